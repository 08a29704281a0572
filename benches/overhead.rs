//! Overhead benchmark: the latency tokenonce adds over calling the engines directly, measured
//! against two in-process fake vLLM engines (`tests/support/fake_vllm.rs`) at a ~1k-token and
//! a ~37k-token chat prompt.
//!
//! Run: `cargo bench --bench overhead` (options after `--`: `--runs N` measured rounds per
//! prompt size, default 100; `--warmup N`, default 5; `--max-seconds S`, the measuring
//! budget, default 150). `cargo bench` builds this file and the `tokenonce` binary with the
//! bench profile (= release) into `target/release/`, and the bench runs that binary
//! (`CARGO_BIN_EXE_tokenonce`, so it is never stale; `TOKENONCE_BIN=path` runs another build,
//! one recent enough to log its bound addresses in a `tokenonce listening` line) as a separate
//! process, started by the tests' harness (`tests/support/harness.rs`, `TokenOnce::spawn`) on
//! port-0 listeners.
//!
//! Each prompt size gets fresh fakes and a fresh tokenonce (the fakes keep every request
//! body, so this bounds memory, about 0.6 GB at the default 100 rounds, and gives a peak RSS
//! per size). Variants, interleaved (every
//! round runs each once, in a freshly shuffled order) so machine noise hits all alike, each
//! non-streamed and streamed:
//! - (a) direct: client → fake decode, the plain chat request;
//! - (b) direct P then D: client → fake prefill (`max_tokens: 1`, `return_token_ids`, not
//!   streamed), then client → fake decode with the echoed ids in
//!   `kv_transfer_params.prompt_token_ids`: a zero-cost orchestrator (the bench's own handoff
//!   work between the legs is excluded from the time, and reported separately);
//! - (c) through tokenonce (orchestrate, token reuse on).
//!
//! Times are client-side wall clock on one keep-alive `reqwest` client: non-streamed from
//! sending the request to the last body byte; streamed time to first byte = to the first body
//! chunk. Everything is on 127.0.0.1; every loop is bounded in count and time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use support::{fmt_num, fmt_signed, pd_config, words, FakeConfig, FakeVllm, Settings, TokenOnce};

/// User-message sizes in words (the fake tokenizer: one token per whitespace-separated word).
const PROMPT_WORDS: [usize; 2] = [1_000, 37_000];
/// `max_tokens` of every measured request.
const MAX_TOKENS: u64 = 16;
/// A gap between two body chunks longer than this counts as a delayed-ACK stall.
const STALL_MS: f64 = 30.0;
/// Delay between SSE events in the streaming relay check.
const CHECK_CHUNK_DELAY: Duration = Duration::from_millis(5);

struct Options {
    runs: usize,
    warmup: usize,
    max_seconds: u64,
    user_args: Vec<String>,
}

fn parse_options() -> Options {
    let mut o = Options { runs: 100, warmup: 5, max_seconds: 150, user_args: Vec::new() };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name} needs a non-negative integer"))
        };
        match arg.as_str() {
            "--bench" => continue, // added by `cargo bench`
            "--runs" => {
                let n = value("--runs");
                o.runs = usize::try_from(n).unwrap().max(1);
                o.user_args.extend(["--runs".into(), n.to_string()]);
            }
            "--warmup" => {
                let n = value("--warmup");
                o.warmup = usize::try_from(n).unwrap();
                o.user_args.extend(["--warmup".into(), n.to_string()]);
            }
            "--max-seconds" => {
                let n = value("--max-seconds");
                o.max_seconds = n.max(1);
                o.user_args.extend(["--max-seconds".into(), n.to_string()]);
            }
            other => eprintln!("overhead: ignoring unknown argument {other:?}"),
        }
    }
    o
}

