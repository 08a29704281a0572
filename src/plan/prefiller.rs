//! The `x-prefiller-host-port` check (llm-d's endpoint picker names the prefill engine in a
//! header): exactly one `host:port`, inside the route's allowlist.

use std::net::IpAddr;

use http::HeaderMap;

use crate::config::AllowEntry;
use crate::openai::ApiError;

/// Checks an `x-prefiller-host-port` style header and returns the endpoint it names;
/// `Ok(None)` when the header is absent (the request then goes to the decode alone).
///
/// # Errors
/// 400 when repeated, a list, or not one `host:port`; 403 when outside `allow`.
pub fn prefiller_from_header(
    headers: &HeaderMap,
    name: &str,
    allow: &[AllowEntry],
) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::InvalidPrefillerHeader("header repeated; exactly one host:port expected".into()));
    }
    let text = value.to_str().map_err(|_| ApiError::InvalidPrefillerHeader("not ASCII".into()))?.trim();
    if text.contains(',') {
        return Err(ApiError::InvalidPrefillerHeader("a list; exactly one host:port expected".into()));
    }
    if !crate::config::model::is_host_port(text) {
        return Err(ApiError::InvalidPrefillerHeader(format!("`{text}` is not host:port")));
    }
    let host = text.rsplit_once(':').map_or(text, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let allowed = match host.parse::<IpAddr>() {
        Ok(ip) => allow.iter().any(|a| matches!(a, AllowEntry::Net(net) if net.contains(&ip))),
        Err(_) => allow.iter().any(|a| matches!(a, AllowEntry::Host(h) if h.eq_ignore_ascii_case(host))),
    };
    if allowed {
        Ok(Some(text.to_owned()))
    } else {
        Err(ApiError::PrefillerNotAllowed(text.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::model::parse_allow;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-prefiller-host-port", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn prefiller_header_is_checked() {
        let allow: Vec<AllowEntry> = ["127.0.0.0/8", "prefill.svc"].iter().map(|a| parse_allow(a).unwrap()).collect();
        let name = "x-prefiller-host-port";
        assert_eq!(prefiller_from_header(&headers(&[]), name, &allow), Ok(None));
        assert_eq!(
            prefiller_from_header(&headers(&["127.0.0.9:8100"]), name, &allow),
            Ok(Some("127.0.0.9:8100".into()))
        );
        assert_eq!(
            prefiller_from_header(&headers(&["PREFILL.svc:80"]), name, &allow),
            Ok(Some("PREFILL.svc:80".into()))
        );
        for bad in [&["127.0.0.1:1,127.0.0.1:2"][..], &["127.0.0.1"], &["127.0.0.1:1", "127.0.0.1:2"], &["h:0"]] {
            assert_eq!(prefiller_from_header(&headers(bad), name, &allow).unwrap_err().status(), 400, "{bad:?}");
        }
        assert_eq!(prefiller_from_header(&headers(&["10.1.2.3:8000"]), name, &allow).unwrap_err().status(), 403);
        assert_eq!(prefiller_from_header(&headers(&["evil.svc:80"]), name, &allow).unwrap_err().status(), 403);
    }
}
