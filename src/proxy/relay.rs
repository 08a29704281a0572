//! Relay mode: an existing orchestrator sends both legs through tokenonce. A prefill
//! (`kv_transfer_params.do_remote_decode`) is asked to echo its prompt ids, which are cached
//! (or returned inside `kv_transfer_params`, stateless); a later decode finds them by
//! correlation key and goes token-in. Anything else passes through unchanged.

use std::time::Instant;

use bytes::Bytes;
use pingora::proxy::Session;

use super::pd::{chat_version_blocker, forward, prefill_leg, Incoming};
use super::respond::{client_head, write_buffered, write_error};
use super::Ctx;
use crate::config::{PrefillSource, RelayHandoff, RouteSpec};
use crate::handoff::{prompt_fingerprint, CacheKey, Evicted, Lookup};
use crate::openai::json::is_null;
use crate::openai::request::kv_params_with_ids;
use crate::openai::response::{extract_handoff, hide_token_ids};
use crate::openai::{Api, ApiError, FallbackReason, PromptIds, RawObject, RequestView};
use crate::App;

/// What the request's `kv_transfer_params` say it is.
struct KvFacts {
    /// `do_remote_decode: true`: a prefill leg.
    is_prefill: bool,
    /// Carries a prefill's handoff (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`).
    looks_like_decode: bool,
    /// `remote_request_id`, the prefill engine's own id.
    remote_request_id: Option<String>,
    /// `prompt_token_ids` already inside (stateless handoff), raw.
    ids_raw: Option<String>,
}

fn kv_facts(obj: &RawObject<'_>) -> KvFacts {
    let kv = obj.get("kv_transfer_params").filter(|raw| !is_null(Some(raw))).and_then(|raw| RawObject::parse(raw).ok());
    let Some(kv) = kv else {
        return KvFacts { is_prefill: false, looks_like_decode: false, remote_request_id: None, ids_raw: None };
    };
    let flag = |k: &str| kv.get(k).is_some_and(|v| v.trim() == "true");
    let remote_request_id = kv.get_as::<String>("remote_request_id").and_then(Result::ok);
    KvFacts {
        is_prefill: flag("do_remote_decode"),
        looks_like_decode: flag("do_remote_prefill")
            || kv.has_non_null("remote_engine_id")
            || remote_request_id.is_some(),
        remote_request_id,
        ids_raw: kv.get("prompt_token_ids").filter(|v| !is_null(Some(v))).map(str::to_owned),
    }
}

fn keys(facts: &KvFacts, request_id: Option<&str>, fingerprint: u64) -> Vec<CacheKey> {
    let mut keys = Vec::with_capacity(3);
    if let Some(r) = &facts.remote_request_id {
        keys.push(CacheKey::RemoteRequestId(r.clone()));
    }
    if let Some(id) = request_id {
        keys.push(CacheKey::RequestId(id.to_owned()));
    }
    keys.push(CacheKey::Fingerprint(fingerprint));
    keys
}

fn record_cache(app: &App, lookup: Option<&Lookup>, evicted: Evicted) {
    let m = &app.metrics;
    if let Some(l) = lookup {
        m.cache_lookups.with_label_values(&[l.as_str()]).inc();
    }
    if evicted.ttl > 0 {
        m.cache_evictions.with_label_values(&["ttl"]).inc_by(evicted.ttl);
    }
    if evicted.capacity > 0 {
        m.cache_evictions.with_label_values(&["capacity"]).inc_by(evicted.capacity);
    }
    let (entries, bytes) = app.cache.stats();
    m.cache_entries.set(entries as i64);
    m.cache_bytes.set(bytes as i64);
}

/// Drops expired cache entries and refreshes the cache gauges (scrapes and the poller call it).
pub fn sweep_cache(app: &App) {
    let evicted = app.cache.purge(Instant::now());
    record_cache(app, None, evicted);
}

/// Runs one request of a relay route.
pub async fn handle(
    app: &App,
    session: &mut Session,
    ctx: &mut Ctx,
    route: &RouteSpec,
    obj: &RawObject<'_>,
    view: &RequestView,
    req: &Incoming<'_>,
) {
    let leg = Leg { route, obj, view, req, facts: kv_facts(obj) };
    if leg.facts.is_prefill {
        prefill(app, session, ctx, &leg).await;
    } else {
        decode(app, session, ctx, &leg).await;
    }
}

