//! Writing to the client: complete bodies (tokenonce's own and an engine's buffered answer),
//! and an engine's answer relayed, with the legs it comes from ([`decode`], [`forward`]: sent
//! by `exec`, reuse settled by `reuse`). Failures are returned; `rescue::fail` answers them.
//!
//! A relayed body is streamed through, SSE framed event by event, JSON buffered only when
//! its `cached_tokens` is rewritten; every read and write is bounded.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use pingora::http::ResponseHeader;
use pingora::prelude::fast_timeout::fast_sleep;

use super::edge::client_gone;
use super::error::ProxyError;
use super::exec::{self, DecodeLeg, Incoming};
use super::{reuse, Call, Record, RequestInfo};
use crate::metrics::{Leg, Outcome, Stage, TimeoutStage};
use crate::openai::json::Pieces;
use crate::openai::response::{rewrite_usage_cached, StreamFraming};
use crate::openai::Api;
use crate::plan::DecodeStep;
use crate::upstream::client::DROPPED_RESPONSE_HEADERS;
use crate::upstream::{Exchange, Picked, REQUEST_ID_HEADER};

/// Sends the planned decode leg ([`DecodeLeg::send`]), settles its reuse, relays its answer,
/// and ends the leg ([`DecodeLeg::ended`]: the KV blocks seen to when the client left first).
///
/// # Errors
/// [`ProxyError`] when the decode fails, times out, or the client leaves.
pub async fn decode(
    call: &mut Call<'_>,
    req: &Incoming<'_>,
    endpoint: &Picked,
    step: DecodeStep,
) -> Result<(), ProxyError> {
    let decode = DecodeLeg { req, endpoint, step };
    let (sent, delivered) = decode.send(call).await;
    decode_sent(call, &decode, sent, delivered).await
}

/// The rest of [`decode`] once the leg was sent (`sent`, `delivered`: [`DecodeLeg::send`]'s):
/// its reuse settled, its answer relayed, the leg ended.
///
/// # Errors
/// [`ProxyError`] when the engine fails or the client leaves.
pub async fn decode_sent(
    call: &mut Call<'_>,
    decode: &DecodeLeg<'_>,
    sent: Result<Exchange, ProxyError>,
    delivered: bool,
) -> Result<(), ProxyError> {
    reuse::settle(call.info, call.rec, sent.as_ref().ok().map(Exchange::status));
    let result = match sent {
        Ok(exchange) => {
            let relayed = relay(call, exchange, decode.step.cached_tokens, Leg::Decode).await;
            count_answer_failure(decode.endpoint, &relayed);
            relayed
        }
        Err(e) => Err(e),
    };
    decode.ended(call, &result, delivered).await;
    result
}

/// Sends `body` to `endpoint` on `leg` ([`exec::send_forward`]) and relays the answer
/// unchanged (passthrough with a read body, decode-only, relay legs), its reuse settled.
///
/// # Errors
/// [`ProxyError`] when the engine fails or the client leaves.
pub async fn forward(
    call: &mut Call<'_>,
    req: &Incoming<'_>,
    leg: Leg,
    endpoint: Picked,
    body: Pieces,
) -> Result<(), ProxyError> {
    let sent = exec::send_forward(call, req, leg, &endpoint, body).await;
    reuse::settle(call.info, call.rec, sent.as_ref().ok().map(Exchange::status));
    let relayed = relay(call, sent?, None, leg).await;
    count_answer_failure(&endpoint, &relayed);
    call.rec.trace.leg_done(leg);
    relayed
}

/// Counts against `endpoint` an answer that failed after its head (a body that broke, went
/// silent past the idle timeout, or outgrew its bound), in the kind `upstream_errors_total`
/// counts it under; the client's own failures are not the engine's. (Failures before the
/// head are counted by the leg client.)
fn count_answer_failure(endpoint: &Picked, relayed: &Result<(), ProxyError>) {
    if let Some((_, kind)) = relayed.as_ref().err().and_then(ProxyError::counted_as) {
        endpoint.endpoint().error(kind);
    }
}

/// Writes a complete response with `Content-Length` (and `x-request-id`).
pub async fn write_full(call: &mut Call<'_>, status: u16, content_type: Option<&str>, body: Bytes) {
    write_full_with(call, (status, content_type, None), body).await;
}

