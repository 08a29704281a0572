//! The cache-aware choice of a `cache_aware` pool: how a prompt's blocks are named, the
//! sources saying which endpoint holds which blocks (asked in order), the score weighing a
//! held prefix against load, and the count of each choice by source and reason.

use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::endpoint::Endpoint;
use super::engine_load::Pressure;
use super::metrics::CacheAwareMetrics;
use crate::kv::{BlockHash, BlockHasher, ExtraKeys, PrefixHolders, SentPrefixes};
use crate::metrics::{ChoiceReason, ChoiceSource};

/// What a cache-aware pick knows of a request's prompt.
#[derive(Clone, Copy, Debug)]
pub enum PromptKey<'c> {
    /// Not a prompt's first leg (passthrough, a failover): least in flight, not counted.
    NotAPrompt,
    /// A prompt known by neither its ids nor its text: least in flight, counted `no_ids`.
    Unknown,
    /// Its full blocks' hashes, as [`Pool::chain`](super::Pool::chain) names them: asked of
    /// the pool's sources.
    Tokens(&'c [BlockHash]),
    /// Its text keys (`openai::prefix`): asked of the pool's own index of text keys.
    Text(&'c [BlockHash]),
    /// A prompt vLLM hashes from inputs tokenonce does not have (media, prompt embeddings):
    /// no prefix is claimed; least in flight, counted by `reason`.
    ByLoad(ChoiceReason),
}

/// What a pick knows of a request: its prompt's key and the LoRA adapter its `model` may
/// name (endpoints whose engine runs that adapter are preferred).
#[derive(Clone, Copy, Debug)]
pub struct Prompt<'c> {
    /// What is known of its prompt.
    pub key: PromptKey<'c>,
    /// Its `model`, which may name an adapter (an engine not running it pays one mean request).
    pub adapter: Option<&'c str>,
}

impl<'c> From<PromptKey<'c>> for Prompt<'c> {
    fn from(key: PromptKey<'c>) -> Self {
        Prompt { key, adapter: None }
    }
}

/// What a `cache_aware` pool chooses by: the score's weights, how a prompt's blocks are
/// named, and the sources saying which endpoint holds which blocks, asked in order.
pub struct CacheAwareChoice {
    weights: Weights,
    hasher: BlockHasher,
    /// Mean prompt tokens a chosen endpoint computes (a moving mean; 0 before the first
    /// choice): what each request an engine reports queued is taken to weigh.
    mean_compute: AtomicU64,
    /// The events source first when installed, then where tokenonce sent each prompt.
    sources: RwLock<Vec<(ChoiceSource, Arc<dyn PrefixHolders>)>>,
    /// Where tokenonce sent each prompt known by its text keys only (a namespace of its own).
    text: SentPrefixes,
    /// Its `cache_aware_choices_total` series, resolved when the pool is built in an App.
    metrics: OnceLock<CacheAwareMetrics>,
}

impl std::fmt::Debug for CacheAwareChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheAwareChoice")
            .field("weights", &self.weights)
            .field("block_size", &self.hasher.block_size())
            .field("sources", &self.source_kinds())
            .finish()
    }
}

impl CacheAwareChoice {
    /// The choice `[pools.NAME.cache_aware]` describes, with the approximate source only.
    pub(super) fn new(spec: &crate::config::CacheAware) -> Self {
        let sent: Arc<dyn PrefixHolders> = Arc::new(SentPrefixes::new(spec.max_blocks as usize));
        Self {
            weights: Weights { prefix: spec.prefix_weight, load: spec.load_weight },
            mean_compute: AtomicU64::new(0),
            hasher: BlockHasher::new(&spec.hash_seed, spec.block_size.get()),
            sources: RwLock::new(vec![(ChoiceSource::Sent, sent)]),
            text: SentPrefixes::new(spec.max_blocks as usize),
            metrics: OnceLock::new(),
        }
    }

    /// The hashes of the full blocks of prompt `ids` with its extra `keys`, as this choice
    /// names blocks.
    pub(super) fn chain(&self, ids: &[u32], keys: &ExtraKeys<'_>) -> Vec<BlockHash> {
        self.hasher.chain(ids, keys)
    }

