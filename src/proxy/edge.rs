//! The client edge: limits checked before any leg (header fields and bytes of a request head,
//! how long its body may take), the one interim answer tokenonce writes (`100 Continue`), and
//! the watch for a client that leaves ([`client_gone`], raced by every wait on an engine).
//!
//! A slow body is a slowloris; the count of requests served at once is `app::Admission`,
//! shared across reloads. pingora itself caps a head at 256 fields and 1 MiB and waits at
//! most 60 s per read.

use std::time::Duration;

use http::HeaderMap;
use pingora::http::RequestHeader;
use pingora::proxy::Session;

use crate::config::Config;
use crate::openai::ApiError;

/// The edge limits of one config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeLimits {
    /// Most header fields in a request head.
    pub max_header_count: usize,
    /// Most bytes of header names and values (each field counted with its `: ` and CRLF).
    pub max_header_bytes: usize,
    /// The whole request body must arrive within this.
    pub body_read_timeout: Duration,
    /// Most client requests served at once (0: no bound).
    pub max_in_flight: usize,
}

impl EdgeLimits {
    /// The limits `config` sets.
    pub fn of(config: &Config) -> Self {
        let server = &config.server;
        Self {
            max_header_count: server.max_header_count,
            max_header_bytes: server.max_header_bytes,
            body_read_timeout: server.body_read_timeout_ms,
            max_in_flight: server.max_in_flight,
        }
    }
}

/// Refuses a head over the limits (431).
///
/// # Errors
/// [`ApiError::HeadersTooLarge`] saying which limit.
pub fn check_head(headers: &HeaderMap, limits: &EdgeLimits) -> Result<(), ApiError> {
    if headers.len() > limits.max_header_count {
        return Err(ApiError::HeadersTooLarge(format!(
            "{} header fields, at most {}",
            headers.len(),
            limits.max_header_count
        )));
    }
    let bytes: usize = headers.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if bytes > limits.max_header_bytes {
        return Err(ApiError::HeadersTooLarge(format!(
            "{bytes} bytes of headers, at most {}",
            limits.max_header_bytes
        )));
    }
    Ok(())
}

/// True when the client waits for `100 Continue` before it sends the body (RFC 9110
/// §10.1.1; HTTP/1.1 only, as pingora checks it before writing the interim answer).
pub fn expects_continue(head: &RequestHeader) -> bool {
    head.version == http::Version::HTTP_11
        && head.headers.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Writes `100 Continue` when the client waits for it; call it once the head is accepted and
/// the body is about to be read. Without it the client waits out its own timer (curl: 1 s)
/// before sending the body.
///
/// # Errors
/// Writing to the client failed.
pub async fn continue_if_expected(session: &mut Session) -> pingora::Result<()> {
    if expects_continue(session.req_header()) {
        let downstream = session.as_downstream_mut();
        // pingora closes a connection whose answer starts before the body is read; an
        // interim answer is not that, so the client's keep-alive survives it.
        downstream.set_close_on_response_before_downstream_finish(false);
        let written = downstream.write_continue_response().await;
        downstream.set_close_on_response_before_downstream_finish(true);
        written?;
    }
    Ok(())
}

/// Waits until the client has gone (FIN or reset while we have nothing to read).
pub async fn client_gone(session: &mut Session) {
    // With abort_on_close set, a FIN is an error; data after the body is an error too.
    let _ = session.as_downstream_mut().read_body_or_idle(true).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_over_either_limit_are_431() {
        let limits = EdgeLimits {
            max_header_count: 3,
            max_header_bytes: 40,
            body_read_timeout: Duration::from_secs(1),
            max_in_flight: 0,
        };
        let mut h = HeaderMap::new();
        h.insert("a", "1".parse().unwrap());
        h.insert("b", "2".parse().unwrap());
        assert_eq!(check_head(&h, &limits), Ok(()));
        h.insert("c", "x".repeat(40).parse().unwrap());
        assert_eq!(check_head(&h, &limits).unwrap_err().status(), 431, "bytes");
        h.insert("c", "3".parse().unwrap());
        h.insert("d", "4".parse().unwrap());
        let err = check_head(&h, &limits).unwrap_err();
        assert_eq!((err.status(), err.code()), (431, "headers_too_large"));
    }
}
