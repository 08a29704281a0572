//! The request plan: every decision about an API request that can be made without I/O, from
//! the request, the route's policy and what is known of the engines. Which legs run, the
//! prefill body, the reuse gate and, given the prefill's answer, the decode body and the reuse
//! outcome. Orchestrate and relay both plan here; `proxy/` only sends what a plan says.
//!
//! - `mod.rs`: the policy and engine facts, the reuse gate, the orchestrated plan.
//! - `relay.rs`: relay-mode plans (a prefill to annotate, a decode to complete).
//! - `prefiller.rs`: the `x-prefiller-host-port` check.

mod prefiller;
pub mod relay;
pub mod skip;
#[cfg(test)]
mod tests;

use bytes::Bytes;

pub use prefiller::{prefiller_from_header, AllowedPrefiller, HeaderRule, NamedPrefiller};

pub use crate::config::ClientHandoff;
use crate::config::{RelayHandoff, ReuseShare, Version};
use crate::openai::json::Pieces;
use crate::openai::request::{decode_body, prefill_body, prefill_body_token_in};
use crate::openai::response::{extract_handoff_shared, HandoffError, IdsFault};
use crate::openai::{Api, ApiError, FallbackReason, IdsError, PromptIds, RawObject, RequestView};

/// A route's knobs that decide reuse, copied from its config once, and the route's state
/// that the request path copies in per request (`hold_ids`, `models_differ`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReusePolicy {
    /// Reuse the prefill's prompt ids on the decode: on, off, or for a share of requests.
    pub token_reuse: ReuseShare,
    /// Relay mode: where the ids wait between the legs.
    pub relay_handoff: RelayHandoff,
    /// Ids must be below this (the route's tokenizer's vocabulary, added tokens included).
    pub vocab: Option<u32>,
    /// The parity watch holds reuse off: ask for the ids (to check them) but decode as text.
    pub hold_ids: bool,
    /// The prefill and decode pools report different models: never exchange ids.
    pub models_differ: bool,
}

impl ReusePolicy {
    /// A route's config knobs; the runtime flags off.
    pub const fn new(token_reuse: ReuseShare, relay_handoff: RelayHandoff, vocab: Option<u32>) -> Self {
        Self { token_reuse, relay_handoff, vocab, hold_ids: false, models_differ: false }
    }
}

/// Body fields that steer the P/D handoff (vLLM reads them as the engine's transfer
/// instructions: ids to decode, which host to pull KV blocks from). On orchestrate routes
/// they belong to tokenonce, never to the client.
pub const HANDOFF_FIELDS: &[&str] = &["kv_transfer_params", "ec_transfer_params"];

/// `vllm_xargs` is merged into the same engine dict the transfer params live in, so the
/// same keys inside it steer the handoff too.
const XARGS: &str = "vllm_xargs";

/// The client body without handoff fields (`Ok(None)`: it had none), or a 400 when the
/// route refuses them.
///
/// # Errors
/// [`ApiError::InvalidRequest`] naming the field, under [`ClientHandoff::Reject`].
pub fn without_client_handoff<'a>(
    obj: &RawObject<'a>,
    policy: ClientHandoff,
) -> Result<Option<RawObject<'a>>, ApiError> {
    let top = HANDOFF_FIELDS.iter().copied().find(|f| obj.get(f).is_some());
    let xargs = obj
        .get(XARGS)
        .and_then(|raw| RawObject::parse(raw).ok())
        .filter(|x| HANDOFF_FIELDS.iter().any(|f| x.get(f).is_some()));
    if top.is_none() && xargs.is_none() {
        return Ok(None);
    }
    if policy == ClientHandoff::Reject {
        let param = top.unwrap_or(XARGS);
        return Err(ApiError::invalid(
            format!("`{param}` is set by tokenonce on this route, not by clients"),
            Some(param),
        ));
    }
    let mut clean = obj.clone();
    for field in HANDOFF_FIELDS {
        clean.remove(field);
    }
    if let Some(mut xargs) = xargs {
        for field in HANDOFF_FIELDS {
            xargs.remove(field);
        }
        // Valid UTF-8 by construction: every piece came from `&str`s.
        clean.set_raw(XARGS, String::from_utf8(xargs.to_bytes()).unwrap_or_else(|_| "{}".into()));
    }
    Ok(Some(clean))
}

