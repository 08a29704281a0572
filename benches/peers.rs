//! Side-by-side bench: tokenonce next to its peers on the same fake engines and requests.
//!
//! Run: `bash benches/peers.sh` once (installs the peers outside the repo), then
//! `cargo bench --bench peers -- --rounds N` (default 10; `--quick` a short smoke run,
//! `--only "chat 37k"`, `--peers a,a0,d`, `--baseline PATH` another tokenonce binary measured
//! beside this one as (a-), `--profile-only "chat 1k non-stream" --seconds S --pid-file F`
//! only a steady load on tokenonce for a profiler (`--profile-as a0` or `a1`: on that variant),
//! `--knee` also tokenonce's req/s curve, `--instances K` the CPU section K times over, each
//! with every proxy started afresh, rounds pooled, `--load-only` only the under-load section,
//! `--load-rounds N` its rounds, `--cached-tokens N` the fake prefill reports N cached tokens).
//!
//! Proxies, all between the same two in-process fake vLLM engines (`tests/support/fake_vllm.rs`),
//! each started once for the whole run:
//! - (b) floor: the client sends the prefill, then the decode with the echoed ids itself (the
//!   bench's own handoff work between the legs is excluded from its time and its CPU); (b0) the
//!   same client sending the text decode (no ids asked, none sent): (b) − (b0) is what moving
//!   the ids' bytes costs a client that does nothing else, beside (a) − (a0);
//! - (a) tokenonce (orchestrate, token reuse on), (a0) the same with reuse off (a plain relay
//!   of both legs: the handoff's cost is (a) ÷ (a0)), (a1) reuse on and
//!   `server.work_stealing = false`, (a-) reuse on from `--baseline`'s binary;
//! - (c) vLLM's `toy_proxy_server.py` (Python, FastAPI + httpx, no reuse);
//! - (d) vLLM Router (PyPI `vllm-router`, Rust, `--vllm-pd-disaggregation`, no reuse).
//!
//! The peers are found in `TOKENONCE_PEERS` (default `~/.cache/tokenonce-peers`: `venv/` and
//! `toy_proxy_server.py`, what `benches/peers.sh` installs); a missing one is skipped loudly,
//! its columns printed as "absent".
//!
//! Rounds interleave: each round gives every proxy a batch of every workload (chat and
//! completions, streamed and not, ~1k and ~37k tokens), sequential requests after one untimed,
//! the order of workloads rotated by one each round and the proxies' shuffled afresh for each
//! batch, so the machine's load (on shared VMs host steal time swings from 1 % to 27 % within
//! minutes) falls on all alike and no proxy always follows the same one.
//! A proxy's CPU per request in a round = the on-CPU time of all its process's threads
//! (`/proc/PID/task/*/schedstat`, ns) over the batch ÷ its requests; the floor's, its client
//! thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`) over its two legs: what a client sending both
//! legs itself spends (on loopback a send also runs the receiver's TCP path, charged to the
//! sender, as for the proxies). Reported: per proxy and workload the median over rounds with
//! its interquartile range, the ratios computed within each round (median and IQR), the host
//! steal time over the run (`/proc/stat`), client latency, then throughput and latency at 64 and
//! 256 concurrent clients (interleaved rounds too; tokenonce ÷ vllm-router within each round),
//! tokenonce's RSS with 256 concurrent 37k-token requests in flight, and with `--knee` its
//! req/s curve at 1 and 2 worker threads. Everything is on 127.0.0.1; every loop is bounded in
//! count and time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use support::{fmt_num, pd_config, words, FakeConfig, FakeVllm, Settings, TokenOnce};

const MAX_TOKENS: u64 = 16;
const SIZES: [usize; 2] = [1_000, 37_000];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Peer {
    Floor,
    FloorText,
    Tokenonce,
    NoReuse,
    NoSteal,
    Baseline,
    Toy,
    Router,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Self::Floor => "(b) floor",
            Self::FloorText => "(b0) floor, text decode",
            Self::Tokenonce => "(a) tokenonce",
            Self::NoReuse => "(a0) plain relay (reuse off)",
            Self::NoSteal => "(a1) work_stealing = false",
            Self::Baseline => "(a-) baseline binary",
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

/// A workload's client body and the floor's prefill bodies.
struct Bodies {
    client: Bytes,
    prefill: Bytes,
    /// The prefill body without `return_token_ids`, for the text decode (b0).
    prefill_text: Bytes,
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
        prefill["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        let prefill_text = Bytes::from(serde_json::to_vec(&prefill).unwrap());
        prefill["return_token_ids"] = json!(true);
        Self {
            prefill_text,
            client: Bytes::from(serde_json::to_vec(&client).unwrap()),
            prefill: Bytes::from(serde_json::to_vec(&prefill).unwrap()),
            client_json: client,
        }
    }

    /// The floor's decode body: the client's body with the prefill's kv params and, when
    /// `ids`, its ids in token-in form (chat: `kv_transfer_params.prompt_token_ids`;
    /// completions: `prompt`).
    fn decode(&self, chat: bool, ids: bool, prefill_answer: &[u8]) -> Bytes {
        let answer: Value = serde_json::from_slice(prefill_answer).unwrap();
        let mut body = self.client_json.clone();
        let mut kv = answer["kv_transfer_params"].clone();
        if ids && chat {
            kv["prompt_token_ids"] = answer["prompt_token_ids"].clone();
        } else if ids {
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

/// A floor request: its workload and bodies, whether it hands the ids over, where to answer.
type FloorJob = (Workload, Arc<Bodies>, bool, tokio::sync::oneshot::Sender<Result<FloorRun, String>>);

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
                    while let Some((w, b, ids, reply)) = rx.recv().await {
                        let _ = reply.send(bench.floor(w, &b, ids).await);
                    }
                });
            })
            .unwrap();
        Self { jobs: Some(jobs), thread: Some(thread) }
    }

    async fn floor(&self, w: Workload, b: &Arc<Bodies>, ids: bool) -> Result<FloorRun, String> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let gone = || "floor thread gone".to_owned();
        self.jobs.as_ref().ok_or_else(gone)?.send((w, Arc::clone(b), ids, reply)).map_err(|_| gone())?;
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
    /// The floor: prefill, then decode (token-in when `ids`, else text), timed without the
    /// client's handoff work between. Its `cpu_ns` is this thread's over the two legs:
    /// meaningful only on a thread doing nothing else meanwhile ([`FloorThread`]); a concurrent
    /// caller ignores it.
    async fn floor(&self, w: Workload, b: &Bodies, ids: bool) -> Result<FloorRun, String> {
        let cpu = thread_cpu_ns();
        let prefill = if ids { b.prefill.clone() } else { b.prefill_text.clone() };
        let (p_ms, answer) = post(&self.client, &format!("{}{}", self.prefill, w.path()), prefill).await?;
        let p_cpu = thread_cpu_ns().saturating_sub(cpu);
        let decode = b.decode(w.chat, ids, &answer);
        let cpu = thread_cpu_ns();
        let (d_ms, body) = post(&self.client, &format!("{}{}", self.decode, w.path()), decode).await?;
        let cpu_ns = p_cpu + thread_cpu_ns().saturating_sub(cpu);
        Ok(FloorRun { ms: p_ms + d_ms, cpu_ns, body })
    }

    async fn via(&self, base: &str, w: Workload, b: &Bodies) -> Result<(f64, Bytes), String> {
        post(&self.client, &format!("{base}{}", w.path()), b.client.clone()).await
    }
}

