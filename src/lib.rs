//! tokenonce: a sidecar reverse proxy for vLLM prefill/decode disaggregation that sends the
//! prefill's prompt token ids to the decode, so the prompt is rendered and tokenized once.
//!
//! Layout (formats → model → plan → execution); docs/contributing.md walks the request path:
//! - `config`: the TOML file as typed data, checked, with what it names loaded; the embedded default.
//! - `routes`: the runtime route table (routes holding their pools, policy, metric handles)
//!   and what each route learns at run time (`RouteState`, kept across reloads).
//! - `plan`: pure decisions per request: legs, reuse gate, prefill and decode bodies.
//! - `openai`: the wire protocol as pure functions on bytes (request view, rewrites, handoff
//!   extraction, prompt-id validation, error bodies).
//! - `handoff`: the relay-mode id cache and correlation keys.
//! - `parity`: pool tokenizers, the vocabulary bound and the sampled parity watch.
//! - `render`: chat and completion prompts rendered as vLLM renders them; `local`: local ids
//!   computed from them and compared with the prefill's echo (shadow).
//! - `sse`: incremental SSE framing.
//! - `upstream`: pools, the leg client (retry, budget, ejection) over the HTTP client,
//!   health and version polling.
//! - `proxy`: pingora glue and the executor that runs a plan; the one error exit.
//!   ARCHITECTURE.md is the one-page map of these rooms.
//! - `metrics`: every exported metric and its label enums.
//! - `reload`: SIGHUP config reload.
//! - `render`: chat prompts rendered as vLLM renders them (pure; not wired in yet).
//! - `server`: wiring config into a pingora server.
//! - `telemetry`: logging and OpenTelemetry spans of each request and its legs.
//! - `toml_read`: TOML text into serde types with every problem at its key and line:column.
//! - `tls`: certificates from files, the TLS listener's certificate, pools' upstream TLS.
//! - `tokens`: a rendered prompt tokenized segment by segment, each segment once (segment
//!   cache); not wired into the request path yet.

pub mod addr;
pub mod config;

/// What this binary is: its version and the build facts `build.rs` recorded, as
/// `tokenonce --version` prints them and `tokenonce_build_info` labels them.
pub mod build {
    /// The crate version.
    pub const VERSION: &str = env!("CARGO_PKG_VERSION");
    /// The git commit built (`unknown` outside a checkout).
    pub const COMMIT: &str = env!("TOKENONCE_COMMIT");
    /// The compiler's version.
    pub const RUSTC: &str = env!("TOKENONCE_RUSTC");
    /// The cargo profile (`release`, `debug`).
    pub const PROFILE: &str = env!("TOKENONCE_PROFILE");
    /// `--version`'s line after the name.
    pub const LONG_VERSION: &str = concat!(
        env!("CARGO_PKG_VERSION"),
        " (commit ",
        env!("TOKENONCE_COMMIT"),
        ", rustc ",
        env!("TOKENONCE_RUSTC"),
        ", ",
        env!("TOKENONCE_PROFILE"),
        " profile)"
    );
}
pub mod handoff;
pub mod kvhash;
pub mod local;
pub mod metrics;
pub mod openai;
pub mod parity;
pub mod plan;
pub mod proxy;
pub mod reload;
pub mod render;
pub mod routes;
pub mod server;
pub mod sse;
pub mod telemetry;
pub mod tls;
pub mod tokens;
pub mod toml_read;
pub mod upstream;

use std::sync::Arc;

use prometheus::Registry;

