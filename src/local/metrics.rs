//! The local-ids family: checks against the prefill's echo, requests not rendered, trust and
//! token-in per shape, the history drift of follow-up turns, and each pool's segment cache
//! (read from its stats at a scrape) ([`LocalMetrics`]).

use prometheus::{IntCounterVec, IntGaugeVec, Registry};

use crate::metrics::{counter, gauge_vec, HistoryResult, LocalIdsResult};

/// Local ids: checks, trust, token-in, prompt history and the segment cache, per pool.
#[derive(Clone)]
pub struct LocalMetrics {
    local_ids_checks: IntCounterVec,
    local_ids_unsupported: IntCounterVec,
    segment_cache_lookups: IntCounterVec,
    segment_cache_bytes: IntGaugeVec,
    local_ids_trusted: IntGaugeVec,
    local_ids_token_in: IntCounterVec,
    prompt_history_turns: IntCounterVec,
    prompt_history_drift_tokens: IntCounterVec,
    prompt_history_drift_start: IntCounterVec,
}

impl LocalMetrics {
    /// Creates and registers the family in `registry`.
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            local_ids_checks: counter(
                registry,
                "tokenonce_local_ids_checks_total",
                "Requests whose prompt ids tokenonce computed itself and compared with the prefill's echo (local_ids = shadow), by pool, request shape and result: match, mismatch, unsupported, dropped.",
                &["pool", "shape", "result"],
            )?,
            local_ids_unsupported: counter(
                registry,
                "tokenonce_local_ids_unsupported_total",
                "Local-ids checks not made because tokenonce does not render the request faithfully, by pool and reason.",
                &["pool", "reason"],
            )?,
            segment_cache_lookups: counter(
                registry,
                "tokenonce_segment_cache_lookups_total",
                "Segments of rendered prompts looked up in a pool's token cache (local ids): hit (ids reused) or miss (encoded); counted at a scrape.",
                &["pool", "result"],
            )?,
            local_ids_trusted: gauge_vec(
                registry,
                "tokenonce_local_ids_trusted",
                "1 while a shape of a pool's requests has matched its echo local_ids_verify_after times in a row (with local_ids = \"on\" its prefills go token-in), read when scraped.",
                &["pool", "shape"],
            )?,
            local_ids_token_in: counter(
                registry,
                "tokenonce_local_ids_token_in_total",
                "Prefills sent token-in with tokenonce's own ids (local_ids = \"on\", a trusted shape): the prefill neither rendered, tokenized nor echoed them, and the decode got the same ids.",
                &["pool", "shape"],
            )?,
            prompt_history_turns: counter(
                registry,
                "tokenonce_prompt_history_turns_total",
                "Follow-up chat turns (local ids, checked and matching the echo) whose conversation before them tokenonce rendered again as it stood when its last assistant turn was generated, by pool and result: same (repeated token for token) or drift (the template renders part of it otherwise).",
                &["pool", "result"],
            )?,
            prompt_history_drift_tokens: counter(
                registry,
                "tokenonce_prompt_history_drift_tokens_total",
                "Tokens of the earlier conversation that follow-up turns render otherwise than when it was generated, from the first difference on: prefix-cache misses the chat template causes, by pool.",
                &["pool"],
            )?,
            prompt_history_drift_start: counter(
                registry,
                "tokenonce_prompt_history_drift_start_tokens_total",
                "Sum over drifting follow-up turns of the position of their first differing token (over prompt_history_turns_total{result=\"drift\"}: where drift starts, on average), by pool.",
                &["pool"],
            )?,
            segment_cache_bytes: gauge_vec(
                registry,
                "tokenonce_segment_cache_bytes",
                "Bytes a pool's token cache holds (segment texts, their ids and bookkeeping), read when scraped.",
                &["pool"],
            )?,
        })
    }

    /// Adds a pool's token-cache hits and misses and sets its size.
    pub fn segment_cache(&self, pool: &str, hits: u64, misses: u64, bytes: usize) {
        let lookups = &self.segment_cache_lookups;
        lookups.with_label_values(&[pool, "hit"]).inc_by(hits);
        lookups.with_label_values(&[pool, "miss"]).inc_by(misses);
        self.segment_cache_bytes.with_label_values(&[pool]).set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets whether a pool's shape is trusted for local ids (its token-in count shows as 0
    /// from then on too, instead of a gap).
    pub fn trusted(&self, pool: &str, shape: &str, trusted: bool) {
        self.local_ids_trusted.with_label_values(&[pool, shape]).set(i64::from(trusted));
        self.local_ids_token_in.with_label_values(&[pool, shape]).inc_by(0);
    }

    /// Counts one follow-up turn whose history was rendered again: `changed` tokens of it from
    /// position `at` on render otherwise (0: none).
    pub fn prompt_history(&self, pool: &str, at: usize, changed: usize) {
        let result = if changed == 0 { HistoryResult::Same } else { HistoryResult::Drift };
        self.prompt_history_turns.with_label_values(&[pool, result.as_str()]).inc();
        if changed > 0 {
            self.prompt_history_drift_tokens.with_label_values(&[pool]).inc_by(changed as u64);
            self.prompt_history_drift_start.with_label_values(&[pool]).inc_by(at as u64);
        }
    }

    /// Shows a local-ids pool's history series from its first scrape (0 until a follow-up
    /// turn is checked, instead of a gap).
    pub fn prompt_history_seen(&self, pool: &str) {
        for result in HistoryResult::ALL {
            self.prompt_history_turns.with_label_values(&[pool, result.as_str()]).inc_by(0);
        }
        self.prompt_history_drift_tokens.with_label_values(&[pool]).inc_by(0);
        self.prompt_history_drift_start.with_label_values(&[pool]).inc_by(0);
    }

    /// Counts one prefill sent token-in with tokenonce's ids.
    pub fn token_in(&self, pool: &str, shape: &str) {
        self.local_ids_token_in.with_label_values(&[pool, shape]).inc();
    }

    /// Counts one local-ids check.
    pub fn check(&self, pool: &str, shape: &str, result: LocalIdsResult) {
        self.local_ids_checks.with_label_values(&[pool, shape, result.as_str()]).inc();
    }

    /// Counts one request local ids do not cover, by reason.
    pub fn unsupported(&self, pool: &str, reason: &str) {
        self.local_ids_unsupported.with_label_values(&[pool, reason]).inc();
    }
}
