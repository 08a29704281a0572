//! The relay id cache's family: entries and bytes held, lookups by result, evictions by
//! reason ([`IdCacheMetrics`]).

use prometheus::{IntCounterVec, IntGauge, Registry};

use crate::metrics::{counter, gauge, CacheLookup, Eviction};

/// The relay id cache.
#[derive(Clone)]
pub struct IdCacheMetrics {
    cache_entries: IntGauge,
    cache_bytes: IntGauge,
    cache_lookups: IntCounterVec,
    cache_evictions: IntCounterVec,
}

impl IdCacheMetrics {
    /// Creates and registers the family in `registry`, every lookup result and eviction
    /// reason included (zeros instead of gaps).
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let metrics = Self {
            cache_entries: gauge(registry, "tokenonce_cache_entries", "Relay id cache: entries held.")?,
            cache_bytes: gauge(registry, "tokenonce_cache_bytes", "Relay id cache: bytes of ids held.")?,
            cache_lookups: counter(
                registry,
                "tokenonce_cache_lookups_total",
                "Relay id cache lookups by result (hit, miss, expired, mismatch).",
                &["result"],
            )?,
            cache_evictions: counter(
                registry,
                "tokenonce_cache_evictions_total",
                "Relay id cache evictions by reason (ttl, capacity).",
                &["reason"],
            )?,
        };
        for result in CacheLookup::ALL {
            metrics.cache_lookups.with_label_values(&[result.as_str()]);
        }
        for reason in Eviction::ALL {
            metrics.cache_evictions.with_label_values(&[reason.as_str()]);
        }
        Ok(metrics)
    }

    /// Counts one relay cache lookup.
    pub fn lookup(&self, result: CacheLookup) {
        self.cache_lookups.with_label_values(&[result.as_str()]).inc();
    }

    /// Counts cache evictions and sets the cache gauges to `entries` and `bytes`.
    pub fn state(&self, ttl_evicted: u64, capacity_evicted: u64, entries: usize, bytes: usize) {
        for (reason, n) in [(Eviction::Ttl, ttl_evicted), (Eviction::Capacity, capacity_evicted)] {
            if n > 0 {
                self.cache_evictions.with_label_values(&[reason.as_str()]).inc_by(n);
            }
        }
        self.cache_entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.cache_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}
