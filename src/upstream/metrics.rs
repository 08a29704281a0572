//! The engines' metric family ([`UpstreamMetrics`]) and the handles an endpoint, a cache-aware
//! pool and a route's legs resolve once ([`EndpointMetrics`], [`CacheAwareMetrics`],
//! [`LegMetrics`]).
//!
//! The family counts leg failures, retries and failovers, ejections, health, each pool's
//! endpoints and discovery lookups, readiness, the engines' own pressure (read from their
//! `/metrics`), Responses follow-ups and homes, and cache-aware choices.

use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::engine_load::EngineLoad;
use crate::metrics::{
    counter, gauge, gauge_vec, registered, ChoiceReason, ChoiceSource, DnsLookup, ErrorKind, FollowUp, Leg, LoadRead,
};

/// Engines: failures, retries, failovers, ejections, health, readiness, Responses homes and
/// cache-aware choices.
#[derive(Clone)]
pub struct UpstreamMetrics {
    /// What legs met: failures, retries, refusals and failovers.
    legs: Legs,
    /// Pools and their endpoints: ejections, health, members, lookups, readiness.
    pools: Pools,
    /// Where requests went: Responses follow-ups and homes, cache-aware choices.
    choices: Choices,
    /// What the engines report of their own pressure.
    engines: Engines,
}

/// What each endpoint's engine reported of its own pressure (`{pool,endpoint}`), and how the
/// reads went.
#[derive(Clone)]
struct Engines {
    waiting: IntGaugeVec,
    running: IntGaugeVec,
    kv_usage: GaugeVec,
    /// Reads of `/metrics` by result (`{pool,endpoint,result}`).
    reads: IntCounterVec,
}

impl Engines {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            waiting: gauge_vec(
                registry,
                "tokenonce_engine_requests_waiting",
                "Requests the endpoint's engine reports queued (vllm:num_requests_waiting, its rank's), as last read and believed; absent while no read is.",
                &["pool", "endpoint"],
            )?,
            running: gauge_vec(
                registry,
                "tokenonce_engine_requests_running",
                "Requests the endpoint's engine reports running (vllm:num_requests_running, its rank's), as last read and believed; absent while no read is.",
                &["pool", "endpoint"],
            )?,
            kv_usage: registered(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "tokenonce_engine_kv_cache_usage",
                        "Share of its KV cache the endpoint's engine reports in use, 0 to 1 (vllm:kv_cache_usage_perc, its rank's), as last read and believed; absent while no read is.",
                    ),
                    &["pool", "endpoint"],
                )?,
            )?,
            reads: counter(
                registry,
                "tokenonce_engine_metrics_reads_total",
                "Reads of an endpoint's /metrics on the health round, by result: ok, failed (no 200 answer in time), rejected (a page that cannot be true: malformed, NaN, negative, absurd, too large; not kept), stale (the last read believed grew too old and was forgotten).",
                &["pool", "endpoint", "result"],
            )?,
        })
    }
}

/// What legs met: failures, retries, refusals and failovers.
#[derive(Clone)]
struct Legs {
    upstream_errors: IntCounterVec,
    /// Failures of each configured endpoint, by kind (`{pool,endpoint,kind}`).
    endpoint_errors: IntCounterVec,
    upstream_retries: IntCounterVec,
    retry_budget_exhausted: IntCounterVec,
    prefill_failovers: IntCounterVec,
}

impl Legs {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            upstream_errors: counter(
                registry,
                "tokenonce_upstream_errors_total",
                "Upstream failures by stage (prefill, decode, passthrough) and kind.",
                &["stage", "kind"],
            )?,
            endpoint_errors: counter(
                registry,
                "tokenonce_endpoint_errors_total",
                "Failures of a pool's endpoint, by kind: no answer head (connect, tls, io), a 5xx head, a deadline that passed (timeout), a body that broke or outgrew its bound after the head (stream_broken, io, timeout, too_large).",
                &["pool", "endpoint", "kind"],
            )?,
            upstream_retries: counter(
                registry,
                "tokenonce_upstream_retries_total",
                "Legs re-sent once because the engine provably never got them (connect failed, or the request could not be written whole).",
                &["stage"],
            )?,
            retry_budget_exhausted: counter(
                registry,
                "tokenonce_retry_budget_exhausted_total",
                "Legs that could safely have been re-sent but the route's retry budget refused.",
                &["route"],
            )?,
            prefill_failovers: counter(
                registry,
                "tokenonce_prefill_failovers_total",
                "Pool prefills moved to another endpoint after failing before any answer or answering 5xx.",
                &["route"],
            )?,
        })
    }
}

