//! Side-by-side bench: tokenonce next to its peers on the same fake engines and requests.
//!
//! Run: `bash benches/peers.sh` once (installs the peers outside the repo), then
//! `cargo bench --bench peers` (options after `--`: `--rounds N` sequential requests per
//! workload and proxy, default 60, a quarter of it at 37k; `--quick` a short smoke run).
//!
//! Proxies, all between the same two in-process fake vLLM engines (`tests/support/fake_vllm.rs`):
//! - (b) floor: the client sends the prefill, then the decode with the echoed ids itself (the
//!   bench's own handoff work between the legs is excluded from its time and its CPU);
//! - (a) tokenonce (orchestrate, token reuse on), (a0) the same with reuse off, and (a1) with
//!   reuse on and `server.work_stealing = false`;
//! - (c) vLLM's `toy_proxy_server.py` (Python, FastAPI + httpx, no reuse);
//! - (d) vLLM Router (PyPI `vllm-router`, Rust, `--vllm-pd-disaggregation`, no reuse).
//!
//! The peers are found in `TOKENONCE_PEERS` (default `~/.cache/tokenonce-peers`: `venv/` and
//! `toy_proxy_server.py`, what `benches/peers.sh` installs); a missing one is skipped loudly,
//! its columns printed as "absent".
//!
//! Per workload (chat and completions, streamed and not, ~1k and ~37k tokens) each proxy gets
//! `rounds` sequential requests, interleaved with the other proxies in blocks of 5 (after one
//! untimed warm request), each paired with a floor request right before it (so machine noise
//! hits all alike). Latency added = proxy − floor quantiles (client wall clock to the last
//! byte); proxy CPU per request = the median over blocks of the on-CPU time of all the proxy
//! process's threads (`/proc/PID/task/*/schedstat`, ns) during the block ÷ 5. The paired floor
//! requests run on a thread of their own (its own current-thread runtime and connection pool,
//! the fakes on theirs), and the floor's CPU per request is measured alike: that thread's CPU
//! clock (`CLOCK_THREAD_CPUTIME_ID`, the same on-CPU ns as schedstat) over its two legs, median
//! over the blocks of the workload. It is what a client sending both legs itself spends
//! (syscalls included; on loopback a send also runs the receiver's TCP path, charged to the
//! sender, as for the proxies); a proxy does at least that plus its server side. Then throughput at
//! concurrency 64 (1k chat, not streamed), the req/s curve of tokenonce at 1 and 2 worker
//! threads (its knee: the lowest concurrency reaching 90 % of the peak), and tokenonce's RSS
//! with 256 concurrent 37k-token requests in flight. Everything is on 127.0.0.1; every loop is
//! bounded in count and time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use support::{fmt_num, fmt_signed, pd_config, words, FakeConfig, FakeVllm, Settings, TokenOnce};

const MAX_TOKENS: u64 = 16;
const SIZES: [usize; 2] = [1_000, 37_000];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Peer {
    Floor,
    Tokenonce,
    NoReuse,
    NoSteal,
    Toy,
    Router,
}

const PEERS: [Peer; 6] = [Peer::Floor, Peer::Tokenonce, Peer::NoReuse, Peer::NoSteal, Peer::Toy, Peer::Router];

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Self::Floor => "(b) floor",
            Self::Tokenonce => "(a) tokenonce",
            Self::NoReuse => "(a0) tokenonce reuse off",
            Self::NoSteal => "(a1) tokenonce work_stealing = false",
            Self::Toy => "(c) toy proxy",
            Self::Router => "(d) vllm-router",
        }
    }
}

#[derive(Clone, Copy)]
struct Workload {
    chat: bool,
    stream: bool,
    words: usize,
}

impl Workload {
    fn label(self) -> String {
        format!(
            "{} {}k {}",
            if self.chat { "chat" } else { "completions" },
            self.words / 1000,
            if self.stream { "stream" } else { "non-stream" }
        )
    }
    fn path(self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }
}

/// A workload's client body and the floor's prefill body.
struct Bodies {
    client: Bytes,
    prefill: Bytes,
    client_json: Value,
}

