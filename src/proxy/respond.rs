//! Writing to the client: complete bodies (tokenonce's own and an engine's buffered answer),
//! and relaying an engine's answer (streamed through; SSE framed event by event; JSON
//! buffered only when its `cached_tokens` is rewritten), every read and write bounded.
//! Failures are returned to the caller; `rescue::fail` is what answers them.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use pingora::http::ResponseHeader;
use pingora::prelude::fast_timeout::fast_sleep;
use pingora::proxy::Session;

use super::error::ProxyError;
use super::{Record, RequestInfo};
use crate::metrics::{Leg, Outcome, Stage, TimeoutStage};
use crate::openai::response::{rewrite_usage_cached, StreamFraming};
use crate::openai::Api;
use crate::upstream::client::DROPPED_RESPONSE_HEADERS;
use crate::upstream::{Exchange, REQUEST_ID_HEADER};

/// Waits until the client has gone (FIN or reset while we have nothing to read).
pub async fn client_gone(session: &mut Session) {
    // With abort_on_close set, a FIN is an error; data after the body is an error too.
    let _ = session.as_downstream_mut().read_body_or_idle(true).await;
}

/// Writes a complete response with `Content-Length` (and `x-request-id`).
pub async fn write_full(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    status: u16,
    content_type: Option<&str>,
    body: Bytes,
) {
    write_full_with(session, info, rec, (status, content_type, None), body).await;
}

/// [`write_full`] with a status, a content type and a `Retry-After` (seconds), when given.
pub async fn write_full_with(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    (status, content_type, retry_after): (u16, Option<&str>, Option<u64>),
    body: Bytes,
) {
    let Ok(mut head) = ResponseHeader::build(status, Some(5)) else {
        rec.answer.outcome.get_or_insert(Outcome::ServerError);
        return;
    };
    let built = content_type.is_none_or(|ct| head.insert_header("content-type", ct).is_ok())
        && retry_after.is_none_or(|s| head.insert_header("retry-after", s.to_string()).is_ok())
        && head.insert_header("x-request-id", info.request_id.as_str()).is_ok();
    if !built {
        rec.answer.outcome.get_or_insert(Outcome::ServerError);
        return;
    }
    write_buffered(session, info, rec, head, body).await;
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
pub async fn write_buffered(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    mut head: ResponseHeader,
    body: Bytes,
) {
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
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    upstream: &ResponseHeader,
    body: Bytes,
) -> Result<(), ProxyError> {
    let head = client_head(upstream, &info.request_id)
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    write_buffered(session, info, rec, head, body).await;
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
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    exchange: Exchange,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    let ok = (200..300).contains(&exchange.status());
    let is_sse = exchange.header(CONTENT_TYPE).is_some_and(|ct| ct.starts_with("text/event-stream"));
    let head = client_head(exchange.head(), &info.request_id)
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    let small =
        exchange.header(CONTENT_LENGTH).and_then(|v| v.trim().parse::<usize>().ok()).is_some_and(|n| n <= SMALL_ANSWER);
    match (is_sse && ok, cached_tokens.filter(|_| ok)) {
        (true, _) => relay_stream(session, info, rec, exchange, head, cached_tokens, leg).await,
        (false, cached) if cached.is_some() || small => {
            relay_buffered(session, info, rec, exchange, head, cached, leg).await
        }
        (false, _) => relay_through(session, info, rec, exchange, head, Bytes::new(), leg).await,
    }
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
    session: &mut Session,
    rec: &mut Record,
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
        _ = client_gone(session) => return Err(ProxyError::ClientGone),
    };
    match read {
        Ok(chunk) => {
            rec.legs.answer_started |= chunk.as_ref().is_some_and(|c| !c.is_empty());
            Ok(chunk)
        }
        Err(source) => Err(ProxyError::StreamBroken { leg, source }),
    }
}

/// Writes `body` to the client within the route's client write timeout (set on the
/// session); a write that ran out is a stalled client, any other failure a gone one.
async fn write_body(session: &mut Session, info: &RequestInfo, body: Bytes, end: bool) -> Result<(), ProxyError> {
    session.write_response_body(Some(body), end).await.map_err(|e| match e.etype() {
        pingora::ErrorType::WriteTimedout => ProxyError::ClientStalled { after: info.route.client_write_timeout },
        _ => ProxyError::ClientGone,
    })
}

/// Writes `head` (chunked: the client connection stays reusable, and a cut shows as one)
/// and records it as the client's first byte.
async fn write_head(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    mut head: ResponseHeader,
) -> Result<(), ProxyError> {
    let _ = head.insert_header("transfer-encoding", "chunked");
    rec.answer.mark_first_byte(info.started);
    rec.answer.status = head.status.as_u16();
    session.write_response_header(Box::new(head), false).await.map_err(|_| ProxyError::ClientGone)
}

/// Largest non-SSE answer relayed through that is also kept, with tracing on, to read the
/// token counts of its `usage` for the request span (an answer is a few KB; a larger one gets
/// no counts).
const USAGE_TAP_LIMIT: usize = 1024 * 1024;

