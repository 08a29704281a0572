//! The orchestrated P/D exchange, run from `request_filter` (pingora.md pattern C): prefill
//! leg, handoff, decode leg in token-in form (or the counted text fallback), relay back.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::HeaderMap;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;

use super::respond::{client_gone, client_head, relay, write_buffered, write_error, Rewrite};
use super::Ctx;
use crate::config::{AllowEntry, PrefillSource, RouteSpec, Version};
use crate::metrics::{Outcome, Stage};
use crate::openai::request::{decode_body, prefill_body};
use crate::openai::response::{extract_handoff, IdsFault};
use crate::openai::{Api, ApiError, FallbackReason, PromptIds, RawObject, RequestView};
use crate::upstream::health::learn_version;
use crate::upstream::{Endpoint, Picked, UpstreamClient, UpstreamError};
use crate::App;

/// Largest prefill response accepted (a 128k-token prompt echoed is about 1 MB).
const PREFILL_RESPONSE_LIMIT: usize = 64 * 1024 * 1024;

/// The request as read by `request_filter`.
#[derive(Clone, Copy)]
pub struct Incoming<'a> {
    /// Path and query as the client sent them.
    pub path_and_query: &'a str,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body.
    pub body: &'a Bytes,
    /// A header never forwarded (the route's `x-prefiller-host-port`).
    pub drop_header: Option<&'a str>,
}

impl Incoming<'_> {
    /// The head of a leg to `addr`: this request's path and end-to-end headers, `request_id`
    /// as `X-Request-Id`, and the leg's body length.
    pub fn head(&self, addr: &str, request_id: &str, body_len: usize) -> Result<RequestHeader, UpstreamError> {
        UpstreamClient::request_head(
            "POST",
            self.path_and_query,
            addr,
            self.headers,
            self.drop_header,
            request_id,
            body_len,
        )
    }
}

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

/// Sends the client's body unchanged to `decode` and relays the answer (no prefill).
pub async fn forward(app: &App, session: &mut Session, ctx: &mut Ctx, decode: Picked, req: &Incoming<'_>, route: &str) {
    let rid = ctx.request_id.clone().unwrap_or_default();
    let head = match req.head(decode.addr(), &rid, req.body.len()) {
        Ok(h) => h,
        Err(e) => return write_error(session, ctx, &ApiError::Internal(e.to_string())).await,
    };
    ctx.decode_sent_at = Some(Instant::now());
    let metrics = &app.metrics;
    let sent = tokio::select! {
        r = app.client.send(decode.addr(), &head, req.body.clone(), || metrics.upstream_retries.with_label_values(&[ctx.stage_label()]).inc()) => r,
        _ = client_gone(session) => { ctx.outcome = Some(Outcome::ClientClosed); return; }
    };
    match sent {
        Ok(exchange) => relay(app, session, ctx, exchange, Rewrite::default(), route).await,
        Err(e) => {
            app.metrics.upstream_errors.with_label_values(&[ctx.stage_label(), e.kind()]).inc();
            write_error(session, ctx, &ApiError::DecodeUnavailable(e.to_string())).await;
        }
    }
}

/// Decides, before the prefill, whether this request may reuse ids.
async fn reuse_gate(app: &App, route: &RouteSpec, view: &RequestView, decode: &Endpoint) -> Option<FallbackReason> {
    if !route.options().token_reuse() {
        return Some(FallbackReason::Disabled);
    }
    if let Some(blocker) = view.reuse_blocker() {
        return Some(blocker);
    }
    if view.api == Api::Completions {
        return None; // `prompt: [ids]` is token-in on every vLLM version
    }
    chat_version_blocker(app, route, decode).await
}

/// Whether the decode's vLLM is too old (or unknown) for chat ids in `kv_transfer_params`:
/// the pool's pinned version, else the endpoint's learned one, else ask `/version`.
pub async fn chat_version_blocker(app: &App, route: &RouteSpec, decode: &Endpoint) -> Option<FallbackReason> {
    let pool_pin = app.pools.get(route.decode_pool()).and_then(|p| p.pinned_version());
    let version = match pool_pin.or_else(|| decode.version()) {
        Some(v) => Some(v),
        None => learn_version(&app.client, decode).await,
    };
    match version {
        None => Some(FallbackReason::DecodeVersionUnknown),
        Some(v) if v < Version::CHAT_TOKEN_REUSE => Some(FallbackReason::DecodeVersionOld),
        Some(_) => None,
    }
}