/// [`write_full`] with a status, a content type and a `Retry-After` (seconds), when given.
pub async fn write_full_with(
    call: &mut Call<'_>,
    (status, content_type, retry_after): (u16, Option<&str>, Option<u64>),
    body: Bytes,
) {
    let Ok(mut head) = ResponseHeader::build(status, Some(5)) else {
        call.rec.answer.outcome.get_or_insert(Outcome::ServerError);
        return;
    };
    let built = content_type.is_none_or(|ct| head.insert_header("content-type", ct).is_ok())
        && retry_after.is_none_or(|s| head.insert_header("retry-after", s.to_string()).is_ok())
        && head.insert_header("x-request-id", call.info.request_id.as_str()).is_ok();
    if !built {
        call.rec.answer.outcome.get_or_insert(Outcome::ServerError);
        return;
    }
    write_buffered(call, head, body).await;
}

/// The client's response head from an engine's: status and end-to-end headers kept,
/// framing headers dropped (tokenonce sets its own), `x-request-id` added when absent.
pub fn client_head(upstream: &ResponseHeader, request_id: &str) -> Option<ResponseHeader> {
    let mut head = ResponseHeader::build(upstream.status.as_u16(), Some(upstream.headers.len() + 2)).ok()?;
    for (name, value) in &upstream.headers {
        if !DROPPED_RESPONSE_HEADERS.contains(&name.as_str()) {
            head.append_header(name.clone(), value.clone()).ok()?;
        }
    }
    if head.headers.get(REQUEST_ID_HEADER).is_none() {
        head.insert_header(REQUEST_ID_HEADER, request_id).ok()?;
    }
    Some(head)
}

/// Writes `head` with `body` and its `Content-Length`; records status and outcome, and a 2xx
/// answer's body as its first content (time to first token).
pub async fn write_buffered(call: &mut Call<'_>, mut head: ResponseHeader, body: Bytes) {
    let Call { session, info, rec } = call;
    let status = head.status.as_u16();
    if head.insert_header(CONTENT_LENGTH, http::HeaderValue::from(body.len())).is_err() {
        rec.answer.outcome.get_or_insert(Outcome::ServerError);
        return;
    }
    rec.answer.mark_first_byte(info.started);
    rec.answer.status = status;
    let content = is_success(status) && !body.is_empty();
    let written = match session.write_response_header(Box::new(head), false).await {
        Ok(()) => session.write_response_body(Some(body), true).await,
        Err(e) => Err(e),
    };
    match written {
        Ok(()) => {
            if content {
                rec.answer.mark_first_token(info.started);
            }
            rec.answer.outcome.get_or_insert(Outcome::from_status(status));
        }
        Err(e) => {
            if e.etype() == &pingora::ErrorType::WriteTimedout {
                // The client stopped reading: cut it (finishing the body would wait again).
                info.route.metrics.timeout(TimeoutStage::ClientWrite);
                tracing::info!(request_id = %info.request_id, "client stopped reading: connection cut");
                rec.answer.cut = true;
            }
            rec.answer.outcome.get_or_insert(Outcome::ClientClosed);
        }
    }
}

/// Writes an engine's buffered answer as it came (status, end-to-end headers, `body`).
///
/// # Errors
/// [`ProxyError::Internal`] when the engine's head cannot be copied.
pub async fn write_engine_answer(
    call: &mut Call<'_>,
    upstream: &ResponseHeader,
    body: Bytes,
) -> Result<(), ProxyError> {
    let head = client_head(upstream, &call.info.request_id)
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    write_buffered(call, head, body).await;
    Ok(())
}

