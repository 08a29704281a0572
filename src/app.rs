//! The composition root: [`App`], everything a request needs, built once from a loaded config
//! and rebuilt on reload (carrying over what was learned at run time), and the background
//! upkeep that walks it (health rounds, gauges read from state). Lower rooms never import it:
//! what they need is handed to them here. `metrics.rs`: every metric family, registered once.

mod metrics;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use prometheus::Registry;

pub use metrics::{Metrics, ReloadMetrics};

use crate::config::{Config, Loaded, Resources};
use crate::routes::{DanglingPool, RouteTable};
use crate::upstream::{Pool, UpstreamClient};
use crate::{handoff, kv, local, parity, upstream};

/// Why the state could not be built from a config.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Metrics registration failed.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The parity watch's worker could not start.
    #[error("parity watch: {0}")]
    Watch(#[from] std::io::Error),
    /// A route names a pool that does not exist.
    #[error(transparent)]
    Routes(#[from] DanglingPool),
    /// A pool discovers its endpoints and no DNS resolver could be set up.
    #[error(transparent)]
    Discovery(#[from] upstream::DiscoveryError),
}

/// Everything a request needs, built once from the config.
pub struct App {
    /// The validated config.
    pub config: Config,
    /// What its paths name (admin token, certificates, tokenizers), as loaded with it.
    pub resources: Resources,
    /// Routes in order, each holding its pools.
    pub routes: RouteTable,
    /// Every pool, in config order (the health poller walks them).
    pub pools: Vec<Arc<Pool>>,
    /// The resolver of pools that discover their endpoints (`None`: no pool does); kept
    /// across reloads while `upstream.dns_server` stays.
    pub discoverer: Option<Arc<upstream::Discoverer>>,
    /// The upstream client.
    pub client: Arc<UpstreamClient>,
    /// Metric handles.
    pub metrics: Metrics,
    /// Their registry.
    pub registry: Registry,
    /// Relay-mode ids waiting for their decode (kept across reloads).
    pub cache: Arc<handoff::IdCache>,
    /// The decode endpoint of each stored Responses answer (kept across reloads).
    pub homes: Arc<upstream::ResponseHomes>,
    /// Set by the admin `/drain` (a preStop hook): `/readyz` answers 503 from then on.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// The client requests being served (kept across reloads; the bound is
    /// `server.max_in_flight` of each request's config).
    pub admission: Arc<Admission>,
    /// The parity watch's workers (kept across reloads).
    pub watch: Arc<parity::Watch>,
    /// The local-ids verifier's workers (kept across reloads).
    pub verifier: Arc<local::Verifier>,
    /// Each pool's local renderer, for pools with `local_ids` on (by pool name).
    pub local: std::collections::BTreeMap<String, Arc<local::LocalIds>>,
    /// Each pool's KV events (which endpoint holds which blocks), for pools with
    /// `kv_events` (by pool name; kept across reloads that change neither its endpoints nor
    /// its `kv_events`). A [`kv::PrefixHolders`] for cache-aware choice.
    pub kv_events: std::collections::BTreeMap<String, Arc<kv::events::PoolKvEvents>>,
}

/// The runtime the KV event subscribers run on: one thread of its own for the process, so
/// they start with the config (before pingora's runtimes run) and outlive reloads.
fn kv_runtime() -> Option<&'static tokio::runtime::Handle> {
    static HANDLE: std::sync::OnceLock<Option<tokio::runtime::Handle>> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            let handle = runtime.handle().clone();
            let thread = std::thread::Builder::new().name("kv-events".into());
            thread.spawn(move || runtime.block_on(std::future::pending::<()>())).ok()?;
            Some(handle)
        })
        .as_ref()
}

