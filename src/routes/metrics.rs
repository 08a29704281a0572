//! Requests served, the family the route table resolves each route's series in: counts,
//! durations, stages, bounded waits, KV releases, in flight, admission, and token reuse
//! ([`RequestMetrics`]); one route's handles ([`RouteMetrics`], resolved when the route table
//! is built; the request path only increments and observes them); and the `api` and `mode`
//! labels a request is counted under.

use std::time::Duration;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, Registry};

use crate::config::Mode;
use crate::metrics::{
    counter, gauge, histogram, histogram_with, registered, DecisionReason, Listener, Outcome, PrefillDecision, Release,
    Stage, TimeoutStage, INTER_TOKEN_BUCKETS, LACKING_TOKEN_BUCKETS,
};
use crate::openai::{Api, FallbackReason};
use crate::parity::metrics::ParityMetrics;
use crate::upstream::metrics::UpstreamMetrics;

/// The families a route table resolves its routes' series in: the requests' own, the
/// upstream's (each route's leg series) and the parity watch's.
#[derive(Clone, Copy)]
pub struct RouteFamilies<'a> {
    /// Requests served and token reuse.
    pub requests: &'a RequestMetrics,
    /// Each route's retries refused and prefill failovers.
    pub upstream: &'a UpstreamMetrics,
    /// Each route's parity checks, hold and model identity.
    pub parity: &'a ParityMetrics,
}

/// Requests served (counts, durations, stages, bounded waits, KV releases, in flight,
/// admission) and token reuse (applied or fallen back, and what it saved).
#[derive(Clone)]
pub struct RequestMetrics {
    /// Requests served: counts, durations, stages, bounded waits, KV releases, in flight.
    requests: Requests,
    /// Token reuse: applied or fallen back, and what it saved.
    reuse: ReuseFamilies,
}

