//! The executor: sends the legs a plan decided (heads, deadlines, prefill failover, the
//! release leg, stage timings) and hands a decode's or forwarded leg's answer back for
//! `respond` to relay. Every failure is returned as a [`ProxyError`] for the one error exit.
//!
//! Each leg goes through the [`LegClient`] (where the retry, budget and ejection rules are),
//! within its deadline while the client is watched; a pool prefill fails over to another
//! endpoint, and its answer is read whole here.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use pingora::http::ResponseHeader;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::edge::client_gone;
use super::error::ProxyError;
use super::{Call, Record, RequestInfo};
use crate::app::App;
use crate::config::{OnClientGone, OnPrefillFailure};
use crate::metrics::{ErrorKind, Leg, Release, Stage, TimeoutStage};
use crate::openai::json::Pieces;
use crate::openai::response::HandoffError;
use crate::plan::{DecodeStep, DecodeVersion, Orchestration};
use crate::routes::Route;
use crate::upstream::client::RequestHead;
use crate::upstream::health::learn_version;
use crate::upstream::{Delivery, Endpoint, Exchange, Failover, LegClient, Picked, Pool};

/// Largest prefill response accepted (a 128k-token prompt echoed is about 1 MB).
const PREFILL_RESPONSE_LIMIT: usize = 64 * 1024 * 1024;

/// The client request as read by `request_filter`: what every leg's head is built from.
#[derive(Clone, Copy)]
pub struct Incoming<'a> {
    /// Path and query as the client sent them.
    pub path_and_query: &'a str,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body.
    pub body: &'a Bytes,
    /// A header never forwarded (the route's `x-prefiller-host-port`).
    pub drop_header: Option<&'a str>,
    /// Leave the client's credentials out of this leg (a header-named prefiller).
    pub drop_credentials: bool,
    /// The client asked for a streamed answer (`stream: true`); its decode keeps that.
    pub streamed: bool,
}

impl Incoming<'_> {
    /// The head of a leg: this request's path and end-to-end headers (minus the route's
    /// `x-prefiller-host-port`, and the credentials to a header-named prefiller),
    /// `request_id` as `X-Request-Id`, and the leg's body length.
    fn head<'h>(&'h self, request_id: &'h str, body_len: usize) -> RequestHead<'h> {
        RequestHead {
            method: "POST",
            path_and_query: self.path_and_query,
            client_headers: self.headers,
            drop: self.drop_header,
            drop_credentials: self.drop_credentials,
            request_id,
            body_len,
        }
    }
}

/// What is known of the decode engine's vLLM: the pool's pinned version, else the learned
/// one, else asked now. Concurrent requests wait for one ask (a burst of first requests
/// would otherwise each ask, and one slow answer would send its request down the text
/// path while the others learned the version); a failed ask is remembered for a pause.
pub async fn decode_version(app: &App, route: &Route, decode: &Endpoint) -> DecodeVersion {
    if let Some(v) = route.decode_pool.pinned_version().or_else(|| decode.facts().version()) {
        return DecodeVersion::Known(v);
    }
    let _one_ask = decode.facts().version_ask.lock().await;
    match decode.facts().version() {
        Some(v) => DecodeVersion::Known(v),
        None => learn_version(&app.client, decode).await.map_or(DecodeVersion::Unknown, DecodeVersion::Known),
    }
}

/// How long a decode or passthrough leg may wait for its response head: a streamed answer's
/// head comes before its first token (the route's first-byte timeout); a non-streamed one's
/// only when generation is done (its whole-answer timeout).
fn head_deadline(route: &Route, req: &Incoming<'_>) -> Duration {
    match req.streamed {
        true => route.decode_first_byte_timeout,
        false => route.decode_whole_answer_timeout,
    }
}

/// One leg to send: its label, endpoint and body.
struct Outgoing<'r> {
    leg: Leg,
    endpoint: &'r Picked,
    body: Pieces,
}

/// What sends this request's legs: what the request is, its trace, and the client request
/// each leg's head is built from.
#[derive(Clone, Copy)]
struct Sender<'r> {
    info: &'r RequestInfo,
    rec: &'r Record,
    req: &'r Incoming<'r>,
}