/// What tokenonce knows of the decode engine's vLLM version when planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeVersion {
    /// Pinned in config or learned from `GET /version`.
    Known(Version),
    /// Asked, but no usable answer.
    Unknown,
    /// Not asked: the plan said the version does not decide this request
    /// ([`needs_decode_version`], [`relay::RelayDecode::needs_decode_version`]), so no version
    /// gate applies. Only a caller that skipped a check the plan needed hands it to a gate
    /// that does apply; the orchestrated gate then falls back, to be safe.
    NotNeeded,
}

/// The client request as the plan reads it: the parsed body and its view.
#[derive(Clone, Copy)]
pub struct Request<'r, 'a> {
    /// The body's members, raw.
    pub obj: &'r RawObject<'a>,
    /// The buffer the body arrived in (its large values go to the legs uncopied).
    pub source: Option<&'r Bytes>,
    /// The fields that decide reuse.
    pub view: &'r RequestView,
}

/// Whether the decode may go token-in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Ask the prefill for its ids and hand them on.
    Reuse,
    /// Send the text decode, counted with this reason.
    Fallback(FallbackReason),
}

/// How a decode was sent, for metrics and the access log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Token-in, with `tokens` ids in `id_bytes` of JSON.
    Applied {
        /// Ids handed to the decode.
        tokens: usize,
        /// Their JSON size.
        id_bytes: usize,
    },
    /// Text decode, for this reason.
    Fallback(FallbackReason),
    /// Not a P/D decode at all (a plain request on a relay route): nothing to count.
    NotCounted,
}

impl Reuse {
    /// The access-log value: `applied`, the fallback reason, or `None`.
    pub fn log_value(self) -> Option<&'static str> {
        match self {
            Self::Applied { .. } => Some("applied"),
            Self::Fallback(reason) => Some(reason.as_str()),
            Self::NotCounted => None,
        }
    }

    fn of(ids: Option<&PromptIds>, fallback: FallbackReason) -> Self {
        match ids {
            Some(ids) => Self::Applied { tokens: ids.len(), id_bytes: ids.json_len() },
            None => Self::Fallback(fallback),
        }
    }
}

/// The decode leg, fully decided.
#[derive(Debug, Clone)]
pub struct DecodeStep {
    /// The body to send.
    pub body: Pieces,
    /// Token-in or text, and why.
    pub reuse: Reuse,
    /// Set `usage.prompt_tokens_details.cached_tokens` in the answer to this (the prefill's).
    pub cached_tokens: Option<u64>,
    /// Why the prefill's ids were refused, for the log.
    pub refused: Option<IdsError>,
    /// The prefill's valid ids (sent, or held back by the parity watch), for a parity sample.
    pub ids: Option<PromptIds>,
    /// The prefill's `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// The prefill answered `kv_transfer_params`: it holds the prompt's KV blocks until this
    /// decode pulls them (or its KV lease ends).
    pub holds_kv: bool,
    /// The request's API (the release leg's limit and echo fields).
    pub api: Api,
}

impl DecodeStep {
    /// The release leg for a client gone before this decode started answering: the same
    /// decode for one token, not streamed, answer discarded, so the decode engine pulls the
    /// prefill's KV blocks and the prefill frees them now. `None` when the prefill holds none.
    pub fn release_body(&self) -> Option<Bytes> {
        if !self.holds_kv {
            return None;
        }
        crate::openai::request::release_body(&self.body.to_bytes(), self.api).map(Bytes::from)
    }
}

/// Why this request may not reuse ids whatever the engines say. `canary_key` places the
/// request in or out of a fractional `token_reuse` share ([`ReuseShare::admits`]).
fn request_gate(view: &RequestView, policy: &ReusePolicy, canary_key: &str) -> Option<FallbackReason> {
    if policy.token_reuse.is_off() {
        return Some(FallbackReason::Disabled);
    }
    view.reuse_blocker()
        .or(policy.models_differ.then_some(FallbackReason::ModelMismatch))
        .or_else(|| (!policy.token_reuse.admits(canary_key)).then_some(FallbackReason::Canary))
}

