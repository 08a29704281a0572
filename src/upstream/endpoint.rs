//! One engine endpoint (a server's address, or one data-parallel rank of it) as choice sees
//! it: requests in flight, last health poll, passive ejection after consecutive failures; and
//! [`Picked`], which counts a request in flight until dropped.

use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::facts::EngineFacts;
use super::metrics::EndpointMetrics;

/// One engine endpoint and what tokenonce knows about it.
#[derive(Debug)]
pub struct Endpoint {
    /// `host:port`: where its legs connect.
    pub addr: String,
    /// The data-parallel rank its legs name (`X-data-parallel-rank`), when the pool lists
    /// one (`host:port#R`): several endpoints then share an address.
    pub rank: Option<u32>,
    /// `host:port`, or `host:port#R` with a rank: what tells it from the pool's other
    /// endpoints (metrics, logs, failover, stored-answer homes).
    pub name: String,
    /// Its pool's TLS (`None`: plain HTTP).
    pub tls: Option<crate::tls::UpstreamTls>,
    inflight: AtomicUsize,
    /// Prompt tokens of the requests in flight here that this instance expects the engine to
    /// compute (what cache-aware picks charged): the queue a cost reads between two
    /// `/metrics` reads.
    queued_tokens: AtomicU64,
    /// Prompt tokens its engine computes now for this instance's requests sent to it alone
    /// (no prefill leg), each until its answer begins: the room the prefill decision reads.
    computing_alone: AtomicU64,
    healthy: AtomicBool,
    /// Passive outlier detection: consecutive failures and the ejection they caused.
    outlier: RwLock<Outlier>,
    /// What asking the engine taught: its vLLM version and the model it serves.
    facts: EngineFacts,
    /// Its `endpoint_errors_total` series, resolved when its pool is built (none: a one-off
    /// endpoint named by a header, or a pool built outside an [`App`](crate::app::App)).
    errors: OnceLock<EndpointMetrics>,
}

/// Longest ejection: an engine back after a long outage is tried again within this.
pub const EJECT_MAX: Duration = Duration::from_secs(120);

/// When a pool ejects an endpoint, and for how long the first time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionRule {
    /// Consecutive failures that eject (0: never).
    pub after: u32,
    /// The first ejection's length; it doubles with each ejection in a row.
    pub base: Duration,
}

impl EjectionRule {
    /// The rule `[upstream]` sets.
    pub fn of(upstream: &crate::config::Upstream) -> Self {
        Self { after: upstream.eject_after_failures, base: upstream.eject_base_ms }
    }
}

/// Consecutive request failures of one endpoint and its ejection, if any.
#[derive(Debug, Default, Clone, Copy)]
struct Outlier {
    /// Failures since the last success.
    failures: u32,
    /// Ejections since the last success (the backoff's exponent).
    ejections: u32,
    /// Skipped by `pick` until then.
    until: Option<Instant>,
}

/// Length of the `n`th ejection in a row (`n` from 1): `base` doubling, capped at
/// [`EJECT_MAX`].
fn backoff(n: u32, base: Duration) -> Duration {
    let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
    base.checked_mul(factor).map_or(EJECT_MAX, |d| d.min(EJECT_MAX))
}

impl Endpoint {
    /// A new endpoint, not yet known healthy.
    pub fn new(addr: impl Into<String>) -> Self {
        let addr = addr.into();
        Self {
            name: addr.clone(),
            addr,
            rank: None,
            tls: None,
            inflight: AtomicUsize::new(0),
            queued_tokens: AtomicU64::new(0),
            computing_alone: AtomicU64::new(0),
            healthy: AtomicBool::new(false),
            outlier: RwLock::new(Outlier::default()),
            facts: EngineFacts::default(),
            errors: OnceLock::new(),
        }
    }

    /// Gives it its error series (once: a pool carried over a reload keeps the first).
    pub fn count_errors_in(&self, series: EndpointMetrics) {
        let _ = self.errors.set(series);
    }

    /// Counts one failure of this endpoint in `endpoint_errors_total` (when it has series).
    pub fn error(&self, kind: crate::metrics::ErrorKind) {
        if let Some(series) = self.errors.get() {
            series.error(kind);
        }
    }

    /// A new endpoint reached with `tls`.
    pub fn with_tls(addr: impl Into<String>, tls: Option<crate::tls::UpstreamTls>) -> Self {
        Self { tls, ..Self::new(addr) }
    }

