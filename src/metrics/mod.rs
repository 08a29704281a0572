//! Every metric tokenonce exports, defined in this one place (prefix `tokenonce_`). Label
//! values are enums owned here (bounded cardinality); route and pool names come from config.
//! Per-route handles are resolved once, when the route table is built ([`RouteMetrics`]);
//! every series that can occur is created up front, so dashboards never see a gap.
//! `labels.rs`: the label enums; `series.rs`: the per-route handles; here: the families, each
//! concern (requests, reuse, upstreams, cache, parity, reloads) registering its own.

use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::config::Mode;
use crate::openai::Api;

mod labels;
mod series;

use labels::{api_label, API_LABELS};
pub use labels::{
    served_as, CacheLookup, ChoiceReason, ChoiceSource, DnsLookup, ErrorKind, Eviction, FallbackReason, FollowUp,
    HistoryResult, Leg, Listener, LocalIdsResult, Outcome, ParityResult, Release, Reload, SpanExport, Stage,
    TimeoutStage,
};
pub use series::{CacheAwareMetrics, EndpointMetrics, FirstBytes, ParityMetrics, RouteMetrics};

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

/// Handles to every metric family, by concern; each concern registers its own.
#[derive(Clone)]
pub struct Metrics {
    /// Requests served: counts, durations, stages, bounded waits, KV releases, in flight.
    requests: Requests,
    /// Token reuse: applied or fallen back, and what it saved.
    reuse: ReuseFamilies,
    /// Engines: failures, retries, failovers, ejections, health, readiness.
    upstreams: Upstreams,
    /// The relay id cache.
    cache: CacheFamilies,
    /// The parity watch and the pools' model identity.
    parity: ParityFamilies,
    /// Config reloads.
    reloads: Reloads,
    /// KV events: the index of held blocks, the subscribers, the hash check.
    kv: KvFamilies,
    /// `build_info`: always 1, labelled with the build.
    build: IntGaugeVec,
}

/// Requests served: counts, durations, stages, bounded waits, KV releases, in flight.
#[derive(Clone)]
struct Requests {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    time_to_first_byte: HistogramVec,
    /// Request head to the first content byte written to the client (2xx answers).
    time_to_first_token: HistogramVec,
    /// Gaps between consecutive content events of a streamed answer, as written.
    inter_token_latency: HistogramVec,
    stage_duration: HistogramVec,
    timeouts: IntCounterVec,
    kv_releases: IntCounterVec,
    /// Requests being served now.
    inflight: IntGauge,
    /// Requests refused at admission (`server.max_in_flight` reached), by listener.
    admission_rejected: IntCounterVec,
    /// The bound on requests in flight (0: none).
    admission_limit: IntGauge,
}

impl Requests {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
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
            time_to_first_token: histogram(
                registry,
                "tokenonce_time_to_first_token_seconds",
                "Time from the client's request head until the first content of a 2xx answer was written to it: a streamed answer's first event carrying generated text, reasoning or tool calls; any other answer's first body byte.",
                &["route", "api", "mode"],
            )?,
            inter_token_latency: histogram_with(
                registry,
                "tokenonce_inter_token_latency_seconds",
                "Gaps between consecutive content events of a streamed answer as written to the client, one per event after the first (events written together: 0).",
                &["route", "api", "mode"],
                INTER_TOKEN_BUCKETS,
            )?,
            stage_duration: histogram(
                registry,
                "tokenonce_stage_duration_seconds",
                "Duration of each stage of an orchestrated request.",
                &["route", "stage"],
            )?,
            timeouts: counter(
                registry,
                "tokenonce_timeouts_total",
                "Bounded waits that ran out, by route and stage (connect, prefill, first_byte, stream_idle, client_write, release).",
                &["route", "stage"],
            )?,
            kv_releases: counter(
                registry,
                "tokenonce_kv_releases_total",
                "Clients gone after a prefill holding KV, before the decode answered a body byte: what became of the blocks.",
                &["route", "result"],
            )?,
            inflight: gauge(registry, "tokenonce_inflight_requests", "Client requests being served now.")?,
            admission_rejected: counter(
                registry,
                "tokenonce_admission_rejected_total",
                "Client requests refused with 503 overloaded because server.max_in_flight were in flight, by listener.",
                &["listener"],
            )?,
            admission_limit: gauge(
                registry,
                "tokenonce_admission_max_in_flight",
                "The bound on client requests in flight (server.max_in_flight; 0: none).",
            )?,
        })
    }
}

/// Token reuse: applied or fallen back, and what it saved.
#[derive(Clone)]
struct ReuseFamilies {
    token_reuse: IntCounterVec,
    reused_prompt_tokens: IntCounterVec,
    relayed_id_bytes: IntCounter,
}

