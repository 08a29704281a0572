//! One pool's KV events state, shared by its subscribers: the bounded index of held blocks,
//! each endpoint's slot and connection, the hash check; a decoded batch applied to it.
//! Synchronous and free of sockets: the subscribers (`events.rs`) feed it, choice reads it.
//!
//! - **Staleness**: vLLM publishes only when its cache changes, so silence from a connected
//!   engine means nothing changed; what makes an endpoint's entries stale is the connection:
//!   an endpoint not connected for `stale_after` answers 0 to `held` (usually an engine down,
//!   which health checks eject as well). The pool's source is `usable` while one endpoint is
//!   fresh and no hash mismatch turned it off: a mismatch keeps it off until the pool's source
//!   is built again (a reload that changes `kv_events`, or a restart).
//! - **Index bound**: `max_blocks` (endpoint, block) entries per pool, oldest stored evicted
//!   first (see `index.rs`). Only the device (GPU) cache of the first KV cache group is indexed:
//!   blocks offloaded to CPU or storage are not what prefix caching reuses on arrival.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::check::{Drift, HashCheck};
use super::index::BlockIndex;
use super::metrics::PoolKvMetrics;
use super::settings::Settings;
use super::wire::{self, Event, EventBatch};
use super::{BlockHash, BlockHasher, LoraPaths};

/// Digests the hash check remembers per `max_blocks` entry of the index (parents of later
/// blocks: the chains sent recently and the blocks verified).
const CHECK_DIGESTS_PER_BLOCK: usize = 1;

/// One pool's index, endpoints and hash check, as its subscribers and choice share them.
pub(super) struct PoolState {
    pub(super) pool: String,
    pub(super) settings: Settings,
    pub(super) metrics: PoolKvMetrics,
    holdings: RwLock<Holdings>,
    check: Mutex<HashCheck>,
    /// The paths the pool's engines loaded their LoRA adapters from (the pool's, handed in).
    lora_paths: RwLock<Arc<LoraPaths>>,
    disabled: AtomicBool,
    /// A LoRA path drift was logged (once per pool's events source: it recurs per batch).
    lora_drift_said: AtomicBool,
}

/// What the pool's endpoints hold, and where each one's entries sit.
struct Holdings {
    index: BlockIndex,
    /// Endpoint name → its slot in the index and its connection.
    endpoints: HashMap<String, Endpoint>,
}

/// One endpoint subscribed to (or once): its slot in the index and its connection.
struct Endpoint {
    slot: usize,
    connected: bool,
    /// When `connected` last changed (or the endpoint was added).
    since: Instant,
    removed: bool,
}

impl Endpoint {
    fn stale(&self, after: Duration) -> bool {
        self.removed || (!self.connected && self.since.elapsed() >= after)
    }
}

impl PoolState {
    /// An empty state for pool `pool`, its cache-aware choice on.
    pub(super) fn new(pool: &str, settings: Settings, metrics: PoolKvMetrics) -> Self {
        let hasher = BlockHasher::new(&settings.hash_seed, settings.block_size);
        let digests = settings.max_blocks.saturating_mul(CHECK_DIGESTS_PER_BLOCK);
        for gauge in &metrics.disabled {
            gauge.set(0);
        }
        metrics.bound.set(gauge_value(settings.max_blocks));
        PoolState {
            pool: pool.to_owned(),
            holdings: RwLock::new(Holdings {
                index: BlockIndex::new(0, settings.max_blocks),
                endpoints: HashMap::new(),
            }),
            check: Mutex::new(HashCheck::new(hasher, digests)),
            lora_paths: RwLock::new(Arc::default()),
            disabled: AtomicBool::new(false),
            lora_drift_said: AtomicBool::new(false),
            settings,
            metrics,
        }
    }

    /// Takes in the endpoint named `name`, not connected yet; returns its slot (its old one
    /// when it was subscribed to before).
    pub(super) fn add_endpoint(&self, name: &str) -> usize {
        let mut holdings = self.holdings.write();
        let slot = match holdings.endpoints.get(name) {
            Some(known) => known.slot,
            None => holdings.index.add_slot(),
        };
        let endpoint = Endpoint { slot, connected: false, since: Instant::now(), removed: false };
        holdings.endpoints.insert(name.to_owned(), endpoint);
        slot
    }