/// Pools and their endpoints: ejections, health, members, lookups, readiness.
#[derive(Clone)]
struct Pools {
    upstream_ejections: IntCounterVec,
    upstream_ejected: IntGaugeVec,
    upstream_healthy: IntGaugeVec,
    /// Each pool's endpoints now (`{pool}`; a discovered pool's follow its DNS name).
    pool_endpoints: IntGaugeVec,
    /// Lookups of a discovered pool's DNS name, by result (`{pool,result}`).
    discovery_lookups: IntCounterVec,
    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    ready: IntGauge,
}

impl Pools {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            upstream_ejections: counter(
                registry,
                "tokenonce_upstream_ejections_total",
                "Endpoints ejected from their pool's choice after consecutive request failures.",
                &["pool"],
            )?,
            upstream_ejected: gauge_vec(
                registry,
                "tokenonce_upstream_ejected",
                "Endpoints of the pool ejected now (read from the pool when scraped).",
                &["pool"],
            )?,
            upstream_healthy: gauge_vec(
                registry,
                "tokenonce_upstream_healthy",
                "1 while the endpoint answers GET /health with 200.",
                &["pool", "endpoint"],
            )?,
            pool_endpoints: gauge_vec(
                registry,
                "tokenonce_pool_endpoints",
                "Endpoints of the pool now (one per rank; a discovered pool's follow its DNS name).",
                &["pool"],
            )?,
            discovery_lookups: counter(
                registry,
                "tokenonce_discovery_lookups_total",
                "Lookups of a discovered pool's DNS name, by result: ok, failed (the last set stays), empty (no address: the last set stays).",
                &["pool", "result"],
            )?,
            ready: gauge(registry, "tokenonce_ready", "1 while every decode pool has an endpoint answering /health.")?,
        })
    }
}

/// Where requests went: Responses follow-ups and homes, cache-aware choices.
#[derive(Clone)]
struct Choices {
    response_followups: IntCounterVec,
    response_homes: IntGauge,
    cache_aware_choices: IntCounterVec,
    cache_aware_predicted_tokens: IntCounterVec,
}

impl Choices {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            response_followups: {
                let c = counter(
                    registry,
                    "tokenonce_response_followups_total",
                    "Responses requests naming a stored answer (previous_response_id, GET /v1/responses/{id}), by where they went: home (the decode endpoint that stored it) or unknown (balanced).",
                    &["result"],
                )?;
                FollowUp::ALL.iter().for_each(|r| drop(c.with_label_values(&[r.as_str()])));
                c
            },
            response_homes: gauge(
                registry,
                "tokenonce_response_homes",
                "Stored Responses answers whose decode endpoint tokenonce knows (read when scraped).",
            )?,
            cache_aware_choices: counter(
                registry,
                "tokenonce_cache_aware_choices_total",
                "Endpoints chosen by a cache_aware pool, by the source asked (events, sent, text, none) and why: prefix (a candidate held part of the prompt), no_prefix, or, choosing the least in flight, no_ids, short_prompt, unusable.",
                &["pool", "source", "reason"],
            )?,
            cache_aware_predicted_tokens: counter(
                registry,
                "tokenonce_cache_aware_predicted_tokens_total",
                "Prompt tokens a cache_aware pool's chosen endpoint was predicted to hold (its full blocks held, times the block size), by the source that said so (events, sent): with events, what the engines' prefix caches should report as hits (vllm:prefix_cache_hits_total, usage cached_tokens).",
                &["pool", "source"],
            )?,
        })
    }
}