/// Relays an engine's answer on `leg` to the client: status and end-to-end headers as sent;
/// an SSE body streamed event by event; any other body streamed through as it comes, unless
/// its `cached_tokens` must be set (a 2xx JSON answer after a prefill that reported them),
/// which is buffered up to [`REWRITE_LIMIT`]. Every read waits at most the route's stream
/// idle timeout, every write the client write timeout. A client that leaves closes the
/// engine connection.
///
/// # Errors
/// [`ProxyError`] when the engine fails (before the head: a JSON error follows; mid-stream:
/// an SSE error event, or a cut connection for other bodies) or the client is gone.
pub async fn relay(
    call: &mut Call<'_>,
    exchange: Exchange,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    let ok = (200..300).contains(&exchange.status());
    let is_sse = exchange.header(CONTENT_TYPE).is_some_and(|ct| ct.starts_with("text/event-stream"));
    let head = client_head(exchange.head(), &call.info.request_id)
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    let small =
        exchange.header(CONTENT_LENGTH).and_then(|v| v.trim().parse::<usize>().ok()).is_some_and(|n| n <= SMALL_ANSWER);
    let answer = Relaying { exchange, head, leg };
    match (is_sse && ok, cached_tokens.filter(|_| ok)) {
        (true, _) => relay_stream(call, answer, cached_tokens).await,
        (false, cached) if cached.is_some() || small => relay_buffered(call, answer, cached).await,
        (false, _) => relay_through(call, answer, Bytes::new()).await,
    }
}

/// An engine's answer on its way to the client: the exchange its body is read from, the
/// client's head made from the engine's, and the leg it answers (named in its errors).
struct Relaying {
    exchange: Exchange,
    head: ResponseHeader,
    leg: Leg,
}

/// Largest declared non-SSE answer read whole before it is written, with its length, in one
/// write (a non-streamed answer comes from vLLM at once; streamed through, its head, body and
/// last chunk were three writes).
const SMALL_ANSWER: usize = 64 * 1024;

/// Largest non-streamed answer buffered to set its `cached_tokens` (a long answer with top
/// logprobs is ~2 KB per token: 16 MiB holds 8k of them). A larger one streams through with
/// the engine's own count.
pub const REWRITE_LIMIT: usize = 16 * 1024 * 1024;