impl<'r> Sender<'r> {
    /// The request's leg client: the route's budget and series, the process's connections.
    fn client(self) -> LegClient<'r> {
        let (info, rec) = (self.info, self.rec);
        LegClient {
            trace: &rec.trace,
            client: &info.app.client,
            metrics: &info.app.metrics.upstream,
            budget: info.route.retry_budget(),
            leg_metrics: &info.route.leg_metrics,
            route: &info.route.name,
            request_id: &info.request_id,
        }
    }

    /// Sends one leg (its head built from the request, with the trace context) through the
    /// [`LegClient`], the one sender of every leg: deadline, retry, budget and ejection rules
    /// live there. The answer head must come within `limit`; `delivery` is marked once the
    /// request is written whole (see [`DecodeLeg::ended`]).
    async fn exchange(
        self,
        out: &Outgoing<'_>,
        delivery: &Delivery,
        limit: Option<Duration>,
    ) -> Result<Exchange, ProxyError> {
        let head = self.req.head(&self.info.request_id, out.body.len());
        Ok(self.client().send(out.leg, out.endpoint, head, out.body.parts(), delivery, limit).await?)
    }

    /// Failover policy: the prefill goes to `first`; while an attempt [fails
    /// over](PrefillTry::fails_over) and the route's `prefill_attempts` (at most the pool's
    /// size) allow, it goes to another endpoint of `pool` (a header-named prefiller has none),
    /// not one tried already. Each failover is counted; the last attempt's result is returned.
    async fn prefill_attempts(
        self,
        first: &Picked,
        pool: Option<&Pool>,
        body: Pieces,
        deadline: tokio::time::Instant,
    ) -> PrefillTry {
        let mut failover = Failover::new(pool, first, self.info.route.prefill_attempts);
        let mut result = self.prefill_once(first, body.clone(), deadline).await;
        while result.fails_over() {
            let Some(next) = self.client().fail_over(&mut failover) else { break };
            if let PrefillTry::NoAnswer(e) = &result {
                super::error::count(self.info, e);
            }
            result = self.prefill_once(&next, body.clone(), deadline).await;
        }
        result
    }

    /// One prefill attempt on `endpoint` before the prefill's `deadline`; one that passes it
    /// is a failure of the endpoint (for its ejection).
    async fn prefill_once(self, endpoint: &Picked, body: Pieces, deadline: tokio::time::Instant) -> PrefillTry {
        self.client()
            .before(Leg::Prefill, endpoint, deadline, self.prefill_answer(endpoint, body))
            .await
            .unwrap_or(PrefillTry::TimedOut)
    }

    /// A prefill attempt's exchange: send, then read the whole answer. A 5xx is counted here.
    async fn prefill_answer(self, endpoint: &Picked, body: Pieces) -> PrefillTry {
        let info = self.info;
        let out = Outgoing { leg: Leg::Prefill, endpoint, body };
        let exchange = match self.exchange(&out, &Delivery::default(), None).await {
            Ok(exchange) => exchange,
            Err(e) => return PrefillTry::NoAnswer(e),
        };
        let head = Some(exchange.head().clone());
        if head.as_ref().is_some_and(|h| h.status.as_u16() >= 500) {
            info.app.metrics.upstream.upstream_error(Leg::Prefill, ErrorKind::Status5xx);
        }
        let body = info.app.client.read_to_end(exchange, PREFILL_RESPONSE_LIMIT).await;
        if let Err(e) = &body {
            endpoint.endpoint().error(e.kind());
        }
        PrefillTry::Answered(body.map(|b| (head, b)).map_err(|e| ProxyError::upstream(Leg::Prefill, e)))
    }
}