/// The KV events of each pool with `kv_events`: `previous`'s when its endpoints and settings
/// are the same, else subscribers started anew (the old ones stop when dropped); each
/// cache-aware pool is given its pool's events as the first source it asks.
fn kv_sources(
    config: &Config,
    pools: &[Arc<Pool>],
    metrics: &kv::metrics::KvMetrics,
    previous: Option<&std::collections::BTreeMap<String, Arc<kv::events::PoolKvEvents>>>,
) -> std::collections::BTreeMap<String, Arc<kv::events::PoolKvEvents>> {
    let mut out = std::collections::BTreeMap::new();
    for pool in pools {
        let Some(spec) = config.pools.get(&pool.name).and_then(|p| p.kv_events.as_ref()) else { continue };
        let settings = spec.settings();
        let endpoints: Vec<String> = pool.endpoints().iter().map(|e| e.name.clone()).collect();
        let kept = previous.and_then(|m| m.get(&pool.name)).filter(|old| {
            old.settings() == &settings && endpoints.iter().all(|e| old.subscribed(e)) && old.len() == endpoints.len()
        });
        if let Some(kept) = kept {
            out.insert(pool.name.clone(), Arc::clone(kept));
            continue;
        }
        let Some(runtime) = kv_runtime() else {
            tracing::error!(pool = %pool.name, "kv events off: their runtime could not start");
            continue;
        };
        match kv::events::PoolKvEvents::start(&pool.name, &endpoints, settings, metrics.pool(&pool.name), runtime) {
            Ok(source) => {
                out.insert(pool.name.clone(), source);
            }
            Err(e) => tracing::error!(pool = %pool.name, error = %e, "kv events off for the pool"),
        }
    }
    // A cache-aware pool asks its events first (set, replaced after a reload, or removed);
    // its events' hash check reads the adapters its engines list.
    for pool in pools {
        if let Some(events) = out.get(&pool.name) {
            events.use_lora_paths(Arc::clone(pool.lora_paths()));
        }
        let events = out.get(&pool.name).map(|s| Arc::clone(s) as Arc<dyn kv::PrefixHolders>);
        pool.set_prefix_source(crate::metrics::ChoiceSource::Events, events);
    }
    out
}

/// The local renderer of each pool whose template was loaded (`local_ids` on), or the one
/// `previous` (the state before a reload) has for the pool when it renders and tokenizes the
/// same under the same policy: its trust per shape and its segment cache carry over.
fn local_renderers(
    config: &Config,
    resources: &Resources,
    previous: Option<&std::collections::BTreeMap<String, Arc<local::LocalIds>>>,
) -> std::collections::BTreeMap<String, Arc<local::LocalIds>> {
    let mut out = std::collections::BTreeMap::new();
    for (name, p) in &resources.pools {
        let Some(spec) = config.pools.get(name) else { continue };
        let policy = local::Policy {
            mode: spec.local_ids,
            verify_after: spec.local_ids_verify_after,
            recheck: spec.local_ids_recheck,
        };
        let fresh = match (p.template.clone(), p.tokenizer.clone(), p.mistral.clone()) {
            (_, _, Some(mistral)) => Ok(local::LocalIds::mistral(name, mistral, policy)),
            (Some(template), Some(tokenizer), None) => local::LocalIds::new(name, template, tokenizer, policy),
            _ => continue,
        };
        match fresh {
            Ok(fresh) => {
                let kept = previous.and_then(|m| m.get(name)).filter(|old| old.same_as(&fresh));
                out.insert(name.clone(), kept.map_or_else(|| Arc::new(fresh), Arc::clone));
            }
            Err(e) => {
                tracing::warn!(pool = %name, error = %e, "local ids off for the pool: its tokenizer cannot be cut")
            }
        }
    }
    out
}

/// The pool `name` of `config`, with its loaded TLS and the config's ejection rule.
fn new_pool(config: &Config, resources: &Resources, name: &str) -> Pool {
    let spec = config.pools.get(name).cloned().unwrap_or_default();
    let loaded = resources.pools.get(name).cloned().unwrap_or_default();
    Pool::new(name, &spec, &loaded, upstream::EjectionRule::of(&config.upstream))
        .polled_every(config.upstream.health_interval_ms)
}