/// Sends a prefill leg to `addr` and reads its whole answer within the route's prefill
/// timeout, watching the client. On failure the error response is written (or the client
/// is gone) and `None` comes back; otherwise the engine's response head and body.
pub async fn prefill_leg(
    app: &App,
    session: &mut Session,
    ctx: &mut Ctx,
    route: &RouteSpec,
    addr: &str,
    req: &Incoming<'_>,
    body: Bytes,
) -> Option<(ResponseHeader, Bytes)> {
    ctx.stage = Some(Stage::Prefill);
    let rid = ctx.request_id.clone().unwrap_or_default();
    let head = match req.head(addr, &rid, body.len()) {
        Ok(h) => h,
        Err(e) => {
            write_error(session, ctx, &ApiError::Internal(e.to_string())).await;
            return None;
        }
    };
    let started = Instant::now();
    let metrics = &app.metrics;
    let leg = async {
        let exchange = app
            .client
            .send(addr, &head, body, || metrics.upstream_retries.with_label_values(&["prefill"]).inc())
            .await?;
        let response_head = exchange.session.response_header().cloned();
        let body = app.client.read_to_end(exchange, PREFILL_RESPONSE_LIMIT).await?;
        Ok::<_, crate::upstream::UpstreamError>((response_head, body))
    };
    let outcome = tokio::select! {
        r = tokio::time::timeout(route.options().prefill_timeout(), leg) => r,
        _ = client_gone(session) => { ctx.outcome = Some(Outcome::ClientClosed); return None; }
    };
    ctx.prefill_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
    metrics.stage_duration.with_label_values(&[route.name(), "prefill"]).observe(started.elapsed().as_secs_f64());
    let err = match outcome {
        Err(_) => {
            metrics.upstream_errors.with_label_values(&["prefill", "timeout"]).inc();
            ApiError::PrefillTimeout(u64::try_from(route.options().prefill_timeout().as_millis()).unwrap_or(u64::MAX))
        }
        Ok(Err(e)) => {
            metrics.upstream_errors.with_label_values(&["prefill", e.kind()]).inc();
            ApiError::PrefillUnavailable(e.to_string())
        }
        Ok(Ok((Some(head), body))) => {
            if head.status.as_u16() >= 500 {
                metrics.upstream_errors.with_label_values(&["prefill", "status_5xx"]).inc();
            }
            return Some((head, body));
        }
        Ok(Ok((None, _))) => ApiError::PrefillBadResponse("no response header".into()),
    };
    write_error(session, ctx, &err).await;
    None
}

