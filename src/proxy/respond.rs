//! Writing responses to the client: tokenonce's own errors and bodies, and relaying an
//! engine's response (buffered JSON, or SSE streamed as it arrives) with optional rewrites.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::Ctx;
use crate::metrics::{Outcome, Stage};
use crate::openai::response::{rewrite_cached_tokens, SseRewriter};
use crate::openai::ApiError;
use crate::upstream::client::DROPPED_RESPONSE_HEADERS;
use crate::upstream::Exchange;
use crate::App;

/// Largest non-streamed engine response tokenonce buffers (a long answer with logprobs).
pub const RESPONSE_LIMIT: usize = 256 * 1024 * 1024;

/// Waits until the client has gone (FIN or reset while we have nothing to read).
pub async fn client_gone(session: &mut Session) {
    // With abort_on_close set, a FIN is an error; data after the body is an error too.
    let _ = session.as_downstream_mut().read_body_or_idle(true).await;
}

/// Writes a complete response with `Content-Length`.
pub async fn write_full(session: &mut Session, ctx: &mut Ctx, status: u16, content_type: Option<&str>, body: Bytes) {
    let outcome = write_full_inner(session, ctx, status, content_type, body).await;
    ctx.outcome.get_or_insert(outcome);
}

async fn write_full_inner(
    session: &mut Session,
    ctx: &mut Ctx,
    status: u16,
    content_type: Option<&str>,
    body: Bytes,
) -> Outcome {
    let Ok(mut head) = ResponseHeader::build(status, Some(4)) else {
        return Outcome::ServerError;
    };
    let ok = head.insert_header("content-length", body.len().to_string()).is_ok()
        && content_type.is_none_or(|ct| head.insert_header("content-type", ct).is_ok())
        && ctx.request_id.as_deref().is_none_or(|id| head.insert_header("x-request-id", id).is_ok());
    if !ok {
        return Outcome::ServerError;
    }
    ctx.mark_first_byte();
    if session.write_response_header(Box::new(head), false).await.is_err()
        || session.write_response_body(Some(body), true).await.is_err()
    {
        return Outcome::ClientClosed;
    }
    ctx.status = status;
    Outcome::from_status(status)
}

/// Answers with tokenonce's own OpenAI-shaped error.
pub async fn write_error(session: &mut Session, ctx: &mut Ctx, err: &ApiError) {
    tracing::info!(request_id = ctx.request_id.as_deref().unwrap_or("-"), code = err.code(), error = %err, "request failed");
    write_full(session, ctx, err.status(), Some("application/json"), Bytes::from(err.body())).await;
}

/// The client's response head from an engine's: status and end-to-end headers kept,
/// framing headers dropped (tokenonce sets its own), `x-request-id` added when absent.
pub fn client_head(upstream: &ResponseHeader, request_id: Option<&str>) -> Option<ResponseHeader> {
    let mut head = ResponseHeader::build(upstream.status.as_u16(), Some(upstream.headers.len() + 2)).ok()?;
    for (name, value) in &upstream.headers {
        if !DROPPED_RESPONSE_HEADERS.contains(&name.as_str()) {
            head.append_header(name.clone(), value.clone()).ok()?;
        }
    }
    if let Some(id) = request_id {
        if head.headers.get("x-request-id").is_none() {
            head.insert_header("x-request-id", id).ok()?;
        }
    }
    Some(head)
}

/// Writes `head` with `body` and its `Content-Length`.
pub async fn write_buffered(session: &mut Session, ctx: &mut Ctx, mut head: ResponseHeader, body: Bytes) {
    let status = head.status.as_u16();
    if head.insert_header("content-length", body.len().to_string()).is_err() {
        return write_error(session, ctx, &ApiError::Internal("content-length".into())).await;
    }
    ctx.mark_first_byte();
    let written = session.write_response_header(Box::new(head), false).await.is_ok()
        && session.write_response_body(Some(body), true).await.is_ok();
    ctx.status = status;
    ctx.outcome = Some(if written { Outcome::from_status(status) } else { Outcome::ClientClosed });
}

/// How to rewrite a relayed engine response.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rewrite {
    /// Set `usage.prompt_tokens_details.cached_tokens` to this (the prefill's count).
    pub cached_tokens: Option<u64>,
}

