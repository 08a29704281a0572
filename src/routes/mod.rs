//! The route table the request path runs on, built once per config: routes in order, each
//! holding its pools (`Arc`), its reuse policy, limits and pre-resolved metric handles; the
//! first rule whose path, model glob and headers all match wins, else the `default` route
//! (passthrough to `defaults.passthrough_pool`). `select` is a pure function of the request.
//! What a route learns at run time is its [`RouteState`] (`state.rs`), carried across reloads.

pub mod metrics;
mod state;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;

pub use state::{BudgetRule, RouteState};

use self::metrics::{RouteFamilies, RouteMetrics};
use crate::config::{AllowRule, Config, Match, Mode, ParityPolicy, Resources, Route as RouteSpec};
use crate::parity::metrics::ParityMetrics;
use crate::parity::RouteParity;
use crate::plan::{AllowedPrefiller, ClientHandoff, HeaderRule, ReusePolicy};
use crate::upstream::metrics::LegMetrics;
use crate::upstream::{Pool, RetryBudget};

/// The facts a route is chosen on.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// Request path (no query).
    pub path: &'a str,
    /// The body's `model`, when one was read.
    pub model: Option<&'a str>,
    /// Request headers.
    pub headers: &'a HeaderMap,
}

/// Where a route's prefill leg goes.
#[derive(Debug)]
pub enum PrefillTarget {
    /// An endpoint of this pool.
    Pool(Arc<Pool>),
    /// The `host:port` a request header names, checked against its rule.
    Header(HeaderRule),
}

/// One route, ready to serve.
pub struct Route {
    /// Name in metrics and logs.
    pub name: String,
    /// What it does.
    pub mode: Mode,
    matcher: Option<Match>,
    /// The decode leg's pool (and a passthrough's).
    pub decode_pool: Arc<Pool>,
    /// The prefill leg's destination (orchestrate; relay: the pool for prefills).
    pub prefill: Option<PrefillTarget>,
    /// What decides token reuse.
    pub policy: ReusePolicy,
    /// Orchestrate: what to do with a client's own handoff fields.
    pub client_handoff: ClientHandoff,
    /// Whole prefill leg deadline.
    pub prefill_timeout: Duration,
    /// Decode response-header deadline (of a streamed answer).
    pub decode_first_byte_timeout: Duration,
    /// A non-streamed answer's deadline (its head comes when generation is done).
    pub decode_whole_answer_timeout: Duration,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Pool prefill: endpoints tried (at least 1; at most the pool's size at run time).
    pub prefill_attempts: usize,
    /// Orchestrate with a prefill pool: the decode computes a prompt alone when it lacks at
    /// most this many of its tokens (0: never).
    pub skip_prefill_below: u64,
    /// Orchestrate: what a failed prefill leg leads to.
    pub on_prefill_failure: crate::config::OnPrefillFailure,
    /// Silence allowed between body chunks of a relayed answer.
    pub stream_idle_timeout: Duration,
    /// How long one write to the client may wait.
    pub client_write_timeout: Duration,
    /// Orchestrate: a client gone after a prefill holding KV.
    pub on_client_gone: crate::config::OnClientGone,
    /// Deadline of the release leg.
    pub release_timeout: Duration,
    /// Longest SSE event relayed.
    pub max_sse_event_bytes: usize,
    /// This route's series.
    pub metrics: RouteMetrics,
    /// Its legs' series (retries its budget refused, prefill failovers).
    pub leg_metrics: LegMetrics,
    /// The parity watch, when the route's pools have a tokenizer (its hold is in `state`).
    pub parity: Option<Arc<RouteParity>>,
    /// What the route learned at run time; carried across reloads while it is unchanged.
    state: Arc<RouteState>,
}

impl Route {
    /// The reuse policy for a request now: the config's knobs plus the route's current state
    /// (parity watch holding reuse off, pools serving different models).
    pub fn policy_now(&self) -> ReusePolicy {
        ReusePolicy {
            hold_ids: self.parity.as_ref().is_some_and(|p| p.reuse_off()),
            models_differ: self.state.models_differ(),
            ..self.policy
        }
    }

