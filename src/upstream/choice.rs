//! The cache-aware choice of a `cache_aware` pool: how a prompt's blocks are named, the
//! sources saying which endpoint holds which blocks (asked in order), the score weighing a
//! held prefix against load, and the count of each choice by source and reason.

use parking_lot::RwLock;
use std::sync::{Arc, OnceLock};

use super::endpoint::Endpoint;
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

/// What a `cache_aware` pool chooses by: the score's weights, how a prompt's blocks are
/// named, and the sources saying which endpoint holds which blocks, asked in order.
pub struct CacheAwareChoice {
    prefix_weight: f64,
    load_weight: f64,
    hasher: BlockHasher,
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
            .field("prefix_weight", &self.prefix_weight)
            .field("load_weight", &self.load_weight)
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
            prefix_weight: spec.prefix_weight,
            load_weight: spec.load_weight,
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

    /// The candidate scoring best for `prompt` (the first in `rotated` order among equals),
    /// counted by source and reason; every source of its kind then hears where it went.
    pub(super) fn choose<'a>(&self, rotated: &[&'a Arc<Endpoint>], prompt: PromptKey<'_>) -> Option<&'a Arc<Endpoint>> {
        let least = || rotated.iter().copied().min_by_key(|e| e.inflight());
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
                let (chosen, any_held, _) = self.best(rotated, &self.text, keys);
                self.count(ChoiceSource::Text, if any_held { ChoiceReason::Prefix } else { ChoiceReason::NoPrefix });
                let chosen = chosen?;
                self.text.sent(&chosen.name, keys);
                return Some(chosen);
            }
            PromptKey::Tokens(chain) => chain,
        };
        let sources = self.sources.read();
        let chosen = if let Some((kind, source)) = sources.iter().find(|(_, s)| s.usable()) {
            let (chosen, any_held, held) = self.best(rotated, source.as_ref(), chain);
            self.count(*kind, if any_held { ChoiceReason::Prefix } else { ChoiceReason::NoPrefix });
            if let Some(m) = self.metrics.get() {
                let tokens = held.saturating_mul(self.hasher.block_size());
                m.predicted(*kind, u64::try_from(tokens).unwrap_or(u64::MAX));
            }
            chosen
        } else {
            self.count(ChoiceSource::None, ChoiceReason::Unusable);
            least()
        }?;
        sources.iter().for_each(|(_, s)| s.sent(&chosen.name, chain));
        Some(chosen)
    }

    /// The best-scoring candidate by `source`, whether any candidate holds a block, and how
    /// many leading blocks the chosen one holds.
    fn best<'a>(
        &self,
        rotated: &[&'a Arc<Endpoint>],
        source: &dyn PrefixHolders,
        chain: &[BlockHash],
    ) -> (Option<&'a Arc<Endpoint>>, bool, usize) {
        let blocks = chain.len() as f64;
        let mut best: Option<(&Arc<Endpoint>, f64, usize)> = None;
        let mut any_held = false;
        for &e in rotated {
            let held = source.held(&e.name, chain);
            any_held |= held > 0;
            let score = self.score(held, blocks, e);
            if best.is_none_or(|(_, top, _)| score > top) {
                best = Some((e, score, held));
            }
        }
        (best.map(|(e, _, _)| e), any_held, best.map_or(0, |(_, _, held)| held))
    }

    /// How good a home `e` is for a prompt of `blocks` blocks of which it holds the first
    /// `held` (higher is better): the share held, weighed against the requests it has in flight.
    fn score(&self, held: usize, blocks: f64, e: &Endpoint) -> f64 {
        self.prefix_weight * held as f64 / blocks - self.load_weight * e.inflight() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Balance;
    use crate::upstream::pool::tests::pool;
    use crate::upstream::{Picked, Pool};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

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

    #[test]
    fn cache_aware_load_outweighs_a_held_prefix() {
        let p = pool(Balance::CacheAware, 2);
        let c = prompt(&p, 0, 8);
        let home = p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name().to_owned();
        // Holding the whole prompt is worth 1.0; each request in flight costs 0.25.
        let busy: Vec<Picked> = (0..3).map(|_| p.pick_named(&home).unwrap()).collect();
        for _ in 0..3 {
            assert_eq!(
                p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
                home,
                "1.0 - 3 x 0.25 > 0"
            );
        }
        let more: Vec<Picked> = (0..2).map(|_| p.pick_named(&home).unwrap()).collect();
        assert_ne!(
            p.pick_for(Instant::now(), &[], PromptKey::Tokens(&c)).unwrap().name(),
            home,
            "1.0 - 5 x 0.25 < 0: it moves"
        );
        drop((busy, more));
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
        let busy: Vec<Picked> = (0..5).map(|_| p.pick_named("127.0.0.1:9001").unwrap()).collect();
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