fn git(args: &[&str]) -> String {
    Command::new("git")
        .arg("-C")
        .arg(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// The tokenonce binary: `TOKENONCE_BIN`, else the one `cargo bench` just built; built with
/// `cargo build --release --bin tokenonce` if it is somehow missing.
fn tokenonce_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("TOKENONCE_BIN") {
        return PathBuf::from(path);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_tokenonce"));
    if built.exists() {
        return built;
    }
    let fallback = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/tokenonce");
    if !fallback.exists() {
        println!("(tokenonce binary missing: running `cargo build --release --bin tokenonce`)");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "--bin", "tokenonce"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build");
        assert!(status.success(), "cargo build --release failed");
    }
    fallback
}

/// `(VmHWM, VmRSS)` in KiB from `/proc/PID/status`.
fn proc_memory_kib(pid: u32) -> (Option<u64>, Option<u64>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok()))
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

/// The request bodies of one prompt size, serialized once.
struct Prompt {
    plain: Bytes,
    plain_stream: Bytes,
    prefill: Bytes,
}

impl Prompt {
    fn new(words_n: usize) -> Self {
        let user = words(words_n, 0x9E37_79B9_7F4A_7C15 ^ words_n as u64);
        let body = |extra: Value| {
            let mut b = json!({
                "model": "tiny-qwen3",
                "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0
            });
            for (k, v) in extra.as_object().unwrap() {
                b.as_object_mut().unwrap().insert(k.clone(), v.clone());
            }
            Bytes::from(serde_json::to_vec(&b).unwrap())
        };
        Self {
            plain: body(json!({})),
            plain_stream: body(json!({"stream": true})),
            // The prefill leg as tokenonce shapes it (docs/concepts.md "How a request flows", step 1).
            prefill: body(json!({
                "max_tokens": 1,
                "stream": false,
                "return_token_ids": true,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                    "remote_block_ids": null, "remote_host": null, "remote_port": null}
            })),
        }
    }
}

#[derive(serde::Deserialize)]
struct PrefillEcho<'a> {
    #[serde(borrow)]
    prompt_token_ids: &'a RawValue,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    usage: Usage,
}

#[derive(serde::Deserialize)]
struct Usage {
    prompt_tokens: u64,
}

/// The zero-cost orchestrator's handoff: `plain` + `kv_transfer_params` = the prefill's kv
/// params with `prompt_token_ids` inside, spliced as bytes. Returns the body and the number of
/// prompt tokens.
fn handoff_body(plain: &[u8], prefill_response: &[u8]) -> (Bytes, u64) {
    let echo: PrefillEcho<'_> = serde_json::from_slice(prefill_response).unwrap_or_else(|e| {
        panic!(
            "prefill answer without ids ({e}): {}",
            String::from_utf8_lossy(&prefill_response[..prefill_response.len().min(300)])
        )
    });
    let ids = echo.prompt_token_ids.get();
    assert!(ids.starts_with('['), "prefill echoed no ids: {ids:.100}");
    let mut kv = match echo.kv_transfer_params.map(RawValue::get) {
        Some(raw) if raw.ends_with('}') && raw != "{}" => {
            let mut s = raw.to_owned();
            s.pop();
            s.push(',');
            s
        }
        _ => "{".to_owned(),
    };
    kv.push_str("\"prompt_token_ids\":");
    kv.push_str(ids);
    kv.push('}');
    let end = plain.iter().rposition(|&b| b == b'}').unwrap();
    let mut body = Vec::with_capacity(plain.len() + kv.len() + 32);
    body.extend_from_slice(&plain[..end]);
    body.extend_from_slice(b",\"kv_transfer_params\":");
    body.extend_from_slice(kv.as_bytes());
    body.push(b'}');
    (Bytes::from(body), echo.usage.prompt_tokens)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Direct,
    DirectPd,
    Tokenonce,
}

impl Via {
    fn letter(self) -> &'static str {
        match self {
            Self::Direct => "a",
            Self::DirectPd => "b",
            Self::Tokenonce => "c",
        }
    }
}

const VARIANTS: [(Via, bool); 6] = [
    (Via::Direct, false),
    (Via::DirectPd, false),
    (Via::Tokenonce, false),
    (Via::Direct, true),
    (Via::DirectPd, true),
    (Via::Tokenonce, true),
];

