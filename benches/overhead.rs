//! Overhead benchmark: the latency tokenonce adds over calling the engines directly, measured
//! against two in-process fake vLLM engines (`tests/support/fake_vllm.rs`) at a ~1k-token and
//! a ~37k-token chat prompt.
//!
//! Run: `cargo bench --bench overhead` (options after `--`: `--runs N` measured rounds per
//! prompt size, default 60; `--warmup N`, default 5; `--max-seconds S`, the measuring budget,
//! default 150). `cargo bench` builds this file and the `tokenonce` binary with the bench
//! profile (= release) into `target/release/`; the bench runs that binary
//! (`CARGO_BIN_EXE_tokenonce`; `TOKENONCE_BIN=path` runs another build instead).
//!
//! Variants, interleaved round-robin (the starting variant rotates every round) so machine
//! noise hits all alike, each non-streamed and streamed:
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

#[allow(dead_code)]
#[path = "../tests/support/fake_vllm.rs"]
mod fake_vllm;

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fake_vllm::{FakeConfig, FakeVllm};
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// User-message sizes in words (the fake tokenizer: one token per whitespace-separated word).
const PROMPT_WORDS: [usize; 2] = [1_000, 37_000];
/// `max_tokens` of every measured request.
const MAX_TOKENS: u64 = 16;
/// One constant request id: responses of all variants are then byte-identical.
const REQUEST_ID: &str = "bench";

struct Options {
    runs: usize,
    warmup: usize,
    max_seconds: u64,
    user_args: Vec<String>,
}