impl Bodies {
    fn new(w: Workload) -> Self {
        let text = words(w.words, 0x9E37_79B9_7F4A_7C15 ^ w.words as u64);
        let mut client = if w.chat {
            json!({"model": "tiny-qwen3", "messages": [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": text}], "max_tokens": MAX_TOKENS, "temperature": 0})
        } else {
            json!({"model": "tiny-qwen3", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0})
        };
        if w.stream {
            client["stream"] = json!(true);
        }
        let mut prefill = client.clone();
        prefill["max_tokens"] = json!(1);
        prefill["stream"] = json!(false);
        prefill["return_token_ids"] = json!(true);
        prefill["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        Self {
            client: Bytes::from(serde_json::to_vec(&client).unwrap()),
            prefill: Bytes::from(serde_json::to_vec(&prefill).unwrap()),
            client_json: client,
        }
    }

    /// The floor's decode body: the client's body with the prefill's kv params and its ids in
    /// token-in form (chat: `kv_transfer_params.prompt_token_ids`; completions: `prompt`).
    fn decode(&self, chat: bool, prefill_answer: &[u8]) -> Bytes {
        let answer: Value = serde_json::from_slice(prefill_answer).unwrap();
        let mut body = self.client_json.clone();
        let mut kv = answer["kv_transfer_params"].clone();
        if chat {
            kv["prompt_token_ids"] = answer["prompt_token_ids"].clone();
        } else {
            body["prompt"] = answer["choices"][0]["prompt_token_ids"].clone();
        }
        body["kv_transfer_params"] = kv;
        Bytes::from(serde_json::to_vec(&body).unwrap())
    }
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

/// On-CPU ns of the calling thread so far (the kernel's `sum_exec_runtime`, as schedstat, but
/// brought up to date for a running thread, which its own schedstat is not).
fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok()))
        .unwrap_or(0)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A peer run as a child process (killed on drop, by its own handle).
struct External {
    child: Child,
    url: String,
}

impl Drop for External {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn peers_dir() -> PathBuf {
    std::env::var_os("TOKENONCE_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tokenonce-peers"))
}

/// Starts `peer` (toy or router) between the fakes, or says why it cannot.
fn spawn_external(peer: Peer, prefill: &FakeVllm, decode: &FakeVllm) -> Result<External, String> {
    let dir = peers_dir();
    let python = dir.join("venv/bin/python");
    let port = free_port();
    let mut command = match peer {
        Peer::Toy => {
            let script = dir.join("toy_proxy_server.py");
            if !script.exists() || !python.exists() {
                return Err(format!("{} or {} missing", script.display(), python.display()));
            }
            let mut c = Command::new(&python);
            c.arg(script).args(["--host", "127.0.0.1", "--port", &port.to_string()]);
            c.args(["--prefiller-host", "127.0.0.1", "--prefiller-port", &prefill.addr.port().to_string()]);
            c.args(["--decoder-host", "127.0.0.1", "--decoder-port", &decode.addr.port().to_string()]);
            c
        }
        Peer::Router => {
            let router = dir.join("venv/bin/vllm-router");
            if !router.exists() {
                return Err(format!("{} missing", router.display()));
            }
            let mut c = Command::new(router);
            c.args(["--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", &port.to_string()]);
            c.args(["--prefill", &format!("http://{}", prefill.host_port())]);
            c.args(["--decode", &format!("http://{}", decode.host_port())]);
            c.args(["--log-level", "warning", "--prometheus-host", "127.0.0.1"]);
            c.args(["--prometheus-port", &free_port().to_string()]);
            c
        }
        _ => unreachable!(),
    };
    let log = std::env::temp_dir().join(format!("tokenonce-peers-{peer:?}-{port}.log"));
    let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let child = command
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .map_err(|e| format!("cannot start: {e}"))?;
    eprintln!("peers: {} pid {} (log {})", peer.name(), child.id(), log.display());
    Ok(External { child, url: format!("http://127.0.0.1:{port}") })
}

struct Bench {
    client: reqwest::Client,
    prefill: String,
    decode: String,
}

/// The client of every request: HTTP/1.1, no proxy, `TCP_NODELAY`, a pool per host.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(128)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// One floor request: ms to the last byte of the decode (both legs, without the handoff
/// between them), the calling thread's on-CPU ns over the two legs, the decode's body.
struct FloorRun {
    ms: f64,
    cpu_ns: u64,
    body: Bytes,
}

type FloorJob = (Workload, Arc<Bodies>, tokio::sync::oneshot::Sender<Result<FloorRun, String>>);

/// The paired floor's client on an OS thread of its own, with its own current-thread runtime
/// and connection pool (so their connection tasks run there too): that thread runs nothing but
/// floor requests, one at a time, so its CPU clock counts only the floor client's work.
struct FloorThread {
    jobs: Option<tokio::sync::mpsc::UnboundedSender<FloorJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FloorThread {
    fn start(prefill: String, decode: String) -> Self {
        let (jobs, mut rx) = tokio::sync::mpsc::unbounded_channel::<FloorJob>();
        let thread = std::thread::Builder::new()
            .name("floor-client".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let bench = Bench { client: client(), prefill, decode };
                rt.block_on(async {
                    while let Some((w, b, reply)) = rx.recv().await {
                        let _ = reply.send(bench.floor(w, &b).await);
                    }
                });
            })
            .unwrap();
        Self { jobs: Some(jobs), thread: Some(thread) }
    }

    async fn floor(&self, w: Workload, b: &Arc<Bodies>) -> Result<FloorRun, String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let gone = || "floor thread gone".to_owned();
        self.jobs.as_ref().ok_or_else(gone)?.send((w, Arc::clone(b), reply)).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

impl Drop for FloorThread {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One timed exchange: ms to the last byte, and the body.
async fn post(client: &reqwest::Client, url: &str, body: Bytes) -> Result<(f64, Bytes), String> {
    let started = Instant::now();
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(|e| format!("POST {url}: body: {e}"))?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if !status.is_success() {
        return Err(format!("POST {url}: {status}: {}", String::from_utf8_lossy(&bytes[..bytes.len().min(300)])));
    }
    Ok((ms, bytes))
}

impl Bench {
    /// The floor: prefill, then decode, timed without the client's handoff work between. Its
    /// `cpu_ns` is this thread's over the two legs: meaningful only on a thread doing nothing
    /// else meanwhile ([`FloorThread`]); a concurrent caller ignores it.
    async fn floor(&self, w: Workload, b: &Bodies) -> Result<FloorRun, String> {
        let cpu = thread_cpu_ns();
        let (p_ms, answer) = post(&self.client, &format!("{}{}", self.prefill, w.path()), b.prefill.clone()).await?;
        let p_cpu = thread_cpu_ns().saturating_sub(cpu);
        let decode = b.decode(w.chat, &answer);
        let cpu = thread_cpu_ns();
        let (d_ms, body) = post(&self.client, &format!("{}{}", self.decode, w.path()), decode).await?;
        let cpu_ns = p_cpu + thread_cpu_ns().saturating_sub(cpu);
        Ok(FloorRun { ms: p_ms + d_ms, cpu_ns, body })
    }

    async fn via(&self, base: &str, w: Workload, b: &Bodies) -> Result<(f64, Bytes), String> {
        post(&self.client, &format!("{base}{}", w.path()), b.client.clone()).await
    }
}

/// A proxy under test: base URL and process id.
struct Target {
    peer: Peer,
    url: String,
    pid: u32,
}

/// Results of one (workload, proxy).
#[derive(Clone, Default)]
struct Cell {
    /// Proxy − floor, ms: p50, p99 of each side's samples.
    added: [f64; 2],
    /// Median of paired differences, ms.
    paired: f64,
    floor_p50: f64,
    cpu_us: f64,
    error: Option<String>,
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1]
}

fn well_formed(w: Workload, body: &[u8]) -> bool {
    if w.stream {
        body.ends_with(b"data: [DONE]\n\n")
    } else {
        serde_json::from_slice::<Value>(body).is_ok_and(|v| v["usage"]["completion_tokens"] == MAX_TOKENS)
    }
}

/// One workload's results: the floor's CPU µs per request (median over all its blocks, every
/// target's pairs pooled) and each proxy's cell.
struct Row {
    w: Workload,
    floor_cpu_us: f64,
    cells: Vec<(Peer, Cell)>,
}

/// Checks each target answers `w` well (3 requests), then measures them interleaved in
/// blocks: each round gives every target [`BLOCK`] requests in a row (after one untimed
/// request, so its threads and caches are warm, as under steady traffic), each request
/// paired with a floor request (on `floor`'s thread) right before it. A change in the
/// machine's load thus falls on all targets alike. CPU per request is the median over blocks
/// of (the block's on-CPU time ÷ its requests): a block where something else woke the proxy
/// does not move it. The floor's likewise, over its requests of each block.
async fn measure(
    bench: &Bench,
    floor_thread: &FloorThread,
    fakes: [&FakeVllm; 2],
    targets: &[Target],
    w: Workload,
    b: &Arc<Bodies>,
    rounds: usize,
) -> Row {
    let mut failed: Vec<Option<String>> = Vec::new();
    for t in targets {
        failed.push(warm(bench, t, w, b).await.err());
    }
    let n = targets.len();
    let (mut floor, mut proxy, mut cpu) = (vec![Vec::new(); n], vec![Vec::new(); n], vec![Vec::new(); n]);
    let mut floor_cpu = Vec::new();
    let started = Instant::now();
    let budget = Duration::from_secs(60 * n as u64);
    for _ in 0..rounds.div_ceil(BLOCK) {
        if started.elapsed() > budget {
            break;
        }
        for (i, t) in targets.iter().enumerate() {
            if failed[i].is_some() {
                continue;
            }
            if let Err(e) = bench.via(&t.url, w, b).await {
                failed[i] = Some(e);
                continue;
            }
            let (mut spent, mut floor_spent) = (0u64, 0u64);
            for _ in 0..BLOCK {
                let f = floor_thread.floor(w, b).await;
                let before = cpu_ns(t.pid);
                let p = bench.via(&t.url, w, b).await;
                spent += cpu_ns(t.pid).saturating_sub(before);
                match (f, p) {
                    (Ok(f), Ok((pm, _))) => {
                        floor[i].push(f.ms);
                        floor_spent += f.cpu_ns;
                        proxy[i].push(pm);
                    }
                    (Err(e), _) | (_, Err(e)) => failed[i] = Some(e),
                }
            }
            cpu[i].push(spent as f64 / 1e3 / BLOCK as f64);
            if failed[i].is_none() {
                floor_cpu.push(floor_spent as f64 / 1e3 / BLOCK as f64);
            }
        }
        // The fakes keep every request they got; a 37k-token round is megabytes.
        fakes.iter().for_each(|f| f.forget());
    }
    let cells = (0..n)
        .map(|i| match failed[i].take() {
            Some(e) => Cell { error: Some(e), ..Cell::default() },
            None => {
                let (p, f) = (&proxy[i], &floor[i]);
                let diffs: Vec<f64> = p.iter().zip(f).map(|(p, f)| p - f).collect();
                Cell {
                    added: [quantile(p, 0.5) - quantile(f, 0.5), quantile(p, 0.99) - quantile(f, 0.99)],
                    paired: quantile(&diffs, 0.5),
                    floor_p50: quantile(f, 0.5),
                    cpu_us: quantile(&cpu[i], 0.5),
                    error: None,
                }
            }
        })
        .collect::<Vec<_>>();
    Row { w, floor_cpu_us: quantile(&floor_cpu, 0.5), cells: targets.iter().map(|t| t.peer).zip(cells).collect() }
}

/// Requests a target gets in a row within a round of [`measure`].
const BLOCK: usize = 5;

/// Three requests through `t`, each answered well.
async fn warm(bench: &Bench, t: &Target, w: Workload, b: &Bodies) -> Result<(), String> {
    for _ in 0..3 {
        let (_, body) = bench.via(&t.url, w, b).await?;
        if !well_formed(w, &body) {
            return Err(format!("malformed answer: {}", String::from_utf8_lossy(&body[..body.len().min(200)])));
        }
    }
    Ok(())
}

/// `total` requests at `concurrency` through `url` (or the floor when `None`): req/s and
/// the proxy's CPU µs per request.
async fn throughput(
    bench: &Bench,
    target: Option<&Target>,
    w: Workload,
    b: &Bodies,
    concurrency: usize,
    total: usize,
) -> (f64, f64) {
    // Warm-up: one request per connection, so opening connections is not measured.
    futures_util::future::join_all((0..concurrency).map(|_| async {
        let _ = match target {
            Some(t) => bench.via(&t.url, w, b).await,
            None => bench.floor(w, b).await.map(|f| (f.ms, f.body)),
        };
    }))
    .await;
    let before = target.map_or(0, |t| cpu_ns(t.pid));
    let started = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let deadline = started + Duration::from_secs(30);
    let worker = || async {
        let mut done = 0usize;
        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total && Instant::now() < deadline {
            let r = match target {
                Some(t) => bench.via(&t.url, w, b).await,
                None => bench.floor(w, b).await.map(|f| (f.ms, f.body)),
            };
            if r.is_ok() {
                done += 1;
            }
        }
        done
    };
    let done: usize = futures_util::future::join_all((0..concurrency).map(|_| worker())).await.into_iter().sum();
    let secs = started.elapsed().as_secs_f64();
    let cpu = target.map_or(0, |t| cpu_ns(t.pid).saturating_sub(before));
    (done as f64 / secs, cpu as f64 / 1e3 / done.max(1) as f64)
}

fn tokenonce_binary() -> PathBuf {
    std::env::var_os("TOKENONCE_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tokenonce")), PathBuf::from)
}

async fn spawn_tokenonce(prefill: &FakeVllm, decode: &FakeVllm, reuse: bool, threads: u32) -> TokenOnce {
    spawn_tokenonce_with(prefill, decode, reuse, threads, true).await
}

async fn spawn_tokenonce_with(
    prefill: &FakeVllm,
    decode: &FakeVllm,
    reuse: bool,
    threads: u32,
    work_stealing: bool,
) -> TokenOnce {
    let server_extra = format!("work_stealing = {work_stealing}");
    let settings =
        Settings { health_interval_ms: 1000, log: "warn".into(), threads, server_extra, ..Settings::default() };
    let config = pd_config(prefill, decode, &format!("token_reuse = {reuse}"));
    let proxy = TokenOnce::spawn(&tokenonce_binary(), &config, &settings).await;
    proxy.wait_ready(200).await;
    proxy
}

/// Waits (bounded: 30 s) until `url` answers a small chat request with 200.
async fn wait_answering(client: &reqwest::Client, url: &str) -> Result<(), String> {
    let body = Bytes::from(
        serde_json::to_vec(
            &json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        )
        .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    while Instant::now() < deadline {
        match post(client, &format!("{url}/v1/chat/completions"), body.clone()).await {
            Ok(_) => return Ok(()),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!("not answering within 30 s: {last}"))
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() || b == 0.0 {
        "–".into()
    } else {
        format!("{:.2}×", a / b)
    }
}

struct Options {
    rounds: usize,
    quick: bool,
    /// Only workloads whose label contains this (`--only "chat 37k"`); skips the rest of the run.
    only: Option<String>,
    /// Only these proxies (`--peers a,a0,c,d`).
    peers: Option<String>,
}

fn options() -> Options {
    let mut o = Options { rounds: 60, quick: false, only: None, peers: None };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--rounds" => o.rounds = args.next().and_then(|v| v.parse::<usize>().ok()).expect("--rounds N").max(1),
            "--quick" => o.quick = true,
            "--only" => o.only = args.next(),
            "--peers" => o.peers = args.next(),
            other => eprintln!("peers: ignoring unknown argument {other:?}"),
        }
    }
    if o.quick {
        o.rounds = o.rounds.min(10);
    }
    o
}

fn main() {
    let opts = options();
    let run_started = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let fake_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fake-vllm")
        .enable_all()
        .build()
        .unwrap();
    let engine = FakeConfig { connector: true, ..FakeConfig::default() };
    let prefill = fake_rt.block_on(FakeVllm::start(engine.clone()));
    let decode = fake_rt.block_on(FakeVllm::start(engine));
    let bench = Bench {
        client: client(),
        prefill: format!("http://{}", prefill.host_port()),
        decode: format!("http://{}", decode.host_port()),
    };
    let floor_thread = FloorThread::start(bench.prefill.clone(), bench.decode.clone());
    rt.block_on(run(&opts, &bench, &floor_thread, &prefill, &decode));
    drop(floor_thread);
    println!("\nBench run time: {:.0} s (excluding the build).", run_started.elapsed().as_secs_f64());
    drop(fake_rt);
}

async fn run(opts: &Options, bench: &Bench, floor_thread: &FloorThread, prefill: &FakeVllm, decode: &FakeVllm) {
    let tok = spawn_tokenonce(prefill, decode, true, 2).await;
    let no_reuse = spawn_tokenonce(prefill, decode, false, 2).await;
    let no_steal = spawn_tokenonce_with(prefill, decode, true, 2, false).await;
    let mut externals = Vec::new();
    let mut absent = Vec::new();
    for peer in [Peer::Toy, Peer::Router] {
        match spawn_external(peer, prefill, decode) {
            Ok(x) => match wait_answering(&bench.client, &x.url).await {
                Ok(()) => externals.push((peer, x)),
                Err(e) => absent.push((peer, e)),
            },
            Err(e) => absent.push((peer, e)),
        }
    }
    for (peer, why) in &absent {
        println!(
            "**SKIPPED: {}** ({why}). Install the peers with `bash benches/peers.sh` (or point TOKENONCE_PEERS at them).\n",
            peer.name()
        );
    }
    let mut targets = vec![
        Target { peer: Peer::Tokenonce, url: tok.url.clone(), pid: tok.pid().unwrap() },
        Target { peer: Peer::NoReuse, url: no_reuse.url.clone(), pid: no_reuse.pid().unwrap() },
        Target { peer: Peer::NoSteal, url: no_steal.url.clone(), pid: no_steal.pid().unwrap() },
    ];
    for (peer, x) in &externals {
        targets.push(Target { peer: *peer, url: x.url.clone(), pid: x.child.id() });
    }
    if let Some(list) = &opts.peers {
        let wanted: Vec<&str> = list.split(',').collect();
        targets.retain(|t| wanted.iter().any(|w| t.peer.name().starts_with(&format!("({w})"))));
    }
    for t in &targets {
        eprintln!("peers: {} pid {}", t.peer.name(), t.pid);
    }
    header(opts);

    // Latency and CPU per workload.
    let mut rows: Vec<Row> = Vec::new();
    for &words_n in &SIZES {
        for chat in [true, false] {
            for stream in [false, true] {
                let w = Workload { chat, stream, words: words_n };
                if opts.only.as_ref().is_some_and(|o| !w.label().contains(o.as_str())) {
                    continue;
                }
                let b = Arc::new(Bodies::new(w));
                let rounds = if words_n > 10_000 { (opts.rounds / 4).max(5) } else { opts.rounds };
                eprintln!("peers: {} ...", w.label());
                rows.push(measure(bench, floor_thread, [prefill, decode], &targets, w, &b, rounds).await);
            }
        }
    }
    print_latency(&rows);
    print_cpu(&rows);
    goals(&rows);
    if opts.only.is_some() {
        return;
    }

    // Throughput at concurrency 64.
    let w = Workload { chat: true, stream: false, words: 1_000 };
    let b = Bodies::new(w);
    let total = if opts.quick { 128 } else { 640 };
    println!("\n### Throughput at concurrency 64 ({}, {total} requests)\n", w.label());
    println!("| proxy | req/s | ÷ floor | proxy CPU µs/req under load |\n|---|---:|---:|---:|");
    let (floor_rps, _) = throughput(bench, None, w, &b, 64, total).await;
    println!("| {} | {} | 1.00× | – |", Peer::Floor.name(), fmt_num(floor_rps));
    for t in &targets {
        let (rps, cpu) = throughput(bench, Some(t), w, &b, 64, total).await;
        println!("| {} | {} | {} | {} |", t.peer.name(), fmt_num(rps), ratio(rps, floor_rps), fmt_num(cpu));
        prefill.forget();
        decode.forget();
    }
    for peer in PEERS.iter().filter(|p| absent.iter().any(|(a, _)| a == *p)) {
        println!("| {} | absent | | |", peer.name());
    }
    drop(no_reuse);
    drop(no_steal);
    drop(externals);

    knee(opts, bench, prefill, decode, &b, w).await;
    drop(tok);
    rss_256(opts, bench, prefill, decode).await;
}

fn header(opts: &Options) {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned()))
        .unwrap_or_default();
    println!("# tokenonce side by side with its peers\n");
    println!("- command: `cargo bench --bench peers{}`", if opts.quick { " -- --quick" } else { "" });
    println!("- commit {}; tokenonce binary {}", git(&["rev-parse", "--short", "HEAD"]), tokenonce_binary().display());
    println!(
        "- {} CPUs ({cpu}); tokenonce threads = 2, log warn; in the bench process: fakes on one 1-worker runtime, the proxies' client on one thread, the paired floor's client on another",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    println!(
        "- {} requests per proxy and workload at 1k ({} at 37k), interleaved across proxies in blocks of {BLOCK}, each after a floor request; CPU = median over blocks; max_tokens {MAX_TOKENS}\n",
        opts.rounds,
        (opts.rounds / 4).max(5)
    );
}