/// Relays an engine response to the client: status and end-to-end headers as sent, a JSON
/// body buffered (and rewritten), an SSE body streamed event by event. A stream that breaks
/// ends with an SSE error event; a client that leaves closes the engine connection.
pub async fn relay(
    app: &App,
    session: &mut Session,
    ctx: &mut Ctx,
    mut exchange: Exchange,
    rewrite: Rewrite,
    route: &str,
) {
    let status = exchange.status();
    let is_sse = exchange.header("content-type").is_some_and(|ct| ct.starts_with("text/event-stream"));
    let Some(mut head) = exchange.session.response_header().and_then(|h| client_head(h, ctx.request_id.as_deref()))
    else {
        write_error(session, ctx, &ApiError::DecodeUnavailable("no response header".into())).await;
        return;
    };

    if !is_sse || !(200..300).contains(&status) {
        let body = tokio::select! {
            r = app.client.read_to_end(exchange, RESPONSE_LIMIT) => r,
            _ = client_gone(session) => {
                ctx.outcome = Some(Outcome::ClientClosed);
                return;
            }
        };
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                app.metrics.upstream_errors.with_label_values(&[ctx.stage_label(), e.kind()]).inc();
                write_error(session, ctx, &ApiError::DecodeUnavailable(e.to_string())).await;
                return;
            }
        };
        let body = match rewrite.cached_tokens.filter(|_| (200..300).contains(&status)) {
            Some(n) => {
                std::str::from_utf8(&body).ok().and_then(|t| rewrite_cached_tokens(t, n)).map_or(body, Bytes::from)
            }
            None => body,
        };
        let _ = head.insert_header("content-length", body.len().to_string());
        ctx.mark_first_byte();
        let written = session.write_response_header(Box::new(head), false).await.is_ok()
            && session.write_response_body(Some(body), true).await.is_ok();
        ctx.status = status;
        ctx.outcome = Some(if written { Outcome::from_status(status) } else { Outcome::ClientClosed });
        observe_decode_total(app, ctx, route);
        return;
    }

    // Chunked, so the client connection stays reusable (a hand-written response without a
    // length would be close-delimited).
    let _ = head.insert_header("transfer-encoding", "chunked");
    ctx.mark_first_byte();
    ctx.status = status;
    if session.write_response_header(Box::new(head), false).await.is_err() {
        ctx.outcome = Some(Outcome::ClientClosed);
        return;
    }
    let mut rewriter =
        rewrite.cached_tokens.map(|n| SseRewriter::new(move |data: &str| rewrite_cached_tokens(data, n)));
    loop {
        tokio::select! {
            chunk = exchange.session.read_response_body() => match chunk {
                Ok(Some(chunk)) => {
                    let out = match rewriter.as_mut() {
                        Some(rw) => Bytes::from(rw.feed(&chunk)),
                        None => chunk,
                    };
                    if !out.is_empty() && session.write_response_body(Some(out), false).await.is_err() {
                        ctx.outcome = Some(Outcome::ClientClosed);
                        return;
                    }
                }
                Ok(None) => {
                    let tail = rewriter.take().map(|rw| Bytes::from(rw.finish())).unwrap_or_default();
                    let ended = session.write_response_body(Some(tail), true).await.is_ok();
                    ctx.outcome = Some(if ended { Outcome::Success } else { Outcome::ClientClosed });
                    app.client.release(exchange).await;
                    observe_decode_total(app, ctx, route);
                    return;
                }
                Err(e) => {
                    app.metrics.upstream_errors.with_label_values(&[ctx.stage_label(), "stream_broken"]).inc();
                    let err = ApiError::DecodeStreamFailed(e.to_string());
                    tracing::warn!(request_id = ctx.request_id.as_deref().unwrap_or("-"), error = %err, "decode stream broke");
                    let mut out = rewriter.take().map(|rw| rw.finish()).unwrap_or_default();
                    if !out.is_empty() && !out.ends_with(b"\n\n") {
                        out.extend_from_slice(b"\n\n");
                    }
                    out.extend_from_slice(&err.sse_event());
                    let _ = session.write_response_body(Some(Bytes::from(out)), true).await;
                    ctx.outcome = Some(Outcome::ServerError);
                    return;
                }
            },
            _ = client_gone(session) => {
                // Dropping `exchange` closes the engine connection; vLLM aborts the request.
                ctx.outcome = Some(Outcome::ClientClosed);
                return;
            }
        }
    }
}

/// Records the decode leg's whole duration (send to last byte) when one was sent.
fn observe_decode_total(app: &App, ctx: &Ctx, route: &str) {
    if let Some(t) = ctx.decode_sent_at {
        app.metrics
            .stage_duration
            .with_label_values(&[route, Stage::DecodeTotal.as_str()])
            .observe(t.elapsed().as_secs_f64());
    }
}