/// True when a reload may keep the pool built from `old` (its endpoints with their health,
/// in-flight counts, versions and ejections) for `new`: every setting [`Pool::new`] reads is
/// the same (the loaded TLS is compared apart). Every field is named, so a field added to
/// [`crate::config::Pool`] does not compile here until someone decides whether it matters.
fn same_pool(old: &crate::config::Pool, new: &crate::config::Pool) -> bool {
    let crate::config::Pool {
        endpoints,
        discover,
        discover_interval_ms,
        engine_metrics_interval_ms,
        balance,
        vllm_version,
        cache_aware,
        // Compared as loaded (the resources' TLS), which also sees a certificate rewritten in
        // place.
        tls: _,
        // The routes' (vocabulary bound, parity watch) and the local renderers', taken from
        // the resources again on every reload.
        tokenizer: _,
        // The local renderers' (`local_renderers` keeps one that renders the same).
        local_ids: _,
        local_ids_verify_after: _,
        local_ids_recheck: _,
        // The KV event subscribers' (`kv_sources` keeps them while their settings hold, and
        // hands every pool its events source again).
        kv_events: _,
    } = new;
    *endpoints == old.endpoints
        && *discover == old.discover
        && *discover_interval_ms == old.discover_interval_ms
        && *engine_metrics_interval_ms == old.engine_metrics_interval_ms
        && *balance == old.balance
        && *vllm_version == old.vllm_version
        && same_cache_aware(&old.cache_aware, cache_aware)
}

/// [`same_pool`] for `[pools.NAME.cache_aware]`, compared whatever the pool's `balance`: every
/// field shapes a cache-aware pool's choice (its weights, how it names blocks, its index).
fn same_cache_aware(old: &crate::config::CacheAware, new: &crate::config::CacheAware) -> bool {
    let crate::config::CacheAware { prefix_weight, load_weight, block_size, hash_seed, max_blocks } = new;
    *prefix_weight == old.prefix_weight
        && *load_weight == old.load_weight
        && *block_size == old.block_size
        && *hash_seed == old.hash_seed
        && *max_blocks == old.max_blocks
}

/// The resolver `config`'s discovered pools need (`None`: no pool discovers): `previous`'s
/// when it asks the same server, else a new one.
fn discoverer(
    config: &Config,
    previous: Option<&Arc<upstream::Discoverer>>,
) -> Result<Option<Arc<upstream::Discoverer>>, upstream::DiscoveryError> {
    if config.pools.values().all(|p| p.discover.is_none()) {
        return Ok(None);
    }
    let server = config.upstream.dns_server.as_deref().and_then(|s| s.parse().ok());
    if let Some(kept) = previous.filter(|d| d.server() == server) {
        return Ok(Some(Arc::clone(kept)));
    }
    Ok(Some(Arc::new(upstream::Discoverer::new(server)?)))
}

/// Creates `pool`'s series and hands each endpoint its own (an endpoint of a pool carried
/// over a reload has them already).
fn pool_series(metrics: &upstream::metrics::UpstreamMetrics, pool: &Pool) {
    metrics.pool(&pool.name);
    if pool.discovery().is_some() {
        metrics.discovered_pool(&pool.name);
    }
    if pool.is_cache_aware() {
        pool.count_choices_in(metrics.cache_aware(&pool.name));
    }
    for e in pool.endpoints().iter() {
        e.count_errors_in(metrics.endpoint(&pool.name, &e.name));
    }
}

/// The current [`App`], swapped whole when the config is reloaded; each request takes one
/// snapshot and keeps it to the end.
pub type SharedApp = Arc<arc_swap::ArcSwap<App>>;

impl App {
    /// Builds the state from a validated config.
    ///
    /// # Errors
    /// When metrics cannot be registered.
    pub fn new(Loaded { config, resources }: Loaded) -> Result<Self, AppError> {
        let registry = Registry::new();
        let metrics = Metrics::register(&registry)?;
        let pools: Vec<Arc<Pool>> =
            config.pools.keys().map(|name| Arc::new(new_pool(&config, &resources, name))).collect();
        pools.iter().for_each(|p| pool_series(&metrics.upstream, p));
        let discoverer = discoverer(&config, None)?;
        let routes = RouteTable::new(&config, &resources, &pools, metrics.routes(), None)?;
        let upstream = &config.upstream;
        let client = Arc::new(UpstreamClient::new(upstream.connect_timeout_ms, upstream.idle_timeout_ms));
        let cache = Arc::new(handoff::IdCache::new(config.cache.capacity_bytes, config.cache.ttl_ms));
        metrics.build_info(crate::build::VERSION, crate::build::COMMIT, crate::build::RUSTC, crate::build::PROFILE);
        metrics.requests.admission_limit().set(i64::try_from(config.server.max_in_flight).unwrap_or(i64::MAX));
        let watch = Arc::new(parity::Watch::start(parity::WORKERS, parity::QUEUE)?);
        let verifier = Arc::new(local::Verifier::start(local::WORKERS, local::QUEUE, &metrics.local)?);
        let local = local_renderers(&config, &resources, None);
        let kv_events = kv_sources(&config, &pools, &metrics.kv, None);
        let admission = Arc::default();
        Ok(Self {
            kv_events,
            cache,
            homes: Arc::default(),
            verifier,
            local,
            draining: Arc::default(),
            admission,
            config,
            resources,
            routes,
            pools,
            discoverer,
            client,
            metrics,
            registry,
            watch,
        })
    }

