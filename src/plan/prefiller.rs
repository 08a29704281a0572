//! The `x-prefiller-host-port` check (llm-d's endpoint picker names the prefill engine in a
//! header): exactly one `host:port`, inside the route's allowlist.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

use crate::config::AllowEntry;
use crate::openai::ApiError;
use crate::tls::UpstreamTls;

/// One allowlist entry: what it permits, and how that is dialled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPrefiller {
    /// The hosts or networks, with ports.
    pub entry: AllowEntry,
    /// TLS to them (`None`: plain HTTP).
    pub tls: Option<UpstreamTls>,
}

/// The prefiller a header names: its `host:port` and the TLS of the entry that permitted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPrefiller {
    /// `host:port` as the header wrote it.
    pub addr: String,
    /// TLS to it (`None`: plain HTTP).
    pub tls: Option<UpstreamTls>,
}

/// A route's rule for a header-named prefiller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRule {
    /// Lower-case header name (never forwarded to an engine).
    pub name: String,
    /// Hosts and networks (with ports) the header may name; the first that permits one decides.
    pub allow: Vec<AllowedPrefiller>,
    /// Peers whose header is believed; empty: any peer.
    pub trusted_sources: Vec<IpNet>,
    /// Send the client's credentials to the named prefiller.
    pub forward_credentials: bool,
}

/// Checks an `x-prefiller-host-port` style header sent by `peer` and returns the endpoint
/// it names, with the TLS of the first entry permitting it; `Ok(None)` when the header is absent (the request then goes to the decode alone).
///
/// # Errors
/// 400 when repeated, a list, or not one `host:port`; 403 when outside `allow`, or when the
/// route trusts the header only from some peers and `peer` is not one of them.
pub fn prefiller_from_header(
    headers: &HeaderMap,
    rule: &HeaderRule,
    peer: Option<IpAddr>,
) -> Result<Option<NamedPrefiller>, ApiError> {
    let mut values = headers.get_all(rule.name.as_str()).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let trusted = rule.trusted_sources.is_empty()
        || peer.is_some_and(|ip| rule.trusted_sources.iter().any(|net| net.contains(&ip)));
    if !trusted {
        return Err(ApiError::UntrustedPrefillerHeader);
    }
    if values.next().is_some() {
        return Err(ApiError::InvalidPrefillerHeader("header repeated; exactly one host:port expected".into()));
    }
    let text = value.to_str().map_err(|_| ApiError::InvalidPrefillerHeader("not ASCII".into()))?.trim();
    if text.contains(',') {
        return Err(ApiError::InvalidPrefillerHeader("a list; exactly one host:port expected".into()));
    }
    if !crate::addr::is_host_port(text) {
        return Err(ApiError::InvalidPrefillerHeader(format!("`{text}` is not host:port")));
    }
    let (host, port) = text.rsplit_once(':').unwrap_or((text, ""));
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse::<u16>().unwrap_or(0);
    let ip = host.parse::<IpAddr>().ok();
    match rule.allow.iter().find(|a| a.entry.permits(host, ip, port)) {
        Some(a) => Ok(Some(NamedPrefiller { addr: text.to_owned(), tls: a.tls.clone() })),
        None => Err(ApiError::PrefillerNotAllowed(text.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_allow;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-prefiller-host-port", v.parse().unwrap());
        }
        h
    }

    fn rule(allow: &[&str], trusted: &[&str]) -> HeaderRule {
        HeaderRule {
            name: "x-prefiller-host-port".into(),
            allow: allow.iter().map(|a| AllowedPrefiller { entry: parse_allow(a).unwrap(), tls: None }).collect(),
            trusted_sources: trusted.iter().map(|t| t.parse().unwrap()).collect(),
            forward_credentials: false,
        }
    }

    #[test]
    fn prefiller_header_is_checked() {
        let r = rule(&["127.0.0.0/8", "prefill.svc"], &[]);
        let check = |values: &[&str]| prefiller_from_header(&headers(values), &r, None).map(|n| n.map(|n| n.addr));
        assert_eq!(check(&[]), Ok(None));
        assert_eq!(check(&["127.0.0.9:8100"]), Ok(Some("127.0.0.9:8100".into())));
        assert_eq!(check(&["PREFILL.svc:80"]), Ok(Some("PREFILL.svc:80".into())));
        for bad in [&["127.0.0.1:1,127.0.0.1:2"][..], &["127.0.0.1"], &["127.0.0.1:1", "127.0.0.1:2"], &["h:0"]] {
            assert_eq!(check(bad).unwrap_err().status(), 400, "{bad:?}");
        }
        assert_eq!(check(&["10.1.2.3:8000"]).unwrap_err().status(), 403);
        assert_eq!(check(&["evil.svc:80"]).unwrap_err().status(), 403);
    }

    #[test]
    fn allowlist_ports_fence_the_named_host() {
        let r = rule(&["10.0.0.0/8:8000", "prefill.svc:8000-8009", "[fd00::/8]:9000"], &[]);
        let check =
            |v: &str| prefiller_from_header(&headers(&[v]), &r, None).map(|n| n.map(|n| n.addr)).map_err(|e| e.code());
        assert_eq!(check("10.1.2.3:8000"), Ok(Some("10.1.2.3:8000".into())));
        assert_eq!(check("10.1.2.3:22"), Err("prefiller_not_allowed"), "ssh port of an allowed host");
        assert_eq!(check("prefill.svc:8009"), Ok(Some("prefill.svc:8009".into())));
        assert_eq!(check("prefill.svc:8010"), Err("prefiller_not_allowed"));
        assert_eq!(check("[fd00::1]:9000"), Ok(Some("[fd00::1]:9000".into())));
        assert_eq!(check("[fd00::1]:9001"), Err("prefiller_not_allowed"));
    }

    #[test]
    fn the_first_entry_that_permits_a_prefiller_decides_its_tls() {
        let tls = UpstreamTls::new(None, None, None, true);
        let entry =
            |a: &str, tls: Option<&UpstreamTls>| AllowedPrefiller { entry: parse_allow(a).unwrap(), tls: tls.cloned() };
        let r = HeaderRule {
            allow: vec![entry("prefill.svc:8443", Some(&tls)), entry("prefill.svc", None)],
            ..rule(&[], &[])
        };
        let named = |v: &str| prefiller_from_header(&headers(&[v]), &r, None).unwrap().unwrap();
        assert_eq!(named("prefill.svc:8443").tls.as_ref(), Some(&tls));
        assert_eq!(tls.name_for("prefill.svc:8443"), "prefill.svc", "the server name defaults to the named host");
        assert_eq!(named("prefill.svc:8000").tls, None, "a plain entry: plain HTTP");
    }

    #[test]
    fn the_header_is_believed_only_from_trusted_peers() {
        let r = rule(&["127.0.0.0/8"], &["10.0.0.0/24"]);
        let h = headers(&["127.0.0.2:8100"]);
        let named = prefiller_from_header(&h, &r, "10.0.0.7".parse().ok()).map(|n| n.map(|n| n.addr));
        assert_eq!(named, Ok(Some("127.0.0.2:8100".into())));
        for peer in [Some("10.0.1.7"), None] {
            let err = prefiller_from_header(&h, &r, peer.and_then(|p| p.parse().ok())).unwrap_err();
            assert_eq!((err.status(), err.code()), (403, "prefiller_header_untrusted"), "{peer:?}");
        }
        assert_eq!(prefiller_from_header(&headers(&[]), &r, None), Ok(None), "no header: decode-only, from anyone");
    }
}
