//! Pools of engine endpoints (one per data-parallel rank of a server listed with its ranks),
//! listed in config or discovered by DNS (their members then swapped as a snapshot: see
//! `discovery`), with round-robin or least-in-flight choice, per-endpoint health and vLLM
//! version, passive ejection after consecutive failures, and an in-flight guard that counts a
//! request until dropped.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::discovery::Discovery;
use crate::config::{Balance, PoolResources, Version};

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
    healthy: AtomicBool,
    version: RwLock<Option<Version>>,
    /// When the version was learned (it is asked again after a while).
    version_learned_at: RwLock<Option<std::time::Instant>>,
    /// When `/version` was last asked and gave nothing usable (retried after a pause).
    version_failed_at: RwLock<Option<std::time::Instant>>,
    /// Held while a request asks `/version`, so a burst of first requests asks once.
    pub version_ask: tokio::sync::Mutex<()>,
    /// Passive outlier detection: consecutive failures and the ejection they caused.
    outlier: RwLock<Outlier>,
    /// What `GET /v1/models` said: `None` not asked yet, `Some(None)` asked without a usable
    /// answer.
    model: RwLock<Option<Option<ModelIdentity>>>,
    /// Its `endpoint_errors_total` series, resolved when its pool is built (none: a one-off
    /// endpoint named by a header, or a pool built outside an [`App`](crate::app::App)).
    errors: std::sync::OnceLock<crate::metrics::EndpointMetrics>,
}

/// The model an engine serves, from `GET /v1/models` (its first base model): engines whose
/// identities differ must not exchange prompt ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// The served model name (`id`).
    pub id: String,
    /// Where the weights came from (`root`).
    pub root: Option<String>,
    /// The context length (`max_model_len`).
    pub max_model_len: Option<u64>,
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
            healthy: AtomicBool::new(false),
            version: RwLock::new(None),
            version_learned_at: RwLock::new(None),
            version_failed_at: RwLock::new(None),
            version_ask: tokio::sync::Mutex::new(()),
            outlier: RwLock::new(Outlier::default()),
            model: RwLock::new(None),
            errors: std::sync::OnceLock::new(),
        }
    }

    /// Gives it its error series (once: a pool carried over a reload keeps the first).
    pub fn count_errors_in(&self, series: crate::metrics::EndpointMetrics) {
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

    /// True while an ejection is running at `now`.
    pub fn is_ejected(&self, now: Instant) -> bool {
        self.outlier.read().ok().and_then(|o| o.until).is_some_and(|until| now < until)
    }

    /// Records a request the endpoint served (an answer below 500): ends any ejection streak.
    pub fn request_succeeded(&self) {
        if let Ok(mut o) = self.outlier.write() {
            *o = Outlier::default();
        }
    }

    /// Records a request the endpoint failed (no answer, or a 5xx) at `now`. At `rule.after`
    /// consecutive failures (0: never) the endpoint is ejected for `rule.base`, and again on
    /// every failure after that ejection ended, each time for twice as long (up to
    /// [`EJECT_MAX`]). Returns true when this failure ejected it.
    pub fn request_failed(&self, now: Instant, rule: EjectionRule) -> bool {
        let Ok(mut o) = self.outlier.write() else { return false };
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

    /// Last health poll result.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health poll result; returns the previous one.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        self.healthy.swap(healthy, Ordering::Relaxed)
    }

    /// The vLLM version learned from `GET /version`.
    pub fn version(&self) -> Option<Version> {
        self.version.read().ok().and_then(|v| *v)
    }

    /// True when `/version` may be asked now: never failed, or failed over `pause` ago.
    pub fn may_ask_version(&self, pause: std::time::Duration) -> bool {
        self.version_failed_at.read().ok().and_then(|t| *t).is_none_or(|t| t.elapsed() >= pause)
    }

    /// Records that `/version` gave nothing usable.
    pub fn version_failed(&self) {
        if let Ok(mut t) = self.version_failed_at.write() {
            *t = Some(std::time::Instant::now());
        }
    }

    /// Records the version.
    pub fn set_version(&self, version: Version) {
        if let Ok(mut v) = self.version.write() {
            *v = Some(version);
        }
        if let Ok(mut t) = self.version_learned_at.write() {
            *t = Some(std::time::Instant::now());
        }
    }

    /// True when the version was learned over `age` ago (or never).
    pub fn version_older_than(&self, age: std::time::Duration) -> bool {
        self.version_learned_at.read().ok().and_then(|t| *t).is_none_or(|t| t.elapsed() >= age)
    }

    /// Forgets the version: the engine went away and may come back as another vLLM.
    pub fn forget_version(&self) {
        if let Ok(mut v) = self.version.write() {
            *v = None;
        }
        if let Ok(mut t) = self.version_learned_at.write() {
            *t = None;
        }
    }

    /// The model `GET /v1/models` reported, if known.
    pub fn model(&self) -> Option<ModelIdentity> {
        self.model.read().ok().and_then(|m| m.clone().flatten())
    }

    /// True once `/v1/models` was asked (since the endpoint last turned healthy).
    pub fn model_asked(&self) -> bool {
        self.model.read().is_ok_and(|m| m.is_some())
    }

    /// Records what `/v1/models` said (`None`: nothing usable).
    pub fn set_model(&self, model: Option<ModelIdentity>) {
        if let Ok(mut m) = self.model.write() {
            *m = Some(model);
        }
    }

    /// Forgets the model: the engine went away and may come back serving another.
    pub fn forget_model(&self) {
        if let Ok(mut m) = self.model.write() {
            *m = None;
        }
    }

    /// Ends the pause after a failed `/version` (the engine answers `/health` again).
    pub fn end_version_pause(&self) {
        if let Ok(mut t) = self.version_failed_at.write() {
            *t = None;
        }
    }
}

