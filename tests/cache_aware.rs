//! Cache-aware endpoint choice (`balance = "cache_aware"`): with local ids on (by their block
//! chains) or off (by the messages' text keys), each turn of a conversation goes to the
//! prefill (and decode) that was sent its earlier turns, another conversation can go
//! elsewhere, load moves a request off a busy holder, and a prompt known by neither (a
//! Responses request) goes least in flight; every choice is counted by source and reason on
//! `/metrics`. A prefiller named by header gets the prefill whatever any pool holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::Duration;

use serde_json::json;
use support::*;

/// A pool's balance key (its blocks are of two tokens below: a one-word prompt is shorter).
const CACHE_AWARE: &str = "balance = \"cache_aware\"\n";

/// Pools `prefill` (the `prefills`) and `decode` (`decode`), both cache-aware with `weights`,
/// and route `pd` between them; the prefill pool's `local` keys (`MODEL` naming `model`).
fn config(prefills: &[&FakeVllm], decode: &FakeVllm, model: &std::path::Path, local: &str, weights: &str) -> String {
    let list = prefills.iter().map(|p| format!("\"{}\"", p.host_port())).collect::<Vec<_>>().join(", ");
    let local = local.replace("MODEL", &format!("{:?}", model.display().to_string()));
    format!(
        "[pools.prefill]\nendpoints = [{list}]\n{local}{CACHE_AWARE}[pools.prefill.cache_aware]\nblock_size = 2\n{weights}\
         [pools.decode]\nendpoints = [\"{}\"]\n{CACHE_AWARE}[pools.decode.cache_aware]\nblock_size = 2\n\
         [[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
        decode.host_port()
    )
}

/// Local ids on and trusted after one match, never rechecked.
const TRUSTED_AFTER_ONE: &str = "local_ids = \"on\"\nlocal_ids_verify_after = 1\nlocal_ids_recheck = 0.0\n";

/// A tokenizer and [`TRUSTED_AFTER_ONE`].
const LOCAL_ON: &str = "tokenizer = MODEL\nlocal_ids = \"on\"\nlocal_ids_verify_after = 1\nlocal_ids_recheck = 0.0\n";

/// Local ids checked against the echo, never sent token-in.
const SHADOW: &str = "tokenizer = MODEL\nlocal_ids = \"shadow\"\n";

/// A tokenizer (and the model folder's chat template), local ids off.
const TOKENIZER_ONLY: &str = "tokenizer = MODEL\n";

/// No tokenizer: the pool knows prompts by their text keys only.
const NO_TOKENIZER: &str = "";