impl ReuseFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
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
            relayed_id_bytes: registered(
                registry,
                IntCounter::new(
                    "tokenonce_relayed_id_bytes_total",
                    "Bytes of prompt-id JSON spliced into decode requests.",
                )?,
            )?,
        })
    }
}

/// Engines: failures, retries, failovers, ejections, health, readiness.
#[derive(Clone)]
struct Upstreams {
    upstream_errors: IntCounterVec,
    /// Failures of each configured endpoint, by kind (`{pool,endpoint,kind}`).
    endpoint_errors: IntCounterVec,
    upstream_retries: IntCounterVec,
    retry_budget_exhausted: IntCounterVec,
    prefill_failovers: IntCounterVec,
    upstream_ejections: IntCounterVec,
    upstream_ejected: IntGaugeVec,
    upstream_healthy: IntGaugeVec,
    /// Each pool's endpoints now (`{pool}`; a discovered pool's follow its DNS name).
    pool_endpoints: IntGaugeVec,
    /// Lookups of a discovered pool's DNS name, by result (`{pool,result}`).
    discovery_lookups: IntCounterVec,
    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    ready: IntGauge,
    response_followups: IntCounterVec,
    response_homes: IntGauge,
    local_ids_checks: IntCounterVec,
    local_ids_unsupported: IntCounterVec,
    segment_cache_lookups: IntCounterVec,
    segment_cache_bytes: IntGaugeVec,
    local_ids_trusted: IntGaugeVec,
    local_ids_token_in: IntCounterVec,
    prompt_history_turns: IntCounterVec,
    prompt_history_drift_tokens: IntCounterVec,
    prompt_history_drift_start: IntCounterVec,
    cache_aware_choices: IntCounterVec,
    cache_aware_predicted_tokens: IntCounterVec,
}

impl Upstreams {
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
            local_ids_checks: counter(
                registry,
                "tokenonce_local_ids_checks_total",
                "Requests whose prompt ids tokenonce computed itself and compared with the prefill's echo (local_ids = shadow), by pool, request shape and result: match, mismatch, unsupported, dropped.",
                &["pool", "shape", "result"],
            )?,
            local_ids_unsupported: counter(
                registry,
                "tokenonce_local_ids_unsupported_total",
                "Local-ids checks not made because tokenonce does not render the request faithfully, by pool and reason.",
                &["pool", "reason"],
            )?,
            segment_cache_lookups: counter(
                registry,
                "tokenonce_segment_cache_lookups_total",
                "Segments of rendered prompts looked up in a pool's token cache (local ids): hit (ids reused) or miss (encoded); counted at a scrape.",
                &["pool", "result"],
            )?,
            local_ids_trusted: gauge_vec(
                registry,
                "tokenonce_local_ids_trusted",
                "1 while a shape of a pool's requests has matched its echo local_ids_verify_after times in a row (with local_ids = \"on\" its prefills go token-in), read when scraped.",
                &["pool", "shape"],
            )?,
            local_ids_token_in: counter(
                registry,
                "tokenonce_local_ids_token_in_total",
                "Prefills sent token-in with tokenonce's own ids (local_ids = \"on\", a trusted shape): the prefill neither rendered, tokenized nor echoed them, and the decode got the same ids.",
                &["pool", "shape"],
            )?,
            prompt_history_turns: counter(
                registry,
                "tokenonce_prompt_history_turns_total",
                "Follow-up chat turns (local ids, checked and matching the echo) whose conversation before them tokenonce rendered again as it stood when its last assistant turn was generated, by pool and result: same (repeated token for token) or drift (the template renders part of it otherwise).",
                &["pool", "result"],
            )?,
            prompt_history_drift_tokens: counter(
                registry,
                "tokenonce_prompt_history_drift_tokens_total",
                "Tokens of the earlier conversation that follow-up turns render otherwise than when it was generated, from the first difference on: prefix-cache misses the chat template causes, by pool.",
                &["pool"],
            )?,
            prompt_history_drift_start: counter(
                registry,
                "tokenonce_prompt_history_drift_start_tokens_total",
                "Sum over drifting follow-up turns of the position of their first differing token (over prompt_history_turns_total{result=\"drift\"}: where drift starts, on average), by pool.",
                &["pool"],
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
            segment_cache_bytes: gauge_vec(
                registry,
                "tokenonce_segment_cache_bytes",
                "Bytes a pool's token cache holds (segment texts, their ids and bookkeeping), read when scraped.",
                &["pool"],
            )?,
        })
    }
}

