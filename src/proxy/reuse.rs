//! Reuse accounting: how each decode was sent (token-in, or text and why), counted in the
//! route's reuse series, noted on the request's span and in its access log line. A decode
//! sent ids counts as `applied` only once it answers 2xx ([`settle`]).

use super::{Record, RequestInfo};
use crate::openai::IdsError;
use crate::plan::Reuse;

/// Counts how the decode is sent and notes it for the access log; a decode sent ids is
/// counted when it answers ([`settle`]).
pub fn record(info: &RequestInfo, rec: &mut Record, reuse: Reuse, refused: Option<&IdsError>) {
    if let Some(e) = refused {
        tracing::info!(request_id = %info.request_id, error = %e, "prompt ids refused");
    }
    match reuse {
        Reuse::Applied { tokens, id_bytes } => rec.reuse.pending = Some((tokens, id_bytes)),
        Reuse::Fallback(reason) => {
            rec.trace.attribute("tokenonce.reuse.result", "fallback");
            rec.trace.attribute("tokenonce.reuse.reason", reason.as_str());
            info.route.metrics.reuse_fallback(reason);
            tracing::info!(request_id = %info.request_id, route = %info.route.name, reason = %reason, "token reuse fallback");
        }
        Reuse::NotCounted => {}
    }
    rec.reuse.log = reuse.log_value().or(rec.reuse.log);
}

/// Counts the reuse of a decode that was sent ids, now that its leg ended in `answered`
/// (a 2xx head: `applied`; anything else: `decode_failed`, the ids sent but not used).
pub fn settle(info: &RequestInfo, rec: &mut Record, answered: Option<u16>) {
    let Some((tokens, id_bytes)) = rec.reuse.pending.take() else { return };
    if answered.is_some_and(|status| (200..300).contains(&status)) {
        info.route.metrics.reuse_applied(tokens, id_bytes);
        rec.trace.attribute("tokenonce.reuse.result", "applied");
        rec.trace.attribute("tokenonce.reused_prompt_tokens", i64::try_from(tokens).unwrap_or(i64::MAX));
    } else {
        info.route.metrics.reuse_decode_failed();
        rec.trace.attribute("tokenonce.reuse.result", "decode_failed");
        rec.reuse.log = Some("decode_failed");
    }
    rec.trace.attribute("tokenonce.reuse.reason", "none");
}
