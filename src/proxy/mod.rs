//! The pingora glue. `Proxy` is the client-facing service: `request_filter` answers API
//! requests itself; every other request goes through pingora's pipeline to the route's pool,
//! byte for byte. `Admin` (admin.rs) serves the operator API.
//!
//! API requests never enter pingora's upstream pipeline: it cannot replay a body read that
//! early once it is over 64 KiB.
//!
//! Phases used: request_filter (route; API requests answered here) → upstream_peer
//! (passthrough only) → fail_to_proxy (passthrough errors, through the one error exit) →
//! logging (metrics, access log).
//!
//! The request path: `api::handle` (read, route, dispatch) → `orchestrate::run` or
//! `relay::handle` (plan, then the legs) → `exec` (send, wait) and `respond` (relay, write)
//! → `rescue::fail` for every `Err`; below `request_filter` they pass one [`Call`]. Beside
//! the legs: `verify` (what the prompt ids feed besides them) and `reuse` (reuse accounting).

pub mod admin;
mod api;
pub mod edge;
pub mod error;
pub mod exec;
pub mod orchestrate;
mod passthrough;
pub mod relay;
mod rescue;
pub mod respond;
mod reuse;
mod verify;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;

pub use admin::Admin;
pub use error::ProxyError;

use crate::app::{Admitted, App, SharedApp};
use crate::metrics::{Leg, Listener, Outcome};
use crate::openai::{Api, RawObject, RequestView};
use crate::routes::metrics::FirstBytes;
use crate::routes::{RequestFacts, Route};
use crate::upstream::{ComputingAlone, Picked, UpstreamError};

/// Per-request state: what the request is, and what it records on its way. Handlers take
/// the two apart (`&RequestInfo`, `&mut Record`), so they can hold on to the route while
/// recording.
pub struct Ctx {
    /// What the request is.
    pub info: RequestInfo,
    /// What it records.
    pub rec: Record,
}

impl Ctx {
    /// This request with the client's connection, as the handlers below `request_filter`
    /// pass it.
    pub fn call<'a>(&'a mut self, session: &'a mut Session) -> Call<'a> {
        Call { session, info: &self.info, rec: &mut self.rec }
    }
}

/// One request being served, as every handler, leg and writer below `request_filter` takes
/// it: the three handles that travel together. What is a function's own (the client request
/// a leg's head is built from, an endpoint, a body) is passed beside it.
pub struct Call<'a> {
    /// The client's connection: watched for the client leaving, written with the answer.
    pub session: &'a mut Session,
    /// What the request is (only read, so a handler can hold the route while recording).
    pub info: &'a RequestInfo,
    /// What it records on its way (read by the error exit and `logging`).
    pub rec: &'a mut Record,
}

/// What a request is: set by `request_filter` and the route choice, then only read.
pub struct RequestInfo {
    /// The configuration snapshot this request runs on.
    pub app: Arc<App>,
    /// The chosen route (the default route until one is chosen).
    pub route: Arc<Route>,
    /// When the request head was seen.
    pub started: Instant,
    /// API of an OpenAI path.
    pub api: Option<Api>,
    /// Request id used on both legs (the client's `X-Request-Id`, else a new one).
    pub request_id: String,
    /// The client's (peer's) IP address.
    pub client_ip: Option<std::net::IpAddr>,
}

/// What a request records on its way, grouped by what it records; the error exit and
/// `logging` read it.
#[derive(Default)]
pub struct Record {
    /// The client's answer.
    pub answer: AnswerRecord,
    /// The legs' stage timings and how far the engine's answer got.
    pub legs: LegRecord,
    /// Reuse accounting (see `reuse`).
    pub reuse: ReuseRecord,
    /// A request pingora's pipeline passes through.
    pub passthrough: PassthroughRecord,
    /// This request's admission slot, counted in `inflight_requests` (freed when the context
    /// is dropped).
    pub admitted: Option<Admitted>,
    /// OpenTelemetry spans of this request (empty when tracing is off).
    pub trace: crate::telemetry::RequestTrace,
}