/// [`Sender::exchange`] of `req`'s leg within `first_byte_timeout`, racing the client going
/// away; with the result, whether the request was written whole (the engine may have it)
/// when that ended.
async fn send(
    call: &mut Call<'_>,
    req: &Incoming<'_>,
    out: Outgoing<'_>,
    first_byte_timeout: Option<Duration>,
) -> (Result<Exchange, ProxyError>, bool) {
    let delivery = Delivery::default();
    let sender = Sender { info: call.info, rec: call.rec, req };
    let result = tokio::select! {
        r = sender.exchange(&out, &delivery, first_byte_timeout) => r,
        _ = client_gone(call.session) => Err(ProxyError::ClientGone),
    };
    (result, delivery.delivered())
}

/// The prefill leg, whole: sends `body` to `first` (then, failing over, to other endpoints
/// of `pool`) and reads the answer, all within the route's prefill timeout. A 5xx answer is
/// counted but returned (the caller passes it to the client).
///
/// # Errors
/// [`ProxyError`] on timeout, engine failure, or the client leaving.
pub async fn prefill_leg(
    call: &mut Call<'_>,
    req: &Incoming<'_>,
    first: &Picked,
    pool: Option<&Pool>,
    body: Pieces,
) -> Result<(ResponseHeader, Bytes), ProxyError> {
    let route = &call.info.route;
    let started = Instant::now();
    call.rec.trace.leg_started(Leg::Prefill);
    let deadline = tokio::time::Instant::now() + route.prefill_timeout;
    let sender = Sender { info: call.info, rec: call.rec, req };
    let answer = tokio::select! {
        r = sender.prefill_attempts(first, pool, body, deadline) => r,
        _ = client_gone(call.session) => return Err(ProxyError::ClientGone),
    };
    call.rec.trace.leg_done(Leg::Prefill);
    call.rec.legs.prefill_ms = Some(ms_since(started));
    route.metrics.stage(Stage::Prefill, started.elapsed());
    match answer {
        PrefillTry::TimedOut => Err(ProxyError::Timeout { leg: Leg::Prefill, after: route.prefill_timeout }),
        PrefillTry::NoAnswer(e) | PrefillTry::Answered(Err(e)) => Err(e),
        PrefillTry::Answered(Ok((None, _))) => Err(HandoffError("no response header".into()).into()),
        PrefillTry::Answered(Ok((Some(head), body))) => Ok((head, body)),
    }
}

/// One prefill attempt's result.
enum PrefillTry {
    /// The engine gave no answer head (connect failed, reset, closed): another may.
    NoAnswer(ProxyError),
    /// It answered: the head (if any) and the whole body, or a failure reading it.
    Answered(Result<(Option<ResponseHeader>, Bytes), ProxyError>),
    /// The prefill's deadline passed during this attempt (counted against its endpoint).
    TimedOut,
}

impl PrefillTry {
    /// True when another endpoint should be tried: no answer from the engine, or a 5xx.
    /// A 4xx is the client's and goes back as is; a failure after the head is not retried.
    fn fails_over(&self) -> bool {
        match self {
            Self::NoAnswer(e) => matches!(e, ProxyError::Upstream { .. }),
            Self::Answered(Ok((Some(head), _))) => head.status.as_u16() >= 500,
            Self::Answered(_) | Self::TimedOut => false,
        }
    }
}

/// What an orchestrated request does after its prefill leg.
pub enum Prefilled {
    /// Send this decode.
    Step(DecodeStep),
    /// Answer the prefill's own non-2xx answer unchanged.
    EngineAnswer(ResponseHeader, Bytes),
}