fn cell(cells: &[(Peer, Cell)], peer: Peer) -> Option<&Cell> {
    cells.iter().find(|(p, c)| *p == peer && c.error.is_none()).map(|(_, c)| c)
}

fn print_latency(rows: &[Row]) {
    println!("### Latency added over the floor (ms, client wall clock to the last byte: p50 / p99; paired median)\n");
    println!(
        "| workload | floor p50 | (a) tokenonce | (a0) reuse off | (a1) no stealing | (c) toy | (d) router |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for Row { w, cells, .. } in rows {
        let floor = cells.iter().find_map(|(_, c)| c.error.is_none().then_some(c.floor_p50)).unwrap_or(f64::NAN);
        let mut line = format!("| {} | {} |", w.label(), fmt_num(floor));
        for peer in [Peer::Tokenonce, Peer::NoReuse, Peer::NoSteal, Peer::Toy, Peer::Router] {
            line.push_str(&match cells.iter().find(|(p, _)| *p == peer) {
                None => " absent |".into(),
                Some((_, c)) if c.error.is_some() => format!(" FAILED: {} |", c.error.as_deref().unwrap_or("")),
                Some((_, c)) => {
                    format!(" {} / {} ({}) |", fmt_signed(c.added[0]), fmt_signed(c.added[1]), fmt_signed(c.paired))
                }
            });
        }
        println!("{line}");
    }
}