/// A body that needs no rewrite: `prefix` (already read), then every chunk as it comes.
/// Nothing is held beyond one read.
async fn relay_through(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    mut exchange: Exchange,
    head: ResponseHeader,
    prefix: Bytes,
    leg: Leg,
) -> Result<(), ProxyError> {
    write_head(session, info, rec, head).await?;
    // A 2xx answer's first body byte written is its first content (time to first token).
    let content = is_success(rec.answer.status);
    if !prefix.is_empty() {
        write_body(session, info, prefix.clone(), false).await?;
        if content {
            rec.answer.mark_first_token(info.started);
        }
    }
    // With tracing on, an answer of at most USAGE_TAP_LIMIT is kept to read its `usage`.
    let mut tap = rec.trace.is_on().then(|| vec![prefix.clone()]);
    let mut tapped = prefix.len();
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    while let Some(chunk) = next_chunk(session, rec, &mut exchange, &mut idle, leg).await? {
        tapped += chunk.len();
        match tap.as_mut() {
            Some(_) if tapped > USAGE_TAP_LIMIT => tap = None,
            Some(t) => t.push(chunk.clone()),
            None => {}
        }
        let some = !chunk.is_empty();
        write_body(session, info, chunk, false).await?;
        if content && some {
            rec.answer.mark_first_token(info.started);
        }
    }
    if let Some(t) = tap {
        rec.trace.usage(&t.concat());
    }
    // Pooled before the client sees the end, so its next request can reuse the connection.
    info.app.client.release(exchange);
    write_body(session, info, Bytes::new(), true).await?;
    let status = rec.answer.status;
    rec.answer.outcome.get_or_insert(Outcome::from_status(status));
    observe_decode_total(info, rec);
    Ok(())
}

/// An answer buffered (every read within the idle timeout) and written with its length: a
/// small one as it came, a 2xx JSON one with `cached_tokens` set to the prefill's. Past
/// [`REWRITE_LIMIT`] it streams through unchanged instead.
async fn relay_buffered(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    mut exchange: Exchange,
    head: ResponseHeader,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    let mut body = bytes::BytesMut::new();
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    loop {
        // Nothing went to the client yet: a broken body is the engine being unavailable.
        let chunk = next_chunk(session, rec, &mut exchange, &mut idle, leg).await.map_err(|e| match e {
            ProxyError::StreamBroken { leg, source } => ProxyError::upstream(leg, source),
            other => other,
        })?;
        match chunk {
            Some(chunk) if body.len() + chunk.len() > REWRITE_LIMIT => {
                tracing::info!(request_id = %info.request_id, limit = REWRITE_LIMIT, "answer too large to rewrite: relayed as is");
                body.extend_from_slice(&chunk);
                // Boxed: this rare path would otherwise size every buffered answer's future.
                return Box::pin(relay_through(session, info, rec, exchange, head, body.freeze(), leg)).await;
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
    rec.trace.usage(&body);
    write_buffered(session, info, rec, head, body).await;
    observe_decode_total(info, rec);
    Ok(())
}

/// A 2xx SSE answer, framed event by event. Its events that carry generated content
/// ([`carries_content`](crate::openai::response::carries_content)) are timed as the client
/// gets them: the first one's write is the time to first token, and each later one observes
/// `inter_token_latency_seconds`, the gap since the content event before it (as vLLM's
/// `vllm:inter_token_latency_seconds` observes each token's; events written together, from
/// one engine read, are 0 apart). N content events give N - 1 gaps.
async fn relay_stream(
    session: &mut Session,
    info: &RequestInfo,
    rec: &mut Record,
    mut exchange: Exchange,
    head: ResponseHeader,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    write_head(session, info, rec, head).await?;
    rec.answer.streaming = true;
    // Always framed, so a break never leaves half an event before the error event.
    let limit = info.route.max_sse_event_bytes;
    let api = info.api.unwrap_or(Api::Chat);
    let mut framing = StreamFraming::for_api(api, cached_tokens).with_event_limit(limit);
    let metrics = &info.route.metrics;
    // When the last content event was written (none yet: the next one is the first token).
    let mut last_content: Option<Instant> = None;
    let mut idle = IdleWatch::new(info.route.stream_idle_timeout);
    loop {
        let chunk = match next_chunk(session, rec, &mut exchange, &mut idle, leg).await {
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
            rec.trace.usage(&rest);
            write_body(session, info, Bytes::from(rest), true).await?;
            rec.answer.outcome = Some(Outcome::Success);
            observe_decode_total(info, rec);
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
        rec.answer.next_sequence = framing.next_sequence();
        rec.trace.usage(&out);
        if !out.is_empty() {
            write_body(session, info, Bytes::from(out), false).await?;
        }
        let content = framing.content_events() - content_before;
        if content > 0 {
            let now = Instant::now();
            match last_content {
                Some(last) => metrics.inter_token(api, now.duration_since(last)),
                None => rec.answer.mark_first_token(info.started),
            }
            (1..content).for_each(|_| metrics.inter_token(api, Duration::ZERO));
            last_content = Some(now);
        }
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

/// Time since `t` in milliseconds, for the access log.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}