/// The decode step from the prefill's result, under the route's `on_prefill_failure`: a
/// failed prefill (unreachable, a 5xx, timed out, or a 2xx that is not a completion; never
/// a 4xx, which is the client's) is the client's error with `error`, and the decode alone
/// with `decode_alone` (the failure still counted in `upstream_errors_total`).
///
/// # Errors
/// The prefill's failure, when it is answered.
pub fn after_prefill(
    info: &RequestInfo,
    plan: &Orchestration<'_, '_>,
    prefilled: Result<(ResponseHeader, Bytes), ProxyError>,
) -> Result<Prefilled, ProxyError> {
    let result = prefilled.and_then(|(head, answer)| match head.status.is_success() {
        true => plan.after_prefill(&answer).map(Prefilled::Step).map_err(ProxyError::from),
        false => Ok(Prefilled::EngineAnswer(head, answer)),
    });
    let failed = match &result {
        Ok(Prefilled::EngineAnswer(head, _)) => head.status.as_u16() >= 500,
        Ok(Prefilled::Step(_)) => false,
        Err(e) => matches!(
            e,
            ProxyError::Upstream { leg: Leg::Prefill, .. }
                | ProxyError::Timeout { leg: Leg::Prefill, .. }
                | ProxyError::PrefillBadResponse(_)
        ),
    };
    if !failed || info.route.on_prefill_failure != OnPrefillFailure::DecodeAlone {
        return result;
    }
    let error = match &result {
        Ok(Prefilled::EngineAnswer(head, _)) => format!("answered {}", head.status.as_u16()),
        Ok(Prefilled::Step(_)) => String::new(),
        Err(e) => e.to_string(),
    };
    if let Err(e) = &result {
        super::error::count(info, e);
    }
    tracing::info!(request_id = %info.request_id, route = %info.route.name, error = %error, "prefill failed: the decode runs alone");
    Ok(Prefilled::Step(plan.decode_alone()))
}

/// The decode leg of an orchestrated request: the client request its head is built from,
/// its endpoint, and the step the plan decided (its body, and whether the prefill holds KV
/// blocks for it): [`send`](Self::send), the answer relayed, then [`ended`](Self::ended).
pub struct DecodeLeg<'r> {
    /// The client request.
    pub req: &'r Incoming<'r>,
    /// The decode endpoint.
    pub endpoint: &'r Picked,
    /// What the plan decided.
    pub step: DecodeStep,
}