fn print_cpu(rows: &[Row]) {
    println!(
        "\n### CPU per request (µs; a proxy: all threads of its process; (b) floor: its client thread over the two legs)\n"
    );
    println!(
        "| workload | (b) floor | (a) tokenonce | (a0) reuse off | (a1) no stealing | (c) toy | (d) router | (a) ÷ (b) | (a) ÷ (a0) | (a) ÷ (d) | (a) ÷ (c) | (a1) ÷ (a) | (a1) ÷ (d) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for Row { w, floor_cpu_us: b, cells } in rows {
        let v = |p| cell(cells, p).map_or(f64::NAN, |c| c.cpu_us);
        let (a, a0, a1, c, d) = (v(Peer::Tokenonce), v(Peer::NoReuse), v(Peer::NoSteal), v(Peer::Toy), v(Peer::Router));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            w.label(),
            fmt_num(*b),
            fmt_num(a),
            fmt_num(a0),
            fmt_num(a1),
            fmt_num(c),
            fmt_num(d),
            ratio(a, *b),
            ratio(a, a0),
            ratio(a, d),
            ratio(a, c),
            ratio(a1, a),
            ratio(a1, d)
        );
    }
}

/// The goals, checked against this run.
fn goals(rows: &[Row]) {
    println!("\n### Goals (issue 12), this run\n");
    let row = |chat: bool, stream: bool, words: usize| {
        rows.iter().find(|r| r.w.chat == chat && r.w.stream == stream && r.w.words == words)
    };
    let get = |chat: bool, stream: bool, words: usize, peer: Peer| {
        row(chat, stream, words).and_then(|r| cell(&r.cells, peer).cloned())
    };
    let check = |what: String, value: Option<f64>, limit: f64| match value {
        Some(v) if !v.is_nan() => {
            println!(
                "- {} {what}: {} (goal ≤ {})",
                if v <= limit { "MET" } else { "NOT MET" },
                fmt_num(v),
                fmt_num(limit)
            )
        }
        _ => println!("- UNKNOWN {what}: not measured"),
    };
    for stream in [false, true] {
        let s = if stream { "streamed" } else { "non-streamed" };
        let a = get(true, stream, 37_000, Peer::Tokenonce);
        let a0 = get(true, stream, 37_000, Peer::NoReuse);
        let d = get(true, stream, 37_000, Peer::Router);
        check(format!("37k chat {s}: CPU reuse on ÷ off"), a.as_ref().zip(a0).map(|(a, o)| a.cpu_us / o.cpu_us), 1.5);
        check(format!("37k chat {s}: added p50 ms"), a.as_ref().map(|a| a.added[0]), 0.5);
        check(format!("37k chat {s}: added p99 ms"), a.as_ref().map(|a| a.added[1]), 2.0);
        check(format!("37k chat {s}: CPU ÷ router"), a.as_ref().zip(d).map(|(a, d)| a.cpu_us / d.cpu_us), 0.5);
        let a = get(true, stream, 1_000, Peer::Tokenonce);
        match row(true, stream, 1_000).map(|r| r.floor_cpu_us).filter(|v| !v.is_nan()) {
            Some(b) => println!(
                "- INFO 1k chat {s}: floor CPU µs: {} (a client sending both legs itself; a proxy spends at least this plus its server side)",
                fmt_num(b)
            ),
            None => println!("- UNKNOWN 1k chat {s}: floor CPU µs: not measured"),
        }
        check(format!("1k chat {s}: CPU µs"), a.as_ref().map(|a| a.cpu_us), if stream { 150.0 } else { 100.0 });
        let d = get(true, stream, 1_000, Peer::Router);
        let c = get(true, stream, 1_000, Peer::Toy);
        check(format!("1k chat {s}: CPU ÷ router"), a.as_ref().zip(d).map(|(a, d)| a.cpu_us / d.cpu_us), 0.25);
        check(format!("1k chat {s}: CPU ÷ toy"), a.as_ref().zip(c).map(|(a, c)| a.cpu_us / c.cpu_us), 0.1);
        let a1 = get(true, stream, 1_000, Peer::NoSteal);
        let d = get(true, stream, 1_000, Peer::Router);
        let limit = if stream { 150.0 } else { 100.0 };
        check(format!("1k chat {s}, work_stealing = false: CPU µs"), a1.as_ref().map(|a| a.cpu_us), limit);
        check(
            format!("1k chat {s}, work_stealing = false: CPU ÷ router"),
            a1.as_ref().zip(d).map(|(a, d)| a.cpu_us / d.cpu_us),
            0.25,
        );
    }
}