impl RequestMetrics {
    /// Creates and registers the family in `registry`, with its route-independent series
    /// (zeros instead of gaps).
    ///
    /// # Errors
    /// When a name is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let metrics = Self { requests: Requests::register(registry)?, reuse: ReuseFamilies::register(registry)? };
        for listener in Listener::ALL {
            metrics.requests.admission_rejected.with_label_values(&[listener.as_str()]);
        }
        Ok(metrics)
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
            timeouts: TimeoutStage::ALL
                .iter()
                .map(|s| self.requests.timeouts.with_label_values(&[route, s.as_str()]))
                .collect(),
            prefill_decisions: PrefillDecision::ALL
                .iter()
                .map(|d| {
                    DecisionReason::ALL
                        .iter()
                        .map(|r| {
                            if counts_reuse {
                                self.requests.prefill_decisions.with_label_values(&[route, d.as_str(), r.as_str()])
                            } else {
                                reuse("", "")
                            }
                        })
                        .collect()
                })
                .collect(),
            decode_lacking_tokens: self.requests.decode_lacking_tokens.with_label_values(&[route]),
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
    /// Orchestrated requests of a pool-prefill route, by whether they got a prefill leg and why.
    prefill_decisions: IntCounterVec,
    /// The prompt tokens a chosen decode lacked, where its KV events said.
    decode_lacking_tokens: HistogramVec,
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
            prefill_decisions: counter(
                registry,
                "tokenonce_prefill_decisions_total",
                "Orchestrated requests of a route with a prefill pool: whether they got a prefill leg or the decode computed the prompt alone, and why.",
                &["route", "decision", "reason"],
            )?,
            decode_lacking_tokens: histogram_with(
                registry,
                "tokenonce_prefill_decode_lacking_tokens",
                "Prompt tokens the chosen decode did not hold (its KV events), what the prefill decision weighed against prefill.skip_below_tokens.",
                &["route"],
                LACKING_TOKEN_BUCKETS,
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

/// When the client got its first bytes, measured from its request head.
#[derive(Clone, Copy, Debug, Default)]
pub struct FirstBytes {
    /// The response header.
    pub head: Option<Duration>,
    /// The first content of a 2xx answer (time to first token).
    pub content: Option<Duration>,
}

/// One route's series, resolved when the route table is built; the request path only
/// increments and observes.
#[derive(Clone)]
pub struct RouteMetrics {
    /// `[api][outcome]`.
    requests: [Vec<IntCounter>; API_LABELS.len()],
    request_duration: [Histogram; API_LABELS.len()],
    time_to_first_byte: [Histogram; API_LABELS.len()],
    /// By [`Api`] (only the OpenAI APIs generate tokens).
    time_to_first_token: [Histogram; Api::ALL.len()],
    /// By [`Api`].
    inter_token_latency: [Histogram; Api::ALL.len()],
    /// By [`Stage`].
    stages: Vec<Histogram>,
    reuse_applied: IntCounter,
    reuse_decode_failed: IntCounter,
    /// By [`FallbackReason`].
    reuse_fallback: Vec<IntCounter>,
    reused_prompt_tokens: IntCounter,
    relayed_id_bytes: IntCounter,
    /// By [`TimeoutStage`].
    timeouts: Vec<IntCounter>,
    /// By [`Release`].
    kv_releases: Vec<IntCounter>,
    /// By [`PrefillDecision`], then [`DecisionReason`].
    prefill_decisions: Vec<Vec<IntCounter>>,
    decode_lacking_tokens: Histogram,
}

impl RouteMetrics {
    /// Counts a finished request and observes its duration, time to first byte and, when
    /// content reached the client, time to first token.
    pub fn finished(&self, api: Option<Api>, outcome: Outcome, total: Duration, first: FirstBytes) {
        let i = api_index(api);
        if let Some(c) = self.requests.get(i).and_then(|by_outcome| by_outcome.get(outcome as usize)) {
            c.inc();
        }
        if let Some(h) = self.request_duration.get(i) {
            h.observe(total.as_secs_f64());
        }
        if let (Some(h), Some(t)) = (self.time_to_first_byte.get(i), first.head) {
            h.observe(t.as_secs_f64());
        }
        if let (Some(h), Some(t)) = (api.and_then(|api| self.time_to_first_token.get(api as usize)), first.content) {
            h.observe(t.as_secs_f64());
        }
    }

    /// Observes the gap between two content events of a streamed `api` answer.
    pub fn inter_token(&self, api: Api, gap: Duration) {
        if let Some(h) = self.inter_token_latency.get(api as usize) {
            h.observe(gap.as_secs_f64());
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

    /// Counts a decode that was sent prompt ids and failed before answering 2xx (no head, a
    /// timeout, the client gone, or an error status): the ids were sent, not used.
    pub fn reuse_decode_failed(&self) {
        self.reuse_decode_failed.inc();
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

    /// Counts one prefill decision of an orchestrated request.
    pub fn prefill_decision(&self, decision: PrefillDecision, reason: DecisionReason) {
        if let Some(c) = self.prefill_decisions.get(decision as usize).and_then(|r| r.get(reason as usize)) {
            c.inc();
        }
    }

    /// Observes the prompt tokens a chosen decode lacked.
    pub fn decode_lacking(&self, tokens: u64) {
        #[expect(clippy::cast_precision_loss, reason = "a token count, bucketed")]
        self.decode_lacking_tokens.observe(tokens as f64);
    }

    /// Counts a decode that fell back to text.
    pub fn reuse_fallback(&self, reason: FallbackReason) {
        if let Some(c) = self.reuse_fallback.get(reason as usize) {
            c.inc();
        }
    }
}

/// The `api` label: an orchestrated API, or `other`.
fn api_label(api: Option<Api>) -> &'static str {
    api.map_or("other", Api::as_str)
}

/// The `api` label values, in the order [`RouteMetrics`] tables them: every [`Api`], then
/// `other` (a request passed through).
#[expect(clippy::indexing_slicing, reason = "evaluated at compile time: a bad index fails the build")]
const API_LABELS: [Option<Api>; Api::ALL.len() + 1] = {
    let mut labels = [None; Api::ALL.len() + 1];
    let mut i = 0;
    while i < Api::ALL.len() {
        labels[i] = Some(Api::ALL[i]);
        i += 1;
    }
    labels
};

/// The `mode` label of a request: its route's mode for the OpenAI APIs; every other
/// request is passed through whatever its route.
pub fn served_as(api: Option<Api>, route_mode: Mode) -> Mode {
    if api.is_some() {
        route_mode
    } else {
        Mode::Passthrough
    }
}

/// Where `api` stands in [`API_LABELS`].
fn api_index(api: Option<Api>) -> usize {
    api.map_or(Api::ALL.len(), |api| api as usize)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::metrics::{render, ParityResult, INTER_TOKEN_BUCKETS, LATENCY_BUCKETS};

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
        let m = RequestMetrics::register(&registry).unwrap();
        let r = m.route("r", Mode::Orchestrate);
        let text = String::from_utf8(render(&registry)).unwrap();
        let count = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(count("tokenonce_requests_total{"), API_LABELS.len() * Outcome::ALL.len());
        // applied, decode_failed, and each fallback reason.
        assert_eq!(count("tokenonce_token_reuse_total{"), 2 + FallbackReason::ALL.len());
        assert_eq!(count("tokenonce_stage_duration_seconds_count{"), Stage::ALL.len());
        assert_eq!(count("tokenonce_timeouts_total{"), TimeoutStage::ALL.len());
        assert_eq!(count("tokenonce_kv_releases_total{"), Release::ALL.len());
        r.finished(Some(Api::Completions), Outcome::ClientClosed, Duration::from_millis(5), FirstBytes::default());
        r.reuse_fallback(FallbackReason::CacheMiss);
        r.reuse_applied(7, 20);
        let text = String::from_utf8(render(&registry)).unwrap();
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
    fn time_to_first_token_and_inter_token_latency_are_per_openai_api() {
        let registry = Registry::new();
        let m = RequestMetrics::register(&registry).unwrap();
        let r = m.route("r", Mode::Orchestrate);
        let first = FirstBytes { head: Some(Duration::from_millis(3)), content: Some(Duration::from_millis(40)) };
        r.finished(Some(Api::Chat), Outcome::Success, Duration::from_millis(90), first);
        r.finished(None, Outcome::Success, Duration::from_millis(9), first);
        r.inter_token(Api::Chat, Duration::from_millis(20));
        r.inter_token(Api::Chat, Duration::ZERO);
        let text = String::from_utf8(render(&registry)).unwrap();
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