fn variant_index(via: Via, stream: bool) -> usize {
    VARIANTS.iter().position(|&v| v == (via, stream)).unwrap()
}

/// One HTTP exchange, times in ms from just before sending.
struct Exchange {
    first: f64,
    total: f64,
    /// Largest gap between two body chunks.
    max_gap: f64,
    body: Bytes,
}

/// One timed request (or P-then-D pair).
struct Sample {
    /// To the last body byte.
    total: f64,
    /// To the first body chunk (streamed only).
    ttfb: Option<f64>,
    max_gap: f64,
    /// (b) only: the prefill leg, the decode leg to first chunk, the bench's own handoff work
    /// (excluded from `total`/`ttfb`).
    legs: Option<[f64; 3]>,
    body: Bytes,
    decode_bytes: usize,
    prompt_tokens: Option<u64>,
}

struct Bench {
    client: reqwest::Client,
    prefill_url: String,
    decode_url: String,
    proxy_url: String,
}

impl Bench {
    async fn post(&self, url: &str, body: Bytes, request_id: &str) -> Exchange {
        let started = Instant::now();
        let mut resp = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("x-request-id", request_id)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = resp.status();
        let mut first = None;
        let mut last = started.elapsed();
        let mut max_gap = Duration::ZERO;
        let mut all = Vec::new();
        // Bounded: the client's 60 s timeout covers the body too.
        while let Some(chunk) = resp.chunk().await.unwrap_or_else(|e| panic!("POST {url}: body: {e}")) {
            let now = started.elapsed();
            if first.is_some() {
                max_gap = max_gap.max(now - last);
            }
            first.get_or_insert(now);
            last = now;
            all.extend_from_slice(&chunk);
        }
        let total = started.elapsed();
        let body = Bytes::from(all);
        assert!(status.is_success(), "POST {url}: {status}: {}", String::from_utf8_lossy(&body[..body.len().min(500)]));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Exchange { first: ms(first.unwrap_or(total)), total: ms(total), max_gap: ms(max_gap), body }
    }

    async fn run(&self, prompt: &Prompt, via: Via, stream: bool, request_id: &str) -> Sample {
        let plain = if stream { &prompt.plain_stream } else { &prompt.plain };
        let url = match via {
            Via::Direct => &self.decode_url,
            Via::Tokenonce => &self.proxy_url,
            Via::DirectPd => {
                let p = self.post(&self.prefill_url, prompt.prefill.clone(), request_id).await;
                let handoff_started = Instant::now();
                let (decode, tokens) = handoff_body(plain, &p.body);
                let handoff = handoff_started.elapsed().as_secs_f64() * 1e3;
                let decode_bytes = decode.len();
                let d = self.post(&self.decode_url, decode, request_id).await;
                return Sample {
                    total: p.total + d.total,
                    ttfb: stream.then_some(p.total + d.first),
                    max_gap: d.max_gap,
                    legs: Some([p.total, d.first, handoff]),
                    body: d.body,
                    decode_bytes,
                    prompt_tokens: Some(tokens),
                };
            }
        };
        let x = self.post(url, plain.clone(), request_id).await;
        Sample {
            total: x.total,
            ttfb: stream.then_some(x.first),
            max_gap: x.max_gap,
            legs: None,
            body: x.body,
            decode_bytes: plain.len(),
            prompt_tokens: None,
        }
    }

    async fn metrics(&self, admin: &str) -> String {
        self.client.get(format!("{admin}/metrics")).send().await.unwrap().text().await.unwrap()
    }
}

/// Sum over the series of `name` whose labels contain every `filter` string.
fn metric_sum(text: &str, name: &str, filter: &[&str]) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            filter.iter().all(|f| labels.contains(f)).then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Nearest-rank quantile of sorted samples.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

fn median(v: &[f64]) -> f64 {
    quantile(&sorted(v), 0.5)
}