impl DecodeLeg<'_> {
    /// Sends the decode leg, its response head awaited within `head_deadline`, and records
    /// its first-byte timings. With the answer, whether the engine got the request whole
    /// (for [`ended`](Self::ended)).
    pub async fn send(&self, call: &mut Call<'_>) -> (Result<Exchange, ProxyError>, bool) {
        let route = &call.info.route;
        let started = Instant::now();
        call.rec.legs.decode_sent_at = Some(started);
        let timeout = Some(head_deadline(route, self.req));
        call.rec.trace.leg_started(Leg::Decode);
        let out = Outgoing { leg: Leg::Decode, endpoint: self.endpoint, body: self.step.body.clone() };
        let (sent, delivered) = send(call, self.req, out, timeout).await;
        if sent.is_ok() {
            call.rec.trace.first_byte();
            call.rec.legs.decode_first_byte_ms = Some(ms_since(started));
            route.metrics.stage(Stage::DecodeFirstByte, started.elapsed());
        }
        (sent, delivered)
    }

    /// Ends the leg once its answer was relayed (or failed, `result`); when the client left
    /// before the engine's answer began, sees to the prefill's KV blocks
    /// (`after_client_gone`). `delivered` is [`send`](Self::send)'s.
    pub async fn ended(&self, call: &mut Call<'_>, result: &Result<(), ProxyError>, delivered: bool) {
        call.rec.trace.leg_done(Leg::Decode);
        if matches!(result, Err(ProxyError::ClientGone)) && !call.rec.legs.answer_started {
            let sender = Sender { info: call.info, rec: call.rec, req: self.req };
            self.after_client_gone(sender, delivered).await;
        }
    }

    /// The client left before the decode answered a body byte, while the prefill may hold KV
    /// blocks for it. A decode engine that got the request whole owns those blocks: vLLM pulls
    /// them when it schedules the request, and one aborted before that tells the prefill to free
    /// them (NixlConnector, vLLM 0.32). A second decode with the same `kv_transfer_params` reads
    /// them again after the prefill freed them (on the real pair: a second NIXL transfer, and the
    /// prefill logs "Potentially invalid KV blocks ... retrieved"), so a release goes only where the
    /// decode provably never had the request (gone before it was written whole); the rest count
    /// `left_to_decode`.
    async fn after_client_gone(&self, sender: Sender<'_>, delivered: bool) {
        if !self.step.holds_kv {
            return;
        }
        let info = sender.info;
        if delivered {
            info.route.metrics.kv_release(Release::LeftToDecode);
            tracing::info!(request_id = %info.request_id, route = %info.route.name, "client gone after the decode got its request: the decode frees or pulls the KV blocks, no release");
            return;
        }
        self.release(sender).await;
    }

    /// The client left after a prefill that holds KV blocks for this decode, before the decode
    /// leg reached the engine whole. Under the route's `on_client_gone`: `release` sends the
    /// decode for one token, not streamed, reads and discards the answer within
    /// `release_timeout_ms`, so the decode pulls the blocks and the prefill frees them now;
    /// `abandon` sends nothing (they wait for the prefill's lease). Counted in `kv_releases_total`.
    async fn release(&self, sender: Sender<'_>) {
        let Some(body) = self.step.release_body() else { return };
        let (info, endpoint) = (sender.info, self.endpoint);
        let route = &info.route;
        if route.on_client_gone == OnClientGone::Abandon {
            route.metrics.kv_release(Release::Abandoned);
            tracing::info!(request_id = %info.request_id, route = %route.name, "client gone after the prefill: KV blocks left to their lease");
            return;
        }
        let span = sender.rec.trace.release();
        let work = async {
            let out = Outgoing { leg: Leg::Decode, endpoint, body: body.into() };
            let exchange = sender.exchange(&out, &Delivery::default(), None).await?;
            let ok = (200..300).contains(&exchange.status());
            info.app
                .client
                .read_to_end(exchange, RELEASE_ANSWER_LIMIT)
                .await
                .map_err(|e| ProxyError::upstream(Leg::Decode, e))?;
            Ok::<bool, ProxyError>(ok)
        };
        let deadline = tokio::time::Instant::now() + route.release_timeout;
        let (result, error) =
            match sender.client().before(Leg::Decode, endpoint, deadline, work.instrument(span.clone())).await {
                Some(Ok(true)) => (Release::Released, String::new()),
                Some(Ok(false)) => (Release::Failed, "answered a non-2xx status".to_owned()),
                Some(Err(e)) => (Release::Failed, e.to_string()),
                None => {
                    route.metrics.timeout(TimeoutStage::Release);
                    (Release::Timeout, format!("no answer within {} ms", route.release_timeout.as_millis()))
                }
            };
        route.metrics.kv_release(result);
        span.set_attribute("tokenonce.release.result", result.as_str());
        tracing::info!(request_id = %info.request_id, route = %route.name, result = result.as_str(), error = %error, "client gone after the prefill: one-token decode sent to release its KV blocks");
    }
}

/// Largest answer read (and discarded) from a release leg.
const RELEASE_ANSWER_LIMIT: usize = 1024 * 1024;

/// Sends `body` to `endpoint` on `leg`, for its answer to be relayed unchanged (passthrough
/// with a read body, decode-only, relay legs). The response head is awaited within
/// `head_deadline` (a relay prefill forwarded as is: its prefill timeout).
///
/// # Errors
/// [`ProxyError`] when the engine fails or the client leaves.
pub async fn send_forward(
    call: &mut Call<'_>,
    req: &Incoming<'_>,
    leg: Leg,
    endpoint: &Picked,
    body: Pieces,
) -> Result<Exchange, ProxyError> {
    // The decode stage's duration is the decode's: a relayed prefill forwarded as is has none.
    if leg == Leg::Decode {
        call.rec.legs.decode_sent_at = Some(Instant::now());
    }
    // A relayed prefill answers as a whole; anything else is bounded to its response head.
    let first_byte = match leg {
        Leg::Prefill => call.info.route.prefill_timeout,
        Leg::Decode | Leg::Passthrough => head_deadline(&call.info.route, req),
    };
    call.rec.trace.leg_started(leg);
    let sent = send(call, req, Outgoing { leg, endpoint, body }, Some(first_byte)).await.0;
    if sent.is_ok() {
        call.rec.trace.first_byte();
    }
    sent
}

/// Time since `t` in milliseconds, for the access log.
fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}