    /// A new endpoint for `rank` of the server at `addr` (`None`: the whole server).
    pub fn with_rank(addr: &str, rank: Option<u32>, tls: Option<crate::tls::UpstreamTls>) -> Self {
        Self { rank, name: endpoint_name(addr, rank), ..Self::with_tls(addr, tls) }
    }

    /// The header naming its data-parallel rank on every leg to it, when it has one.
    pub fn rank_header(&self) -> Option<(&'static str, String)> {
        self.rank.map(|r| (super::DP_RANK_HEADER, r.to_string()))
    }

    /// Where its legs go.
    pub fn target(&self) -> crate::upstream::client::Target<'_> {
        crate::upstream::client::Target { addr: &self.addr, tls: self.tls.as_ref() }
    }

    /// What asking the engine taught: its vLLM version and the model it serves.
    pub fn facts(&self) -> &EngineFacts {
        &self.facts
    }

    /// True while an ejection is running at `now`.
    pub fn is_ejected(&self, now: Instant) -> bool {
        self.outlier.read().until.is_some_and(|until| now < until)
    }

    /// Records a request the endpoint served (an answer below 500): ends any ejection streak.
    pub fn request_succeeded(&self) {
        *self.outlier.write() = Outlier::default();
    }

    /// Records a request the endpoint failed (no answer, or a 5xx) at `now`. At `rule.after`
    /// consecutive failures (0: never) the endpoint is ejected for `rule.base`, and again on
    /// every failure after that ejection ended, each time for twice as long (up to
    /// [`EJECT_MAX`]). Returns true when this failure ejected it.
    pub fn request_failed(&self, now: Instant, rule: EjectionRule) -> bool {
        let mut o = self.outlier.write();
        o.failures = o.failures.saturating_add(1);
        let running = o.until.is_some_and(|until| now < until);
        if rule.after == 0 || o.failures < rule.after || running {
            return false;
        }
        o.ejections = o.ejections.saturating_add(1);
        o.until = now.checked_add(backoff(o.ejections, rule.base));
        true
    }

    /// Requests in flight to it.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Prompt tokens the requests in flight here were charged when picked (see
    /// [`Picked::charged`]).
    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens.load(Ordering::Relaxed)
    }

    /// Prompt tokens it computes now for requests sent to it alone (see [`ComputingAlone`]).
    pub fn computing_alone_tokens(&self) -> u64 {
        self.computing_alone.load(Ordering::Relaxed)
    }

    /// Last health poll result.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health poll result; returns the previous one.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        self.healthy.swap(healthy, Ordering::Relaxed)
    }
}

/// The name of the endpoint for `rank` of the server at `addr`: `host:port`, or `host:port#R`.
pub(super) fn endpoint_name(addr: &str, rank: Option<u32>) -> String {
    rank.map_or_else(|| addr.to_owned(), |r| format!("{addr}#{r}"))
}

/// An endpoint chosen for one request; counts as in flight until dropped.
#[derive(Debug)]
pub struct Picked {
    endpoint: Arc<Endpoint>,
    /// The pool it came from (`None`: a one-off endpoint, never ejected).
    pool: Option<Arc<PoolEjection>>,
    /// Prompt tokens it adds to the endpoint's queue while held.
    charge: u64,
}

/// The ejection rule of a pool, as each endpoint picked from it carries it: the pool's name
/// (the label its ejections are counted under) and when and how long it ejects.
#[derive(Debug)]
pub struct PoolEjection {
    /// Name from config.
    pub name: String,
    /// When an endpoint is ejected, and for how long.
    pub rule: EjectionRule,
}

impl Picked {
    /// Marks `endpoint` in flight.
    pub fn new(endpoint: Arc<Endpoint>) -> Self {
        endpoint.inflight.fetch_add(1, Ordering::Relaxed);
        Self { endpoint, pool: None, charge: 0 }
    }

    /// Marks `endpoint`, picked from the pool ejecting by `pool`, in flight.
    pub(super) fn from_pool(endpoint: Arc<Endpoint>, pool: Arc<PoolEjection>) -> Self {
        let mut picked = Self::new(endpoint);
        picked.pool = Some(pool);
        picked
    }

    /// The same pick, adding `tokens` to its endpoint's queued tokens until dropped: the
    /// prompt tokens a cache-aware pick expects the engine to compute for it.
    #[must_use]
    pub fn charged(mut self, tokens: u64) -> Self {
        self.endpoint.queued_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.charge = self.charge.saturating_add(tokens);
        self
    }