/// p50, p90, p99.
fn q3(v: &[f64]) -> [f64; 3] {
    let s = sorted(v);
    [quantile(&s, 0.5), quantile(&s, 0.9), quantile(&s, 0.99)]
}

/// Median of per-round differences `a[i] - b[i]` (rounds are interleaved, so paired).
fn paired_median(a: &[f64], b: &[f64]) -> f64 {
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    median(&d)
}

#[derive(Default)]
struct Series {
    total: Vec<f64>,
    ttfb: Vec<f64>,
    max_gap: Vec<f64>,
    legs: Vec<[f64; 3]>,
}

impl Series {
    fn push(&mut self, s: &Sample) {
        self.total.push(s.total);
        self.ttfb.extend(s.ttfb);
        self.max_gap.push(s.max_gap);
        self.legs.extend(s.legs);
    }
}

/// Fresh fakes and a fresh tokenonce for one prompt size.
struct Env {
    proxy: TokenOnce,
    prefill: FakeVllm,
    decode: FakeVllm,
    fake_rt: tokio::runtime::Runtime,
}

impl Env {
    /// Starts the fakes, then tokenonce (a child process) between them, on `rt`.
    fn start(binary: &Path, rt: &tokio::runtime::Runtime) -> Self {
        // The fakes get their own runtime so their CPU work never delays the client's clock.
        let fake_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fake-vllm")
            .enable_all()
            .build()
            .unwrap();
        // Answer prefills like a NIXL engine (non-null kv_transfer_params).
        let engine = FakeConfig { connector: true, ..FakeConfig::default() };
        let prefill = fake_rt.block_on(FakeVllm::start(engine.clone()));
        let decode = fake_rt.block_on(FakeVllm::start(engine));
        let settings = Settings { health_interval_ms: 1000, log: "warn".into(), ..Settings::default() };
        let config = pd_config(&prefill, &decode, "token_reuse = true");
        let proxy = rt.block_on(TokenOnce::spawn(binary, &config, &settings));
        Self { proxy, prefill, decode, fake_rt }
    }
}