    /// True when `other` names blocks as this choice does (same seed and block size).
    pub(super) fn names_blocks_like(&self, other: &CacheAwareChoice) -> bool {
        self.hasher.block_size() == other.hasher.block_size() && self.hasher.none_hash() == other.hasher.none_hash()
    }

    /// Sets its source of `kind`: replaces the one it had, or removes it (`None`). The events
    /// source goes before the approximate one, so it is asked first while usable.
    pub(super) fn set_source(&self, kind: ChoiceSource, source: Option<Arc<dyn PrefixHolders>>) {
        let mut sources = self.sources.write();
        sources.retain(|(k, _)| *k != kind);
        if let Some(source) = source {
            let at = if kind == ChoiceSource::Events { 0 } else { sources.len() };
            sources.insert(at, (kind, source));
        }
    }

    /// Forgets what every source (and the text keys' index) says the endpoint named `name`
    /// holds.
    pub(super) fn forget(&self, name: &str) {
        self.sources.read().iter().for_each(|(_, s)| s.forget(name));
        self.text.forget(name);
    }

    /// The prompt tokens of `chain` (full blocks) the endpoint named `name` holds, as the
    /// engines' KV events say (`None`: no events source, or not usable now).
    pub(super) fn tokens_held_by_events(&self, name: &str, chain: &[BlockHash]) -> Option<u64> {
        let sources = self.sources.read();
        let (_, events) = sources.iter().find(|(kind, s)| *kind == ChoiceSource::Events && s.usable())?;
        let held = u64::try_from(events.held(name, chain)).unwrap_or(u64::MAX);
        Some(held.saturating_mul(self.hasher.block_size() as u64))
    }

    /// The kinds of source it asks, in order.
    pub(super) fn source_kinds(&self) -> Vec<ChoiceSource> {
        self.sources.read().iter().map(|(k, _)| *k).collect()
    }

    /// Gives it its choice series (once: a pool carried over a reload keeps the first).
    pub(super) fn count_in(&self, metrics: CacheAwareMetrics) {
        let _ = self.metrics.set(metrics);
    }

    /// Counts one choice (when the pool has series).
    fn count(&self, source: ChoiceSource, reason: ChoiceReason) {
        if let Some(m) = self.metrics.get() {
            m.choice(source, reason);
        }
    }

    /// The candidate costing least for `prompt` (the first in `rotated` order among equals),
    /// with the prompt tokens it is expected to compute (what its pick is charged), counted
    /// by source and by what decided; every source of its kind then hears where it went.
    /// `ahead` tells the work already queued at a candidate.
    pub(super) fn choose<'a>(
        &self,
        rotated: &[&'a Arc<Endpoint>],
        prompt: PromptKey<'_>,
        ahead: &dyn Fn(&Endpoint) -> Ahead,
    ) -> Option<(&'a Arc<Endpoint>, u64)> {
        let least = || rotated.iter().copied().min_by_key(|e| e.inflight()).map(|e| (e, 0));
        let chain = match prompt {
            PromptKey::NotAPrompt => return least(),
            PromptKey::Unknown => {
                self.count(ChoiceSource::None, ChoiceReason::NoIds);
                return least();
            }
            PromptKey::ByLoad(reason) => {
                self.count(ChoiceSource::None, reason);
                return least();
            }
            PromptKey::Tokens(chain) | PromptKey::Text(chain) if chain.is_empty() => {
                self.count(ChoiceSource::None, ChoiceReason::ShortPrompt);
                return least();
            }
            PromptKey::Text(keys) => {
                let choice = self.best(rotated, &self.text, keys, ahead)?;
                self.count(ChoiceSource::Text, choice.reason);
                self.text.sent(&choice.chosen.name, keys);
                return Some((choice.chosen, choice.compute));
            }
            PromptKey::Tokens(chain) => chain,
        };
        let sources = self.sources.read();
        let Some((kind, source)) = sources.iter().find(|(_, s)| s.usable()) else {
            self.count(ChoiceSource::None, ChoiceReason::Unusable);
            let chosen = least()?;
            sources.iter().for_each(|(_, s)| s.sent(&chosen.0.name, chain));
            return Some(chosen);
        };
        let choice = self.best(rotated, source.as_ref(), chain, ahead)?;
        self.count(*kind, choice.reason);
        if let Some(m) = self.metrics.get() {
            let tokens = choice.held.saturating_mul(self.hasher.block_size());
            m.predicted(*kind, u64::try_from(tokens).unwrap_or(u64::MAX));
        }
        sources.iter().for_each(|(_, s)| s.sent(&choice.chosen.name, chain));
        Some((choice.chosen, choice.compute))
    }