impl UpstreamMetrics {
    /// Creates and registers the family in `registry`, with its pool-independent series
    /// (zeros instead of gaps).
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let metrics = Self {
            legs: Legs::register(registry)?,
            pools: Pools::register(registry)?,
            choices: Choices::register(registry)?,
            engines: Engines::register(registry)?,
        };
        for leg in Leg::ALL {
            for kind in ErrorKind::ALL {
                metrics.legs.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]);
            }
            metrics.legs.upstream_retries.with_label_values(&[leg.as_str()]);
        }
        Ok(metrics)
    }

    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    pub fn ready(&self) -> &IntGauge {
        &self.pools.ready
    }

    /// Counts one upstream failure.
    pub fn upstream_error(&self, leg: Leg, kind: ErrorKind) {
        self.legs.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]).inc();
    }

    /// Counts one leg re-sent.
    pub fn upstream_retry(&self, leg: Leg) {
        self.legs.upstream_retries.with_label_values(&[leg.as_str()]).inc();
    }

    /// Resolves (and so creates) route `route`'s leg series: retries its budget refused,
    /// prefills moved to another endpoint.
    pub fn route_legs(&self, route: &str) -> LegMetrics {
        LegMetrics {
            retry_refused: self.legs.retry_budget_exhausted.with_label_values(&[route]),
            prefill_failovers: self.legs.prefill_failovers.with_label_values(&[route]),
        }
    }

    /// Resolves (and so creates) the series of `pool`'s `endpoint`: its failures by kind, and
    /// its reads of `/metrics` by result.
    pub fn endpoint(&self, pool: &str, endpoint: &str) -> EndpointMetrics {
        for result in LoadRead::ALL {
            self.engines.reads.with_label_values(&[pool, endpoint, result.as_str()]);
        }
        EndpointMetrics {
            errors: ErrorKind::ALL
                .iter()
                .map(|kind| self.legs.endpoint_errors.with_label_values(&[pool, endpoint, kind.as_str()]))
                .collect(),
        }
    }

    /// Removes the series of what a reload took away, so no alert fires on a series that no
    /// longer reports anything: an endpoint no longer in `pool`'s list (its health gauge and
    /// its error counters).
    pub fn forget_endpoint(&self, pool: &str, endpoint: &str) {
        let _ = self.pools.upstream_healthy.remove_label_values(&[pool, endpoint]);
        for kind in ErrorKind::ALL {
            let _ = self.legs.endpoint_errors.remove_label_values(&[pool, endpoint, kind.as_str()]);
        }
        for result in LoadRead::ALL {
            let _ = self.engines.reads.remove_label_values(&[pool, endpoint, result.as_str()]);
        }
        self.engine_load_gone(pool, endpoint);
    }

    /// Shows what `pool`'s `endpoint` reported of its own pressure.
    pub fn engine_load(&self, pool: &str, endpoint: &str, load: &EngineLoad) {
        let labels = [pool, endpoint];
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.engines.waiting.with_label_values(&labels).set(int(load.waiting));
        self.engines.running.with_label_values(&labels).set(int(load.running));
        self.engines.kv_usage.with_label_values(&labels).set(load.kv_usage);
    }

    /// Removes `pool`'s `endpoint`'s pressure gauges: no read of it is believed now.
    pub fn engine_load_gone(&self, pool: &str, endpoint: &str) {
        let labels = [pool, endpoint];
        let _ = self.engines.waiting.remove_label_values(&labels);
        let _ = self.engines.running.remove_label_values(&labels);
        let _ = self.engines.kv_usage.remove_label_values(&labels);
    }

    /// Counts one read of `pool`'s `endpoint`'s `/metrics`.
    pub fn engine_metrics_read(&self, pool: &str, endpoint: &str, result: LoadRead) {
        self.engines.reads.with_label_values(&[pool, endpoint, result.as_str()]).inc();
    }

    /// Records an endpoint's health poll.
    pub fn upstream_health(&self, pool: &str, endpoint: &str, healthy: bool) {
        self.pools.upstream_healthy.with_label_values(&[pool, endpoint]).set(i64::from(healthy));
    }

    /// Creates a pool's series (zeros instead of gaps).
    pub fn pool(&self, pool: &str) {
        self.pools.upstream_ejections.with_label_values(&[pool]);
        self.pools.upstream_ejected.with_label_values(&[pool]);
        self.pools.pool_endpoints.with_label_values(&[pool]);
    }

    /// Creates a discovered pool's lookup series (zeros instead of gaps).
    pub fn discovered_pool(&self, pool: &str) {
        DnsLookup::ALL.iter().for_each(|r| drop(self.pools.discovery_lookups.with_label_values(&[pool, r.as_str()])));
    }

    /// Removes a pool's gauges after a reload removed the pool.
    pub fn forget_pool(&self, pool: &str) {
        let _ = self.pools.upstream_ejected.remove_label_values(&[pool]);
        let _ = self.pools.pool_endpoints.remove_label_values(&[pool]);
        for result in DnsLookup::ALL {
            let _ = self.pools.discovery_lookups.remove_label_values(&[pool, result.as_str()]);
        }
    }

    /// Counts one lookup of `pool`'s DNS name.
    pub fn discovery_lookup(&self, pool: &str, result: DnsLookup) {
        self.pools.discovery_lookups.with_label_values(&[pool, result.as_str()]).inc();
    }

    /// Sets how many endpoints `pool` has now.
    pub fn pool_endpoints(&self, pool: &str, endpoints: usize) {
        self.pools.pool_endpoints.with_label_values(&[pool]).set(i64::try_from(endpoints).unwrap_or(i64::MAX));
    }

    /// Counts one endpoint of `pool` ejected (the `upstream_ejected` gauge is set from the
    /// pool's state when scraped: an ejection also ends by itself).
    pub fn upstream_ejection(&self, pool: &str) {
        self.pools.upstream_ejections.with_label_values(&[pool]).inc();
    }

    /// Sets how many endpoints of `pool` are ejected now.
    pub fn upstream_ejected(&self, pool: &str, ejected: usize) {
        self.pools.upstream_ejected.with_label_values(&[pool]).set(i64::try_from(ejected).unwrap_or(i64::MAX));
    }

    /// Counts one Responses follow-up by where it went.
    pub fn response_followup(&self, result: FollowUp) {
        self.choices.response_followups.with_label_values(&[result.as_str()]).inc();
    }

    /// Sets how many stored answers' endpoints are known.
    pub fn response_homes(&self, entries: usize) {
        self.choices.response_homes.set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Resolves (and so creates) the choice series of a `cache_aware` pool: each source with
    /// the reasons it can give.
    pub fn cache_aware(&self, pool: &str) -> CacheAwareMetrics {
        let family = &self.choices.cache_aware_choices;
        let choices = CacheAwareMetrics::PAIRS
            .iter()
            .map(|(source, reason)| family.with_label_values(&[pool, source.as_str(), reason.as_str()]))
            .collect();
        let family = &self.choices.cache_aware_predicted_tokens;
        let predicted = CacheAwareMetrics::PREDICTING
            .iter()
            .map(|source| family.with_label_values(&[pool, source.as_str()]))
            .collect();
        CacheAwareMetrics { choices, predicted }
    }
}