/// The name of the endpoint for `rank` of the server at `addr`: `host:port`, or `host:port#R`.
fn endpoint_name(addr: &str, rank: Option<u32>) -> String {
    rank.map_or_else(|| addr.to_owned(), |r| format!("{addr}#{r}"))
}

/// An endpoint chosen for one request; counts as in flight until dropped.
#[derive(Debug)]
pub struct Picked {
    endpoint: Arc<Endpoint>,
    /// The pool it came from (`None`: a one-off endpoint, never ejected).
    pool: Option<Arc<PoolEjection>>,
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
        Self { endpoint, pool: None }
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
    }
}

/// A named pool.
#[derive(Debug)]
pub struct Pool {
    /// Name from config.
    pub name: String,
    /// Its endpoints now: the configured list (never empty: config validation), or a
    /// discovered pool's last answer (empty until its first), swapped whole so a request
    /// choosing reads one consistent list and an endpoint that left lives on in the
    /// [`Picked`]s that hold it.
    members: ArcSwap<Vec<Arc<Endpoint>>>,
    /// Where its members come from when DNS gives them (`None`: the configured list).
    discovery: Option<Discovery>,
    /// Its TLS, which every endpoint it makes gets.
    tls: Option<crate::tls::UpstreamTls>,
    balance: Balance,
    pinned_version: Option<Version>,
    next: AtomicUsize,
    /// Its ejection rule, shared with every [`Picked`] of this pool.
    ejection: Arc<PoolEjection>,
}

impl Pool {
    /// The pool `name` as configured, with its loaded TLS, ejecting endpoints by `rule`.
    pub fn new(name: &str, spec: &crate::config::Pool, loaded: &PoolResources, rule: EjectionRule) -> Self {
        // An entry with a rank range is one endpoint per rank (config validation vouches for
        // every entry's form).
        let listed: Vec<Arc<Endpoint>> = spec
            .endpoints
            .iter()
            .filter_map(|entry| crate::addr::endpoint_ranks(entry))
            .flat_map(|(addr, ranks)| {
                ranks.into_iter().map(move |rank| Arc::new(Endpoint::with_rank(addr, rank, loaded.tls.clone())))
            })
            .collect();
        Self {
            name: name.to_owned(),
            members: ArcSwap::from_pointee(listed),
            discovery: spec.discover.as_deref().and_then(|d| Discovery::parse(d, spec.discover_interval_ms)),
            tls: loaded.tls.clone(),
            balance: spec.balance,
            pinned_version: spec.vllm_version,
            next: AtomicUsize::new(0),
            ejection: Arc::new(PoolEjection { name: name.to_owned(), rule }),
        }
    }