struct SizeResult {
    words: usize,
    prompt_tokens: u64,
    request_bytes: usize,
    decode_bytes: usize,
    rounds: usize,
    cut_short: bool,
    /// Indexed like `VARIANTS`.
    series: Vec<Series>,
    /// tokenonce's own view (`/metrics` deltas over the measured rounds), mean ms.
    own: Vec<(&'static str, f64)>,
    reuse_applied: f64,
    proxied: usize,
    retries: f64,
    peak_rss_kib: Option<u64>,
    reuse_races: usize,
    warnings: Vec<String>,
    /// Streaming relay check: (via, median TTFB, median total).
    relay_check: Vec<(Via, f64, f64)>,
}

async fn measure(bench: &Bench, env: &Env, words_n: usize, opts: &Options, budget: Duration) -> SizeResult {
    let prompt = Prompt::new(words_n);
    let mut warnings = Vec::new();
    // Warm-up (connections, tokenonce's version lookup, allocators) and sanity checks: with the
    // same request id, all three paths must answer the same bytes.
    let mut prompt_tokens = 0;
    let mut decode_bytes = 0;
    for round in 0..opts.warmup.max(1) {
        let mut outs = Vec::new();
        for &(via, stream) in &VARIANTS {
            outs.push(bench.run(&prompt, via, stream, "bench").await);
        }
        if round == 0 {
            prompt_tokens = outs[1].prompt_tokens.unwrap_or(0);
            decode_bytes = outs[1].decode_bytes;
            for (i, what) in [(0, "non-streamed"), (3, "streamed")] {
                if outs[i].body != outs[i + 1].body || outs[i].body != outs[i + 2].body {
                    warnings.push(format!(
                        "{what} answers differ between (a), (b) and (c) ({} / {} / {} bytes)",
                        outs[i].body.len(),
                        outs[i + 1].body.len(),
                        outs[i + 2].body.len()
                    ));
                }
            }
        }
    }
    let before = bench.metrics(&env.proxy.admin).await;
    let mut series: Vec<Series> = VARIANTS.iter().map(|_| Series::default()).collect();
    let started = Instant::now();
    let mut rounds = 0;
    let mut cut_short = false;
    let mut order: Vec<usize> = (0..VARIANTS.len()).collect();
    let mut rng = 0x2545_F491_4F6C_DD1D_u64;
    for round in 0..opts.runs {
        if started.elapsed() > budget {
            cut_short = true;
            break;
        }
        // A fresh order every round (Fisher-Yates, deterministic xorshift), so no variant
        // always follows the same one (a streamed direct request ends with a ~40 ms idle stall).
        for i in (1..order.len()).rev() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            order.swap(i, (rng % (i as u64 + 1)) as usize);
        }
        for &v in &order {
            let (via, stream) = VARIANTS[v];
            let rid = format!("{}-{}-{round}", via.letter(), if stream { "s" } else { "n" });
            series[v].push(&bench.run(&prompt, via, stream, &rid).await);
        }
        rounds += 1;
        if rounds % 20 == 0 {
            eprintln!("  {words_n} words: {rounds}/{} rounds, {:.1} s", opts.runs, started.elapsed().as_secs_f64());
        }
    }
    let after = bench.metrics(&env.proxy.admin).await;
    let delta = |name: &str, filter: &[&str]| metric_sum(&after, name, filter) - metric_sum(&before, name, filter);
    let mean = |base: &str, filter: &[&str]| {
        delta(&format!("{base}_sum"), filter) / delta(&format!("{base}_count"), filter) * 1e3
    };
    let stage = "tokenonce_stage_duration_seconds";
    // Means, so a few slow requests weigh in. (Request and decode totals are left out: streamed
    // ones include the fake's delayed-ACK stalls.)
    let own = vec![
        ("to response header", mean("tokenonce_time_to_first_byte_seconds", &[])),
        ("prefill leg", mean(stage, &["stage=\"prefill\""])),
        ("handoff", mean(stage, &["stage=\"handoff\""])),
        ("decode to header", mean(stage, &["stage=\"decode_first_byte\""])),
    ];
    let reuse_applied = delta("tokenonce_token_reuse_total", &["result=\"applied\""]);
    let proxied = 2 * rounds;
    let retries = delta("tokenonce_upstream_retries_total", &[]);
    if (reuse_applied - proxied as f64).abs() > 0.5 {
        warnings.push(format!("token reuse applied on {reuse_applied} of {proxied} proxied requests"));
    }

    // Streaming relay check (first size only): with 5 ms between the decode's SSE events, the
    // first byte must come long before the last, through tokenonce as directly.
    let mut relay_check = Vec::new();
    if words_n == PROMPT_WORDS[0] {
        env.decode.configure(|c| c.chunk_delay = CHECK_CHUNK_DELAY);
        let mut got: [(Vec<f64>, Vec<f64>); 2] = Default::default();
        for _ in 0..3 {
            for (i, via) in [Via::Direct, Via::Tokenonce].into_iter().enumerate() {
                let s = bench.run(&prompt, via, true, "relay-check").await;
                got[i].0.push(s.ttfb.unwrap_or(f64::NAN));
                got[i].1.push(s.total);
            }
        }
        env.decode.configure(|c| c.chunk_delay = Duration::ZERO);
        for (i, via) in [Via::Direct, Via::Tokenonce].into_iter().enumerate() {
            relay_check.push((via, median(&got[i].0), median(&got[i].1)));
        }
    }

    let log = env.proxy.log_text();
    let reuse_races = log.matches("failed to acquire reusable stream").count();
    let others: Vec<&str> =
        log.lines().filter(|l| !l.contains("failed to acquire reusable stream") && !l.contains("INFO")).collect();
    if !others.is_empty() {
        warnings.push(format!(
            "tokenonce logged {} other line(s) at warn or above, first: {}",
            others.len(),
            others[0]
        ));
    }
    SizeResult {
        words: words_n,
        prompt_tokens,
        request_bytes: prompt.plain.len(),
        decode_bytes,
        rounds,
        cut_short,
        series,
        own,
        reuse_applied,
        proxied,
        retries,
        peak_rss_kib: env.proxy.pid().and_then(|pid| proc_memory_kib(pid).0),
        reuse_races,
        warnings,
        relay_check,
    }
}

