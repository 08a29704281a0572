//! Why a request could not be served as planned ([`ProxyError`]), what each error means to
//! the client ([`ProxyError::api_error`]) and how it is counted ([`count`]); the one exit
//! that answers with it is `rescue::fail`.
//!
//! A client's message names no upstream address and carries no internal error chain.

use std::time::Duration;

use super::RequestInfo;
use crate::metrics::{ErrorKind, Leg, TimeoutStage};
use crate::openai::response::HandoffError;
use crate::openai::ApiError;
use crate::upstream::{LegError, UpstreamError};

/// Why a request could not be served as planned.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The client's request is refused (bad body, too large, bad prefiller header).
    #[error(transparent)]
    Request(#[from] ApiError),
    /// A leg's engine could not be reached or failed before the client saw a byte.
    #[error("{leg} leg: {source}")]
    Upstream {
        /// Which leg.
        leg: Leg,
        /// The failure, with the address (for the log only).
        source: UpstreamError,
    },
    /// A leg's deadline passed before its answer.
    #[error("{leg} leg: no answer within {} ms", after.as_millis())]
    Timeout {
        /// Which leg.
        leg: Leg,
        /// The deadline that passed.
        after: Duration,
    },
    /// The prefill answered 2xx with something that is not a completion response.
    #[error(transparent)]
    PrefillBadResponse(#[from] HandoffError),
    /// The leg's pool has no endpoint to send to.
    #[error("{0} pool has no endpoint")]
    NoEndpoint(Leg),
    /// A relayed stream broke after the response began.
    #[error("{leg} stream broke: {source}")]
    StreamBroken {
        /// Which leg.
        leg: Leg,
        /// The failure.
        source: UpstreamError,
    },
    /// A relayed answer went silent for longer than the route's stream idle timeout.
    #[error("{leg} answer: nothing for {} ms", after.as_millis())]
    StreamIdle {
        /// Which leg.
        leg: Leg,
        /// The idle limit that passed.
        after: Duration,
    },
    /// A relayed SSE event was longer than the route allows.
    #[error("{leg} stream: an event over {limit} bytes")]
    EventTooLarge {
        /// Which leg.
        leg: Leg,
        /// The route's `max_sse_event_bytes`.
        limit: usize,
    },
    /// The client did not take a write within the route's client write timeout; nothing
    /// more is sent (it would not be read) and its connection is cut.
    #[error("client stopped reading: a write waited {} ms", after.as_millis())]
    ClientStalled {
        /// The write timeout that passed.
        after: Duration,
    },
    /// The client went away; nothing is answered.
    #[error("client closed the connection")]
    ClientGone,
    /// A bug or an unclassified failure inside tokenonce.
    #[error("internal: {0}")]
    Internal(String),
}

impl From<LegError> for ProxyError {
    fn from(e: LegError) -> Self {
        match e {
            LegError::NoEndpoint(leg) => Self::NoEndpoint(leg),
            LegError::Upstream { leg, source } => Self::upstream(leg, source),
            LegError::Timeout { leg, after } => Self::Timeout { leg, after },
            LegError::Head(why) => Self::Internal(why),
        }
    }
}

impl ProxyError {
    /// A leg's upstream failure.
    pub fn upstream(leg: Leg, source: UpstreamError) -> Self {
        Self::Upstream { leg, source }
    }

    /// The same failure with every connect cause reading alike (for prefillers a client names:
    /// refused, timed out, unresolvable and a refused TLS handshake must not tell a port scan
    /// apart; the log and `kind="tls"` still do).
    pub fn uniform_connect(self) -> Self {
        match self {
            Self::Upstream { leg, source: UpstreamError::Connect { addr, detail, .. } } => {
                Self::Upstream { leg, source: UpstreamError::Connect { addr, cause: "cannot connect", detail } }
            }
            Self::Upstream { leg, source: UpstreamError::Tls { addr, detail, .. } } => {
                Self::Upstream { leg, source: UpstreamError::Tls { addr, cause: "cannot connect", detail } }
            }
            other => other,
        }
    }

    /// The client's answer, with a message safe to show.
    pub fn api_error(&self) -> ApiError {
        let unavailable = |leg: Leg, cause: &str| match leg {
            Leg::Prefill => ApiError::PrefillUnavailable(cause.to_owned()),
            Leg::Decode | Leg::Passthrough => ApiError::DecodeUnavailable(cause.to_owned()),
        };
        let ms = |d: &Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        match self {
            Self::Request(e) => e.clone(),
            Self::Upstream { leg, source } => unavailable(*leg, source.cause()),
            Self::Timeout { leg: Leg::Prefill, after } => ApiError::PrefillTimeout(ms(after)),
            Self::Timeout { after, .. } => ApiError::DecodeTimeout(ms(after)),
            Self::PrefillBadResponse(_) => ApiError::PrefillBadResponse("not a completion response".into()),
            Self::NoEndpoint(leg) => unavailable(*leg, "no endpoint in its pool"),
            Self::StreamBroken { source, .. } => ApiError::DecodeStreamFailed(source.cause().to_owned()),
            Self::StreamIdle { after, .. } => ApiError::StreamIdleTimeout(ms(after)),
            Self::EventTooLarge { limit, .. } => ApiError::StreamEventTooLarge(*limit),
            Self::ClientGone | Self::ClientStalled { .. } | Self::Internal(_) => {
                ApiError::Internal("tokenonce failed to serve the request".into())
            }
        }
    }

    /// The `upstream_errors_total{stage,kind}` series this error counts in, if any.
    pub fn counted_as(&self) -> Option<(Leg, ErrorKind)> {
        match self {
            Self::Upstream { leg, source } => Some((*leg, source.kind())),
            Self::Timeout { leg, .. } => Some((*leg, ErrorKind::Timeout)),
            Self::PrefillBadResponse(_) => Some((Leg::Prefill, ErrorKind::BadResponse)),
            Self::StreamBroken { leg, .. } => Some((*leg, ErrorKind::StreamBroken)),
            Self::StreamIdle { leg, .. } => Some((*leg, ErrorKind::Timeout)),
            Self::EventTooLarge { leg, .. } => Some((*leg, ErrorKind::TooLarge)),
            Self::Request(_)
            | Self::NoEndpoint(_)
            | Self::ClientGone
            | Self::ClientStalled { .. }
            | Self::Internal(_) => None,
        }
    }

    /// The `timeouts_total{stage}` series this error counts in, if it is a wait that ran out.
    pub fn timeout_stage(&self) -> Option<TimeoutStage> {
        match self {
            Self::Timeout { leg: Leg::Prefill, .. } => Some(TimeoutStage::Prefill),
            Self::Timeout { .. } => Some(TimeoutStage::FirstByte),
            Self::StreamIdle { .. } => Some(TimeoutStage::StreamIdle),
            Self::ClientStalled { .. } => Some(TimeoutStage::ClientWrite),
            Self::Upstream { source, .. } if source.timed_out_connecting() => Some(TimeoutStage::Connect),
            _ => None,
        }
    }
}

/// Counts `err` in `upstream_errors_total` and `timeouts_total` (each where it belongs).
pub fn count(info: &RequestInfo, err: &ProxyError) {
    if let Some((leg, kind)) = err.counted_as() {
        info.app.metrics.upstream.upstream_error(leg, kind);
    }
    if let Some(stage) = err.timeout_stage() {
        info.route.metrics.timeout(stage);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> UpstreamError {
        UpstreamError::Connect {
            addr: "10.1.2.3:8100".into(),
            cause: "connection refused",
            detail: "connect to addr: 10.1.2.3:8100, scheme: HTTP failed: ConnectRefused context: x".into(),
        }
    }

    /// Every error a client can receive: its code and status, and a body that names no
    /// upstream address and carries no internal error chain.
    #[test]
    fn every_error_body_is_typed_and_reveals_nothing_inside() {
        let addr_free = |body: &str| !body.contains("10.1.2.3") && !body.contains("8100") && !body.contains("context");
        let io = UpstreamError::Io { addr: "10.1.2.3:8100".into(), cause: "connection closed", detail: "x".into() };
        type Row = (ProxyError, u16, &'static str, Option<(Leg, ErrorKind)>);
        let table: Vec<Row> = vec![
            (ApiError::invalid("bad", None).into(), 400, "invalid_request", None),
            (
                ProxyError::upstream(Leg::Prefill, refused()),
                502,
                "prefill_unavailable",
                Some((Leg::Prefill, ErrorKind::Connect)),
            ),
            (
                ProxyError::upstream(Leg::Decode, refused()),
                502,
                "decode_unavailable",
                Some((Leg::Decode, ErrorKind::Connect)),
            ),
            (
                ProxyError::upstream(Leg::Passthrough, io.clone()),
                502,
                "decode_unavailable",
                Some((Leg::Passthrough, ErrorKind::Io)),
            ),
            (
                ProxyError::Timeout { leg: Leg::Prefill, after: Duration::from_millis(300) },
                504,
                "prefill_timeout",
                Some((Leg::Prefill, ErrorKind::Timeout)),
            ),
            (
                ProxyError::Timeout { leg: Leg::Decode, after: Duration::from_millis(300) },
                504,
                "decode_timeout",
                Some((Leg::Decode, ErrorKind::Timeout)),
            ),
            (
                HandoffError("expected value at line 1 column 1".into()).into(),
                502,
                "prefill_bad_response",
                Some((Leg::Prefill, ErrorKind::BadResponse)),
            ),
            (ProxyError::NoEndpoint(Leg::Prefill), 502, "prefill_unavailable", None),
            (
                ProxyError::upstream(
                    Leg::Decode,
                    UpstreamError::Tls {
                        addr: "10.1.2.3:8100".into(),
                        cause: "engine certificate not trusted",
                        detail: "certificate verify failed context: 10.1.2.3:8100".into(),
                    },
                ),
                502,
                "decode_unavailable",
                Some((Leg::Decode, ErrorKind::Tls)),
            ),
            (
                ProxyError::StreamBroken { leg: Leg::Decode, source: io },
                502,
                "decode_stream_failed",
                Some((Leg::Decode, ErrorKind::StreamBroken)),
            ),
            (ProxyError::Internal("pingora said 10.1.2.3:8100".into()), 500, "internal_error", None),
            (
                ProxyError::StreamIdle { leg: Leg::Passthrough, after: Duration::from_millis(300) },
                504,
                "stream_idle_timeout",
                Some((Leg::Passthrough, ErrorKind::Timeout)),
            ),
            (
                ProxyError::EventTooLarge { leg: Leg::Decode, limit: 65536 },
                502,
                "stream_event_too_large",
                Some((Leg::Decode, ErrorKind::TooLarge)),
            ),
        ];
        for (err, status, code, counted) in table {
            let api = err.api_error();
            assert_eq!((api.status(), api.code()), (status, code), "{err}");
            assert_eq!(err.counted_as(), counted, "{err}");
            let body = String::from_utf8(api.body()).unwrap();
            assert!(addr_free(&body), "{err}: {body}");
        }
        let stages = [
            (ProxyError::Timeout { leg: Leg::Prefill, after: Duration::ZERO }, Some(TimeoutStage::Prefill)),
            (ProxyError::Timeout { leg: Leg::Passthrough, after: Duration::ZERO }, Some(TimeoutStage::FirstByte)),
            (ProxyError::StreamIdle { leg: Leg::Decode, after: Duration::ZERO }, Some(TimeoutStage::StreamIdle)),
            (ProxyError::ClientStalled { after: Duration::ZERO }, Some(TimeoutStage::ClientWrite)),
            (ProxyError::upstream(Leg::Decode, refused()), None),
            (
                ProxyError::upstream(
                    Leg::Decode,
                    UpstreamError::Connect { addr: "a".into(), cause: "connect timed out", detail: "x".into() },
                ),
                Some(TimeoutStage::Connect),
            ),
        ];
        for (err, stage) in stages {
            assert_eq!(err.timeout_stage(), stage, "{err}");
        }
        assert_eq!(ProxyError::ClientStalled { after: Duration::ZERO }.counted_as(), None, "not the engine's fault");
        let body = String::from_utf8(ProxyError::upstream(Leg::Prefill, refused()).api_error().body()).unwrap();
        assert!(body.contains("prefill engine unavailable: connection refused"), "{body}");
        assert!(
            ProxyError::upstream(Leg::Prefill, refused()).to_string().contains("10.1.2.3:8100"),
            "the log keeps it"
        );
    }
}