    /// What the route learned at run time.
    pub fn state(&self) -> &RouteState {
        &self.state
    }

    /// The route's retry budget (part of its state).
    pub fn retry_budget(&self) -> &RetryBudget {
        self.state.retry_budget()
    }

    /// True when `old` is this route before a reload, unchanged: same name, mode and pools
    /// (the very pool objects a reload carried over) or prefiller rule.
    fn same_as(&self, old: &Route) -> bool {
        let same_prefill = match (&self.prefill, &old.prefill) {
            (None, None) => true,
            (Some(PrefillTarget::Pool(a)), Some(PrefillTarget::Pool(b))) => Arc::ptr_eq(a, b),
            (Some(PrefillTarget::Header(a)), Some(PrefillTarget::Header(b))) => a == b,
            _ => false,
        };
        self.name == old.name
            && self.mode == old.mode
            && Arc::ptr_eq(&self.decode_pool, &old.decode_pool)
            && same_prefill
    }

    /// The header naming the prefiller, which is never forwarded to an engine.
    pub fn prefiller_header(&self) -> Option<&str> {
        match &self.prefill {
            Some(PrefillTarget::Header(rule)) => Some(&rule.name),
            _ => None,
        }
    }

    fn path_matches(&self, path: &str) -> bool {
        self.matcher.as_ref().is_some_and(|m| m.paths.is_empty() || m.paths.iter().any(|p| p == path))
    }

    fn matches(&self, facts: &RequestFacts<'_>) -> bool {
        let Some(m) = &self.matcher else { return false };
        self.path_matches(facts.path)
            && m.model.as_ref().is_none_or(|glob| facts.model.is_some_and(|model| glob.0.is_match(model)))
            && m.headers.iter().all(|(name, value)| {
                facts.headers.get(name.as_str()).and_then(|v| v.to_str().ok()).is_some_and(|v| v == value)
            })
    }
}

/// A pool reference the validated config should never contain.
#[derive(Debug, thiserror::Error)]
#[error("route `{route}` refers to a pool that does not exist")]
pub struct DanglingPool {
    route: String,
}

/// Ordered routes and the default.
pub struct RouteTable {
    routes: Vec<Arc<Route>>,
    default: Arc<Route>,
}

impl RouteTable {
    /// Sets each route's "pools serve different models" flag and gauge from what the
    /// endpoints reported (`GET /v1/models`); a change is logged.
    pub fn compare_models(&self, metrics: &ParityMetrics) {
        for route in self.routes() {
            let Some(PrefillTarget::Pool(prefill)) = &route.prefill else { continue };
            let differ = crate::upstream::health::pools_differ(prefill, &route.decode_pool);
            metrics.models_differ(&route.name, differ);
            if route.state().set_models_differ(differ) {
                if differ {
                    tracing::warn!(route = %route.name, "prefill and decode pools serve different models: no ids are exchanged");
                } else {
                    tracing::info!(route = %route.name, "prefill and decode pools serve the same model again");
                }
            }
        }
    }

    /// Builds the table of a validated `config` over its `pools` (same order as
    /// `config.pools`), resolving each route's series in `metrics`. A route that `previous`
    /// (the table before a reload) holds unchanged keeps its [`RouteState`].
    ///
    /// # Errors
    /// [`DanglingPool`] if a route names a pool not in `pools` (validation prevents it).
    pub fn new(
        config: &Config,
        resources: &Resources,
        pools: &[Arc<Pool>],
        metrics: RouteFamilies<'_>,
        previous: Option<&RouteTable>,
    ) -> Result<Self, DanglingPool> {
        let built = Built { config, resources, pools, metrics, previous, now: Instant::now() };
        let routes = config.routes.iter().map(|spec| built.route(spec).map(Arc::new)).collect::<Result<Vec<_>, _>>()?;
        let largest_body = routes.iter().map(|r| r.max_body_bytes).max().unwrap_or(DEFAULT_ROUTE_BODY_LIMIT);
        let default = built.default_route(largest_body)?;
        Ok(Self { routes, default: Arc::new(default) })
    }