/// tokenonce's req/s against concurrency at 1 and 2 worker threads; the knee.
async fn knee(opts: &Options, bench: &Bench, prefill: &FakeVllm, decode: &FakeVllm, b: &Bodies, w: Workload) {
    println!("\n### tokenonce req/s by concurrency ({}; knee = lowest concurrency at ≥ 90 % of the peak)\n", w.label());
    let levels = [1usize, 2, 4, 8, 16, 32, 64];
    println!(
        "| server.threads | {} | peak | knee |\n|---|{}---:|---:|",
        levels.map(|c| format!("c={c}")).join(" | "),
        "---:|".repeat(levels.len())
    );
    for threads in [1u32, 2] {
        let proxy = spawn_tokenonce(prefill, decode, true, threads).await;
        let t = Target { peer: Peer::Tokenonce, url: proxy.url.clone(), pid: proxy.pid().unwrap() };
        let mut rps = Vec::new();
        for &c in &levels {
            let total = if opts.quick { 32.max(c * 2) } else { 200.max(c * 4) };
            rps.push(throughput(bench, Some(&t), w, b, c, total).await.0);
            prefill.forget();
            decode.forget();
        }
        let peak = rps.iter().copied().fold(0.0, f64::max);
        let knee = levels.iter().zip(&rps).find(|(_, &r)| r >= 0.9 * peak).map_or(0, |(c, _)| *c);
        println!(
            "| {threads} | {} | {} | c={knee} |",
            rps.iter().map(|r| fmt_num(*r)).collect::<Vec<_>>().join(" | "),
            fmt_num(peak)
        );
    }
}

