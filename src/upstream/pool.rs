//! Pools of engine endpoints (one per data-parallel rank of a server listed with its ranks),
//! listed in config or discovered by DNS (their members then swapped as a snapshot: see
//! `discovery`), with round-robin, least-in-flight or cache-aware choice, per-endpoint health
//! and vLLM version, passive ejection after consecutive failures, and an in-flight guard that
//! counts a request until dropped.

use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::dns_name::Discovery;
use super::metrics::{CacheAwareMetrics, EndpointMetrics};
use crate::config::{Balance, PoolResources, Version};
use crate::kv::{BlockHash, BlockHasher, ExtraKeys, PrefixHolders, SentPrefixes};
use crate::metrics::{ChoiceReason, ChoiceSource};

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
    errors: std::sync::OnceLock<EndpointMetrics>,
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
        *self.version.read()
    }

    /// True when `/version` may be asked now: never failed, or failed over `pause` ago.
    pub fn may_ask_version(&self, pause: std::time::Duration) -> bool {
        (*self.version_failed_at.read()).is_none_or(|t| t.elapsed() >= pause)
    }

    /// Records that `/version` gave nothing usable.
    pub fn version_failed(&self) {
        *self.version_failed_at.write() = Some(std::time::Instant::now());
    }

    /// Records the version.
    pub fn set_version(&self, version: Version) {
        *self.version.write() = Some(version);
        *self.version_learned_at.write() = Some(std::time::Instant::now());
    }

    /// True when the version was learned over `age` ago (or never).
    pub fn version_older_than(&self, age: std::time::Duration) -> bool {
        (*self.version_learned_at.read()).is_none_or(|t| t.elapsed() >= age)
    }

    /// Forgets the version: the engine went away and may come back as another vLLM.
    pub fn forget_version(&self) {
        *self.version.write() = None;
        *self.version_learned_at.write() = None;
    }

    /// The model `GET /v1/models` reported, if known.
    pub fn model(&self) -> Option<ModelIdentity> {
        self.model.read().clone().flatten()
    }

    /// True once `/v1/models` was asked (since the endpoint last turned healthy).
    pub fn model_asked(&self) -> bool {
        self.model.read().is_some()
    }

    /// Records what `/v1/models` said (`None`: nothing usable).
    pub fn set_model(&self, model: Option<ModelIdentity>) {
        *self.model.write() = Some(model);
    }

    /// Forgets the model: the engine went away and may come back serving another.
    pub fn forget_model(&self) {
        *self.model.write() = None;
    }

    /// Ends the pause after a failed `/version` (the engine answers `/health` again).
    pub fn end_version_pause(&self) {
        *self.version_failed_at.write() = None;
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
        let sources: Vec<ChoiceSource> = self.sources.read().iter().map(|(k, _)| *k).collect();
        f.debug_struct("CacheAwareChoice")
            .field("prefix_weight", &self.prefix_weight)
            .field("load_weight", &self.load_weight)
            .field("block_size", &self.hasher.block_size())
            .field("sources", &sources)
            .finish()
    }
}

impl CacheAwareChoice {
    /// The choice `[pools.NAME.cache_aware]` describes, with the approximate source only.
    fn new(spec: &crate::config::CacheAware) -> Self {
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

    /// Counts one choice (when the pool has series).
    fn count(&self, source: ChoiceSource, reason: ChoiceReason) {
        if let Some(m) = self.metrics.get() {
            m.choice(source, reason);
        }
    }

    /// The candidate scoring best for `prompt` (the first in `rotated` order among equals),
    /// counted by source and reason; every source of its kind then hears where it went.
    fn choose<'a>(&self, rotated: &[&'a Arc<Endpoint>], prompt: PromptKey<'_>) -> Option<&'a Arc<Endpoint>> {
        let least = || rotated.iter().copied().min_by_key(|e| e.inflight());
        let chain = match prompt {
            PromptKey::NotAPrompt => return least(),
            PromptKey::Unknown => {
                self.count(ChoiceSource::None, ChoiceReason::NoIds);
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
            let score = self.prefix_weight * held as f64 / blocks - self.load_weight * e.inflight() as f64;
            if best.is_none_or(|(_, top, _)| score > top) {
                best = Some((e, score, held));
            }
        }
        (best.map(|(e, _, _)| e), any_held, best.map_or(0, |(_, _, held)| held))
    }
}

/// What a cache-aware pick knows of a request's prompt.
#[derive(Clone, Copy, Debug)]
pub enum PromptKey<'c> {
    /// Not a prompt's first leg (passthrough, a failover): least in flight, not counted.
    NotAPrompt,
    /// A prompt known by neither its ids nor its text: least in flight, counted `no_ids`.
    Unknown,
    /// Its full blocks' hashes, as [`Pool::chain`] names them: asked of the pool's sources.
    Tokens(&'c [BlockHash]),
    /// Its text keys (`openai::prefix`): asked of the pool's own index of text keys.
    Text(&'c [BlockHash]),
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
    /// With `balance = "cache_aware"`: what it chooses by.
    cache_aware: Option<CacheAwareChoice>,
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
        }
    }

