//! tokenonce's own errors, each with its HTTP status and a stable `code` string
//! (docs/failures.md "Errors" lists them), written in the format of the API asked: OpenAI's
//! `{"error":{"message","type","param","code"}}` (chat, completions, responses, any other
//! path), Anthropic's `{"type":"error","error":{"type","message"}}` on `/v1/messages`; in a
//! stream that already began, the API's own error event. Upstream errors are never re-wrapped
//! here: an engine's own 4xx body is relayed unchanged.

use serde::Serialize;

use super::api::Api;

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

/// Anthropic's error envelope (what vLLM writes on `/v1/messages`).
#[derive(Serialize)]
struct AnthropicEnvelope<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    error: AnthropicBody<'a>,
}

#[derive(Serialize)]
struct AnthropicBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: String,
}

/// The Responses API's stream error event (`ResponseErrorEvent` of the OpenAI SDK).
#[derive(Serialize)]
struct ResponsesErrorEvent<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
    message: String,
    param: Option<&'a str>,
    sequence_number: u64,
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

    /// Anthropic's `error.type` for this error (its SDK picks the exception by status).
    pub fn anthropic_kind(&self) -> &'static str {
        if matches!(self, Self::Overloaded(_)) {
            return "overloaded_error";
        }
        match self.status() {
            413 => "request_too_large",
            400 | 408 | 431 => "invalid_request_error",
            403 => "permission_error",
            504 => "timeout_error",
            _ => "api_error",
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

    /// The JSON body in the format of `api` (OpenAI's for any but Messages, and for `None`).
    pub fn body_for(&self, api: Option<Api>) -> Vec<u8> {
        if api != Some(Api::Messages) {
            return self.body();
        }
        let envelope = AnthropicEnvelope {
            kind: "error",
            error: AnthropicBody { kind: self.anthropic_kind(), message: self.to_string() },
        };
        serde_json::to_vec(&envelope).unwrap_or_else(|_| b"{\"type\":\"error\"}".to_vec())
    }

    /// The same error as one SSE event followed by `[DONE]`, for a chat or completions stream
    /// that already began.
    pub fn sse_event(&self) -> Vec<u8> {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.body());
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        out
    }

    /// The error event ending a stream of `api` that already began: chat, completions and generate as
    /// [`Self::sse_event`]; Responses `event: error` with `{"type":"error","code","message",
    /// "param","sequence_number"}` (`sequence_number` the stream's next); Messages
    /// `event: error` with Anthropic's body. Neither of the last two has a `[DONE]`.
    pub fn sse_event_for(&self, api: Option<Api>, sequence_number: u64) -> Vec<u8> {
        let data = match api {
            Some(Api::Responses) => serde_json::to_vec(&ResponsesErrorEvent {
                kind: "error",
                code: self.code(),
                message: self.to_string(),
                param: self.param(),
                sequence_number,
            })
            .unwrap_or_default(),
            Some(Api::Messages) => self.body_for(api),
            Some(Api::Chat | Api::Completions | Api::Generate) | None => return self.sse_event(),
        };
        let mut out = b"event: error\ndata: ".to_vec();
        out.extend_from_slice(&data);
        out.extend_from_slice(b"\n\n");
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
    fn messages_and_responses_errors_take_their_own_format() {
        let err = ApiError::invalid("bad field", Some("max_tokens"));
        let body: serde_json::Value = serde_json::from_slice(&err.body_for(Some(Api::Messages))).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"type": "error", "error": {"type": "invalid_request_error", "message": "invalid request: bad field"}})
        );
        assert_eq!(err.body_for(Some(Api::Responses)), err.body(), "Responses errors are OpenAI's");
        assert_eq!(err.body_for(None), err.body());
        let kinds = [
            (ApiError::BodyTooLarge { limit: 1 }, "request_too_large"),
            (ApiError::PrefillerNotAllowed("x".into()), "permission_error"),
            (ApiError::DecodeTimeout(5), "timeout_error"),
            (ApiError::DecodeUnavailable("x".into()), "api_error"),
            (ApiError::Internal("x".into()), "api_error"),
            (ApiError::Overloaded(4), "overloaded_error"),
        ];
        for (err, kind) in kinds {
            assert_eq!(err.anthropic_kind(), kind, "{err}");
        }

        let broke = ApiError::DecodeStreamFailed("connection reset".into());
        let events = crate::sse::SseDecoder::new().feed(&broke.sse_event_for(Some(Api::Responses), 7));
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].other_lines().collect::<Vec<_>>(), vec![&b"event: error"[..]]);
        let data: serde_json::Value = serde_json::from_slice(&events[0].data().unwrap()).unwrap();
        assert_eq!(
            data,
            serde_json::json!({"type": "error", "code": "decode_stream_failed", "message": "decode engine stream failed: connection reset", "param": null, "sequence_number": 7})
        );
        let text = String::from_utf8(broke.sse_event_for(Some(Api::Messages), 7)).unwrap();
        assert_eq!(
            text,
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"decode engine stream failed: connection reset\"}}\n\n"
        );
        assert_eq!(broke.sse_event_for(Some(Api::Chat), 7), broke.sse_event());
        assert_eq!(broke.sse_event_for(Some(Api::Completions), 7), broke.sse_event());
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