/// The gate on the decode's version: chat ids in `kv_transfer_params` need vLLM 0.27,
/// Responses ids 0.32 ([`Version::RESPONSES_TOKEN_REUSE`]).
fn version_gate(api: Api, version: DecodeVersion) -> Option<FallbackReason> {
    let first = if api == Api::Responses { Version::RESPONSES_TOKEN_REUSE } else { Version::CHAT_TOKEN_REUSE };
    match version {
        DecodeVersion::Known(v) if v >= first => None,
        DecodeVersion::Known(_) => Some(FallbackReason::DecodeVersionOld),
        // NotNeeded here means the caller skipped a check the plan needed: be safe.
        DecodeVersion::Unknown | DecodeVersion::NotNeeded => Some(FallbackReason::DecodeVersionUnknown),
    }
}

/// True when an orchestrated request's gate depends on the decode's version (chat or
/// Responses, with nothing else already blocking reuse): only then is it worth asking
/// `GET /version`.
pub fn needs_decode_version(view: &RequestView, policy: &ReusePolicy, canary_key: &str) -> bool {
    view.api != Api::Completions
        && !view.stateful
        && !view.rewrite_hides_refusal
        && request_gate(view, policy, canary_key).is_none()
}

/// The reuse gate of an orchestrated request. Completions go token-in on every vLLM version
/// (`prompt: [ids]`); chat needs a decode of 0.27 or later, Responses 0.32.
pub fn gate(view: &RequestView, policy: &ReusePolicy, decode: DecodeVersion, canary_key: &str) -> Gate {
    if view.stateful {
        return Gate::Fallback(FallbackReason::Stateful);
    }
    if view.rewrite_hides_refusal {
        return Gate::Fallback(FallbackReason::VllmRefuses);
    }
    let blocker = match request_gate(view, policy, canary_key) {
        Some(reason) => Some(reason),
        None if view.api == Api::Completions => None,
        None => version_gate(view.api, decode),
    };
    blocker.map_or(Gate::Reuse, Gate::Fallback)
}

/// An orchestrated request, planned: the prefill body to send, and what to do with its answer.
pub struct Orchestration<'r, 'a> {
    request: Request<'r, 'a>,
    policy: ReusePolicy,
    /// The reuse gate, decided before the prefill.
    pub gate: Gate,
    /// The prefill leg's body.
    pub prefill_body: Pieces,
    /// tokenonce's own ids for the prompt, sent to the prefill and the decode.
    local: Option<PromptIds>,
}

/// Plans an orchestrated request (prefill, then decode). `canary_key` is the request's id
/// (a fractional `token_reuse` admits by its hash).
pub fn orchestrate<'r, 'a>(
    request: Request<'r, 'a>,
    policy: &ReusePolicy,
    decode: DecodeVersion,
    canary_key: &str,
) -> Orchestration<'r, 'a> {
    let gate = gate(request.view, policy, decode, canary_key);
    let api = request.view.api;
    let prefill_body = prefill_body(request.obj, request.source, api, gate == Gate::Reuse);
    Orchestration { request, policy: *policy, gate, prefill_body, local: None }
}

impl Orchestration<'_, '_> {
    /// With tokenonce's own `ids` for the prompt (`local_ids = "on"`, a trusted shape): when
    /// the gate allows reuse on chat or completions, the prefill goes token-in without the
    /// echo and the decode gets the same ids; otherwise nothing changes.
    #[must_use]
    pub fn with_local_ids(mut self, ids: PromptIds) -> Self {
        let api = self.request.view.api;
        if self.gate == Gate::Reuse && matches!(api, Api::Chat | Api::Completions) {
            self.prefill_body = prefill_body_token_in(self.request.obj, self.request.source, api, &ids);
            self.local = Some(ids);
        }
        self
    }

    /// True when the prefill goes token-in with tokenonce's ids.
    pub fn local_ids(&self) -> bool {
        self.local.is_some()
    }

    /// The prompt's token count when the decode may take it token-in with tokenonce's ids
    /// and no prefill behind it ([`decode_token_in`](Self::decode_token_in)).
    pub fn decode_alone_tokens(&self) -> Option<u64> {
        let ids = self.local.as_ref().filter(|_| !self.policy.hold_ids)?;
        u64::try_from(ids.len()).ok()
    }