fn print_size(r: &SizeResult) {
    println!(
        "### ~{}k-token prompt: {} words → {} prompt tokens; client body {:.1} KB, decode body with ids {:.1} KB; {} measured rounds{}\n",
        (r.prompt_tokens as f64 / 1000.0).round(),
        r.words,
        r.prompt_tokens,
        r.request_bytes as f64 / 1000.0,
        r.decode_bytes as f64 / 1000.0,
        r.rounds,
        if r.cut_short { " (cut short by the time budget)" } else { "" }
    );
    println!("| variant | non-stream total p50 | p90 | p99 | stream TTFB p50 | p90 | p99 |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let s = |via, stream| &r.series[variant_index(via, stream)];
    let names = [
        (Via::Direct, "(a) direct → decode"),
        (Via::DirectPd, "(b) direct P then D"),
        (Via::Tokenonce, "(c) through tokenonce"),
    ];
    let mut qs = Vec::new();
    for (via, name) in names {
        let (ns, st) = (q3(&s(via, false).total), q3(&s(via, true).ttfb));
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} |",
            fmt_num(ns[0]),
            fmt_num(ns[1]),
            fmt_num(ns[2]),
            fmt_num(st[0]),
            fmt_num(st[1]),
            fmt_num(st[2])
        );
        qs.push((ns, st));
    }
    for (other, name) in [(1, "**added: (c) − (b)**"), (0, "**added: (c) − (a)**")] {
        let ((cn, cs), (on, os)) = (qs[2], qs[other]);
        println!(
            "| {name} | **{}** | {} | **{}** | **{}** | {} | **{}** |",
            fmt_signed(cn[0] - on[0]),
            fmt_signed(cn[1] - on[1]),
            fmt_signed(cn[2] - on[2]),
            fmt_signed(cs[0] - os[0]),
            fmt_signed(cs[1] - os[1]),
            fmt_signed(cs[2] - os[2])
        );
    }
    let (c, b, a) = (Via::Tokenonce, Via::DirectPd, Via::Direct);
    println!(
        "\n- Added latency as the median of per-round paired differences: (c) − (b) {} ms non-streamed, {} ms TTFB; \
         (c) − (a) {} ms non-streamed, {} ms TTFB.",
        fmt_signed(paired_median(&s(c, false).total, &s(b, false).total)),
        fmt_signed(paired_median(&s(c, true).ttfb, &s(b, true).ttfb)),
        fmt_signed(paired_median(&s(c, false).total, &s(a, false).total)),
        fmt_signed(paired_median(&s(c, true).ttfb, &s(a, true).ttfb)),
    );
    let legs: Vec<[f64; 3]> = s(b, false).legs.iter().chain(&s(b, true).legs).copied().collect();
    let leg = |i: usize| median(&legs.iter().map(|l| l[i]).collect::<Vec<_>>());
    println!(
        "- (b) legs, median: prefill {} ms, decode to first byte {} ms; the bench's own handoff between them \
         (parse the prefill answer, splice the ids; not counted in (b)) {} ms.",
        fmt_num(leg(0)),
        fmt_num(leg(1)),
        fmt_num(leg(2))
    );
    let own: Vec<String> = r.own.iter().map(|(k, v)| format!("{k} {}", fmt_num(*v))).collect();
    println!(
        "- tokenonce's own timings of its (c) requests (`/metrics` sum/count deltas, means, ms): {}.",
        own.join(", ")
    );
    let stalled = |via| {
        let gaps = &s(via, true).max_gap;
        100.0 * gaps.iter().filter(|&&g| g > STALL_MS).count() as f64 / gaps.len().max(1) as f64
    };
    println!(
        "- Streamed to the last byte, p50 (share of streams with a gap > {STALL_MS} ms between two chunks): \
         (a) {} ms ({:.0}%), (b) {} ms ({:.0}%), (c) {} ms ({:.0}%). Not in the table: the axum fake does not set \
         TCP_NODELAY, so its later SSE writes wait for the receiver's delayed ACK (~40 ms); a fake artifact \
         that TTFB does not include.",
        fmt_num(median(&s(a, true).total)),
        stalled(a),
        fmt_num(median(&s(b, true).total)),
        stalled(b),
        fmt_num(median(&s(c, true).total)),
        stalled(c)
    );
    println!(
        "- Token reuse applied on {} of {} proxied requests; tokenonce peak RSS (VmHWM) {}; upstream connections: \
         {} stale-connection retries, {} pingora \"failed to acquire reusable stream\" (pooled connection dropped, \
         a new one opened).",
        r.reuse_applied,
        r.proxied,
        mib(r.peak_rss_kib),
        r.retries,
        r.reuse_races
    );
    for (via, ttfb, total) in &r.relay_check {
        println!(
            "- Streaming relay check ({} ms between the decode's SSE events): ({}) TTFB {} ms, last byte {} ms.",
            CHECK_CHUNK_DELAY.as_millis(),
            via.letter(),
            fmt_num(*ttfb),
            fmt_num(*total)
        );
    }
    for w in &r.warnings {
        println!("- **WARNING**: {w}");
    }
    println!();
}