    /// The candidate costing least by `source` (see [`Cost`]), and what decided.
    fn best<'a>(
        &self,
        rotated: &[&'a Arc<Endpoint>],
        source: &dyn PrefixHolders,
        chain: &[BlockHash],
        ahead: &dyn Fn(&Endpoint) -> Ahead,
    ) -> Option<Choice<'a>> {
        let block = self.hasher.block_size() as u64;
        let prompt = (chain.len() as u64).saturating_mul(block);
        // A queued request computes at least its last block (never cached).
        let per_request = match self.mean_compute.load(Ordering::Relaxed) {
            0 => prompt,
            mean => mean,
        }
        .max(block);
        let aheads: Vec<Ahead> = rotated.iter().map(|e| ahead(e)).collect();
        // An adapter some candidate's engine runs: the others load it first.
        let adapter_somewhere = aheads.iter().any(|a| a.adapter_running == Some(true));
        let mut best: Option<(&Arc<Endpoint>, Cost)> = None;
        // The candidate holding the most, and the least costly among those (for the reason).
        let mut holder: Option<Cost> = None;
        let mut least_held = usize::MAX;
        for (&e, mut ahead) in rotated.iter().zip(aheads) {
            if adapter_somewhere && ahead.adapter_running != Some(true) {
                ahead.adapter_load = per_request;
            }
            let held = source.held(&e.name, chain);
            let cost = Cost::of(held, block, prompt, ahead, per_request, self.weights);
            least_held = least_held.min(held);
            if holder.is_none_or(|h: Cost| held > h.held || (held == h.held && cost.total < h.total)) {
                holder = Some(cost);
            }
            if best.is_none_or(|(_, top): (&Arc<Endpoint>, Cost)| cost.total < top.total) {
                best = Some((e, cost));
            }
        }
        let (chosen, cost) = best?;
        let reason = match holder {
            Some(h) if h.held == 0 => ChoiceReason::NoPrefix,
            Some(h) if h.held == least_held && rotated.len() > 1 => ChoiceReason::SharedPrefix,
            Some(h) if h.held == cost.held => ChoiceReason::Prefix,
            Some(h) if h.unpressed <= cost.total => ChoiceReason::CachePressure,
            _ => ChoiceReason::Load,
        };
        self.learn_compute(cost.compute);
        Some(Choice { chosen, held: cost.held, compute: cost.compute, reason })
    }

    /// Moves the mean prompt tokens a chosen endpoint computes an eighth toward `compute`.
    fn learn_compute(&self, compute: u64) {
        let _ = self.mean_compute.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
            Some(if mean == 0 { compute.max(1) } else { (mean.saturating_mul(7).saturating_add(compute) / 8).max(1) })
        });
    }
}

/// The work already ahead of a prompt at one endpoint, as a pick sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ahead {
    /// Prompt tokens of this instance's requests in flight there (their picks' charges).
    pub own_tokens: u64,
    /// What its engine last reported, when believed (every instance reads the same).
    pub engine: Option<Pressure>,
    /// Whether its engine runs (or queues) the request's LoRA adapter
    /// (`vllm:lora_requests_info`); `None`: no adapter asked, or not known.
    pub adapter_running: Option<bool>,
    /// Tokens added for loading the adapter (set by the choice).
    pub(super) adapter_load: u64,
}

/// KV-cache use past which a held prefix counts for less: it counts in full up to this, not
/// at all when the cache is full (the engine evicts or queues).
pub const KV_PRESSURE_FROM: f64 = 0.9;