/// Runs one orchestrated request to the end, writing the response (or error) itself.
pub async fn orchestrate(
    app: &App,
    session: &mut Session,
    ctx: &mut Ctx,
    route: &RouteSpec,
    obj: &RawObject<'_>,
    view: &RequestView,
    req: &Incoming<'_>,
) {
    let route_name = route.name();
    let Some(decode) = app.pools.get(route.decode_pool()).and_then(|p| p.pick()) else {
        return write_error(session, ctx, &ApiError::DecodeUnavailable("decode pool has no endpoints".into())).await;
    };
    let prefill = match route.prefill() {
        Some(PrefillSource::Pool(i)) => app.pools.get(*i).and_then(|p| p.pick()),
        Some(PrefillSource::Header { name, allow }) => match prefiller_from_header(req.headers, name, allow) {
            Ok(Some(addr)) => Some(Picked::new(Arc::new(Endpoint::new(addr)))),
            Ok(None) => None,
            Err(e) => return write_error(session, ctx, &e).await,
        },
        None => None,
    };
    let Some(prefill) = prefill else {
        // Header mode without the header: the picker chose decode-only; send it as is.
        ctx.stage = Some(Stage::DecodeTotal);
        return forward(app, session, ctx, decode, req, route_name).await;
    };

    let fallback = reuse_gate(app, route, view, decode.endpoint()).await;
    let want_ids = fallback.is_none();
    let rid = ctx.request_id.clone().unwrap_or_default();
    let metrics = &app.metrics;

    // (1) Prefill leg.
    let prefill_bytes = Bytes::from(prefill_body(obj, want_ids));
    let answer = prefill_leg(app, session, ctx, route, prefill.addr(), req, prefill_bytes).await;
    drop(prefill);
    let Some((prefill_head, prefill_response)) = answer else { return };
    if !prefill_head.status.is_success() {
        // The prefill's own error (e.g. vLLM's 400 for a too-long prompt) goes back unchanged.
        return match client_head(&prefill_head, ctx.request_id.as_deref()) {
            Some(head) => write_buffered(session, ctx, head, prefill_response).await,
            None => write_error(session, ctx, &ApiError::PrefillBadResponse("response header".into())).await,
        };
    }

    // (2) Handoff.
    ctx.stage = Some(Stage::Handoff);
    let handoff_started = Instant::now();
    let handoff = match extract_handoff(view.api, &prefill_response) {
        Ok(h) => h,
        Err(detail) => {
            metrics.upstream_errors.with_label_values(&["prefill", "bad_response"]).inc();
            return write_error(session, ctx, &ApiError::PrefillBadResponse(detail)).await;
        }
    };
    let (ids, reason): (Option<&PromptIds>, Option<FallbackReason>) = match (&fallback, &handoff.ids) {
        (Some(reason), _) => (None, Some(*reason)),
        (None, Ok(ids)) => (Some(ids), None),
        (None, Err(IdsFault::Missing)) => (None, Some(FallbackReason::IdsMissing)),
        (None, Err(IdsFault::Invalid(e))) => {
            tracing::info!(request_id = %rid, error = %e, "prefill ids refused");
            (None, Some(FallbackReason::IdsMalformed))
        }
    };
    let decode_bytes = Bytes::from(decode_body(obj, view.api, handoff.kv_transfer_params.as_deref(), ids));
    match (ids, reason) {
        (Some(ids), _) => {
            metrics.token_reuse.with_label_values(&[route_name, "applied", "none"]).inc();
            metrics.reused_prompt_tokens.with_label_values(&[route_name]).inc_by(ids.len() as u64);
            metrics.relayed_id_bytes.inc_by(ids.as_json().len() as u64);
            ctx.reuse = Some("applied");
        }
        (None, reason) => {
            let reason = reason.unwrap_or(FallbackReason::IdsMissing);
            metrics.token_reuse.with_label_values(&[route_name, "fallback", reason.as_str()]).inc();
            tracing::info!(request_id = %rid, route = route_name, reason = reason.as_str(), "token reuse fallback");
            ctx.reuse = Some(reason.as_str());
        }
    }
    metrics.stage_duration.with_label_values(&[route_name, "handoff"]).observe(handoff_started.elapsed().as_secs_f64());

    // (3) Decode leg.
    ctx.stage = Some(Stage::DecodeFirstByte);
    let head = match req.head(decode.addr(), &rid, decode_bytes.len()) {
        Ok(h) => h,
        Err(e) => return write_error(session, ctx, &ApiError::Internal(e.to_string())).await,
    };
    let decode_started = Instant::now();
    ctx.decode_sent_at = Some(decode_started);
    let sent = tokio::select! {
        r = tokio::time::timeout(
            route.options().decode_first_byte_timeout(),
            app.client.send(decode.addr(), &head, decode_bytes, || metrics.upstream_retries.with_label_values(&["decode"]).inc()),
        ) => r,
        _ = client_gone(session) => { ctx.outcome = Some(Outcome::ClientClosed); return; }
    };
    let exchange = match sent {
        Err(_) => {
            metrics.upstream_errors.with_label_values(&["decode", "timeout"]).inc();
            let ms = u64::try_from(route.options().decode_first_byte_timeout().as_millis()).unwrap_or(u64::MAX);
            return write_error(session, ctx, &ApiError::DecodeTimeout(ms)).await;
        }
        Ok(Err(e)) => {
            metrics.upstream_errors.with_label_values(&["decode", e.kind()]).inc();
            return write_error(session, ctx, &ApiError::DecodeUnavailable(e.to_string())).await;
        }
        Ok(Ok(exchange)) => exchange,
    };
    ctx.decode_first_byte_ms = Some(decode_started.elapsed().as_secs_f64() * 1000.0);
    metrics
        .stage_duration
        .with_label_values(&[route_name, "decode_first_byte"])
        .observe(decode_started.elapsed().as_secs_f64());

    // (4) Relay back.
    ctx.stage = Some(Stage::DecodeTotal);
    relay(app, session, ctx, exchange, Rewrite { cached_tokens: handoff.cached_tokens }, route_name).await;
    drop(decode);
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
