//! A fault-injecting engine for the fault matrix (`tests/faults.rs`) and the soak: a raw
//! HTTP/1.1 front on loopback that hands each request to a [`FakeVllm`] behind it (so an
//! unfaulted answer is the fake's, which matches the recordings) and injects the fault the
//! test selected: no answer, a hang, a raw status, non-HTTP bytes, or the fake's answer cut or
//! stalled at a chosen byte. It can go down (connections refused) and come back on the same
//! address, and records every POST it read whole and how each exchange ended.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::AbortHandle;

use super::fake_vllm::FakeVllm;

/// Longest a hang or stall holds the connection (the peer closing ends it sooner).
pub const HOLD: Duration = Duration::from_secs(30);
/// An engine's error body, relayed unchanged.
pub const ENGINE_503: &str =
    "{\"error\":{\"message\":\"engine overloaded\",\"type\":\"ServiceUnavailable\",\"param\":null,\"code\":503}}";
/// Bytes that are not HTTP.
pub const GARBAGE: &[u8] = b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01\x02 not http at all";

/// Most connections one engine accepts, and requests it serves per connection.
const MAX_CONNECTIONS: usize = 20_000;
const MAX_REQUESTS_PER_CONNECTION: usize = 10_000;

/// A place in the fake's raw answer (head and body as sent): `plus` bytes after the start of
/// the `nth` (1-based) occurrence of `marker`.
#[derive(Clone, Copy, Debug)]
pub struct At {
    /// What to look for.
    pub marker: &'static str,
    /// Which occurrence (1-based).
    pub nth: usize,
    /// Bytes after its start.
    pub plus: usize,
}

impl At {
    /// `n` bytes into the body.
    pub const fn body(n: usize) -> Self {
        Self { marker: "\r\n\r\n", nth: 1, plus: 4 + n }
    }

    /// `plus` bytes into the `nth` SSE event (`data: ` lines; chat's first is the role delta).
    pub const fn event(nth: usize, plus: usize) -> Self {
        Self { marker: "data: ", nth, plus }
    }

    /// The offset in `bytes`, once they hold it.
    fn offset_in(&self, bytes: &[u8]) -> Option<usize> {
        let m = self.marker.as_bytes();
        let start = bytes.windows(m.len()).enumerate().filter(|(_, w)| *w == m).nth(self.nth.checked_sub(1)?)?.0;
        Some(start + self.plus)
    }
}

/// What the engine does with a POST.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// The fake's answer, unchanged.
    Pass,
    /// Read the request whole, then close without a byte.
    CloseAfterRead,
    /// Read the request, then send nothing (held up to [`HOLD`]).
    HangBeforeHead,
    /// Answer this status and body (`content-type: application/json`, any body, even empty).
    Status(u16, &'static str),
    /// Answer these bytes (not HTTP), then close.
    Garbage(&'static [u8]),
    /// The fake's answer up to the place, then close the connection.
    Cut(At),
    /// The fake's answer up to the place, then send nothing more (held up to [`HOLD`]).
    Stall(At),
}

/// How one POST exchange ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Still being served.
    Open,
    /// Answered whole (the fake's answer or a raw status).
    Answered,
    /// The fault ended it (closed, cut, garbage sent).
    Faulted,
    /// The proxy closed the connection while the engine held it (hang or stall) or relayed.
    ClosedByPeer,
    /// A hold ran out ([`HOLD`]) with the peer still connected.
    HoldRanOut,
}

/// One POST the engine read whole.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Path and query.
    pub path: String,
    /// The raw head, lower-cased.
    pub head: String,
    /// The body.
    pub body: Vec<u8>,
    /// How it ended.
    pub end: End,
}

