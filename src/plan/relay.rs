//! Relay-mode plans: an orchestrator sends both legs through tokenonce. A prefill
//! (`kv_transfer_params.do_remote_decode`) is asked to echo its ids, which are kept (cache
//! keys planned here) or returned inside `kv_transfer_params` (stateless); a decode gets its
//! ids from the request itself or from the cache and goes token-in. Nothing here touches the
//! cache: the executor takes and stores what the plan names.

use bytes::Bytes;

use super::{request_gate, version_gate, DecodeVersion, Request, Reuse, ReusePolicy};
use crate::config::RelayHandoff;
use crate::handoff::{prompt_fingerprint, CacheKey};
use crate::openai::json::{is_null, Pieces};
use crate::openai::request::{decode_body, kv_params_with_ids};
use crate::openai::response::{extract_handoff_within, hide_token_ids};
use crate::openai::{Api, FallbackReason, IdsError, PromptIds, RawObject};

/// What the request's `kv_transfer_params` say it is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    let Some(kv) = kv else { return KvFacts::default() };
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

/// The correlation keys, best first: the prefill engine's own request id, the client's
/// `X-Request-Id`, the prompt fingerprint.
fn keys(remote_request_id: Option<&str>, request_id: Option<&str>, fingerprint: u64) -> Vec<CacheKey> {
    let mut keys = Vec::with_capacity(3);
    keys.extend(remote_request_id.map(|r| CacheKey::RemoteRequestId(r.to_owned())));
    keys.extend(request_id.map(|id| CacheKey::RequestId(id.to_owned())));
    keys.push(CacheKey::Fingerprint(fingerprint));
    keys
}

/// One relayed request, read once.
struct Relayed<'r, 'a> {
    request: Request<'r, 'a>,
    policy: ReusePolicy,
    request_id: Option<&'r str>,
    /// The id a fractional `token_reuse` admits by: the client's `X-Request-Id` (the same on
    /// both legs, so both are decided alike), else tokenonce's own id for this request.
    canary_key: &'r str,
    facts: KvFacts,
}

/// A relayed request, planned by what its `kv_transfer_params` say.
pub enum RelayPlan<'r, 'a> {
    /// A prefill leg.
    Prefill(RelayPrefill<'r, 'a>),
    /// A decode leg (or any other request, which passes unchanged).
    Decode(RelayDecode<'r, 'a>),
}

/// Plans one request of a relay route; `request_id` is the client's own `X-Request-Id`.
pub fn plan<'r, 'a>(
    request: Request<'r, 'a>,
    policy: &ReusePolicy,
    request_id: Option<&'r str>,
    canary_key: &'r str,
) -> RelayPlan<'r, 'a> {
    let relayed = Relayed { request, policy: *policy, request_id, canary_key, facts: kv_facts(request.obj) };
    if relayed.facts.is_prefill {
        RelayPlan::Prefill(RelayPrefill(relayed))
    } else {
        RelayPlan::Decode(RelayDecode(relayed))
    }
}

/// A relayed prefill.
pub struct RelayPrefill<'r, 'a>(Relayed<'r, 'a>);

/// Ids to keep for a later decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// Keys the decode may come with, best first.
    pub keys: Vec<CacheKey>,
    /// The prompt fingerprint the decode must match.
    pub fingerprint: u64,
    /// The ids.
    pub ids: Vec<u32>,
}

/// What to do with a relayed prefill's 2xx answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillAnswer {
    /// The body for the client; `None`: the engine's, unchanged.
    pub body: Option<Bytes>,
    /// Ids to cache (cache handoff).
    pub store: Option<CacheEntry>,
    /// True when the ids were kept (cached or returned inside `kv_transfer_params`).
    pub kept: bool,
}

impl RelayPrefill<'_, '_> {
    /// The prefill body asking for ids; `None` when this request cannot reuse them (it is
    /// then forwarded unchanged).
    pub fn body(&self) -> Option<Pieces> {
        let view = self.0.request.view;
        let eligible = request_gate(view, &self.0.policy, self.0.canary_key).is_none() && !view.stream;
        if !eligible {
            return None;
        }
        let echo = view.api.echo_field()?;
        let mut body = self.0.request.obj.clone();
        if !view.return_token_ids {
            body.set_raw(echo, "true");
        }
        Some(body.to_pieces(self.0.request.source, None, None))
    }

    /// Keeps the ids of a 2xx answer (cache or stateless) and hides them from the client
    /// unless it asked for them.
    pub fn after_prefill(&self, answer: &[u8]) -> PrefillAnswer {
        let mut out = PrefillAnswer { body: None, store: None, kept: false };
        let Ok(text) = std::str::from_utf8(answer) else { return out };
        let api = self.0.request.view.api;
        let handoff = extract_handoff_within(api, answer, self.0.policy.vocab).ok();
        let mut rewritten: Option<Vec<u8>> = None;
        if let Some((handoff, ids)) = handoff.as_ref().and_then(|h| h.ids.as_ref().ok().map(|ids| (h, ids))) {
            match self.0.policy.relay_handoff {
                RelayHandoff::Cache => {
                    // The prefill engine's own id, from its answer, is the best key.
                    let remote = handoff
                        .kv_transfer_params
                        .as_deref()
                        .and_then(|kv| RawObject::parse(kv).ok())
                        .and_then(|kv| kv.get_as::<String>("remote_request_id").and_then(Result::ok));
                    let fingerprint = prompt_fingerprint(self.0.request.obj);
                    let mut keys = keys(self.0.facts.remote_request_id.as_deref(), self.0.request_id, fingerprint);
                    if let Some(r) = remote {
                        keys.insert(0, CacheKey::RemoteRequestId(r));
                    }
                    out.store = Some(CacheEntry { keys, fingerprint, ids: ids.to_vec() });
                }
                RelayHandoff::Stateless => {
                    let kv = kv_params_with_ids(handoff.kv_transfer_params.as_deref(), ids);
                    if let Ok(mut top) = RawObject::parse(text) {
                        top.set_raw("kv_transfer_params", kv);
                        rewritten = Some(top.to_bytes());
                    }
                }
            }
            out.kept = true;
        }
        if !self.0.request.view.return_token_ids {
            let current = rewritten.as_deref().and_then(|b| std::str::from_utf8(b).ok()).unwrap_or(text);
            if let Some(hidden) = hide_token_ids(api, current) {
                rewritten = Some(hidden);
            }
        }
        out.body = rewritten.map(Bytes::from);
        out
    }
}