/// The `cache_aware_choices_total` series of `pool` for `source` and `reason`.
fn choices(pool: &str, source: &str, reason: &str) -> String {
    format!(r#"tokenonce_cache_aware_choices_total{{pool="{pool}",reason="{reason}",source="{source}"}}"#)
}

/// Sends completions `prompt` through `proxy` and returns which of `prefills` got its
/// prefill (by index).
async fn send(proxy: &TokenOnce, prefills: &[&FakeVllm], prompt: &str) -> usize {
    let body = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    send_to(proxy, prefills, "/v1/completions", &body).await
}

/// Sends `body` to `path` through `proxy` and returns which of `prefills` got its prefill.
async fn send_to(proxy: &TokenOnce, prefills: &[&FakeVllm], path: &str, body: &serde_json::Value) -> usize {
    let before: Vec<usize> = prefills.iter().map(|p| p.posts().len()).collect();
    let (status, _, text) = post_json(&format!("{}{path}", proxy.url), body, &[]).await;
    assert_eq!(status, 200, "{body}: {text}");
    let got = prefills.iter().zip(&before).filter(|(p, b)| p.posts().len() > **b).count();
    assert_eq!(got, 1, "one prefill per request");
    prefills.iter().zip(&before).position(|(p, b)| p.posts().len() > *b).unwrap()
}

/// A model folder and the fakes: two prefills and a decode, all known healthy by `proxy`.
async fn started(local: &str, weights: &str) -> (tempfile::TempDir, [FakeVllm; 3], TokenOnce) {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    started_in(dir, local, weights).await
}

/// As [`started`], with the model folder `dir` as written.
async fn started_in(
    dir: tempfile::TempDir,
    local: &str,
    weights: &str,
) -> (tempfile::TempDir, [FakeVllm; 3], TokenOnce) {
    let fakes = fakes([FakeConfig::default(), FakeConfig::default(), FakeConfig::default()]).await;
    let [p1, p2, d] = &fakes;
    let proxy = TokenOnce::start(&config(&[p1, p2], d, dir.path(), local, weights)).await;
    for p in [p1, p2] {
        proxy.wait_health("prefill", &p.host_port(), true).await;
    }
    (dir, fakes, proxy)
}

/// Sends `prompt` in the background and waits (bounded) until `prefill` holds it in flight.
async fn held_at(proxy: &TokenOnce, prefill: &FakeVllm, prompt: &str) -> tokio::task::JoinHandle<()> {
    let before = prefill.posts().len();
    let url = format!("{}/v1/completions", proxy.url);
    let body = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    let task = tokio::spawn(async move {
        post_json(&url, &body, &[]).await;
    });
    for _ in 0..500 {
        if prefill.posts().len() > before {
            return task;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the prefill never got {prompt}");
}

/// Turns of one conversation (each repeating the last and adding words) go to one prefill
/// and are counted as prefix choices; a new conversation, held nowhere, goes by rotation (so
/// to the other prefill next); the first request, sent before its shape was trusted, is
/// already picked by its ids; a prompt shorter than a block is counted so.
#[tokio::test(flavor = "multi_thread")]
async fn a_conversation_sticks_to_its_prefill_while_another_goes_elsewhere() {
    let (_dir, [p1, p2, d], proxy) = started(LOCAL_ON, "").await;
    let prefills = [&p1, &p2];
    // Before trust: text with the echo, but both picks by the ids rendered for it.
    send(&proxy, &prefills, "bravo bravo").await;
    proxy.assert_reaches(&choices("prefill", "sent", "no_prefix"), 1.0).await;
    assert_eq!(
        proxy.metric(&choices("decode", "sent", "prefix")).await
            + proxy.metric(&choices("decode", "sent", "no_prefix")).await,
        1.0
    );
    proxy.assert_reaches(r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#, 1.0).await;

    let mut turn = String::from("alpha bravo");
    let home = send(&proxy, &prefills, &turn).await;
    for _ in 0..4 {
        turn.push_str(" alpha bravo bravo");
        assert_eq!(send(&proxy, &prefills, &turn).await, home, "every turn goes where the first went: {turn}");
    }
    assert_eq!(proxy.metric(&choices("prefill", "sent", "prefix")).await, 4.0, "the four later turns");
    assert_eq!(proxy.metric(&choices("decode", "sent", "prefix")).await, 4.0);
    let other = send(&proxy, &prefills, "bravo alpha alpha").await;
    let another = send(&proxy, &prefills, "bravo bravo alpha alpha").await;
    assert!(other != home || another != home, "new conversations rotate");
    assert!(proxy.metric(&choices("prefill", "sent", "no_prefix")).await >= 2.0);

    send(&proxy, &prefills, "alpha").await;
    proxy.assert_reaches(&choices("prefill", "none", "short_prompt"), 1.0).await;
    assert!(d.posts().len() >= 8, "every request was decoded");
}

/// With a load weight of 0.4, a holder of a 4-token turn (blocks of 2) computes one block
/// (2) and each of its requests in flight was charged 2: with two there it costs 2 + 0.4 x 4
/// = 3.6 and keeps the turn against the idle prefill's 4; with three, 2 + 0.4 x 6 = 4.4 loses.
#[tokio::test(flavor = "multi_thread")]
async fn load_moves_a_turn_off_a_busy_holder() {
    let (_dir, [p1, p2, _d], proxy) = started(LOCAL_ON, "load_weight = 0.4\n").await;
    let prefills = [&p1, &p2];
    send(&proxy, &prefills, "bravo bravo").await; // earns the shape's trust
    let turn = "alpha bravo alpha bravo";
    let home = send(&proxy, &prefills, turn).await;
    let (holder, idle) = (prefills[home], prefills[1 - home]);
    holder.configure(|c| c.delay = Duration::from_secs(30));
    let idle_before = idle.posts().len();
    let mut busy = vec![held_at(&proxy, holder, turn).await, held_at(&proxy, holder, turn).await];
    // Two in flight: 3.6 beats the idle one's 4 (held_at fails if it went elsewhere).
    busy.push(held_at(&proxy, holder, turn).await);
    assert_eq!(idle.posts().len(), idle_before);
    // Three: 4.4 loses.
    assert_eq!(send(&proxy, &prefills, turn).await, 1 - home, "the idle prefill took the turn");
    busy.iter().for_each(tokio::task::JoinHandle::abort);
}

/// Every prefill fake delays its answers; one request is sent and held where it landed; the
/// others answer at once again. Returns where it landed and its task.
async fn hold_one(proxy: &TokenOnce, prefills: &[&FakeVllm], prompt: &str) -> (usize, tokio::task::JoinHandle<()>) {
    prefills.iter().for_each(|p| p.configure(|c| c.delay = Duration::from_secs(30)));
    let before: Vec<usize> = prefills.iter().map(|p| p.posts().len()).collect();
    let url = format!("{}/v1/completions", proxy.url);
    let body = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    let task = tokio::spawn(async move {
        post_json(&url, &body, &[]).await;
    });
    for _ in 0..500 {
        if let Some(at) = prefills.iter().zip(&before).position(|(p, b)| p.posts().len() > *b) {
            for (i, p) in prefills.iter().enumerate() {
                if i != at {
                    p.configure(|c| c.delay = Duration::ZERO);
                }
            }
            return (at, task);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no prefill got {prompt}");
}

/// A Responses request has neither local ids nor text keys: each goes to the least loaded
/// prefill, counted `no_ids`.
#[tokio::test(flavor = "multi_thread")]
async fn without_ids_the_least_loaded_prefill_is_chosen() {
    let (_dir, [p1, p2, _d], proxy) = started(NO_TOKENIZER, "").await;
    let prefills = [&p1, &p2];
    let body = json!({"model": "tiny-qwen3", "input": "alpha bravo alpha", "max_output_tokens": 3});
    let (busy_one, busy) = hold_one(&proxy, &prefills, "alpha bravo alpha").await;
    for _ in 0..3 {
        assert_eq!(send_to(&proxy, &prefills, "/v1/responses", &body).await, 1 - busy_one, "the idle one");
    }
    assert_eq!(proxy.metric(&choices("prefill", "none", "no_ids")).await, 3.0);
    assert_eq!(proxy.metric(&choices("prefill", "sent", "prefix")).await, 0.0);
    busy.abort();
}

/// A chat with an image (or a completions prompt given as embeddings) is hashed by vLLM from
/// inputs tokenonce does not have: however often it is sent, no prefix is claimed for it, and
/// each goes to the least loaded prefill, counted `multimodal` (`prompt_embeds`).
#[tokio::test(flavor = "multi_thread")]
async fn media_and_prompt_embeds_go_by_load_and_claim_no_prefix() {
    let (_dir, [p1, p2, _d], proxy) = started("", "").await;
    let prefills = [&p1, &p2];
    let image = json!({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}});
    let content = json!([{"type": "text", "text": "alpha bravo alpha bravo"}, image]);
    let chat = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": content}], "max_tokens": 3});
    let embeds = json!({"model": "tiny-qwen3", "prompt_embeds": "AAAA", "prompt": "alpha", "max_tokens": 3});
    let (busy_one, busy) = hold_one(&proxy, &prefills, "alpha bravo alpha").await;
    for _ in 0..3 {
        assert_eq!(send_to(&proxy, &prefills, "/v1/chat/completions", &chat).await, 1 - busy_one, "the idle one");
        assert_eq!(send_to(&proxy, &prefills, "/v1/completions", &embeds).await, 1 - busy_one, "the idle one");
    }
    assert_eq!(proxy.metric(&choices("prefill", "none", "multimodal")).await, 3.0);
    assert_eq!(proxy.metric(&choices("prefill", "none", "prompt_embeds")).await, 3.0);
    assert_eq!(proxy.metric(&choices("prefill", "text", "prefix")).await, 0.0, "no text prefix claimed");
    busy.abort();
}

/// Without a tokenizer (or with one whose folder has no chat template: a warning at load), a
/// chat conversation's turns go where its earlier messages went (their text keys), counted
/// `source="text"`; a new conversation can go elsewhere.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_tokenizer_a_conversation_sticks_by_its_messages() {
    let no_template = tempfile::tempdir().unwrap();
    write_local_model(no_template.path());
    std::fs::write(no_template.path().join("tokenizer_config.json"), "{}").unwrap();
    for (dir, local) in [(None, NO_TOKENIZER), (Some(no_template), TOKENIZER_ONLY)] {
        let (_dir, [p1, p2, _d], proxy) = match dir {
            None => started(local, "").await,
            Some(dir) => started_in(dir, local, "").await,
        };
        let prefills = [&p1, &p2];
        let url = "/v1/chat/completions";
        let mut messages = vec![json!({"role": "user", "content": "alpha bravo"})];
        let body = |m: &Vec<serde_json::Value>| json!({"model": "tiny-qwen3", "messages": m, "max_tokens": 3});
        let home = send_to(&proxy, &prefills, url, &body(&messages)).await;
        for i in 0..4 {
            messages.push(json!({"role": "assistant", "content": format!("bravo {i}")}));
            messages.push(json!({"role": "user", "content": "alpha"}));
            assert_eq!(send_to(&proxy, &prefills, url, &body(&messages)).await, home, "{local}: turn {i}");
        }
        assert_eq!(proxy.metric(&choices("prefill", "text", "prefix")).await, 4.0, "{local}");
        assert_eq!(proxy.metric(&choices("decode", "text", "prefix")).await, 4.0, "{local}");
        let others: Vec<usize> = new_conversations(&proxy, &prefills, url).await;
        assert!(others.iter().any(|&o| o != home), "{local}: new conversations rotate: {others:?}");
    }
}

/// A pool whose local ids are not trusted (in shadow, or off with a tokenizer) still picks by
/// them from its first request: a conversation's turns stick by their ids (`source="sent"`,
/// no text keys), while every prefill goes as text with the echo. In shadow the ids rendered
/// for the picks are the ones checked against the echo (each check a match); off, none is.
#[tokio::test(flavor = "multi_thread")]
async fn untrusted_local_ids_steer_the_picks_from_the_first_request() {
    for (local, checked) in [(SHADOW, true), (TOKENIZER_ONLY, false)] {
        let (_dir, [p1, p2, _d], proxy) = started(local, "").await;
        let prefills = [&p1, &p2];
        let mut turn = String::from("alpha bravo alpha bravo");
        let home = send(&proxy, &prefills, &turn).await;
        for _ in 0..4 {
            turn.push_str(" alpha bravo bravo");
            assert_eq!(send(&proxy, &prefills, &turn).await, home, "{local}: {turn}");
        }
        assert_eq!(proxy.metric(&choices("prefill", "sent", "prefix")).await, 4.0, "{local}");
        assert_eq!(proxy.metric(&choices("prefill", "text", "prefix")).await, 0.0, "{local}");
        let prefilled: Vec<serde_json::Value> = prefills[home].posts().iter().map(|p| p.json()).collect();
        assert!(prefilled.iter().all(|b| b["prompt"].is_string()), "{local}: every prefill as text");
        let checks = r#"tokenonce_local_ids_checks_total{pool="prefill",result="match",shape="completions"}"#;
        if checked {
            proxy.assert_reaches(checks, 5.0).await;
        } else {
            assert!(!proxy.metrics().await.contains("tokenonce_local_ids_checks_total{"), "off: nothing checked");
        }
    }
}

/// Two new one-message conversations, held nowhere: where each went.
async fn new_conversations(proxy: &TokenOnce, prefills: &[&FakeVllm], url: &str) -> Vec<usize> {
    let mut went = Vec::new();
    for word in ["charlie", "delta"] {
        let body = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": word}], "max_tokens": 3});
        went.push(send_to(proxy, prefills, url, &body).await);
    }
    went
}

/// A route whose prefiller is named by `x-prefiller-host-port` sends every turn there, while
/// its cache-aware decode pool still chooses by the turns' text (counted).
#[tokio::test(flavor = "multi_thread")]
async fn a_prefiller_named_by_header_wins() {
    let [p1, p2, d] = fakes([FakeConfig::default(), FakeConfig::default(), FakeConfig::default()]).await;
    let text = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n{CACHE_AWARE}[[routes]]\nname = \"llmd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }}\n",
        d.host_port()
    );
    let proxy = TokenOnce::start(&text).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let mut messages = vec![json!({"role": "user", "content": "alpha bravo"})];
    for _ in 0..3 {
        let body = json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 3});
        let (status, _, answer) = post_json(&url, &body, &[("x-prefiller-host-port", &p2.host_port())]).await;
        assert_eq!(status, 200, "{answer}");
        messages.push(json!({"role": "assistant", "content": "bravo"}));
        messages.push(json!({"role": "user", "content": "alpha"}));
    }
    assert_eq!((p1.posts().len(), p2.posts().len()), (0, 3), "every prefill went to the named one");
    proxy.assert_reaches(&choices("decode", "text", "prefix"), 2.0).await;
}

/// `conf/kv-aware.toml` with its loopback engines replaced by `prefills` and `decode`, its
/// events ports by theirs, its model folder by `model`, and local ids trusted after one match
/// (the file's own `[server]` gives way to the harness's listeners). Every replaced piece must
/// be in the file: an example that changes shape fails here until this follows it.
fn shipped_kv_aware(prefills: &[&FakeVllm], decode: &FakeVllm, model: &std::path::Path, ports: (u16, u16)) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/kv-aware.toml");
    let mut text = std::fs::read_to_string(path).unwrap();
    let list = prefills.iter().map(|p| format!("\"{}\"", p.host_port())).collect::<Vec<_>>().join(", ");
    let replacements = [
        ("[server]\nlisten = \"127.0.0.1:8000\"\nadmin_listen = \"127.0.0.1:9000\"\n", String::new()),
        ("[\"127.0.0.1:8100#0-1\"]", format!("[{list}]")),
        ("[\"127.0.0.1:8200\"]", format!("[\"{}\"]", decode.host_port())),
        ("\"/models/Qwen3-0.6B\"", format!("{:?}", model.display().to_string())),
        ("local_ids = \"on\"\n", TRUSTED_AFTER_ONE.to_owned()),
        ("port = 5557 ", format!("port = {} ", ports.0)),
        ("replay_port = 5567 ", format!("replay_port = {} ", ports.1)),
    ];
    for (from, to) in replacements {
        assert!(text.contains(from), "conf/kv-aware.toml no longer has {from:?}");
        text = text.replacen(from, &to, 1);
    }
    text
}

