//! The parity watch's moving parts: per-route sampling and mismatch policy ([`RouteParity`]),
//! and the bounded worker pool ([`Watch`]) that decodes sampled ids off the request path. A
//! full queue drops the sample (counted); the request never waits.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::check::{check, expected_contents, Verdict};
use super::metrics::RouteParityMetrics;
use super::Tokenizer;
use crate::config::ParityPolicy;
use crate::metrics::ParityResult;
use crate::openai::{Api, PromptIds};

/// Worker threads of the watch: a check at 37k tokens takes milliseconds, and the engines'
/// own CPUs are not tokenonce's to take.
pub const WORKERS: usize = 1;

/// Samples waiting for a worker; more are dropped.
pub const QUEUE: usize = 16;

/// A route's hold on token reuse after a parity mismatch under `disable_reuse`: `Some(until)`
/// while held. It lives in the route's state ([`crate::routes::RouteState`]), so a reload of
/// the unchanged route keeps it while the watch itself is rebuilt (a new tokenizer file).
#[derive(Debug, Default)]
pub struct ParityHold(Mutex<Option<Instant>>);

impl ParityHold {
    /// True while reuse is held off.
    pub fn is_held(&self) -> bool {
        self.0.lock().is_some()
    }

    /// Holds reuse off until at least `until`; true when it was not held before.
    pub fn hold_until(&self, until: Instant) -> bool {
        let mut off = self.0.lock();
        let was_free = off.is_none();
        *off = Some(until);
        was_free
    }

    /// Ends the hold if its cool-down passed at `now`; true when it ended.
    fn release_after_cooldown(&self, now: Instant) -> bool {
        let mut off = self.0.lock();
        if off.is_some_and(|until| now >= until) {
            *off = None;
            return true;
        }
        false
    }
}

/// One route's parity settings, built with the route table, and its hold (the route's state).
pub struct RouteParity {
    route: String,
    tokenizer: Arc<Tokenizer>,
    /// Sample share in 1/2^32 steps; an accumulator crossing a 2^32 boundary samples.
    step: u64,
    acc: AtomicU64,
    policy: ParityPolicy,
    cooldown: Duration,
    /// Held while reuse is off after a mismatch (carried across reloads).
    hold: Arc<ParityHold>,
    metrics: RouteParityMetrics,
}

/// A reused request to check.
pub struct Sample {
    /// Its route's watch state.
    pub route: Arc<RouteParity>,
    /// For the mismatch log line.
    pub request_id: String,
    /// Chat or completions.
    pub api: Api,
    /// The client's body (shared bytes; parsed on the worker).
    pub body: Bytes,
    /// The ids the decode got (or, while reuse is off, would have got).
    pub ids: PromptIds,
    /// The prefill's `usage.prompt_tokens`, when it reported one.
    pub prompt_tokens: Option<u64>,
}

impl RouteParity {
    /// The watch of route `route` checking with `tokenizer`, sampling `share` (0–1) of
    /// reused requests, its hold in `hold` (the `reuse_off` gauge is set to match it).
    pub fn new(
        route: &str,
        tokenizer: Arc<Tokenizer>,
        share: f64,
        policy: ParityPolicy,
        cooldown: Duration,
        metrics: RouteParityMetrics,
        hold: Arc<ParityHold>,
    ) -> Self {
        let step = (share.clamp(0.0, 1.0) * (1u64 << 32) as f64).ceil() as u64;
        metrics.show_hold(hold.is_held());
        Self { route: route.to_owned(), tokenizer, step, acc: AtomicU64::new(0), policy, cooldown, hold, metrics }
    }

    /// The route's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// True while a mismatch holds reuse off (`disable_reuse`): decodes go text, and every
    /// request's ids are checked until they match again after the cool-down.
    pub fn reuse_off(&self) -> bool {
        self.hold.is_held()
    }

