//! An orchestrated request, top to bottom: pick the decode, plan, decide whether a prefill
//! pays (`plan::skip`: a decode holding nearly all of the prompt computes it alone), prefill
//! leg, handoff, decode leg, relay.
//!
//! Decisions come from `plan`; sending and waiting from `exec`; the decode's answer from
//! `respond`; what the prompt ids feed besides the legs from `verify`; reuse accounting from
//! `reuse`.

use std::time::Instant;

use bytes::Bytes;
use pingora::http::ResponseHeader;

use super::error::ProxyError;
use super::exec::DecodeLeg;
use super::respond::{self, write_engine_answer};
use super::{exec, reuse, verify, ApiRequest, Call, RequestInfo};
use crate::metrics::{DecisionReason, FollowUp, Leg, PrefillDecision, Stage};
use crate::openai::json::{Pieces, RawObject};
use crate::openai::request::{previous_response_id, stored_response_id};
use crate::openai::response::HandoffError;
use crate::openai::Api;
use crate::plan::skip::{self, SkipFacts};
use crate::plan::{self, prefiller_from_header, DecodeVersion};
use crate::routes::{PrefillTarget, Route};
use crate::upstream::{self, ComputingAlone, Picked, Prompt};

/// Runs one request of an orchestrate route.
///
/// # Errors
/// Any [`ProxyError`]; the caller's error exit answers it.
pub async fn run(call: &mut Call<'_>, req: &ApiRequest<'_>) -> Result<(), ProxyError> {
    let info = call.info;
    let (app, route) = (&info.app, &info.route);
    // The handoff is ours: a client's own kv_transfer_params never reach an engine.
    let cleaned = plan::without_client_handoff(&req.obj, route.client_handoff)?;
    let obj = cleaned.as_ref().unwrap_or(&req.obj);
    // A stored Responses answer is remembered with its endpoint when the pool has a choice
    // (one endpoint needs no affinity, and its body stays the client's).
    let choice = route.decode_pool.endpoints().len() > 1;
    let stored = (req.view.api == Api::Responses && choice).then(|| stored_response_id(obj)).flatten();
    let (stored_id, named) = stored.map_or((None, None), |(id, named)| (Some(id), named));
    let rewritten = named.as_ref().or(cleaned.as_ref());
    let obj = rewritten.unwrap_or(&req.obj);
    // The prompt's own ids when the prefill pool renders locally (a trusted shape's also send
    // the prefill token-in), else its text keys: what the cache-aware picks choose by.
    let keys = verify::PromptKeys::of(info, req).await;
    let decode = pick_decode(info, req.view.api, obj, keys.decode())?;
    let home = decode.name().to_owned();
    let result = orchestrate(call, req, (obj, rewritten.is_some()), decode, &keys).await;
    if let (Some(id), Ok(())) = (stored_id, &result) {
        if (200..300).contains(&call.rec.answer.status) {
            app.homes.remember(&id, &home);
        }
    }
    result
}

/// The decode endpoint: for a Responses follow-up, the one that stored the answer it names
/// (counted either way), else the pool's choice (by what is known of the `prompt`).
fn pick_decode(info: &RequestInfo, api: Api, obj: &RawObject<'_>, prompt: Prompt<'_>) -> Result<Picked, ProxyError> {
    let pool = &info.route.decode_pool;
    if let Some(previous) = (api == Api::Responses).then(|| previous_response_id(obj)).flatten() {
        let home = info.app.homes.home(previous).and_then(|name| pool.pick_named(&name));
        info.app.metrics.upstream.response_followup(if home.is_some() { FollowUp::Home } else { FollowUp::Unknown });
        if let Some(home) = home {
            return Ok(home);
        }
    }
    Ok(upstream::pick_for(pool, Leg::Decode, prompt)?)
}