    /// The decode leg alone with tokenonce's ids, no prefill behind it (the prefill decision
    /// found the decode holding nearly all of the prompt): no `kv_transfer_params` but the
    /// ids, so a decode running a KV connector computes the prompt itself. `None` without
    /// local ids, or while the parity watch holds reuse off.
    pub fn decode_token_in(&self) -> Option<DecodeStep> {
        let ids = self.local.as_ref().filter(|_| !self.policy.hold_ids)?;
        let api = self.request.view.api;
        Some(DecodeStep {
            body: decode_body(self.request.obj, self.request.source, api, None, Some(ids)),
            reuse: Reuse::of(Some(ids), FallbackReason::ParityReuseOff),
            cached_tokens: None,
            refused: None,
            ids: None,
            prompt_tokens: None,
            holds_kv: false,
            api,
        })
    }

    /// The decode leg alone, decided before any prefill: a Responses request that needs the
    /// decode's response store (`previous_response_id`, `conversation`, `background`). The
    /// prefill engine does not hold the earlier answers (its legs are `store: false`, and a
    /// stored id lives on the engine that decoded it), so a prefill leg would fail with 404.
    ///
    /// Also a request vLLM refuses for a field the prefill leg rewrites
    /// ([`RequestView::rewrite_hides_refusal`]): the prefill would take it, and hold its KV
    /// for a decode that refuses it; the decode alone refuses it in vLLM's words.
    pub fn decode_only(&self) -> Option<DecodeStep> {
        match self.gate {
            Gate::Fallback(reason @ (FallbackReason::Stateful | FallbackReason::VllmRefuses)) => {
                Some(self.text_decode(reason))
            }
            _ => None,
        }
    }

    /// The decode leg alone, after a failed prefill (`on_prefill_failure = "decode_alone"`):
    /// the client's body (its own handoff fields already removed), the text path, no KV
    /// handoff, counted as a `prefill_failed` fallback.
    pub fn decode_alone(&self) -> DecodeStep {
        self.text_decode(FallbackReason::PrefillFailed)
    }

    /// The client's body as the decode, no prefill behind it, counted as `reason`.
    fn text_decode(&self, reason: FallbackReason) -> DecodeStep {
        DecodeStep {
            body: self.request.obj.to_pieces(self.request.source, None, None),
            reuse: Reuse::Fallback(reason),
            cached_tokens: None,
            refused: None,
            ids: None,
            prompt_tokens: None,
            holds_kv: false,
            api: self.request.view.api,
        }
    }

    /// The decode leg, given the prefill's 2xx answer: its `kv_transfer_params`, its ids when
    /// the gate allowed reuse and they validate (below the vocabulary, when the route has a
    /// tokenizer) and the parity watch does not hold them, else the text decode with the reason.
    ///
    /// # Errors
    /// [`HandoffError`] when the answer is not a completion response.
    pub fn after_prefill(&self, answer: &Bytes) -> Result<DecodeStep, HandoffError> {
        let api = self.request.view.api;
        let handoff = extract_handoff_shared(api, answer, self.policy.vocab)?;
        let (ids, fallback, refused) = match (self.gate, handoff.ids) {
            (Gate::Fallback(reason), _) => (None, reason, None),
            // The prefill was sent tokenonce's ids and echoed none.
            (Gate::Reuse, _) if self.local.is_some() => (self.local.clone(), FallbackReason::ParityReuseOff, None),
            (Gate::Reuse, Ok(ids)) => (Some(ids), FallbackReason::ParityReuseOff, None),
            (Gate::Reuse, Err(IdsFault::Missing)) => (None, FallbackReason::IdsMissing, None),
            (Gate::Reuse, Err(IdsFault::Invalid(e @ IdsError::OutOfVocab { .. }))) => {
                (None, FallbackReason::IdsOutOfVocab, Some(e))
            }
            (Gate::Reuse, Err(IdsFault::Invalid(e))) => (None, FallbackReason::IdsMalformed, Some(e)),
        };
        let sent = ids.as_ref().filter(|_| !self.policy.hold_ids);
        let body = decode_body(self.request.obj, self.request.source, api, handoff.kv_transfer_params.as_deref(), sent);
        Ok(DecodeStep {
            body,
            reuse: Reuse::of(sent, fallback),
            cached_tokens: handoff.cached_tokens,
            refused,
            ids,
            prompt_tokens: handoff.prompt_tokens,
            holds_kv: handoff.kv_transfer_params.is_some(),
            api,
        })
    }
}