/// One relayed request, read once.
struct Leg<'r, 'a> {
    route: &'r RouteSpec,
    obj: &'r RawObject<'a>,
    view: &'r RequestView,
    req: &'r Incoming<'a>,
    facts: KvFacts,
}

async fn prefill(app: &App, session: &mut Session, ctx: &mut Ctx, leg: &Leg<'_, '_>) {
    let Leg { route, obj, view, req, ref facts } = *leg;
    let pool = match route.prefill() {
        Some(PrefillSource::Pool(i)) => *i,
        _ => route.decode_pool(),
    };
    let Some(endpoint) = app.pools.get(pool).and_then(|p| p.pick()) else {
        return write_error(session, ctx, &ApiError::PrefillUnavailable("prefill pool is empty".into())).await;
    };
    let eligible = route.options().token_reuse() && view.reuse_blocker().is_none() && !view.stream;
    if !eligible {
        return forward(app, session, ctx, endpoint, req, route.name()).await;
    }
    let mut body = obj.clone();
    if !view.return_token_ids {
        body.set_raw("return_token_ids", "true");
    }
    let answer = prefill_leg(app, session, ctx, route, endpoint.addr(), req, Bytes::from(body.to_bytes())).await;
    drop(endpoint);
    let Some((upstream_head, response)) = answer else { return };
    let Some(head) = client_head(&upstream_head, ctx.request_id.as_deref()) else {
        return write_error(session, ctx, &ApiError::PrefillBadResponse("no response header".into())).await;
    };
    let status = head.status.as_u16();
    if !(200..300).contains(&status) {
        return write_buffered(session, ctx, head, response).await;
    }
    let Ok(text) = std::str::from_utf8(&response) else { return write_buffered(session, ctx, head, response).await };
    let handoff = extract_handoff(view.api, &response);
    let ids = handoff.as_ref().ok().and_then(|h| h.ids.as_ref().ok());
    let mut out: Option<Vec<u8>> = None;
    if let (Some(ids), Ok(handoff)) = (ids, &handoff) {
        match route.options().relay_handoff() {
            RelayHandoff::Cache => {
                // The prefill's own engine id, from its response, is the best key.
                let remote = handoff
                    .kv_transfer_params
                    .as_deref()
                    .and_then(|kv| RawObject::parse(kv).ok())
                    .and_then(|kv| kv.get_as::<String>("remote_request_id").and_then(Result::ok));
                let fingerprint = prompt_fingerprint(obj);
                let mut keys = keys(
                    facts,
                    ctx.request_id.as_deref().filter(|_| req.headers.contains_key("x-request-id")),
                    fingerprint,
                );
                if let Some(r) = remote {
                    keys.insert(0, CacheKey::RemoteRequestId(r));
                }
                let evicted = app.cache.insert(keys, fingerprint, ids.to_vec(), Instant::now());
                record_cache(app, None, evicted);
            }
            RelayHandoff::Stateless => {
                let kv = kv_params_with_ids(handoff.kv_transfer_params.as_deref(), ids);
                if let Ok(mut top) = RawObject::parse(text) {
                    top.set_raw("kv_transfer_params", kv);
                    out = Some(top.to_bytes());
                }
            }
        }
        ctx.reuse = Some("ids_kept");
    }
    if !view.return_token_ids {
        let current = out.as_deref().and_then(|b| std::str::from_utf8(b).ok()).unwrap_or(text);
        if let Some(hidden) = hide_token_ids(view.api, current) {
            out = Some(hidden);
        }
    }
    let body = out.map_or(response.clone(), Bytes::from);
    write_buffered(session, ctx, head, body).await;
}