    /// The state for a reloaded `config`: metrics, client and cache carry over, pools whose
    /// spec did not change keep their endpoints (health, in-flight counts, versions,
    /// ejections; a discovered pool its last answer), a discovered pool whose other settings
    /// changed starts from its predecessor's addresses (never empty until its next lookup),
    /// and routes unchanged over those pools keep their [`routes::RouteState`]
    /// (model identity, parity hold, retry budget).
    ///
    /// # Errors
    /// [`AppError::Routes`] if a route names a missing pool (validation prevents it).
    pub fn reload(&self, Loaded { config, resources }: Loaded) -> Result<Self, AppError> {
        let rule = upstream::EjectionRule::of(&config.upstream);
        let pools: Vec<Arc<Pool>> = config
            .pools
            .iter()
            .map(|(name, spec)| {
                let tls = |r: &Resources| r.pools.get(name).and_then(|p| p.tls.clone());
                let old_spec = self.config.pools.get(name);
                let unchanged =
                    old_spec.is_some_and(|old| same_pool(old, spec) && tls(&self.resources) == tls(&resources));
                let previous = self.pools.iter().find(|p| &p.name == name);
                if let Some(kept) = previous.filter(|p| unchanged && p.ejection_rule() == rule) {
                    return Arc::clone(kept);
                }
                let fresh = new_pool(&config, &resources, name);
                let same_name = old_spec.is_some_and(|old| spec.discover.is_some() && old.discover == spec.discover);
                if let Some(previous) = previous.filter(|_| same_name) {
                    fresh.replace_members(&previous.member_addrs());
                }
                Arc::new(fresh)
            })
            .collect();
        pools.iter().for_each(|p| pool_series(&self.metrics.upstream, p));
        let discoverer = discoverer(&config, self.discoverer.as_ref())?;
        let routes = RouteTable::new(&config, &resources, &pools, self.metrics.routes(), Some(&self.routes))?;
        let local = local_renderers(&config, &resources, Some(&self.local));
        let kv_events = kv_sources(&config, &pools, &self.metrics.kv, Some(&self.kv_events));
        self.forget_removed(&pools, &routes);
        for gone in self.kv_events.keys().filter(|pool| !kv_events.contains_key(*pool)) {
            self.metrics.kv.forget_pool(gone);
        }
        self.metrics.requests.admission_limit().set(i64::try_from(config.server.max_in_flight).unwrap_or(i64::MAX));
        Ok(Self {
            config,
            resources,
            routes,
            pools,
            discoverer,
            client: Arc::clone(&self.client),
            metrics: self.metrics.clone(),
            registry: self.registry.clone(),
            cache: Arc::clone(&self.cache),
            homes: Arc::clone(&self.homes),
            verifier: Arc::clone(&self.verifier),
            local,
            kv_events,
            draining: Arc::clone(&self.draining),
            admission: Arc::clone(&self.admission),
            watch: Arc::clone(&self.watch),
        })
    }

    /// Removes the gauges of the endpoints, pools and routes this state has and `pools` and
    /// `routes` (a reload's) do not.
    fn forget_removed(&self, pools: &[Arc<Pool>], routes: &RouteTable) {
        for old in &self.pools {
            let Some(new) = pools.iter().find(|p| p.name == old.name) else {
                self.metrics.upstream.forget_pool(&old.name);
                old.endpoints().iter().for_each(|e| self.metrics.upstream.forget_endpoint(&old.name, &e.name));
                continue;
            };
            let kept = new.endpoints();
            for e in old.endpoints().iter().filter(|e| !kept.iter().any(|n| n.name == e.name)) {
                self.metrics.upstream.forget_endpoint(&old.name, &e.name);
            }
        }
        for old in self.routes.routes() {
            if !routes.routes().iter().any(|r| r.name == old.name) {
                self.metrics.parity.forget_models_differ(&old.name);
                self.metrics.parity.forget_parity_hold(&old.name);
            }
        }
    }

