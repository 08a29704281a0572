//! Pools of engine endpoints (one per data-parallel rank of a listed server), from config or
//! a DNS name (members swapped as one snapshot: `discovery`), and the pick among them: untried,
//! not ejected and healthy endpoints first, then round robin, least in flight or cache-aware.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::choice::{Ahead, CacheAwareChoice, Prompt, PromptKey};
use super::dns_name::Discovery;
use super::endpoint::{endpoint_name, EjectionRule, Endpoint, Picked, PoolEjection};
use super::engine_load::{EngineLoad, Pressure};
use super::metrics::CacheAwareMetrics;
use crate::config::{Balance, PoolResources, Version};
use crate::kv::{BlockHash, ExtraKeys, LoraPaths, PrefixHolders};
use crate::metrics::ChoiceSource;

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
    /// With `balance = "cache_aware"`: what it chooses by.
    cache_aware: Option<CacheAwareChoice>,
    /// When its engines' `/metrics` are read (`None`: never).
    load_reads: Option<LoadReads>,
    /// The LoRA adapters its engines' `/v1/models` list, with their paths (block hashes).
    lora_paths: Arc<LoraPaths>,
}

/// When a pool's engines' `/metrics` are read on the health round, and for how long a read
/// is believed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadReads {
    /// Time between two reads of one endpoint (`engine_metrics_interval_ms`).
    pub every: Duration,
    /// Age past which a read is not believed: [`STALE_AFTER_READS`] reads, of the longer of
    /// `every` and the health interval.
    pub believed_for: Duration,
}

/// Reads an endpoint may miss before its last one is not believed.
pub const STALE_AFTER_READS: u32 = 3;