/// tokenonce's RSS with 256 concurrent 37k-token chat requests held in flight at the decode.
async fn rss_256(opts: &Options, bench: &Bench, prefill: &FakeVllm, decode: &FakeVllm) {
    let n = if opts.quick { 32 } else { 256 };
    let proxy = spawn_tokenonce(prefill, decode, true, 2).await;
    let pid = proxy.pid().unwrap();
    let w = Workload { chat: true, stream: false, words: 37_000 };
    let b = Bodies::new(w);
    let _ = bench.via(&proxy.url, w, &b).await;
    let idle = rss_kib(pid);
    decode.configure(|c| c.delay = Duration::from_secs(3));
    let started = Instant::now();
    let peak = std::sync::atomic::AtomicU64::new(idle);
    let done = std::sync::atomic::AtomicUsize::new(0);
    let sampler = async {
        while done.load(std::sync::atomic::Ordering::Relaxed) < n && started.elapsed() < Duration::from_secs(60) {
            peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let requests = futures_util::future::join_all((0..n).map(|_| async {
        let ok = bench.via(&proxy.url, w, &b).await.is_ok();
        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ok
    }));
    let (oks, ()) = tokio::join!(requests, sampler);
    decode.configure(|c| c.delay = Duration::ZERO);
    prefill.forget();
    decode.forget();
    let ok = oks.iter().filter(|o| **o).count();
    println!(
        "\n### Memory\n\n- tokenonce RSS with {n} concurrent 37k-token chat requests held 3 s at the decode: peak {:.1} MiB \
         (idle after one request {:.1} MiB; {ok}/{n} answered 200; {:.1} s)",
        peak.into_inner() as f64 / 1024.0,
        idle as f64 / 1024.0,
        started.elapsed().as_secs_f64()
    );
}