    /// Whether to check this request: exactly `share` of calls (evenly spread), or every one
    /// while reuse is off.
    pub fn wants_sample(&self) -> bool {
        if self.reuse_off() {
            return true;
        }
        let old = self.acc.fetch_add(self.step, Ordering::Relaxed);
        (old.wrapping_add(self.step) >> 32) != (old >> 32)
    }

    /// Runs one sample's check and applies the verdict (on a worker thread).
    fn run(&self, sample: &Sample) {
        let verdict = match expected_contents(sample.api, &sample.body) {
            Err(why) => Verdict::Skipped(why),
            Ok(expected) => match self.tokenizer.decode(&sample.ids.to_vec()) {
                Err(_) => Verdict::Skipped("ids do not decode"),
                Ok(decoded) => check(&decoded, &expected, sample.ids.len(), sample.prompt_tokens),
            },
        };
        self.record(&sample.request_id, &verdict, Instant::now());
    }

    /// Counts a verdict, logs a mismatch, and moves the reuse switch under `disable_reuse`.
    fn record(&self, request_id: &str, verdict: &Verdict, now: Instant) {
        match verdict {
            Verdict::Match => {
                self.metrics.check(ParityResult::Match);
                self.maybe_back_on(now);
            }
            Verdict::Skipped(why) => {
                self.metrics.check(ParityResult::Skipped);
                tracing::debug!(request_id, route = %self.route, why, "parity check skipped");
            }
            Verdict::Mismatch(m) => {
                self.metrics.check(ParityResult::Mismatch);
                let content = m.content.map_or_else(|| "count".to_owned(), |i| i.to_string());
                tracing::warn!(
                    request_id, route = %self.route, content = %content, expected = %m.expected, found = %m.found,
                    "parity mismatch: the prompt ids do not carry the request"
                );
                if self.policy == ParityPolicy::DisableReuse {
                    self.turn_off(now);
                }
            }
        }
    }

    fn turn_off(&self, now: Instant) {
        if self.hold.hold_until(now + self.cooldown) {
            self.metrics.reuse_disabled();
            tracing::warn!(route = %self.route, cooldown_ms = self.cooldown.as_millis() as u64,
                "parity: token reuse off for the route until samples match again");
        }
    }

    fn maybe_back_on(&self, now: Instant) {
        if self.hold.release_after_cooldown(now) {
            self.metrics.reuse_back_on();
            tracing::info!(route = %self.route, "parity: samples match again, token reuse back on");
        }
    }
}

/// The worker pool; dropping the last handle ends its threads once the queue is drained.
pub struct Watch {
    tx: SyncSender<Sample>,
}

impl Watch {
    /// Starts `workers` threads behind a queue of `queue` samples.
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn start(workers: usize, queue: usize) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Sample>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..workers.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new().name(format!("tokenonce-parity-{i}")).spawn(move || work(&rx))?;
        }
        Ok(Self { tx })
    }

    /// Queues `sample` without waiting; a full queue drops it (counted as `dropped`).
    pub fn submit(&self, sample: Sample) {
        match self.tx.try_send(sample) {
            Ok(()) => {}
            Err(TrySendError::Full(s) | TrySendError::Disconnected(s)) => s.route.metrics.check(ParityResult::Dropped),
        }
    }
}

