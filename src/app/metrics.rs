//! Every metric family of the process, registered once ([`Metrics`]): each component's own
//! (requests, upstream, local ids, KV events, the relay id cache, the parity watch), and those
//! of the process itself: config reloads, `build_info`, the trace spans and `process_*`.

use prometheus::{Gauge, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::handoff::metrics::IdCacheMetrics;
use crate::kv::metrics::KvMetrics;
use crate::local::metrics::LocalMetrics;
use crate::metrics::{counter, gauge, gauge_vec, registered, trace_spans, Reload};
use crate::parity::metrics::ParityMetrics;
use crate::routes::metrics::{RequestMetrics, RouteFamilies};
use crate::upstream::metrics::UpstreamMetrics;

/// Handles to every metric family, each registered by the component that owns it.
#[derive(Clone)]
pub struct Metrics {
    /// Requests served: counts, durations, stages, bounded waits, KV releases, in flight,
    /// admission, token reuse.
    pub requests: RequestMetrics,
    /// Engines: failures, retries, failovers, ejections, health, readiness, Responses homes,
    /// cache-aware choices.
    pub upstream: UpstreamMetrics,
    /// Local ids: checks, trust, token-in, prompt history, segment caches.
    pub local: LocalMetrics,
    /// KV events: the index of held blocks, the subscribers, the hash check.
    pub kv: KvMetrics,
    /// The relay id cache.
    pub id_cache: IdCacheMetrics,
    /// The parity watch and the pools' model identity.
    pub parity: ParityMetrics,
    /// Config reloads.
    pub reloads: ReloadMetrics,
    /// `build_info`: always 1, labelled with the build.
    build: IntGaugeVec,
}

impl Metrics {
    /// Creates and registers every metric in `registry`.
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let build = gauge_vec(
            registry,
            "tokenonce_build_info",
            "Always 1; labelled with the build (what tokenonce --version prints).",
            &["version", "commit", "rustc", "profile"],
        )?;
        let spans = trace_spans().as_ref().map_err(|e| prometheus::Error::Msg(e.to_string()))?;
        registered(registry, spans.clone())?;
        let metrics = Self {
            requests: RequestMetrics::register(registry)?,
            upstream: UpstreamMetrics::register(registry)?,
            local: LocalMetrics::register(registry)?,
            kv: KvMetrics::register(registry)?,
            id_cache: IdCacheMetrics::register(registry)?,
            parity: ParityMetrics::register(registry)?,
            reloads: ReloadMetrics::register(registry)?,
            build,
        };
        // The standard `process_*` series (CPU, resident memory, open files, threads, start
        // time), read from /proc when scraped.
        #[cfg(target_os = "linux")]
        registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        Ok(metrics)
    }

    /// The families a route table resolves its routes' series in.
    pub fn routes(&self) -> RouteFamilies<'_> {
        RouteFamilies { requests: &self.requests, upstream: &self.upstream, parity: &self.parity }
    }

    /// Labels `build_info` with the build that runs (version, commit, compiler, profile: the
    /// composition root hands them down).
    pub fn build_info(&self, version: &str, commit: &str, rustc: &str, profile: &str) {
        self.build.with_label_values(&[version, commit, rustc, profile]).set(1);
    }
}

/// Config reloads.
#[derive(Clone)]
pub struct ReloadMetrics {
    config_reloads: IntCounterVec,
    /// 1 when the last reload was applied (or none was tried since the start), 0 when it was
    /// rejected.
    last_success: IntGauge,
    /// When the last reload was tried (or the process started), Unix seconds.
    last_time: Gauge,
}

impl ReloadMetrics {
    /// Creates and registers the family in `registry`, set as after a reload that succeeded
    /// now (the start loaded the config).
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let last_time = Gauge::new(
            "tokenonce_config_last_reload_timestamp_seconds",
            "When the last config reload was tried, whatever its result (the start until one is), Unix time.",
        )?;
        let metrics = Self {
            config_reloads: counter(
                registry,
                "tokenonce_config_reloads_total",
                "Config reloads (SIGHUP, POST /admin/reload, the file watch) by result; a failed one keeps the running config.",
                &["result"],
            )?,
            last_success: gauge(
                registry,
                "tokenonce_config_last_reload_success",
                "1 when the last config reload was applied (or none was tried since the start), 0 when it was rejected and the running config is not the file's.",
            )?,
            last_time: registered(registry, last_time)?,
        };
        for result in Reload::ALL {
            metrics.config_reloads.with_label_values(&[result.as_str()]);
        }
        // The start loaded the config: as a reload that succeeded.
        metrics.last_success.set(1);
        metrics.last_time.set(unix_now());
        Ok(metrics)
    }

    /// Counts one config reload and records it as the last one (its result and time).
    pub fn record(&self, result: Reload) {
        self.config_reloads.with_label_values(&[result.as_str()]).inc();
        self.last_success.set(i64::from(result == Reload::Success));
        self.last_time.set(unix_now());
    }
}

/// Now, in Unix seconds (0 if the clock is before 1970).
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::metrics::render;

    #[test]
    fn registers_every_design_metric_once() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        m.requests.route("r", Mode::Relay);
        m.upstream.route_legs("r");
        m.upstream.upstream_health("decode", "127.0.0.1:1", true);
        m.upstream.pool("decode");
        m.upstream.discovered_pool("decode");
        m.upstream.endpoint("decode", "127.0.0.1:1");
        m.parity.route("r");
        m.parity.models_differ("r", false);
        m.build_info("1.0.0", "abc", "rustc 1", "debug");
        let text = String::from_utf8(render(&registry)).unwrap();
        for name in [
            "tokenonce_requests_total",
            "tokenonce_request_duration_seconds",
            "tokenonce_time_to_first_byte_seconds",
            "tokenonce_time_to_first_token_seconds",
            "tokenonce_inter_token_latency_seconds",
            "tokenonce_stage_duration_seconds",
            "tokenonce_endpoint_errors_total",
            "tokenonce_token_reuse_total",
            "tokenonce_reused_prompt_tokens_total",
            "tokenonce_relayed_id_bytes_total",
            "tokenonce_upstream_errors_total",
            "tokenonce_upstream_retries_total",
            "tokenonce_retry_budget_exhausted_total",
            "tokenonce_inflight_requests",
            "tokenonce_admission_rejected_total",
            "tokenonce_admission_max_in_flight",
            "tokenonce_cache_entries",
            "tokenonce_cache_bytes",
            "tokenonce_cache_lookups_total",
            "tokenonce_cache_evictions_total",
            "tokenonce_build_info",
            "tokenonce_ready",
            "tokenonce_upstream_healthy",
            "tokenonce_prefill_failovers_total",
            "tokenonce_upstream_ejections_total",
            "tokenonce_upstream_ejected",
            "tokenonce_pool_endpoints",
            "tokenonce_discovery_lookups_total",
            "tokenonce_parity_checks_total",
            "tokenonce_parity_reuse_disabled_total",
            "tokenonce_parity_reuse_off",
            "tokenonce_pool_models_differ",
            "tokenonce_timeouts_total",
            "tokenonce_kv_releases_total",
            "tokenonce_trace_spans_total",
            "tokenonce_response_followups_total",
            "tokenonce_response_homes",
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        #[cfg(target_os = "linux")]
        for name in ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(Metrics::register(&registry).is_err(), "double registration must fail");
    }
}
