//! The prefill decision (`prefill.skip_below_tokens`): a turn whose history the chosen decode
//! already holds, by its KV events, goes to that decode alone, token-in, with no prefill leg;
//! a turn it lacks more of goes P/D; a decode alone that fails before answering is retried
//! P/D on another decode; every decision counted by reason. The decodes are fakes keeping a
//! prefix cache (blocks of 32 tokens, vLLM's hashes) and publishing it as vLLM's KV events
//! over ZeroMQ.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::Arc;

use serde_json::json;
use support::kv_engine::{KvEngine, KvEngineConfig};
use support::*;

/// A prefill fake, two decode fakes on 127.0.0.2 and .3 (one port, as a pool of pods) that
/// keep a prefix cache and publish it, and tokenonce with the completions shape trusted.
struct Stack {
    _dir: tempfile::TempDir,
    prefill: FakeVllm,
    decodes: Vec<FakeVllm>,
    engines: Vec<Arc<KvEngine>>,
    proxy: TokenOnce,
}

/// The series of `decision` and `reason` on route `pd`.
fn decisions(decision: &str, reason: &str) -> String {
    format!(r#"tokenonce_prefill_decisions_total{{decision="{decision}",reason="{reason}",route="pd"}}"#)
}

impl Stack {
    /// `skip` is the route's `skip_below_tokens`; `decodes` how many decode fakes (1 or 2).
    async fn start(skip: u64, decodes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        write_local_model(dir.path());
        let engine = KvEngineConfig::instant(32, 10_000);
        let (first, port, replay) = KvEngine::publishing(engine.clone(), "127.0.0.2", 0, 0, "kv").await;
        let mut engines = vec![first];
        if decodes > 1 {
            engines.push(KvEngine::publishing(engine, "127.0.0.3", port, replay, "kv").await.0);
        }
        let mut fakes = Vec::new();
        for (host, e) in ["127.0.0.2", "127.0.0.3"].iter().zip(&engines) {
            let config = FakeConfig { kv_engine: Some(Arc::clone(e)), ..FakeConfig::default() };
            fakes.push(FakeVllm::start_at(format!("{host}:0").parse().unwrap(), config).await.unwrap());
        }
        // A prefill running vLLM's NixlConnector: its answer carries `kv_transfer_params`.
        let prefill = FakeVllm::start(FakeConfig { connector: true, ..FakeConfig::default() }).await;
        let list = fakes.iter().map(|d| format!("\"{}\"", d.host_port())).collect::<Vec<_>>().join(", ");
        let config = format!(
            "[pools.prefill]\nendpoints = [\"{}\"]\ntokenizer = {:?}\nlocal_ids = \"on\"\nlocal_ids_verify_after = 1\n\
             local_ids_recheck = 0.0\n\
             [pools.decode]\nendpoints = [{list}]\nbalance = \"cache_aware\"\n\
             [pools.decode.cache_aware]\nblock_size = 32\nhash_seed = \"0\"\n\
             [pools.decode.kv_events]\nport = {port}\nreplay_port = {replay}\ntopic = \"kv\"\nblock_size = 32\nhash_seed = \"0\"\n\
             [[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\n\
             prefill = {{ pool = \"prefill\", skip_below_tokens = {skip} }}\n",
            prefill.host_port(),
            dir.path().display().to_string(),
        );
        let proxy = TokenOnce::start(&config).await;
        proxy.wait_health("prefill", &prefill.host_port(), true).await;
        for d in &fakes {
            proxy.wait_health("decode", &d.host_port(), true).await;
        }
        let stack = Stack { _dir: dir, prefill, decodes: fakes, engines, proxy };
        stack.send("bravo bravo").await; // earns the completions shape's trust
        stack.proxy.assert_reaches(r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#, 1.0).await;
        stack
    }

    /// Sends completions `prompt`, checks the answer is a whole completion, and returns
    /// whether a prefill leg ran.
    async fn send(&self, prompt: &str) -> bool {
        let before = self.prefill.posts().len();
        let body = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
        let (status, _, text) = post_json(&format!("{}/v1/completions", self.proxy.url), &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["object"], "text_completion", "{text}");
        self.prefill.posts().len() > before
    }

    /// A conversation's first turn, 40 tokens (one full block and 8), sent P/D and held by its
    /// decode (the events caught up): what the next turn extends.
    async fn held_first_turn(&self) -> String {
        let turn = "alpha bravo ".repeat(20);
        assert!(self.send(&turn).await, "the first turn has its prefill");
        self.events_caught_up().await;
        turn
    }

    /// Waits until tokenonce's index of the decodes' events holds every block they stored.
    async fn events_caught_up(&self) {
        let blocks: usize = self.engines.iter().map(|e| e.blocks()).sum();
        self.proxy.assert_reaches(r#"tokenonce_kv_blocks{pool="decode"}"#, blocks as f64).await;
    }
}

/// A conversation's first turn goes P/D (its decode holds nothing of it); its next turn, a few
/// tokens past the blocks that decode now holds, goes to that decode alone: token-in with
/// tokenonce's ids, no `kv_transfer_params` beyond them, no prefill leg; a turn that adds more
/// than the threshold goes P/D again. Counted by reason, the tokens lacked observed.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_the_decode_already_holds_skips_the_prefill() {
    let stack = Stack::start(16, 1).await;
    let proxy = &stack.proxy;
    assert_eq!(proxy.metric(&decisions("prefill", "no_local_ids")).await, 1.0, "the first, untrusted request");

    let mut turn = "alpha bravo ".repeat(20); // 40 tokens: one full block and 8
    assert!(stack.send(&turn).await, "the decode holds nothing yet");
    assert_eq!(proxy.metric(&decisions("prefill", "over_threshold")).await, 1.0);
    stack.events_caught_up().await;

    turn.push_str("bravo alpha alpha bravo"); // 44 tokens: 12 past the held block
    let decode = &stack.decodes[0];
    let posts = decode.posts().len();
    assert!(!stack.send(&turn).await, "12 tokens lacking, threshold 16: no prefill leg");
    assert_eq!(proxy.metric(&decisions("decode_alone", "under_threshold")).await, 1.0);
    let sent = decode.posts()[posts].json();
    assert_eq!(sent["prompt"].as_array().map(Vec::len), Some(44), "token-in with the local ids: {sent}");
    assert!(sent.get("kv_transfer_params").is_none(), "no remote prefill asked: {sent}");
    assert_eq!(proxy.metric(r#"tokenonce_prefill_decode_lacking_tokens_count{route="pd"}"#).await, 2.0);
    assert_eq!(proxy.metric(r#"tokenonce_prefill_decode_lacking_tokens_sum{route="pd"}"#).await, 40.0 + 12.0);
    assert_eq!(proxy.metric(r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#).await, 3.0);

    stack.events_caught_up().await;
    turn.push_str(&" alpha".repeat(30)); // 74 tokens, 32 held: 42 lacking
    assert!(stack.send(&turn).await, "over the threshold: P/D");
    assert_eq!(proxy.metric(&decisions("prefill", "over_threshold")).await, 2.0);
}

/// With `skip_below_tokens = 0`, every request goes P/D, counted `off`, whatever the decode
/// holds.
#[tokio::test(flavor = "multi_thread")]
async fn zero_turns_it_off_every_turn_gets_its_prefill() {
    let stack = Stack::start(0, 1).await;
    let mut turn = stack.held_first_turn().await;
    turn.push_str("bravo");
    assert!(stack.send(&turn).await, "off: the prefill runs");
    assert_eq!(stack.proxy.metric(&decisions("prefill", "off")).await, 3.0);
    assert_eq!(stack.proxy.metric(&decisions("decode_alone", "under_threshold")).await, 0.0);
}

/// The decode alone answers 503 before any byte: the request is retried P/D on the other
/// decode (never the same engine twice), and the client gets its answer; counted both ways.
/// With no other decode, the failure is the answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_alone_that_fails_is_retried_with_a_prefill_elsewhere() {
    let stack = Stack::start(16, 2).await;
    let proxy = &stack.proxy;
    // 96 tokens, three full blocks: held, they outweigh computing them on the other decode.
    let mut turn = "alpha bravo ".repeat(48);
    let before: Vec<usize> = stack.decodes.iter().map(|d| d.posts().len()).collect();
    assert!(stack.send(&turn).await);
    let holder = stack.decodes.iter().zip(&before).position(|(d, b)| d.posts().len() > *b).unwrap();
    stack.events_caught_up().await;

    stack.decodes[holder].configure(|c| c.fail_with = Some((503, r#"{"error":"engine busy"}"#.into())));
    let other = &stack.decodes[1 - holder];
    let posts = other.posts().len();
    turn.push_str("bravo alpha");
    assert!(stack.send(&turn).await, "retried with a prefill");
    assert_eq!(proxy.metric(&decisions("decode_alone", "under_threshold")).await, 1.0);
    assert_eq!(proxy.metric(&decisions("prefill", "decode_alone_failed")).await, 1.0);
    let sent = other.posts()[posts].json();
    assert!(sent["kv_transfer_params"].is_object(), "the other decode got the prefill's handoff: {sent}");
    assert_eq!(
        proxy.metric(r#"tokenonce_token_reuse_total{reason="none",result="decode_failed",route="pd"}"#).await,
        1.0
    );
}

/// A decode alone that fails with no other decode to retry on: its failure is relayed as the
/// engine gave it (vLLM's 503 and body), as any decode failure is.
#[tokio::test(flavor = "multi_thread")]
async fn with_one_decode_a_failed_decode_alone_is_answered() {
    let stack = Stack::start(16, 1).await;
    let mut turn = stack.held_first_turn().await;
    stack.decodes[0].configure(|c| c.fail_with = Some((503, r#"{"error":"engine busy"}"#.into())));
    turn.push_str("bravo");
    let prefills = stack.prefill.posts().len();
    let body = json!({"model": "tiny-qwen3", "prompt": turn, "max_tokens": 3});
    let (status, _, text) = post_json(&format!("{}/v1/completions", stack.proxy.url), &body, &[]).await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(stack.prefill.posts().len(), prefills, "not retried on the same engine");
    assert_eq!(stack.proxy.metric(&decisions("prefill", "decode_alone_failed")).await, 0.0);
}

/// The decode lost what tokenonce believed it held (a restart its events have not said yet):
/// the decode alone computes the whole prompt itself, slower than predicted, and answers as
/// ever; nothing breaks.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_that_lost_the_history_computes_it_and_answers() {
    let stack = Stack::start(16, 1).await;
    let mut turn = stack.held_first_turn().await;
    let engine = &stack.engines[0];
    engine.restart(); // its cache emptied, no event published
    let cached = engine.cached_tokens();
    turn.push_str("bravo alpha");
    assert!(!stack.send(&turn).await, "decided on what the events said: the decode alone");
    assert_eq!(stack.proxy.metric(&decisions("decode_alone", "under_threshold")).await, 1.0);
    assert_eq!(engine.cached_tokens(), cached, "nothing was cached: the decode computed all 42 tokens");
    assert_eq!(engine.blocks(), 1, "and holds the prompt's block again");
}

/// The decode has room for what it computes alone up to the threshold: a turn arriving while
/// another computes alone there, together lacking more than the threshold, goes P/D (counted
/// `decode_busy`); once the first answers, the room is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_computing_a_turn_alone_sends_the_next_to_the_prefill() {
    let stack = Arc::new(Stack::start(16, 1).await);
    let base = stack.held_first_turn().await; // the decode holds one block

    let decode = &stack.decodes[0];
    decode.configure(|c| c.delay = std::time::Duration::from_millis(1500));
    let posts = decode.posts().len();
    let first = {
        let stack = Arc::clone(&stack);
        let turn = format!("{base}bravo alpha alpha bravo"); // 12 lacking
        tokio::spawn(async move { stack.send(&turn).await })
    };
    for _ in 0..500 {
        if decode.posts().len() > posts {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(decode.posts().len() > posts, "the decode got the first turn within 5 s");
    let second = format!("{base}alpha"); // 9 lacking: 21 with the first's 12, over 16
    assert!(stack.send(&second).await, "no room on the decode: a prefill leg");
    first.await.unwrap(); // answered (its prefill count is the second's: they overlap)
    let proxy = &stack.proxy;
    assert_eq!(proxy.metric(&decisions("decode_alone", "under_threshold")).await, 1.0);
    assert_eq!(proxy.metric(&decisions("prefill", "decode_busy")).await, 1.0);

    decode.configure(|c| c.delay = std::time::Duration::ZERO);
    assert!(!stack.send(&second).await, "the first answered: room again, the decode alone");
    assert_eq!(proxy.metric(&decisions("decode_alone", "under_threshold")).await, 2.0);
}

/// A decode whose engine reports requests waiting (its `/metrics`, read on the health round)
/// gets no prompt to compute alone: the turn goes P/D, counted `decode_busy`, until its queue
/// is empty again.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_whose_engine_queues_gets_the_prefill_leg() {
    let stack = Stack::start(16, 1).await;
    let mut turn = stack.held_first_turn().await;

    let decode = &stack.decodes[0];
    let waiting = format!(r#"tokenonce_engine_requests_waiting{{endpoint="{}",pool="decode"}}"#, decode.host_port());
    decode.configure(|c| c.metrics_page = Some(metrics_page(&[("3", "8", "0.2")])));
    stack.proxy.assert_reaches(&waiting, 3.0).await;
    turn.push_str("bravo alpha");
    assert!(stack.send(&turn).await, "its engine queues: a prefill leg");
    assert_eq!(stack.proxy.metric(&decisions("prefill", "decode_busy")).await, 1.0);

    decode.configure(|c| c.metrics_page = Some(metrics_page(&[("0", "8", "0.2")])));
    stack.proxy.assert_reaches(&waiting, 0.0).await;
    assert!(!stack.send(&turn).await, "its queue empty: the decode alone");
    assert_eq!(stack.proxy.metric(&decisions("decode_alone", "under_threshold")).await, 1.0);
}
