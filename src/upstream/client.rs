//! The HTTP/1.1 client for the legs tokenonce sends itself (prefill, decode, health): dials
//! with pingora's transport connector, speaks HTTP/1.1 itself (`h1`), pools idle connections.
//!
//! Connections dial with a connect timeout and TLS, and idle ones are kept under vLLM's 5 s
//! keep-alive. For a failed send it says whether the engine provably never got the request
//! (the executor decides whether to re-send; only the idempotent `get` retries here).

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use pingora::connectors::TransportConnector;
use pingora::http::ResponseHeader;
use pingora::upstreams::peer::{HttpPeer, Peer};

use super::h1::{Answer, Conn, WireError};
use super::resolve::Resolver;
use crate::metrics::ErrorKind;
use crate::tls::{TrustKey, UpstreamTls};

/// Where a leg goes: `host:port`, and its pool's TLS (`None`: plain HTTP).
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `host:port`.
    pub addr: &'a str,
    /// The pool's TLS settings.
    pub tls: Option<&'a UpstreamTls>,
}

impl<'a> Target<'a> {
    /// A plain-HTTP target.
    pub fn plain(addr: &'a str) -> Self {
        Self { addr, tls: None }
    }
}

/// Why an upstream exchange failed. `Display` names the address and pingora's detail (for
/// the log); [`UpstreamError::cause`] is the short, address-free text a client may see.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// Could not connect.
    #[error("connect to {addr} failed: {detail}")]
    Connect { addr: String, cause: &'static str, detail: String },
    /// The connection failed while sending or reading.
    #[error("{addr}: {detail}")]
    Io { addr: String, cause: &'static str, detail: String },
    /// The TLS handshake failed: the engine's certificate was not trusted (wrong CA, wrong
    /// name, expired), or the engine refused ours (mTLS).
    #[error("TLS with {addr} failed: {detail}")]
    Tls { addr: String, cause: &'static str, detail: String },
    /// The response body exceeded the allowed size.
    #[error("{addr}: response body over {limit} bytes")]
    TooLarge { addr: String, limit: usize },
}

impl UpstreamError {
    /// Label value for `upstream_errors_total{kind}`.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Connect { .. } => ErrorKind::Connect,
            Self::Tls { .. } => ErrorKind::Tls,
            Self::Io { .. } => ErrorKind::Io,
            Self::TooLarge { .. } => ErrorKind::TooLarge,
        }
    }

    /// What went wrong in a few words, without address or error chain (`connection refused`).
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Connect { cause, .. } | Self::Io { cause, .. } | Self::Tls { cause, .. } => cause,
            Self::TooLarge { .. } => "answer too large",
        }
    }

    /// True for a connect that ran out of `upstream.connect_timeout_ms`.
    pub fn timed_out_connecting(&self) -> bool {
        matches!(self, Self::Connect { cause: "connect timed out", .. })
    }

    /// A connect failure to `addr` (a TLS one when the handshake failed).
    pub fn connect(addr: &str, e: &pingora::Error) -> Self {
        let (addr, cause, detail) = (addr.to_owned(), cause_of(e), e.to_string());
        if is_tls(e) {
            Self::Tls { addr, cause, detail }
        } else {
            Self::Connect { addr, cause, detail }
        }
    }

    /// A send or read failure with `addr`; a TLS alert or protocol error from the engine is
    /// a TLS one.
    pub fn io(addr: &str, e: &pingora::Error) -> Self {
        let (addr, detail) = (addr.to_owned(), e.to_string());
        match tls_alert(e) {
            Some(cause) => Self::Tls { addr, cause, detail },
            None => Self::Io { addr, cause: cause_of(e), detail },
        }
    }

    /// [`Self::io`] for pingora's own connection to `addr` (passthrough); `fresh_tls`: a TLS
    /// connection dialled for this request, so a reset met by writing the request is the
    /// engine's TLS refusal (as in [`UpstreamClient`]'s own sends).
    pub fn passthrough(addr: &str, e: &pingora::Error, fresh_tls: bool) -> Self {
        use std::io::ErrorKind as K;
        let reset = e.root_cause().downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(io.kind(), K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted | K::UnexpectedEof)
        });
        if fresh_tls && e.etype() == &pingora::ErrorType::WriteError && reset {
            let detail = format!("the engine reset the connection right after the TLS handshake: {e}");
            return Self::Tls { addr: addr.to_owned(), cause: "TLS handshake failed", detail };
        }
        Self::io(addr, e)
    }

    /// A failure on the wire with `addr` (writing, reading, or a malformed answer); a TLS
    /// alert or protocol error from the engine is a TLS one.
    pub fn wire(addr: &str, e: &WireError) -> Self {
        let detail = e.to_string();
        match e.io().and_then(|io| tls_alert(io)) {
            Some(cause) => Self::Tls { addr: addr.to_owned(), cause, detail },
            None => Self::Io { addr: addr.to_owned(), cause: e.cause(), detail },
        }
    }

    /// The engine's TLS refusal seen after the client's side of the handshake was done (TLS
    /// 1.3 refuses a missing or unwanted client certificate that way): an alert on the first
    /// read, or, when it also reset the connection already, the first write meeting that reset.
    fn refused_after_handshake(addr: &str, e: &WireError) -> Self {
        let detail = format!("the engine reset the connection right after the TLS handshake: {e}");
        Self::Tls { addr: addr.to_owned(), cause: "TLS handshake failed", detail }
    }
}

