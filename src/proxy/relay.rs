//! Relay mode, top to bottom: an existing orchestrator sends both legs through tokenonce; a
//! prefill echoes its ids, kept for its decode, which then goes token-in.
//!
//! The ids are cached (or returned inside `kv_transfer_params`). Decisions come from
//! `plan::relay`; this module sends the legs and touches the cache.

use std::time::Instant;

use super::error::ProxyError;
use super::respond::{self, write_engine_answer};
use super::{exec, reuse, verify, ApiRequest, Call};
use crate::app::App;
use crate::handoff::{Evicted, Lookup};
use crate::metrics::Leg;
use crate::openai::prefix::text_keys;
use crate::openai::PromptIds;
use crate::plan::relay::{Found, RelayDecode, RelayPlan, RelayPrefill, Search};
use crate::plan::DecodeVersion;
use crate::routes::PrefillTarget;
use crate::upstream::{self, PromptKey};

/// Runs one request of a relay route.
///
/// # Errors
/// Any [`ProxyError`]; the caller's error exit answers it.
pub async fn handle(call: &mut Call<'_>, req: &ApiRequest<'_>) -> Result<(), ProxyError> {
    let info = call.info;
    // Only an `X-Request-Id` the orchestrator sent correlates the legs (ours is random).
    let client_id = req.incoming.headers.contains_key("x-request-id").then_some(info.request_id.as_str());
    let policy = info.route.policy_now();
    match crate::plan::relay::plan(req.plan_input(), &policy, client_id, &info.request_id) {
        RelayPlan::Prefill(plan) => annotated_prefill(call, req, &plan).await,
        RelayPlan::Decode(plan) => completed_decode(call, req, &plan).await,
    }
}

/// A relayed prefill: asked to echo its ids, which are kept (cache or inline) and hidden from
/// the answer unless the orchestrator asked for them.
async fn annotated_prefill(
    call: &mut Call<'_>,
    req: &ApiRequest<'_>,
    plan: &RelayPrefill<'_, '_>,
) -> Result<(), ProxyError> {
    let (app, route) = (&call.info.app, &call.info.route);
    let pool = match &route.prefill {
        Some(PrefillTarget::Pool(pool)) => pool,
        _ => &route.decode_pool,
    };
    let text = pool.is_cache_aware().then(|| text_keys(&req.obj, req.view.api)).flatten();
    let endpoint = upstream::pick_for(pool, Leg::Prefill, prompt_key(req, text.as_deref()))?;
    let Some(body) = plan.body() else {
        return respond::forward(call, &req.incoming, Leg::Prefill, endpoint, req.incoming.body.clone().into()).await;
    };
    let (head, answer) = exec::prefill_leg(call, &req.incoming, &endpoint, Some(pool), body).await?;
    drop(endpoint);
    if !head.status.is_success() {
        return write_engine_answer(call, &head, answer).await;
    }
    let kept = plan.after_prefill(&answer);
    if let Some(entry) = kept.store {
        let evicted = app.cache.insert(entry.keys, entry.fingerprint, entry.ids, Instant::now());
        record_cache(app, None, evicted);
    }
    if kept.kept {
        call.rec.reuse.log = Some("ids_kept");
    }
    write_engine_answer(call, &head, kept.body.unwrap_or(answer)).await
}

/// A relayed decode: its ids found (inline or in the cache) and sent token-in, else as sent.
async fn completed_decode(
    call: &mut Call<'_>,
    req: &ApiRequest<'_>,
    plan: &RelayDecode<'_, '_>,
) -> Result<(), ProxyError> {
    let info = call.info;
    let (app, route) = (&info.app, &info.route);
    let text = route.decode_pool.is_cache_aware().then(|| text_keys(&req.obj, req.view.api)).flatten();
    let endpoint = upstream::pick_for(&route.decode_pool, Leg::Decode, prompt_key(req, text.as_deref()))?;
    let version = if plan.needs_decode_version(app.cache.is_empty()) {
        exec::decode_version(app, route, endpoint.endpoint()).await
    } else {
        DecodeVersion::NotNeeded
    };
    let found = match plan.search(version) {
        Search::Done(found) => found,
        Search::Cache { keys, fingerprint } => {
            let (lookup, evicted) = app.cache.take(&keys, fingerprint, Instant::now());
            record_cache(app, Some(&lookup), evicted);
            match lookup {
                Lookup::Hit(ids) => Found::Ids(PromptIds::from_ids(&ids)),
                _ => Found::Missing,
            }
        }
    };
    let found = match found {
        Found::Ids(ids) => {
            verify::prompt_ids(info, req, &ids, None, (verify::Echoed::Relayed, None));
            // While the watch holds reuse off, the ids were only checked.
            if route.parity.as_ref().is_some_and(|p| p.reuse_off()) {
                Found::Blocked(crate::openai::FallbackReason::ParityReuseOff)
            } else {
                Found::Ids(ids)
            }
        }
        other => other,
    };
    let (body, reuse, refused) = plan.step(found);
    reuse::record(info, call.rec, reuse, refused.as_ref());
    let body = body.unwrap_or_else(|| req.incoming.body.clone().into());
    respond::forward(call, &req.incoming, Leg::Decode, endpoint, body).await
}

/// What a relayed leg's cache-aware pick knows of its prompt: its text keys, when it has them
/// (the ids of a relayed decode are found only after its endpoint is chosen), unless vLLM
/// hashes it from more than its text (media, prompt embeddings: by load).
fn prompt_key<'t>(req: &ApiRequest<'_>, text: Option<&'t [crate::kv::BlockHash]>) -> PromptKey<'t> {
    match verify::by_load(&crate::openai::HashInputs::of(&req.view, &req.obj)) {
        Some(reason) => PromptKey::ByLoad(reason),
        None => text.map_or(PromptKey::Unknown, PromptKey::Text),
    }
}

/// Counts a cache lookup and evictions, and refreshes the cache gauges.
fn record_cache(app: &App, lookup: Option<&Lookup>, evicted: Evicted) {
    if let Some(l) = lookup {
        app.metrics.id_cache.lookup(l.label());
    }
    let (entries, bytes) = app.cache.stats();
    app.metrics.id_cache.state(evicted.ttl, evicted.capacity, entries, bytes);
}
