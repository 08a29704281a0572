//! The handles a route resolves once, when the route table is built: its request, latency,
//! reuse, stage, timeout and release series ([`RouteMetrics`]) and its parity series
//! ([`ParityMetrics`]); and those an endpoint gets when its pool is built
//! ([`EndpointMetrics`]). The request path only increments and observes them.

use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};

use super::labels::{api_index, API_LABELS};
use super::{
    ChoiceReason, ChoiceSource, ErrorKind, FallbackReason, Outcome, ParityResult, Release, Stage, TimeoutStage,
};
use crate::openai::Api;

/// One configured endpoint's series (`endpoint_errors_total{pool,endpoint,kind}`).
#[derive(Clone, Debug)]
pub struct EndpointMetrics {
    /// By [`ErrorKind`].
    pub(super) errors: Vec<IntCounter>,
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
    pub(super) choices: Vec<IntCounter>,
    /// `cache_aware_predicted_tokens_total{pool,source}`, by [`Self::PREDICTING`].
    pub(super) predicted: Vec<IntCounter>,
}

impl CacheAwareMetrics {
    /// The source and reason pairs a choice can report.
    pub const PAIRS: [(ChoiceSource, ChoiceReason); 9] = [
        (ChoiceSource::Events, ChoiceReason::Prefix),
        (ChoiceSource::Events, ChoiceReason::NoPrefix),
        (ChoiceSource::Sent, ChoiceReason::Prefix),
        (ChoiceSource::Sent, ChoiceReason::NoPrefix),
        (ChoiceSource::Text, ChoiceReason::Prefix),
        (ChoiceSource::Text, ChoiceReason::NoPrefix),
        (ChoiceSource::None, ChoiceReason::NoIds),
        (ChoiceSource::None, ChoiceReason::ShortPrompt),
        (ChoiceSource::None, ChoiceReason::Unusable),
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

/// One route's parity-watch series.
#[derive(Clone)]
pub struct ParityMetrics {
    /// By [`ParityResult`].
    pub(super) checks: Vec<IntCounter>,
    pub(super) reuse_disabled: IntCounter,
    pub(super) reuse_off: IntGauge,
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
    pub(super) requests: [Vec<IntCounter>; API_LABELS.len()],
    pub(super) request_duration: [Histogram; API_LABELS.len()],
    pub(super) time_to_first_byte: [Histogram; API_LABELS.len()],
    /// By [`Api`] (only the OpenAI APIs generate tokens).
    pub(super) time_to_first_token: [Histogram; Api::ALL.len()],
    /// By [`Api`].
    pub(super) inter_token_latency: [Histogram; Api::ALL.len()],
    /// By [`Stage`].
    pub(super) stages: Vec<Histogram>,
    pub(super) reuse_applied: IntCounter,
    pub(super) reuse_decode_failed: IntCounter,
    /// By [`FallbackReason`].
    pub(super) reuse_fallback: Vec<IntCounter>,
    pub(super) reused_prompt_tokens: IntCounter,
    pub(super) relayed_id_bytes: IntCounter,
    pub(super) retry_refused: IntCounter,
    pub(super) prefill_failovers: IntCounter,
    /// By [`TimeoutStage`].
    pub(super) timeouts: Vec<IntCounter>,
    /// By [`Release`].
    pub(super) kv_releases: Vec<IntCounter>,
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