/// A worker: takes samples until every sender is gone.
fn work(rx: &Mutex<Receiver<Sample>>) {
    loop {
        // The guard is a temporary: the lock is released before the sample is worked on.
        let Ok(sample) = rx.lock().recv() else { return };
        sample.route.run(&sample);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tokenizer::testing::{encode, word_tokenizer};
    use super::*;
    use crate::metrics::render;
    use crate::parity::metrics::ParityMetrics;

    fn parity(share: f64, policy: ParityPolicy, registry: &prometheus::Registry) -> Arc<RouteParity> {
        let metrics = ParityMetrics::register(registry).unwrap();
        let tk = Arc::new(word_tokenizer(&["<|im_start|>user", "hello", "world", "bye"], &["<|im_end|>"]));
        let hold = Arc::default();
        Arc::new(RouteParity::new("r", tk, share, policy, Duration::from_millis(50), metrics.route("r"), hold))
    }

    fn scrape(registry: &prometheus::Registry, result: &str) -> u64 {
        let text = String::from_utf8(render(registry)).unwrap();
        let line = format!("tokenonce_parity_checks_total{{result=\"{result}\",route=\"r\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&line)).and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    fn sample(route: &Arc<RouteParity>, prompt: &str, body: &str) -> Sample {
        let ids = encode(route.tokenizer(), prompt);
        Sample {
            route: Arc::clone(route),
            request_id: "req-1".into(),
            api: Api::Chat,
            body: Bytes::from(body.to_owned()),
            prompt_tokens: Some(ids.len() as u64),
            ids: PromptIds::from_ids(&ids),
        }
    }

    const BODY: &str = r#"{"messages":[{"role":"user","content":"hello world"}]}"#;

    #[test]
    fn samples_exactly_the_share() {
        let registry = prometheus::Registry::new();
        for (share, want) in [(0.0, 0), (0.01, 10), (0.25, 250), (1.0, 1000)] {
            let p = parity(share, ParityPolicy::Alert, &prometheus::Registry::new());
            assert_eq!((0..1000).filter(|_| p.wants_sample()).count(), want, "share {share}");
        }
        drop(registry);
    }

    #[test]
    fn the_right_ids_match_and_another_requests_ids_do_not() {
        let registry = prometheus::Registry::new();
        let p = parity(1.0, ParityPolicy::Alert, &registry);
        p.run(&sample(&p, "<|im_start|>user hello world <|im_end|>", BODY));
        assert_eq!(scrape(&registry, "match"), 1);
        p.run(&sample(&p, "<|im_start|>user bye <|im_end|>", BODY));
        assert_eq!(scrape(&registry, "mismatch"), 1);
        p.run(&sample(&p, "<|im_start|>user hello world", r#"{"prompt":"x"}"#));
        assert_eq!(scrape(&registry, "skipped"), 1);
        assert!(!p.reuse_off(), "alert never turns reuse off");
    }

    #[test]
    fn disable_reuse_turns_off_on_a_mismatch_and_back_on_after_the_cooldown_when_samples_match() {
        let registry = prometheus::Registry::new();
        let p = parity(0.0, ParityPolicy::DisableReuse, &registry);
        assert!(!p.wants_sample());
        let now = Instant::now();
        p.record(
            "a",
            &Verdict::Mismatch(super::super::check::Mismatch {
                content: Some(0),
                expected: "x".into(),
                found: "y".into(),
            }),
            now,
        );
        assert!(p.reuse_off());
        assert!(p.wants_sample(), "every request is checked while reuse is off");
        p.record("b", &Verdict::Match, now + Duration::from_millis(10));
        assert!(p.reuse_off(), "a match inside the cool-down keeps reuse off");
        p.record("c", &Verdict::Match, now + Duration::from_millis(60));
        assert!(!p.reuse_off());
        let text = String::from_utf8(render(&registry)).unwrap();
        assert!(text.contains("tokenonce_parity_reuse_disabled_total{route=\"r\"} 1"), "{text}");
        assert!(text.contains("tokenonce_parity_reuse_off{route=\"r\"} 0"), "{text}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_waiting() {
        let registry = prometheus::Registry::new();
        let p = parity(1.0, ParityPolicy::Alert, &registry);
        // No worker takes from this queue of one: the second sample is dropped.
        let (tx, _rx) = sync_channel::<Sample>(1);
        let watch = Watch { tx };
        watch.submit(sample(&p, "hello", BODY));
        watch.submit(sample(&p, "hello", BODY));
        assert_eq!(scrape(&registry, "dropped"), 1);
        let watch = Watch::start(1, 4).unwrap();
        watch.submit(sample(&p, "<|im_start|>user hello world <|im_end|>", BODY));
        let deadline = Instant::now() + Duration::from_secs(10);
        while scrape(&registry, "match") == 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(scrape(&registry, "match"), 1);
    }
}