/// The answer to the client: status, outcome and time to first byte for the metrics and
/// the access log, and how the error exit must end it.
#[derive(Default)]
pub struct AnswerRecord {
    /// Final status sent to the client.
    pub status: u16,
    /// How it ended (set when known; else derived from the status in `logging`).
    pub outcome: Option<Outcome>,
    /// When the response header went out.
    pub first_byte: Option<Duration>,
    /// When the first content of a 2xx answer was written (time to first token): a streamed
    /// answer's first content event, any other answer's first body byte.
    pub first_token: Option<Duration>,
    /// True once an SSE response head went out: errors then end the stream instead.
    pub streaming: bool,
    /// The `sequence_number` an error event ending a Responses stream takes.
    pub next_sequence: u64,
    /// The client connection must be closed without ending the response (a non-SSE body
    /// cut mid-way, or a client that stopped reading): `request_filter` then returns an
    /// error, so pingora drops the connection instead of finishing the body.
    pub cut: bool,
}

impl AnswerRecord {
    /// Records the time to first byte (since `started`) once.
    pub fn mark_first_byte(&mut self, started: Instant) {
        self.first_byte.get_or_insert_with(|| started.elapsed());
    }

    /// Records the time to first token (since `started`) once: content of a 2xx answer was
    /// just written.
    pub fn mark_first_token(&mut self, started: Instant) {
        self.first_token.get_or_insert_with(|| started.elapsed());
    }
}

/// What the legs did: stage timings for the metrics and the access log, and whether the
/// engine's answer began (for the release decision).
#[derive(Default)]
pub struct LegRecord {
    /// Prefill leg duration, for the access log.
    pub prefill_ms: Option<f64>,
    /// When the decode leg was sent.
    pub decode_sent_at: Option<Instant>,
    /// Decode time to response header, for the access log.
    pub decode_first_byte_ms: Option<f64>,
    /// A body byte of the engine's answer reached tokenonce (a decode that streams has pulled
    /// the prefill's KV blocks).
    pub answer_started: bool,
    /// The prompt a decode alone computes, counted on its endpoint until the answer starts.
    pub computing_alone: Option<ComputingAlone>,
}

/// Reuse accounting: what the access log says of reuse, and what waits on the decode.
#[derive(Default)]
pub struct ReuseRecord {
    /// Token reuse result or fallback reason, for the access log.
    pub log: Option<&'static str>,
    /// Ids sent to the decode (tokens, JSON bytes), counted `applied` only once the decode
    /// answers 2xx and `decode_failed` otherwise (see `reuse::settle`).
    pub pending: Option<(usize, usize)>,
}

/// A passthrough through pingora's pipeline.
#[derive(Default)]
pub struct PassthroughRecord {
    /// The endpoint (held for in-flight counting).
    pub endpoint: Option<Picked>,
    /// Pingora dialled a TLS connection for this request (none was reused).
    pub fresh_tls: bool,
    /// Request body bytes streamed to the engine so far.
    pub body_bytes: usize,
}

/// An API request whose body parsed: what handlers and plans read.
pub struct ApiRequest<'a> {
    /// Path, headers and the raw body, for building legs.
    pub incoming: exec::Incoming<'a>,
    /// The body's members, raw.
    pub obj: RawObject<'a>,
    /// The fields that decide reuse.
    pub view: RequestView,
}

impl ApiRequest<'_> {
    /// The request as the plan reads it.
    pub fn plan_input(&self) -> crate::plan::Request<'_, '_> {
        crate::plan::Request { obj: &self.obj, view: &self.view, source: Some(self.incoming.body) }
    }
}

/// Admission: takes a slot for this request (counted in `inflight_requests`), or, with
/// `server.max_in_flight` requests in flight, answers 503 `overloaded` with `Retry-After`
/// before anything else is done (the body is not read, so the connection is closed after).
async fn admit(session: &mut Session, ctx: &mut Ctx) -> bool {
    let app = &ctx.info.app;
    if let Some(slot) = app.admission.admit(app.config.server.max_in_flight) {
        ctx.rec.admitted = Some(slot);
        app.metrics.requests.inflight().inc();
        return true;
    }
    let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
    app.metrics.requests.admission_rejected(if tls { Listener::Tls } else { Listener::Plain });
    session.set_keepalive(None);
    let limit = app.config.server.max_in_flight;
    rescue::fail(&mut ctx.call(session), crate::openai::ApiError::Overloaded(limit).into()).await;
    false
}