/// [`run`] once the body (`obj`, `rewritten` when it differs from the client's), the decode
/// endpoint and what is known of the prompt (`keys`) are set.
async fn orchestrate(
    call: &mut Call<'_>,
    req: &ApiRequest<'_>,
    (obj, rewritten): (&RawObject<'_>, bool),
    decode: Picked,
    keys: &verify::PromptKeys,
) -> Result<(), ProxyError> {
    let info = call.info;
    let (app, route) = (&info.app, &info.route);
    // Header mode names its prefiller per request; without the header the picker chose
    // decode-only: send it as is.
    let named = match &route.prefill {
        Some(PrefillTarget::Header(rule)) => match prefiller_from_header(req.incoming.headers, rule, info.client_ip)? {
            Some(n) => Some(Prefiller { endpoint: upstream::named_endpoint(n.addr, n.tls), named: true }),
            None => {
                let body = if rewritten {
                    obj.to_pieces(Some(req.incoming.body), None, None)
                } else {
                    req.incoming.body.clone().into()
                };
                return respond::forward(call, &req.incoming, Leg::Decode, decode, body).await;
            }
        },
        _ => None,
    };
    let policy = route.policy_now();
    let version = if plan::needs_decode_version(&req.view, &policy, &info.request_id) {
        exec::decode_version(app, route, decode.endpoint()).await
    } else {
        DecodeVersion::NotNeeded
    };
    let plan = plan::orchestrate(
        plan::Request { obj, view: &req.view, source: Some(req.incoming.body) },
        &policy,
        version,
        &info.request_id,
    );
    let plan = verify::token_in(info, plan, keys.local.as_ref());
    if let Some(step) = plan.decode_only() {
        reuse::record(info, call.rec, step.reuse, None);
        return respond::decode(call, &req.incoming, &decode, step).await;
    }
    let (prefiller, decode) = match named {
        Some(named) => (named, decode),
        None => {
            // A pool prefill: none at all when the decode holds nearly all of the prompt.
            let Some(decode) = decode_alone_unless_lacking(call, req, decode, &plan, keys).await? else {
                return Ok(());
            };
            (pool_prefiller(route, keys.prefill())?, decode)
        }
    };

    let prefilled = guarded_prefill(call, &req.incoming, &prefiller, plan.prefill_body.clone()).await;
    drop(prefiller);

    let handoff_started = Instant::now();
    let handoff = call.rec.trace.handoff();
    let mut step = match exec::after_prefill(info, &plan, prefilled)? {
        exec::Prefilled::Step(step) => step,
        // The prefill's own error (e.g. vLLM's 400 for a too-long prompt) goes back unchanged.
        exec::Prefilled::EngineAnswer(head, answer) => return write_engine_answer(call, &head, answer).await,
    };
    reuse::record(info, call.rec, step.reuse, step.refused.as_ref());
    if let Some(ids) = step.ids.take() {
        let by = if plan.local_ids() { verify::Echoed::Local } else { verify::Echoed::Engine };
        verify::prompt_ids(info, req, &ids, step.prompt_tokens, (by, keys.local.as_ref()));
    }
    route.metrics.stage(Stage::Handoff, handoff_started.elapsed());
    drop(handoff);

    respond::decode(call, &req.incoming, &decode, step).await
}

/// Where the prefill leg goes.
struct Prefiller {
    endpoint: Picked,
    /// Named by a request header, not taken from a configured pool: less trusted.
    named: bool,
}

/// The prefiller of a route with a prefill pool: one of its endpoints, by what is known of
/// the `prompt`.
fn pool_prefiller(route: &Route, prompt: Prompt<'_>) -> Result<Prefiller, ProxyError> {
    match &route.prefill {
        Some(PrefillTarget::Pool(pool)) => {
            Ok(Prefiller { endpoint: upstream::pick_for(pool, Leg::Prefill, prompt)?, named: false })
        }
        _ => Err(ProxyError::NoEndpoint(Leg::Prefill)),
    }
}

/// The prefill decision of a pool-prefill request ([`skip::decide`]), counted and noted on
/// its span: the decode alone, token-in, when the chosen `decode` lacks at most the route's
/// `prefill.skip_below_tokens` of the prompt by its KV events. `Ok(None)`: the decode alone
/// answered (or failed past retrying). `Ok(Some(decode))`: the request goes P/D to that
/// decode: the chosen one, or, when the decode alone failed before its answer began,
/// another of its pool (never the same engine twice; with none, the failure is answered).
async fn decode_alone_unless_lacking(
    call: &mut Call<'_>,
    req: &ApiRequest<'_>,
    decode: Picked,
    plan: &plan::Orchestration<'_, '_>,
    keys: &verify::PromptKeys,
) -> Result<Option<Picked>, ProxyError> {
    let info = call.info;
    let route = &info.route;
    let threshold = route.skip_prefill_below;
    let chain = keys.local.as_ref().and_then(|l| l.chains.decode.as_deref());
    let held = chain.filter(|_| threshold > 0).and_then(|c| route.decode_pool.tokens_held_by_events(decode.name(), c));
    let decided = skip::decide(SkipFacts {
        threshold,
        prompt_tokens: plan.decode_alone_tokens(),
        held_tokens: held,
        computing_alone: decode.endpoint().computing_alone_tokens(),
        engine_waiting: route.decode_pool.engine_pressure(decode.endpoint()).map(|p| p.waiting),
    });
    route.metrics.prefill_decision(decided.decision, decided.reason);
    call.rec.trace.attribute("tokenonce.prefill.decision", decided.decision.as_str());
    call.rec.trace.attribute("tokenonce.prefill.reason", decided.reason.as_str());
    if let Some(lacking) = decided.lacking {
        route.metrics.decode_lacking(lacking);
        call.rec.trace.attribute("tokenonce.prefill.decode_lacking_tokens", i64::try_from(lacking).unwrap_or(i64::MAX));
    }
    let step = match (decided.decision, plan.decode_token_in()) {
        (PrefillDecision::DecodeAlone, Some(step)) => step,
        _ => return Ok(Some(decode)),
    };
    reuse::record(info, call.rec, step.reuse, None);
    call.rec.legs.computing_alone = Some(ComputingAlone::new(decode.endpoint(), decided.lacking.unwrap_or(0)));
    let leg = DecodeLeg { req: &req.incoming, endpoint: &decode, step };
    let (sent, delivered) = leg.send(call).await;
    let failed_before_answer = match &sent {
        Ok(exchange) => exchange.status() >= 500,
        Err(e) => matches!(e, ProxyError::Upstream { .. } | ProxyError::Timeout { .. }),
    };
    let other = failed_before_answer
        .then(|| route.decode_pool.pick_for(Instant::now(), &[decode.name()], keys.decode()))
        .flatten()
        .filter(|other| other.name() != decode.name()); // the pool's only endpoint comes back
    let Some(other) = other else {
        return respond::decode_sent(call, &leg, sent, delivered).await.map(|()| None);
    };
    let error = match &sent {
        Ok(exchange) => format!("answered {}", exchange.status()),
        Err(e) => e.to_string(),
    };
    reuse::settle(info, call.rec, sent.as_ref().ok().map(upstream::Exchange::status));
    call.rec.legs.computing_alone = None;
    call.rec.trace.leg_done(Leg::Decode);
    drop(sent);
    route.metrics.prefill_decision(PrefillDecision::Prefill, DecisionReason::DecodeAloneFailed);
    call.rec.trace.attribute("tokenonce.prefill.reason", DecisionReason::DecodeAloneFailed.as_str());
    tracing::info!(request_id = %info.request_id, route = %route.name, error = %error, "the decode alone failed before answering: retried with a prefill on another decode");
    Ok(Some(other))
}

/// Largest error body relayed from a header-named prefiller.
const NAMED_PREFILLER_ERROR_LIMIT: usize = 64 * 1024;

/// The prefill leg ([`exec::prefill_leg`]) under the trust rules of its prefiller: a
/// header-named one gets no client credentials unless the route says so, its connect failures
/// all read alike (no probing of ports and hosts through tokenonce), and its error bodies are
/// relayed only up to a bound.
async fn guarded_prefill(
    call: &mut Call<'_>,
    req: &exec::Incoming<'_>,
    prefiller: &Prefiller,
    body: Pieces,
) -> Result<(ResponseHeader, Bytes), ProxyError> {
    let route = &call.info.route;
    if !prefiller.named {
        let pool = match &route.prefill {
            Some(PrefillTarget::Pool(pool)) => Some(pool.as_ref()),
            _ => None,
        };
        return exec::prefill_leg(call, req, &prefiller.endpoint, pool, body).await;
    }
    let forward = matches!(&route.prefill, Some(PrefillTarget::Header(rule)) if rule.forward_credentials);
    let req = exec::Incoming { drop_credentials: !forward, ..*req };
    let (head, answer) =
        exec::prefill_leg(call, &req, &prefiller.endpoint, None, body).await.map_err(ProxyError::uniform_connect)?;
    if !head.status.is_success() && answer.len() > NAMED_PREFILLER_ERROR_LIMIT {
        return Err(HandoffError(format!("error answer over {NAMED_PREFILLER_ERROR_LIMIT} bytes")).into());
    }
    Ok((head, answer))
}