impl LoadReads {
    /// Reads every `every` (zero: none), on health rounds every `health`.
    pub fn new(every: Duration, health: Duration) -> Option<Self> {
        (!every.is_zero()).then(|| Self { every, believed_for: every.max(health).saturating_mul(STALE_AFTER_READS) })
    }
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
            cache_aware: (spec.balance == Balance::CacheAware).then(|| CacheAwareChoice::new(&spec.cache_aware)),
            load_reads: LoadReads::new(spec.engine_metrics_interval_ms, Duration::ZERO),
            lora_paths: Arc::default(),
        }
    }

    /// The pool with its engines' `/metrics` read on health rounds every `health` (a read is
    /// believed for three of the longer of its interval and `health`).
    #[must_use]
    pub fn polled_every(mut self, health: Duration) -> Self {
        self.load_reads = self.load_reads.and_then(|r| LoadReads::new(r.every, health));
        self
    }

    /// When its engines' `/metrics` are read (`None`: never).
    pub fn load_reads(&self) -> Option<LoadReads> {
        self.load_reads
    }

    /// What `endpoint`'s engine last reported of its own pressure, if read recently enough to
    /// believe (a routing cost term reads this).
    pub fn engine_load(&self, endpoint: &Endpoint) -> Option<EngineLoad> {
        endpoint.facts().load(self.load_reads?.believed_for)
    }

    /// The numbers of `endpoint`'s engine's last believed pressure read (nothing cloned).
    pub fn engine_pressure(&self, endpoint: &Endpoint) -> Option<Pressure> {
        endpoint.facts().pressure(self.load_reads?.believed_for)
    }

    /// The KV-cache blocks its engines say they hold between them (`num_gpu_blocks`, believed
    /// reads; an endpoint not read counted at the mean of those read); `None` before any read.
    pub fn engine_gpu_blocks(&self) -> Option<u64> {
        let believed = self.load_reads?.believed_for;
        let members = self.endpoints();
        let read: Vec<u64> =
            members.iter().filter_map(|e| e.facts().load(believed).and_then(|l| l.num_gpu_blocks)).collect();
        let sum = read.iter().fold(0u64, |a, b| a.saturating_add(*b));
        let known = u64::try_from(read.len()).ok().filter(|n| *n > 0)?;
        let all = u64::try_from(members.len()).unwrap_or(u64::MAX);
        Some(sum.saturating_mul(all) / known)
    }

    /// True when it chooses by the prompt's blocks (`balance = "cache_aware"`): its picks then
    /// want the prompt's [`chain`](Self::chain).
    pub fn is_cache_aware(&self) -> bool {
        self.cache_aware.is_some()
    }

    /// The hashes of the full blocks of prompt `ids` with its extra `keys` (its LoRA adapter,
    /// its salt: [`LoraPaths::keys`]), as this pool names blocks (`None` when it is not
    /// cache-aware). Computed once per request: a SHA-256 per block.
    pub fn chain(&self, ids: &[u32], keys: &ExtraKeys<'_>) -> Option<Vec<BlockHash>> {
        Some(self.cache_aware.as_ref()?.chain(ids, keys))
    }

    /// The prompt tokens of `chain` the endpoint named `name` holds, by its engine's KV events
    /// (`None`: not cache-aware, no events source, or the events are not usable now).
    pub fn tokens_held_by_events(&self, name: &str, chain: &[BlockHash]) -> Option<u64> {
        self.cache_aware.as_ref()?.tokens_held_by_events(name, chain)
    }

    /// The LoRA adapters its engines serve, with the paths they loaded them from (the health
    /// round learns them from `/v1/models`; a request's chain and the KV events' hash check
    /// read them).
    pub fn lora_paths(&self) -> &Arc<LoraPaths> {
        &self.lora_paths
    }

    /// True when `other` names blocks as this pool does (same seed and block size), so one
    /// chain serves both.
    pub fn names_blocks_like(&self, other: &Pool) -> bool {
        match (&self.cache_aware, &other.cache_aware) {
            (Some(a), Some(b)) => a.names_blocks_like(b),
            _ => false,
        }
    }

    /// Sets its source of `kind` (a no-op unless cache-aware): replaces the one it had, or
    /// removes it (`None`). The events source goes before the approximate one, so it is asked
    /// first while usable.
    pub fn set_prefix_source(&self, kind: ChoiceSource, source: Option<Arc<dyn PrefixHolders>>) {
        if let Some(choice) = &self.cache_aware {
            choice.set_source(kind, source);
        }
    }

    /// Forgets what every source of a cache-aware pool says the endpoint named `name` holds:
    /// it went down, and an engine that comes back (restarted) starts with an empty cache
    /// before its events can say so.
    pub fn forget_cache_of(&self, name: &str) {
        if let Some(choice) = &self.cache_aware {
            choice.forget(name);
        }
    }

    /// The kinds of source a cache-aware pool asks, in order (empty: not cache-aware).
    pub fn prefix_sources(&self) -> Vec<ChoiceSource> {
        self.cache_aware.as_ref().map(CacheAwareChoice::source_kinds).unwrap_or_default()
    }

    /// Gives a cache-aware pool its choice series (once: a pool carried over a reload keeps
    /// the first).
    pub fn count_choices_in(&self, metrics: CacheAwareMetrics) {
        if let Some(choice) = &self.cache_aware {
            choice.count_in(metrics);
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

    /// Chooses an endpoint at `now` for something other than a prompt's first leg (a
    /// passthrough request, a failover): a cache-aware pool takes the least in flight and
    /// counts nothing. See [`Pool::pick_for`].
    pub fn pick_at(&self, now: Instant, tried: &[&str]) -> Option<Picked> {
        self.pick_for(now, tried, PromptKey::NotAPrompt)
    }

    /// Chooses an endpoint at `now` for a request whose prompt is known by `prompt`, not one
    /// of `tried` unless every endpoint was: endpoints not ejected first (all when every one
    /// is), among them healthy ones first (all when none is), then by the policy.
    pub fn pick_for<'c>(&self, now: Instant, tried: &[&str], prompt: impl Into<Prompt<'c>>) -> Option<Picked> {
        let Prompt { key: prompt, adapter } = prompt.into();
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
            Balance::CacheAware => {
                let n = candidates.len();
                let rotated: Vec<&Arc<Endpoint>> =
                    (0..n).filter_map(|i| candidates.get((turn + i) % n).copied()).collect();
                let believed = self.load_reads.map(|r| r.believed_for);
                let ahead = |e: &Endpoint| Ahead {
                    own_tokens: e.queued_tokens(),
                    engine: believed.and_then(|age| e.facts().pressure(age)),
                    adapter_running: adapter.zip(believed).and_then(|(name, age)| e.facts().runs_adapter(name, age)),
                    ..Ahead::default()
                };
                let (chosen, charge) = match &self.cache_aware {
                    Some(choice) => choice.choose(&rotated, prompt, &ahead),
                    None => rotated.iter().copied().min_by_key(|e| e.inflight()).map(|e| (e, 0)),
                }?;
                let picked = Picked::from_pool(Arc::clone(chosen), Arc::clone(&self.ejection));
                return Some(picked.charged(charge));
            }
        }?;
        Some(Picked::from_pool(Arc::clone(chosen), Arc::clone(&self.ejection)))
    }

    /// Its endpoint named `name` ([`Endpoint::name`]), whatever its health (a stored answer
    /// is there and nowhere else); `None` when the pool has no such endpoint.
    pub fn pick_named(&self, name: &str) -> Option<Picked> {
        let members = self.endpoints();
        let endpoint = members.iter().find(|e| e.name == name)?;
        Some(Picked::from_pool(Arc::clone(endpoint), Arc::clone(&self.ejection)))
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
pub(crate) mod tests {
    use super::*;
    use crate::kv::SentPrefixes;
    use crate::upstream::endpoint::tests::{rule, EJECT_BASE};
    use std::time::Duration;

    /// A pool `p` of `n` endpoints (`127.0.0.1:9000` up) choosing by `balance`, ejecting
    /// at 3 failures; a cache-aware one names blocks of 4 and weighs queued tokens as computed
    /// ones (`load_weight = 1`: the worked example's numbers).
    pub(crate) fn pool(balance: Balance, n: usize) -> Pool {
        let endpoints: Vec<String> = (0..n).map(|i| format!("\"127.0.0.1:{}\"", 9000 + i)).collect();
        let balance = match balance {
            Balance::RoundRobin => "round_robin\"",
            Balance::LeastInFlight => "least_in_flight\"",
            Balance::CacheAware => "cache_aware\"\n[pools.p.cache_aware]\nblock_size = 4\nload_weight = 1.0",
        };
        let text = format!(
            "[pools.p]\nendpoints = [{}]\nbalance = \"{balance}\n[defaults]\npassthrough_pool = \"p\"\n",
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
    fn a_pool_that_is_not_cache_aware_has_no_chain() {
        let p = pool(Balance::LeastInFlight, 2);
        assert!(!p.is_cache_aware() && p.chain(&[1, 2, 3, 4], &crate::kv::ExtraKeys::default()).is_none());
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::new(SentPrefixes::new(1))));
        assert!(!p.names_blocks_like(&pool(Balance::CacheAware, 1)));
        assert!(pool(Balance::CacheAware, 1).names_blocks_like(&pool(Balance::CacheAware, 2)));
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