    /// Its endpoints now (a discovered pool's change between two calls).
    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.members.load_full()
    }

    /// Where its members come from when DNS gives them (`None`: the configured list).
    pub fn discovery(&self) -> Option<&Discovery> {
        self.discovery.as_ref()
    }

    /// Makes its members the endpoints at `addrs` (each once per rank of its discovery; a
    /// pool without discovery takes no rank): an endpoint already a member stays the same
    /// [`Endpoint`] (its health, ejection, version and in-flight count), a new one joins not
    /// yet healthy, and the others leave (requests holding them finish). Members are kept in
    /// address order, so a set that does not change keeps its round-robin order.
    pub fn replace_members(&self, addrs: &[std::net::SocketAddr]) -> Membership {
        let mut addrs = addrs.to_vec();
        addrs.sort_unstable();
        addrs.dedup();
        let ranks = self.discovery.as_ref().map_or_else(|| vec![None], |d| d.ranks().to_vec());
        let old = self.endpoints();
        let mut joined = Vec::new();
        let mut members = Vec::with_capacity(addrs.len() * ranks.len());
        for addr in addrs.iter().map(std::string::ToString::to_string) {
            for &rank in &ranks {
                let name = endpoint_name(&addr, rank);
                let kept = old.iter().find(|e| e.name == name).cloned();
                members.push(kept.unwrap_or_else(|| {
                    let fresh = Arc::new(Endpoint::with_rank(&addr, rank, self.tls.clone()));
                    joined.push(Arc::clone(&fresh));
                    fresh
                }));
            }
        }
        let left = old.iter().filter(|e| !members.iter().any(|m| m.name == e.name)).cloned().collect();
        self.members.store(Arc::new(members));
        Membership { joined, left }
    }

    /// The addresses of its members (each once), as [`Pool::replace_members`] takes them: a
    /// discovered pool rebuilt by a reload starts from its predecessor's.
    pub fn member_addrs(&self) -> Vec<std::net::SocketAddr> {
        let mut addrs: Vec<std::net::SocketAddr> =
            self.endpoints().iter().filter_map(|e| e.addr.parse().ok()).collect();
        addrs.sort_unstable();
        addrs.dedup();
        addrs
    }

    /// When it ejects an endpoint, and for how long.
    pub fn ejection_rule(&self) -> EjectionRule {
        self.ejection.rule
    }

    /// Endpoints ejected at `now`.
    pub fn ejected(&self, now: Instant) -> usize {
        self.endpoints().iter().filter(|e| e.is_ejected(now)).count()
    }

    /// The version pinned in config, if any.
    pub fn pinned_version(&self) -> Option<Version> {
        self.pinned_version
    }

    /// True when some endpoint passed its last health poll.
    pub fn any_healthy(&self) -> bool {
        self.endpoints().iter().any(|e| e.is_healthy())
    }

    /// Chooses an endpoint now: see [`Pool::pick_at`].
    pub fn pick(&self) -> Option<Picked> {
        self.pick_at(Instant::now(), &[])
    }

    /// Chooses an endpoint at `now`, not one of `tried` unless every endpoint was: endpoints
    /// not ejected first (all when every one is), among them healthy ones first (all when
    /// none is), then by the policy.
    pub fn pick_at(&self, now: Instant, tried: &[&str]) -> Option<Picked> {
        let members = self.endpoints();
        let untried = prefer(members.iter().collect(), &|e| !tried.contains(&e.name.as_str()));
        let live = prefer(untried, &|e| !e.is_ejected(now));
        let candidates = prefer(live, &|e| e.is_healthy());
        if candidates.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let chosen = match self.balance {
            Balance::RoundRobin => candidates.get(turn % candidates.len()).copied(),
            Balance::LeastInFlight => {
                // Start the scan at the round-robin position so ties rotate.
                let n = candidates.len();
                (0..n).filter_map(|i| candidates.get((turn + i) % n).copied()).min_by_key(|e| e.inflight())
            }
        }?;
        let mut picked = Picked::new(Arc::clone(chosen));
        picked.pool = Some(Arc::clone(&self.ejection));
        Some(picked)
    }

    /// Its endpoint named `name` ([`Endpoint::name`]), whatever its health (a stored answer
    /// is there and nowhere else); `None` when the pool has no such endpoint.
    pub fn pick_named(&self, name: &str) -> Option<Picked> {
        let members = self.endpoints();
        let endpoint = members.iter().find(|e| e.name == name)?;
        let mut picked = Picked::new(Arc::clone(endpoint));
        picked.pool = Some(Arc::clone(&self.ejection));
        Some(picked)
    }
}