    /// The configured routes in order.
    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The route of requests no rule matches.
    pub fn default_route(&self) -> &Arc<Route> {
        &self.default
    }

    /// The first route matching `facts`, else the default.
    pub fn select(&self, facts: &RequestFacts<'_>) -> &Arc<Route> {
        self.routes.iter().find(|r| r.matches(facts)).unwrap_or(&self.default)
    }

    /// Largest body any route accepts (bounds the read before a route is chosen).
    pub fn max_body_bytes(&self) -> usize {
        self.default.max_body_bytes
    }
}

/// A header prefill's allowlist with each entry's loaded TLS (a rule without `match` was
/// refused by the checks).
fn allowed_prefillers(resources: &Resources, route: &str, rules: &[AllowRule]) -> Vec<AllowedPrefiller> {
    let tls = resources.allow_tls.get(route);
    let tls_of = |j: usize| tls.and_then(|t| t.get(j)).cloned().flatten();
    let entries = rules.iter().enumerate();
    entries.filter_map(|(j, r)| Some(AllowedPrefiller { entry: r.matcher.clone()?, tls: tls_of(j) })).collect()
}

/// What every route of one table is built from.
struct Built<'a> {
    config: &'a Config,
    resources: &'a Resources,
    pools: &'a [Arc<Pool>],
    metrics: RouteFamilies<'a>,
    /// The table before a reload: unchanged routes keep their state.
    previous: Option<&'a RouteTable>,
    now: Instant,
}

impl Built<'_> {
    /// The pool named `name`, for route `route`.
    fn pool(&self, name: &str, route: &str) -> Result<Arc<Pool>, DanglingPool> {
        self.pools.iter().find(|p| p.name == name).cloned().ok_or(DanglingPool { route: route.to_owned() })
    }

    /// One configured route, with its state carried over when `previous` holds it unchanged.
    fn route(&self, spec: &RouteSpec) -> Result<Route, DanglingPool> {
        let o = spec;
        let prefill = match &spec.prefill {
            Some(p) => match (&p.pool, &p.header) {
                (Some(pool), _) => Some(PrefillTarget::Pool(self.pool(pool, &spec.name)?)),
                (None, Some(header)) => Some(PrefillTarget::Header(HeaderRule {
                    name: header.to_ascii_lowercase(),
                    allow: allowed_prefillers(self.resources, &spec.name, &p.allow),
                    trusted_sources: p.trusted_sources.iter().map(|n| n.0).collect(),
                    forward_credentials: p.forward_credentials,
                })),
                (None, None) => None,
            },
            None => None,
        };
        let tokenizer = route_tokenizer(self.resources, spec);
        let budget = BudgetRule { percent: o.retry_budget_percent, min_per_second: o.retry_budget_min_per_second };
        let mut matcher = spec.matcher.clone();
        matcher.headers = matcher.headers.into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect();
        let mut route = Route {
            name: spec.name.clone(),
            mode: spec.mode,
            matcher: Some(matcher),
            decode_pool: self.pool(&spec.decode_pool, &spec.name)?,
            prefill,
            policy: ReusePolicy::new(o.token_reuse, o.relay_handoff, tokenizer.as_ref().map(|t| t.vocab_bound())),
            client_handoff: o.client_kv_transfer_params,
            prefill_timeout: o.prefill_timeout_ms,
            decode_first_byte_timeout: o.decode_first_byte_timeout_ms,
            decode_whole_answer_timeout: o.decode_whole_answer_timeout_ms,
            max_body_bytes: o.max_body_bytes,
            prefill_attempts: o.prefill_attempts,
            skip_prefill_below: spec.prefill.as_ref().filter(|p| p.pool.is_some()).map_or(0, |p| p.skip_below_tokens),
            on_prefill_failure: o.on_prefill_failure,
            stream_idle_timeout: o.stream_idle_timeout_ms,
            client_write_timeout: o.client_write_timeout_ms,
            on_client_gone: o.on_client_gone,
            release_timeout: o.release_timeout_ms,
            max_sse_event_bytes: o.max_sse_event_bytes,
            metrics: self.metrics.requests.route(&spec.name, spec.mode),
            leg_metrics: self.metrics.upstream.route_legs(&spec.name),
            parity: None,
            state: RouteState::new(budget, self.now),
        };
        let holds = tokenizer.is_some() && o.on_parity_mismatch == ParityPolicy::DisableReuse;
        if let Some(old) = self.previous.and_then(|t| t.routes.iter().find(|old| route.same_as(old))) {
            route.state = RouteState::carried(&old.state, budget, holds, self.now);
        }
        route.parity = route_parity(spec, tokenizer, self.metrics.parity, &route.state);
        Ok(route)
    }

    /// The route of unmatched requests: passthrough to `defaults.passthrough_pool`, taking
    /// bodies up to `largest_body` (the most any route accepts).
    fn default_route(&self, largest_body: usize) -> Result<Route, DanglingPool> {
        let d = RouteSpec::default();
        let budget = BudgetRule { percent: d.retry_budget_percent, min_per_second: d.retry_budget_min_per_second };
        let mut default = Route {
            name: DEFAULT_ROUTE.to_owned(),
            mode: Mode::Passthrough,
            matcher: None,
            decode_pool: self.pool(&self.config.defaults.passthrough_pool, DEFAULT_ROUTE)?,
            prefill: None,
            policy: ReusePolicy::new(crate::config::ReuseShare::OFF, crate::config::RelayHandoff::Cache, None),
            client_handoff: ClientHandoff::Strip,
            prefill_timeout: d.prefill_timeout_ms,
            decode_first_byte_timeout: d.decode_first_byte_timeout_ms,
            decode_whole_answer_timeout: d.decode_whole_answer_timeout_ms,
            max_body_bytes: largest_body,
            prefill_attempts: 1,
            skip_prefill_below: 0,
            on_prefill_failure: crate::config::OnPrefillFailure::Error,
            stream_idle_timeout: d.stream_idle_timeout_ms,
            client_write_timeout: d.client_write_timeout_ms,
            on_client_gone: d.on_client_gone,
            release_timeout: d.release_timeout_ms,
            max_sse_event_bytes: d.max_sse_event_bytes,
            metrics: self.metrics.requests.default_route(DEFAULT_ROUTE),
            leg_metrics: self.metrics.upstream.route_legs(DEFAULT_ROUTE),
            parity: None,
            state: RouteState::new(budget, self.now),
        };
        if let Some(old) = self.previous.map(|t| &t.default).filter(|old| default.same_as(old)) {
            default.state = RouteState::carried(&old.state, budget, false, self.now);
        }
        Ok(default)
    }
}