/// A proxy under test: base URL and process id (the floor has neither: its requests run on
/// [`FloorThread`], its CPU is that thread's clock).
struct Target {
    peer: Peer,
    url: String,
    pid: u32,
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1]
}

/// `median [p25–p75]` of `v`.
fn med_iqr(v: &[f64]) -> String {
    let m = quantile(v, 0.5);
    if m.is_nan() {
        return "–".into();
    }
    format!("{} [{}–{}]", fmt_num(m), fmt_num(quantile(v, 0.25)), fmt_num(quantile(v, 0.75)))
}

fn well_formed(w: Workload, body: &[u8]) -> bool {
    if w.stream {
        body.ends_with(b"data: [DONE]\n\n")
    } else {
        serde_json::from_slice::<Value>(body).is_ok_and(|v| v["usage"]["completion_tokens"] == MAX_TOKENS)
    }
}

/// The host's CPU time from `/proc/stat`'s `cpu` line: (steal, all), in ticks.
fn host_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|x| x.parse().ok())
        .collect();
    (v.get(7).copied().unwrap_or(0), v.iter().sum())
}

/// Steal time between two [`host_ticks`] readings, % of all CPU time.
fn steal_pct(before: (u64, u64), after: (u64, u64)) -> f64 {
    let all = after.1.saturating_sub(before.1);
    if all == 0 {
        return f64::NAN;
    }
    after.0.saturating_sub(before.0) as f64 * 100.0 / all as f64
}

/// Requests a target gets in a row per workload and round (after one untimed one).
fn batch(w: Workload, quick: bool) -> usize {
    match (w.words > 10_000, quick) {
        (true, true) => 2,
        (true, false) => 4,
        (false, true) => 4,
        (false, false) => 10,
    }
}

/// One (workload, target) over the run: CPU µs per request of each round, and every
/// request's client latency (ms to the last byte).
#[derive(Clone, Default)]
struct Series {
    cpu_us: Vec<f64>,
    ms: Vec<f64>,
    error: Option<String>,
}

/// Everything the interleaved rounds measured: `series[workload][target]`, and the steal time
/// of each round.
#[derive(Clone)]
struct Measured {
    workloads: Vec<Workload>,
    peers: Vec<Peer>,
    series: Vec<Vec<Series>>,
    round_steal: Vec<f64>,
    steal: f64,
}

impl Measured {
    fn get(&self, w: usize, peer: Peer) -> Option<&Series> {
        let i = self.peers.iter().position(|p| *p == peer)?;
        self.series[w].get(i).filter(|s| s.error.is_none())
    }

    /// The per-round ratios `a ÷ b` of workload `w`'s CPU per request.
    fn ratios(&self, w: usize, a: Peer, b: Peer) -> Vec<f64> {
        self.per_round(w, a, b, |a, b| a / b)
    }

    /// Adds another instance's rounds (the same workloads; its proxies matched by name).
    fn absorb(&mut self, other: &Measured) {
        for (wi, row) in self.series.iter_mut().enumerate() {
            for (pi, s) in row.iter_mut().enumerate() {
                let theirs =
                    other.peers.iter().position(|p| *p == self.peers[pi]).and_then(|i| other.series[wi].get(i));
                match theirs {
                    Some(t) if t.error.is_none() => {
                        s.cpu_us.extend(&t.cpu_us);
                        s.ms.extend(&t.ms);
                    }
                    Some(t) => s.error = s.error.take().or_else(|| t.error.clone()),
                    None => s.error = s.error.take().or_else(|| Some("absent in a later instance".into())),
                }
            }
        }
        self.round_steal.extend(&other.round_steal);
    }

    /// The per-round differences `a − b` of workload `w`'s CPU µs per request.
    fn differences(&self, w: usize, a: Peer, b: Peer) -> Vec<f64> {
        self.per_round(w, a, b, |a, b| a - b)
    }