/// The relay id cache.
#[derive(Clone)]
struct CacheFamilies {
    cache_entries: IntGauge,
    cache_bytes: IntGauge,
    cache_lookups: IntCounterVec,
    cache_evictions: IntCounterVec,
}

impl CacheFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
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
        })
    }
}

/// The parity watch and the pools' model identity.
#[derive(Clone)]
struct ParityFamilies {
    parity_checks: IntCounterVec,
    parity_reuse_disabled: IntCounterVec,
    parity_reuse_off: IntGaugeVec,
    models_differ: IntGaugeVec,
}

impl ParityFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            parity_checks: counter(
                registry,
                "tokenonce_parity_checks_total",
                "Sampled checks that reused ids decode to their request (match, mismatch, skipped, dropped).",
                &["route", "result"],
            )?,
            parity_reuse_disabled: counter(
                registry,
                "tokenonce_parity_reuse_disabled_total",
                "Times a parity mismatch turned token reuse off for the route (on_parity_mismatch = disable_reuse).",
                &["route"],
            )?,
            parity_reuse_off: gauge_vec(
                registry,
                "tokenonce_parity_reuse_off",
                "1 while a parity mismatch holds token reuse off for the route.",
                &["route"],
            )?,
            models_differ: gauge_vec(
                registry,
                "tokenonce_pool_models_differ",
                "1 while the route's prefill and decode pools report different models in GET /v1/models.",
                &["route"],
            )?,
        })
    }
}

/// Config reloads.
#[derive(Clone)]
struct Reloads {
    config_reloads: IntCounterVec,
    /// 1 when the last reload was applied (or none was tried since the start), 0 when it was
    /// rejected.
    last_success: IntGauge,
    /// When the last reload was tried (or the process started), Unix seconds.
    last_time: Gauge,
}

impl Reloads {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        let last_time = Gauge::new(
            "tokenonce_config_last_reload_timestamp_seconds",
            "When the last config reload was tried, whatever its result (the start until one is), Unix time.",
        )?;
        Ok(Self {
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
        })
    }
}

/// Now, in Unix seconds (0 if the clock is before 1970).
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// KV events: the index of held blocks, the subscribers, the hash check (per pool with
/// `kv_events`; no endpoint label: pools grow to hundreds of ranks).
#[derive(Clone)]
struct KvFamilies {
    blocks: IntGaugeVec,
    evicted: IntCounterVec,
    lag: prometheus::GaugeVec,
    gaps: IntCounterVec,
    replays: IntCounterVec,
    replays_failed: IntCounterVec,
    reconnects: IntCounterVec,
    hash_checks: IntCounterVec,
    disabled: IntGaugeVec,
}

impl KvFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            blocks: gauge_vec(
                registry,
                "tokenonce_kv_blocks",
                "KV events index: (endpoint, block) entries held, by pool.",
                &["pool"],
            )?,
            evicted: counter(
                registry,
                "tokenonce_kv_blocks_evicted_total",
                "KV events index: entries dropped by the kv_events.max_blocks bound, by pool.",
                &["pool"],
            )?,
            lag: registered(
                registry,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "tokenonce_kv_events_lag_seconds",
                        "KV events: seconds from the last batch's publication to its arrival, by pool.",
                    ),
                    &["pool"],
                )?,
            )?,
            gaps: counter(
                registry,
                "tokenonce_kv_events_gaps_total",
                "KV events: jumps in an engine's sequence seen on a live connection, by pool.",
                &["pool"],
            )?,
            replays: counter(
                registry,
                "tokenonce_kv_events_replays_total",
                "KV events: replays asked of an engine (each connection's and each gap's), by pool.",
                &["pool"],
            )?,
            replays_failed: counter(
                registry,
                "tokenonce_kv_events_replays_failed_total",
                "KV events: replays that brought no answer (unreachable, silent, cut), by pool; each is asked again later.",
                &["pool"],
            )?,
            reconnects: counter(
                registry,
                "tokenonce_kv_events_reconnects_total",
                "KV events: subscriber connections made again after one was lost, by pool.",
                &["pool"],
            )?,
            hash_checks: counter(
                registry,
                "tokenonce_kv_hash_checks_total",
                "KV events: stored blocks whose hash tokenonce computed again, by pool and result (match, mismatch).",
                &["pool", "result"],
            )?,
            disabled: gauge_vec(
                registry,
                "tokenonce_kv_cache_aware_disabled",
                "1 while a hash mismatch keeps a pool's cache-aware choice off, by pool and reason.",
                &["pool", "reason"],
            )?,
        })
    }
}

