//! Every metric tokenonce exports, defined in this one place (prefix `tokenonce_`). Label
//! values are enums owned here (bounded cardinality); route and pool names come from config.
//! Per-route handles are resolved once, when the route table is built ([`RouteMetrics`]);
//! every series that can occur is created up front, so dashboards never see a gap.

use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::config::Mode;
use crate::openai::Api;

/// Latency buckets from 1 ms to 120 s: loopback overheads at the bottom, long prefills and
/// whole streamed answers at the top.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];

/// Declares a label enum: variants, their label strings, and `ALL` in declaration order
/// (so `variant as usize` indexes `ALL` and the per-route handle tables).
macro_rules! label_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $label,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

label_enum! {
    /// Timed stages of an orchestrated request (`stage_duration_seconds{stage}`).
    Stage {
        /// The prefill leg, send to full response.
        Prefill => "prefill",
        /// Extracting and validating the handoff, building the decode body.
        Handoff => "handoff",
        /// Decode leg, send to response header.
        DecodeFirstByte => "decode_first_byte",
        /// Decode leg, send to end of stream.
        DecodeTotal => "decode_total",
    }
}

label_enum! {
    /// Which leg an upstream error or retry happened on (`upstream_errors_total{stage}`).
    Leg {
        /// The prefill leg.
        Prefill => "prefill",
        /// The decode leg (orchestrated, relayed, or decode-only).
        Decode => "decode",
        /// A passthrough route or an unmatched request.
        Passthrough => "passthrough",
    }
}

label_enum! {
    /// How an upstream exchange failed (`upstream_errors_total{kind}`).
    ErrorKind {
        /// Could not connect.
        Connect => "connect",
        /// The TLS handshake failed (certificate not trusted, or ours refused).
        Tls => "tls",
        /// The connection failed while sending or reading.
        Io => "io",
        /// No answer within the leg's deadline.
        Timeout => "timeout",
        /// The answer was over the size tokenonce buffers.
        TooLarge => "too_large",
        /// The engine answered 5xx.
        Status5xx => "status_5xx",
        /// A 2xx prefill answer that is not a completion response.
        BadResponse => "bad_response",
        /// A stream broke after the response began.
        StreamBroken => "stream_broken",
    }
}

label_enum! {
    /// Which bounded wait ran out (`timeouts_total{stage}`).
    TimeoutStage {
        /// TCP connect to an engine (`upstream.connect_timeout_ms`).
        Connect => "connect",
        /// The whole prefill leg (`prefill_timeout_ms`).
        Prefill => "prefill",
        /// An engine's response header (`decode_first_byte_timeout_ms`).
        FirstByte => "first_byte",
        /// Silence between body chunks of an answer being relayed (`stream_idle_timeout_ms`).
        StreamIdle => "stream_idle",
        /// A write to a client that does not read (`client_write_timeout_ms`).
        ClientWrite => "client_write",
        /// The release leg sent for a client gone after its prefill (`release_timeout_ms`).
        Release => "release",
    }
}

label_enum! {
    /// What became of a prefill's KV blocks when the client left before the decode answered
    /// a body byte (`kv_releases_total{result}`).
    Release {
        /// The one-token decode was sent and answered 2xx: the decode pulled the blocks.
        Released => "released",
        /// It was sent and failed (no answer, or not 2xx).
        Failed => "failed",
        /// It was sent and did not finish within `release_timeout_ms`.
        Timeout => "timeout",
        /// The route has `on_client_gone = "abandon"`: nothing was sent.
        Abandoned => "abandoned",
    }
}

label_enum! {
    /// How a request ended (`requests_total{outcome}`).
    Outcome {
        /// 2xx fully relayed.
        Success => "success",
        /// 4xx (ours or an engine's).
        ClientError => "client_error",
        /// 5xx, or a stream that broke.
        ServerError => "server_error",
        /// The client went away first.
        ClientClosed => "client_closed",
    }
}