fn main() {
    let run_started = Instant::now();
    let opts = parse_options();
    let command = if opts.user_args.is_empty() {
        "cargo bench --bench overhead".to_owned()
    } else {
        format!("cargo bench --bench overhead -- {}", opts.user_args.join(" "))
    };
    let dirty = git(&["status", "--porcelain", "--", "src", "Cargo.toml", "Cargo.lock"]);
    let binary = tokenonce_binary();
    println!("# tokenonce overhead benchmark\n");
    println!("- command: `{command}`");
    println!(
        "- commit: {}{}",
        git(&["rev-parse", "--short", "HEAD"]),
        if dirty.is_empty() || dirty == "unknown" { "" } else { " (+ uncommitted changes in src/ or Cargo.*)" }
    );
    println!("- tokenonce binary: {}", binary.display());
    println!(
        "- {} CPUs; tokenonce threads = 2, TOKENONCE_LOG=warn; both fakes on one 1-worker runtime in the bench process; \
         the client on one thread",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    println!(
        "- per prompt size: {} warm-up + up to {} measured rounds of all 6 variants (in a fresh shuffled order each round); \
         max_tokens {MAX_TOKENS}; nearest-rank quantiles; ms\n",
        opts.warmup, opts.runs
    );

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(4)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let measuring = Instant::now();
    let total_budget = Duration::from_secs(opts.max_seconds);
    let mut results = Vec::new();
    for (i, &n) in PROMPT_WORDS.iter().enumerate() {
        let env = Env::start(&binary, &rt);
        let bench = Bench {
            client: client.clone(),
            prefill_url: format!("http://{}/v1/chat/completions", env.prefill.host_port()),
            decode_url: format!("http://{}/v1/chat/completions", env.decode.host_port()),
            proxy_url: format!("{}/v1/chat/completions", env.proxy.url),
        };
        let budget = total_budget.saturating_sub(measuring.elapsed()) / u32::try_from(PROMPT_WORDS.len() - i).unwrap();
        eprintln!("overhead: {n}-word prompt ...");
        results.push(rt.block_on(async {
            env.proxy.wait_ready(200).await;
            measure(&bench, &env, n, &opts, budget).await
        }));
        let Env { proxy, fake_rt, .. } = env;
        drop(proxy);
        drop(fake_rt);
    }
    for r in &results {
        print_size(r);
    }
    println!(
        "This bench process (client + fakes, which keep every request body) peaked at {}.\n",
        mib(proc_memory_kib(std::process::id()).0)
    );
    println!("Bench run time: {:.1} s (excluding the build).", run_started.elapsed().as_secs_f64());
}