/// The stream idle timeout of one relayed answer: one timer for the whole answer, moved
/// forward only when it fires early, instead of one armed and cancelled around every read.
/// It is pingora's fast timer (10 ms buckets), not tokio's: arming a tokio timer locks the
/// time driver and, when no other timer is due sooner, wakes the thread parked on it.
struct IdleWatch {
    limit: Duration,
    /// When the read now waiting (or the last one) started.
    read_started: Instant,
    timer: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl IdleWatch {
    fn new(limit: Duration) -> Self {
        Self { limit, read_started: Instant::now(), timer: Box::pin(fast_sleep(limit)) }
    }

    /// A read starts now: it may wait `limit` from here.
    fn read_starts(&mut self) {
        self.read_started = Instant::now();
    }

    /// Resolves once the current read has waited `limit` (a timer armed for an earlier read
    /// is re-armed for what is left of this read's when it fires).
    async fn expired(&mut self) {
        loop {
            self.timer.as_mut().await;
            let left = (self.read_started + self.limit).saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            self.timer = Box::pin(fast_sleep(left));
        }
    }
}

/// The next body chunk of `exchange` (`None`: the body ended), waiting at most the route's
/// stream idle timeout (`idle`) while watching the client.
async fn next_chunk(
    call: &mut Call<'_>,
    exchange: &mut Exchange,
    idle: &mut IdleWatch,
    leg: Leg,
) -> Result<Option<Bytes>, ProxyError> {
    idle.read_starts();
    let read = tokio::select! {
        // The read first: a chunk already buffered never waits on the other two.
        biased;
        r = exchange.read_body() => r,
        () = idle.expired() => return Err(ProxyError::StreamIdle { leg, after: idle.limit }),
        // Dropping `exchange` closes the engine connection; vLLM aborts the request.
        _ = client_gone(call.session) => return Err(ProxyError::ClientGone),
    };
    match read {
        Ok(chunk) => {
            if chunk.as_ref().is_some_and(|c| !c.is_empty()) {
                call.rec.legs.answer_started = true;
                // The engine answers: a prompt it computed alone is done.
                call.rec.legs.computing_alone = None;
            }
            Ok(chunk)
        }
        Err(source) => Err(ProxyError::StreamBroken { leg, source }),
    }
}

/// Writes `body` to the client within the route's client write timeout (set on the
/// session); a write that ran out is a stalled client, any other failure a gone one.
async fn write_body(call: &mut Call<'_>, body: Bytes, end: bool) -> Result<(), ProxyError> {
    let after = call.info.route.client_write_timeout;
    call.session.write_response_body(Some(body), end).await.map_err(|e| match e.etype() {
        pingora::ErrorType::WriteTimedout => ProxyError::ClientStalled { after },
        _ => ProxyError::ClientGone,
    })
}

/// Writes `head` (chunked: the client connection stays reusable, and a cut shows as one)
/// and records it as the client's first byte.
async fn write_head(call: &mut Call<'_>, mut head: ResponseHeader) -> Result<(), ProxyError> {
    let _ = head.insert_header("transfer-encoding", "chunked");
    call.rec.answer.mark_first_byte(call.info.started);
    call.rec.answer.status = head.status.as_u16();
    call.session.write_response_header(Box::new(head), false).await.map_err(|_| ProxyError::ClientGone)
}

/// Largest non-SSE answer relayed through that is also kept, with tracing on, to read the
/// token counts of its `usage` for the request span (an answer is a few KB; a larger one gets
/// no counts).
const USAGE_TAP_LIMIT: usize = 1024 * 1024;

/// A body that needs no rewrite: `prefix` (already read), then every chunk as it comes.
/// Nothing is held beyond one read.
async fn relay_through(call: &mut Call<'_>, answer: Relaying, prefix: Bytes) -> Result<(), ProxyError> {
    let Relaying { mut exchange, head, leg } = answer;
    let info = call.info;
    write_head(call, head).await?;
    // A 2xx answer's first body byte written is its first content (time to first token).
    let content = is_success(call.rec.answer.status);
    if !prefix.is_empty() {
        write_body(call, prefix.clone(), false).await?;
        if content {
            call.rec.answer.mark_first_token(info.started);
        }
    }
    // With tracing on, an answer of at most USAGE_TAP_LIMIT is kept to read its `usage`.
    let mut tap = call.rec.trace.is_on().then(|| vec![prefix.clone()]);
    let mut tapped = prefix.len();
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    while let Some(chunk) = next_chunk(call, &mut exchange, &mut idle, leg).await? {
        tapped += chunk.len();
        match tap.as_mut() {
            Some(_) if tapped > USAGE_TAP_LIMIT => tap = None,
            Some(t) => t.push(chunk.clone()),
            None => {}
        }
        let some = !chunk.is_empty();
        write_body(call, chunk, false).await?;
        if content && some {
            call.rec.answer.mark_first_token(info.started);
        }
    }
    if let Some(t) = tap {
        call.rec.trace.usage(&t.concat());
    }
    // Pooled before the client sees the end, so its next request can reuse the connection.
    info.app.client.release(exchange);
    write_body(call, Bytes::new(), true).await?;
    let status = call.rec.answer.status;
    call.rec.answer.outcome.get_or_insert(Outcome::from_status(status));
    observe_decode_total(info, call.rec);
    Ok(())
}

/// An answer buffered (every read within the idle timeout) and written with its length: a
/// small one as it came, a 2xx JSON one with `cached_tokens` set to the prefill's. Past
/// [`REWRITE_LIMIT`] it streams through unchanged instead.
async fn relay_buffered(call: &mut Call<'_>, answer: Relaying, cached_tokens: Option<u64>) -> Result<(), ProxyError> {
    let Relaying { mut exchange, head, leg } = answer;
    let info = call.info;
    let mut body = bytes::BytesMut::new();
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    loop {
        // Nothing went to the client yet: a broken body is the engine being unavailable.
        let chunk = next_chunk(call, &mut exchange, &mut idle, leg).await.map_err(|e| match e {
            ProxyError::StreamBroken { leg, source } => ProxyError::upstream(leg, source),
            other => other,
        })?;
        match chunk {
            Some(chunk) if body.len() + chunk.len() > REWRITE_LIMIT => {
                tracing::info!(request_id = %info.request_id, limit = REWRITE_LIMIT, "answer too large to rewrite: relayed as is");
                body.extend_from_slice(&chunk);
                // Boxed: this rare path would otherwise size every buffered answer's future.
                let answer = Relaying { exchange, head, leg };
                return Box::pin(relay_through(call, answer, body.freeze())).await;
            }
            Some(chunk) => body.extend_from_slice(&chunk),
            None => break,
        }
    }
    info.app.client.release(exchange);
    let body = body.freeze();
    let body = cached_tokens
        .and_then(|cached| {
            rewrite_usage_cached(info.api.unwrap_or(Api::Chat), std::str::from_utf8(&body).ok()?, cached)
        })
        .map_or(body, Bytes::from);
    call.rec.trace.usage(&body);
    write_buffered(call, head, body).await;
    observe_decode_total(info, call.rec);
    Ok(())
}

/// A 2xx SSE answer, framed event by event. Its events that carry generated content
/// ([`carries_content`](crate::openai::response::carries_content)) are timed as the client
/// gets them ([`ContentClock`]).
async fn relay_stream(call: &mut Call<'_>, answer: Relaying, cached_tokens: Option<u64>) -> Result<(), ProxyError> {
    let Relaying { mut exchange, head, leg } = answer;
    let info = call.info;
    write_head(call, head).await?;
    call.rec.answer.streaming = true;
    // Always framed, so a break never leaves half an event before the error event.
    let limit = info.route.max_sse_event_bytes;
    let api = info.api.unwrap_or(Api::Chat);
    let mut framing = StreamFraming::for_api(api, cached_tokens).with_event_limit(limit);
    let mut clock = ContentClock::default();
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    loop {
        let chunk = match next_chunk(call, &mut exchange, &mut idle, leg).await {
            Ok(chunk) => chunk,
            Err(e) => {
                let dropped = framing.broken();
                tracing::debug!(request_id = %info.request_id, dropped, "unfinished event of a broken stream dropped");
                return Err(e);
            }
        };
        let Some(chunk) = chunk else {
            info.app.client.release(exchange);
            let rest = framing.end();
            call.rec.trace.usage(&rest);
            write_body(call, Bytes::from(rest), true).await?;
            call.rec.answer.outcome = Some(Outcome::Success);
            observe_decode_total(info, call.rec);
            return Ok(());
        };
        let content_before = framing.content_events();
        let mut out = Vec::with_capacity(chunk.len());
        framing.feed_into(&chunk, &mut out);
        // The pieces that came with this read (an engine's burst of events, each its own
        // HTTP chunk) go out in the same write: one send instead of one per event.
        let mut broke = None;
        while !framing.too_long() {
            match exchange.read_buffered_body() {
                Ok(Some(more)) => framing.feed_into(&more, &mut out),
                Ok(None) => break,
                Err(source) => {
                    broke = Some(ProxyError::StreamBroken { leg, source });
                    break;
                }
            }
        }
        call.rec.answer.next_sequence = framing.next_sequence();
        call.rec.trace.usage(&out);
        if !out.is_empty() {
            write_body(call, Bytes::from(out), false).await?;
        }
        clock.written(call, api, framing.content_events() - content_before);
        if let Some(e) = broke {
            let dropped = framing.broken();
            tracing::debug!(request_id = %info.request_id, dropped, "unfinished event of a broken stream dropped");
            return Err(e);
        }
        if framing.too_long() {
            return Err(ProxyError::EventTooLarge { leg, limit });
        }
    }
}

/// The timing of a stream's content events: the first one's write is the time to first
/// token, and each later one observes `inter_token_latency_seconds`, the gap since the
/// content event before it (as vLLM's `vllm:inter_token_latency_seconds` observes each
/// token's; events written together, from one engine read, are 0 apart). N content events
/// give N - 1 gaps.
#[derive(Default)]
struct ContentClock {
    /// When the last content event was written (none yet: the next one is the first token).
    last: Option<Instant>,
}

impl ContentClock {
    /// `content` content events were just written in one write.
    fn written(&mut self, call: &mut Call<'_>, api: Api, content: u64) {
        if content == 0 {
            return;
        }
        let (info, metrics) = (call.info, &call.info.route.metrics);
        let now = Instant::now();
        match self.last {
            Some(last) => metrics.inter_token(api, now.duration_since(last)),
            None => call.rec.answer.mark_first_token(info.started),
        }
        (1..content).for_each(|_| metrics.inter_token(api, Duration::ZERO));
        self.last = Some(now);
    }
}

/// Records the decode leg's whole duration (send to last byte) when one was sent.
fn observe_decode_total(info: &RequestInfo, rec: &Record) {
    if let Some(t) = rec.legs.decode_sent_at {
        info.route.metrics.stage(Stage::DecodeTotal, t.elapsed());
    }
}

/// True for a 2xx status: only such an answer's content is timed as tokens.
fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}
