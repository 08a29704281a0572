//! What a request's prompt ids feed besides its legs: the parity watch's sample and the
//! local-ids shadow check once they are known ([`prompt_ids`]), and, before the prefill,
//! the local ids a trusted shape has earned ([`local_prompt`], [`token_in`]).
//!
//! The local ids steer the cache-aware picks (their block chains) from a pool's first request
//! (a wrong id there costs a cache miss, never a wrong answer), and send the prefill token-in
//! once their shape is trusted. Nothing here waits on a check: a full queue drops it, counted.

use std::sync::Arc;

use super::{ApiRequest, RequestInfo};
use crate::kv::BlockHash;
use crate::local::LocalIds;
use crate::metrics::ChoiceReason;
use crate::openai::{Api, HashInputs, PromptIds};
use crate::plan::Orchestration;
use crate::routes::PrefillTarget;
use crate::upstream::{Pool, Prompt, PromptKey};

/// Who made the ids the prefill echoed, which decides what checks them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Echoed {
    /// The prefill engine, from the prompt's text: the parity watch samples them and the
    /// local-ids check compares tokenonce's own render with them.
    Engine,
    /// Tokenonce (the prefill went token-in with local ids): never checked against
    /// themselves, only sampled by the parity watch.
    Local,
    /// A relayed prefill, kept for its decode: sampled by the parity watch only.
    Relayed,
}

/// The checks a request's prompt `ids` feed once they are known: a parity sample when the
/// route samples this request, and the local-ids check when the route's prefill pool has
/// `local_ids` on and the engine made them (against the ids rendered for the picks, `local`,
/// when there are some). `prompt_tokens` is the prefill's count.
pub fn prompt_ids(
    info: &RequestInfo,
    req: &ApiRequest<'_>,
    ids: &PromptIds,
    prompt_tokens: Option<u64>,
    (by, local): (Echoed, Option<&LocalPrompt>),
) {
    watch_parity(info, req, ids, prompt_tokens);
    if by == Echoed::Engine {
        shadow_local_ids(info, req, ids, local);
    }
}

/// A prompt's full blocks' hashes as each cache-aware pool of its route names them (`None`:
/// the pool is not cache-aware, or the ids are not known), each computed once.
#[derive(Default)]
pub struct PromptChains {
    /// As the route's prefill pool names blocks.
    pub prefill: Option<Vec<BlockHash>>,
    /// As its decode pool does.
    pub decode: Option<Vec<BlockHash>>,
}

impl PromptChains {
    /// The chains of prompt `ids` with what else the request hashes (`inputs`: its adapter,
    /// its salt, as each pool's engines name them) for `prefill` (a pool prefill) and
    /// `decode`: once when both name blocks alike; none for inputs vLLM hashes beyond them.
    pub fn of(prefill: Option<&Pool>, decode: &Pool, ids: &[u32], inputs: &HashInputs) -> Self {
        let HashInputs::Text { model, cache_salt } = inputs else { return Self::default() };
        let keys = |p: &Pool| p.lora_paths().keys(model.as_deref(), cache_salt.as_deref());
        let prefill_keys = prefill.map(keys);
        let prefill_chain = prefill.zip(prefill_keys.as_ref()).and_then(|(p, k)| p.chain(ids, &k.as_extra()));
        let decode_keys = keys(decode);
        let decode_chain = match prefill {
            Some(p) if p.names_blocks_like(decode) && prefill_keys.as_ref() == Some(&decode_keys) => {
                prefill_chain.clone()
            }
            _ => decode.chain(ids, &decode_keys.as_extra()),
        };
        Self { prefill: prefill_chain, decode: decode_chain }
    }
}

/// Why a request's picks go by load whatever its prompt: vLLM hashes its blocks from inputs
/// tokenonce does not have (`None`: its ids and extra keys name them).
pub fn by_load(inputs: &HashInputs) -> Option<ChoiceReason> {
    match inputs {
        HashInputs::Text { .. } => None,
        HashInputs::Multimodal => Some(ChoiceReason::Multimodal),
        HashInputs::PromptEmbeds => Some(ChoiceReason::PromptEmbeds),
    }
}

/// What the cache-aware picks of one request know of its prompt: its local ids' chains, else
/// its text keys (`openai::prefix`), else nothing.
#[derive(Default)]
pub struct PromptKeys {
    /// Tokenonce's own ids and their chains.
    pub local: Option<LocalPrompt>,
    /// The text keys, when there are no local ids and a pool of the route is cache-aware.
    pub text: Option<Vec<BlockHash>>,
    /// Set when the prompt's blocks are hashed from more than tokenonce knows ([`by_load`]).
    pub by_load: Option<ChoiceReason>,
    /// The request's `model`: a pick prefers engines running it when it names a LoRA adapter.
    pub model: Option<String>,
}

impl PromptKeys {
    /// The local ids of `info`'s request ([`local_prompt`]), else its text keys when a pool
    /// of the route chooses by the prompt.
    pub async fn of(info: &RequestInfo, req: &ApiRequest<'_>) -> Self {
        let local = local_prompt(info, req).await;
        let route = &info.route;
        let prefill_aware = matches!(&route.prefill, Some(crate::routes::PrefillTarget::Pool(p)) if p.is_cache_aware());
        let wanted = local.is_none() && (prefill_aware || route.decode_pool.is_cache_aware());
        let text = wanted.then(|| crate::openai::prefix::text_keys(&req.obj, req.view.api)).flatten();
        Self { local, text, by_load: by_load(&HashInputs::of(&req.view, &req.obj)), model: req.view.model.clone() }
    }

