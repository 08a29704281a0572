//! The one error exit. Every handler returns `Result<(), ProxyError>`; [`fail`] is the only
//! place that turns an error into the client's answer (in the API's format), the log line
//! (full detail with the request id) and its counts.

use bytes::Bytes;

use super::error::{count, ProxyError};
use super::respond::write_full_with;
use super::Call;
use crate::metrics::Outcome;

/// Ends a request that failed: counts it, logs the full detail, and answers the client in
/// its API's format (a JSON error before the response began; the API's SSE error event after
/// the head of a stream went out, see [`ApiError::sse_event_for`]; nothing when the client
/// is gone; a cut connection when a non-SSE body was under way or the client stopped
/// reading, see [`AnswerRecord::cut`](super::AnswerRecord::cut)).
pub async fn fail(call: &mut Call<'_>, err: ProxyError) {
    let (info, rec) = (call.info, &mut *call.rec);
    if let ProxyError::ClientGone = err {
        rec.answer.outcome = Some(Outcome::ClientClosed);
        return;
    }
    count(info, &err);
    if let ProxyError::ClientStalled { .. } = err {
        tracing::info!(request_id = %info.request_id, error = %err, "client connection cut");
        rec.answer.outcome = Some(Outcome::ClientClosed);
        rec.answer.cut = true;
        return;
    }
    let api = err.api_error();
    rec.trace.error(api.code());
    if rec.answer.streaming {
        tracing::warn!(request_id = %info.request_id, code = api.code(), error = %err, "decode stream broke");
        let event = api.sse_event_for(info.api, rec.answer.next_sequence);
        let _ = call.session.write_response_body(Some(Bytes::from(event)), true).await;
        rec.answer.outcome = Some(Outcome::ServerError);
        return;
    }
    tracing::info!(request_id = %info.request_id, code = api.code(), error = %err, "request failed");
    if call.session.response_written().is_some_and(|h| !h.status.is_informational()) {
        // A non-SSE answer was already on its way: nothing more can be said, and ending
        // its body would pass the cut answer off as whole, so the connection is cut.
        tracing::warn!(request_id = %info.request_id, code = api.code(), "answer cut mid-body");
        rec.answer.outcome = Some(Outcome::ServerError);
        rec.answer.cut = true;
        return;
    }
    let head = (api.status(), Some("application/json"), api.retry_after());
    write_full_with(call, head, Bytes::from(api.body_for(info.api))).await;
}