async fn decode(app: &App, session: &mut Session, ctx: &mut Ctx, leg: &Leg<'_, '_>) {
    let Leg { route, obj, view, req, ref facts } = *leg;
    let Some(endpoint) = app.pools.get(route.decode_pool()).and_then(|p| p.pick()) else {
        return write_error(session, ctx, &ApiError::DecodeUnavailable("decode pool is empty".into())).await;
    };
    let route_name = route.name();
    let mut blocker = if route.options().token_reuse() { view.reuse_blocker() } else { Some(FallbackReason::Disabled) };
    if blocker.is_none()
        && view.api == Api::Chat
        && (facts.looks_like_decode || facts.ids_raw.is_some() || !app.cache.is_empty())
    {
        blocker = chat_version_blocker(app, route, endpoint.endpoint()).await;
    }

    // Find the ids: already inside (stateless) or in the cache.
    let (ids, miss_is_fallback): (Option<PromptIds>, bool) = match (&facts.ids_raw, blocker) {
        (Some(raw), None) => match PromptIds::parse(raw, None) {
            Ok(ids) => (Some(ids), true),
            Err(e) => {
                tracing::info!(request_id = ctx.request_id.as_deref().unwrap_or("-"), error = %e, "relayed ids refused");
                blocker = Some(FallbackReason::IdsMalformed);
                (None, true)
            }
        },
        (None, None) => {
            // Only a cache lookup needs the fingerprint (a full parse of the prompt fields).
            let fingerprint = prompt_fingerprint(obj);
            let keys = keys(
                facts,
                ctx.request_id.as_deref().filter(|_| req.headers.contains_key("x-request-id")),
                fingerprint,
            );
            let (lookup, evicted) = app.cache.take(&keys, fingerprint, Instant::now());
            record_cache(app, Some(&lookup), evicted);
            match lookup {
                Lookup::Hit(ids) => (Some(PromptIds::from_ids(&ids)), true),
                _ => (None, facts.looks_like_decode),
            }
        }
        (_, Some(_)) => (None, facts.looks_like_decode || facts.ids_raw.is_some()),
    };

    // Rewrite: chat ids into kv_transfer_params, completions ids as the prompt; a blocked
    // request carrying ids has them removed (vLLM 0.27-0.31 would use them unchecked).
    let mut body = obj.clone();
    let kv_raw = obj.get("kv_transfer_params").filter(|raw| !is_null(Some(raw)));
    let without_ids = |kv: &str| -> Option<String> {
        let mut kv = RawObject::parse(kv).ok()?;
        kv.remove("prompt_token_ids");
        String::from_utf8(kv.to_bytes()).ok()
    };
    match (&ids, view.api) {
        (Some(ids), Api::Chat) => {
            let merged = kv_params_with_ids(kv_raw, ids);
            body.set_raw("kv_transfer_params", merged);
        }
        (Some(ids), Api::Completions) => {
            body.set_raw("prompt", ids.as_json().to_owned());
            if let Some(kv) = kv_raw.filter(|_| facts.ids_raw.is_some()).and_then(without_ids) {
                body.set_raw("kv_transfer_params", kv);
            }
        }
        (None, _) => {
            if let Some(kv) = kv_raw.filter(|_| facts.ids_raw.is_some()).and_then(without_ids) {
                body.set_raw("kv_transfer_params", kv);
            }
        }
    }
    let m = &app.metrics;
    match (&ids, blocker) {
        (Some(ids), _) => {
            m.token_reuse.with_label_values(&[route_name, "applied", "none"]).inc();
            m.reused_prompt_tokens.with_label_values(&[route_name]).inc_by(ids.len() as u64);
            m.relayed_id_bytes.inc_by(ids.as_json().len() as u64);
            ctx.reuse = Some("applied");
        }
        (None, reason) if miss_is_fallback => {
            let reason = reason.unwrap_or(FallbackReason::CacheMiss);
            m.token_reuse.with_label_values(&[route_name, "fallback", reason.as_str()]).inc();
            tracing::info!(
                request_id = ctx.request_id.as_deref().unwrap_or("-"),
                route = route_name,
                reason = reason.as_str(),
                "token reuse fallback"
            );
            ctx.reuse = Some(reason.as_str());
        }
        (None, _) => {}
    }
    let changed = ids.is_some() || facts.ids_raw.is_some();
    let bytes = if changed { Bytes::from(body.to_bytes()) } else { req.body.clone() };
    let incoming = Incoming { body: &bytes, ..*req };
    ctx.stage = Some(crate::metrics::Stage::DecodeFirstByte);
    forward(app, session, ctx, endpoint, &incoming, route_name).await;
}
