//! tokenonce's own errors in OpenAI's shape, `{"error":{"message","type","param","code"}}`,
//! each with its HTTP status and a stable `code` string (README "Errors" lists them). Upstream errors are
//! never re-wrapped here: an engine's own 4xx body is relayed unchanged.

use serde::Serialize;

/// An error tokenonce answers by itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request body is not valid JSON or misses a required field.
    #[error("invalid request: {message}")]
    InvalidRequest { message: String, param: Option<&'static str> },
    /// The request body is over the route's `max_body_bytes`.
    #[error("request body over {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The request head has too many header fields, or too many bytes of them.
    #[error("request headers over the limit: {0}")]
    HeadersTooLarge(String),
    /// The client sent its body too slowly.
    #[error("request body not received within {0} ms")]
    RequestTimeout(u64),
    /// `x-prefiller-host-port` is missing, repeated or not one `host:port`.
    #[error("invalid x-prefiller-host-port header: {0}")]
    InvalidPrefillerHeader(String),
    /// `x-prefiller-host-port` came from a peer the route does not trust to send it.
    #[error("x-prefiller-host-port is not accepted from this client")]
    UntrustedPrefillerHeader,
    /// `x-prefiller-host-port` names a host outside the route's allowlist.
    #[error("prefiller {0} is not in the allowlist")]
    PrefillerNotAllowed(String),
    /// The prefill engine could not be reached or closed the connection.
    #[error("prefill engine unavailable: {0}")]
    PrefillUnavailable(String),
    /// The prefill engine did not answer within the route's prefill timeout.
    #[error("prefill timed out after {0} ms")]
    PrefillTimeout(u64),
    /// The prefill engine answered 2xx with a body that is not a usable response.
    #[error("prefill engine returned a bad response: {0}")]
    PrefillBadResponse(String),
    /// The decode engine could not be reached or failed before its first byte.
    #[error("decode engine unavailable: {0}")]
    DecodeUnavailable(String),
    /// The decode engine sent no response header within the first-byte timeout.
    #[error("decode timed out after {0} ms before its first byte")]
    DecodeTimeout(u64),
    /// An engine sent nothing for longer than the route's stream idle timeout.
    #[error("engine answer stalled: nothing for {0} ms")]
    StreamIdleTimeout(u64),
    /// An engine's SSE event was longer than the route's `max_sse_event_bytes`.
    #[error("engine stream event over {0} bytes")]
    StreamEventTooLarge(usize),
    /// The decode stream broke after the response had started.
    #[error("decode engine stream failed: {0}")]
    DecodeStreamFailed(String),
    /// `server.max_in_flight` requests are being served: this one is refused before any leg.
    #[error("tokenonce is serving its limit of {0} requests; retry shortly")]
    Overloaded(usize),
    /// A bug or an unclassified failure inside tokenonce.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Seconds a client refused as [`ApiError::Overloaded`] is told to wait (`Retry-After`): a
/// request slot frees as soon as any answer ends, so a short pause is enough.
pub const OVERLOADED_RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl ApiError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidRequest { .. } | Self::InvalidPrefillerHeader(_) => 400,
            Self::PrefillerNotAllowed(_) | Self::UntrustedPrefillerHeader => 403,
            Self::BodyTooLarge { .. } => 413,
            Self::HeadersTooLarge(_) => 431,
            Self::RequestTimeout(_) => 408,
            Self::PrefillUnavailable(_)
            | Self::PrefillBadResponse(_)
            | Self::DecodeUnavailable(_)
            | Self::DecodeStreamFailed(_)
            | Self::StreamEventTooLarge(_) => 502,
            Self::PrefillTimeout(_) | Self::DecodeTimeout(_) | Self::StreamIdleTimeout(_) => 504,
            Self::Overloaded(_) => 503,
            Self::Internal(_) => 500,
        }
    }

    /// The stable machine-readable code (`error.code`).
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. } => "invalid_request",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::HeadersTooLarge(_) => "headers_too_large",
            Self::RequestTimeout(_) => "request_timeout",
            Self::InvalidPrefillerHeader(_) => "invalid_prefiller_header",
            Self::PrefillerNotAllowed(_) => "prefiller_not_allowed",
            Self::UntrustedPrefillerHeader => "prefiller_header_untrusted",
            Self::PrefillUnavailable(_) => "prefill_unavailable",
            Self::PrefillTimeout(_) => "prefill_timeout",
            Self::PrefillBadResponse(_) => "prefill_bad_response",
            Self::DecodeUnavailable(_) => "decode_unavailable",
            Self::DecodeTimeout(_) => "decode_timeout",
            Self::DecodeStreamFailed(_) => "decode_stream_failed",
            Self::StreamIdleTimeout(_) => "stream_idle_timeout",
            Self::StreamEventTooLarge(_) => "stream_event_too_large",
            Self::Overloaded(_) => "overloaded",
            Self::Internal(_) => "internal_error",
        }
    }

    /// OpenAI's `error.type` family for this error.
    pub fn kind(&self) -> &'static str {
        match self.status() {
            400 | 408 | 413 | 431 => "invalid_request_error",
            403 => "permission_error",
            500 => "internal_error",
            503 => "server_error",
            _ => "upstream_error",
        }
    }

    /// Seconds the client should wait before retrying (`Retry-After`), for errors that say so.
    pub fn retry_after(&self) -> Option<u64> {
        matches!(self, Self::Overloaded(_)).then_some(OVERLOADED_RETRY_AFTER_SECONDS)
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            Self::InvalidRequest { param, .. } => *param,
            Self::InvalidPrefillerHeader(_) | Self::PrefillerNotAllowed(_) | Self::UntrustedPrefillerHeader => {
                Some("x-prefiller-host-port")
            }
            _ => None,
        }
    }

    /// The JSON body `{"error":{message,type,param,code}}`.
    pub fn body(&self) -> Vec<u8> {
        let envelope = Envelope {
            error: Body { message: self.to_string(), kind: self.kind(), param: self.param(), code: self.code() },
        };
        serde_json::to_vec(&envelope).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }

    /// The same error as one SSE event followed by `[DONE]`, for a stream that already began.
    pub fn sse_event(&self) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.body());
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        out
    }

    /// Shorthand for an invalid request with an optional parameter name.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::InvalidRequest { message: message.into(), param }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_and_status_table() {
        let table: [(ApiError, u16, &str); 17] = [
            (ApiError::StreamIdleTimeout(5), 504, "stream_idle_timeout"),
            (ApiError::StreamEventTooLarge(5), 502, "stream_event_too_large"),
            (ApiError::UntrustedPrefillerHeader, 403, "prefiller_header_untrusted"),
            (ApiError::invalid("x", None), 400, "invalid_request"),
            (ApiError::BodyTooLarge { limit: 1 }, 413, "body_too_large"),
            (ApiError::HeadersTooLarge("x".into()), 431, "headers_too_large"),
            (ApiError::RequestTimeout(5), 408, "request_timeout"),
            (ApiError::InvalidPrefillerHeader("x".into()), 400, "invalid_prefiller_header"),
            (ApiError::PrefillerNotAllowed("x".into()), 403, "prefiller_not_allowed"),
            (ApiError::PrefillUnavailable("x".into()), 502, "prefill_unavailable"),
            (ApiError::PrefillTimeout(5), 504, "prefill_timeout"),
            (ApiError::PrefillBadResponse("x".into()), 502, "prefill_bad_response"),
            (ApiError::DecodeUnavailable("x".into()), 502, "decode_unavailable"),
            (ApiError::DecodeTimeout(5), 504, "decode_timeout"),
            (ApiError::DecodeStreamFailed("x".into()), 502, "decode_stream_failed"),
            (ApiError::Overloaded(4), 503, "overloaded"),
            (ApiError::Internal("x".into()), 500, "internal_error"),
        ];
        for (err, status, code) in table {
            assert_eq!(err.status(), status, "{err}");
            assert_eq!(err.code(), code);
            let body: serde_json::Value = serde_json::from_slice(&err.body()).unwrap();
            let e = &body["error"];
            assert_eq!(e["code"], code);
            assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
            assert!(e["type"].is_string());
            assert!(e.as_object().unwrap().contains_key("param"));
        }
    }

    #[test]
    fn only_overloaded_asks_for_a_retry_after() {
        assert_eq!(ApiError::Overloaded(4).retry_after(), Some(OVERLOADED_RETRY_AFTER_SECONDS));
        assert_eq!(ApiError::DecodeTimeout(5).retry_after(), None);
    }

    #[test]
    fn sse_error_ends_with_done() {
        let ev = ApiError::DecodeStreamFailed("reset".into()).sse_event();
        let text = String::from_utf8(ev).unwrap();
        assert!(text.starts_with("data: {\"error\":"));
        assert!(text.ends_with("\n\ndata: [DONE]\n\n"));
    }
}
