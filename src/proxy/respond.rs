//! Writing to the client: complete bodies (tokenonce's own and an engine's buffered answer),
//! and relaying a decode's answer (JSON buffered and rewritten, SSE streamed event by event).
//! Failures are returned to the caller; `error::fail` is what answers them.

use std::time::Instant;

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::error::ProxyError;
use super::Ctx;
use crate::metrics::{Leg, Outcome, Stage};
use crate::openai::response::{rewrite_usage_cached, StreamFraming};
use crate::openai::Api;
use crate::upstream::client::DROPPED_RESPONSE_HEADERS;
use crate::upstream::Exchange;

/// Largest non-streamed engine response tokenonce buffers (a long answer with logprobs).
pub const RESPONSE_LIMIT: usize = 256 * 1024 * 1024;

/// Waits until the client has gone (FIN or reset while we have nothing to read).
pub async fn client_gone(session: &mut Session) {
    // With abort_on_close set, a FIN is an error; data after the body is an error too.
    let _ = session.as_downstream_mut().read_body_or_idle(true).await;
}

/// Writes a complete response with `Content-Length` (and `x-request-id`).
pub async fn write_full(session: &mut Session, ctx: &mut Ctx, status: u16, content_type: Option<&str>, body: Bytes) {
    let Ok(mut head) = ResponseHeader::build(status, Some(4)) else {
        ctx.outcome.get_or_insert(Outcome::ServerError);
        return;
    };
    let built = content_type.is_none_or(|ct| head.insert_header("content-type", ct).is_ok())
        && head.insert_header("x-request-id", ctx.request_id.as_str()).is_ok();
    if !built {
        ctx.outcome.get_or_insert(Outcome::ServerError);
        return;
    }
    write_buffered(session, ctx, head, body).await;
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
    if head.headers.get("x-request-id").is_none() {
        head.insert_header("x-request-id", request_id).ok()?;
    }
    Some(head)
}

/// Writes `head` with `body` and its `Content-Length`; records status and outcome.
pub async fn write_buffered(session: &mut Session, ctx: &mut Ctx, mut head: ResponseHeader, body: Bytes) {
    let status = head.status.as_u16();
    if head.insert_header("content-length", body.len().to_string()).is_err() {
        ctx.outcome.get_or_insert(Outcome::ServerError);
        return;
    }
    ctx.mark_first_byte();
    let written = session.write_response_header(Box::new(head), false).await.is_ok()
        && session.write_response_body(Some(body), true).await.is_ok();
    ctx.status = status;
    ctx.outcome.get_or_insert(if written { Outcome::from_status(status) } else { Outcome::ClientClosed });
}

/// Writes an engine's buffered answer as it came (status, end-to-end headers, `body`).
///
/// # Errors
/// [`ProxyError::Internal`] when the engine's head cannot be copied.
pub async fn write_engine_answer(
    session: &mut Session,
    ctx: &mut Ctx,
    upstream: &ResponseHeader,
    body: Bytes,
) -> Result<(), ProxyError> {
    let head = client_head(upstream, &ctx.request_id)
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    write_buffered(session, ctx, head, body).await;
    Ok(())
}

/// Relays an engine's answer on `leg` to the client: status and end-to-end headers as sent, a
/// JSON body buffered (its `cached_tokens` set when given), an SSE body streamed event by
/// event. A client that leaves closes the engine connection.
///
/// # Errors
/// [`ProxyError`] when the engine fails (before the head: a JSON error follows; mid-stream:
/// an SSE error event) or the client is gone.
pub async fn relay(
    session: &mut Session,
    ctx: &mut Ctx,
    exchange: Exchange,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    let status = exchange.status();
    let is_sse = exchange.header("content-type").is_some_and(|ct| ct.starts_with("text/event-stream"));
    let head = exchange
        .session
        .response_header()
        .and_then(|h| client_head(h, &ctx.request_id))
        .ok_or_else(|| ProxyError::Internal("engine response head cannot be copied".into()))?;
    if is_sse && (200..300).contains(&status) {
        relay_stream(session, ctx, exchange, head, cached_tokens, leg).await
    } else {
        relay_buffered(session, ctx, exchange, head, cached_tokens.filter(|_| (200..300).contains(&status)), leg).await
    }
}

async fn relay_buffered(
    session: &mut Session,
    ctx: &mut Ctx,
    exchange: Exchange,
    head: ResponseHeader,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    let client = std::sync::Arc::clone(&ctx.app.client);
    let body = tokio::select! {
        r = client.read_to_end(exchange, RESPONSE_LIMIT) => r.map_err(|e| ProxyError::upstream(leg, e))?,
        _ = client_gone(session) => return Err(ProxyError::ClientGone),
    };
    let body = match cached_tokens {
        Some(n) => std::str::from_utf8(&body)
            .ok()
            .and_then(|t| rewrite_usage_cached(ctx.api.unwrap_or(Api::Chat), t, n))
            .map_or(body, Bytes::from),
        None => body,
    };
    write_buffered(session, ctx, head, body).await;
    observe_decode_total(ctx);
    Ok(())
}

async fn relay_stream(
    session: &mut Session,
    ctx: &mut Ctx,
    mut exchange: Exchange,
    mut head: ResponseHeader,
    cached_tokens: Option<u64>,
    leg: Leg,
) -> Result<(), ProxyError> {
    // Chunked, so the client connection stays reusable (a hand-written response without a
    // length would be close-delimited).
    let _ = head.insert_header("transfer-encoding", "chunked");
    ctx.mark_first_byte();
    ctx.status = head.status.as_u16();
    if session.write_response_header(Box::new(head), false).await.is_err() {
        return Err(ProxyError::ClientGone);
    }
    ctx.streaming = true;
    // Always framed, so a break never leaves half an event before the error event.
    let mut framing = StreamFraming::for_api(ctx.api.unwrap_or(Api::Chat), cached_tokens);
    loop {
        let chunk = tokio::select! {
            chunk = exchange.session.read_response_body() => chunk,
            // Dropping `exchange` closes the engine connection; vLLM aborts the request.
            _ = client_gone(session) => return Err(ProxyError::ClientGone),
        };
        match chunk {
            Ok(Some(chunk)) => {
                let out = framing.feed(&chunk);
                if !out.is_empty() && session.write_response_body(Some(Bytes::from(out)), false).await.is_err() {
                    return Err(ProxyError::ClientGone);
                }
            }
            Ok(None) => {
                let ended = session.write_response_body(Some(Bytes::from(framing.end())), true).await.is_ok();
                ctx.outcome = Some(if ended { Outcome::Success } else { Outcome::ClientClosed });
                ctx.app.client.release(exchange).await;
                observe_decode_total(ctx);
                return Ok(());
            }
            Err(e) => {
                let dropped = framing.broken();
                tracing::debug!(request_id = %ctx.request_id, dropped, "unfinished event of a broken stream dropped");
                let source = crate::upstream::UpstreamError::io(&exchange.peer.to_string(), &e);
                return Err(ProxyError::StreamBroken { leg, source });
            }
        }
    }
}

/// Records the decode leg's whole duration (send to last byte) when one was sent.
fn observe_decode_total(ctx: &Ctx) {
    if let Some(t) = ctx.decode_sent_at {
        ctx.route.metrics.stage(Stage::DecodeTotal, t.elapsed());
    }
}

/// Time since `t` in milliseconds, for the access log.
pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}