impl Seen {
    /// The body as JSON (`Null` when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

#[derive(Default)]
struct State {
    /// Faults for the next POSTs, in order; then `default`.
    queue: VecDeque<Fault>,
    default: Option<Fault>,
    seen: Vec<Seen>,
    /// While down: the bound, non-listening socket that keeps the port (connects refused).
    parked: Option<TcpSocket>,
    tasks: Vec<AbortHandle>,
}

/// A running fault engine; stopped (its tasks aborted) on drop.
pub struct FaultEngine {
    /// Its address.
    pub addr: SocketAddr,
    inner: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl FaultEngine {
    /// Starts in front of `fake`, on a fresh loopback port, passing everything.
    pub async fn start(fake: &FakeVllm) -> Self {
        let socket = reusable_socket();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        let me = Self { addr, inner: fake.addr, state: Arc::default() };
        me.listen(socket);
        me
    }

    /// Starts in front of `fake` with every POST meeting `fault`.
    pub async fn with(fake: &FakeVllm, fault: Fault) -> Self {
        let me = Self::start(fake).await;
        me.set(fault);
        me
    }

    /// `host:port`.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Every POST from now on (after those queued) meets `fault`.
    pub fn set(&self, fault: Fault) {
        self.state.lock().default = Some(fault);
    }

    /// The next POST meets `fault` (then the next queued, then the default).
    pub fn then(&self, fault: Fault) {
        self.state.lock().queue.push_back(fault);
    }

    /// The POSTs read whole so far.
    pub fn posts(&self) -> Vec<Seen> {
        self.state.lock().seen.clone()
    }

    /// How many exchanges ended `end`.
    pub fn ended(&self, end: End) -> usize {
        self.state.lock().seen.iter().filter(|s| s.end == end).count()
    }

    /// Goes down like a dead engine: open connections dropped, new connects refused (the port
    /// stays bound, not listening, so nothing else takes it).
    pub async fn stop(&self) {
        let tasks: Vec<AbortHandle> = self.state.lock().tasks.drain(..).collect();
        tasks.iter().for_each(AbortHandle::abort);
        // The aborted accept task drops the listener; bind the port again as soon as it is free.
        let socket = reusable_socket();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while socket.bind(self.addr).is_err() {
            assert!(std::time::Instant::now() < deadline, "port {} not released", self.addr);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.state.lock().parked = Some(socket);
    }

    /// Comes back up on the same address (after [`Self::stop`]).
    pub fn restart(&self) {
        let socket = self.state.lock().parked.take().expect("restart() after stop()");
        self.listen(socket);
    }

    fn listen(&self, socket: TcpSocket) {
        let listener = socket.listen(1024).unwrap();
        let (state, inner) = (Arc::clone(&self.state), self.inner);
        let task = tokio::spawn(accept_loop(listener, inner, Arc::clone(&state)));
        state.lock().tasks.push(task.abort_handle());
    }
}

impl Drop for FaultEngine {
    fn drop(&mut self) {
        self.state.lock().tasks.drain(..).for_each(|t| t.abort());
    }
}

fn reusable_socket() -> TcpSocket {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_reuseaddr(true).unwrap();
    socket
}

async fn accept_loop(listener: TcpListener, inner: SocketAddr, state: Arc<Mutex<State>>) {
    for _ in 0..MAX_CONNECTIONS {
        let Ok((sock, _)) = listener.accept().await else { return };
        let _ = sock.set_nodelay(true);
        let task = tokio::spawn(serve(sock, inner, Arc::clone(&state)));
        let mut state = state.lock();
        state.tasks.retain(|t| !t.is_finished());
        state.tasks.push(task.abort_handle());
    }
}

/// A request as read: method (upper case), path, raw head (without the blank line), body.
pub struct Request {
    /// As sent (`POST`).
    pub method: String,
    /// Path and query.
    pub path: String,
    /// The raw head, request line included.
    pub head: String,
    /// The `content-length` body.
    pub body: Vec<u8>,
}

async fn serve(mut sock: TcpStream, inner: SocketAddr, state: Arc<Mutex<State>>) {
    for _ in 0..MAX_REQUESTS_PER_CONNECTION {
        let Some(req) = read_request(&mut sock).await else { return };
        let (fault, index) = if req.method == "POST" {
            let mut s = state.lock();
            let fault = s.queue.pop_front().or(s.default).unwrap_or(Fault::Pass);
            s.seen.push(Seen {
                path: req.path.clone(),
                head: req.head.to_ascii_lowercase(),
                body: req.body.clone(),
                end: End::Open,
            });
            (fault, Some(s.seen.len() - 1))
        } else {
            (Fault::Pass, None)
        };
        let (end, keep_alive) = apply(&mut sock, inner, &req, &fault).await;
        if let Some(i) = index {
            state.lock().seen[i].end = end;
        }
        if !keep_alive {
            return;
        }
    }
}

/// Reads one request whole (head, then a `content-length` body; within [`HOLD`]): the one
/// request reader of the tests' raw engines.
pub async fn read_request(sock: &mut TcpStream) -> Option<Request> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let work = async {
        loop {
            let n = sock.read(&mut buf).await.ok().filter(|&n| n > 0)?;
            got.extend_from_slice(&buf[..n]);
            let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            let head = String::from_utf8_lossy(&got[..end]).into_owned();
            let len: usize = header(&head, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
            if got.len() >= end + 4 + len {
                let mut words = head.split(' ');
                let method = words.next().unwrap_or_default().to_owned();
                let path = words.next().unwrap_or_default().to_owned();
                let body = got[end + 4..end + 4 + len].to_vec();
                return Some(Request { method, path, head, body });
            }
        }
    };
    tokio::time::timeout(HOLD, work).await.ok().flatten()
}

/// The value of header `name` in a raw head.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A raw engine's `200 OK` answer carrying the JSON `body`, with `connection: close` when
/// `close`.
pub fn json_answer(body: &str, close: bool) -> String {
    let close = if close { "connection: close\r\n" } else { "" };
    format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{close}\r\n{body}", body.len())
}

/// Does what `fault` says with one request; how it ended and whether the connection lives on.
async fn apply(sock: &mut TcpStream, inner: SocketAddr, req: &Request, fault: &Fault) -> (End, bool) {
    match fault {
        Fault::CloseAfterRead => (End::Faulted, false),
        Fault::HangBeforeHead => (hold(sock).await, false),
        Fault::Status(status, body) => {
            let answer = format!(
                "HTTP/1.1 {status} Engine Fault\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let ok = sock.write_all(answer.as_bytes()).await.is_ok();
            (if ok { End::Answered } else { End::ClosedByPeer }, ok)
        }
        Fault::Garbage(bytes) => {
            let _ = sock.write_all(bytes).await;
            (End::Faulted, false)
        }
        Fault::Pass => relay(sock, inner, req, None).await,
        Fault::Cut(at) => relay(sock, inner, req, Some((*at, false))).await,
        Fault::Stall(at) => relay(sock, inner, req, Some((*at, true))).await,
    }
}

/// Holds the connection, sending nothing, until the peer closes it or [`HOLD`] passes.
async fn hold(sock: &mut TcpStream) -> End {
    let mut buf = [0u8; 4096];
    let watch = async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    match tokio::time::timeout(HOLD, watch).await {
        Ok(()) => End::ClosedByPeer,
        Err(_) => End::HoldRanOut,
    }
}

/// Sends `req` to the fake (`connection: close`) and relays its answer as it arrives (the
/// fake's `connection` header removed when the answer is framed, so this connection stays
/// reusable), stopping at `stop` (`true`: stall there, `false`: close there).
async fn relay(sock: &mut TcpStream, inner: SocketAddr, req: &Request, stop: Option<(At, bool)>) -> (End, bool) {
    let Ok(mut up) = TcpStream::connect(inner).await else { return (End::Faulted, false) };
    let mut head: String = req
        .head
        .lines()
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .map(|l| format!("{l}\r\n"))
        .collect();
    head.push_str("connection: close\r\n\r\n");
    if up.write_all(head.as_bytes()).await.is_err() || up.write_all(&req.body).await.is_err() {
        return (End::Faulted, false);
    }
    let mut raw = Vec::new();
    let mut out: Option<Vec<u8>> = None; // the answer as relayed: head rewritten, then body
    let mut framed = false;
    let mut written = 0;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match tokio::time::timeout(HOLD, up.read(&mut buf)).await {
            Ok(Ok(n)) => n,
            _ => return (End::Faulted, false),
        };
        let eof = n == 0;
        match &mut out {
            Some(o) => o.extend_from_slice(&buf[..n]),
            None => {
                raw.extend_from_slice(&buf[..n]);
                if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                    let text = String::from_utf8_lossy(&raw[..end]).into_owned();
                    framed = header(&text, "content-length").is_some() || header(&text, "transfer-encoding").is_some();
                    let kept: String = text
                        .lines()
                        .filter(|l| !(framed && l.to_ascii_lowercase().starts_with("connection:")))
                        .map(|l| format!("{l}\r\n"))
                        .collect();
                    let mut o = kept.into_bytes();
                    o.extend_from_slice(b"\r\n");
                    o.extend_from_slice(&raw[end + 4..]);
                    out = Some(o);
                } else if eof {
                    return (End::Faulted, false);
                }
            }
        }
        let Some(o) = &out else { continue };
        let stop_at = stop.and_then(|(at, _)| at.offset_in(o));
        // Until the stop is known, hold back what could be the start of its marker.
        let upto = match (stop, stop_at) {
            (Some(_), Some(at)) => at.min(o.len()),
            (Some((at, _)), None) if !eof => o.len().saturating_sub(at.marker.len()),
            _ => o.len(),
        };
        if upto > written {
            if sock.write_all(&o[written..upto]).await.is_err() {
                return (End::ClosedByPeer, false);
            }
            written = upto;
        }
        if let (Some((_, stall)), Some(at)) = (stop, stop_at) {
            if written >= at {
                let _ = sock.flush().await;
                return if stall { (hold(sock).await, false) } else { (End::Faulted, false) };
            }
        }
        if eof {
            return (End::Answered, framed);
        }
    }
}
