//! Soak: tokenonce under steady mixed load for a set time, reporting every 10 s.
//!
//! Run: `cargo bench --bench soak -- --seconds 600` (options after `--`: `--seconds S`, the run
//! length, default 600; `--concurrency N`, requests in flight, default 64; `--report-seconds
//! S`, default 10). `cargo bench` builds this file and the `tokenonce` binary (release); the
//! bench runs that binary (`CARGO_BIN_EXE_tokenonce`, or `TOKENONCE_BIN=path`) as a separate
//! process through the tests' harness (`tests/support/harness.rs`, `TokenOnce::spawn`), between
//! two in-process fake vLLM engines (`tests/support/fake_vllm.rs`, on a runtime of their own,
//! keeping no request bodies), on 127.0.0.1 only.
//!
//! Load: `--concurrency` workers, each sending one request after another on a shared
//! keep-alive client: chat or completions, streamed or not, with a prompt of 1k, 4k, 12k or
//! 37k tokens (the fake tokenizer: one token per word; mostly short, one in eight 37k), each
//! with its own `X-Request-Id`. A request is an error unless it answers 200 within 60 s with
//! a body that carries its own request id (the fake's answer id) and, when streamed, ends in
//! `[DONE]` with no error event.
//!
//! Every `--report-seconds` one line: requests/s over the interval, p50 and p99 latency (send
//! to last byte) of the requests finished in it, errors (interval and total), and the RSS of
//! the tokenonce process (`/proc/PID/status` VmRSS). At the end: totals, tokenonce's own
//! `requests_total` by outcome, and the verdict. Exits non-zero on any error, and, for runs of
//! 300 s or more, when the RSS after the warm-up (the first fifth of the run, at least 30 s)
//! rises more than 10 % above its value when the warm-up ended. Every loop is bounded in
//! count and time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;
use support::{pd_config, words, FakeConfig, FakeVllm, Settings, TokenOnce};

/// Prompt sizes in tokens (words) and how many of every eight requests use each.
const SIZES: [(usize, u32); 4] = [(1_000, 4), (4_000, 2), (12_000, 1), (37_000, 1)];
/// `max_tokens` of every request.
const MAX_TOKENS: u64 = 16;
/// A request not answered whole within this is an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Runs at least this long check RSS growth.
const LONG_RUN: Duration = Duration::from_secs(300);
/// Largest RSS growth after the warm-up, in percent.
const RSS_GROWTH_LIMIT: f64 = 10.0;
/// Requests one worker sends at most (with the time limit, bounds its loop).
const MAX_REQUESTS_PER_WORKER: u64 = 10_000_000;

struct Options {
    seconds: u64,
    concurrency: usize,
    report_seconds: u64,
}

fn parse_options() -> Options {
    let mut o = Options { seconds: 600, concurrency: 64, report_seconds: 10 };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name} needs a positive integer"))
        };
        match arg.as_str() {
            "--bench" => {} // added by `cargo bench`
            "--seconds" => o.seconds = value("--seconds").max(1),
            "--concurrency" => o.concurrency = usize::try_from(value("--concurrency")).unwrap().max(1),
            "--report-seconds" => o.report_seconds = value("--report-seconds").max(1),
            other => eprintln!("soak: ignoring unknown argument {other:?}"),
        }
    }
    o
}

/// The tokenonce binary: `TOKENONCE_BIN`, else the one `cargo bench` built.
fn tokenonce_binary() -> PathBuf {
    std::env::var_os("TOKENONCE_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tokenonce")), PathBuf::from)
}

/// VmRSS of `pid` in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().trim_end_matches("kB").trim().parse().ok())
}

/// One kind of request, its body serialized once.
struct Kind {
    path: &'static str,
    stream: bool,
    tokens: usize,
    body: Bytes,
}

/// Every (API, streamed, size) combination, each size repeated by its weight.
fn kinds() -> Vec<Kind> {
    let mut kinds = Vec::new();
    for (i, &(tokens, weight)) in SIZES.iter().enumerate() {
        let text = words(tokens, 7 + i as u64);
        for stream in [false, true] {
            let chat = json!({
                "model": "tiny-qwen3", "messages": [{"role": "user", "content": text}],
                "max_tokens": MAX_TOKENS, "stream": stream
            });
            let completions =
                json!({"model": "tiny-qwen3", "prompt": text, "max_tokens": MAX_TOKENS, "stream": stream});
            for (path, body) in [("/v1/chat/completions", chat), ("/v1/completions", completions)] {
                for _ in 0..weight {
                    kinds.push(Kind { path, stream, tokens, body: Bytes::from(serde_json::to_vec(&body).unwrap()) });
                }
            }
        }
    }
    kinds
}

