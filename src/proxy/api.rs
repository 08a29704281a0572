//! An OpenAI API request, from `request_filter`: read the body (bounded), parse it once,
//! choose the route (its model glob may need the body), and hand it to the route's mode.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;

use super::error::ProxyError;
use super::exec::Incoming;
use super::{orchestrate, relay, respond, ApiRequest, Call, Ctx};
use crate::config::Mode;
use crate::metrics::Leg;
use crate::openai::{Api, ApiError, RawObject, RequestView};
use crate::routes::RequestFacts;
use crate::upstream;

/// Reads the whole request body within `deadline`, refusing more than `limit` bytes.
async fn read_body(session: &mut Session, limit: usize, deadline: Duration) -> Result<Bytes, ApiError> {
    let ms = u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX);
    crate::deadline::before(tokio::time::Instant::now() + deadline, read_body_unbounded(session, limit))
        .await
        .unwrap_or(Err(ApiError::RequestTimeout(ms)))
}

async fn read_body_unbounded(session: &mut Session, limit: usize) -> Result<Bytes, ApiError> {
    let declared =
        session.req_header().headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
    if declared.is_some_and(|len: usize| len > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    super::edge::continue_if_expected(session)
        .await
        .map_err(|e| ApiError::invalid(format!("reading the body failed: {}", e.etype().as_str()), None))?;
    // A body that arrives in one piece (most: pingora reads up to 64 KiB at once) is kept as
    // that piece; a buffer and a copy only when a second one comes.
    let mut first: Option<Bytes> = None;
    let mut body = BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) if body.len() + first.as_ref().map_or(0, Bytes::len) + chunk.len() > limit => {
                return Err(ApiError::BodyTooLarge { limit })
            }
            Ok(Some(chunk)) if first.is_none() && body.is_empty() => first = Some(chunk),
            Ok(Some(chunk)) => {
                if let Some(first) = first.take() {
                    append_within(&mut body, &first, declared);
                }
                append_within(&mut body, &chunk, declared);
            }
            Ok(None) => return Ok(first.unwrap_or_else(|| body.freeze())),
            Err(e) => return Err(ApiError::invalid(format!("reading the body failed: {}", e.etype().as_str()), None)),
        }
    }
}

/// Appends `chunk` to `body`, growing it to the declared length in one step once that is at
/// most 4x what arrived (a body read whole holds its length once, its bytes copied once: a
/// buffer doubled from 64 KiB copied a 37k body's bytes about twice more), and never past it
/// while the body fits it.
fn append_within(body: &mut BytesMut, chunk: &[u8], declared: Option<usize>) {
    let need = body.len() + chunk.len();
    if need > body.capacity() {
        // To the declared length at once (one copy of the bytes so far, none later), but
        // never past 4x what arrived; without one, doubling.
        let target = match declared.filter(|&d| d >= need) {
            Some(d) => d.min(need.saturating_mul(4)),
            None => body.capacity().saturating_mul(2).max(need),
        };
        let mut grown = BytesMut::with_capacity(target);
        grown.extend_from_slice(body);
        *body = grown;
    }
    body.extend_from_slice(chunk);
}

/// Serves one API request to the end; sets the request's route (the last of what it is)
/// once the body is read.
///
/// # Errors
/// Any [`ProxyError`]; the caller's error exit answers it.
pub async fn handle(session: &mut Session, ctx: &mut Ctx, api: Api) -> Result<(), ProxyError> {
    let app = &ctx.info.app;
    let head = session.req_header();
    let path = head.uri.path().to_owned();
    let path_and_query = head.uri.path_and_query().map_or_else(|| path.clone(), |p| p.as_str().to_owned());
    let headers = head.headers.clone();
    session.as_downstream_mut().set_abort_on_close(true);
    let body = match read_body(session, app.routes.max_body_bytes(), app.config.server.body_read_timeout_ms).await {
        Ok(body) => body,
        Err(e) => {
            // Do not try to reuse a connection whose body was not read to the end.
            session.set_keepalive(None);
            return Err(e.into());
        }
    };

    let parsed = RawObject::parse_bytes(&body);
    let view = parsed.as_ref().ok().map(|obj| RequestView::parse(api, obj));
    let model = view.as_ref().and_then(|v| v.as_ref().ok()).and_then(|v| v.model.as_deref());
    ctx.info.route = Arc::clone(app.routes.select(&RequestFacts { path: &path, model, headers: &headers }));
    let Ctx { info, rec } = ctx;
    let info = &*info;
    let route = &info.route;
    session.as_downstream_mut().set_write_timeout(Some(route.client_write_timeout));
    if body.len() > route.max_body_bytes {
        return Err(ApiError::BodyTooLarge { limit: route.max_body_bytes }.into());
    }
    let incoming = Incoming {
        path_and_query: &path_and_query,
        headers: &headers,
        body: &body,
        drop_header: route.prefiller_header(),
        drop_credentials: false,
        // Unknown (a body that is not a request): not streamed, as vLLM would answer it.
        streamed: view.as_ref().and_then(|v| v.as_ref().ok()).is_some_and(|v| v.stream),
    };

    let call = &mut Call { session, info, rec };
    if route.mode == Mode::Passthrough {
        // The body was read to choose the route: forward it unchanged ourselves.
        let endpoint = upstream::pick(&route.decode_pool, Leg::Passthrough)?;
        return respond::forward(call, &incoming, Leg::Passthrough, endpoint, body.clone().into()).await;
    }
    let obj = parsed.map_err(|e| ApiError::invalid(format!("body is not a JSON object: {e}"), None))?;
    let view = view.ok_or_else(|| ApiError::invalid("body is not a JSON object", None))??;
    let req = ApiRequest { incoming, obj, view };
    match route.mode {
        Mode::Relay => relay::handle(call, &req).await,
        _ => orchestrate::run(call, &req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_buffer_grows_with_the_bytes_not_the_declared_length() {
        // 60 MiB declared, 100 KB sent a KB at a time: the buffer holds at most 4x what arrived.
        let declared: usize = 60 << 20;
        let mut body = BytesMut::new();
        for _ in 0..100 {
            append_within(&mut body, &[b'x'; 1000], Some(declared));
            assert!(body.capacity() <= 4 * body.len(), "{} reserved for {}", body.capacity(), body.len());
        }
        // A body that does arrive whole ends in a buffer of its declared length, not twice it,
        // reached in one step once the declared length is within 4x what arrived.
        let declared = 174_000;
        let mut body = BytesMut::new();
        append_within(&mut body, &[b'y'; 65_536], Some(declared));
        assert_eq!(body.capacity(), declared);
        append_within(&mut body, &[b'y'; 65_536], Some(declared));
        append_within(&mut body, &[b'y'; 174_000 - 131_072], Some(declared));
        assert_eq!((body.len(), body.capacity()), (declared, declared));
        // No declared length (chunked): doubling.
        let mut body = BytesMut::new();
        append_within(&mut body, &[b'z'; 10], None);
        append_within(&mut body, &[b'z'; 10], None);
        assert_eq!(body.len(), 20);
    }
}
