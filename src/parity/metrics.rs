//! The parity watch's family: sampled checks by result, reuse turned off and held off per
//! route, and whether a route's pools serve different models ([`ParityMetrics`]); one route's
//! handles ([`RouteParityMetrics`], resolved when its watch is built).

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::metrics::{counter, gauge_vec, ParityResult};

/// The parity watch and the pools' model identity.
#[derive(Clone)]
pub struct ParityMetrics {
    parity_checks: IntCounterVec,
    parity_reuse_disabled: IntCounterVec,
    parity_reuse_off: IntGaugeVec,
    models_differ: IntGaugeVec,
}

impl ParityMetrics {
    /// Creates and registers the family in `registry`.
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            parity_checks: counter(
                registry,
                "tokenonce_parity_checks_total",
                "Sampled checks that reused ids decode to their request (match, mismatch, skipped, dropped).",
                &["route", "result"],
            )?,
            parity_reuse_disabled: counter(
                registry,
                "tokenonce_parity_reuse_disabled_total",
                "Times a parity mismatch turned token reuse off for the route (on_parity_mismatch = disable_reuse).",
                &["route"],
            )?,
            parity_reuse_off: gauge_vec(
                registry,
                "tokenonce_parity_reuse_off",
                "1 while a parity mismatch holds token reuse off for the route.",
                &["route"],
            )?,
            models_differ: gauge_vec(
                registry,
                "tokenonce_pool_models_differ",
                "1 while the route's prefill and decode pools report different models in GET /v1/models.",
                &["route"],
            )?,
        })
    }

    /// Resolves (and so creates) a route's parity series.
    pub fn route(&self, route: &str) -> RouteParityMetrics {
        RouteParityMetrics {
            checks: ParityResult::ALL
                .iter()
                .map(|r| self.parity_checks.with_label_values(&[route, r.as_str()]))
                .collect(),
            reuse_disabled: self.parity_reuse_disabled.with_label_values(&[route]),
            reuse_off: self.parity_reuse_off.with_label_values(&[route]),
        }
    }

    /// Sets whether `route`'s prefill and decode pools serve different models.
    pub fn models_differ(&self, route: &str, differ: bool) {
        self.models_differ.with_label_values(&[route]).set(i64::from(differ));
    }

    /// Removes a route's model-identity gauge (the route is gone, or has no prefill pool now).
    pub fn forget_models_differ(&self, route: &str) {
        let _ = self.models_differ.remove_label_values(&[route]);
    }

    /// Removes a route's parity-hold gauge (the route is gone, or is passthrough now).
    pub fn forget_parity_hold(&self, route: &str) {
        let _ = self.parity_reuse_off.remove_label_values(&[route]);
    }
}

/// One route's parity-watch series.
#[derive(Clone)]
pub struct RouteParityMetrics {
    /// By [`ParityResult`].
    checks: Vec<IntCounter>,
    reuse_disabled: IntCounter,
    reuse_off: IntGauge,
}

impl RouteParityMetrics {
    /// Counts one check.
    pub fn check(&self, result: ParityResult) {
        if let Some(c) = self.checks.get(result as usize) {
            c.inc();
        }
    }

    /// Counts reuse turned off, and marks it off.
    pub fn reuse_disabled(&self) {
        self.reuse_disabled.inc();
        self.reuse_off.set(1);
    }

    /// Marks reuse on again.
    pub fn reuse_back_on(&self) {
        self.reuse_off.set(0);
    }

    /// Sets the `reuse_off` gauge to a hold's state (when the route's watch is built).
    pub fn show_hold(&self, held: bool) {
        self.reuse_off.set(i64::from(held));
    }
}