fn parse_options() -> Options {
    let mut o = Options { runs: 60, warmup: 5, max_seconds: 150, user_args: Vec::new() };
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The tokenonce process; killed (by its own pid) on drop.
struct TokenOnce {
    child: Child,
    url: String,
    admin: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl TokenOnce {
    fn start(binary: &Path, prefill: &FakeVllm, decode: &FakeVllm) -> Self {
        let port = free_port();
        let admin_port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenonce.toml");
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\nthreads = 2\ngrace_period_seconds = 1\ngraceful_shutdown_timeout_seconds = 1\n\n[upstream]\nhealth_interval_ms = 1000\n\n[pools.prefill]\nendpoints = [\"{}\"]\n\n[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\ntoken_reuse = true\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n",
            prefill.host_port(),
            decode.host_port()
        );
        std::fs::File::create(&path).unwrap().write_all(text.as_bytes()).unwrap();
        let log = dir.path().join("tokenonce.log");
        let child = Command::new(binary)
            .arg("--config")
            .arg(&path)
            .env("TOKENONCE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin_port}"),
            log,
            _dir: dir,
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded: 20 s) until `/healthz` and `/readyz` answer 200.
    async fn wait_ready(&self, client: &reqwest::Client) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for path in ["/healthz", "/readyz"] {
            loop {
                let ok = client.get(format!("{}{path}", self.admin)).send().await.is_ok_and(|r| r.status() == 200);
                if ok {
                    break;
                }
                assert!(Instant::now() < deadline, "tokenonce: {path} not 200 within 20 s:\n{}", self.log_text());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// `(VmHWM, VmRSS)` in KiB from `/proc/PID/status`.
    fn memory_kib(&self) -> (Option<u64>, Option<u64>) {
        proc_memory_kib(self.child.id())
    }
}

impl Drop for TokenOnce {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proc_memory_kib(pid: u32) -> (Option<u64>, Option<u64>) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok()))
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// `n` deterministic lowercase words of 3–7 letters (about 6 bytes each with the space).
fn words(n: usize, seed: u64) -> String {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut text = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            text.push(' ');
        }
        let r = next();
        let len = 3 + (r % 5) as usize;
        for k in 0..len {
            text.push(char::from(b'a' + ((r >> (8 + 5 * k)) % 26) as u8));
        }
    }
    text
}

/// The bodies of one prompt size.
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
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": user}
                ],
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
            // The prefill leg as tokenonce shapes it (src/openai/request.rs prefill_body).
            prefill: body(json!({
                "max_tokens": 1,
                "stream": false,
                "return_token_ids": true,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}
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
fn decode_body_bench(plain: &[u8], prefill_response: &[u8]) -> (Bytes, u64) {
    let echo: PrefillEcho<'_> = serde_json::from_slice(prefill_response).unwrap_or_else(|e| {
        panic!(
            "prefill answer without ids ({e}): {}",
            String::from_utf8_lossy(&prefill_response[..prefill_response.len().min(300)])
        )
    });
    let ids = echo.prompt_token_ids.get();
    assert!(ids.starts_with('['), "prefill echoed no ids: {ids:.100}");
    let mut kv = match echo.kv_transfer_params.map(RawValue::get) {
        Some(raw) if raw.trim_end().ends_with('}') && raw.trim() != "{}" => {
            let mut s = raw.trim_end().to_owned();
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

const VARIANTS: [(Via, bool); 6] = [
    (Via::Direct, false),
    (Via::DirectPd, false),
    (Via::Tokenonce, false),
    (Via::Direct, true),
    (Via::DirectPd, true),
    (Via::Tokenonce, true),
];

/// One timed request (or P-then-D pair).
struct Sample {
    /// To the last body byte, ms.
    total: f64,
    /// To the first body chunk, ms (streamed only).
    ttfb: Option<f64>,
    /// The bench's own handoff work, ms (excluded from `total`/`ttfb`; (b) only).
    handoff: Option<f64>,
    /// The response body.
    body: Bytes,
    /// Size of the decode request body sent.
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
    /// Sends one POST; returns (time to first body chunk, time to last byte, body), both
    /// measured from just before sending.
    async fn post(&self, url: &str, body: Bytes) -> (f64, f64, Bytes) {
        let started = Instant::now();
        let mut resp = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("x-request-id", REQUEST_ID)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = resp.status();
        let mut first = None;
        let mut all = Vec::new();
        // Bounded: the client's 60 s timeout also covers the body.
        while let Some(chunk) = resp.chunk().await.unwrap_or_else(|e| panic!("POST {url}: body: {e}")) {
            first.get_or_insert_with(|| started.elapsed());
            all.extend_from_slice(&chunk);
        }
        let total = started.elapsed();
        let body = Bytes::from(all);
        assert!(status.is_success(), "POST {url}: {status}: {}", String::from_utf8_lossy(&body[..body.len().min(500)]));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        (ms(first.unwrap_or(total)), ms(total), body)
    }

    async fn run(&self, prompt: &Prompt, path: Via, stream: bool) -> Sample {
        let plain = if stream { &prompt.plain_stream } else { &prompt.plain };
        let url = match path {
            Via::Direct => &self.decode_url,
            Via::Tokenonce => &self.proxy_url,
            Via::DirectPd => {
                let (_, p_total, p_body) = self.post(&self.prefill_url, prompt.prefill.clone()).await;
                let handoff_started = Instant::now();
                let (decode, tokens) = decode_body_bench(plain, &p_body);
                let handoff = handoff_started.elapsed().as_secs_f64() * 1e3;
                let decode_bytes = decode.len();
                let (d_first, d_total, body) = self.post(&self.decode_url, decode).await;
                return Sample {
                    total: p_total + d_total,
                    ttfb: stream.then_some(p_total + d_first),
                    handoff: Some(handoff),
                    body,
                    decode_bytes,
                    prompt_tokens: Some(tokens),
                };
            }
        };
        let (first, total, body) = self.post(url, plain.clone()).await;
        Sample {
            total,
            ttfb: stream.then_some(first),
            handoff: None,
            body,
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

#[derive(Default)]
struct Series {
    total: Vec<f64>,
    ttfb: Vec<f64>,
    handoff: Vec<f64>,
}

impl Series {
    fn push(&mut self, s: &Sample) {
        self.total.push(s.total);
        if let Some(t) = s.ttfb {
            self.ttfb.push(t);
        }
        if let Some(h) = s.handoff {
            self.handoff.push(h);
        }
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

fn q3(v: &[f64]) -> [f64; 3] {
    let s = sorted(v);
    [quantile(&s, 0.5), quantile(&s, 0.9), quantile(&s, 0.99)]
}

/// Median of per-round differences `a[i] - b[i]` (rounds are interleaved, so paired).
fn paired_median(a: &[f64], b: &[f64]) -> f64 {
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    quantile(&sorted(&d), 0.5)
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
    mismatches: Vec<String>,
}

fn f(ms: f64) -> String {
    if ms.is_nan() {
        "–".into()
    } else if ms.abs() < 10.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.1}")
    }
}

fn signed(ms: f64) -> String {
    if ms >= 0.0 {
        format!("+{}", f(ms))
    } else {
        f(ms)
    }
}

fn print_size(r: &SizeResult) {
    let idx = |p: Via, s: bool| VARIANTS.iter().position(|&(vp, vs)| vp == p && vs == s).unwrap();
    println!(
        "### ~{}k-token prompt ({} words → {} prompt tokens; client body {:.1} KB, decode body with ids {:.1} KB; {} measured rounds{})\n",
        (r.prompt_tokens as f64 / 1000.0).round(),
        r.words,
        r.prompt_tokens,
        r.request_bytes as f64 / 1000.0,
        r.decode_bytes as f64 / 1000.0,
        r.rounds,
        if r.cut_short { ", cut short by the time budget" } else { "" }
    );
    println!("| variant | non-stream total p50 | p90 | p99 | stream TTFB p50 | p90 | p99 | stream total p50 |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let names = [
        (Via::Direct, "(a) direct → decode"),
        (Via::DirectPd, "(b) direct P then D"),
        (Via::Tokenonce, "(c) tokenonce"),
    ];
    let mut qs = Vec::new();
    for (p, name) in names {
        let ns = q3(&r.series[idx(p, false)].total);
        let st = q3(&r.series[idx(p, true)].ttfb);
        let stt = q3(&r.series[idx(p, true)].total);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
            f(ns[0]),
            f(ns[1]),
            f(ns[2]),
            f(st[0]),
            f(st[1]),
            f(st[2]),
            f(stt[0])
        );
        qs.push((ns, st, stt));
    }
    for (other, name) in [(1, "**added: (c) − (b)**"), (0, "**added: (c) − (a)**")] {
        let (cn, cs, ct) = qs[2];
        let (on, os, ot) = qs[other];
        println!(
            "| {name} | **{}** | {} | **{}** | **{}** | {} | **{}** | {} |",
            signed(cn[0] - on[0]),
            signed(cn[1] - on[1]),
            signed(cn[2] - on[2]),
            signed(cs[0] - os[0]),
            signed(cs[1] - os[1]),
            signed(cs[2] - os[2]),
            signed(ct[0] - ot[0])
        );
    }
    let c = |s| &r.series[idx(Via::Tokenonce, s)];
    let b = |s| &r.series[idx(Via::DirectPd, s)];
    let a = |s| &r.series[idx(Via::Direct, s)];
    println!(
        "\nPaired per-round medians (c − b): non-stream {} ms, stream TTFB {} ms; (c − a): non-stream {} ms, stream TTFB {} ms.",
        signed(paired_median(&c(false).total, &b(false).total)),
        signed(paired_median(&c(true).ttfb, &b(true).ttfb)),
        signed(paired_median(&c(false).total, &a(false).total)),
        signed(paired_median(&c(true).ttfb, &a(true).ttfb)),
    );
    let mut handoff = b(false).handoff.clone();
    handoff.extend_from_slice(&b(true).handoff);
    println!(
        "The bench's own (b) handoff (parse the prefill answer, splice the ids; excluded from (b)): median {} ms.",
        f(quantile(&sorted(&handoff), 0.5))
    );
    let own: Vec<String> = r.own.iter().map(|(k, v)| format!("{k} {}", f(*v))).collect();
    println!("tokenonce's own view of its (c) requests (/metrics sum/count deltas, mean ms): {}.", own.join(", "));
    println!("Token reuse applied on {} of {} proxied requests.", r.reuse_applied, r.proxied);
    for m in &r.mismatches {
        println!("WARNING: {m}");
    }
    println!();
}

#[allow(clippy::too_many_lines)]
async fn measure(bench: &Bench, admin: &str, words_n: usize, opts: &Options, budget: Duration) -> SizeResult {
    let prompt = Prompt::new(words_n);
    let mut mismatches = Vec::new();
    // Warm-up (connections, tokenonce's version lookup, allocator) and sanity checks.
    let mut prompt_tokens = 0;
    let mut decode_bytes = 0;
    for round in 0..opts.warmup.max(1) {
        let mut outs: Vec<Sample> = Vec::new();
        for &(p, s) in &VARIANTS {
            outs.push(bench.run(&prompt, p, s).await);
        }
        if round == 0 {
            prompt_tokens = outs[1].prompt_tokens.unwrap_or(0);
            decode_bytes = outs[1].decode_bytes;
            for (i, what) in [(0, "non-streamed"), (3, "streamed")] {
                if outs[i].body != outs[i + 1].body || outs[i].body != outs[i + 2].body {
                    mismatches.push(format!(
                        "{what} answers differ between (a), (b) and (c) ({} / {} / {} bytes)",
                        outs[i].body.len(),
                        outs[i + 1].body.len(),
                        outs[i + 2].body.len()
                    ));
                }
            }
        }
    }
    let before = bench.metrics(admin).await;
    let mut series: Vec<Series> = VARIANTS.iter().map(|_| Series::default()).collect();
    let started = Instant::now();
    let mut rounds = 0;
    let mut cut_short = false;
    for round in 0..opts.runs {
        if started.elapsed() > budget {
            cut_short = true;
            break;
        }
        for k in 0..VARIANTS.len() {
            let v = (round + k) % VARIANTS.len();
            let (p, s) = VARIANTS[v];
            let sample = bench.run(&prompt, p, s).await;
            series[v].push(&sample);
        }
        rounds += 1;
        if rounds % 10 == 0 {
            eprintln!("  {words_n} words: {rounds}/{} rounds, {:.1} s", opts.runs, started.elapsed().as_secs_f64());
        }
    }
    let after = bench.metrics(admin).await;
    let delta = |name: &str, filter: &[&str]| metric_sum(&after, name, filter) - metric_sum(&before, name, filter);
    let mean = |base: &str, filter: &[&str]| {
        let count = delta(&format!("{base}_count"), filter);
        delta(&format!("{base}_sum"), filter) / count * 1e3
    };
    let own = vec![
        ("request (head → last byte)", mean("tokenonce_request_duration_seconds", &[])),
        ("prefill leg", mean("tokenonce_stage_duration_seconds", &["stage=\"prefill\""])),
        ("handoff", mean("tokenonce_stage_duration_seconds", &["stage=\"handoff\""])),
        ("decode first byte", mean("tokenonce_stage_duration_seconds", &["stage=\"decode_first_byte\""])),
        ("decode total", mean("tokenonce_stage_duration_seconds", &["stage=\"decode_total\""])),
    ];
    let reuse_applied = delta("tokenonce_token_reuse_total", &["result=\"applied\""]);
    let proxied = 2 * rounds;
    if (reuse_applied - proxied as f64).abs() > 0.5 {
        mismatches.push(format!("token reuse applied on {reuse_applied} of {proxied} proxied requests"));
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
        mismatches,
    }
}

fn main() {
    if std::env::args().any(|a| a == "--micro") {
        micro();
        return;
    }
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
        "- machine: {} CPUs; tokenonce threads = 2, TOKENONCE_LOG=warn; fakes on a 2-worker runtime in this process; client on one thread",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    println!(
        "- per prompt size: {} warm-up + {} measured rounds; each round runs all 6 variants once, starting variant rotating; max_tokens {MAX_TOKENS}; quantiles nearest-rank; times in ms\n",
        opts.warmup, opts.runs
    );

    // The fakes get their own runtime so their CPU work never delays the client's clock reads.
    let fake_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("fake-vllm")
        .enable_all()
        .build()
        .unwrap();
    let engine = FakeConfig {
        connector: true, // answer prefills like a NIXL engine (non-null kv_transfer_params)
        ..FakeConfig::default()
    };
    let prefill = fake_rt.block_on(FakeVllm::start(engine.clone()));
    let decode = fake_rt.block_on(FakeVllm::start(engine));
    let proxy = TokenOnce::start(&binary, &prefill, &decode);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(4)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let bench = Bench {
        client,
        prefill_url: format!("http://{}/v1/chat/completions", prefill.host_port()),
        decode_url: format!("http://{}/v1/chat/completions", decode.host_port()),
        proxy_url: format!("{}/v1/chat/completions", proxy.url),
    };
    let results: Vec<SizeResult> = rt.block_on(async {
        proxy.wait_ready(&bench.client).await;
        let mut out = Vec::new();
        let measuring = Instant::now();
        let total_budget = Duration::from_secs(opts.max_seconds);
        for (i, &n) in PROMPT_WORDS.iter().enumerate() {
            let left = total_budget.saturating_sub(measuring.elapsed());
            let budget = left / u32::try_from(PROMPT_WORDS.len() - i).unwrap();
            eprintln!("overhead: {n}-word prompt ...");
            out.push(measure(&bench, &proxy.admin, n, &opts, budget).await);
        }
        out
    });
    for r in &results {
        print_size(r);
    }
    let (hwm, rss) = proxy.memory_kib();
    let (self_hwm, _) = proc_memory_kib(std::process::id());
    let mib = |k: Option<u64>| k.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0));
    println!(
        "tokenonce peak RSS (VmHWM): {} (VmRSS now {}); this bench process (client + both fakes, which keep every request body): {}.",
        mib(hwm),
        mib(rss),
        mib(self_hwm)
    );
    let log = proxy.log_text();
    if !log.trim().is_empty() {
        println!(
            "\ntokenonce logged at warn or above:\n```\n{}\n```",
            log.lines().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    drop(proxy);
    drop(fake_rt);
    println!("\nBench run time: {:.1} s (excluding the build).", run_started.elapsed().as_secs_f64());
}

// TEMP
fn micro() {
    use tokenonce::openai::request::{decode_body, prefill_body};
    use tokenonce::openai::response::extract_handoff;
    use tokenonce::openai::{Api, RawObject, RequestView};
    let prompt = Prompt::new(37_000);
    let ids: Vec<u64> =
        fake_vllm::fake_tokenize(&fake_vllm::fake_render_chat(&serde_json::from_slice(&prompt.plain).unwrap()));
    let resp = format!("{{\"id\":\"x\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"t1 \"}},\"token_ids\":[1]}}],\"usage\":{{\"prompt_tokens\":{},\"total_tokens\":1,\"completion_tokens\":1,\"prompt_tokens_details\":null}},\"prompt_token_ids\":{},\"kv_transfer_params\":{{\"do_remote_prefill\":true,\"remote_block_ids\":[[1,2,3]]}}}}", ids.len(), serde_json::to_string(&ids).unwrap());
    let n = 200;
    let t = |name: &str, f: &mut dyn FnMut()| {
        for _ in 0..5 {
            f();
        }
        let s = Instant::now();
        for _ in 0..n {
            f();
        }
        println!("{name}: {:.3} ms", s.elapsed().as_secs_f64() * 1e3 / n as f64);
    };
    t("RawObject::parse_bytes(222KB)", &mut || {
        std::hint::black_box(RawObject::parse_bytes(&prompt.plain).unwrap());
    });
    let obj = RawObject::parse_bytes(&prompt.plain).unwrap();
    t("RequestView::parse", &mut || {
        std::hint::black_box(RequestView::parse(Api::Chat, &obj).unwrap());
    });
    t("prefill_body", &mut || {
        std::hint::black_box(prefill_body(&obj, true));
    });
    t("extract_handoff(230KB)", &mut || {
        std::hint::black_box(extract_handoff(Api::Chat, resp.as_bytes()).unwrap());
    });
    let h = extract_handoff(Api::Chat, resp.as_bytes()).unwrap();
    let pid = h.ids.as_ref().unwrap();
    t("decode_body", &mut || {
        std::hint::black_box(decode_body(&obj, Api::Chat, h.kv_transfer_params.as_deref(), Some(pid)));
    });
    t("bench decode_body", &mut || {
        std::hint::black_box(decode_body_bench(&prompt.plain, resp.as_bytes()));
    });
    t("fake: serde Value parse of plain", &mut || {
        std::hint::black_box(serde_json::from_slice::<Value>(&prompt.plain).unwrap());
    });
    let v: Value = serde_json::from_slice(&prompt.plain).unwrap();
    t("fake: render+tokenize", &mut || {
        std::hint::black_box(fake_vllm::fake_tokenize(&fake_vllm::fake_render_chat(&v)));
    });
    let db = decode_body(&obj, Api::Chat, h.kv_transfer_params.as_deref(), Some(pid));
    t("fake: serde Value parse of decode body", &mut || {
        std::hint::black_box(serde_json::from_slice::<Value>(&db).unwrap());
    });
    t("fake: ids_json", &mut || {
        std::hint::black_box(serde_json::to_string(&ids).unwrap());
    });
}