    /// `op(a, b)` of workload `w`'s CPU µs per request, round by round.
    fn per_round(&self, w: usize, a: Peer, b: Peer, op: fn(f64, f64) -> f64) -> Vec<f64> {
        match (self.get(w, a), self.get(w, b)) {
            (Some(a), Some(b)) => a.cpu_us.iter().zip(&b.cpu_us).map(|(a, b)| op(*a, *b)).collect(),
            _ => Vec::new(),
        }
    }
}

/// `0..n` in an order drawn afresh for each `round` and `salt` (a seeded Fisher-Yates
/// shuffle, the same every run): no proxy always follows the same one. A rotation kept the
/// neighbours fixed, and two processes of one binary then differed by 3-6 % per request.
fn shuffled(n: usize, round: usize, salt: usize) -> Vec<usize> {
    let mut state =
        (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (salt as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut next = || {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    order
}

/// Who a batch goes through: the floor's client (token-in decode when `ids`) or a proxy.
#[derive(Clone, Copy)]
enum Slot<'a> {
    Floor { ids: bool },
    Proxy(&'a Target),
}

/// One batch of `n` requests of `w` through `slot`, after one untimed: its CPU µs per request
/// and each request's ms.
async fn one_batch(
    bench: &Bench,
    floor_thread: &FloorThread,
    slot: Slot<'_>,
    w: Workload,
    b: &Arc<Bodies>,
    n: usize,
) -> Result<(f64, Vec<f64>), String> {
    let mut ms = Vec::with_capacity(n);
    match slot {
        Slot::Floor { ids } => {
            floor_thread.floor(w, b, ids).await?;
            let mut spent = 0u64;
            for _ in 0..n {
                let f = floor_thread.floor(w, b, ids).await?;
                spent += f.cpu_ns;
                ms.push(f.ms);
            }
            Ok((spent as f64 / 1e3 / n as f64, ms))
        }
        Slot::Proxy(t) => {
            bench.via(&t.url, w, b).await?;
            let before = cpu_ns(t.pid);
            for _ in 0..n {
                ms.push(bench.via(&t.url, w, b).await?.0);
            }
            Ok((cpu_ns(t.pid).saturating_sub(before) as f64 / 1e3 / n as f64, ms))
        }
    }
}

/// Checks each target answers `w` well (3 requests), then runs `rounds` interleaved rounds:
/// each round gives every target a batch of every workload, workloads in an order rotated by
/// one each round and targets in one [`shuffled`] for each, so a change in the machine's load
/// falls on all alike and no proxy always follows the same one. CPU per request of a round = the batch's on-CPU time of
/// all the proxy's threads (`/proc/PID/task/*/schedstat`) ÷ its requests; ratios are taken
/// within a round, then their median over rounds.
async fn measure(
    opts: &Options,
    bench: &Bench,
    floor_thread: &FloorThread,
    fakes: [&FakeVllm; 2],
    targets: &[Target],
    workloads: &[Workload],
) -> Measured {
    let bodies: Vec<Arc<Bodies>> = workloads.iter().map(|w| Arc::new(Bodies::new(*w))).collect();
    // Index 0 is the floor, 1 the floor's text decode; 2.. are `targets`.
    const FLOORS: usize = 2;
    let n = targets.len() + FLOORS;
    let slot_of = |ti: usize| match ti.checked_sub(FLOORS) {
        Some(i) => Slot::Proxy(&targets[i]),
        None => Slot::Floor { ids: ti == 0 },
    };
    let mut series = vec![vec![Series::default(); n]; workloads.len()];
    for (wi, (w, b)) in workloads.iter().zip(&bodies).enumerate() {
        for (ti, t) in targets.iter().enumerate() {
            if let Err(e) = warm(bench, t, *w, b).await {
                series[wi][ti + FLOORS].error = Some(e);
            }
        }
    }
    let (mut round_steal, run_start) = (Vec::new(), host_ticks());
    let started = Instant::now();
    let budget = Duration::from_secs(600);
    for round in 0..opts.rounds {
        if started.elapsed() > budget {
            eprintln!("peers: stopping after {round} rounds (the 10 min budget)");
            break;
        }
        let round_start = host_ticks();
        for k in 0..workloads.len() {
            let wi = (k + round) % workloads.len();
            let (w, b) = (workloads[wi], &bodies[wi]);
            for ti in shuffled(n, round, k) {
                if series[wi][ti].error.is_some() {
                    continue;
                }
                match one_batch(bench, floor_thread, slot_of(ti), w, b, batch(w, opts.quick)).await {
                    Ok((cpu, ms)) => {
                        series[wi][ti].cpu_us.push(cpu);
                        series[wi][ti].ms.extend(ms);
                    }
                    Err(e) => series[wi][ti].error = Some(e),
                }
            }
            // The fakes keep every request they got; a 37k-token round is megabytes.
            fakes.iter().for_each(|f| f.forget());
        }
        round_steal.push(steal_pct(round_start, host_ticks()));
        eprintln!("peers: round {}/{} done ({:.0} s)", round + 1, opts.rounds, started.elapsed().as_secs_f64());
    }
    let mut peers = vec![Peer::Floor, Peer::FloorText];
    peers.extend(targets.iter().map(|t| t.peer));
    Measured { workloads: workloads.to_vec(), peers, series, round_steal, steal: steal_pct(run_start, host_ticks()) }
}

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

/// What [`throughput`] measured: req/s, the proxy's CPU µs per request, and every request's
/// client latency in ms.
#[derive(Clone)]
struct Load {
    rps: f64,
    cpu_us: f64,
    ms: Vec<f64>,
}

/// `total` requests at `concurrency` through `target` (or the floor when `None`); with `warm`,
/// one untimed request per connection first, so opening connections is not measured.
async fn throughput(
    bench: &Bench,
    target: Option<&Target>,
    w: Workload,
    b: &Bodies,
    (concurrency, total): (usize, usize),
    warm: bool,
) -> Load {
    if warm {
        futures_util::future::join_all((0..concurrency).map(|_| async {
            let _ = match target {
                Some(t) => bench.via(&t.url, w, b).await,
                None => bench.floor(w, b, true).await.map(|f| (f.ms, f.body)),
            };
        }))
        .await;
    }
    let before = target.map_or(0, |t| cpu_ns(t.pid));
    let started = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let deadline = started + Duration::from_secs(30);
    let worker = || async {
        let mut ms = Vec::new();
        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total && Instant::now() < deadline {
            let r = match target {
                Some(t) => bench.via(&t.url, w, b).await,
                None => bench.floor(w, b, true).await.map(|f| (f.ms, f.body)),
            };
            if let Ok((m, _)) = r {
                ms.push(m);
            }
        }
        ms
    };
    let ms: Vec<f64> =
        futures_util::future::join_all((0..concurrency).map(|_| worker())).await.into_iter().flatten().collect();
    let secs = started.elapsed().as_secs_f64();
    let cpu = target.map_or(0, |t| cpu_ns(t.pid).saturating_sub(before));
    Load { rps: ms.len() as f64 / secs, cpu_us: cpu as f64 / 1e3 / ms.len().max(1) as f64, ms }
}

/// Rounds of the under-load section, and the requests a proxy gets per round and connection.
fn load_rounds(quick: bool) -> (usize, usize) {
    if quick {
        (2, 1)
    } else {
        (6, 4)
    }
}

/// Throughput and latency at 64 and 256 concurrent clients (chat 1k non-streamed), in
/// interleaved rounds as the CPU section: each round gives the floor and every proxy a batch
/// (clients × a few requests), in an order [`shuffled`] each round, so load drift falls on
/// all alike. Reported per proxy: req/s and CPU per request, median over rounds [IQR]; p50
/// and p99 of every timed request of the run; then tokenonce ÷ the router within each round.
async fn under_load(opts: &Options, bench: &Bench, targets: &[Target], prefill: &FakeVllm, decode: &FakeVllm) {
    let w = Workload { chat: true, stream: false, words: 1_000 };
    let b = Bodies::new(w);
    let (rounds, per_client) = load_rounds(opts.quick);
    let rounds = opts.load_rounds.unwrap_or(rounds);
    println!(
        "\n### Under load ({}; {rounds} interleaved rounds, each a batch of {per_client} × clients requests per proxy, orders shuffled; req/s, ÷ floor and CPU µs per request: median over rounds [IQR]; p50 and p99: of all rounds' requests, ms)\n",
        w.label()
    );
    println!(
        "| clients | proxy | req/s | ÷ floor | p50 ms | p99 ms | CPU µs/req |\n|---:|---|---:|---:|---:|---:|---:|"
    );
    // Slot 0 is the floor, slot i + 1 is targets[i].
    let slots = targets.len() + 1;
    let target_of = |slot: usize| slot.checked_sub(1).and_then(|i| targets.get(i));
    // tokenonce within each round against the router and against the build before.
    let pairs = [(Peer::Router, "(d) vllm-router"), (Peer::Baseline, "(a-) the baseline binary")];
    let mut versus: Vec<Vec<String>> = vec![Vec::new(); pairs.len()];
    for concurrency in [64usize, 256] {
        let mut loads: Vec<Vec<Load>> = vec![Vec::new(); slots];
        for round in 0..rounds {
            for slot in shuffled(slots, round, concurrency) {
                let t = target_of(slot);
                // The toy proxy answers ~60 req/s: a tenth of the requests.
                let n = concurrency * per_client / if t.is_some_and(|t| t.peer == Peer::Toy) { 10 } else { 1 };
                loads[slot].push(throughput(bench, t, w, &b, (concurrency, n), round == 0).await);
                prefill.forget();
                decode.forget();
            }
        }
        let floor_rps: Vec<f64> = loads[0].iter().map(|l| l.rps).collect();
        for (slot, runs) in loads.iter().enumerate() {
            let name = target_of(slot).map_or(Peer::Floor.name(), |t| t.peer.name());
            let rps: Vec<f64> = runs.iter().map(|l| l.rps).collect();
            let per_floor: Vec<f64> = rps.iter().zip(&floor_rps).map(|(a, f)| a / f).collect();
            let ms: Vec<f64> = runs.iter().flat_map(|l| l.ms.iter().copied()).collect();
            let cpu = match slot {
                0 => "–".to_owned(),
                _ => med_iqr(&runs.iter().map(|l| l.cpu_us).collect::<Vec<_>>()),
            };
            println!(
                "| {concurrency} | {name} | {} | {} | {} | {} | {cpu} |",
                med_iqr(&rps),
                med_iqr(&per_floor),
                fmt_num(quantile(&ms, 0.5)),
                fmt_num(quantile(&ms, 0.99))
            );
        }
        let slot_of = |peer: Peer| (1..slots).find(|&s| target_of(s).is_some_and(|t| t.peer == peer));
        for ((other, _), rows) in pairs.iter().zip(&mut versus) {
            let (Some(a), Some(d)) = (slot_of(Peer::Tokenonce), slot_of(*other)) else { continue };
            let per_round = |f: &dyn Fn(&Load) -> f64| -> Vec<f64> {
                loads[a].iter().zip(&loads[d]).map(|(a, d)| f(a) / f(d)).collect()
            };
            rows.push(format!(
                "| {concurrency} | {} | {} | {} | {} |",
                med_iqr(&per_round(&|l| l.rps)),
                med_iqr(&per_round(&|l| quantile(&l.ms, 0.5))),
                med_iqr(&per_round(&|l| quantile(&l.ms, 0.99))),
                med_iqr(&per_round(&|l| l.cpu_us))
            ));
        }
    }
    for ((_, name), rows) in pairs.iter().zip(versus) {
        if rows.is_empty() {
            continue;
        }
        println!("\n(a) tokenonce ÷ {name} within each round, median [IQR] (req/s above 1 and latency below 1 favour tokenonce):\n");
        println!("| clients | req/s | p50 | p99 | CPU µs/req |\n|---:|---:|---:|---:|---:|");
        for row in rows {
            println!("{row}");
        }
    }
}

fn tokenonce_binary() -> PathBuf {
    std::env::var_os("TOKENONCE_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tokenonce")), PathBuf::from)
}

async fn spawn_tokenonce(prefill: &FakeVllm, decode: &FakeVllm, reuse: bool, threads: u32) -> TokenOnce {
    spawn_tokenonce_with(&tokenonce_binary(), prefill, decode, reuse, threads, true).await
}

async fn spawn_tokenonce_with(
    binary: &std::path::Path,
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
    let proxy = TokenOnce::spawn(binary, &config, &settings).await;
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

struct Options {
    /// Interleaved rounds (`--rounds N`).
    rounds: usize,
    quick: bool,
    /// Only workloads whose label contains this (`--only "chat 37k"`); skips the rest of the run.
    only: Option<String>,
    /// Only these proxies (`--peers a,a0,c,d`).
    peers: Option<String>,
    /// Another tokenonce binary measured beside this one as (a-) (`--baseline PATH`): a cut's
    /// before and after in the same rounds.
    baseline: Option<PathBuf>,
    /// Only load tokenonce (a) with this workload, one request at a time, for `seconds`
    /// (`--profile-only "chat 1k non-stream"`), for a profiler to attach to the pid it writes
    /// to `pid_file` (`--pid-file F`).
    profile_only: Option<String>,
    /// Which tokenonce to load (`--profile-as a0`: the plain relay, whose difference from (a)
    /// is the handoff's cost; `a1`: without work stealing).
    profile_as: Peer,
    seconds: u64,
    pid_file: Option<PathBuf>,
    /// Also tokenonce's req/s curve at 1 and 2 worker threads (`--knee`).
    knee: bool,
    /// Only the under-load section (`--load-only`), in this many rounds (`--load-rounds N`).
    load_only: bool,
    /// Independent instances of the CPU section (`--instances K`), every proxy started afresh
    /// for each, their rounds pooled.
    instances: usize,
    load_rounds: Option<usize>,
    /// The fake prefill reports this many cached prompt tokens (`--cached-tokens N`), as vLLM
    /// with `--enable-prompt-tokens-details` does: tokenonce then sets the decode answer's
    /// `cached_tokens` to it.
    cached_tokens: Option<u64>,
}

fn options() -> Options {
    let mut o = Options {
        rounds: 10,
        quick: false,
        only: None,
        peers: None,
        baseline: None,
        profile_only: None,
        profile_as: Peer::Tokenonce,
        seconds: 30,
        pid_file: None,
        knee: false,
        load_only: false,
        instances: 1,
        load_rounds: None,
        cached_tokens: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--rounds" => o.rounds = args.next().and_then(|v| v.parse::<usize>().ok()).expect("--rounds N").max(1),
            "--quick" => o.quick = true,
            "--only" => o.only = args.next(),
            "--peers" => o.peers = args.next(),
            "--baseline" => o.baseline = args.next().map(PathBuf::from),
            "--profile-only" => o.profile_only = args.next(),
            "--profile-as" => {
                o.profile_as = match args.next().as_deref() {
                    Some("a0") => Peer::NoReuse,
                    Some("a1") => Peer::NoSteal,
                    _ => Peer::Tokenonce,
                }
            }
            "--seconds" => {
                o.seconds = args.next().and_then(|v| v.parse::<u64>().ok()).expect("--seconds N").clamp(1, 600)
            }
            "--pid-file" => o.pid_file = args.next().map(PathBuf::from),
            "--knee" => o.knee = true,
            "--load-only" => o.load_only = true,
            "--instances" => {
                o.instances = args.next().and_then(|v| v.parse::<usize>().ok()).expect("--instances K").clamp(1, 10)
            }
            "--cached-tokens" => {
                o.cached_tokens = Some(args.next().and_then(|v| v.parse::<u64>().ok()).expect("--cached-tokens N"))
            }
            "--load-rounds" => {
                o.load_rounds =
                    Some(args.next().and_then(|v| v.parse::<usize>().ok()).expect("--load-rounds N").clamp(1, 60))
            }
            other => eprintln!("peers: ignoring unknown argument {other:?}"),
        }
    }
    if o.quick {
        o.rounds = o.rounds.min(2);
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
    let prefill = fake_rt.block_on(FakeVllm::start(FakeConfig { cached_tokens: opts.cached_tokens, ..engine.clone() }));
    let decode = fake_rt.block_on(FakeVllm::start(engine));
    let bench = Bench {
        client: client(),
        prefill: format!("http://{}", prefill.host_port()),
        decode: format!("http://{}", decode.host_port()),
    };
    let floor_thread = FloorThread::start(bench.prefill.clone(), bench.decode.clone());
    if opts.profile_only.is_some() {
        rt.block_on(profile_load(&opts, &bench, &prefill, &decode));
    } else {
        rt.block_on(run(&opts, &bench, &floor_thread, &prefill, &decode));
    }
    drop(floor_thread);
    println!("\nBench run time: {:.0} s (excluding the build).", run_started.elapsed().as_secs_f64());
    drop(fake_rt);
}

/// Every workload, in the order the tables print them.
fn all_workloads() -> Vec<Workload> {
    let mut v = Vec::new();
    for &words in &SIZES {
        for chat in [true, false] {
            for stream in [false, true] {
                v.push(Workload { chat, stream, words });
            }
        }
    }
    v
}

/// `--profile-only`: tokenonce (a) under a steady load of one workload, one request at a
/// time, for a profiler attached to its pid.
async fn profile_load(opts: &Options, bench: &Bench, prefill: &FakeVllm, decode: &FakeVllm) {
    let label = opts.profile_only.as_deref().unwrap_or_default();
    let Some(w) = all_workloads().into_iter().find(|w| w.label().contains(label)) else {
        eprintln!("peers: no workload matches {label:?}");
        return;
    };
    let peer = opts.profile_as;
    let tok =
        spawn_tokenonce_with(&tokenonce_binary(), prefill, decode, peer != Peer::NoReuse, 2, peer != Peer::NoSteal)
            .await;
    let t = Target { peer, url: tok.url.clone(), pid: tok.pid().unwrap() };
    let b = Bodies::new(w);
    warm(bench, &t, w, &b).await.expect("tokenonce answers");
    if let Some(f) = &opts.pid_file {
        std::fs::write(f, t.pid.to_string()).unwrap();
    }
    eprintln!("peers: loading {} pid {} with {} for {} s", t.peer.name(), t.pid, w.label(), opts.seconds);
    // A profiler started on the pid file gets a moment to attach.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (steal0, cpu0, started) = (host_ticks(), cpu_ns(t.pid), Instant::now());
    let mut done = 0u64;
    while started.elapsed() < Duration::from_secs(opts.seconds) {
        for _ in 0..50 {
            if bench.via(&t.url, w, &b).await.is_ok() {
                done += 1;
            }
        }
        prefill.forget();
        decode.forget();
    }
    println!(
        "profile load: {} {done} requests in {:.1} s, tokenonce CPU {:.0} µs/request, steal {:.1} %",
        w.label(),
        started.elapsed().as_secs_f64(),
        cpu_ns(t.pid).saturating_sub(cpu0) as f64 / 1e3 / done.max(1) as f64,
        steal_pct(steal0, host_ticks())
    );
}

/// Every proxy of one instance, started (each process stopped when this drops), and the
/// targets the rounds go through.
struct Started {
    tok: TokenOnce,
    others: Vec<TokenOnce>,
    externals: Vec<(Peer, External)>,
    targets: Vec<Target>,
}

/// Starts every proxy once (those `--peers` leaves out too, as the rounds skip them); with
/// `announce`, says which peers are absent and how to install them.
async fn start_all(opts: &Options, bench: &Bench, fakes: [&FakeVllm; 2], instance: usize) -> Started {
    let [prefill, decode] = fakes;
    let announce = instance == 0;
    // The tokenonce variants start in an order rotated by one each instance, as the rounds
    // rotate theirs: no variant always starts first.
    let kinds = [Peer::Tokenonce, Peer::NoReuse, Peer::NoSteal, Peer::Baseline];
    let mut spawned: Vec<(Peer, TokenOnce)> = Vec::new();
    for k in 0..kinds.len() {
        let kind = kinds[(k + instance) % kinds.len()];
        let proxy = match kind {
            Peer::NoReuse => spawn_tokenonce(prefill, decode, false, 2).await,
            Peer::NoSteal => spawn_tokenonce_with(&tokenonce_binary(), prefill, decode, true, 2, false).await,
            Peer::Baseline => match &opts.baseline {
                Some(bin) => spawn_tokenonce_with(bin, prefill, decode, true, 2, true).await,
                None => continue,
            },
            _ => spawn_tokenonce(prefill, decode, true, 2).await,
        };
        spawned.push((kind, proxy));
    }
    let mut take = |kind: Peer| spawned.iter().position(|(k, _)| *k == kind).map(|i| spawned.swap_remove(i).1);
    let (tok, no_reuse, no_steal) =
        (take(Peer::Tokenonce).unwrap(), take(Peer::NoReuse).unwrap(), take(Peer::NoSteal).unwrap());
    let baseline = take(Peer::Baseline);
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
    for (peer, why) in absent.iter().filter(|_| announce) {
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
    if let Some(x) = &baseline {
        targets.push(Target { peer: Peer::Baseline, url: x.url.clone(), pid: x.pid().unwrap() });
    }
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
    Started {
        tok,
        others: [Some(no_reuse), Some(no_steal), baseline].into_iter().flatten().collect(),
        externals,
        targets,
    }
}

async fn run(opts: &Options, bench: &Bench, floor_thread: &FloorThread, prefill: &FakeVllm, decode: &FakeVllm) {
    let run_start = host_ticks();
    let mut started = start_all(opts, bench, [prefill, decode], 0).await;
    header(opts);
    if opts.load_only {
        under_load(opts, bench, &started.targets, prefill, decode).await;
        return;
    }

    let workloads: Vec<Workload> = all_workloads()
        .into_iter()
        .filter(|w| opts.only.as_ref().is_none_or(|o| w.label().contains(o.as_str())))
        .collect();
    let mut m = measure(opts, bench, floor_thread, [prefill, decode], &started.targets, &workloads).await;
    let mut per_instance = vec![m.clone()];
    for instance in 2..=opts.instances {
        // Every proxy stopped and started afresh: a process's own luck (where its threads and
        // memory land) moves its CPU per request by 10-20 % from one start to the next.
        drop(started);
        eprintln!("peers: instance {instance}/{}", opts.instances);
        started = start_all(opts, bench, [prefill, decode], instance - 1).await;
        let more = measure(opts, bench, floor_thread, [prefill, decode], &started.targets, &workloads).await;
        m.absorb(&more);
        per_instance.push(more);
    }
    m.steal = steal_pct(run_start, host_ticks());
    print_steal(&m);
    print_cpu(&m);
    print_ratios(&m);
    print_handoff(&m);
    print_latency(&m);
    if per_instance.len() > 1 {
        print_instances(&per_instance);
    }
    goals(&m);
    if opts.only.is_some() {
        return;
    }

    under_load(opts, bench, &started.targets, prefill, decode).await;
    let Started { tok, others, externals, .. } = started;
    drop(others);
    drop(externals);

    if opts.knee {
        let w = Workload { chat: true, stream: false, words: 1_000 };
        knee(opts, bench, prefill, decode, &Bodies::new(w), w).await;
    }
    drop(tok);
    rss_256(opts, bench, prefill, decode).await;
}

/// The goal ratios' medians in each instance alone (its own proxy processes), beside the
/// pooled ones the tables give.
fn print_instances(each: &[Measured]) {
    println!("\n### Each instance alone (its own processes): (a) ÷ (d) and (a) ÷ (a0), medians of its rounds\n");
    let cols: Vec<String> = (1..=each.len()).map(|i| format!("instance {i}")).collect();
    println!("| workload | {} |\n|---|{}", cols.join(" | "), "---:|".repeat(cols.len()));
    for (wi, w) in each[0].workloads.iter().enumerate() {
        let cells: Vec<String> = each
            .iter()
            .map(|m| {
                let r = |a, b| fmt_num(quantile(&m.ratios(wi, a, b), 0.5));
                format!("{} / {}", r(Peer::Tokenonce, Peer::Router), r(Peer::Tokenonce, Peer::NoReuse))
            })
            .collect();
        println!("| {} | {} |", w.label(), cells.join(" | "));
    }
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
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    println!("# tokenonce side by side with its peers\n");
    println!("- command: `cargo bench --bench peers -- {}`", args.join(" "));
    println!("- commit {}; tokenonce binary {}", git(&["rev-parse", "--short", "HEAD"]), tokenonce_binary().display());
    if let Some(b) = &opts.baseline {
        println!("- (a-) baseline binary {}", b.display());
    }
    println!(
        "- {} CPUs ({cpu}); tokenonce threads = 2, log warn; in the bench process: fakes on one 1-worker runtime, the proxies' client on one thread, the floor's client on another",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    println!(
        "- {} rounds in each of {} instance(s) (every proxy started afresh per instance, rounds pooled); each round: every workload, every proxy (workloads rotated, proxies shuffled each round), a batch of {} requests at 1k ({} at 37k) after one untimed; max_tokens {MAX_TOKENS}\n",
        opts.rounds,
        opts.instances,
        batch(Workload { chat: true, stream: false, words: 1_000 }, opts.quick),
        batch(Workload { chat: true, stream: false, words: 37_000 }, opts.quick)
    );
}

fn print_steal(m: &Measured) {
    println!(
        "### Host steal time: {:.1} % over the run (per round {} – {} %)\n",
        m.steal,
        fmt_num(quantile(&m.round_steal, 0.0)),
        fmt_num(quantile(&m.round_steal, 1.0))
    );
}

const COLUMNS: [Peer; 8] = [
    Peer::Floor,
    Peer::FloorText,
    Peer::Tokenonce,
    Peer::NoReuse,
    Peer::NoSteal,
    Peer::Baseline,
    Peer::Toy,
    Peer::Router,
];

fn present(m: &Measured) -> Vec<Peer> {
    COLUMNS.into_iter().filter(|p| m.peers.contains(p)).collect()
}

fn print_cpu(m: &Measured) {
    let peers = present(m);
    println!("### CPU per request, µs: median over rounds [IQR] (a proxy: all threads of its process; (b) floor: its client thread over the two legs)\n");
    println!("| workload | {} |", peers.iter().map(|p| p.name()).collect::<Vec<_>>().join(" | "));
    println!("|---|{}", "---:|".repeat(peers.len()));
    for (wi, w) in m.workloads.iter().enumerate() {
        let cells: Vec<String> = peers
            .iter()
            .map(|p| match m.series[wi].get(m.peers.iter().position(|q| q == p).unwrap_or(usize::MAX)) {
                Some(s) if s.error.is_some() => format!("FAILED: {}", s.error.as_deref().unwrap_or("")),
                Some(s) => med_iqr(&s.cpu_us),
                None => "absent".into(),
            })
            .collect();
        println!("| {} | {} |", w.label(), cells.join(" | "));
    }
}

/// The ratios the tables and goals use: (numerator, denominator).
const RATIOS: [(Peer, Peer); 8] = [
    (Peer::Tokenonce, Peer::Router),
    (Peer::Tokenonce, Peer::Toy),
    (Peer::Tokenonce, Peer::NoReuse),
    (Peer::Floor, Peer::FloorText),
    (Peer::Tokenonce, Peer::Floor),
    (Peer::NoSteal, Peer::Tokenonce),
    (Peer::Tokenonce, Peer::Baseline),
    (Peer::Router, Peer::Floor),
];

fn short(p: Peer) -> &'static str {
    p.name().split(' ').next().unwrap_or("")
}

fn print_ratios(m: &Measured) {
    let ratios: Vec<(Peer, Peer)> =
        RATIOS.into_iter().filter(|(a, b)| m.peers.contains(a) && m.peers.contains(b)).collect();
    println!("\n### CPU ratios, computed within each round: median over rounds [IQR]\n");
    println!(
        "| workload | {} |",
        ratios.iter().map(|(a, b)| format!("{} ÷ {}", short(*a), short(*b))).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|{}", "---:|".repeat(ratios.len()));
    for (wi, w) in m.workloads.iter().enumerate() {
        let cells: Vec<String> = ratios.iter().map(|(a, b)| med_iqr(&m.ratios(wi, *a, *b))).collect();
        println!("| {} | {} |", w.label(), cells.join(" | "));
    }
}

/// What handing the ids over adds per request, for tokenonce and for the floor's client: the
/// proxy's extra beside the bare cost of moving the same bytes.
fn print_handoff(m: &Measured) {
    println!("\n### What the ids' handoff adds, µs per request: (a) − (a0) and (b) − (b0), computed within each round: median over rounds [IQR]\n");
    println!("| workload | (a) − (a0) tokenonce | (b) − (b0) floor client |\n|---|---:|---:|");
    for (wi, w) in m.workloads.iter().enumerate() {
        let a = m.differences(wi, Peer::Tokenonce, Peer::NoReuse);
        let b = m.differences(wi, Peer::Floor, Peer::FloorText);
        println!("| {} | {} | {} |", w.label(), med_iqr(&a), med_iqr(&b));
    }
}

fn print_latency(m: &Measured) {
    let peers = present(m);
    println!("\n### Latency, one request at a time (ms, client wall clock to the last byte: p50 / p99 over every request of the run)\n");
    println!("| workload | {} |", peers.iter().map(|p| p.name()).collect::<Vec<_>>().join(" | "));
    println!("|---|{}", "---:|".repeat(peers.len()));
    for (wi, w) in m.workloads.iter().enumerate() {
        let cells: Vec<String> = peers
            .iter()
            .map(|p| match m.get(wi, *p) {
                Some(s) => format!("{} / {}", fmt_num(quantile(&s.ms, 0.5)), fmt_num(quantile(&s.ms, 0.99))),
                None => "–".into(),
            })
            .collect();
        println!("| {} | {} |", w.label(), cells.join(" | "));
    }
}

/// The goals (issue 30), checked against this run's medians of per-round ratios.
fn goals(m: &Measured) {
    println!("\n### Goals (issue 30), this run: medians of the per-round ratios\n");
    let find = |chat: bool, stream: bool, words: usize| {
        m.workloads.iter().position(|w| w.chat == chat && w.stream == stream && w.words == words)
    };
    let check = |what: String, v: Vec<f64>, limit: f64| {
        let med = quantile(&v, 0.5);
        if med.is_nan() {
            println!("- UNKNOWN {what}: not measured");
        } else {
            let verdict = if med <= limit { "MET" } else { "NOT MET" };
            println!("- {verdict} {what}: {} (goal ≤ {})", med_iqr(&v), fmt_num(limit));
        }
    };
    for chat in [true, false] {
        let api = if chat { "chat" } else { "completions" };
        for stream in [false, true] {
            let s = if stream { "streamed" } else { "non-streamed" };
            let r =
                |words: usize, a: Peer, b: Peer| find(chat, stream, words).map_or_else(Vec::new, |w| m.ratios(w, a, b));
            check(format!("1k {api} {s}: tokenonce ÷ router"), r(1_000, Peer::Tokenonce, Peer::Router), 0.25);
            check(format!("1k {api} {s}: tokenonce ÷ toy"), r(1_000, Peer::Tokenonce, Peer::Toy), 0.1);
            check(format!("37k {api} {s}: tokenonce ÷ router"), r(37_000, Peer::Tokenonce, Peer::Router), 0.4);
            check(format!("37k {api} {s}: reuse on ÷ plain relay"), r(37_000, Peer::Tokenonce, Peer::NoReuse), 1.3);
            // Not the issue's: what the handoff adds beside what the same bytes cost a bare
            // client, per round ((a) − (a0)) ÷ ((b) − (b0)).
            if let Some(w) = find(chat, stream, 37_000) {
                let extra = m.differences(w, Peer::Tokenonce, Peer::NoReuse);
                let bare = m.differences(w, Peer::Floor, Peer::FloorText);
                let v: Vec<f64> = extra.iter().zip(&bare).map(|(a, b)| a / b).collect();
                println!(
                    "- INFO 37k {api} {s}: the handoff's extra ÷ the bare client's for the same bytes: {}",
                    med_iqr(&v)
                );
            }
        }
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
            rps.push(throughput(bench, Some(&t), w, b, (c, total), true).await.rps);
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

/// `server.max_in_flight`'s default, for the memory bound it implies.
const DEFAULT_MAX_IN_FLIGHT: f64 = 1024.0;

/// tokenonce's RSS with 256 concurrent 37k-token chat requests held in flight at the decode:
/// its peak, the RSS per request in flight, and what that implies at the default
/// `max_in_flight`.
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
    let (peak, idle) = (peak.into_inner() as f64 / 1024.0, idle as f64 / 1024.0);
    let per = (peak - idle) / n as f64;
    println!(
        "\n### Memory\n\n- tokenonce RSS with {n} concurrent 37k-token chat requests held 3 s at the decode: peak {peak:.1} MiB \
         (idle after one request {idle:.1} MiB; {ok}/{n} answered 200; {:.1} s)\n- per request in flight: {:.2} MiB; at the default \
         max_in_flight ({DEFAULT_MAX_IN_FLIGHT}) of such requests: {:.0} MiB",
        started.elapsed().as_secs_f64(),
        per,
        idle + per * DEFAULT_MAX_IN_FLIGHT
    );
}