    /// Each pool's KV event subscribers follow its current members (after a discovery round
    /// changed them).
    pub fn kv_events_follow_members(&self) {
        for pool in &self.pools {
            if let Some(events) = self.kv_events.get(&pool.name) {
                let members: Vec<String> = pool.endpoints().iter().map(|e| e.name.clone()).collect();
                events.follow(&members);
            }
        }
    }

    /// Each pool's KV events index sized from what its engines say they hold (after a health
    /// round read their `/metrics`), unless its `max_blocks` is configured.
    pub fn size_kv_indexes(&self) {
        for pool in &self.pools {
            if let (Some(events), Some(blocks)) = (self.kv_events.get(&pool.name), pool.engine_gpu_blocks()) {
                events.size_for(blocks);
            }
        }
    }

    /// Sets the gauges read from state at a scrape and each health round: endpoints and
    /// ejected endpoints per pool, the relay cache (its expired entries dropped first).
    pub fn refresh_gauges(&self) {
        let now = std::time::Instant::now();
        for p in &self.pools {
            self.metrics.upstream.upstream_ejected(&p.name, p.ejected(now));
            self.metrics.upstream.pool_endpoints(&p.name, p.endpoints().len());
        }
        self.metrics.upstream.response_homes(self.homes.len());
        self.local.values().for_each(|l| l.report(&self.metrics.local));
        self.sweep_cache();
    }

    /// The pools that serve decodes (readiness needs each to have a healthy endpoint).
    pub fn decode_pools(&self) -> Vec<Arc<Pool>> {
        let mut pools: Vec<Arc<Pool>> = Vec::new();
        let all = self.routes.routes().iter().chain(std::iter::once(self.routes.default_route()));
        for route in all {
            if !pools.iter().any(|p| Arc::ptr_eq(p, &route.decode_pool)) {
                pools.push(Arc::clone(&route.decode_pool));
            }
        }
        pools
    }

    /// Drops expired relay cache entries and refreshes the cache gauges (scrapes and the
    /// health poller call it).
    pub fn sweep_cache(&self) {
        let evicted = self.cache.purge(std::time::Instant::now());
        let (entries, bytes) = self.cache.stats();
        self.metrics.id_cache.state(evicted.ttl, evicted.capacity, entries, bytes);
    }
}

/// The client requests being served, counted across config reloads (the bound itself is
/// read from each request's config, so a reload changes it for the next request).
#[derive(Debug, Default)]
pub struct Admission {
    in_flight: AtomicUsize,
}

/// One admitted request; its slot frees when this is dropped (with the request's context,
/// whatever path it ended on).
#[derive(Debug)]
pub struct Admitted(Arc<Admission>);

impl Admission {
    /// A slot when fewer than `limit` requests are in flight (0: always), else `None`.
    pub fn admit(self: &Arc<Self>, limit: usize) -> Option<Admitted> {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (limit == 0 || n < limit).then_some(n + 1))
            .ok()
            .map(|_| Admitted(Arc::clone(self)))
    }

    /// Requests admitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The background upkeep of the current [`App`], every health interval: the lookups of
/// discovered pools that are due, a health round over every endpoint (newcomers included),
/// each route's model comparison, idle engine connections closed, readiness, then the gauges
/// read from state; it reads the current state each round, so reloads take effect.
pub struct Upkeep {
    /// The current state.
    pub app: SharedApp,
    /// Time between rounds.
    pub interval: Duration,
}

impl Upkeep {
    /// One round.
    pub async fn run_once(&self) {
        let app = self.app.load_full();
        if let Some(discoverer) = &app.discoverer {
            upstream::discovery::round(discoverer, &app.pools, &app.metrics.upstream, &app.homes).await;
            app.kv_events_follow_members();
        }
        upstream::health::poll_round(&app.client, &app.metrics.upstream, &app.homes, &app.pools).await;
        app.size_kv_indexes();
        app.routes.compare_models(&app.metrics.parity);
        // Idle engine connections of endpoints no longer used (or removed by a reload) close
        // within one interval past their idle limit.
        app.client.close_expired_idle();
        let ready = app.decode_pools().iter().all(|p| p.any_healthy());
        app.metrics.upstream.ready().set(i64::from(ready));
        app.refresh_gauges();
    }
}

