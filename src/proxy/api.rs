//! An OpenAI API request, from `request_filter`: read the body (bounded), parse it once,
//! choose the route (its model glob may need the body), and hand it to the route's mode.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;

use super::error::ProxyError;
use super::exec::{self, Incoming};
use super::{orchestrate, relay, ApiRequest, Ctx};
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
    let mut body = BodyPieces::default();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) if body.len + chunk.len() > limit => return Err(ApiError::BodyTooLarge { limit }),
            Ok(Some(chunk)) => body.push(chunk),
            Ok(None) => return Ok(body.joined()),
            Err(e) => return Err(ApiError::invalid(format!("reading the body failed: {}", e.etype().as_str()), None)),
        }
    }
}

/// A request body's pieces as they came, held as they are (nothing reserved ahead of the
/// bytes: a declared length is only a claim), joined once at the end. Past
/// [`MAX_HELD_PIECES`] they are folded into one buffer, so a body trickled a byte at a time
/// costs about its length, not a piece's overhead per byte.
#[derive(Default)]
struct BodyPieces {
    folded: BytesMut,
    pieces: Vec<Bytes>,
    len: usize,
}

/// Most pieces held apart (a body read 64 KiB at a time has a few).
const MAX_HELD_PIECES: usize = 64;

impl BodyPieces {
    fn push(&mut self, piece: Bytes) {
        self.len += piece.len();
        self.pieces.push(piece);
        if self.pieces.len() >= MAX_HELD_PIECES {
            // Grown by doubling as bytes come (amortized: each byte copied about twice).
            for piece in self.pieces.drain(..) {
                self.folded.extend_from_slice(&piece);
            }
        }
    }

    /// The body: a lone piece as it is (most bodies: pingora reads up to 64 KiB at once),
    /// several copied once into a buffer of their total length (a buffer grown as they came
    /// copied a 150 KB body's bytes about twice more).
    fn joined(mut self) -> Bytes {
        if self.folded.is_empty() && self.pieces.len() <= 1 {
            return self.pieces.pop().unwrap_or_default();
        }
        let mut body = self.folded;
        body.reserve(self.len - body.len());
        for piece in &self.pieces {
            body.extend_from_slice(piece);
        }
        body.freeze()
    }
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

    if route.mode == Mode::Passthrough {
        // The body was read to choose the route: forward it unchanged ourselves.
        let endpoint = upstream::pick(&route.decode_pool, Leg::Passthrough)?;
        return exec::forward(session, info, rec, &incoming, Leg::Passthrough, endpoint, body.clone().into()).await;
    }
    let obj = parsed.map_err(|e| ApiError::invalid(format!("body is not a JSON object: {e}"), None))?;
    let view = view.ok_or_else(|| ApiError::invalid("body is not a JSON object", None))??;
    let req = ApiRequest { incoming, obj, view };
    match route.mode {
        Mode::Relay => relay::handle(session, info, rec, &req).await,
        _ => orchestrate::run(session, info, rec, &req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_pieces_are_joined_once_and_a_lone_piece_is_kept_as_it_came() {
        let lone = Bytes::from(vec![b'x'; 100]);
        let mut body = BodyPieces::default();
        body.push(lone.clone());
        assert_eq!(body.joined().as_ptr(), lone.as_ptr(), "a lone piece is not copied");
        let mut body = BodyPieces::default();
        for i in 0..1000u32 {
            body.push(Bytes::from(vec![(i % 251) as u8; 1000]));
        }
        let joined = body.joined();
        assert_eq!(joined.len(), 1_000_000);
        assert!(joined.chunks(1000).enumerate().all(|(i, c)| c.iter().all(|&b| u32::from(b) == i as u32 % 251)));
        assert!(BodyPieces::default().joined().is_empty());
        // A trickled body (a byte per piece) is folded: few pieces held, every byte kept.
        let mut body = BodyPieces::default();
        for i in 0..10_000u32 {
            body.push(Bytes::from(vec![(i % 7) as u8]));
            assert!(body.pieces.len() < MAX_HELD_PIECES);
        }
        let joined = body.joined();
        assert_eq!(joined.len(), 10_000);
        assert!(joined.iter().enumerate().all(|(i, &b)| usize::from(b) == i % 7));
    }
}
