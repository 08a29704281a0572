//! The metrics ground every room registers its family on (prefix `tokenonce_`): the
//! registration helpers, the bucket constants with their rationale, the Prometheus text
//! rendering, and the label enums (`labels.rs`, bounded cardinality). Each component owns its
//! family in a `metrics.rs` of its own room (`routes/`, `upstream/`, `local/`, `kv/`,
//! `handoff/`, `parity/`); `app/metrics.rs` holds them all, registered once per process.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

mod labels;

pub use labels::{
    CacheLookup, ChoiceReason, ChoiceSource, DecisionReason, DnsLookup, ErrorKind, Eviction, FollowUp, HistoryResult,
    Leg, Listener, LoadRead, LocalIdsResult, Outcome, ParityResult, PrefillDecision, Release, Reload, SpanExport,
    Stage, TimeoutStage,
};

/// Latency buckets from 1 ms to 6 h: loopback overheads at the bottom; long prefills, queued
/// decodes and whole answers above; at the top the longest deadline the config allows
/// (`decode_whole_answer_timeout_ms` up to [`MAX_ANSWER_MS`](crate::config::MAX_ANSWER_MS)),
/// so a request that ran to any configured deadline lands in a finite bucket, not in `+Inf`
/// only (a test holds the top to the config's bounds).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1200.0, 1800.0, 3600.0, 7200.0, 21600.0,
];

/// Inter-token latency buckets: fine from 1 ms to 1 s, where a decode's tokens come (vLLM
/// streams one every few tens of ms; its own `vllm:inter_token_latency_seconds` is finest
/// there too), then coarse up to the longest silence a stream may keep
/// (`stream_idle_timeout_ms` up to [`MAX_LEG_MS`](crate::config::MAX_LEG_MS)).
pub const INTER_TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Prompt-token buckets of the tokens a decode lacked (`prefill_decode_lacking_tokens`): an
/// agentic turn's few hundred new tokens at the bottom, whole cold prompts (up to 128k) at
/// the top, the thresholds a route is likely to set (128 to 4,096) each a bound.
pub const LACKING_TOKEN_BUCKETS: &[f64] =
    &[16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0];

/// Spans handed to the OTLP exporter, by [`SpanExport`]. One counter for the process (the
/// exporter is built once and outlives reloads); every registry gets it.
pub fn trace_spans() -> &'static prometheus::Result<IntCounterVec> {
    static SPANS: std::sync::OnceLock<prometheus::Result<IntCounterVec>> = std::sync::OnceLock::new();
    SPANS.get_or_init(|| {
        let opts = Opts::new("tokenonce_trace_spans_total", "Spans handed to the OTLP exporter, by result.");
        let spans = IntCounterVec::new(opts, &["result"])?;
        for result in SpanExport::ALL {
            spans.with_label_values(&[result.as_str()]);
        }
        Ok(spans)
    })
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

/// A histogram family over [`LATENCY_BUCKETS`], registered in `registry`.
pub(crate) fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    histogram_with(registry, name, help, labels, LATENCY_BUCKETS)
}

/// A histogram family over `buckets`, registered in `registry`.
pub(crate) fn histogram_with(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> prometheus::Result<HistogramVec> {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels)?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

/// A counter family, registered in `registry`.
pub(crate) fn counter(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// A gauge without labels, registered in `registry`.
pub(crate) fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    registered(registry, IntGauge::new(name, help)?)
}

/// A gauge family, registered in `registry`.
pub(crate) fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    registered(registry, IntGaugeVec::new(Opts::new(name, help), labels)?)
}

/// `c`, registered in `registry`.
pub(crate) fn registered<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    c: C,
) -> prometheus::Result<C> {
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}