/// The score's weights (`[pools.NAME.cache_aware]`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Weights {
    prefix: f64,
    load: f64,
}

/// One candidate's cost for a prompt, in tokens the engine would compute before this
/// prompt's first token: `prefix_weight` x the prompt tokens it does not hold, plus
/// `load_weight` x the tokens queued ahead there. The least wins.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cost {
    /// Leading blocks it holds.
    held: usize,
    /// Prompt tokens it would compute: those its held blocks (discounted for KV pressure) do
    /// not cover, and at least one block.
    compute: u64,
    /// Tokens queued ahead: the larger of this instance's own charges there and the
    /// engine's waiting and running requests at the mean charge, and one mean request more
    /// when it must load the request's adapter that another candidate runs.
    queued: u64,
    total: f64,
    /// The total were its KV cache under no pressure.
    unpressed: f64,
}

impl Cost {
    /// The cost of a candidate holding `held` blocks of `block` tokens of a `prompt`-token
    /// prompt, with `ahead` queued there and `per_request` tokens per engine-reported request.
    #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "0 <= keep <= 1")]
    #[expect(clippy::cast_precision_loss, reason = "token counts far below 2^52")]
    fn of(held: usize, block: u64, prompt: u64, ahead: Ahead, per_request: u64, weights: Weights) -> Self {
        let held_tokens = (held as u64).saturating_mul(block).min(prompt);
        let keep = ahead.engine.map_or(1.0, |p| ((1.0 - p.kv_usage) / (1.0 - KV_PRESSURE_FROM)).clamp(0.0, 1.0));
        // An engine always computes a prompt's last tokens: at least a block (or the prompt).
        let least = block.min(prompt);
        let compute = (prompt - (held_tokens as f64 * keep) as u64).max(least);
        let engine_queue = ahead.engine.map_or(0, |p| p.waiting.saturating_add(p.running).saturating_mul(per_request));
        let queued = ahead.own_tokens.max(engine_queue).saturating_add(ahead.adapter_load);
        let total_with = |compute: u64| weights.prefix * compute as f64 + weights.load * queued as f64;
        let unpressed = total_with((prompt - held_tokens).max(least));
        Self { held, compute, queued, total: total_with(compute), unpressed }
    }
}

