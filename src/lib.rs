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
//! - `server`: wiring config into a pingora server.

pub mod config;
pub mod handoff;
pub mod metrics;
pub mod openai;
pub mod proxy;
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
    /// Relay-mode ids waiting for their decode.
    pub cache: handoff::IdCache,
}

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
            metrics.init_route(&route.name);
        }
        let pools = config.pools.iter().map(|spec| Arc::new(Pool::new(spec))).collect();
        let client = Arc::new(UpstreamClient::new(config.upstream.connect_timeout, config.upstream.idle_timeout));
        let max_body_bytes = config.routes.iter().map(|r| r.options.max_body_bytes).max().unwrap_or(32 << 20);
        let cache = handoff::IdCache::new(config.cache.capacity_bytes, config.cache.ttl);
        Ok(Self {
            cache,
            passthrough_pool: config.passthrough_pool,
            config,
            routes,
            pools,
            max_body_bytes,
            client,
            metrics,
            registry,
        })
    }

    /// The metric label of a route index (`default` when none matched).
    pub fn route_label(&self, route: Option<usize>) -> &str {
        route.and_then(|i| self.routes.routes().get(i)).map_or("default", |r| r.name.as_str())
    }
}