use crate::config::{Config, Loaded, Resources};
use crate::metrics::Metrics;
use crate::routes::{DanglingPool, RouteTable};
use crate::upstream::{Pool, UpstreamClient};

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
    /// Client-edge limits (requests in flight, header count and size, body read deadline).
    pub edge: proxy::edge::EdgeLimits,
    /// The client requests being served (kept across reloads; the bound is in `edge`).
    pub admission: Arc<proxy::edge::Admission>,
    /// The parity watch's workers (kept across reloads).
    pub watch: Arc<parity::Watch>,
    /// The local-ids verifier's workers (kept across reloads).
    pub verifier: Arc<local::Verifier>,
    /// Each pool's local renderer, for pools with `local_ids` on (by pool name).
    pub local: std::collections::BTreeMap<String, Arc<local::LocalIds>>,
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
        let (Some(template), Some(tokenizer), Some(spec)) =
            (p.template.clone(), p.tokenizer.clone(), config.pools.get(name))
        else {
            continue;
        };
        let policy = local::Policy {
            mode: spec.local_ids,
            verify_after: spec.local_ids_verify_after,
            recheck: spec.local_ids_recheck,
        };
        match local::LocalIds::new(name, template, tokenizer, policy) {
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
        pools.iter().for_each(|p| metrics.pool(&p.name));
        let routes = RouteTable::new(&config, &resources, &pools, &metrics, None)?;
        let upstream = &config.upstream;
        let client = Arc::new(UpstreamClient::new(upstream.connect_timeout_ms, upstream.idle_timeout_ms));
        let cache = Arc::new(handoff::IdCache::new(config.cache.capacity_bytes, config.cache.ttl_ms));
        let edge = proxy::edge::EdgeLimits::of(&config);
        metrics.admission_limit().set(i64::try_from(edge.max_in_flight).unwrap_or(i64::MAX));
        let watch = Arc::new(parity::Watch::start(parity::WORKERS, parity::QUEUE)?);
        let verifier = Arc::new(local::Verifier::start(local::WORKERS, local::QUEUE, &metrics)?);
        let local = local_renderers(&config, &resources, None);
        let admission = Arc::default();
        Ok(Self {
            cache,
            homes: Arc::default(),
            verifier,
            local,
            draining: Arc::default(),
            edge,
            admission,
            config,
            resources,
            routes,
            pools,
            client,
            metrics,
            registry,
            watch,
        })
    }

    /// The state for a reloaded `config`: metrics, client and cache carry over, pools whose
    /// spec did not change keep their endpoints (health, in-flight counts, versions,
    /// ejections), and routes unchanged over those pools keep their [`routes::RouteState`]
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
                let unchanged = self.config.pools.get(name).is_some_and(|old| {
                    old.endpoints == spec.endpoints
                        && old.balance == spec.balance
                        && old.vllm_version == spec.vllm_version
                        && tls(&self.resources) == tls(&resources)
                });
                self.pools
                    .iter()
                    .find(|p| unchanged && &p.name == name && p.ejection_rule() == rule)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(new_pool(&config, &resources, name)))
            })
            .collect();
        pools.iter().for_each(|p| self.metrics.pool(&p.name));
        let routes = RouteTable::new(&config, &resources, &pools, &self.metrics, Some(&self.routes))?;
        let local = local_renderers(&config, &resources, Some(&self.local));
        self.forget_removed(&pools, &routes);
        let edge = proxy::edge::EdgeLimits::of(&config);
        self.metrics.admission_limit().set(i64::try_from(edge.max_in_flight).unwrap_or(i64::MAX));
        Ok(Self {
            config,
            resources,
            routes,
            pools,
            client: Arc::clone(&self.client),
            metrics: self.metrics.clone(),
            registry: self.registry.clone(),
            cache: Arc::clone(&self.cache),
            homes: Arc::clone(&self.homes),
            verifier: Arc::clone(&self.verifier),
            local,
            draining: Arc::clone(&self.draining),
            edge,
            admission: Arc::clone(&self.admission),
            watch: Arc::clone(&self.watch),
        })
    }

    /// Removes the gauges of the endpoints, pools and routes this state has and `pools` and
    /// `routes` (a reload's) do not.
    fn forget_removed(&self, pools: &[Arc<Pool>], routes: &RouteTable) {
        for old in &self.pools {
            let Some(new) = pools.iter().find(|p| p.name == old.name) else {
                self.metrics.forget_pool(&old.name);
                old.endpoints.iter().for_each(|e| self.metrics.forget_endpoint(&old.name, &e.name));
                continue;
            };
            for e in old.endpoints.iter().filter(|e| !new.endpoints.iter().any(|n| n.name == e.name)) {
                self.metrics.forget_endpoint(&old.name, &e.name);
            }
        }
        for old in self.routes.routes() {
            if !routes.routes().iter().any(|r| r.name == old.name) {
                self.metrics.forget_models_differ(&old.name);
                self.metrics.forget_parity_hold(&old.name);
            }
        }
    }

    /// Sets the gauges read from state at a scrape and each health round: ejected endpoints
    /// per pool, the relay cache (its expired entries dropped first).
    pub fn refresh_gauges(&self) {
        let now = std::time::Instant::now();
        self.pools.iter().for_each(|p| self.metrics.upstream_ejected(&p.name, p.ejected(now)));
        self.metrics.response_homes(self.homes.len());
        self.local.values().for_each(|l| l.report(&self.metrics));
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
        self.metrics.cache_state(evicted.ttl, evicted.capacity, entries, bytes);
    }
}