    /// What the prefill pool's pick knows.
    pub fn prefill(&self) -> Prompt<'_> {
        let key = self.key(self.local.as_ref().and_then(|l| l.chains.prefill.as_deref()));
        Prompt { key, adapter: self.model.as_deref() }
    }

    /// What the decode pool's pick knows.
    pub fn decode(&self) -> Prompt<'_> {
        let key = self.key(self.local.as_ref().and_then(|l| l.chains.decode.as_deref()));
        Prompt { key, adapter: self.model.as_deref() }
    }

    fn key<'k>(&'k self, tokens: Option<&'k [BlockHash]>) -> PromptKey<'k> {
        if let Some(reason) = self.by_load {
            return PromptKey::ByLoad(reason);
        }
        match (tokens, &self.text) {
            (Some(chain), _) => PromptKey::Tokens(chain),
            (None, Some(text)) => PromptKey::Text(text),
            (None, None) => PromptKey::Unknown,
        }
    }
}

/// Tokenonce's own ids for a request's prompt, with its block chains.
pub struct LocalPrompt {
    ids: Vec<u32>,
    shape: &'static str,
    /// True when the ids also send the prefill token-in (a trusted shape, not rechecked).
    token_in: bool,
    /// The chains the cache-aware picks want.
    pub chains: PromptChains,
}

/// Tokenonce's own ids for a request's prompt and their chains, when the route's prefill pool
/// renders locally and either a pool of the route chooses by the prompt (any shape: routing
/// by an unproven id risks a cache miss only) or a shape is trusted for token-in (rendered,
/// tokenized and hashed on a blocking thread, off the proxy's workers).
pub async fn local_prompt(info: &RequestInfo, req: &ApiRequest<'_>) -> Option<LocalPrompt> {
    let Some(PrefillTarget::Pool(prefill)) = &info.route.prefill else { return None };
    let decode = &info.route.decode_pool;
    let steers = prefill.is_cache_aware() || decode.is_cache_aware();
    // No blocking-thread hop and no render when nothing would use the ids.
    let local = local_renderer(info).filter(|l| steers || l.any_trusted())?;
    let api = req.view.api;
    if !matches!(api, Api::Chat | Api::Completions) {
        return None;
    }
    let (local, body) = (Arc::clone(local), req.incoming.body.clone());
    let (prefill, decode) = (Arc::clone(prefill), Arc::clone(decode));
    let inputs = HashInputs::of(&req.view, &req.obj);
    let work = move || {
        let render = local.for_request(api, &body)?;
        let chains = PromptChains::of(Some(&prefill), &decode, &render.ids, &inputs);
        Some(LocalPrompt { ids: render.ids, shape: render.shape, token_in: render.token_in, chains })
    };
    tokio::task::spawn_blocking(work).await.ok().flatten()
}

/// `plan` with tokenonce's own ids for the prompt (`local`, from [`local_prompt`]), counted
/// when the prefill goes token-in.
pub fn token_in<'r, 'a>(
    info: &RequestInfo,
    plan: Orchestration<'r, 'a>,
    local: Option<&LocalPrompt>,
) -> Orchestration<'r, 'a> {
    let Some(LocalPrompt { ids, shape, token_in: true, .. }) = local else { return plan };
    let plan = plan.with_local_ids(PromptIds::from_ids(ids));
    if let Some(local) = plan.local_ids().then(|| local_renderer(info)).flatten() {
        info.app.metrics.local.token_in(&local.pool, shape);
    }
    plan
}

/// The route's prefill pool's local renderer, when it has one.
fn local_renderer(info: &RequestInfo) -> Option<&Arc<LocalIds>> {
    let Some(PrefillTarget::Pool(pool)) = &info.route.prefill else { return None };
    info.app.local.get(&pool.name)
}

/// Hands `ids` to the parity watch when the route samples this request.
fn watch_parity(info: &RequestInfo, req: &ApiRequest<'_>, ids: &PromptIds, prompt_tokens: Option<u64>) {
    let Some(parity) = info.route.parity.as_ref().filter(|p| p.wants_sample()) else { return };
    info.app.watch.submit(crate::parity::Sample {
        route: Arc::clone(parity),
        request_id: info.request_id.clone(),
        api: req.view.api,
        body: req.incoming.body.clone(),
        ids: ids.clone(),
        prompt_tokens,
    });
}

/// Hands `ids` (the prefill's echo) to the local-ids verifier when the route's prefill pool
/// has `local_ids` shadow or on, with the ids already `rendered` for the picks, if any.
fn shadow_local_ids(info: &RequestInfo, req: &ApiRequest<'_>, ids: &PromptIds, rendered: Option<&LocalPrompt>) {
    let Some(local) = local_renderer(info).filter(|l| l.checks()) else { return };
    info.app.verifier.submit(crate::local::Sample {
        local: Arc::clone(local),
        request_id: info.request_id.clone(),
        api: req.view.api,
        body: req.incoming.body.clone(),
        echoed: ids.clone(),
        rendered: rendered.map(|r| (r.ids.clone(), r.shape)),
    });
}