    /// The ejection rule of the pool it was picked from (`None`: a one-off endpoint, never
    /// ejected).
    pub fn ejection(&self) -> Option<&PoolEjection> {
        self.pool.as_deref()
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// Its `host:port`.
    pub fn addr(&self) -> &str {
        &self.endpoint.addr
    }

    /// Its name in its pool: `host:port`, or `host:port#R` for one data-parallel rank.
    pub fn name(&self) -> &str {
        &self.endpoint.name
    }
}

impl Drop for Picked {
    fn drop(&mut self) {
        self.endpoint.inflight.fetch_sub(1, Ordering::Relaxed);
        self.endpoint.queued_tokens.fetch_sub(self.charge, Ordering::Relaxed);
    }
}

/// The prompt tokens a request sent to a decode alone has its engine compute, counted on the
/// endpoint while held: dropped when the answer begins (the prompt is computed) or the
/// request ends.
#[derive(Debug)]
pub struct ComputingAlone {
    endpoint: Arc<Endpoint>,
    tokens: u64,
}

impl ComputingAlone {
    /// Counts `tokens` computing on `endpoint`.
    pub fn new(endpoint: &Arc<Endpoint>, tokens: u64) -> Self {
        endpoint.computing_alone.fetch_add(tokens, Ordering::Relaxed);
        Self { endpoint: Arc::clone(endpoint), tokens }
    }
}

impl Drop for ComputingAlone {
    fn drop(&mut self) {
        self.endpoint.computing_alone.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The default first ejection (`upstream.eject_base_ms`).
    pub(crate) const EJECT_BASE: Duration = Duration::from_secs(5);

    /// Ejecting at `after` failures for [`EJECT_BASE`].
    pub(crate) fn rule(after: u32) -> EjectionRule {
        EjectionRule { after, base: EJECT_BASE }
    }

    #[test]
    fn computing_alone_counts_until_dropped() {
        let e = Arc::new(Endpoint::new("127.0.0.1:9000"));
        let first = ComputingAlone::new(&e, 300);
        let second = ComputingAlone::new(&e, 40);
        assert_eq!(e.computing_alone_tokens(), 340);
        drop(first);
        assert_eq!(e.computing_alone_tokens(), 40);
        drop(second);
        assert_eq!(e.computing_alone_tokens(), 0);
    }

    #[test]
    fn ejection_backoff_doubles_up_to_the_cap() {
        assert_eq!(backoff(1, EJECT_BASE), EJECT_BASE);
        assert_eq!(backoff(2, EJECT_BASE), EJECT_BASE * 2);
        assert_eq!(backoff(4, EJECT_BASE), EJECT_BASE * 8);
        assert_eq!(backoff(6, EJECT_BASE), EJECT_MAX);
        assert_eq!(backoff(u32::MAX, EJECT_BASE), EJECT_MAX);
    }

    #[test]
    fn consecutive_failures_eject_and_a_success_resets() {
        let e = Endpoint::new("127.0.0.1:9000");
        let t0 = Instant::now();
        assert!(!e.request_failed(t0, rule(3)));
        assert!(!e.request_failed(t0, rule(3)));
        assert!(e.request_failed(t0, rule(3)), "third failure in a row ejects");
        assert!(e.is_ejected(t0 + EJECT_BASE - Duration::from_millis(1)));
        assert!(!e.request_failed(t0 + Duration::from_secs(1), rule(3)), "no second ejection while one runs");
        let t1 = t0 + EJECT_BASE;
        assert!(!e.is_ejected(t1), "readmitted when the backoff ends");
        assert!(e.request_failed(t1, rule(3)), "still failing: ejected again at once");
        assert!(e.is_ejected(t1 + EJECT_BASE * 2 - Duration::from_millis(1)), "for twice as long");
        assert!(!e.is_ejected(t1 + EJECT_BASE * 2));
        e.request_succeeded();
        let t2 = t1 + EJECT_BASE * 2;
        assert!(!e.request_failed(t2, rule(3)) && !e.request_failed(t2, rule(3)), "a success starts over");
        assert!(e.request_failed(t2, rule(3)));
        assert!(!e.is_ejected(t2 + EJECT_BASE), "and the backoff too");
    }

    #[test]
    fn zero_never_ejects() {
        let e = Endpoint::new("127.0.0.1:9000");
        let t0 = Instant::now();
        assert!((0..100).all(|_| !e.request_failed(t0, rule(0))));
        assert!(!e.is_ejected(t0));
    }
}