fn histogram(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<HistogramVec> {
    histogram_with(registry, name, help, labels, LATENCY_BUCKETS)
}

fn histogram_with(
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

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    registered(registry, IntGauge::new(name, help)?)
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
    registered(registry, IntGaugeVec::new(Opts::new(name, help), labels)?)
}

fn registered<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> prometheus::Result<C> {
    registry.register(Box::new(c.clone()))?;
    Ok(c)
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
            requests: Requests::register(registry)?,
            reuse: ReuseFamilies::register(registry)?,
            upstreams: Upstreams::register(registry)?,
            cache: CacheFamilies::register(registry)?,
            parity: ParityFamilies::register(registry)?,
            reloads: Reloads::register(registry)?,
            kv: KvFamilies::register(registry)?,
            build,
        };
        metrics.init_fixed();
        // The standard `process_*` series (CPU, resident memory, open files, threads, start
        // time), read from /proc when scraped.
        #[cfg(target_os = "linux")]
        registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        Ok(metrics)
    }

    /// Labels `build_info` with the build that runs (version, commit, compiler, profile: the
    /// composition root hands them down).
    pub fn build_info(&self, version: &str, commit: &str, rustc: &str, profile: &str) {
        self.build.with_label_values(&[version, commit, rustc, profile]).set(1);
    }

    /// Client requests being served now.
    pub fn inflight(&self) -> &IntGauge {
        &self.requests.inflight
    }

    /// Counts a request refused at admission on `listener`.
    pub fn admission_rejected(&self, listener: Listener) {
        self.requests.admission_rejected.with_label_values(&[listener.as_str()]).inc();
    }

    /// The bound on requests in flight, as configured (0: none).
    pub fn admission_limit(&self) -> &IntGauge {
        &self.requests.admission_limit
    }

    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    pub fn ready(&self) -> &IntGauge {
        &self.upstreams.ready
    }

    /// Creates the route-independent series up front (zeros instead of gaps).
    fn init_fixed(&self) {
        for leg in Leg::ALL {
            for kind in ErrorKind::ALL {
                self.upstreams.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]);
            }
            self.upstreams.upstream_retries.with_label_values(&[leg.as_str()]);
        }
        for result in CacheLookup::ALL {
            self.cache.cache_lookups.with_label_values(&[result.as_str()]);
        }
        for reason in Eviction::ALL {
            self.cache.cache_evictions.with_label_values(&[reason.as_str()]);
        }
        for result in Reload::ALL {
            self.reloads.config_reloads.with_label_values(&[result.as_str()]);
        }
        // The start loaded the config: as a reload that succeeded.
        self.reloads.last_success.set(1);
        self.reloads.last_time.set(unix_now());
        for listener in Listener::ALL {
            self.requests.admission_rejected.with_label_values(&[listener.as_str()]);
        }
    }

    /// Resolves (and so creates) every series of one configured route with mode `mode`.
    pub fn route(&self, route: &str, mode: Mode) -> RouteMetrics {
        self.route_series(route, mode, true)
    }

    /// The series of unmatched requests: requests and durations only (they never reuse ids,
    /// so no reuse series is exported for them).
    pub fn default_route(&self, route: &str) -> RouteMetrics {
        self.route_series(route, Mode::Passthrough, false)
    }

    fn route_series(&self, route: &str, mode: Mode, counts_reuse: bool) -> RouteMetrics {
        let reuse = |result: &str, reason: &str| {
            if counts_reuse {
                self.reuse.token_reuse.with_label_values(&[route, result, reason])
            } else {
                // Detached: never registered, so never exported.
                IntCounter::new("tokenonce_detached", "unexported")
                    .unwrap_or_else(|_| self.reuse.relayed_id_bytes.clone())
            }
        };
        let per_api = |f: &dyn Fn(&str, &str) -> Histogram| {
            API_LABELS.map(|api| f(api_label(api), served_as(api, mode).as_str()))
        };
        // Only the OpenAI APIs generate tokens: no `api="other"` series for these.
        let per_openai_api = |f: &dyn Fn(&str) -> Histogram| -> [Histogram; Api::ALL.len()] {
            std::array::from_fn(|i| f(api_label(Api::ALL.get(i).copied())))
        };
        RouteMetrics {
            requests: API_LABELS.map(|api| {
                let (api, mode) = (api_label(api), served_as(api, mode).as_str());
                Outcome::ALL
                    .iter()
                    .map(|o| self.requests.requests.with_label_values(&[route, api, mode, o.as_str()]))
                    .collect()
            }),
            request_duration: per_api(&|api, mode| {
                self.requests.request_duration.with_label_values(&[route, api, mode])
            }),
            time_to_first_byte: per_api(&|api, mode| {
                self.requests.time_to_first_byte.with_label_values(&[route, api, mode])
            }),
            time_to_first_token: per_openai_api(&|api| {
                self.requests.time_to_first_token.with_label_values(&[route, api, mode.as_str()])
            }),
            inter_token_latency: per_openai_api(&|api| {
                self.requests.inter_token_latency.with_label_values(&[route, api, mode.as_str()])
            }),
            stages: Stage::ALL
                .iter()
                .map(|s| self.requests.stage_duration.with_label_values(&[route, s.as_str()]))
                .collect(),
            reuse_applied: reuse("applied", "none"),
            reuse_decode_failed: reuse("decode_failed", "none"),
            reuse_fallback: FallbackReason::ALL.iter().map(|r| reuse("fallback", r.as_str())).collect(),
            reused_prompt_tokens: if counts_reuse {
                self.reuse.reused_prompt_tokens.with_label_values(&[route])
            } else {
                reuse("", "")
            },
            relayed_id_bytes: self.reuse.relayed_id_bytes.clone(),
            retry_refused: self.upstreams.retry_budget_exhausted.with_label_values(&[route]),
            prefill_failovers: self.upstreams.prefill_failovers.with_label_values(&[route]),
            timeouts: TimeoutStage::ALL
                .iter()
                .map(|s| self.requests.timeouts.with_label_values(&[route, s.as_str()]))
                .collect(),
            kv_releases: Release::ALL
                .iter()
                .map(|r| {
                    if counts_reuse {
                        self.requests.kv_releases.with_label_values(&[route, r.as_str()])
                    } else {
                        reuse("", "")
                    }
                })
                .collect(),
        }
    }

    /// Resolves (and so creates) a route's parity series.
    pub fn parity(&self, route: &str) -> ParityMetrics {
        ParityMetrics {
            checks: ParityResult::ALL
                .iter()
                .map(|r| self.parity.parity_checks.with_label_values(&[route, r.as_str()]))
                .collect(),
            reuse_disabled: self.parity.parity_reuse_disabled.with_label_values(&[route]),
            reuse_off: self.parity.parity_reuse_off.with_label_values(&[route]),
        }
    }

    /// Sets whether `route`'s prefill and decode pools serve different models.
    pub fn models_differ(&self, route: &str, differ: bool) {
        self.parity.models_differ.with_label_values(&[route]).set(i64::from(differ));
    }

    /// Creates a pool's series (zeros instead of gaps).
    pub fn pool(&self, pool: &str) {
        self.upstreams.upstream_ejections.with_label_values(&[pool]);
        self.upstreams.upstream_ejected.with_label_values(&[pool]);
        self.upstreams.pool_endpoints.with_label_values(&[pool]);
    }

    /// Creates a discovered pool's lookup series (zeros instead of gaps).
    pub fn discovered_pool(&self, pool: &str) {
        DnsLookup::ALL
            .iter()
            .for_each(|r| drop(self.upstreams.discovery_lookups.with_label_values(&[pool, r.as_str()])));
    }

    /// Counts one lookup of `pool`'s DNS name.
    pub fn discovery_lookup(&self, pool: &str, result: DnsLookup) {
        self.upstreams.discovery_lookups.with_label_values(&[pool, result.as_str()]).inc();
    }

    /// Sets how many endpoints `pool` has now.
    pub fn pool_endpoints(&self, pool: &str, endpoints: usize) {
        self.upstreams.pool_endpoints.with_label_values(&[pool]).set(i64::try_from(endpoints).unwrap_or(i64::MAX));
    }

    /// Counts one endpoint of `pool` ejected (the `upstream_ejected` gauge is set from the
    /// pool's state when scraped: an ejection also ends by itself).
    pub fn upstream_ejection(&self, pool: &str) {
        self.upstreams.upstream_ejections.with_label_values(&[pool]).inc();
    }

    /// Resolves (and so creates) the series of `pool`'s `endpoint`: its failures by kind.
    pub fn endpoint(&self, pool: &str, endpoint: &str) -> EndpointMetrics {
        EndpointMetrics {
            errors: ErrorKind::ALL
                .iter()
                .map(|kind| self.upstreams.endpoint_errors.with_label_values(&[pool, endpoint, kind.as_str()]))
                .collect(),
        }
    }

    /// Removes the series of what a reload took away, so no alert fires on a series that no
    /// longer reports anything: an endpoint no longer in `pool`'s list (its health gauge and
    /// its error counters).
    pub fn forget_endpoint(&self, pool: &str, endpoint: &str) {
        let _ = self.upstreams.upstream_healthy.remove_label_values(&[pool, endpoint]);
        for kind in ErrorKind::ALL {
            let _ = self.upstreams.endpoint_errors.remove_label_values(&[pool, endpoint, kind.as_str()]);
        }
    }

    /// Resolves (and so creates) the KV events series of `pool`.
    pub fn kv_events(&self, pool: &str) -> crate::kv::events::Metrics {
        let kv = &self.kv;
        let checks = |result: &str| kv.hash_checks.with_label_values(&[pool, result]);
        let disabled = crate::kv::check::Drift::LABELS.map(|reason| kv.disabled.with_label_values(&[pool, reason]));
        crate::kv::events::Metrics {
            blocks: kv.blocks.with_label_values(&[pool]),
            evicted: kv.evicted.with_label_values(&[pool]),
            lag: kv.lag.with_label_values(&[pool]),
            gaps: kv.gaps.with_label_values(&[pool]),
            replays: kv.replays.with_label_values(&[pool]),
            replays_failed: kv.replays_failed.with_label_values(&[pool]),
            reconnects: kv.reconnects.with_label_values(&[pool]),
            checks_matched: checks("match"),
            checks_mismatched: checks("mismatch"),
            disabled,
        }
    }

    /// Removes a pool's KV events series (a reload removed the pool or its `kv_events`), so
    /// no alert stays firing on a gauge nothing updates.
    pub fn forget_kv_events(&self, pool: &str) {
        let kv = &self.kv;
        for family in [&kv.evicted, &kv.gaps, &kv.replays, &kv.replays_failed, &kv.reconnects] {
            let _ = family.remove_label_values(&[pool]);
        }
        let _ = kv.blocks.remove_label_values(&[pool]);
        let _ = kv.lag.remove_label_values(&[pool]);
        for result in ["match", "mismatch"] {
            let _ = kv.hash_checks.remove_label_values(&[pool, result]);
        }
        for reason in crate::kv::check::Drift::LABELS {
            let _ = kv.disabled.remove_label_values(&[pool, reason]);
        }
    }

    /// Removes a pool's gauges after a reload removed the pool.
    pub fn forget_pool(&self, pool: &str) {
        let _ = self.upstreams.upstream_ejected.remove_label_values(&[pool]);
        let _ = self.upstreams.pool_endpoints.remove_label_values(&[pool]);
        for result in DnsLookup::ALL {
            let _ = self.upstreams.discovery_lookups.remove_label_values(&[pool, result.as_str()]);
        }
    }

    /// Resolves (and so creates) the choice series of a `cache_aware` pool: each source with
    /// the reasons it can give.
    pub fn cache_aware(&self, pool: &str) -> CacheAwareMetrics {
        let family = &self.upstreams.cache_aware_choices;
        let choices = CacheAwareMetrics::PAIRS
            .iter()
            .map(|(source, reason)| family.with_label_values(&[pool, source.as_str(), reason.as_str()]))
            .collect();
        let family = &self.upstreams.cache_aware_predicted_tokens;
        let predicted = CacheAwareMetrics::PREDICTING
            .iter()
            .map(|source| family.with_label_values(&[pool, source.as_str()]))
            .collect();
        CacheAwareMetrics { choices, predicted }
    }

    /// Removes a route's model-identity gauge (the route is gone, or has no prefill pool now).
    pub fn forget_models_differ(&self, route: &str) {
        let _ = self.parity.models_differ.remove_label_values(&[route]);
    }

    /// Removes a route's parity-hold gauge (the route is gone, or is passthrough now).
    pub fn forget_parity_hold(&self, route: &str) {
        let _ = self.parity.parity_reuse_off.remove_label_values(&[route]);
    }

    /// Sets how many endpoints of `pool` are ejected now.
    pub fn upstream_ejected(&self, pool: &str, ejected: usize) {
        self.upstreams.upstream_ejected.with_label_values(&[pool]).set(i64::try_from(ejected).unwrap_or(i64::MAX));
    }

    /// Counts one upstream failure.
    pub fn upstream_error(&self, leg: Leg, kind: ErrorKind) {
        self.upstreams.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]).inc();
    }

    /// Counts one leg re-sent.
    pub fn upstream_retry(&self, leg: Leg) {
        self.upstreams.upstream_retries.with_label_values(&[leg.as_str()]).inc();
    }

    /// Records an endpoint's health poll.
    pub fn upstream_health(&self, pool: &str, endpoint: &str, healthy: bool) {
        self.upstreams.upstream_healthy.with_label_values(&[pool, endpoint]).set(i64::from(healthy));
    }

    /// Counts one Responses follow-up by where it went.
    pub fn response_followup(&self, result: FollowUp) {
        self.upstreams.response_followups.with_label_values(&[result.as_str()]).inc();
    }

    /// Sets how many stored answers' endpoints are known.
    pub fn response_homes(&self, entries: usize) {
        self.upstreams.response_homes.set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Adds a pool's token-cache hits and misses and sets its size.
    pub fn segment_cache(&self, pool: &str, hits: u64, misses: u64, bytes: usize) {
        let lookups = &self.upstreams.segment_cache_lookups;
        lookups.with_label_values(&[pool, "hit"]).inc_by(hits);
        lookups.with_label_values(&[pool, "miss"]).inc_by(misses);
        self.upstreams.segment_cache_bytes.with_label_values(&[pool]).set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets whether a pool's shape is trusted for local ids (its token-in count shows as 0
    /// from then on too, instead of a gap).
    pub fn local_ids_trusted(&self, pool: &str, shape: &str, trusted: bool) {
        self.upstreams.local_ids_trusted.with_label_values(&[pool, shape]).set(i64::from(trusted));
        self.upstreams.local_ids_token_in.with_label_values(&[pool, shape]).inc_by(0);
    }

    /// Counts one follow-up turn whose history was rendered again: `changed` tokens of it from
    /// position `at` on render otherwise (0: none).
    pub fn prompt_history(&self, pool: &str, at: usize, changed: usize) {
        let u = &self.upstreams;
        let result = if changed == 0 { HistoryResult::Same } else { HistoryResult::Drift };
        u.prompt_history_turns.with_label_values(&[pool, result.as_str()]).inc();
        if changed > 0 {
            u.prompt_history_drift_tokens.with_label_values(&[pool]).inc_by(changed as u64);
            u.prompt_history_drift_start.with_label_values(&[pool]).inc_by(at as u64);
        }
    }

    /// Shows a local-ids pool's history series from its first scrape (0 until a follow-up
    /// turn is checked, instead of a gap).
    pub fn prompt_history_seen(&self, pool: &str) {
        let u = &self.upstreams;
        for result in HistoryResult::ALL {
            u.prompt_history_turns.with_label_values(&[pool, result.as_str()]).inc_by(0);
        }
        u.prompt_history_drift_tokens.with_label_values(&[pool]).inc_by(0);
        u.prompt_history_drift_start.with_label_values(&[pool]).inc_by(0);
    }

    /// Counts one prefill sent token-in with tokenonce's ids.
    pub fn local_ids_token_in(&self, pool: &str, shape: &str) {
        self.upstreams.local_ids_token_in.with_label_values(&[pool, shape]).inc();
    }

    /// Counts one local-ids check.
    pub fn local_ids(&self, pool: &str, shape: &str, result: LocalIdsResult) {
        self.upstreams.local_ids_checks.with_label_values(&[pool, shape, result.as_str()]).inc();
    }

    /// Counts one request local ids do not cover, by reason.
    pub fn local_ids_unsupported(&self, pool: &str, reason: &str) {
        self.upstreams.local_ids_unsupported.with_label_values(&[pool, reason]).inc();
    }

    /// Counts one relay cache lookup.
    pub fn cache_lookup(&self, result: CacheLookup) {
        self.cache.cache_lookups.with_label_values(&[result.as_str()]).inc();
    }

    /// Counts cache evictions and sets the cache gauges to `entries` and `bytes`.
    pub fn cache_state(&self, ttl_evicted: u64, capacity_evicted: u64, entries: usize, bytes: usize) {
        for (reason, n) in [(Eviction::Ttl, ttl_evicted), (Eviction::Capacity, capacity_evicted)] {
            if n > 0 {
                self.cache.cache_evictions.with_label_values(&[reason.as_str()]).inc_by(n);
            }
        }
        self.cache.cache_entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.cache.cache_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Counts one config reload and records it as the last one (its result and time).
    pub fn reload(&self, result: Reload) {
        self.reloads.config_reloads.with_label_values(&[result.as_str()]).inc();
        self.reloads.last_success.set(i64::from(result == Reload::Success));
        self.reloads.last_time.set(unix_now());
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
    use std::time::Duration;

    use super::labels::api_index;
    use super::*;

    #[test]
    fn label_tables_follow_declaration_order() {
        // `value as usize` indexes the per-route tables: it must be the value's place in `ALL`.
        macro_rules! in_declaration_order {
            ($($label:ty),+) => {$(
                for (i, value) in <$label>::ALL.iter().enumerate() {
                    assert_eq!(*value as usize, i, stringify!($label));
                }
            )+};
        }
        in_declaration_order!(Stage, Outcome, FallbackReason, ParityResult, TimeoutStage, Release, Api);
        for (i, api) in API_LABELS.iter().enumerate() {
            assert_eq!(api_index(*api), i);
        }
    }

    #[test]
    fn a_route_creates_every_series_it_can_touch() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        let r = m.route("r", Mode::Orchestrate);
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
        let count = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(count("tokenonce_requests_total{"), API_LABELS.len() * Outcome::ALL.len());
        // applied, decode_failed, and each fallback reason.
        assert_eq!(count("tokenonce_token_reuse_total{"), 2 + FallbackReason::ALL.len());
        assert_eq!(count("tokenonce_upstream_errors_total{"), Leg::ALL.len() * ErrorKind::ALL.len());
        assert_eq!(count("tokenonce_stage_duration_seconds_count{"), Stage::ALL.len());
        assert_eq!(count("tokenonce_timeouts_total{"), TimeoutStage::ALL.len());
        assert_eq!(count("tokenonce_kv_releases_total{"), Release::ALL.len());
        r.finished(Some(Api::Completions), Outcome::ClientClosed, Duration::from_millis(5), FirstBytes::default());
        r.reuse_fallback(FallbackReason::CacheMiss);
        r.reuse_applied(7, 20);
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
        for line in [
            r#"tokenonce_requests_total{api="completions",mode="orchestrate",outcome="client_closed",route="r"} 1"#,
            r#"tokenonce_token_reuse_total{reason="cache_miss",result="fallback",route="r"} 1"#,
            r#"tokenonce_token_reuse_total{reason="none",result="applied",route="r"} 1"#,
            r#"tokenonce_reused_prompt_tokens_total{route="r"} 7"#,
            "tokenonce_relayed_id_bytes_total 20",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}");
        }
    }

    #[test]
    fn registers_every_design_metric_once() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        m.route("r", Mode::Relay);
        m.upstream_health("decode", "127.0.0.1:1", true);
        m.pool("decode");
        m.discovered_pool("decode");
        m.endpoint("decode", "127.0.0.1:1");
        m.parity("r");
        m.models_differ("r", false);
        m.build_info("1.0.0", "abc", "rustc 1", "debug");
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
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

    #[test]
    fn latency_buckets_reach_the_longest_deadline_the_config_allows() {
        let top = |b: &[f64]| b.last().copied().unwrap_or_default();
        let secs = |ms: u64| Duration::from_millis(ms).as_secs_f64();
        assert!(top(LATENCY_BUCKETS) >= secs(crate::config::MAX_ANSWER_MS), "whole answers, every leg");
        assert!(top(INTER_TOKEN_BUCKETS) >= secs(crate::config::MAX_LEG_MS), "a gap is at most stream_idle_timeout");
        for b in [LATENCY_BUCKETS, INTER_TOKEN_BUCKETS] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "increasing: {b:?}");
        }
    }

    #[test]
    fn an_endpoint_counts_its_errors_until_a_reload_forgets_it() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        let e = m.endpoint("decode", "10.0.0.1:8200");
        e.error(ErrorKind::Status5xx);
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
        let series = |t: &str| t.lines().filter(|l| l.starts_with("tokenonce_endpoint_errors_total{")).count();
        assert_eq!(series(&text), ErrorKind::ALL.len(), "every kind, zeros instead of gaps");
        assert!(text.contains(
            r#"tokenonce_endpoint_errors_total{endpoint="10.0.0.1:8200",kind="status_5xx",pool="decode"} 1"#
        ));
        m.forget_endpoint("decode", "10.0.0.1:8200");
        assert_eq!(series(&String::from_utf8(Metrics::render(&registry)).unwrap()), 0);
    }

    #[test]
    fn time_to_first_token_and_inter_token_latency_are_per_openai_api() {
        let registry = Registry::new();
        let m = Metrics::register(&registry).unwrap();
        let r = m.route("r", Mode::Orchestrate);
        let first = FirstBytes { head: Some(Duration::from_millis(3)), content: Some(Duration::from_millis(40)) };
        r.finished(Some(Api::Chat), Outcome::Success, Duration::from_millis(90), first);
        r.finished(None, Outcome::Success, Duration::from_millis(9), first);
        r.inter_token(Api::Chat, Duration::from_millis(20));
        r.inter_token(Api::Chat, Duration::ZERO);
        let text = String::from_utf8(Metrics::render(&registry)).unwrap();
        let count = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(count("tokenonce_time_to_first_token_seconds_count{"), Api::ALL.len(), "no api=\"other\"");
        assert_eq!(count("tokenonce_inter_token_latency_seconds_count{"), Api::ALL.len());
        for line in [
            r#"tokenonce_time_to_first_token_seconds_count{api="chat",mode="orchestrate",route="r"} 1"#,
            r#"tokenonce_inter_token_latency_seconds_count{api="chat",mode="orchestrate",route="r"} 2"#,
            r#"tokenonce_inter_token_latency_seconds_sum{api="chat",mode="orchestrate",route="r"} 0.02"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}");
        }
    }
}