/// The client-facing proxy.
pub struct Proxy {
    /// The current state; replaced whole on reload.
    pub app: SharedApp,
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        // One config snapshot per request: a reload never changes a request in flight.
        let app = self.app.load_full();
        Ctx {
            info: RequestInfo {
                route: Arc::clone(app.routes.default_route()),
                app,
                started: Instant::now(),
                api: None,
                request_id: String::new(),
                client_ip: None,
            },
            rec: Record::default(),
        }
    }

    /// Routes the request; API calls that need their body are answered here (`Ok(true)`).
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.info.started = Instant::now();
        ctx.info.client_ip = session.client_addr().and_then(|a| a.as_inet()).map(|a| a.ip());
        session.as_downstream_mut().set_write_timeout(Some(ctx.info.route.client_write_timeout));
        let header = session.req_header();
        ctx.info.request_id = header
            .headers
            .get(crate::upstream::REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned);
        ctx.rec.trace =
            crate::telemetry::RequestTrace::start(header.method.as_str(), header.uri.path(), &header.headers);
        // Known before admission and the head check, so even those errors are in the API's format.
        ctx.info.api = (header.method == http::Method::POST).then(|| Api::from_path(header.uri.path())).flatten();
        if !admit(session, ctx).await {
            return Ok(true);
        }
        let app = &ctx.info.app;
        if let Err(e) = edge::check_head(&session.req_header().headers, &edge::EdgeLimits::of(&app.config)) {
            session.set_keepalive(None);
            rescue::fail(&mut ctx.call(session), e.into()).await;
            return Ok(true);
        }
        // Every API request is read and sent by tokenonce, on passthrough routes too: only a
        // read body says whether the answer streams (a non-streamed one gets the whole-answer
        // deadline), and only our leg client feeds outcomes, timeouts too, to ejection.
        if let Some(api) = ctx.info.api {
            if let Err(e) = api::handle(session, ctx, api).await {
                rescue::fail(&mut ctx.call(session), e).await;
            }
            if ctx.rec.answer.cut {
                // An error here makes pingora drop the connection without ending the body.
                return Err(Error::explain(ErrorType::WriteError, "response cut"));
            }
            return Ok(true);
        }
        let header = session.req_header();
        let facts = RequestFacts { path: header.uri.path(), model: None, headers: &header.headers };
        ctx.info.route = Arc::clone(app.routes.select(&facts));
        session.as_downstream_mut().set_write_timeout(Some(ctx.info.route.client_write_timeout));
        let answered = passthrough::check_declared_length(&mut ctx.call(session)).await?;
        if !answered {
            // pingora streams the body to the engine; the client waits for our go.
            edge::continue_if_expected(session).await?;
        }
        Ok(answered)
    }

    /// Passthrough only: counts the streamed request body against the route's
    /// `max_body_bytes` (a chunked body has no declared length to check up front).
    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        _end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        passthrough::count_body(&ctx.info, &mut ctx.rec, body.as_ref().map_or(0, bytes::Bytes::len))
    }

    /// A cut response was logged by the error exit already.
    fn suppress_error_log(&self, _session: &Session, ctx: &Ctx, _error: &Error) -> bool {
        ctx.rec.answer.cut
    }

    /// Passthrough only: an endpoint of the route's pool.
    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let picked = passthrough::stored_answer_home(&ctx.info, session.req_header().uri.path())
            .or_else(|| ctx.info.route.decode_pool.pick())
            .ok_or_else(|| Error::explain(ErrorType::HTTPStatus(502), "passthrough pool is empty"))?;
        let peer = ctx
            .info
            .app
            .client
            .peer(picked.endpoint().target())
            .await
            .map_err(|e| Error::explain(ErrorType::ConnectError, e.to_string()))?;
        ctx.rec.passthrough.endpoint = Some(picked);
        Ok(Box::new(passthrough::bounded_peer(peer, &ctx.info.route)))
    }

    /// Passthrough: notes whether the connection was dialled for this request (a TLS refusal
    /// after the handshake shows as a reset on its first write).
    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        #[cfg(unix)] _fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        _digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.rec.passthrough.fresh_tls = !reused && peer.is_tls();
        Ok(())
    }

    /// Passthrough: the request's own `traceparent` goes to the engine (when tracing is on),
    /// and the endpoint's data-parallel rank when it has one.
    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        for (name, value) in ctx.rec.trace.headers_for(Leg::Passthrough) {
            upstream.insert_header(name, value)?;
        }
        if let Some((name, value)) = ctx.rec.passthrough.endpoint.as_ref().and_then(|p| p.endpoint().rank_header()) {
            upstream.insert_header(name, value)?;
        }
        // `100 Continue` was answered here already (`request_filter`).
        upstream.remove_header(&http::header::EXPECT);
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.rec.answer.status = upstream.status.as_u16();
        ctx.rec.answer.mark_first_byte(ctx.info.started);
        Ok(())
    }

    /// Passthrough failures go through the one error exit (OpenAI-shaped, redacted).
    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        if ctx.rec.answer.cut {
            // `request_filter` cut an API response; the error exit already ran.
            return FailToProxy { error_code: 0, can_reuse_downstream: false };
        }
        let addr = ctx.rec.passthrough.endpoint.as_ref().map_or_else(String::new, |p| p.addr().to_owned());
        let err = match passthrough::classify(session, e, &ctx.info) {
            Some(err) => err,
            None => match e.etype() {
                ErrorType::ConnectTimedout
                | ErrorType::ConnectRefused
                | ErrorType::ConnectError
                | ErrorType::ConnectNoRoute
                | ErrorType::TLSHandshakeFailure
                | ErrorType::TLSHandshakeTimedout
                | ErrorType::InvalidCert
                | ErrorType::HandshakeError => ProxyError::upstream(Leg::Passthrough, UpstreamError::connect(&addr, e)),
                _ if matches!(e.esource(), ErrorSource::Upstream) => ProxyError::upstream(
                    Leg::Passthrough,
                    UpstreamError::passthrough(&addr, e, ctx.rec.passthrough.fresh_tls),
                ),
                _ if matches!(e.esource(), ErrorSource::Downstream) => ProxyError::ClientGone,
                _ => ProxyError::Internal(e.to_string()),
            },
        };
        if let (Some(picked), Some((_, kind))) = (&ctx.rec.passthrough.endpoint, err.counted_as()) {
            picked.endpoint().error(kind);
        }
        let code = match err {
            ProxyError::ClientGone | ProxyError::ClientStalled { .. } => 0,
            ref err => err.api_error().status(),
        };
        rescue::fail(&mut ctx.call(session), err).await;
        FailToProxy { error_code: code, can_reuse_downstream: false }
    }

    /// Counts the request once, whatever path it took.
    async fn logging(&self, session: &mut Session, _e: Option<&Error>, ctx: &mut Ctx) {
        if ctx.rec.admitted.is_some() {
            ctx.info.app.metrics.requests.inflight().dec();
        }
        let status = if ctx.rec.answer.status != 0 {
            ctx.rec.answer.status
        } else {
            session.response_written().filter(|h| !h.status.is_informational()).map_or(0, |h| h.status.as_u16())
        };
        let outcome = ctx.rec.answer.outcome.unwrap_or(if status == 0 {
            Outcome::ClientClosed
        } else {
            Outcome::from_status(status)
        });
        let elapsed = ctx.info.started.elapsed();
        let route = &ctx.info.route;
        let first = FirstBytes { head: ctx.rec.answer.first_byte, content: ctx.rec.answer.first_token };
        route.metrics.finished(ctx.info.api, outcome, elapsed, first);
        let mode = crate::routes::metrics::served_as(ctx.info.api, route.mode).as_str();
        ctx.rec.trace.attribute("tokenonce.route", route.name.clone());
        ctx.rec.trace.attribute("tokenonce.api", ctx.info.api.map_or("other", Api::as_str));
        ctx.rec.trace.attribute("tokenonce.mode", mode);
        ctx.rec.trace.attribute("tokenonce.outcome", outcome.as_str());
        ctx.rec.trace.finish(status);
        tracing::info!(
            request_id = %ctx.info.request_id,
            route = %route.name,
            api = ctx.info.api.map_or("other", Api::as_str),
            mode,
            status,
            outcome = outcome.as_str(),
            reuse = ctx.rec.reuse.log.unwrap_or("-"),
            prefill_ms = ctx.rec.legs.prefill_ms.unwrap_or(0.0),
            decode_first_byte_ms = ctx.rec.legs.decode_first_byte_ms.unwrap_or(0.0),
            ttfb_ms = ctx.rec.answer.first_byte.map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            total_ms = elapsed.as_secs_f64() * 1000.0,
            "request"
        );
    }
}
