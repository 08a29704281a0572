//! Every metric tokenonce exports, defined in this one place (prefix `tokenonce_`). Label
//! values are bounded: route and pool names come from config, the rest from fixed enums.

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Latency buckets from 1 ms to 120 s: loopback overheads at the bottom, long prefills and
/// whole streamed answers at the top.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];

/// Stages of an orchestrated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The prefill leg, send to full response.
    Prefill,
    /// Extracting and validating the handoff, building the decode body.
    Handoff,
    /// Decode leg, send to response header.
    DecodeFirstByte,
    /// Decode leg, send to end of stream.
    DecodeTotal,
}

impl Stage {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Handoff => "handoff",
            Self::DecodeFirstByte => "decode_first_byte",
            Self::DecodeTotal => "decode_total",
        }
    }
}

/// How a request ended, for `requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx fully relayed.
    Success,
    /// 4xx (ours or an engine's).
    ClientError,
    /// 5xx, or a stream that broke.
    ServerError,
    /// The client went away first.
    ClientClosed,
}

impl Outcome {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::ClientError => "client_error",
            Self::ServerError => "server_error",
            Self::ClientClosed => "client_closed",
        }
    }

    /// The outcome of a finished response with `status`.
    pub fn from_status(status: u16) -> Self {
        match status {
            200..=399 => Self::Success,
            400..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

/// Handles to every metric.
#[derive(Clone)]
pub struct Metrics {
    /// Finished requests by route, api, mode and outcome.
    pub requests: IntCounterVec,
    /// Whole request duration.
    pub request_duration: HistogramVec,
    /// Time until the client got the response header.
    pub time_to_first_byte: HistogramVec,
    /// Per-stage durations of orchestrated requests.
    pub stage_duration: HistogramVec,
    /// Token reuse applied vs fallback by reason.
    pub token_reuse: IntCounterVec,
    /// Prompt tokens the decode did not have to tokenize.
    pub reused_prompt_tokens: IntCounterVec,
    /// Bytes of id arrays spliced into decode requests.
    pub relayed_id_bytes: IntCounter,
    /// Upstream failures by stage and kind.
    pub upstream_errors: IntCounterVec,
    /// Retries after a stale pooled connection, by stage.
    pub upstream_retries: IntCounterVec,
    /// Requests being served now.
    pub inflight: IntGauge,
    /// 1 while an endpoint answers its `/health`, by pool and endpoint.
    pub upstream_healthy: IntGaugeVec,
    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    pub ready: IntGauge,
    /// Relay cache: entries held.
    pub cache_entries: IntGauge,
    /// Relay cache: bytes held.
    pub cache_bytes: IntGauge,
    /// Relay cache lookups by result.
    pub cache_lookups: IntCounterVec,
    /// Relay cache evictions by reason.
    pub cache_evictions: IntCounterVec,
    /// Config reloads by result (success, failure).
    pub config_reloads: IntCounterVec,
    /// Constant 1 labelled with the version.
    pub build_info: IntGaugeVec,
}

fn histogram(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<HistogramVec> {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()), labels)?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

impl Metrics {
    /// Creates and registers every metric in `registry`.
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let relayed_id_bytes = IntCounter::new(
            "tokenonce_relayed_id_bytes_total",
            "Bytes of prompt-id JSON spliced into decode requests.",
        )?;
        registry.register(Box::new(relayed_id_bytes.clone()))?;
        let upstream_healthy = IntGaugeVec::new(
            Opts::new("tokenonce_upstream_healthy", "1 while the endpoint answers GET /health with 200."),
            &["pool", "endpoint"],
        )?;
        registry.register(Box::new(upstream_healthy.clone()))?;
        let build_info =
            IntGaugeVec::new(Opts::new("tokenonce_build_info", "Always 1; labelled with the build."), &["version"])?;
        registry.register(Box::new(build_info.clone()))?;
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let metrics = Self {
            requests: counter(
                registry,
                "tokenonce_requests_total",
                "Requests finished, by route, API, mode and outcome.",
                &["route", "api", "mode", "outcome"],
            )?,
            request_duration: histogram(
                registry,
                "tokenonce_request_duration_seconds",
                "Time from request head to the last response byte.",
                &["route", "api", "mode"],
            )?,
            time_to_first_byte: histogram(
                registry,
                "tokenonce_time_to_first_byte_seconds",
                "Time from request head until the response header went to the client.",
                &["route", "api", "mode"],
            )?,
            stage_duration: histogram(
                registry,
                "tokenonce_stage_duration_seconds",
                "Duration of each stage of an orchestrated request.",
                &["route", "stage"],
            )?,
            token_reuse: counter(
                registry,
                "tokenonce_token_reuse_total",
                "Orchestrated/relayed decodes by whether prefill ids were reused, and why not.",
                &["route", "result", "reason"],
            )?,
            reused_prompt_tokens: counter(
                registry,
                "tokenonce_reused_prompt_tokens_total",
                "Prompt tokens whose rendering and tokenization the decode engine skipped.",
                &["route"],
            )?,
            relayed_id_bytes,
            upstream_errors: counter(
                registry,
                "tokenonce_upstream_errors_total",
                "Upstream failures by stage (prefill, decode, passthrough) and kind.",
                &["stage", "kind"],
            )?,
            upstream_retries: counter(
                registry,
                "tokenonce_upstream_retries_total",
                "Requests re-sent once after a pooled connection turned out stale.",
                &["stage"],
            )?,
            inflight: gauge(registry, "tokenonce_inflight_requests", "Client requests being served now.")?,
            upstream_healthy,
            ready: gauge(registry, "tokenonce_ready", "1 while every decode pool has an endpoint answering /health.")?,
            cache_entries: gauge(registry, "tokenonce_cache_entries", "Relay id cache: entries held.")?,
            cache_bytes: gauge(registry, "tokenonce_cache_bytes", "Relay id cache: bytes of ids held.")?,
            cache_lookups: counter(
                registry,
                "tokenonce_cache_lookups_total",
                "Relay id cache lookups by result (hit, miss, expired, mismatch).",
                &["result"],
            )?,
            cache_evictions: counter(
                registry,
                "tokenonce_cache_evictions_total",
                "Relay id cache evictions by reason (ttl, capacity).",
                &["reason"],
            )?,
            config_reloads: counter(
                registry,
                "tokenonce_config_reloads_total",
                "Config reloads on SIGHUP by result; a failed one keeps the running config.",
                &["result"],
            )?,
            build_info,
        };
        metrics.init_fixed();
        Ok(metrics)
    }

    /// Creates the series of one route up front so dashboards see zeros, not gaps.
    pub fn init_route(&self, route: &str) {
        for reason in crate::openai::FallbackReason::ALL {
            self.token_reuse.with_label_values(&[route, "fallback", reason.as_str()]);
        }
        self.token_reuse.with_label_values(&[route, "applied", "none"]);
        self.reused_prompt_tokens.with_label_values(&[route]);
    }

    /// Creates the route-independent series up front (zeros instead of gaps).
    fn init_fixed(&self) {
        for stage in ["prefill", "decode", "passthrough"] {
            for kind in ["connect", "io", "timeout"] {
                self.upstream_errors.with_label_values(&[stage, kind]);
            }
            self.upstream_retries.with_label_values(&[stage]);
        }
        for result in ["hit", "miss", "expired", "mismatch"] {
            self.cache_lookups.with_label_values(&[result]);
        }
        for result in ["success", "failure"] {
            self.config_reloads.with_label_values(&[result]);
        }
        for reason in ["ttl", "capacity"] {
            self.cache_evictions.with_label_values(&[reason]);
        }
    }

    /// Renders `registry` in the Prometheus text format.
    pub fn render(registry: &Registry) -> Vec<u8> {
        let mut out = Vec::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = prometheus::Encoder::encode(&encoder, &registry.gather(), &mut out) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_every_design_metric_once() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        m.init_route("r");
        m.requests.with_label_values(&["r", "chat", "orchestrate", "success"]).inc();
        m.stage_duration.with_label_values(&["r", "prefill"]).observe(0.1);
        m.request_duration.with_label_values(&["r", "chat", "orchestrate"]).observe(0.1);
        m.time_to_first_byte.with_label_values(&["r", "chat", "orchestrate"]).observe(0.1);
        m.upstream_errors.with_label_values(&["prefill", "connect"]).inc();
        m.upstream_retries.with_label_values(&["decode"]).inc();
        m.cache_lookups.with_label_values(&["hit"]).inc();
        m.cache_evictions.with_label_values(&["ttl"]).inc();
        m.upstream_healthy.with_label_values(&["decode", "127.0.0.1:1"]).set(1);
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
        for name in [
            "tokenonce_requests_total",
            "tokenonce_request_duration_seconds",
            "tokenonce_time_to_first_byte_seconds",
            "tokenonce_stage_duration_seconds",
            "tokenonce_token_reuse_total",
            "tokenonce_reused_prompt_tokens_total",
            "tokenonce_relayed_id_bytes_total",
            "tokenonce_upstream_errors_total",
            "tokenonce_upstream_retries_total",
            "tokenonce_inflight_requests",
            "tokenonce_cache_entries",
            "tokenonce_cache_bytes",
            "tokenonce_cache_lookups_total",
            "tokenonce_cache_evictions_total",
            "tokenonce_build_info",
            "tokenonce_ready",
            "tokenonce_upstream_healthy",
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(Metrics::register(&registry).is_err(), "double registration must fail");
    }
}