/// A relayed decode (or a plain request, which passes unchanged).
pub struct RelayDecode<'r, 'a>(Relayed<'r, 'a>);

/// Where a relayed decode's ids are to be found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Search {
    /// Decided already.
    Done(Found),
    /// Take them from the cache under these keys, for this prompt.
    Cache {
        /// Keys, best first.
        keys: Vec<CacheKey>,
        /// The prompt fingerprint the entry must carry.
        fingerprint: u64,
    },
}

/// The ids a relayed decode goes with, or why none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Ids to hand on (inline or from the cache).
    Ids(PromptIds),
    /// Reuse is not allowed (route, request or decode version).
    Blocked(FallbackReason),
    /// The request's own ids are malformed.
    Malformed(IdsError),
    /// The cache had nothing for it.
    Missing,
}

impl RelayDecode<'_, '_> {
    /// True when the decode's version decides this request: chat, not otherwise blocked,
    /// and some ids could apply (inline, a handoff-looking request, or a non-empty cache).
    pub fn needs_decode_version(&self, cache_is_empty: bool) -> bool {
        self.0.request.view.api != Api::Completions
            && request_gate(self.0.request.view, &self.0.policy, self.0.canary_key).is_none()
            && (self.0.facts.looks_like_decode || self.0.facts.ids_raw.is_some() || !cache_is_empty)
    }

    /// Where the ids are: inline (validated here), in the cache, or nowhere (blocked).
    pub fn search(&self, decode: DecodeVersion) -> Search {
        let view = self.0.request.view;
        let blocked = request_gate(view, &self.0.policy, self.0.canary_key).or_else(|| match decode {
            // Not needed: the plan found no ids could apply, or this API needs no version.
            DecodeVersion::NotNeeded => None,
            known => version_gate(view.api, known),
        });
        if let Some(reason) = blocked {
            return Search::Done(Found::Blocked(reason));
        }
        if let Some(raw) = &self.0.facts.ids_raw {
            return Search::Done(match PromptIds::parse_within(raw, None, self.0.policy.vocab) {
                Ok(ids) => Found::Ids(ids),
                Err(e) => Found::Malformed(e),
            });
        }
        // Only a cache lookup needs the fingerprint (a full parse of the prompt fields).
        let fingerprint = prompt_fingerprint(self.0.request.obj);
        Search::Cache {
            keys: keys(self.0.facts.remote_request_id.as_deref(), self.0.request_id, fingerprint),
            fingerprint,
        }
    }

    /// The decode leg: token-in with the ids found, else the request as sent (minus any
    /// inline ids a blocked request carried: vLLM 0.27–0.31 would use them unchecked).
    /// `None` as the body means unchanged.
    pub fn step(&self, found: Found) -> (Option<Pieces>, Reuse, Option<IdsError>) {
        let handoff_like = self.0.facts.looks_like_decode || self.0.facts.ids_raw.is_some();
        let (ids, reuse, refused) = match found {
            Found::Ids(ids) => {
                let reuse = Reuse::of(Some(&ids), FallbackReason::CacheMiss);
                (Some(ids), reuse, None)
            }
            Found::Blocked(reason) if handoff_like => (None, Reuse::Fallback(reason), None),
            Found::Malformed(e @ IdsError::OutOfVocab { .. }) => {
                (None, Reuse::Fallback(FallbackReason::IdsOutOfVocab), Some(e))
            }
            Found::Malformed(e) => (None, Reuse::Fallback(FallbackReason::IdsMalformed), Some(e)),
            Found::Missing if self.0.facts.looks_like_decode => {
                (None, Reuse::Fallback(FallbackReason::CacheMiss), None)
            }
            Found::Blocked(_) | Found::Missing => (None, Reuse::NotCounted, None),
        };
        if ids.is_none() && self.0.facts.ids_raw.is_none() {
            return (None, reuse, refused);
        }
        let api = self.0.request.view.api;
        let kv = self.0.request.obj.get("kv_transfer_params").filter(|raw| !is_null(Some(raw)));
        // Chat ids replace the inline ones in place; otherwise inline ids are dropped.
        let strip = self.0.facts.ids_raw.is_some() && !(ids.is_some() && api != Api::Completions);
        let kv = match kv {
            Some(raw) if strip => Some(without_ids(raw).unwrap_or_else(|| raw.to_owned())),
            kv => kv.map(str::to_owned),
        };
        let body = decode_body(self.0.request.obj, self.0.request.source, api, kv.as_deref(), ids.as_ref());
        (Some(body), reuse, refused)
    }
}

/// A `kv_transfer_params` text with its `prompt_token_ids` removed.
fn without_ids(kv: &str) -> Option<String> {
    let mut kv = RawObject::parse(kv).ok()?;
    kv.remove("prompt_token_ids");
    String::from_utf8(kv.to_bytes()).ok()
}
