//! The KV events family, per pool with `kv_events` (no endpoint label: pools grow to
//! hundreds of ranks): the index of held blocks, the subscribers, the hash check
//! ([`KvMetrics`]); one pool's handles ([`PoolKvMetrics`], resolved when its source starts).

use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::check::Drift;
use crate::metrics::{counter, gauge_vec, registered};

/// KV events: the index of held blocks, the subscribers, the hash check (per pool with
/// `kv_events`; no endpoint label: pools grow to hundreds of ranks).
#[derive(Clone)]
pub struct KvMetrics {
    blocks: IntGaugeVec,
    bound: IntGaugeVec,
    evicted: IntCounterVec,
    lag: GaugeVec,
    gaps: IntCounterVec,
    replays: IntCounterVec,
    replays_failed: IntCounterVec,
    reconnects: IntCounterVec,
    hash_checks: IntCounterVec,
    disabled: IntGaugeVec,
}

impl KvMetrics {
    /// Creates and registers the family in `registry`.
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            blocks: gauge_vec(
                registry,
                "tokenonce_kv_blocks",
                "KV events index: (endpoint, block) entries held, by pool.",
                &["pool"],
            )?,
            bound: gauge_vec(
                registry,
                "tokenonce_kv_index_max_blocks",
                "KV events index: its bound in (endpoint, block) entries, by pool (kv_events.max_blocks, or sized from the engines' num_gpu_blocks).",
                &["pool"],
            )?,
            evicted: counter(
                registry,
                "tokenonce_kv_blocks_evicted_total",
                "KV events index: entries dropped by the kv_events.max_blocks bound, by pool.",
                &["pool"],
            )?,
            lag: registered(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tokenonce_kv_events_lag_seconds",
                        "KV events: seconds from the last batch's publication to its arrival, by pool.",
                    ),
                    &["pool"],
                )?,
            )?,
            gaps: counter(
                registry,
                "tokenonce_kv_events_gaps_total",
                "KV events: jumps in an engine's sequence seen on a live connection, by pool.",
                &["pool"],
            )?,
            replays: counter(
                registry,
                "tokenonce_kv_events_replays_total",
                "KV events: replays asked of an engine (each connection's and each gap's), by pool.",
                &["pool"],
            )?,
            replays_failed: counter(
                registry,
                "tokenonce_kv_events_replays_failed_total",
                "KV events: replays that brought no answer (unreachable, silent, cut), by pool; each is asked again later.",
                &["pool"],
            )?,
            reconnects: counter(
                registry,
                "tokenonce_kv_events_reconnects_total",
                "KV events: subscriber connections made again after one was lost, by pool.",
                &["pool"],
            )?,
            hash_checks: counter(
                registry,
                "tokenonce_kv_hash_checks_total",
                "KV events: stored blocks whose hash tokenonce computed again, by pool and result (match, mismatch).",
                &["pool", "result"],
            )?,
            disabled: gauge_vec(
                registry,
                "tokenonce_kv_cache_aware_disabled",
                "1 while a hash mismatch keeps a pool's cache-aware choice off, by pool and reason.",
                &["pool", "reason"],
            )?,
        })
    }

    /// Resolves (and so creates) the KV events series of `pool`.
    pub fn pool(&self, pool: &str) -> PoolKvMetrics {
        let checks = |result: &str| self.hash_checks.with_label_values(&[pool, result]);
        let disabled = Drift::LABELS.map(|reason| self.disabled.with_label_values(&[pool, reason]));
        PoolKvMetrics {
            blocks: self.blocks.with_label_values(&[pool]),
            bound: self.bound.with_label_values(&[pool]),
            evicted: self.evicted.with_label_values(&[pool]),
            lag: self.lag.with_label_values(&[pool]),
            gaps: self.gaps.with_label_values(&[pool]),
            replays: self.replays.with_label_values(&[pool]),
            replays_failed: self.replays_failed.with_label_values(&[pool]),
            reconnects: self.reconnects.with_label_values(&[pool]),
            checks_matched: checks("match"),
            checks_mismatched: checks("mismatch"),
            disabled,
        }
    }

    /// Removes a pool's KV events series (a reload removed the pool or its `kv_events`), so
    /// no alert stays firing on a gauge nothing updates.
    pub fn forget_pool(&self, pool: &str) {
        for family in [&self.evicted, &self.gaps, &self.replays, &self.replays_failed, &self.reconnects] {
            let _ = family.remove_label_values(&[pool]);
        }
        let _ = self.blocks.remove_label_values(&[pool]);
        let _ = self.bound.remove_label_values(&[pool]);
        let _ = self.lag.remove_label_values(&[pool]);
        for result in ["match", "mismatch"] {
            let _ = self.hash_checks.remove_label_values(&[pool, result]);
        }
        for reason in Drift::LABELS {
            let _ = self.disabled.remove_label_values(&[pool, reason]);
        }
    }
}

/// One pool's KV event series, resolved for the pool ([`KvMetrics::pool`]).
#[derive(Clone)]
pub struct PoolKvMetrics {
    /// (endpoint, block) entries in the index.
    pub blocks: IntGauge,
    /// The index's bound.
    pub bound: IntGauge,
    /// Entries the `max_blocks` bound evicted.
    pub evicted: IntCounter,
    /// Seconds between the last batch's publication and its arrival.
    pub lag: Gauge,
    /// Sequence jumps seen on a live connection.
    pub gaps: IntCounter,
    /// Replays asked (each connection's and each gap's).
    pub replays: IntCounter,
    /// Replays that brought no answer (asked again later).
    pub replays_failed: IntCounter,
    /// Connections made again after one was lost.
    pub reconnects: IntCounter,
    /// Blocks whose published hash tokenonce computed again: the same.
    pub checks_matched: IntCounter,
    /// ... and another.
    pub checks_mismatched: IntCounter,
    /// 1 for the reason cache-aware choice was turned off, by [`Drift::LABELS`] order.
    pub disabled: [IntGauge; 2],
}