/// What one [`Pool::replace_members`] changed.
#[derive(Debug, Default)]
pub struct Membership {
    /// Endpoints new to the pool.
    pub joined: Vec<Arc<Endpoint>>,
    /// Endpoints no longer in it.
    pub left: Vec<Arc<Endpoint>>,
}

/// The endpoints of `all` that `keep` accepts, or all of them when it accepts none.
fn prefer<'a>(all: Vec<&'a Arc<Endpoint>>, keep: &dyn Fn(&Endpoint) -> bool) -> Vec<&'a Arc<Endpoint>> {
    let kept: Vec<&Arc<Endpoint>> = all.iter().copied().filter(|e| keep(e)).collect();
    if kept.is_empty() {
        all
    } else {
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default first ejection (`upstream.eject_base_ms`).
    const EJECT_BASE: Duration = Duration::from_secs(5);

    /// Ejecting at `after` failures for [`EJECT_BASE`].
    fn rule(after: u32) -> EjectionRule {
        EjectionRule { after, base: EJECT_BASE }
    }

    fn pool(balance: Balance, n: usize) -> Pool {
        let endpoints: Vec<String> = (0..n).map(|i| format!("\"127.0.0.1:{}\"", 9000 + i)).collect();
        let balance = if balance == Balance::RoundRobin { "round_robin" } else { "least_in_flight" };
        let text = format!(
            "[pools.p]\nendpoints = [{}]\nbalance = \"{balance}\"\n[defaults]\npassthrough_pool = \"p\"\n",
            endpoints.join(", ")
        );
        let config = crate::config::Config::from_toml(&text, "t").unwrap();
        Pool::new("p", &config.pools["p"], &PoolResources::default(), rule(3))
    }

    #[test]
    fn round_robin_rotates() {
        let p = pool(Balance::RoundRobin, 3);
        let picks: Vec<String> = (0..6).map(|_| p.pick().unwrap().addr().to_owned()).collect();
        assert_eq!(picks[0..3], picks[3..6]);
        assert_ne!(picks[0], picks[1]);
    }

    #[test]
    fn least_in_flight_avoids_busy_endpoints() {
        let p = pool(Balance::LeastInFlight, 2);
        let first = p.pick().unwrap();
        for _ in 0..5 {
            let second = p.pick().unwrap();
            assert_ne!(second.addr(), first.addr());
        }
        drop(first);
        assert_eq!(p.endpoints().iter().map(|e| e.inflight()).sum::<usize>(), 0);
    }

    #[test]
    fn a_version_ages_and_is_forgotten() {
        let e = Endpoint::new("127.0.0.1:9000");
        assert!(e.version_older_than(std::time::Duration::from_secs(3600)), "never learned");
        e.set_version(Version::parse("0.32.0").unwrap());
        assert!(!e.version_older_than(std::time::Duration::from_secs(3600)));
        assert!(e.version_older_than(std::time::Duration::ZERO));
        e.version_failed();
        assert!(!e.may_ask_version(std::time::Duration::from_secs(3600)));
        e.end_version_pause();
        assert!(e.may_ask_version(std::time::Duration::from_secs(3600)));
        e.forget_version();
        assert_eq!(e.version(), None);
    }

    #[test]
    fn healthy_endpoints_are_preferred() {
        let p = pool(Balance::RoundRobin, 3);
        p.endpoints()[2].set_healthy(true);
        for _ in 0..4 {
            assert_eq!(p.pick().unwrap().addr(), "127.0.0.1:9002");
        }
        assert!(p.any_healthy());
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

    #[test]
    fn pick_skips_ejected_and_tried_endpoints_while_others_exist() {
        let p = pool(Balance::RoundRobin, 3);
        let now = Instant::now();
        for _ in 0..3 {
            p.endpoints()[0].request_failed(now, rule(3));
        }
        assert_eq!(p.ejected(now), 1);
        for _ in 0..6 {
            assert_ne!(p.pick_at(now, &[]).unwrap().addr(), "127.0.0.1:9000");
            assert_eq!(p.pick_at(now, &["127.0.0.1:9001"]).unwrap().addr(), "127.0.0.1:9002");
        }
        // Every other endpoint tried: an ejected one beats none.
        assert_eq!(p.pick_at(now, &["127.0.0.1:9001", "127.0.0.1:9002"]).unwrap().addr(), "127.0.0.1:9000");
        // A healthy /health does not readmit early: ejection is about requests.
        p.endpoints()[0].set_healthy(true);
        assert_ne!(p.pick_at(now, &[]).unwrap().addr(), "127.0.0.1:9000");
        assert_eq!(p.pick_at(now + EJECT_BASE, &[]).unwrap().addr(), "127.0.0.1:9000", "the only healthy one");
        assert_eq!(p.pick().unwrap().ejection().unwrap().name, "p");
    }

    /// A discovered pool's members follow each answer: those that stay are the same
    /// endpoints (their ejection and health), newcomers join unhealthy, leavers are chosen no
    /// more while a request holding one keeps it counted in flight until it ends.
    #[test]
    fn replacing_members_keeps_those_that_stay_and_lets_leavers_finish() {
        let text = "[pools.p]\ndiscover = \"engines.test:8000#0-1\"\n[defaults]\npassthrough_pool = \"p\"\n";
        let config = crate::config::Config::from_toml(text, "t").unwrap();
        let pool = Pool::new("p", &config.pools["p"], &PoolResources::default(), rule(1));
        assert!(pool.endpoints().is_empty() && pool.pick().is_none(), "no member before the first answer");
        let at = |ip: &str| -> std::net::SocketAddr { format!("{ip}:8000").parse().unwrap() };
        let first = pool.replace_members(&[at("127.0.0.3"), at("127.0.0.2"), at("127.0.0.2")]);
        let names: Vec<String> = pool.endpoints().iter().map(|e| e.name.clone()).collect();
        assert_eq!(names, ["127.0.0.2:8000#0", "127.0.0.2:8000#1", "127.0.0.3:8000#0", "127.0.0.3:8000#1"]);
        assert_eq!((first.joined.len(), first.left.len()), (4, 0));
        let now = Instant::now();
        let staying = Arc::clone(&pool.endpoints()[2]);
        staying.set_healthy(true);
        assert!(staying.request_failed(now, pool.ejection_rule()));
        let leaver = pool.pick_named("127.0.0.2:8000#0").unwrap();

        let second = pool.replace_members(&[at("127.0.0.3"), at("127.0.0.4")]);
        assert_eq!(
            second.left.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
            ["127.0.0.2:8000#0", "127.0.0.2:8000#1"]
        );
        assert_eq!(second.joined.len(), 2);
        assert!(second.joined.iter().all(|e| !e.is_healthy()), "newcomers join unhealthy");
        let kept = pool.endpoints().iter().find(|e| e.name == "127.0.0.3:8000#0").cloned().unwrap();
        assert!(Arc::ptr_eq(&kept, &staying), "the same endpoint");
        assert!(kept.is_healthy() && kept.is_ejected(now) && pool.ejected(now) == 1, "with its state");
        assert_eq!(leaver.endpoint().inflight(), 1, "the leaver's request still holds it");
        for _ in 0..8 {
            assert!(!pool.pick_at(now, &[]).unwrap().name().starts_with("127.0.0.2"), "a leaver is chosen no more");
        }
        let gone = Arc::clone(leaver.endpoint());
        drop(leaver);
        assert_eq!(gone.inflight(), 0);
        assert_eq!(pool.member_addrs(), [at("127.0.0.3"), at("127.0.0.4")]);
    }

    /// `upstream.eject_base_ms` sets how long a pool's endpoints stay ejected: the first
    /// ejection lasts it, the next one twice as long.
    #[test]
    fn the_configured_base_sets_the_ejection_length() {
        let text = "[upstream]\neject_after_failures = 1\neject_base_ms = 250\n[pools.p]\nendpoints = [\"127.0.0.1:9000\"]\n[defaults]\npassthrough_pool = \"p\"\n";
        let config = crate::config::Config::from_toml(text, "t").unwrap();
        let pool = Pool::new("p", &config.pools["p"], &PoolResources::default(), EjectionRule::of(&config.upstream));
        let (e, t0, ms) = (&pool.endpoints()[0], Instant::now(), Duration::from_millis);
        assert!(e.request_failed(t0, pool.ejection_rule()));
        assert!(e.is_ejected(t0 + ms(249)) && !e.is_ejected(t0 + ms(250)));
        assert!(e.request_failed(t0 + ms(250), pool.ejection_rule()));
        assert!(e.is_ejected(t0 + ms(749)) && !e.is_ejected(t0 + ms(750)), "then twice as long");
    }
}