/// What [`CacheAwareChoice::best`] found.
struct Choice<'a> {
    chosen: &'a Arc<Endpoint>,
    held: usize,
    compute: u64,
    reason: ChoiceReason,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Balance;
    use crate::upstream::pool::tests::pool;
    use crate::upstream::{EngineLoad, Prompt};
    use crate::upstream::{Picked, Pool};
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    /// The chain of a prompt of `blocks` blocks of 4 ids from `from`, as `p` names blocks.
    fn prompt(p: &Pool, from: u32, blocks: u32) -> Vec<BlockHash> {
        p.chain(&(from..from + blocks * 4).collect::<Vec<u32>>(), &ExtraKeys::default()).unwrap()
    }

    #[test]
    fn cache_aware_sends_a_prompt_where_its_prefix_went() {
        let p = pool(Balance::CacheAware, 3);
        let first = prompt(&p, 0, 8);
        let home = p.pick_for(Instant::now(), &[], PromptKey::Tokens(&first[..4])).unwrap().name().to_owned();
        for _ in 0..6 {
            assert_eq!(
                p.pick_for(Instant::now(), &[], PromptKey::Tokens(&first)).unwrap().name(),
                home,
                "its longer turns follow"
            );
        }
        let elsewhere: Vec<String> = (0..3)
            .map(|i| {
                p.pick_for(Instant::now(), &[], PromptKey::Tokens(&prompt(&p, 2000 + i * 100, 8)))
                    .unwrap()
                    .name()
                    .to_owned()
            })
            .collect();
        assert!(elsewhere.iter().any(|n| n != &home), "new prompts rotate: {elsewhere:?}");
        // Tried already (failover): another endpoint, whatever it holds.
        assert_ne!(p.pick_for(Instant::now(), &[home.as_str()], PromptKey::Tokens(&first)).unwrap().name(), home);
    }

    /// The choice series of `registry` for pool `p`, as text.
    fn choices(registry: &prometheus::Registry) -> String {
        String::from_utf8(crate::metrics::render(registry)).unwrap()
    }

    /// A pool of `n` counting its choices in a registry of its own.
    fn counted_pool(n: usize) -> (Pool, prometheus::Registry) {
        let registry = prometheus::Registry::new();
        let metrics = crate::upstream::metrics::UpstreamMetrics::register(&registry).unwrap();
        let p = pool(Balance::CacheAware, n);
        p.count_choices_in(metrics.cache_aware("p"));
        (p, registry)
    }

    fn count_of(text: &str, source: &str, reason: &str) -> u64 {
        let series = format!(r#"tokenonce_cache_aware_choices_total{{pool="p",reason="{reason}",source="{source}"}} "#);
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.parse().unwrap())
    }

    /// Worked example (docs/concepts.md, `load_weight = 1`): a prompt of 32 tokens (8 blocks of 4) the holder
    /// holds whole costs it one block (4) to compute and 32 elsewhere; the holder keeps it
    /// while under 28 tokens are queued there, and loses it past that.
    #[test]
    fn cache_aware_load_outweighs_a_held_prefix() {
        let (p, registry) = counted_pool(2);
        let c = prompt(&p, 0, 8);
        let home = p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name().to_owned();
        let busy = p.pick_named(&home).unwrap().charged(27);
        for _ in 0..3 {
            assert_eq!(
                p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
                home,
                "4 + 27 queued < 32 to compute elsewhere"
            );
        }
        let more = p.pick_named(&home).unwrap().charged(2);
        assert_ne!(
            p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
            home,
            "4 + 29 queued > 32: it moves"
        );
        let text = choices(&registry);
        assert_eq!(count_of(&text, "sent", "prefix"), 3, "{text}");
        assert_eq!(count_of(&text, "sent", "load"), 1, "{text}");
        drop((busy, more));
        assert!(p.endpoints().iter().all(|e| e.queued_tokens() == 0), "charges end with their picks");
    }

    /// A source saying endpoint `i` holds the first `held[i]` blocks of any prompt.
    struct Holds(Vec<usize>);

    impl PrefixHolders for Holds {
        fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
            let i = endpoint.rsplit(':').next().and_then(|port| port.parse::<usize>().ok()).unwrap() - 9000;
            self.0[i].min(chain.len())
        }
        fn usable(&self) -> bool {
            true
        }
    }

    /// A prefix every candidate holds (a shared system prompt) attracts nothing: the picks
    /// spread by what is queued, counted `shared_prefix`.
    #[test]
    fn a_prefix_every_candidate_holds_attracts_nothing() {
        let (p, registry) = counted_pool(3);
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::new(Holds(vec![2, 2, 2]))));
        let held: Vec<Picked> = (0..6)
            .map(|i| p.pick_for(Instant::now(), &[], PromptKey::Tokens(&prompt(&p, i * 100, 8))).unwrap())
            .collect();
        for e in p.endpoints().iter() {
            assert_eq!(e.inflight(), 2, "{} took its share", e.name);
            assert_eq!(e.queued_tokens(), 48, "each charged the 24 tokens it computes");
        }
        assert_eq!(count_of(&choices(&registry), "events", "shared_prefix"), 6);
        drop(held);
    }

    /// The engine's own queue counts as the tokens a request computes on the mean: a holder
    /// whose engine reports enough waiting loses the prompt, whichever instance sent them.
    #[expect(clippy::disallowed_methods, reason = "a synchronous test waits for a read to age")]
    #[test]
    fn an_engine_reported_queue_moves_a_prompt_off_its_holder() {
        let (p, registry) = counted_pool(2);
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::new(Holds(vec![8, 0]))));
        let c = prompt(&p, 0, 8);
        let holder = &p.endpoints()[0];
        holder.facts().set_load(EngineLoad { waiting: 7, ..EngineLoad::default() });
        // The first choice takes each queued request to compute the whole prompt (32 tokens):
        // 4 + 7 x 32 > 32 elsewhere.
        assert_eq!(p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(), "127.0.0.1:9001");
        assert_eq!(count_of(&choices(&registry), "events", "load"), 1);
        // Engine pressure is not believed once its read is too old: the holder wins again.
        let stale = pool_reading_every(100);
        stale.set_prefix_source(ChoiceSource::Events, Some(Arc::new(Holds(vec![8, 0]))));
        stale.endpoints()[0].facts().set_load(EngineLoad { waiting: 7, ..EngineLoad::default() });
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(
            stale.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
            "127.0.0.1:9000",
            "a read three intervals old is not believed"
        );
    }

    /// A cache near full keeps less of what it holds: at 99 % the holder's 32 held tokens
    /// count as 3, and with one request running there (at the mean of 4 computed) it costs
    /// 29 + 4 = 33 against 32 elsewhere: the prompt moves, counted `cache_pressure`.
    #[test]
    fn kv_cache_pressure_discounts_a_held_prefix() {
        let (p, registry) = counted_pool(2);
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::new(Holds(vec![8, 0]))));
        let c = prompt(&p, 0, 8);
        let holder = &p.endpoints()[0];
        holder.facts().set_load(EngineLoad { kv_usage: 0.5, ..EngineLoad::default() });
        assert_eq!(p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(), "127.0.0.1:9000");
        holder.facts().set_load(EngineLoad { running: 1, kv_usage: 0.99, ..EngineLoad::default() });
        assert_eq!(p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(), "127.0.0.1:9001");
        let text = choices(&registry);
        assert_eq!(
            (count_of(&text, "events", "prefix"), count_of(&text, "events", "cache_pressure")),
            (1, 1),
            "{text}"
        );
    }

    /// A request naming a LoRA adapter one engine runs (`vllm:lora_requests_info`) goes there
    /// while nothing else differs: the others pay one mean request to load it first. A
    /// request for the base model rotates as before.
    #[test]
    fn a_lora_request_prefers_an_engine_running_its_adapter() {
        let p = pool(Balance::CacheAware, 2);
        let running = EngineLoad { max_loras: Some(4), loras_running: vec!["sql".into()], ..EngineLoad::default() };
        p.endpoints()[1].facts().set_load(running);
        p.endpoints()[0].facts().set_load(EngineLoad { max_loras: Some(4), ..EngineLoad::default() });
        for i in 0..4 {
            let c = prompt(&p, 1000 * i, 8);
            let lora = Prompt { key: PromptKey::Tokens(&c), adapter: Some("sql") };
            assert_eq!(p.pick_for(Instant::now(), &[], lora).unwrap().name(), "127.0.0.1:9001");
        }
        let base: Vec<String> = (0..2)
            .map(|i| {
                let c = prompt(&p, 9000 + 1000 * i, 8);
                let key = Prompt { key: PromptKey::Tokens(&c), adapter: Some("base-model") };
                p.pick_for(Instant::now(), &[], key).unwrap().name().to_owned()
            })
            .collect();
        assert_ne!(base[0], base[1], "no engine runs it: rotation");
    }

    /// A cache-aware pool of 2 (blocks of 4) whose engines' `/metrics` are read every
    /// `ms` (a read believed for three of it).
    fn pool_reading_every(ms: u64) -> Pool {
        let text = format!(
            "[pools.p]\nendpoints = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]\nbalance = \"cache_aware\"\n\
             engine_metrics_interval_ms = {ms}\n[pools.p.cache_aware]\nblock_size = 4\nload_weight = 1.0\n\
             [defaults]\npassthrough_pool = \"p\"\n"
        );
        let config = crate::config::Config::from_toml(&text, "t").unwrap();
        let rule = crate::upstream::endpoint::tests::rule(3);
        Pool::new("p", &config.pools["p"], &crate::config::PoolResources::default(), rule)
    }

    #[test]
    fn cache_aware_without_a_chain_takes_the_least_loaded() {
        let p = pool(Balance::CacheAware, 2);
        let busy = p.pick_named("127.0.0.1:9000").unwrap();
        for _ in 0..4 {
            assert_eq!(p.pick().unwrap().name(), "127.0.0.1:9001");
            assert_eq!(
                p.pick_for(Instant::now(), &[], PromptKey::Tokens(&[])).unwrap().name(),
                "127.0.0.1:9001",
                "short prompt"
            );
        }
        drop(busy);
    }

    /// A source that holds everything for one endpoint and can be switched off.
    struct Oracle {
        holder: &'static str,
        usable: AtomicBool,
    }

    impl PrefixHolders for Oracle {
        fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
            if endpoint == self.holder {
                chain.len()
            } else {
                0
            }
        }
        fn usable(&self) -> bool {
            self.usable.load(Ordering::Relaxed)
        }
    }

    #[test]
    fn cache_aware_asks_the_events_source_first_while_it_is_usable() {
        let p = pool(Balance::CacheAware, 3);
        let c = prompt(&p, 0, 8);
        let sent_home = p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name().to_owned();
        let holder = if sent_home == "127.0.0.1:9002" { "127.0.0.1:9001" } else { "127.0.0.1:9002" };
        let events = Arc::new(Oracle { holder, usable: AtomicBool::new(true) });
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::clone(&events) as Arc<dyn PrefixHolders>));
        assert_eq!(
            p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
            holder,
            "the events say where it is"
        );
        events.usable.store(false, Ordering::Relaxed);
        let fallback = p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name().to_owned();
        assert!(fallback == sent_home || fallback == holder, "the approximate index: sent to both now ({fallback})");
        assert_ne!(fallback, "127.0.0.1:9000");
    }

    /// Each choice counts the tokens its source predicts the chosen endpoint holds: the
    /// holder's whole prompt (8 blocks of 4), then nothing more once load sends the prompt to
    /// the endpoint holding none of it.
    #[test]
    fn cache_aware_counts_the_tokens_the_chosen_endpoint_is_predicted_to_hold() {
        let registry = prometheus::Registry::new();
        let metrics = crate::upstream::metrics::UpstreamMetrics::register(&registry).unwrap();
        let p = pool(Balance::CacheAware, 2);
        p.count_choices_in(metrics.cache_aware("p"));
        let events = Arc::new(Oracle { holder: "127.0.0.1:9001", usable: AtomicBool::new(true) });
        p.set_prefix_source(ChoiceSource::Events, Some(events));
        let c = prompt(&p, 0, 8);
        let predicted = || {
            let text = String::from_utf8(crate::metrics::render(&registry)).unwrap();
            let series = r#"tokenonce_cache_aware_predicted_tokens_total{pool="p",source="events"} "#;
            let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("{text}"));
            line[series.len()..].parse::<u64>().unwrap()
        };
        assert_eq!(p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(), "127.0.0.1:9001");
        assert_eq!(predicted(), 32);
        let busy = p.pick_named("127.0.0.1:9001").unwrap().charged(33);
        assert_eq!(p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(), "127.0.0.1:9000");
        assert_eq!(predicted(), 32, "the idle endpoint chosen holds none of it");
        drop(busy);
    }

    /// With only an events source that may not be believed (stale, or off after a hash
    /// mismatch) and no other, the choice is least in flight, counted `unusable`.
    #[test]
    fn cache_aware_with_no_usable_source_takes_the_least_loaded() {
        let registry = prometheus::Registry::new();
        let metrics = crate::upstream::metrics::UpstreamMetrics::register(&registry).unwrap();
        let p = pool(Balance::CacheAware, 2);
        p.count_choices_in(metrics.cache_aware("p"));
        p.set_prefix_source(ChoiceSource::Sent, None);
        let stale = Arc::new(Oracle { holder: "127.0.0.1:9000", usable: AtomicBool::new(false) });
        p.set_prefix_source(ChoiceSource::Events, Some(stale));
        let busy = p.pick_named("127.0.0.1:9000").unwrap();
        let c = prompt(&p, 0, 4);
        assert_eq!(
            p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
            "127.0.0.1:9001",
            "not the stale holder"
        );
        let text = String::from_utf8(crate::metrics::render(&registry)).unwrap();
        let series = r#"tokenonce_cache_aware_choices_total{pool="p",reason="unusable",source="none"} 1"#;
        assert!(text.contains(series), "{text}");
        drop(busy);
    }
}