/// What the workers share.
#[derive(Default)]
struct Tally {
    /// Latencies (ms) of the requests finished since the last report.
    latencies: Mutex<Vec<f64>>,
    done: AtomicU64,
    errors: AtomicU64,
    tokens: AtomicU64,
    first_errors: Mutex<Vec<String>>,
}

impl Tally {
    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_errors.lock();
        if first.len() < 10 {
            first.push(what);
        }
    }
}

/// One request; `Err` says why it failed.
async fn one(client: &reqwest::Client, url: &str, kind: &Kind, request_id: &str) -> Result<(), String> {
    let resp = client
        .post(format!("{url}{}", kind.path))
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(kind.body.clone())
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("body: {e}"))?;
    if status != 200 {
        return Err(format!("status {status}: {}", text.chars().take(300).collect::<String>()));
    }
    if !text.contains(&format!("-{request_id}\"")) {
        return Err(format!("answer without its request id {request_id}"));
    }
    if kind.stream && (!text.ends_with("data: [DONE]\n\n") || text.contains("\"error\"")) {
        return Err(format!("stream did not end cleanly: {}", text.chars().rev().take(300).collect::<String>()));
    }
    Ok(())
}

async fn worker(
    w: usize,
    client: reqwest::Client,
    url: String,
    kinds: Arc<Vec<Kind>>,
    tally: Arc<Tally>,
    end: Instant,
) {
    let mut state = (w as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for n in 0..MAX_REQUESTS_PER_WORKER {
        if Instant::now() >= end {
            return;
        }
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let kind = &kinds[(state % kinds.len() as u64) as usize];
        let request_id = format!("soak-{w}-{n}");
        let started = Instant::now();
        match tokio::time::timeout(REQUEST_TIMEOUT, one(&client, &url, kind, &request_id)).await {
            Ok(Ok(())) => {
                tally.latencies.lock().push(started.elapsed().as_secs_f64() * 1000.0);
                tally.done.fetch_add(1, Ordering::Relaxed);
                tally.tokens.fetch_add(kind.tokens as u64, Ordering::Relaxed);
            }
            Ok(Err(e)) => tally.error(format!("{request_id}: {e}")),
            Err(_) => tally.error(format!("{request_id}: no answer within {} s", REQUEST_TIMEOUT.as_secs())),
        }
    }
}

/// Nearest-rank quantile of sorted `v` (0 when empty).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// One report line's numbers.
struct Report {
    at_s: u64,
    rss_kib: Option<u64>,
}

/// Starts the fakes on their own runtime (so their CPU work does not stall the client).
fn start_fakes() -> (tokio::runtime::Runtime, FakeVllm, FakeVllm) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fake-vllm")
        .enable_all()
        .build()
        .unwrap();
    let engine = FakeConfig { connector: true, keep_requests: false, ..FakeConfig::default() };
    let prefill = rt.block_on(FakeVllm::start(engine.clone()));
    let decode = rt.block_on(FakeVllm::start(engine));
    (rt, prefill, decode)
}

/// `requests_total` of tokenonce by outcome, summed over routes and APIs.
async fn outcomes(proxy: &TokenOnce) -> Vec<(String, f64)> {
    let text = proxy.metrics().await;
    let mut by = Vec::<(String, f64)>::new();
    for line in text.lines().filter(|l| l.starts_with("tokenonce_requests_total{")) {
        let outcome = line.split("outcome=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("?").to_owned();
        let v: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        match by.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, total)) => *total += v,
            None => by.push((outcome, v)),
        }
    }
    by
}