#[async_trait]
impl BackgroundService for Upkeep {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            self.run_once().await;
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_refuses_past_the_limit_and_frees_a_slot_on_drop() {
        let admission = Arc::new(Admission::default());
        let first = admission.admit(2).unwrap();
        let second = admission.admit(2).unwrap();
        assert!(admission.admit(2).is_none(), "a third is refused");
        assert_eq!(admission.in_flight(), 2);
        drop(first);
        let third = admission.admit(2).unwrap();
        assert!(admission.admit(1).is_none(), "a lower limit (a reload) applies at once");
        drop((second, third));
        assert_eq!(admission.in_flight(), 0);
        let unbounded: Vec<Admitted> = (0..5).filter_map(|_| admission.admit(0)).collect();
        assert_eq!(unbounded.len(), 5, "0: no bound");
    }

    /// A reload keeps a pool while every setting its build reads is the same: a change of each
    /// one makes it anew, a change of any other keeps it.
    #[test]
    fn a_pool_is_made_anew_when_a_setting_it_reads_changes_and_kept_otherwise() {
        use crate::config::{Balance, BlockSize, LocalIdsMode, Pool as Spec, PoolKvEvents, PoolTls, Version};
        type Change = (&'static str, fn(&mut Spec));
        let base = Spec { endpoints: vec!["127.0.0.1:8100".into()], ..Spec::default() };
        let read: [Change; 11] = [
            ("endpoints", |p| p.endpoints.push("127.0.0.1:8101".into())),
            ("discover", |p| p.discover = Some("engines.test:8100".into())),
            ("discover_interval_ms", |p| p.discover_interval_ms += Duration::from_secs(1)),
            ("engine_metrics_interval_ms", |p| p.engine_metrics_interval_ms += Duration::from_secs(1)),
            ("balance", |p| p.balance = Balance::LeastInFlight),
            ("vllm_version", |p| p.vllm_version = Some(Version(0, 32, 0))),
            ("cache_aware.prefix_weight", |p| p.cache_aware.prefix_weight = 2.0),
            ("cache_aware.load_weight", |p| p.cache_aware.load_weight = 0.5),
            ("cache_aware.block_size", |p| p.cache_aware.block_size = BlockSize::try_from(32).unwrap()),
            ("cache_aware.hash_seed", |p| p.cache_aware.hash_seed = "0".into()),
            ("cache_aware.max_blocks", |p| p.cache_aware.max_blocks = 7),
        ];
        let not_read: [Change; 7] = [
            ("tls (compared as loaded)", |p| p.tls = Some(PoolTls::default())),
            ("tokenizer", |p| p.tokenizer = Some("/models/x".into())),
            ("local_ids", |p| p.local_ids = LocalIdsMode::Shadow),
            ("local_ids_verify_after", |p| p.local_ids_verify_after = 7),
            ("local_ids_recheck", |p| p.local_ids_recheck = 0.5),
            ("kv_events", |p| p.kv_events = Some(PoolKvEvents::default())),
            ("nothing", |_| {}),
        ];
        for (kept, changes) in [(false, &read[..]), (true, &not_read[..])] {
            for (field, change) in changes {
                let mut new = base.clone();
                change(&mut new);
                assert_eq!(same_pool(&base, &new), kept, "{field}");
            }
        }

        // Through a reload: the pool whose balance changed is new, the one whose local-ids
        // count changed is the same one.
        let text = |verify_after: u32, balance: &str| {
            format!(
                "[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\nlocal_ids_verify_after = {verify_after}\n\
                 [pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\nbalance = \"{balance}\"\n"
            )
        };
        let app = App::new(crate::config::from_toml(&text(7, "round_robin"), "t").unwrap()).unwrap();
        let next = app.reload(crate::config::from_toml(&text(8, "least_in_flight"), "t").unwrap()).unwrap();
        let pool = |app: &App, name: &str| Arc::clone(app.pools.iter().find(|p| p.name == name).unwrap());
        assert!(Arc::ptr_eq(&pool(&app, "prefill"), &pool(&next, "prefill")), "kept");
        assert!(!Arc::ptr_eq(&pool(&app, "decode"), &pool(&next, "decode")), "made anew");
    }

    fn kv_config(block_size: u32) -> Loaded {
        let text = format!(
            "[pools.prefill]\nendpoints = [\"127.0.0.1:8100#0-1\"]\n[pools.prefill.kv_events]\nport = 5557\n\
             block_size = {block_size}\n[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n"
        );
        crate::config::from_toml(&text, "kv").unwrap()
    }

    #[test]
    fn kv_events_follow_a_pools_members_as_they_change() {
        let text = "[pools.prefill]\ndiscover = \"engines.test:8100#0-1\"\n[pools.prefill.kv_events]\nport = 5557\n\
                    [pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
        let app = App::new(crate::config::from_toml(text, "kv").unwrap()).unwrap();
        let prefill_pool = app.pools.iter().find(|p| p.name == "prefill").unwrap();
        let at = |ip: &str| std::net::SocketAddr::new(ip.parse().unwrap(), 8100);
        prefill_pool.replace_members(&[at("127.0.0.1")]);
        app.kv_events_follow_members();
        assert!(app.kv_events.get("prefill").unwrap().subscribed("127.0.0.1:8100#1"), "first members subscribed");
        prefill_pool.replace_members(&[at("127.0.0.3")]);
        app.kv_events_follow_members();
        let events = app.kv_events.get("prefill").unwrap();
        assert!(events.subscribed("127.0.0.3:8100#0") && events.subscribed("127.0.0.3:8100#1"), "newcomers subscribed");
        assert!(!events.subscribed("127.0.0.1:8100#0") && !events.subscribed("127.0.0.1:8100#1"), "leavers stopped");
        assert_eq!(events.len(), 2);
    }

    #[test]
    fn a_cache_aware_pool_asks_its_events_first_and_forgets_them_with_the_config() {
        use crate::metrics::ChoiceSource;
        let text = |kv: &str| {
            format!(
                "[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\nbalance = \"cache_aware\"\n{kv}\
                 [pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n"
            )
        };
        let with_events = || crate::config::from_toml(&text("[pools.prefill.kv_events]\nport = 5557\n"), "kv").unwrap();
        let app = App::new(with_events()).unwrap();
        let prefill = |app: &App| Arc::clone(app.pools.iter().find(|p| p.name == "prefill").unwrap());
        assert_eq!(prefill(&app).prefix_sources(), [ChoiceSource::Events, ChoiceSource::Sent]);
        let off = app.reload(crate::config::from_toml(&text(""), "kv").unwrap()).unwrap();
        assert_eq!(prefill(&off).prefix_sources(), [ChoiceSource::Sent], "events gone with their config");
        let on = off.reload(with_events()).unwrap();
        assert_eq!(prefill(&on).prefix_sources(), [ChoiceSource::Events, ChoiceSource::Sent], "and back");
    }

    #[test]
    fn pools_with_kv_events_get_subscribers_kept_by_a_reload_that_changes_neither() {
        let app = App::new(kv_config(32)).unwrap();
        let prefill = app.kv_events.get("prefill").unwrap();
        assert!(!app.kv_events.contains_key("decode"), "no kv_events: no subscribers");
        assert!(prefill.subscribed("127.0.0.1:8100#0") && prefill.subscribed("127.0.0.1:8100#1"));
        let same = app.reload(kv_config(32)).unwrap();
        assert!(Arc::ptr_eq(prefill, same.kv_events.get("prefill").unwrap()), "carried over");
        let changed = same.reload(kv_config(64)).unwrap();
        let fresh = changed.kv_events.get("prefill").unwrap();
        assert!(!Arc::ptr_eq(prefill, fresh) && fresh.settings().block_size == 64, "started anew");

        // A reload without kv_events stops them and removes their series (no alert stays on).
        let kv_series = |app: &App| {
            app.registry
                .gather()
                .iter()
                .filter(|f| f.name().starts_with("tokenonce_kv_"))
                .map(|f| f.get_metric().len())
                .sum::<usize>()
        };
        assert!(kv_series(&changed) > 0);
        let text =
            "[pools.prefill]\nendpoints = [\"127.0.0.1:8100#0-1\"]\n[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
        let off = changed.reload(crate::config::from_toml(text, "kv").unwrap()).unwrap();
        assert!(off.kv_events.is_empty());
        assert_eq!(kv_series(&off), 0);
    }
}