/// A route's tokenizer: its decode pool's (the engine that reads the ids), else its prefill
/// pool's.
fn route_tokenizer(resources: &Resources, spec: &RouteSpec) -> Option<Arc<crate::parity::Tokenizer>> {
    let of = |name: &str| resources.pools.get(name).and_then(|p| p.tokenizer.clone());
    of(&spec.decode_pool).or_else(|| prefill_pool(spec).and_then(of))
}

/// The pool a route's prefill goes to, when it goes to a pool.
fn prefill_pool(spec: &RouteSpec) -> Option<&str> {
    spec.prefill.as_ref().and_then(|p| p.pool.as_deref())
}

/// A route's parity watch (with a tokenizer) holding reuse in `state`, and its parity and
/// model-identity series created and set to what `state` holds (zeros instead of gaps, also
/// on routes without a tokenizer; gauges equal the state they report after a reload too).
fn route_parity(
    spec: &RouteSpec,
    tokenizer: Option<Arc<crate::parity::Tokenizer>>,
    metrics: &ParityMetrics,
    state: &RouteState,
) -> Option<Arc<RouteParity>> {
    let name = &spec.name;
    if prefill_pool(spec).is_some() {
        metrics.models_differ(name, state.models_differ());
    } else {
        metrics.forget_models_differ(name);
    }
    if spec.mode != Mode::Passthrough {
        metrics.route(name).show_hold(state.parity_hold().is_held());
    } else {
        metrics.forget_parity_hold(name);
    }
    tokenizer.map(|t| {
        Arc::new(RouteParity::new(
            name,
            t,
            spec.parity_sample,
            spec.on_parity_mismatch,
            spec.parity_cooldown_ms,
            metrics.route(name),
            Arc::clone(state.parity_hold()),
        ))
    })
}