/// The shipped `conf/kv-aware.toml` running as written but for its addresses: two prefill
/// fakes on 127.0.0.2 and .3 that keep a prefix cache (the file's 32-token blocks, hashed with
/// its seed) and publish what they store as vLLM's KV events on the file's one port, and a
/// decode; the completions shape already trusted.
struct ShippedKvAware {
    _dir: tempfile::TempDir,
    engines: [std::sync::Arc<support::kv_engine::KvEngine>; 2],
    prefills: Vec<FakeVllm>,
    _decode: FakeVllm,
    proxy: TokenOnce,
}

impl ShippedKvAware {
    async fn start() -> Self {
        use support::kv_engine::{KvEngine, KvEngineConfig};
        let dir = tempfile::tempdir().unwrap();
        write_local_model(dir.path());
        let engine = KvEngineConfig::instant(32, 10_000);
        let (e1, port, replay) = KvEngine::publishing(engine.clone(), "127.0.0.2", 0, 0, "kv").await;
        let (e2, _, _) = KvEngine::publishing(engine, "127.0.0.3", port, replay, "kv").await;
        let mut prefills = Vec::new();
        for (host, e) in [("127.0.0.2", &e1), ("127.0.0.3", &e2)] {
            let config = FakeConfig { kv_engine: Some(std::sync::Arc::clone(e)), ..FakeConfig::default() };
            prefills.push(FakeVllm::start_at(format!("{host}:0").parse().unwrap(), config).await.unwrap());
        }
        let decode = FakeVllm::start(FakeConfig::default()).await;
        let refs: Vec<&FakeVllm> = prefills.iter().collect();
        let proxy = TokenOnce::start(&shipped_kv_aware(&refs, &decode, dir.path(), (port, replay))).await;
        for p in &refs {
            proxy.wait_health("prefill", &p.host_port(), true).await;
        }
        send(&proxy, &refs, "bravo bravo").await; // earns the completions shape's trust
        proxy.assert_reaches(r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#, 1.0).await;
        ShippedKvAware { _dir: dir, engines: [e1, e2], prefills, _decode: decode, proxy }
    }
}

/// The shipped `conf/kv-aware.toml` runs as written but for its addresses: two prefill fakes
/// on their own loopback addresses keep a prefix cache (blocks of the file's 32 tokens, hashed
/// with its seed) and publish what they store as vLLM's KV events over ZeroMQ on one port,
/// as the file's pool expects; each turn of a conversation goes where the events say its
/// earlier turns are held (`source="events"`), and every published hash checks out.
#[tokio::test(flavor = "multi_thread")]
async fn the_shipped_kv_aware_example_follows_the_engines_kv_events() {
    let shipped = ShippedKvAware::start().await;
    let ([e1, e2], proxy) = (&shipped.engines, &shipped.proxy);
    let prefills: Vec<&FakeVllm> = shipped.prefills.iter().collect();

    let blocks = || (e1.blocks() + e2.blocks()) as f64;
    let mut turn = "alpha bravo ".repeat(20); // 40 tokens: one full block
    let home = send(proxy, &prefills, &turn).await;
    for _ in 0..3 {
        proxy.assert_reaches(r#"tokenonce_kv_blocks{pool="prefill"}"#, blocks()).await;
        turn.push_str(&"bravo alpha alpha ".repeat(12));
        assert_eq!(send(proxy, &prefills, &turn).await, home, "every turn goes where its blocks are held");
    }
    assert_eq!(proxy.metric(&choices("prefill", "events", "prefix")).await, 3.0);
    assert_eq!([&e1, &e2][home].blocks(), turn.split_whitespace().count() / 32);
    proxy.assert_reaches(r#"tokenonce_kv_hash_checks_total{pool="prefill",result="match"}"#, blocks()).await;
    assert_eq!(proxy.metric(r#"tokenonce_kv_hash_checks_total{pool="prefill",result="mismatch"}"#).await, 0.0);
}

/// An engine's replay endpoint that leaves a subscriber's first ask unanswered (a busy engine,
/// or a buffer too long to read in time) is asked again a second later: the blocks it stored
/// before tokenonce subscribed (a shared system prompt's, which no later request stores again)
/// come back, and what came live meanwhile stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_left_unanswered_is_asked_again() {
    use support::kv_engine::{KvEngine, KvEngineConfig};
    use tokenonce::kv::events::{PoolKvEvents, Settings};
    use tokenonce::kv::hash::{BlockHasher, ExtraKeys};
    use tokenonce::kv::PrefixHolders;
    let engine = KvEngineConfig::instant(4, 1000);
    let (engine, port, replay_port) = KvEngine::publishing(engine, "127.0.0.1", 0, 0, "kv").await;
    engine.leave_replays_unanswered(1);
    let system: Vec<u32> = (0..16).collect();
    engine.prefill(&system).await; // 4 blocks, published before anyone subscribed
    until("the engine published them", || engine.published() == 1).await;

    let settings = Settings {
        port,
        replay_port: Some(replay_port),
        endpoint_ports: Default::default(),
        endpoint_replay_ports: Default::default(),
        topic: "kv".into(),
        hash_seed: "0".into(),
        block_size: 4,
        max_blocks: 10_000,
        fixed_bound: true,
        stale_after: Duration::from_secs(60),
    };
    let registry = prometheus::Registry::new();
    let metrics = tokenonce::kv::metrics::KvMetrics::register(&registry).unwrap().pool("prefill");
    let endpoint = "127.0.0.1:8000";
    let kv = PoolKvEvents::start(
        "prefill",
        &[endpoint.to_owned()],
        settings,
        metrics.clone(),
        &tokio::runtime::Handle::current(),
    )
    .unwrap();
    let hasher = BlockHasher::new("0", 4);
    let held = |ids: &[u32]| kv.held(endpoint, &hasher.chain(ids, &ExtraKeys::default()));
    until("the first replay failed", || metrics.replays_failed.get() == 1).await;
    assert_eq!(held(&system), 0, "the unanswered replay brought nothing");
    let turn: Vec<u32> = (100..108).collect();
    engine.prefill(&turn).await;
    until("the system prompt's blocks, by the replay asked again", || held(&system) == 4).await;
    assert_eq!(held(&turn), 2, "what came live is kept");
    assert_eq!(metrics.replays_failed.get(), 1);
    assert!(metrics.replays.get() >= 2, "asked twice: {}", metrics.replays.get());
}

/// A prefill that goes down (its `/health` fails) has lost its cache: tokenonce drops what its
/// KV events said it held (`tokenonce_kv_blocks` falls to the other prefill's, none), so when
/// it comes back restarted, empty, before any event could say so, the next turn of the
/// conversation it held is predicted held nowhere (`reason="no_prefix"`) instead of sent there
/// for blocks it no longer has.
#[tokio::test(flavor = "multi_thread")]
async fn a_prefill_that_went_down_stops_attracting_its_conversations() {
    let shipped = ShippedKvAware::start().await;
    let ([e1, e2], proxy) = (&shipped.engines, &shipped.proxy);
    let prefills: Vec<&FakeVllm> = shipped.prefills.iter().collect();

    let engines = [&e1, &e2];
    let blocks = || (e1.blocks() + e2.blocks()) as f64;
    let mut turn = "alpha bravo ".repeat(20); // 40 tokens: one full block
    let home = send(proxy, &prefills, &turn).await;
    proxy.assert_reaches(r#"tokenonce_kv_blocks{pool="prefill"}"#, blocks()).await;
    turn.push_str(&"bravo alpha alpha ".repeat(12));
    assert_eq!(send(proxy, &prefills, &turn).await, home, "held there: the turn follows");
    proxy.assert_reaches(r#"tokenonce_kv_blocks{pool="prefill"}"#, blocks()).await;
    assert_eq!(proxy.metric(&choices("prefill", "events", "prefix")).await, 1.0);
    let no_prefix = proxy.metric(&choices("prefill", "events", "no_prefix")).await;

    // Down, then back restarted: its cache is empty and no event said so.
    prefills[home].configure(|c| c.healthy = false);
    proxy.wait_health("prefill", &prefills[home].host_port(), false).await;
    let other = 1 - home;
    proxy.assert_reaches(r#"tokenonce_kv_blocks{pool="prefill"}"#, engines[other].blocks() as f64).await;
    engines[home].restart();
    prefills[home].configure(|c| c.healthy = true);
    proxy.wait_health("prefill", &prefills[home].host_port(), true).await;

    turn.push_str(&"alpha alpha bravo ".repeat(12));
    send(proxy, &prefills, &turn).await;
    assert_eq!(proxy.metric(&choices("prefill", "events", "no_prefix")).await, no_prefix + 1.0, "held nowhere now");
    assert_eq!(proxy.metric(&choices("prefill", "events", "prefix")).await, 1.0, "not predicted at the old home");
    assert_eq!(proxy.metric(r#"tokenonce_kv_hash_checks_total{pool="prefill",result="mismatch"}"#).await, 0.0);
}