/// One route's leg series (`retry_budget_exhausted_total{route}`,
/// `prefill_failovers_total{route}`), resolved when the route table is built.
#[derive(Clone)]
pub struct LegMetrics {
    retry_refused: IntCounter,
    prefill_failovers: IntCounter,
}

impl LegMetrics {
    /// Counts a retry the budget refused.
    pub fn retry_refused(&self) {
        self.retry_refused.inc();
    }

    /// Counts a pool prefill moved to another endpoint.
    pub fn prefill_failover(&self) {
        self.prefill_failovers.inc();
    }
}

/// One configured endpoint's series (`endpoint_errors_total{pool,endpoint,kind}`).
#[derive(Clone, Debug)]
pub struct EndpointMetrics {
    /// By [`ErrorKind`].
    errors: Vec<IntCounter>,
}

impl EndpointMetrics {
    /// Counts one failure of the endpoint.
    pub fn error(&self, kind: ErrorKind) {
        if let Some(c) = self.errors.get(kind as usize) {
            c.inc();
        }
    }
}

/// A `cache_aware` pool's choices (`cache_aware_choices_total{pool,source,reason}`).
#[derive(Clone, Debug)]
pub struct CacheAwareMetrics {
    /// By [`Self::PAIRS`].
    choices: Vec<IntCounter>,
    /// `cache_aware_predicted_tokens_total{pool,source}`, by [`Self::PREDICTING`].
    predicted: Vec<IntCounter>,
}

impl CacheAwareMetrics {
    /// The source and reason pairs a choice can report.
    pub const PAIRS: [(ChoiceSource, ChoiceReason); 20] = [
        (ChoiceSource::Events, ChoiceReason::Prefix),
        (ChoiceSource::Events, ChoiceReason::NoPrefix),
        (ChoiceSource::Events, ChoiceReason::SharedPrefix),
        (ChoiceSource::Events, ChoiceReason::Load),
        (ChoiceSource::Events, ChoiceReason::CachePressure),
        (ChoiceSource::Sent, ChoiceReason::Prefix),
        (ChoiceSource::Sent, ChoiceReason::NoPrefix),
        (ChoiceSource::Sent, ChoiceReason::SharedPrefix),
        (ChoiceSource::Sent, ChoiceReason::Load),
        (ChoiceSource::Sent, ChoiceReason::CachePressure),
        (ChoiceSource::Text, ChoiceReason::Prefix),
        (ChoiceSource::Text, ChoiceReason::NoPrefix),
        (ChoiceSource::Text, ChoiceReason::SharedPrefix),
        (ChoiceSource::Text, ChoiceReason::Load),
        (ChoiceSource::Text, ChoiceReason::CachePressure),
        (ChoiceSource::None, ChoiceReason::NoIds),
        (ChoiceSource::None, ChoiceReason::ShortPrompt),
        (ChoiceSource::None, ChoiceReason::Unusable),
        (ChoiceSource::None, ChoiceReason::Multimodal),
        (ChoiceSource::None, ChoiceReason::PromptEmbeds),
    ];

