//! tokenonce: a sidecar reverse proxy for vLLM prefill/decode disaggregation that sends the
//! prefill's prompt token ids to the decode, so the prompt is rendered and tokenized once.
//!
//! Layout (formats → model → pipeline):
//! - `config`: TOML file format → validated model; the embedded default.
//! - `routes`: ordered rule matching.
//! - `openai`: request view, prefill/decode rewrites, handoff extraction, response rewrites,
//!   prompt-id validation, error bodies; pure functions on bytes.
//! - `sse`: incremental SSE framing.
//! - `upstream`: pools, the HTTP client for the legs, health and version polling.
//! - `proxy`: pingora phases; `proxy/pd.rs` runs the P/D exchange.
//! - `metrics`: every exported metric.
//! - `reload`: SIGHUP config reload.
//! - `server`: wiring config into a pingora server.

pub mod config;
pub mod handoff;
pub mod metrics;
pub mod openai;
pub mod proxy;
pub mod reload;
pub mod routes;
pub mod server;
pub mod sse;
pub mod upstream;

use std::sync::Arc;

use prometheus::Registry;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::routes::RouteTable;
use crate::upstream::{Pool, UpstreamClient};

/// Body read limit when no route sets one (no route at all: everything is passthrough).
const MAX_BODY_BYTES: usize = config::defaults::MAX_BODY_BYTES as usize;

/// Everything a request needs, built once from the config.
pub struct App {
    /// The validated config.
    pub config: Config,
    /// Routes in order.
    pub routes: RouteTable,
    /// Pools, indexed as in the config.
    pub pools: Vec<Arc<Pool>>,
    /// Pool for unmatched requests.
    pub passthrough_pool: usize,
    /// Largest body any API route accepts (bounds the read before a route is chosen).
    pub max_body_bytes: usize,
    /// The upstream client.
    pub client: Arc<UpstreamClient>,
    /// Metric handles.
    pub metrics: Metrics,
    /// Their registry.
    pub registry: Registry,
    /// Relay-mode ids waiting for their decode (kept across reloads).
    pub cache: Arc<handoff::IdCache>,
    /// Set by the admin `/drain` (a preStop hook): `/readyz` answers 503 from then on.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
}

/// The current [`App`], swapped whole when the config is reloaded; each request takes one
/// snapshot and keeps it to the end.
pub type SharedApp = Arc<arc_swap::ArcSwap<App>>;

impl App {
    /// Builds the state from a validated config.
    ///
    /// # Errors
    /// When metrics cannot be registered.
    pub fn new(config: Config) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let metrics = Metrics::register(&registry)?;
        let routes = RouteTable::new(&config);
        for route in routes.routes() {
            metrics.init_route(route.name());
        }
        let pools = config.pools().iter().map(|spec| Arc::new(Pool::new(spec))).collect();
        let client =
            Arc::new(UpstreamClient::new(config.upstream().connect_timeout(), config.upstream().idle_timeout()));
        let max_body_bytes =
            config.routes().iter().map(|r| r.options().max_body_bytes()).max().unwrap_or(MAX_BODY_BYTES);
        let cache = Arc::new(handoff::IdCache::new(config.cache().capacity_bytes(), config.cache().ttl()));
        Ok(Self {
            cache,
            draining: Arc::default(),
            passthrough_pool: config.passthrough_pool(),
            config,
            routes,
            pools,
            max_body_bytes,
            client,
            metrics,
            registry,
        })
    }

    /// The state for a reloaded `config`: metrics, client and cache carry over, and pools
    /// whose spec did not change keep their endpoints (health, in-flight counts, versions).
    pub fn reload(&self, config: Config) -> Self {
        let routes = RouteTable::new(&config);
        for route in routes.routes() {
            self.metrics.init_route(route.name());
        }
        let pools = config
            .pools()
            .iter()
            .map(|spec| {
                self.config
                    .pools()
                    .iter()
                    .position(|old| {
                        old.name() == spec.name()
                            && old.endpoints() == spec.endpoints()
                            && old.balance() == spec.balance()
                            && old.vllm_version() == spec.vllm_version()
                    })
                    .and_then(|i| self.pools.get(i).cloned())
                    .unwrap_or_else(|| Arc::new(Pool::new(spec)))
            })
            .collect();
        let max_body_bytes =
            config.routes().iter().map(|r| r.options().max_body_bytes()).max().unwrap_or(MAX_BODY_BYTES);
        Self {
            passthrough_pool: config.passthrough_pool(),
            config,
            routes,
            pools,
            max_body_bytes,
            client: Arc::clone(&self.client),
            metrics: self.metrics.clone(),
            registry: self.registry.clone(),
            cache: Arc::clone(&self.cache),
            draining: Arc::clone(&self.draining),
        }
    }

    /// Indexes of the pools that serve decodes (readiness needs each to have a healthy endpoint).
    pub fn decode_pools(&self) -> Vec<usize> {
        let mut pools: Vec<usize> = self.routes.routes().iter().map(|r| r.decode_pool()).collect();
        pools.push(self.passthrough_pool);
        pools.sort_unstable();
        pools.dedup();
        pools
    }

    /// The metric label of a route index (`default` when none matched).
    pub fn route_label(&self, route: Option<usize>) -> &str {
        route.and_then(|i| self.routes.routes().get(i)).map_or("default", |r| r.name())
    }
}