    /// True when it chooses by the prompt's blocks (`balance = "cache_aware"`): its picks then
    /// want the prompt's [`chain`](Self::chain).
    pub fn is_cache_aware(&self) -> bool {
        self.cache_aware.is_some()
    }

    /// The hashes of the full blocks of prompt `ids`, as this pool names blocks (`None` when
    /// it is not cache-aware). Computed once per request: a SHA-256 per block.
    pub fn chain(&self, ids: &[u32]) -> Option<Vec<BlockHash>> {
        Some(self.cache_aware.as_ref()?.hasher.chain(ids, &ExtraKeys::default()))
    }

    /// True when `other` names blocks as this pool does (same seed and block size), so one
    /// chain serves both.
    pub fn names_blocks_like(&self, other: &Pool) -> bool {
        match (&self.cache_aware, &other.cache_aware) {
            (Some(a), Some(b)) => {
                a.hasher.block_size() == b.hasher.block_size() && a.hasher.none_hash() == b.hasher.none_hash()
            }
            _ => false,
        }
    }

    /// Sets its source of `kind` (a no-op unless cache-aware): replaces the one it had, or
    /// removes it (`None`). The events source goes before the approximate one, so it is asked
    /// first while usable.
    pub fn set_prefix_source(&self, kind: ChoiceSource, source: Option<Arc<dyn PrefixHolders>>) {
        let Some(choice) = &self.cache_aware else { return };
        let mut sources = choice.sources.write();
        sources.retain(|(k, _)| *k != kind);
        if let Some(source) = source {
            let at = if kind == ChoiceSource::Events { 0 } else { sources.len() };
            sources.insert(at, (kind, source));
        }
    }

    /// Forgets what every source of a cache-aware pool says the endpoint named `name` holds:
    /// it went down, and an engine that comes back (restarted) starts with an empty cache
    /// before its events can say so.
    pub fn forget_cache_of(&self, name: &str) {
        let Some(choice) = &self.cache_aware else { return };
        choice.sources.read().iter().for_each(|(_, s)| s.forget(name));
        choice.text.forget(name);
    }

    /// The kinds of source a cache-aware pool asks, in order (empty: not cache-aware).
    pub fn prefix_sources(&self) -> Vec<ChoiceSource> {
        self.cache_aware.as_ref().map(|c| c.sources.read().iter().map(|(k, _)| *k).collect()).unwrap_or_default()
    }

    /// Gives a cache-aware pool its choice series (once: a pool carried over a reload keeps
    /// the first).
    pub fn count_choices_in(&self, metrics: CacheAwareMetrics) {
        if let Some(choice) = &self.cache_aware {
            let _ = choice.metrics.set(metrics);
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
    pub fn pick_for(&self, now: Instant, tried: &[&str], prompt: PromptKey<'_>) -> Option<Picked> {
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
                match &self.cache_aware {
                    Some(choice) => choice.choose(&rotated, prompt),
                    None => rotated.iter().copied().min_by_key(|e| e.inflight()),
                }
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
        let balance = match balance {
            Balance::RoundRobin => "round_robin\"",
            Balance::LeastInFlight => "least_in_flight\"",
            Balance::CacheAware => "cache_aware\"\n[pools.p.cache_aware]\nblock_size = 4\nload_weight = 0.25",
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

    /// The chain of a prompt of `blocks` blocks of 4 ids from `from`, as `p` names blocks.
    fn prompt(p: &Pool, from: u32, blocks: u32) -> Vec<BlockHash> {
        p.chain(&(from..from + blocks * 4).collect::<Vec<u32>>()).unwrap()
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
        if let Some(choice) = &p.cache_aware {
            choice.sources.write().clear();
        }
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

    #[test]
    fn a_pool_that_is_not_cache_aware_has_no_chain() {
        let p = pool(Balance::LeastInFlight, 2);
        assert!(!p.is_cache_aware() && p.chain(&[1, 2, 3, 4]).is_none());
        p.set_prefix_source(ChoiceSource::Events, Some(Arc::new(SentPrefixes::new(1))));
        assert!(!p.names_blocks_like(&pool(Balance::CacheAware, 1)));
        assert!(pool(Balance::CacheAware, 1).names_blocks_like(&pool(Balance::CacheAware, 2)));
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