    /// The sources whose predictions are counted in tokens (text keys are not tokens).
    pub const PREDICTING: [ChoiceSource; 2] = [ChoiceSource::Events, ChoiceSource::Sent];

    /// Counts the `tokens` of a prompt that `source` predicted the chosen endpoint holds.
    pub fn predicted(&self, source: ChoiceSource, tokens: u64) {
        let at = Self::PREDICTING.iter().position(|&s| s == source);
        if let Some(c) = at.and_then(|i| self.predicted.get(i)) {
            c.inc_by(tokens);
        }
    }

    /// Counts one choice.
    pub fn choice(&self, source: ChoiceSource, reason: ChoiceReason) {
        let at = Self::PAIRS.iter().position(|&p| p == (source, reason));
        if let Some(c) = at.and_then(|i| self.choices.get(i)) {
            c.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;

    use super::*;
    use crate::metrics::render;

    #[test]
    fn every_legs_errors_and_retries_show_from_the_start() {
        let registry = Registry::new();
        UpstreamMetrics::register(&registry).unwrap();
        let text = String::from_utf8(render(&registry)).unwrap();
        let count = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(count("tokenonce_upstream_errors_total{"), Leg::ALL.len() * ErrorKind::ALL.len());
        assert_eq!(count("tokenonce_upstream_retries_total{"), Leg::ALL.len());
    }

    #[test]
    fn an_endpoint_counts_its_errors_until_a_reload_forgets_it() {
        let registry = Registry::new();
        let m = UpstreamMetrics::register(&registry).unwrap();
        let e = m.endpoint("decode", "10.0.0.1:8200");
        e.error(ErrorKind::Status5xx);
        let text = String::from_utf8(render(&registry)).unwrap();
        let series = |t: &str| t.lines().filter(|l| l.starts_with("tokenonce_endpoint_errors_total{")).count();
        assert_eq!(series(&text), ErrorKind::ALL.len(), "every kind, zeros instead of gaps");
        assert!(text.contains(
            r#"tokenonce_endpoint_errors_total{endpoint="10.0.0.1:8200",kind="status_5xx",pool="decode"} 1"#
        ));
        m.forget_endpoint("decode", "10.0.0.1:8200");
        assert_eq!(series(&String::from_utf8(render(&registry)).unwrap()), 0);
    }

    #[test]
    fn an_engines_pressure_shows_per_endpoint_and_goes_with_it() {
        let registry = Registry::new();
        let m = UpstreamMetrics::register(&registry).unwrap();
        m.endpoint("prefill", "10.0.0.1:8100#1");
        let text = || String::from_utf8(render(&registry)).unwrap();
        let reads = |t: &str| t.lines().filter(|l| l.starts_with("tokenonce_engine_metrics_reads_total{")).count();
        assert_eq!(reads(&text()), LoadRead::ALL.len(), "every result, zeros instead of gaps");
        assert!(!text().contains("tokenonce_engine_requests_waiting{"), "nothing read, nothing shown");
        m.engine_load(
            "prefill",
            "10.0.0.1:8100#1",
            &EngineLoad { waiting: 4, running: 2, kv_usage: 0.25, ..EngineLoad::default() },
        );
        m.engine_metrics_read("prefill", "10.0.0.1:8100#1", LoadRead::Ok);
        let shown = text();
        for line in [
            r#"tokenonce_engine_requests_waiting{endpoint="10.0.0.1:8100#1",pool="prefill"} 4"#,
            r#"tokenonce_engine_requests_running{endpoint="10.0.0.1:8100#1",pool="prefill"} 2"#,
            r#"tokenonce_engine_kv_cache_usage{endpoint="10.0.0.1:8100#1",pool="prefill"} 0.25"#,
            r#"tokenonce_engine_metrics_reads_total{endpoint="10.0.0.1:8100#1",pool="prefill",result="ok"} 1"#,
        ] {
            assert!(shown.contains(line), "{line} in\n{shown}");
        }
        m.forget_endpoint("prefill", "10.0.0.1:8100#1");
        assert!(!text().contains("10.0.0.1:8100#1"));
    }
}
