//! Static pools of engine endpoints with round-robin or least-in-flight choice, per-endpoint
//! health and vLLM version, and an in-flight guard that counts a request until dropped.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::config::{Balance, PoolSpec, Version};

/// One engine endpoint and what tokenonce knows about it.
#[derive(Debug)]
pub struct Endpoint {
    /// `host:port`.
    pub addr: String,
    inflight: AtomicUsize,
    healthy: AtomicBool,
    version: RwLock<Option<Version>>,
    /// When the version was learned (it is asked again after a while).
    version_learned_at: RwLock<Option<std::time::Instant>>,
    /// When `/version` was last asked and gave nothing usable (retried after a pause).
    version_failed_at: RwLock<Option<std::time::Instant>>,
}

impl Endpoint {
    /// A new endpoint, not yet known healthy.
    pub fn new(addr: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            inflight: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            version: RwLock::new(None),
            version_learned_at: RwLock::new(None),
            version_failed_at: RwLock::new(None),
        }
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

    /// Ends the pause after a failed `/version` (the engine answers `/health` again).
    pub fn end_version_pause(&self) {
        if let Ok(mut t) = self.version_failed_at.write() {
            *t = None;
        }
    }
}

/// An endpoint chosen for one request; counts as in flight until dropped.
#[derive(Debug)]
pub struct Picked {
    endpoint: Arc<Endpoint>,
}

impl Picked {
    /// Marks `endpoint` in flight.
    pub fn new(endpoint: Arc<Endpoint>) -> Self {
        endpoint.inflight.fetch_add(1, Ordering::Relaxed);
        Self { endpoint }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// Its `host:port`.
    pub fn addr(&self) -> &str {
        &self.endpoint.addr
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
    /// Its endpoints (never empty: config validation).
    pub endpoints: Vec<Arc<Endpoint>>,
    balance: Balance,
    pinned_version: Option<Version>,
    next: AtomicUsize,
}

impl Pool {
    /// A pool from its spec.
    pub fn new(spec: &PoolSpec) -> Self {
        Self {
            name: spec.name().to_owned(),
            endpoints: spec.endpoints().iter().map(|a| Arc::new(Endpoint::new(a.clone()))).collect(),
            balance: spec.balance(),
            pinned_version: spec.vllm_version(),
            next: AtomicUsize::new(0),
        }
    }

    /// The version pinned in config, if any.
    pub fn pinned_version(&self) -> Option<Version> {
        self.pinned_version
    }

    /// True when some endpoint passed its last health poll.
    pub fn any_healthy(&self) -> bool {
        self.endpoints.iter().any(|e| e.is_healthy())
    }

    /// Chooses an endpoint: healthy ones first (all when none is), then by the policy.
    pub fn pick(&self) -> Option<Picked> {
        let healthy: Vec<&Arc<Endpoint>> = self.endpoints.iter().filter(|e| e.is_healthy()).collect();
        let candidates: Vec<&Arc<Endpoint>> =
            if healthy.is_empty() { self.endpoints.iter().collect() } else { healthy };
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
        Some(Picked::new(Arc::clone(chosen)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(balance: Balance, n: usize) -> Pool {
        let endpoints: Vec<String> = (0..n).map(|i| format!("\"127.0.0.1:{}\"", 9000 + i)).collect();
        let balance = if balance == Balance::RoundRobin { "round_robin" } else { "least_in_flight" };
        let text = format!(
            "[pools.p]\nendpoints = [{}]\nbalance = \"{balance}\"\n[defaults]\npassthrough_pool = \"p\"\n",
            endpoints.join(", ")
        );
        Pool::new(&crate::config::Config::from_toml(&text, "t").unwrap().pools()[0])
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
        assert_eq!(p.endpoints.iter().map(|e| e.inflight()).sum::<usize>(), 0);
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
        p.endpoints[2].set_healthy(true);
        for _ in 0..4 {
            assert_eq!(p.pick().unwrap().addr(), "127.0.0.1:9002");
        }
        assert!(p.any_healthy());
    }
}
