//! Bounds for requests pingora's own pipeline proxies (passthrough routes and unmatched
//! paths), what its failures mean for the error exit, and the endpoint of a stored Responses
//! answer a path names.
//!
//! The bounds: the route's body limit (declared up front, counted while it streams), and
//! per-read and per-write engine timeouts on the peer.

use std::time::Duration;

use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;

use super::error::ProxyError;
use super::rescue;
use super::{Call, Record, RequestInfo};
use crate::metrics::{FollowUp, Leg};
use crate::openai::ApiError;
use crate::routes::Route;
use crate::upstream::Picked;

/// For `/v1/responses/{id}` (and its `/cancel`, `/input_items`): the endpoint of the route's
/// pool that stored `id`, counted as a follow-up; `None` for other paths or an unknown id.
pub fn stored_answer_home(info: &RequestInfo, path: &str) -> Option<Picked> {
    let id = path.strip_prefix("/v1/responses/")?.split('/').next().filter(|id| !id.is_empty())?;
    let home = info.app.homes.home(id).and_then(|name| info.route.decode_pool.pick_named(&name));
    info.app.metrics.upstream.response_followup(if home.is_some() { FollowUp::Home } else { FollowUp::Unknown });
    home
}

/// Answers 413 (and returns `Ok(true)`: answered) when the request declares a body over the
/// route's `max_body_bytes`; the body is not read, so the connection is not reused.
///
/// # Errors
/// Never; `Result` is the phase's signature.
pub async fn check_declared_length(call: &mut Call<'_>) -> Result<bool> {
    let limit = call.info.route.max_body_bytes;
    let declared = call.session.req_header().headers.get("content-length").and_then(|v| v.to_str().ok()?.parse().ok());
    if declared.is_none_or(|len: usize| len <= limit) {
        return Ok(false);
    }
    call.session.set_keepalive(None);
    rescue::fail(call, ApiError::BodyTooLarge { limit }.into()).await;
    Ok(true)
}

/// Adds `n` streamed body bytes; past the route's limit the request fails with 413.
///
/// # Errors
/// `HTTPStatus(413)` once the body is over `max_body_bytes` ([`classify`] answers it).
pub fn count_body(info: &RequestInfo, rec: &mut Record, n: usize) -> Result<()> {
    rec.passthrough.body_bytes = rec.passthrough.body_bytes.saturating_add(n);
    if rec.passthrough.body_bytes > info.route.max_body_bytes {
        return Err(Error::explain(ErrorType::HTTPStatus(413), "request body over max_body_bytes"));
    }
    Ok(())
}

/// Each read from the engine waits at most the larger of the route's first-byte and stream
/// idle timeouts (pingora has one read timeout for the head and the body), each write of the
/// request body at most the idle timeout.
pub fn bounded_peer(mut peer: HttpPeer, route: &Route) -> HttpPeer {
    peer.options.read_timeout = Some(read_timeout(route));
    peer.options.write_timeout = Some(route.stream_idle_timeout);
    peer
}

fn read_timeout(route: &Route) -> Duration {
    route.decode_first_byte_timeout.max(route.stream_idle_timeout)
}

/// The failures of the pipeline that are bounds of ours: a body over the limit, an engine
/// read or write that ran out (before the response head: no answer in time; after: a
/// stalled body), a client that stopped reading. `None`: not one of them.
pub fn classify(session: &Session, e: &Error, info: &RequestInfo) -> Option<ProxyError> {
    let route = &info.route;
    let upstream = matches!(e.esource(), ErrorSource::Upstream);
    match e.etype() {
        ErrorType::HTTPStatus(413) => Some(ApiError::BodyTooLarge { limit: route.max_body_bytes }.into()),
        ErrorType::ReadTimedout
            if upstream && session.response_written().is_some_and(|h| !h.status.is_informational()) =>
        {
            Some(ProxyError::StreamIdle { leg: Leg::Passthrough, after: read_timeout(route) })
        }
        ErrorType::ReadTimedout | ErrorType::WriteTimedout if upstream => {
            Some(ProxyError::Timeout { leg: Leg::Passthrough, after: read_timeout(route) })
        }
        ErrorType::WriteTimedout => Some(ProxyError::ClientStalled { after: route.client_write_timeout }),
        _ => None,
    }
}