    /// The endpoint named `name` is no longer subscribed to: what it held is forgotten.
    pub(super) fn remove_endpoint(&self, name: &str) {
        let mut holdings = self.holdings.write();
        if let Some(slot) = holdings.endpoints.get_mut(name).map(|e| {
            e.removed = true;
            e.slot
        }) {
            holdings.index.clear(slot);
            self.metrics.blocks.set(gauge_value(holdings.index.len()));
        }
    }

    /// The slot of the endpoint named `name`, if it was ever subscribed to.
    pub(super) fn slot(&self, name: &str) -> Option<usize> {
        self.holdings.read().endpoints.get(name).map(|e| e.slot)
    }

    /// Whether the endpoint named `name` is connected now.
    pub(super) fn connected(&self, name: &str) -> bool {
        self.holdings.read().endpoints.get(name).is_some_and(|e| e.connected && !e.removed)
    }

    /// The index bound now.
    pub(super) fn max_blocks(&self) -> usize {
        self.holdings.read().index.max_blocks()
    }

    /// Whether a hash mismatch turned this pool's cache-aware choice off.
    pub(super) fn disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// How many leading blocks of `chain` the endpoint named `endpoint` holds; 0 when it is
    /// stale or unknown.
    pub(super) fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
        let holdings = self.holdings.read();
        match holdings.endpoints.get(endpoint) {
            Some(e) if !e.stale(self.settings.stale_after) => holdings.index.held(e.slot, chain),
            _ => 0,
        }
    }

    /// Where the pool's engines loaded their LoRA adapters from, as the hash check reads it.
    pub(super) fn use_lora_paths(&self, paths: Arc<LoraPaths>) {
        *self.lora_paths.write() = paths;
    }

    /// A chain tokenonce sent: the hash check chains the blocks later reported on it.
    pub(super) fn expect(&self, chain: &[BlockHash]) {
        self.check.lock().expect(chain);
    }

    /// True while one endpoint is fresh and no hash mismatch turned the pool off.
    pub(super) fn usable(&self) -> bool {
        let after = self.settings.stale_after;
        !self.disabled() && self.holdings.read().endpoints.values().any(|e| !e.stale(after))
    }

    /// The endpoint in `slot` connected, or lost its connection.
    pub(super) fn set_connected(&self, slot: usize, connected: bool) {
        let mut holdings = self.holdings.write();
        if let Some(e) = holdings.endpoints.values_mut().find(|e| e.slot == slot) {
            e.connected = connected;
            e.since = Instant::now();
        }
    }

    /// The endpoint in `slot` holds nothing (until it reports blocks again).
    pub(super) fn clear(&self, slot: usize) {
        let mut holdings = self.holdings.write();
        holdings.index.clear(slot);
        self.metrics.blocks.set(gauge_value(holdings.index.len()));
    }

    /// Sizes the index for engines holding `engine_blocks` blocks between them
    /// ([`super::settings::bound_for`]) unless its bound was configured; returns the new
    /// bound when it changed.
    pub(super) fn size_for(&self, engine_blocks: u64) -> Option<usize> {
        if self.settings.fixed_bound {
            return None;
        }
        let bound = super::settings::bound_for(engine_blocks);
        let mut holdings = self.holdings.write();
        if holdings.index.max_blocks() == bound {
            return None;
        }
        let evicted = holdings.index.set_max_blocks(bound);
        self.metrics.evicted.inc_by(evicted as u64);
        self.metrics.blocks.set(gauge_value(holdings.index.len()));
        self.metrics.bound.set(gauge_value(bound));
        Some(bound)
    }

    /// One batch from the endpoint in `slot`, in sequence order.
    pub(super) fn apply(&self, slot: usize, batch: &EventBatch) {
        let mut drifts = Vec::new();
        {
            let mut holdings = self.holdings.write();
            let endpoint = holdings.endpoints.iter().find(|(_, e)| e.slot == slot).map(|(n, _)| n.clone());
            let paths = Arc::clone(&self.lora_paths.read());
            let lora_path = |name: &str| paths.path_on(endpoint.as_deref()?, name);
            for event in &batch.events {
                match event {
                    Event::BlockStored(stored) => {
                        if wire::in_device_cache(stored.medium.as_deref(), stored.group_idx) {
                            let evicted = holdings.index.store(slot, stored.block_hashes.iter().map(|h| h.0));
                            self.metrics.evicted.inc_by(evicted as u64);
                        }
                        let outcome = self.check.lock().check(stored, &lora_path);
                        self.metrics.checks_matched.inc_by(outcome.matched);
                        self.metrics.checks_mismatched.inc_by(outcome.mismatched);
                        drifts.extend(outcome.drift);
                    }
                    Event::BlockRemoved(removed) => {
                        if wire::in_device_cache(removed.medium.as_deref(), removed.group_idx) {
                            holdings.index.remove(slot, removed.block_hashes.iter().map(|h| h.0));
                        }
                    }
                    Event::AllBlocksCleared => holdings.index.clear(slot),
                    Event::Other => {}
                }
            }
            self.metrics.blocks.set(gauge_value(holdings.index.len()));
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.metrics.lag.set((now - batch.ts).max(0.0));
        for drift in drifts {
            self.turn_off(drift);
        }
    }

    /// A hash mismatch: cache-aware choice off for the pool, said once (a LoRA adapter's
    /// blocks hashed from another path are only said, once).
    fn turn_off(&self, drift: Drift) {
        if !drift.turns_off() {
            if !self.lora_drift_said.swap(true, Ordering::Relaxed) {
                tracing::warn!(pool = %self.pool, reason = drift.label(), "KV events: {drift}");
            }
            return;
        }
        let position = Drift::LABELS.iter().position(|l| *l == drift.label());
        if let Some(gauge) = position.and_then(|i| self.metrics.disabled.get(i)) {
            gauge.set(1);
        }
        if !self.disabled.swap(true, Ordering::Relaxed) {
            tracing::error!(pool = %self.pool, reason = drift.label(), "cache-aware choice off for the pool: the KV events' block hashes are not tokenonce's: {drift}");
        }
    }
}

fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::metrics::KvMetrics;
    use crate::kv::wire::{Removed, Stored, WireHash};
    use crate::kv::ExtraKeys;

    const BLOCK: usize = 4;
    const IDS: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    fn pool(stale_after: Duration) -> PoolState {
        let settings = Settings {
            port: 5557,
            replay_port: None,
            endpoint_ports: Default::default(),
            endpoint_replay_ports: Default::default(),
            topic: String::new(),
            hash_seed: "0".into(),
            block_size: BLOCK,
            max_blocks: 100,
            fixed_bound: true,
            stale_after,
        };
        let metrics = KvMetrics::register(&prometheus::Registry::new()).expect("registers").pool("p");
        PoolState::new("p", settings, metrics)
    }

    fn chain(seed: &str, ids: &[u32]) -> Vec<BlockHash> {
        BlockHasher::new(seed, BLOCK).chain(ids, &ExtraKeys::default())
    }

    fn wire_hashes(chain: &[BlockHash]) -> Vec<WireHash> {
        chain.iter().map(|h| WireHash(h.wire())).collect()
    }

    /// A `BlockStored` of `ids` hashed with `seed`, in the cache `medium` names.
    fn stored(seed: &str, ids: &[u32], medium: Option<&str>) -> Event {
        Event::BlockStored(Stored {
            block_hashes: wire_hashes(&chain(seed, ids)),
            parent_block_hash: None,
            token_ids: ids.to_vec(),
            block_size: BLOCK,
            lora_name: None,
            medium: medium.map(str::to_owned),
            extra_keys: None,
            group_idx: None,
        })
    }

    fn batch(events: Vec<Event>) -> EventBatch {
        EventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    /// A bound not configured follows the engines' blocks (a lower one evicting, counted); a
    /// configured one never moves.
    #[test]
    fn an_index_not_bounded_by_config_is_sized_from_the_engines() {
        let state = pool(Duration::from_secs(60));
        assert_eq!(state.size_for(10_000_000), None, "configured: stays");
        let mut sized = pool(Duration::from_secs(60));
        sized.settings.fixed_bound = false;
        assert_eq!(sized.size_for(800_000), Some(1_000_000));
        assert_eq!(sized.size_for(800_000), None, "unchanged");
        assert_eq!((sized.max_blocks(), sized.metrics.bound.get()), (1_000_000, 1_000_000));
    }

    #[test]
    fn a_batch_stores_removes_and_clears_the_device_cache_blocks() {
        let state = pool(Duration::from_secs(60));
        let slot = state.add_endpoint("a:1");
        let blocks = chain("0", &IDS);
        state.apply(slot, &batch(vec![stored("0", &IDS, None)]));
        assert_eq!(state.held("a:1", &blocks), 2);
        assert_eq!(state.metrics.blocks.get(), 2);
        assert_eq!(state.metrics.checks_matched.get(), 2, "each stored block hashed again");

        let second = Removed { block_hashes: wire_hashes(&blocks[1..]), medium: None, group_idx: None };
        state.apply(slot, &batch(vec![Event::BlockRemoved(second)]));
        assert_eq!(state.held("a:1", &blocks), 1);

        let offloaded = [9, 10, 11, 12];
        state.apply(slot, &batch(vec![stored("0", &offloaded, Some("CPU"))]));
        assert_eq!(state.held("a:1", &chain("0", &offloaded)), 0, "blocks offloaded to CPU are not indexed");

        state.apply(slot, &batch(vec![Event::AllBlocksCleared, Event::Other]));
        assert_eq!(state.held("a:1", &blocks), 0);
        assert_eq!(state.metrics.blocks.get(), 0);
        assert!(state.usable(), "not connected, but not for stale_after yet");
        assert!(!state.disabled());
    }

    #[test]
    fn a_hash_mismatch_turns_the_pool_off_for_good() {
        let state = pool(Duration::from_secs(60));
        let slot = state.add_endpoint("a:1");
        state.apply(slot, &batch(vec![stored("another seed", &IDS, None)]));
        assert!(state.disabled());
        assert!(!state.usable());
        assert_eq!(state.metrics.checks_mismatched.get(), 1);
        let reasons = state.metrics.disabled.each_ref().map(|g| g.get());
        assert_eq!(reasons, [0, 1], "by Drift::LABELS: block_size, seed_or_algorithm");
        state.apply(slot, &batch(vec![stored("0", &IDS, None)]));
        assert!(state.disabled(), "until the pool's source is built again");
    }

    /// A LoRA block is hashed with the path the publishing endpoint's `/v1/models` listed: the
    /// same path matches; another is counted a mismatch and leaves the pool on.
    #[test]
    fn lora_blocks_are_checked_with_the_endpoints_path_and_a_drift_leaves_the_pool_on() {
        let state = pool(Duration::from_secs(60));
        let slot = state.add_endpoint("a:1");
        let paths = Arc::new(LoraPaths::default());
        paths.learned("a:1", [("sql".to_owned(), "/loras/sql".to_owned())]);
        state.use_lora_paths(Arc::clone(&paths));
        let lora_event = |path: &str| {
            let keys = ExtraKeys { lora: Some(crate::kv::hash::Lora { name: "sql", path }), cache_salt: None };
            let hashes = BlockHasher::new("0", BLOCK).chain(&IDS, &keys);
            let published = Some(wire::BlockKeys { texts: vec!["sql".into()], other: false });
            Event::BlockStored(Stored {
                block_hashes: wire_hashes(&hashes),
                parent_block_hash: None,
                token_ids: IDS.to_vec(),
                block_size: BLOCK,
                lora_name: Some("sql".into()),
                medium: None,
                extra_keys: Some(vec![published.clone(), published]),
                group_idx: None,
            })
        };
        state.apply(slot, &batch(vec![lora_event("/loras/sql")]));
        assert_eq!((state.metrics.checks_matched.get(), state.metrics.checks_mismatched.get()), (2, 0));
        state.apply(slot, &batch(vec![lora_event("/loras/sql-v2")]));
        assert_eq!(state.metrics.checks_mismatched.get(), 1);
        assert!(!state.disabled() && state.usable(), "only that adapter's chains are wrong");
    }

    #[test]
    fn an_endpoint_disconnected_for_stale_after_holds_nothing() {
        let state = pool(Duration::ZERO);
        let slot = state.add_endpoint("a:1");
        let blocks = chain("0", &IDS);
        state.apply(slot, &batch(vec![stored("0", &IDS, None)]));
        assert_eq!(state.held("a:1", &blocks), 0);
        assert!(!state.usable());

        state.set_connected(slot, true);
        assert!(state.connected("a:1"));
        assert_eq!(state.held("a:1", &blocks), 2);
        assert!(state.usable());
        assert_eq!(state.held("b:1", &blocks), 0, "an endpoint never subscribed to");

        state.remove_endpoint("a:1");
        assert!(!state.connected("a:1"));
        assert_eq!(state.held("a:1", &blocks), 0);
        assert_eq!(state.metrics.blocks.get(), 0, "what it held is forgotten");
        assert_eq!(state.add_endpoint("a:1"), slot, "subscribed again: its old slot");
        assert_eq!(state.slot("a:1"), Some(slot));
    }
}