/// The client-safe words for an engine's TLS refusal found in `e` or its causes: a TLS alert
/// or protocol error (not a plain reset or close, which says nothing about TLS).
pub fn tls_alert(e: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use pingora::tls::ssl::{Error as SslError, ErrorCode};
    let mut next = Some(e);
    // Bounded: a cause chain is short, and a cycle would be a bug elsewhere.
    for _ in 0..16 {
        let err = next?;
        if let Some(ssl) = err.downcast_ref::<SslError>() {
            return (ssl.code() == ErrorCode::SSL).then_some("TLS handshake failed");
        }
        next = if let Some(io) = err.downcast_ref::<std::io::Error>() {
            io.get_ref().map(|inner| inner as &(dyn std::error::Error + 'static))
        } else if let Some(pe) = err.downcast_ref::<pingora::Error>() {
            pe.cause.as_deref().map(|inner| inner as &(dyn std::error::Error + 'static))
        } else if let Some(pe) = err.downcast_ref::<pingora::BError>() {
            // A pingora error as another's cause is boxed once more.
            pe.cause.as_deref().map(|inner| inner as &(dyn std::error::Error + 'static))
        } else {
            err.source()
        };
    }
    None
}

/// True for a failed TLS handshake (either side refused, or it timed out).
pub fn is_tls(e: &pingora::Error) -> bool {
    use pingora::ErrorType as T;
    matches!(
        e.etype(),
        T::TLSHandshakeFailure | T::TLSHandshakeTimedout | T::InvalidCert | T::HandshakeError | T::TLSWantX509Lookup
    )
}

/// The client-safe words for a pingora error type.
fn cause_of(e: &pingora::Error) -> &'static str {
    use pingora::ErrorType as T;
    match e.etype() {
        T::InvalidCert => "engine certificate not trusted",
        T::TLSHandshakeTimedout => "TLS handshake timed out",
        T::TLSHandshakeFailure | T::HandshakeError | T::TLSWantX509Lookup => "TLS handshake failed",
        T::ConnectTimedout => "connect timed out",
        T::ConnectRefused => "connection refused",
        T::ConnectNoRoute => "no route to host",
        T::ConnectionClosed => "connection closed",
        T::ReadTimedout => "read timed out",
        T::WriteTimedout => "write timed out",
        T::ReadError => "read failed",
        T::WriteError => "write failed",
        T::InvalidHTTPHeader | T::H1Error => "not an HTTP/1.1 answer",
        T::ConnectError | T::BindError | T::SocketError | T::ConnectProxyFailure => "connect failed",
        _ => "connection failed",
    }
}

/// Headers never forwarded from the client to an engine (hop-by-hop, recomputed, or ours).
const DROPPED_REQUEST_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
    "expect",
    "x-request-id",
];

/// Headers that carry the client's credentials: never sent to a prefiller a request header
/// named, unless the route says so.
pub const CREDENTIAL_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"];

/// Headers never copied from an engine response to the client.
pub const DROPPED_RESPONSE_HEADERS: &[&str] =
    &["connection", "keep-alive", "transfer-encoding", "content-length", "trailer", "upgrade"];

/// What a request head to an engine is made of; [`RequestHead::wire`] writes it as HTTP/1.1
/// straight from the client's header map: no pingora `RequestHeader` is built and encoded per
/// leg (its cost: docs/performance.md, "Costs the code's comments used to carry").
#[derive(Clone, Copy)]
pub struct RequestHead<'a> {
    /// `POST`, `GET`.
    pub method: &'a str,
    /// Path and query, as the client sent them (or ours).
    pub path_and_query: &'a str,
    /// The client's headers: its end-to-end ones are forwarded, lower-case, minus
    /// `DROPPED_REQUEST_HEADERS`, `drop`, the credentials when `drop_credentials`, and those
    /// the leg sets itself.
    pub client_headers: &'a HeaderMap,
    /// One more header name never forwarded (lower-case; a route's `x-prefiller-host-port`).
    pub drop: Option<&'a str>,
    /// Leave out `CREDENTIAL_HEADERS` (a leg to a prefiller a request header named).
    pub drop_credentials: bool,
    /// Sent as `x-request-id`.
    pub request_id: &'a str,
    /// Sent as `content-length` (not on a `GET` without a body).
    pub body_len: usize,
}

impl RequestHead<'_> {
    /// The head's bytes for `addr` (`host`), with the leg's own headers `extra` (lower-case
    /// names; any the client sent by those names are left out).
    ///
    /// # Errors
    /// A path with a space or control byte (it would split the request line), or a value of
    /// ours with a line break.
    pub fn wire(&self, addr: &str, extra: &[(&str, &str)]) -> Result<Vec<u8>, &'static str> {
        let path = self.path_and_query.as_bytes();
        if path.is_empty() || path.iter().any(|&b| b <= b' ' || b == 0x7f) {
            return Err("request path holds a space or control byte");
        }
        let breaks_a_line = |v: &str| v.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0));
        if breaks_a_line(addr) || breaks_a_line(self.request_id) || extra.iter().any(|(_, v)| breaks_a_line(v)) {
            return Err("header value holds a line break");
        }
        let mut out = Vec::with_capacity(96 + path.len() + self.client_headers.len() * 48);
        out.extend_from_slice(self.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(path);
        out.extend_from_slice(b" HTTP/1.1\r\n");
        let mut line = |name: &[u8], value: &[u8]| {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        };
        for (name, value) in self.client_headers {
            let n = name.as_str();
            let dropped = DROPPED_REQUEST_HEADERS.contains(&n)
                || self.drop == Some(n)
                || (self.drop_credentials && CREDENTIAL_HEADERS.contains(&n))
                || extra.iter().any(|(e, _)| *e == n);
            if dropped {
                continue;
            }
            line(n.as_bytes(), value.as_bytes());
        }
        line(b"host", addr.as_bytes());
        line(super::REQUEST_ID_HEADER.as_str().as_bytes(), self.request_id.as_bytes());
        if self.method != "GET" || self.body_len > 0 {
            line(b"content-length", self.body_len.to_string().as_bytes());
        }
        for (name, value) in extra {
            line(name.as_bytes(), value.as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        Ok(out)
    }
}

/// A send that failed, and whether the engine provably never got the request (so sending
/// it again cannot run it twice); see `UpstreamClient::attempt` for what proves it.
#[derive(Debug, Clone)]
pub struct SendFailure {
    /// What went wrong.
    pub error: UpstreamError,
    /// True when the request provably did not reach the engine whole.
    pub unstarted: bool,
}

/// An exchange that has its response header; the body is still to be read.
pub struct Exchange {
    conn: Conn,
    answer: Answer,
    /// The idle pool's key for the connection (its peer's address and TLS settings).
    pool_key: PoolKey,
    /// `host:port`, for errors.
    addr: String,
    /// The connection was taken from the idle pool (not dialled for this exchange).
    pooled: bool,
}

impl Exchange {
    /// Response status.
    pub fn status(&self) -> u16 {
        self.answer.head.status.as_u16()
    }

    /// A response header value.
    pub fn header(&self, name: impl http::header::AsHeaderName) -> Option<&str> {
        self.answer.head.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The response head.
    pub fn head(&self) -> &ResponseHeader {
        &self.answer.head
    }

    /// The next piece of the body as it arrives (`None`: the body ended).
    ///
    /// # Errors
    /// [`UpstreamError::Io`] when the connection fails or the framing is broken.
    pub async fn read_body(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        self.conn.read_body(&mut self.answer).await.map_err(|e| UpstreamError::wire(&self.addr, &e))
    }

    /// The next piece of the body if it arrived with the last read (`None`: wait with
    /// [`Self::read_body`]); pieces read together can then be written together.
    ///
    /// # Errors
    /// [`UpstreamError::Io`] when the framing is broken.
    pub fn read_buffered_body(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        self.conn.buffered_body(&mut self.answer).map_err(|e| UpstreamError::wire(&self.addr, &e))
    }
}

/// What an idle connection is kept under: pingora's reuse hash of its peer (address, scheme,
/// SNI, client certificate serials, verify flags) and the pool's whole trust settings, which
/// that hash leaves out (the CA bundle above all). A connection is handed out only to a leg
/// or health poll whose settings are equal, so a pool that trusts another CA, or a reload
/// that changed a pool's TLS, never gets a connection verified under other settings.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    peer: u64,
    trust: Option<TrustKey>,
}

impl PoolKey {
    fn of(peer: &HttpPeer, to: Target<'_>) -> Self {
        Self { peer: peer.reuse_hash(), trust: to.tls.map(|t| t.trust_key().clone()) }
    }
}

/// Idle connections by peer, most recently used last. No task watches them: a connection
/// is checked for a close or stray bytes when it is taken, and those idle past the pool's
/// limit are dropped whenever the pool is used.
#[derive(Default)]
struct IdlePool {
    by_peer: Mutex<HashMap<PoolKey, VecDeque<Conn>>>,
}

/// Most idle connections kept per peer (a burst of up to 512 concurrent legs to one engine
/// leaves that many idle, all kept for the next burst).
const MAX_IDLE_PER_PEER: usize = 512;

impl IdlePool {
    /// The most recent live connection to `key`, if any (stale ones are closed).
    fn take(&self, key: &PoolKey, idle_timeout: Duration) -> Option<Conn> {
        let mut stale = Vec::new();
        let found = {
            let mut by_peer = self.by_peer.lock();
            let idle = by_peer.get_mut(key)?;
            let mut found = None;
            while let Some(conn) = idle.pop_back() {
                if conn.idle_since.elapsed() < idle_timeout && conn.is_quiet() {
                    found = Some(conn);
                    break;
                }
                stale.push(conn);
            }
            found
        };
        drop(stale);
        found
    }

    /// Closes every connection idle past `idle_timeout`, of every peer.
    fn close_expired(&self, idle_timeout: Duration) {
        let mut stale = Vec::new();
        {
            let mut by_peer = self.by_peer.lock();
            for idle in by_peer.values_mut() {
                while idle.front().is_some_and(|c| c.idle_since.elapsed() >= idle_timeout) {
                    stale.extend(idle.pop_front());
                }
            }
            by_peer.retain(|_, idle| !idle.is_empty());
        }
        drop(stale);
    }

    /// Connections kept, over all peers.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_peer.lock().values().map(VecDeque::len).sum()
    }

    /// Keeps `conn` for reuse, dropping connections to `key` idle past `idle_timeout`.
    fn put(&self, key: PoolKey, mut conn: Conn, idle_timeout: Duration) {
        conn.idle_since = Instant::now();
        let mut stale = Vec::new();
        {
            let mut by_peer = self.by_peer.lock();
            let idle = by_peer.entry(key).or_default();
            while idle.front().is_some_and(|c| c.idle_since.elapsed() >= idle_timeout)
                || idle.len() >= MAX_IDLE_PER_PEER
            {
                stale.extend(idle.pop_front());
            }
            idle.push_back(conn);
        }
        drop(stale);
    }
}

/// The shared client.
pub struct UpstreamClient {
    /// Dials (and does TLS); connections are pooled in `idle`.
    connector: TransportConnector,
    idle: IdlePool,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// Endpoint names remembered for a few seconds (a lookup per leg cost `getaddrinfo`).
    resolver: Resolver,
}

/// Whether a leg's request left this process whole. Set by the send as soon as the last byte
/// is written, so a caller that stops waiting (the client left) still knows whether the
/// engine may have the request: before, it provably has not.
#[derive(Debug, Default)]
pub struct Delivery(AtomicBool);

impl Delivery {
    fn mark(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// True once the request was written whole (the engine may act on it).
    pub fn delivered(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl UpstreamClient {
    /// A client with its own connection pool.
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self {
            connector: TransportConnector::new(None),
            idle: IdlePool::default(),
            connect_timeout,
            idle_timeout,
            resolver: Resolver::default(),
        }
    }

    /// A peer for `target` with tokenonce's connection options and the pool's TLS.
    pub async fn peer(&self, target: Target<'_>) -> Result<HttpPeer, UpstreamError> {
        let addr = target.addr;
        let resolved = self.resolver.resolve(addr).await.map_err(|e| UpstreamError::Connect {
            addr: addr.to_owned(),
            cause: "name resolution failed",
            detail: e.0,
        })?;
        let mut peer = HttpPeer::new(resolved, false, String::new());
        peer.options.connection_timeout = Some(self.connect_timeout);
        peer.options.idle_timeout = Some(self.idle_timeout);
        if let Some(tls) = target.tls {
            tls.apply(&mut peer, addr);
        }
        Ok(peer)
    }

    /// A connection to `peer`: a live idle one, unless `fresh`, else a new one; and whether
    /// it was taken from the pool.
    async fn connection(&self, peer: &HttpPeer, key: &PoolKey, fresh: bool) -> Result<(Conn, bool), pingora::BError> {
        if let Some(conn) = (!fresh).then(|| self.idle.take(key, self.idle_timeout)).flatten() {
            return Ok((conn, true));
        }
        // Boxed: pingora's dial (TCP, TLS) is a ~2 KB future that every leg's future would
        // otherwise carry, and copy at each await up the chain, though most legs are pooled.
        Box::pin(self.connector.new_stream(peer)).await.map(|io| (Conn::new(io), false))
    }

    /// One attempt: connect (or take a pooled connection), write the request, read the
    /// response head.
    ///
    /// What a failure proves about whether the engine got the request:
    /// - connecting failed: nothing was sent. Unstarted.
    /// - writing the request failed: some bytes of it never left this process; it is framed
    ///   by `Content-Length`, so the engine never had it whole and cannot have acted on it.
    ///   Unstarted. On a reused connection this is the keep-alive race: the engine closed
    ///   the idle connection (not reading our request) and our write met its reset. (A close
    ///   that arrived before we took the connection is caught by the pool's check, and a
    ///   new connection is dialled.)
    /// - the request was fully written and reading the response head failed (EOF, reset,
    ///   timeout), even with no response byte: the engine may have read it and started (it
    ///   can crash or close mid-work), and a decode is not idempotent. Not unstarted, however
    ///   likely a stale connection looks.
    async fn attempt(
        &self,
        peer: &HttpPeer,
        key: &PoolKey,
        head: &[u8],
        body: &[Bytes],
        fresh: bool,
        delivery: &Delivery,
    ) -> Result<(Conn, Answer, bool), SendFailure> {
        // The answer to a HEAD has no body whatever its head says (RFC 9112 §6.3).
        let to_head = head.starts_with(b"HEAD ");
        // The peer as errors name it: formatted only when one happens, not on every leg.
        let addr = || peer.to_string();
        let (mut conn, reused) = self
            .connection(peer, key, fresh)
            .await
            .map_err(|e| SendFailure { error: UpstreamError::connect(&addr(), &e), unstarted: true })?;
        conn.write_request(head, body).await.map_err(|e| {
            // A connection just handshaken that the engine already reset: its TLS refusal.
            let error = if key.trust.is_some() && !reused && e.is_write_reset() {
                UpstreamError::refused_after_handshake(&addr(), &e)
            } else {
                UpstreamError::wire(&addr(), &e)
            };
            SendFailure { error, unstarted: true }
        })?;
        delivery.mark();
        let answer = conn
            .read_head(to_head)
            .await
            .map_err(|e| SendFailure { error: UpstreamError::wire(&addr(), &e), unstarted: false })?;
        Ok((conn, answer, reused))
    }

    /// Sends `head` + `body` (its parts written in order, one vectored write) to `to` once
    /// and reads the response header.
    ///
    /// `delivery` is marked once the request is written whole.
    ///
    /// # Errors
    /// [`SendFailure`]: the error, and whether the engine provably never got the request.
    pub async fn send(
        &self,
        to: Target<'_>,
        head: &[u8],
        body: &[Bytes],
        delivery: &Delivery,
    ) -> Result<Exchange, SendFailure> {
        self.send_via(to, head, body, false, delivery).await
    }

    /// [`Self::send`] on a newly dialled connection (never a pooled one), for a re-send.
    ///
    /// # Errors
    /// As [`Self::send`].
    pub async fn resend(
        &self,
        to: Target<'_>,
        head: &[u8],
        body: &[Bytes],
        delivery: &Delivery,
    ) -> Result<Exchange, SendFailure> {
        self.send_via(to, head, body, true, delivery).await
    }

    async fn send_via(
        &self,
        to: Target<'_>,
        head: &[u8],
        body: &[Bytes],
        fresh: bool,
        delivery: &Delivery,
    ) -> Result<Exchange, SendFailure> {
        let peer = self.peer(to).await.map_err(|error| SendFailure { error, unstarted: true })?;
        let pool_key = PoolKey::of(&peer, to);
        let (conn, answer, pooled) =
            self.attempt(&peer, &pool_key, head, body, fresh, delivery).await.inspect_err(|f| {
                // The name may point somewhere else now: the next leg looks it up again.
                if matches!(f.error, UpstreamError::Connect { .. }) {
                    self.resolver.forget(to.addr);
                }
            })?;
        Ok(Exchange { conn, answer, pool_key, addr: to.addr.to_owned(), pooled })
    }

    /// Reads the rest of the body (at most `limit` bytes) and returns the connection to the pool.
    ///
    /// # Errors
    /// [`UpstreamError`] on a read failure or an oversized body.
    pub async fn read_to_end(&self, mut exchange: Exchange, limit: usize) -> Result<Bytes, UpstreamError> {
        let read = exchange.conn.read_to_end(&mut exchange.answer, limit).await;
        match read.map_err(|e| UpstreamError::wire(&exchange.addr, &e))? {
            Some(body) => {
                self.release(exchange);
                Ok(body)
            }
            None => Err(UpstreamError::TooLarge { addr: exchange.addr, limit }),
        }
    }

    /// Returns a fully read exchange's connection to the pool (dropped, so closed, if the
    /// body was not read to its end or the engine asked to close).
    pub fn release(&self, exchange: Exchange) {
        if exchange.conn.reusable_after(&exchange.answer) {
            self.idle.put(exchange.pool_key, exchange.conn, self.idle_timeout);
        }
    }

    /// Closes the pooled connections idle past the pool's limit, of every peer (the health
    /// poller calls it each round; a peer's own pool use drops its stale ones too).
    pub fn close_expired_idle(&self) {
        self.idle.close_expired(self.idle_timeout);
    }

    /// `GET path` with a deadline; returns the status and body.
    ///
    /// # Errors
    /// [`UpstreamError`] on failure or when `timeout` passes.
    pub async fn get(&self, to: Target<'_>, path: &str, timeout: Duration) -> Result<(u16, Bytes), UpstreamError> {
        let addr = to.addr;
        let work = async {
            let no_headers = HeaderMap::new();
            let parts = RequestHead {
                method: "GET",
                path_and_query: path,
                client_headers: &no_headers,
                drop: None,
                drop_credentials: false,
                request_id: "tokenonce-health",
                body_len: 0,
            };
            let head = parts.wire(addr, &[]).map_err(|detail| UpstreamError::Io {
                addr: addr.to_owned(),
                cause: "bad request head",
                detail: detail.to_owned(),
            })?;
            // A GET is idempotent: one more try on any failure (a stale pooled connection
            // must not mark an endpoint unhealthy).
            let delivery = Delivery::default();
            let mut exchange = match self.send(to, &head, &[], &delivery).await {
                Ok(exchange) => exchange,
                Err(SendFailure {
                    error: error @ (UpstreamError::Connect { .. } | UpstreamError::Tls { .. }), ..
                }) => return Err(error),
                Err(_) => self.resend(to, &head, &[], &delivery).await.map_err(|f| f.error)?,
            };
            let status = exchange.status();
            // A connection this GET dialled is closed, not pooled: the health poller runs on
            // pingora's background runtime, and a socket stays with the reactor of the runtime
            // that opened it, so every leg later sent on it would be woken across runtimes.
            let pooled = exchange.pooled;
            let read = exchange.conn.read_to_end(&mut exchange.answer, 1 << 20).await;
            let body = read
                .map_err(|e| UpstreamError::wire(&exchange.addr, &e))?
                .ok_or_else(|| UpstreamError::TooLarge { addr: exchange.addr.clone(), limit: 1 << 20 })?;
            if pooled {
                self.release(exchange);
            }
            Ok((status, body))
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(UpstreamError::Io {
                addr: addr.to_owned(),
                cause: "timed out",
                detail: format!("GET {path} timed out"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads_forward_end_to_end_headers_and_set_ours() {
        let mut client = HeaderMap::new();
        client.append("content-type", "application/json".parse().unwrap());
        client.append("x-b", "1".parse().unwrap());
        client.append("x-b", "2".parse().unwrap());
        for (name, value) in [
            ("connection", "keep-alive"),
            ("host", "client.example"),
            ("content-length", "9"),
            ("x-request-id", "theirs"),
            ("authorization", "Bearer k"),
            ("traceparent", "00-client"),
            ("x-prefiller-host-port", "10.0.0.1:8000"),
        ] {
            client.append(name, value.parse().unwrap());
        }
        let head = RequestHead {
            method: "POST",
            path_and_query: "/v1/chat/completions?x=1",
            client_headers: &client,
            drop: Some("x-prefiller-host-port"),
            drop_credentials: true,
            request_id: "r1",
            body_len: 2,
        };
        let wire = head.wire("127.0.0.1:8000", &[("traceparent", "00-ours")]).unwrap();
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\ncontent-type: application/json\r\nx-b: 1\r\nx-b: 2\r\n\
             host: 127.0.0.1:8000\r\nx-request-id: r1\r\ncontent-length: 2\r\ntraceparent: 00-ours\r\n\r\n"
        );
        // A GET without a body has no length; the client's traceparent goes on when the leg sets none.
        let get = RequestHead { method: "GET", body_len: 0, drop: None, drop_credentials: false, ..head };
        let wire = String::from_utf8(get.wire("e:1", &[]).unwrap()).unwrap();
        assert!(wire.starts_with("GET /v1/chat/completions?x=1 HTTP/1.1\r\n"), "{wire}");
        assert!(wire.contains("traceparent: 00-client\r\n") && wire.contains("authorization: Bearer k\r\n"));
        assert!(!wire.contains("content-length"), "{wire}");
    }

    #[test]
    fn request_heads_that_would_split_a_line_are_refused() {
        let none = HeaderMap::new();
        let head = |path| RequestHead {
            method: "POST",
            path_and_query: path,
            client_headers: &none,
            drop: None,
            drop_credentials: false,
            request_id: "r",
            body_len: 0,
        };
        for bad in ["/a b", "/a\r\nx: y", "/a\n", "", "/a\u{7f}"] {
            assert!(head(bad).wire("e:1", &[]).is_err(), "{bad:?}");
        }
        assert!(head("/ok").wire("e:1\r\nx: y", &[]).is_err());
        assert!(head("/ok").wire("e:1", &[("traceparent", "a\nb")]).is_err());
        let id = RequestHead { request_id: "r\r\n", ..head("/ok") };
        assert!(id.wire("e:1", &[]).is_err());
        assert!(head("/ok").wire("e:1", &[]).is_ok());
    }

    /// A pooled connection to a loopback listener (kept open by the returned listener's accept).
    async fn conn() -> (Conn, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (engine, _) = listener.accept().await.unwrap();
        (Conn::new(Box::new(pingora::protocols::l4::stream::Stream::from(client))), engine)
    }

    fn key(peer: u64) -> PoolKey {
        PoolKey { peer, trust: None }
    }

    /// A connection kept under one pool's trust settings is never handed out under others
    /// for the same peer (pingora's reuse hash leaves the CA bundle out).
    #[tokio::test]
    async fn idle_connections_are_kept_apart_by_trust_settings() {
        let pool = IdlePool::default();
        let long = Duration::from_secs(60);
        let tls = |verify| UpstreamTls::new(None, Some("engine.test".into()), None, verify);
        let (first, second) = (tls(true), tls(false));
        assert_eq!(first.trust_key(), tls(true).trust_key(), "equal settings, equal keys");
        assert_ne!(first.trust_key(), second.trust_key());
        let under = |t: &UpstreamTls| PoolKey { peer: 7, trust: Some(t.trust_key().clone()) };
        let (a, _engine) = conn().await;
        pool.put(under(&first), a, long);
        assert!(pool.take(&under(&second), long).is_none(), "other settings: no connection");
        assert!(pool.take(&key(7), long).is_none(), "plain HTTP: no connection");
        assert!(pool.take(&under(&tls(true)), long).is_some(), "equal settings reuse it");
    }

    #[tokio::test]
    async fn the_pool_returns_live_connections_and_closes_expired_ones() {
        let pool = IdlePool::default();
        let long = Duration::from_secs(60);
        let (a, _engine_a) = conn().await;
        let (b, engine_b) = conn().await;
        pool.put(key(1), a, long);
        pool.put(key(2), b, long);
        assert_eq!(pool.len(), 2);
        // An engine that closed its side: the peek sees the FIN and the pool dials anew.
        drop(engine_b);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(pool.take(&key(2), long).is_none(), "a closed connection is not handed out");
        assert_eq!(pool.len(), 1);
        let a = pool.take(&key(1), long).expect("a live connection");
        pool.put(key(1), a, long);
        // Past the idle limit: closed by the sweep, whichever peer it belongs to.
        tokio::time::sleep(Duration::from_millis(20)).await;
        pool.close_expired(Duration::from_millis(10));
        assert_eq!(pool.len(), 0);
        assert!(pool.by_peer.lock().is_empty(), "empty peers are forgotten");
    }
}