/// The metric label of unmatched requests.
pub const DEFAULT_ROUTE: &str = "default";

/// The body bound when no route is configured (the route default, 32 MiB).
const DEFAULT_ROUTE_BODY_LIMIT: usize = 32 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = r#"
[pools.decode]
endpoints = ["127.0.0.1:1"]
[pools.prefill]
endpoints = ["127.0.0.1:2"]
[[routes]]
name = "tenant-b"
mode = "passthrough"
decode_pool = "decode"
[routes.match]
paths = ["/v1/chat/completions"]
headers = { "x-tenant" = "b" }
[[routes]]
name = "qwen"
mode = "orchestrate"
decode_pool = "decode"
prefill = { pool = "prefill" }
[routes.match]
paths = ["/v1/chat/completions", "/v1/completions"]
model = "Qwen/*"
[[routes]]
name = "rest"
mode = "passthrough"
decode_pool = "decode"
"#;

    fn table() -> RouteTable {
        let config = Config::from_toml(CONF, "t").unwrap();
        let none = Resources::default();
        let pools: Vec<Arc<Pool>> = config
            .pools
            .iter()
            .map(|(name, p)| {
                Arc::new(Pool::new(name, p, &Default::default(), crate::upstream::EjectionRule::of(&config.upstream)))
            })
            .collect();
        let registry = prometheus::Registry::new();
        let requests = metrics::RequestMetrics::register(&registry).unwrap();
        let upstream = crate::upstream::metrics::UpstreamMetrics::register(&registry).unwrap();
        let parity = ParityMetrics::register(&registry).unwrap();
        let metrics = RouteFamilies { requests: &requests, upstream: &upstream, parity: &parity };
        RouteTable::new(&config, &none, &pools, metrics, None).unwrap()
    }

    fn pick(path: &str, model: Option<&str>, headers: &[(&'static str, &'static str)]) -> Option<String> {
        let table = table();
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, v.parse().unwrap());
        }
        let name = &table.select(&RequestFacts { path, model, headers: &map }).name;
        (name != DEFAULT_ROUTE).then(|| name.clone())
    }

    #[test]
    fn first_match_wins_in_order() {
        assert_eq!(
            pick("/v1/chat/completions", Some("Qwen/Qwen3-8B"), &[("x-tenant", "b")]).as_deref(),
            Some("tenant-b")
        );
        assert_eq!(pick("/v1/chat/completions", Some("Qwen/Qwen3-8B"), &[("x-tenant", "a")]).as_deref(), Some("qwen"));
        assert_eq!(pick("/v1/completions", Some("Qwen/Qwen3-8B"), &[]).as_deref(), Some("qwen"));
    }

    #[test]
    fn model_glob_needs_a_model() {
        assert_eq!(pick("/v1/chat/completions", Some("llama"), &[]).as_deref(), Some("rest"));
        assert_eq!(pick("/v1/chat/completions", None, &[]).as_deref(), Some("rest"));
        assert_eq!(pick("/v1/models", None, &[]).as_deref(), Some("rest"));
    }

    #[test]
    fn routes_hold_their_pools_and_unmatched_requests_get_the_default() {
        let table = table();
        let qwen = &table.routes()[1];
        assert_eq!(qwen.decode_pool.name, "decode");
        assert!(matches!(&qwen.prefill, Some(PrefillTarget::Pool(p)) if p.name == "prefill"));
        assert!(Arc::ptr_eq(&table.routes()[0].decode_pool, &qwen.decode_pool), "one pool, shared");
        let none = table.select(&RequestFacts { path: "/x", model: None, headers: &HeaderMap::new() });
        assert!(none.name == "rest", "the catch-all route takes it");
        assert_eq!(table.default_route().mode, Mode::Passthrough);
        assert_eq!(table.default_route().decode_pool.name, "decode");
    }
}