impl Outcome {
    /// The outcome of a finished response with `status`.
    pub fn from_status(status: u16) -> Self {
        match status {
            200..=399 => Self::Success,
            400..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

label_enum! {
    /// Why a request took the text decode instead of reusing the prefill's ids
    /// (`token_reuse_total{result="fallback",reason}`).
    FallbackReason {
        /// The route turns token reuse off.
        Disabled => "disabled",
        /// The decode vLLM is older than 0.27 (no `kv_transfer_params.prompt_token_ids`).
        DecodeVersionOld => "decode_version_old",
        /// The decode vLLM's version could not be learned.
        DecodeVersionUnknown => "decode_version_unknown",
        /// Messages carry media: ids alone would drop it.
        Media => "media",
        /// `echo` is set.
        Echo => "echo",
        /// `n > 1`.
        NGreaterThanOne => "n_gt_1",
        /// A completions batch (several prompts).
        BatchPrompt => "batch_prompt",
        /// The client already sent token ids: nothing to save.
        PromptIsTokens => "prompt_is_tokens",
        /// The prefill echoed no ids.
        IdsMissing => "ids_missing",
        /// The prefill's ids failed validation.
        IdsMalformed => "ids_malformed",
        /// Relay mode: no cached ids for this decode.
        CacheMiss => "cache_miss",
        /// The prefill leg failed and the route sends the decode alone.
        PrefillFailed => "prefill_failed",
        /// The API has no way to echo prompt ids on vLLM (`/v1/messages`).
        IdsNotEchoed => "ids_not_echoed",
        /// A Responses request that needs the decode's response store
        /// (`previous_response_id`, `conversation`, `background`): sent to the decode alone.
        Stateful => "stateful",
        /// A fractional `token_reuse` left this request out of the canary share.
        Canary => "canary",
        /// An id is at or above the vocabulary size of the route's tokenizer.
        IdsOutOfVocab => "ids_out_of_vocab",
        /// The parity watch found ids that do not carry their request (`disable_reuse`).
        ParityReuseOff => "parity_reuse_off",
        /// The prefill and decode pools serve different models (`GET /v1/models`).
        ModelMismatch => "model_mismatch",
    }
}

label_enum! {
    /// Result of a parity check (`parity_checks_total{result}`).
    ParityResult {
        /// The ids decode to the request's contents, in order, and their count agrees.
        Match => "match",
        /// They do not.
        Mismatch => "mismatch",
        /// Nothing comparable (no text content, a token prompt, ids that do not decode).
        Skipped => "skipped",
        /// The watch's queue was full: not checked.
        Dropped => "dropped",
    }
}

label_enum! {
    /// What became of spans handed to the OTLP exporter (`trace_spans_total{result}`).
    SpanExport {
        /// The collector took the batch.
        Exported => "exported",
        /// The batch could not be sent (collector down, refused, timed out): the spans are lost.
        Failed => "failed",
    }
}

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

label_enum! {
    /// Result of a relay cache lookup (`cache_lookups_total{result}`).
    CacheLookup {
        /// Ids found and taken.
        Hit => "hit",
        /// No entry under any key.
        Miss => "miss",
        /// An entry was found but had expired.
        Expired => "expired",
        /// An entry was found under a key but for another prompt.
        Mismatch => "mismatch",
    }
}

label_enum! {
    /// Why relay cache entries were dropped (`cache_evictions_total{reason}`).
    Eviction {
        /// The TTL passed.
        Ttl => "ttl",
        /// Room was needed (or the entry was larger than the cache).
        Capacity => "capacity",
    }
}

label_enum! {
    /// Result of a config reload (`config_reloads_total{result}`).
    Reload {
        /// The new config is in use.
        Success => "success",
        /// The file was rejected; the running config stays.
        Failure => "failure",
    }
}

/// The `api` label: an orchestrated API, or `other`.
fn api_label(api: Option<Api>) -> &'static str {
    api.map_or("other", Api::as_str)
}

/// The `api` label values, in the order [`RouteMetrics`] tables them.
const API_LABELS: [Option<Api>; 5] =
    [Some(Api::Chat), Some(Api::Completions), Some(Api::Responses), Some(Api::Messages), None];

/// The `mode` label of a request: its route's mode for the OpenAI APIs; every other
/// request is passed through whatever its route.
pub fn served_as(api: Option<Api>, route_mode: Mode) -> Mode {
    if api.is_some() {
        route_mode
    } else {
        Mode::Passthrough
    }
}

fn api_index(api: Option<Api>) -> usize {
    match api {
        Some(Api::Chat) => 0,
        Some(Api::Completions) => 1,
        Some(Api::Responses) => 2,
        Some(Api::Messages) => 3,
        None => 4,
    }
}

/// Handles to every metric family.
#[derive(Clone)]
pub struct Metrics {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    time_to_first_byte: HistogramVec,
    stage_duration: HistogramVec,
    token_reuse: IntCounterVec,
    reused_prompt_tokens: IntCounterVec,
    relayed_id_bytes: IntCounter,
    upstream_errors: IntCounterVec,
    upstream_retries: IntCounterVec,
    retry_budget_exhausted: IntCounterVec,
    prefill_failovers: IntCounterVec,
    timeouts: IntCounterVec,
    kv_releases: IntCounterVec,
    upstream_ejections: IntCounterVec,
    upstream_ejected: IntGaugeVec,
    /// Requests being served now.
    pub inflight: IntGauge,
    upstream_healthy: IntGaugeVec,
    /// 1 while every decode pool has a healthy endpoint (what `/readyz` reports).
    pub ready: IntGauge,
    cache_entries: IntGauge,
    cache_bytes: IntGauge,
    cache_lookups: IntCounterVec,
    cache_evictions: IntCounterVec,
    config_reloads: IntCounterVec,
    parity_checks: IntCounterVec,
    parity_reuse_disabled: IntCounterVec,
    parity_reuse_off: IntGaugeVec,
    models_differ: IntGaugeVec,
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
        let build_info =
            gauge_vec(registry, "tokenonce_build_info", "Always 1; labelled with the build.", &["version"])?;
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let spans = trace_spans().as_ref().map_err(|e| prometheus::Error::Msg(e.to_string()))?;
        registered(registry, spans.clone())?;
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
            relayed_id_bytes: registered(
                registry,
                IntCounter::new(
                    "tokenonce_relayed_id_bytes_total",
                    "Bytes of prompt-id JSON spliced into decode requests.",
                )?,
            )?,
            upstream_errors: counter(
                registry,
                "tokenonce_upstream_errors_total",
                "Upstream failures by stage (prefill, decode, passthrough) and kind.",
                &["stage", "kind"],
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
            upstream_ejections: counter(
                registry,
                "tokenonce_upstream_ejections_total",
                "Endpoints ejected from their pool's choice after consecutive request failures.",
                &["pool"],
            )?,
            upstream_ejected: gauge_vec(
                registry,
                "tokenonce_upstream_ejected",
                "Endpoints of the pool ejected now (updated on ejection and every health interval).",
                &["pool"],
            )?,
            inflight: gauge(registry, "tokenonce_inflight_requests", "Client requests being served now.")?,
            upstream_healthy: gauge_vec(
                registry,
                "tokenonce_upstream_healthy",
                "1 while the endpoint answers GET /health with 200.",
                &["pool", "endpoint"],
            )?,
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
        };
        metrics.init_fixed();
        Ok(metrics)
    }

    /// Creates the route-independent series up front (zeros instead of gaps).
    fn init_fixed(&self) {
        for leg in Leg::ALL {
            for kind in ErrorKind::ALL {
                self.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]);
            }
            self.upstream_retries.with_label_values(&[leg.as_str()]);
        }
        for result in CacheLookup::ALL {
            self.cache_lookups.with_label_values(&[result.as_str()]);
        }
        for reason in Eviction::ALL {
            self.cache_evictions.with_label_values(&[reason.as_str()]);
        }
        for result in Reload::ALL {
            self.config_reloads.with_label_values(&[result.as_str()]);
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
                self.token_reuse.with_label_values(&[route, result, reason])
            } else {
                // Detached: never registered, so never exported.
                IntCounter::new("tokenonce_detached", "unexported").unwrap_or_else(|_| self.relayed_id_bytes.clone())
            }
        };
        let per_api = |f: &dyn Fn(&str, &str) -> Histogram| {
            API_LABELS.map(|api| f(api_label(api), served_as(api, mode).as_str()))
        };
        RouteMetrics {
            requests: API_LABELS.map(|api| {
                let (api, mode) = (api_label(api), served_as(api, mode).as_str());
                Outcome::ALL.iter().map(|o| self.requests.with_label_values(&[route, api, mode, o.as_str()])).collect()
            }),
            request_duration: per_api(&|api, mode| self.request_duration.with_label_values(&[route, api, mode])),
            time_to_first_byte: per_api(&|api, mode| self.time_to_first_byte.with_label_values(&[route, api, mode])),
            stages: Stage::ALL.iter().map(|s| self.stage_duration.with_label_values(&[route, s.as_str()])).collect(),
            reuse_applied: reuse("applied", "none"),
            reuse_fallback: FallbackReason::ALL.iter().map(|r| reuse("fallback", r.as_str())).collect(),
            reused_prompt_tokens: if counts_reuse {
                self.reused_prompt_tokens.with_label_values(&[route])
            } else {
                reuse("", "")
            },
            relayed_id_bytes: self.relayed_id_bytes.clone(),
            retry_refused: self.retry_budget_exhausted.with_label_values(&[route]),
            prefill_failovers: self.prefill_failovers.with_label_values(&[route]),
            timeouts: TimeoutStage::ALL.iter().map(|s| self.timeouts.with_label_values(&[route, s.as_str()])).collect(),
            kv_releases: Release::ALL
                .iter()
                .map(|r| {
                    if counts_reuse {
                        self.kv_releases.with_label_values(&[route, r.as_str()])
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
                .map(|r| self.parity_checks.with_label_values(&[route, r.as_str()]))
                .collect(),
            reuse_disabled: self.parity_reuse_disabled.with_label_values(&[route]),
            reuse_off: self.parity_reuse_off.with_label_values(&[route]),
        }
    }

    /// Sets whether `route`'s prefill and decode pools serve different models.
    pub fn models_differ(&self, route: &str, differ: bool) {
        self.models_differ.with_label_values(&[route]).set(i64::from(differ));
    }

    /// Creates a pool's series (zeros instead of gaps).
    pub fn pool(&self, pool: &str) {
        self.upstream_ejections.with_label_values(&[pool]);
        self.upstream_ejected.with_label_values(&[pool]);
    }

    /// Counts one endpoint of `pool` ejected.
    pub fn upstream_ejection(&self, pool: &str) {
        self.upstream_ejections.with_label_values(&[pool]).inc();
        self.upstream_ejected.with_label_values(&[pool]).inc();
    }

    /// Sets how many endpoints of `pool` are ejected now.
    pub fn upstream_ejected(&self, pool: &str, ejected: usize) {
        self.upstream_ejected.with_label_values(&[pool]).set(i64::try_from(ejected).unwrap_or(i64::MAX));
    }

    /// Counts one upstream failure.
    pub fn upstream_error(&self, leg: Leg, kind: ErrorKind) {
        self.upstream_errors.with_label_values(&[leg.as_str(), kind.as_str()]).inc();
    }

    /// Counts one leg re-sent.
    pub fn upstream_retry(&self, leg: Leg) {
        self.upstream_retries.with_label_values(&[leg.as_str()]).inc();
    }

    /// Records an endpoint's health poll.
    pub fn upstream_health(&self, pool: &str, endpoint: &str, healthy: bool) {
        self.upstream_healthy.with_label_values(&[pool, endpoint]).set(i64::from(healthy));
    }

    /// Counts one relay cache lookup.
    pub fn cache_lookup(&self, result: CacheLookup) {
        self.cache_lookups.with_label_values(&[result.as_str()]).inc();
    }

    /// Counts cache evictions and sets the cache gauges to `entries` and `bytes`.
    pub fn cache_state(&self, ttl_evicted: u64, capacity_evicted: u64, entries: usize, bytes: usize) {
        for (reason, n) in [(Eviction::Ttl, ttl_evicted), (Eviction::Capacity, capacity_evicted)] {
            if n > 0 {
                self.cache_evictions.with_label_values(&[reason.as_str()]).inc_by(n);
            }
        }
        self.cache_entries.set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.cache_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Counts one config reload.
    pub fn reload(&self, result: Reload) {
        self.config_reloads.with_label_values(&[result.as_str()]).inc();
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

/// One route's parity-watch series.
#[derive(Clone)]
pub struct ParityMetrics {
    /// By [`ParityResult`].
    checks: Vec<IntCounter>,
    reuse_disabled: IntCounter,
    reuse_off: IntGauge,
}

impl ParityMetrics {
    /// Counts one check.
    pub fn check(&self, result: ParityResult) {
        if let Some(c) = self.checks.get(result as usize) {
            c.inc();
        }
    }

    /// Counts reuse turned off, and marks it off.
    pub fn reuse_disabled(&self) {
        self.reuse_disabled.inc();
        self.reuse_off.set(1);
    }

    /// Marks reuse on again.
    pub fn reuse_back_on(&self) {
        self.reuse_off.set(0);
    }

    /// Sets the `reuse_off` gauge to a hold's state (when the route's watch is built).
    pub fn show_hold(&self, held: bool) {
        self.reuse_off.set(i64::from(held));
    }
}

/// One route's series, resolved when the route table is built; the request path only
/// increments and observes.
#[derive(Clone)]
pub struct RouteMetrics {
    /// `[api][outcome]`.
    requests: [Vec<IntCounter>; 5],
    request_duration: [Histogram; 5],
    time_to_first_byte: [Histogram; 5],
    /// By [`Stage`].
    stages: Vec<Histogram>,
    reuse_applied: IntCounter,
    /// By [`FallbackReason`].
    reuse_fallback: Vec<IntCounter>,
    reused_prompt_tokens: IntCounter,
    relayed_id_bytes: IntCounter,
    retry_refused: IntCounter,
    prefill_failovers: IntCounter,
    /// By [`TimeoutStage`].
    timeouts: Vec<IntCounter>,
    /// By [`Release`].
    kv_releases: Vec<IntCounter>,
}

impl RouteMetrics {
    /// Counts a finished request and observes its duration and time to first byte.
    pub fn finished(&self, api: Option<Api>, outcome: Outcome, total: Duration, first_byte: Option<Duration>) {
        let i = api_index(api);
        if let Some(c) = self.requests.get(i).and_then(|by_outcome| by_outcome.get(outcome as usize)) {
            c.inc();
        }
        if let Some(h) = self.request_duration.get(i) {
            h.observe(total.as_secs_f64());
        }
        if let (Some(h), Some(t)) = (self.time_to_first_byte.get(i), first_byte) {
            h.observe(t.as_secs_f64());
        }
    }

    /// Observes one stage's duration.
    pub fn stage(&self, stage: Stage, took: Duration) {
        if let Some(h) = self.stages.get(stage as usize) {
            h.observe(took.as_secs_f64());
        }
    }

    /// Counts a decode that reused `tokens` prompt ids, `id_bytes` of JSON.
    pub fn reuse_applied(&self, tokens: usize, id_bytes: usize) {
        self.reuse_applied.inc();
        self.reused_prompt_tokens.inc_by(tokens as u64);
        self.relayed_id_bytes.inc_by(id_bytes as u64);
    }

    /// Counts a retry the budget refused.
    pub fn retry_refused(&self) {
        self.retry_refused.inc();
    }

    /// Counts a pool prefill moved to another endpoint.
    pub fn prefill_failover(&self) {
        self.prefill_failovers.inc();
    }

    /// Counts a bounded wait that ran out.
    pub fn timeout(&self, stage: TimeoutStage) {
        if let Some(c) = self.timeouts.get(stage as usize) {
            c.inc();
        }
    }

    /// Counts what became of a gone client's KV blocks.
    pub fn kv_release(&self, result: Release) {
        if let Some(c) = self.kv_releases.get(result as usize) {
            c.inc();
        }
    }

    /// Counts a decode that fell back to text.
    pub fn reuse_fallback(&self, reason: FallbackReason) {
        if let Some(c) = self.reuse_fallback.get(reason as usize) {
            c.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_tables_follow_declaration_order() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        for (i, r) in FallbackReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, r) in ParityResult::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, s) in TimeoutStage::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
        for (i, r) in Release::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
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
        assert_eq!(count("tokenonce_token_reuse_total{"), 1 + FallbackReason::ALL.len());
        assert_eq!(count("tokenonce_upstream_errors_total{"), Leg::ALL.len() * ErrorKind::ALL.len());
        assert_eq!(count("tokenonce_stage_duration_seconds_count{"), Stage::ALL.len());
        assert_eq!(count("tokenonce_timeouts_total{"), TimeoutStage::ALL.len());
        assert_eq!(count("tokenonce_kv_releases_total{"), Release::ALL.len());
        r.finished(Some(Api::Completions), Outcome::ClientClosed, Duration::from_millis(5), None);
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
        m.parity("r");
        m.models_differ("r", false);
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
            "tokenonce_retry_budget_exhausted_total",
            "tokenonce_inflight_requests",
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
            "tokenonce_parity_checks_total",
            "tokenonce_parity_reuse_disabled_total",
            "tokenonce_parity_reuse_off",
            "tokenonce_pool_models_differ",
            "tokenonce_timeouts_total",
            "tokenonce_kv_releases_total",
            "tokenonce_trace_spans_total",
        ] {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(Metrics::register(&registry).is_err(), "double registration must fail");
    }
}