/// Runs the load and reports; the RSS samples taken.
async fn soak(proxy: &TokenOnce, opts: &Options, tally: &Arc<Tally>) -> Vec<Report> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(opts.concurrency)
        .build()
        .unwrap();
    let kinds = Arc::new(kinds());
    let started = Instant::now();
    let end = started + Duration::from_secs(opts.seconds);
    let workers: Vec<_> = (0..opts.concurrency)
        .map(|w| {
            let (client, url, kinds, tally) =
                (client.clone(), proxy.url.clone(), Arc::clone(&kinds), Arc::clone(tally));
            tokio::spawn(worker(w, client, url, kinds, tally, end))
        })
        .collect();
    let pid = proxy.pid().expect("tokenonce runs as a child process");
    let every = Duration::from_secs(opts.report_seconds);
    println!("| t (s) | req/s | p50 ms | p99 ms | errors (interval / total) | tokenonce RSS MiB |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut reports = Vec::new();
    let (mut last_done, mut last_errors, mut last_at) = (0, 0, started);
    let intervals = opts.seconds.div_ceil(opts.report_seconds) + 1;
    for i in 1..=intervals {
        let next = (started + every * u32::try_from(i).unwrap()).min(end + Duration::from_millis(1));
        tokio::time::sleep_until(next.into()).await;
        let now = Instant::now();
        let mut lat = std::mem::take(&mut *tally.latencies.lock());
        lat.sort_by(f64::total_cmp);
        let (done, errors) = (tally.done.load(Ordering::Relaxed), tally.errors.load(Ordering::Relaxed));
        let rate = (done - last_done) as f64 / now.duration_since(last_at).as_secs_f64();
        let rss = rss_kib(pid);
        let at_s = now.duration_since(started).as_secs();
        println!(
            "| {at_s} | {rate:.1} | {:.1} | {:.1} | {} / {errors} | {} |",
            quantile(&lat, 0.5),
            quantile(&lat, 0.99),
            errors - last_errors,
            rss.map_or("?".into(), |k| format!("{:.1}", k as f64 / 1024.0))
        );
        reports.push(Report { at_s, rss_kib: rss });
        (last_done, last_errors, last_at) = (done, errors, now);
        if now >= end {
            break;
        }
    }
    for w in workers {
        // Each worker ends after its request in flight (at most REQUEST_TIMEOUT past the end).
        let _ = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(5), w).await;
    }
    reports
}

/// The RSS verdict for a run of `seconds`: `Err` when it grew past the limit after warm-up.
fn rss_verdict(reports: &[Report], seconds: u64) -> Result<String, String> {
    if Duration::from_secs(seconds) < LONG_RUN {
        return Ok(format!("RSS growth not checked (run shorter than {} s)", LONG_RUN.as_secs()));
    }
    let warm_up = (seconds / 5).max(30);
    let after: Vec<(u64, u64)> =
        reports.iter().filter(|r| r.at_s >= warm_up).filter_map(|r| Some((r.at_s, r.rss_kib?))).collect();
    let Some(&(base_at, base)) = after.first() else { return Err("no RSS sample after the warm-up".into()) };
    let &(peak_at, peak) = after.iter().max_by_key(|(_, k)| *k).unwrap();
    let growth = (peak as f64 / base as f64 - 1.0) * 100.0;
    let text = format!(
        "RSS after warm-up: {:.1} MiB at {base_at} s, peak {:.1} MiB at {peak_at} s ({growth:+.1} %, limit {RSS_GROWTH_LIMIT} %)",
        base as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    if growth > RSS_GROWTH_LIMIT {
        Err(text)
    } else {
        Ok(text)
    }
}

fn main() {
    let opts = parse_options();
    let binary = tokenonce_binary();
    println!("# tokenonce soak\n");
    println!("- command: `cargo bench --bench soak -- --seconds {}`", opts.seconds);
    println!(
        "- {} s, concurrency {}, reports every {} s; tokenonce {} (threads 2, log warn) between two in-process fakes; {} CPUs",
        opts.seconds,
        opts.concurrency,
        opts.report_seconds,
        binary.display(),
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    println!("- mix: chat and completions, streamed and not, prompts of 1k/4k/12k/37k tokens (4:2:1:1), max_tokens {MAX_TOKENS}\n");
    let (fake_rt, prefill, decode) = start_fakes();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let settings = Settings { health_interval_ms: 1000, log: "warn".into(), ..Settings::default() };
    let config = pd_config(&prefill, &decode, "");
    let tally = Arc::new(Tally::default());
    let (reports, own) = rt.block_on(async {
        let proxy = TokenOnce::spawn(Path::new(&binary), &config, &settings).await;
        proxy.wait_ready(200).await;
        let reports = soak(&proxy, &opts, &tally).await;
        (reports, outcomes(&proxy).await)
    });
    drop(fake_rt);
    let (done, errors) = (tally.done.load(Ordering::Relaxed), tally.errors.load(Ordering::Relaxed));
    println!(
        "\ntotal: {done} requests answered, {errors} errors, {:.1} req/s, {:.0} prompt tokens/s",
        done as f64 / opts.seconds as f64,
        tally.tokens.load(Ordering::Relaxed) as f64 / opts.seconds as f64
    );
    let own: Vec<String> = own.iter().map(|(o, v)| format!("{o} {v}")).collect();
    println!("tokenonce requests_total by outcome: {}", own.join(", "));
    for e in tally.first_errors.lock().iter() {
        println!("error: {e}");
    }
    let rss = rss_verdict(&reports, opts.seconds);
    println!("{}", rss.as_ref().unwrap_or_else(|e| e));
    let failed = errors > 0 || rss.is_err() || done == 0;
    println!("verdict: {}", if failed { "FAIL" } else { "ok" });
    if failed {
        std::process::exit(1);
    }
}
