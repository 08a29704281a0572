//! Local ids, in shadow: for a request whose prefill echoed its prompt ids, tokenonce renders
//! and tokenizes the request itself (`render`, then the pool's tokenizer, chat prompts segment
//! by segment through the pool's [`SegmentCache`], so a conversation's earlier turns are not
//! encoded again) off the request path and compares its ids with the echo, exactly; every
//! result is counted by request shape, and a mismatch is logged with where the two first
//! differ. In shadow nothing a client gets depends on it. With `local_ids = "on"` a shape that
//! matched `local_ids_verify_after` times in a row is trusted: its requests' prefills go
//! token-in with these ids (`LocalIds::token_in`), but for a recheck share; a mismatch ends
//! the trust until the shape has matched that many times again.
//!
//! A checked follow-up chat turn that matched also has its history drift measured
//! (`drift`): the conversation before it rendered again as it stood when its last assistant
//! turn was generated, compared with the echo (one more render and encode per such check, its
//! shared segments cache hits). Every count goes to the local-ids family (`metrics`).

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use self::metrics::LocalMetrics;
use crate::config::LocalIdsMode;
use crate::metrics::LocalIdsResult;
use crate::openai::{Api, PromptIds};
use crate::parity::Tokenizer;
use crate::render::{self, ChatTemplate, Mistral, Shape};
use crate::tokens::{SegmentCache, Segmenter};

pub mod drift;
pub mod metrics;

pub use drift::Drift;

/// Bytes of segment ids (and their texts) kept per pool: a 45k-token conversation holds about
/// 380 KB, so this keeps a few hundred conversations' turns.
pub const SEGMENT_CACHE_BYTES: usize = 128 * 1024 * 1024;

/// A segment not asked for this long is dropped: agentic turns come seconds to minutes apart.
pub const SEGMENT_IDLE: Duration = Duration::from_secs(600);

/// Verifier threads: a 37k-token render and encode takes tens of ms of one core, and the
/// engines' own CPUs are not tokenonce's to take.
pub const WORKERS: usize = 1;

/// Requests waiting for the verifier; more are dropped (counted), the request never waits.
pub const QUEUE: usize = 16;

/// The request shapes local ids are counted and trusted by.
pub const SHAPES: [&str; 6] = ["completions", "chat", "chat_system", "chat_multi_turn", "chat_tools", "chat_continue"];

/// What one shape has shown: matches in a row, and whether that earned trust.
#[derive(Debug, Default)]
struct ShapeTrust {
    streak: AtomicU32,
    trusted: AtomicBool,
}

/// How a pool uses local ids (`local_ids`, `local_ids_verify_after`, `local_ids_recheck`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Shadow or on.
    pub mode: LocalIdsMode,
    /// Matches in a row that make a shape trusted.
    pub verify_after: u32,
    /// Share of a trusted shape's requests still checked.
    pub recheck: f64,
}

/// One pool's local rendering: its chat template and tokenizer, or Mistral's renderer.
pub struct LocalIds {
    /// The pool's name (the metric label).
    pub pool: String,
    renderer: Renderer,
    /// Segment hits and misses already counted in the metrics (they are read when scraped).
    counted: [AtomicU64; 2],
    /// Its policy.
    pub policy: Policy,
    /// Per shape of [`SHAPES`].
    trust: [ShapeTrust; 6],
    /// Recheck share in 1/2^32 steps; an accumulator crossing a 2^32 boundary rechecks.
    recheck_step: u64,
    recheck_acc: AtomicU64,
}

/// How a pool's requests become ids.
enum Renderer {
    /// A chat template rendered to text, then the pool's tokenizer.
    Template {
        template: Arc<ChatTemplate>,
        tokenizer: Arc<Tokenizer>,
        /// The tokenizer with where it may be cut (chat prompts).
        segmenter: Box<Segmenter>,
        cache: SegmentCache,
    },
    /// vLLM's Mistral tokenizer mode: ids straight from the request.
    Mistral(Arc<Mistral>),
}

/// A request rendered, not yet tokenized (or, for Mistral and Harmony, already ids).
pub struct Rendered {
    prompt: Prompt,
    /// Its shape label (one of [`SHAPES`]).
    pub shape: &'static str,
}

/// What a request rendered to.
enum Prompt {
    /// Text for the tokenizer, with or without its special tokens.
    Text { text: String, add_special_tokens: bool },
    /// The ids themselves.
    Ids(Vec<u32>),
}

/// A request's ids as tokenonce renders them, with its shape and whether they may send its
/// prefill token-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRender {
    /// The prompt's ids.
    pub ids: Vec<u32>,
    /// Its shape label (one of [`SHAPES`]).
    pub shape: &'static str,
    /// True when the shape is trusted and this request is not of the recheck share.
    pub token_in: bool,
}

/// What the comparison found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The same ids, in the same order.
    Match,
    /// The ids differ; the first index where they do (the shorter length when one is a prefix
    /// of the other).
    Mismatch {
        /// First differing index.
        at: usize,
        /// Local ids, echoed ids.
        lengths: (usize, usize),
    },
    /// The request is not one tokenonce renders faithfully (its reason label).
    Unsupported(&'static str),
}

impl LocalIds {
    /// The pool `pool`'s renderer from its loaded template and tokenizer.
    ///
    /// # Errors
    /// When the tokenizer cannot be inspected for its cut points.
    pub fn new(
        pool: &str,
        template: Arc<ChatTemplate>,
        tokenizer: Arc<Tokenizer>,
        policy: Policy,
    ) -> Result<Self, String> {
        let library = tokenizer.library().ok_or("a chat template needs a Hugging Face tokenizer")?;
        let segmenter = Segmenter::new(library.clone(), tokenizer.path().to_path_buf()).map_err(|e| e.to_string())?;
        let cache = SegmentCache::new(SEGMENT_CACHE_BYTES, SEGMENT_IDLE);
        Ok(Self::with_renderer(
            pool,
            Renderer::Template { template, tokenizer, segmenter: Box::new(segmenter), cache },
            policy,
        ))
    }

    /// The pool `pool`'s renderer for vLLM's Mistral tokenizer mode.
    pub fn mistral(pool: &str, mistral: Arc<Mistral>, policy: Policy) -> Self {
        Self::with_renderer(pool, Renderer::Mistral(mistral), policy)
    }

    fn with_renderer(pool: &str, renderer: Renderer, policy: Policy) -> Self {
        #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "0 <= share * 2^32 <= 2^32")]
        let recheck_step = (policy.recheck.clamp(0.0, 1.0) * (1u64 << 32) as f64).ceil() as u64;
        Self {
            pool: pool.to_owned(),
            renderer,
            counted: Default::default(),
            policy,
            trust: Default::default(),
            recheck_step,
            recheck_acc: AtomicU64::new(0),
        }
    }

    /// True when `other` renders and tokenizes as this one (same template text, same
    /// tokenizer file contents) under the same policy: a reload keeps this one, its trust
    /// and its cache.
    pub fn same_as(&self, other: &Self) -> bool {
        self.policy == other.policy
            && match (&self.renderer, &other.renderer) {
                (
                    Renderer::Template { template, segmenter, .. },
                    Renderer::Template { template: other_template, segmenter: other_segmenter, .. },
                ) => segmenter.fingerprint() == other_segmenter.fingerprint() && template.same_as(other_template),
                (Renderer::Mistral(mistral), Renderer::Mistral(other)) => mistral.same_as(other),
                _ => false,
            }
    }

    /// `body` rendered on `api`, with its shape.
    ///
    /// # Errors
    /// The reason label when the request is not rendered here.
    pub fn render(&self, api: Api, body: &[u8]) -> Result<Rendered, &'static str> {
        let template = match (&self.renderer, api) {
            (_, Api::Responses | Api::Messages | Api::Generate) => return Err("api"),
            (Renderer::Mistral(mistral), Api::Chat) => {
                let (ids, shape) = mistral.render_chat(body).map_err(|e| e.label())?;
                return Ok(Rendered { prompt: Prompt::Ids(ids), shape: shape_label(&shape) });
            }
            (Renderer::Mistral(mistral), Api::Completions) => {
                let ids = mistral.render_completion(body).map_err(|e| e.label())?;
                return Ok(Rendered { prompt: Prompt::Ids(ids), shape: "completions" });
            }
            (Renderer::Template { template, .. }, _) => template,
        };
        // gpt-oss's chat is Harmony; its completions prompt, as every family's, is encoded
        // by the pool's tokenizer (below)
        if let (Some(harmony), Api::Chat) = (template.harmony(), api) {
            let chat = render::render_harmony(harmony, body).map_err(|e| e.label())?;
            return Ok(Rendered { prompt: Prompt::Ids(chat.ids), shape: shape_label(&chat.shape) });
        }
        if api == Api::Chat {
            let chat = render::render_chat(template, body).map_err(|e| e.label())?;
            let prompt = Prompt::Text { text: chat.text, add_special_tokens: false };
            Ok(Rendered { prompt, shape: shape_label(&chat.shape) })
        } else {
            let completion = render::render_completion(body).map_err(|e| e.label())?;
            let prompt = Prompt::Text { text: completion.text, add_special_tokens: completion.add_special_tokens };
            Ok(Rendered { prompt, shape: "completions" })
        }
    }

    /// The ids of a rendered request (chat segment by segment through the cache).
    ///
    /// # Errors
    /// `encode` when the tokenizer fails.
    pub fn encode(&self, rendered: &Rendered) -> Result<Vec<u32>, &'static str> {
        match (&rendered.prompt, &self.renderer) {
            (Prompt::Ids(ids), _) => Ok(ids.clone()),
            (Prompt::Text { text, add_special_tokens: true }, Renderer::Template { tokenizer, .. }) => {
                let library = tokenizer.library().ok_or("encode")?;
                render::encode(library, text, true).map_err(|_| "encode")
            }
            (Prompt::Text { text, .. }, Renderer::Template { segmenter, cache, .. }) => {
                cache.encode(segmenter, text).map_err(|_| "encode")
            }
            (Prompt::Text { .. }, Renderer::Mistral(_)) => Err("encode"),
        }
    }

    /// With `local_ids = "on"`: the ids of `body` when its shape is trusted and this request
    /// is not one of the recheck share (`None`: send it as text with the echo).
    pub fn token_in(&self, api: Api, body: &[u8]) -> Option<(Vec<u32>, &'static str)> {
        if !self.any_trusted() {
            return None;
        }
        self.for_request(api, body).filter(|r| r.token_in).map(|r| (r.ids, r.shape))
    }

    /// The ids of `body` whatever its shape's trust (a cache-aware pick steers by them: a
    /// wrong id costs a cache miss, never a wrong answer), and whether they may also send its
    /// prefill token-in (`local_ids = "on"`, the shape trusted, not one of the recheck share).
    /// `None` when the request does not render here or has no ids.
    pub fn for_request(&self, api: Api, body: &[u8]) -> Option<LocalRender> {
        let rendered = self.render(api, body).ok()?;
        let token_in = self.policy.mode == LocalIdsMode::On && self.trusted(rendered.shape) && !self.recheck_now();
        // No ids: vLLM takes no empty token prompt (`prompt: []`) as it takes the text, so it
        // goes as text and the engine answers in its own words. (An empty prompt never gets
        // here: `render_completion` refuses it, as vLLM does before tokenizing.)
        let ids = self.encode(&rendered).ok().filter(|ids| !ids.is_empty())?;
        Some(LocalRender { ids, shape: rendered.shape, token_in })
    }

    /// True when its ids are checked against the prefill's echo (`local_ids` shadow or on; a
    /// renderer loaded only to steer a cache-aware pool checks nothing).
    pub fn checks(&self) -> bool {
        self.policy.mode != LocalIdsMode::Off
    }

    /// Whether this request of a trusted shape is one of the recheck share.
    fn recheck_now(&self) -> bool {
        let old = self.recheck_acc.fetch_add(self.recheck_step, Ordering::Relaxed);
        (old.wrapping_add(self.recheck_step) >> 32) != (old >> 32)
    }

    /// With `local_ids = "on"`, whether any shape is trusted yet (until then no request is
    /// rendered on the request path).
    pub fn any_trusted(&self) -> bool {
        self.policy.mode == LocalIdsMode::On && self.trust.iter().any(|t| t.trusted.load(Ordering::Relaxed))
    }

    fn shape_trust(&self, shape: &str) -> Option<&ShapeTrust> {
        SHAPES.iter().position(|s| *s == shape).and_then(|i| self.trust.get(i))
    }

    /// Whether `shape` is trusted now.
    pub fn trusted(&self, shape: &str) -> bool {
        self.shape_trust(shape).is_some_and(|t| t.trusted.load(Ordering::Relaxed))
    }

    /// Takes a check's verdict into the shape's trust: a match extends its streak (trusted at
    /// `verify_after`), a mismatch ends both. Returns `Some(true)` when the shape became
    /// trusted, `Some(false)` when it lost trust, `None` otherwise.
    pub fn record(&self, shape: &str, verdict: &Verdict) -> Option<bool> {
        let trust = self.shape_trust(shape)?;
        match verdict {
            Verdict::Match => {
                let streak = trust.streak.fetch_add(1, Ordering::Relaxed).saturating_add(1);
                (streak >= self.policy.verify_after && !trust.trusted.swap(true, Ordering::Relaxed)).then_some(true)
            }
            Verdict::Mismatch { .. } => {
                trust.streak.store(0, Ordering::Relaxed);
                trust.trusted.swap(false, Ordering::Relaxed).then_some(false)
            }
            Verdict::Unsupported(_) => None,
        }
    }

    /// Counts the segment cache's hits and misses since the last call, and sets its size
    /// (at a scrape).
    pub fn report(&self, metrics: &LocalMetrics) {
        if let Renderer::Template { cache, .. } = &self.renderer {
            let stats = cache.stats();
            let [hits, misses] = &self.counted;
            let new_hits = stats.hits.saturating_sub(hits.swap(stats.hits, Ordering::Relaxed));
            let new_misses = stats.misses.saturating_sub(misses.swap(stats.misses, Ordering::Relaxed));
            metrics.segment_cache(&self.pool, new_hits, new_misses, stats.bytes);
        }
        for shape in SHAPES {
            metrics.trusted(&self.pool, shape, self.trusted(shape));
        }
        metrics.prompt_history_seen(&self.pool);
    }

    /// The ids tokenonce computes for `body` on `api`, and the request's shape label.
    ///
    /// # Errors
    /// The reason label when the request is not rendered here.
    pub fn ids(&self, api: Api, body: &[u8]) -> Result<(Vec<u32>, &'static str), &'static str> {
        let rendered = self.render(api, body)?;
        Ok((self.encode(&rendered)?, rendered.shape))
    }

    /// How a chat follow-up's prompt ids (`now`) leave the conversation before it as it stood
    /// when its last assistant turn was generated ([`drift::previous_turn`], rendered and
    /// encoded here); `None` when `body` has no such turn or it does not render.
    pub fn history_drift(&self, body: &[u8], now: &[u32]) -> Option<Drift> {
        let then = drift::previous_turn(body)?;
        let (ids, _) = self.ids(Api::Chat, &then).ok()?;
        Some(Drift::between(&ids, now))
    }

    /// Compares what tokenonce computes for `body` (or computed already: `rendered`) with
    /// the ids the prefill `echoed`.
    pub fn verify(
        &self,
        api: Api,
        body: &[u8],
        rendered: Option<(Vec<u32>, &'static str)>,
        echoed: &[u32],
    ) -> (&'static str, Verdict) {
        match rendered.map_or_else(|| self.ids(api, body), Ok) {
            Err(reason) => ("unsupported", Verdict::Unsupported(reason)),
            Ok((ids, shape)) if ids == echoed => (shape, Verdict::Match),
            Ok((ids, shape)) => {
                let at = ids.iter().zip(echoed).position(|(a, b)| a != b).unwrap_or(ids.len().min(echoed.len()));
                (shape, Verdict::Mismatch { at, lengths: (ids.len(), echoed.len()) })
            }
        }
    }
}

/// The shape label of a chat request: the most telling feature it has.
fn shape_label(shape: &Shape) -> &'static str {
    if shape.tools || shape.tool_calls || shape.tool_results {
        "chat_tools"
    } else if shape.continue_final {
        "chat_continue"
    } else if shape.multi_turn {
        "chat_multi_turn"
    } else if shape.system {
        "chat_system"
    } else {
        "chat"
    }
}

/// A request to verify.
pub struct Sample {
    /// The pool's renderer.
    pub local: Arc<LocalIds>,
    /// For the mismatch log line.
    pub request_id: String,
    /// Chat or completions.
    pub api: Api,
    /// The client's body (shared bytes).
    pub body: Bytes,
    /// The ids the prefill echoed.
    pub echoed: PromptIds,
    /// The ids and shape tokenonce rendered for the request already (to steer its picks):
    /// compared as they are, not rendered again.
    pub rendered: Option<(Vec<u32>, &'static str)>,
}

/// The verifier threads; dropping the last handle ends them once the queue is drained.
pub struct Verifier {
    tx: SyncSender<Sample>,
    metrics: LocalMetrics,
}

impl Verifier {
    /// Starts `workers` threads behind a queue of `queue` samples, counting in `metrics`.
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn start(workers: usize, queue: usize, metrics: &LocalMetrics) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Sample>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..workers.max(1) {
            let (rx, metrics) = (Arc::clone(&rx), metrics.clone());
            std::thread::Builder::new().name(format!("tokenonce-local-{i}")).spawn(move || work(&rx, &metrics))?;
        }
        Ok(Self { tx, metrics: metrics.clone() })
    }

    /// Queues `sample` without waiting; a full queue drops it (counted as `dropped`).
    pub fn submit(&self, sample: Sample) {
        if let Err(TrySendError::Full(sample) | TrySendError::Disconnected(sample)) = self.tx.try_send(sample) {
            self.metrics.check(&sample.local.pool, "none", LocalIdsResult::Dropped);
        }
    }
}

/// A worker: verifies samples until every sender is gone.
fn work(rx: &Mutex<Receiver<Sample>>, metrics: &LocalMetrics) {
    loop {
        // The guard is a temporary: the lock is released before the sample is worked on.
        let Ok(sample) = rx.lock().recv() else { return };
        let echoed = sample.echoed.to_vec();
        let (shape, verdict) = sample.local.verify(sample.api, &sample.body, sample.rendered, &echoed);
        let pool = &sample.local.pool;
        // The echo is tokenonce's own ids here, so the history is compared with what the
        // engine got.
        if verdict == Verdict::Match && sample.api == Api::Chat {
            if let Some(drift) = sample.local.history_drift(&sample.body, &echoed) {
                metrics.prompt_history(pool, drift.at, drift.changed);
                if drift.changed > 0 {
                    tracing::debug!(request_id = %sample.request_id, pool = %pool, at = drift.at, changed = drift.changed,
                        "a follow-up turn renders its history otherwise than it was generated");
                }
            }
        }
        match sample.local.record(shape, &verdict) {
            Some(true) => {
                tracing::info!(pool = %pool, shape, "local ids trusted for the shape: it matched its echo enough times in a row")
            }
            Some(false) => {
                tracing::warn!(pool = %pool, shape, "local ids no longer trusted for the shape: a check differed")
            }
            None => {}
        }
        match verdict {
            Verdict::Match => metrics.check(pool, shape, LocalIdsResult::Match),
            Verdict::Unsupported(reason) => {
                metrics.check(pool, shape, LocalIdsResult::Unsupported);
                metrics.unsupported(pool, reason);
            }
            Verdict::Mismatch { at, lengths } => {
                metrics.check(pool, shape, LocalIdsResult::Mismatch);
                tracing::warn!(request_id = %sample.request_id, pool = %pool, shape, at, local = lengths.0, echoed = lengths.1,
                    "local ids differ from the prefill's echo");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool renderer over a ChatML template and a word tokenizer.
    fn local() -> Arc<LocalIds> {
        let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let template = ChatTemplate::from_source(template, &[], crate::render::LoadOptions::default()).unwrap();
        let tokenizer = crate::parity::testing::word_tokenizer(&["user", "word"], &["<|im_start|>", "<|im_end|>"]);
        let policy = Policy { mode: LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
        Arc::new(LocalIds::new("p", Arc::new(template), Arc::new(tokenizer), policy).unwrap())
    }

    /// A Mistral pool's renderer gives the request's ids straight (no tokenizer pass), by
    /// shape; a completions prompt is tekken's ids after `<s>` (none when the request turns
    /// special tokens off), an empty one refused as vLLM does; a reload of the same tekken
    /// file keeps it.
    #[test]
    fn a_mistral_pool_renders_chat_and_completions_to_ids() {
        let (dir, mistral) = crate::render::mistral_testing::folder();
        let policy = Policy { mode: LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
        let local = LocalIds::mistral("m", Arc::new(mistral), policy);
        let body = br#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u"}]}"#;
        let (ids, shape) = local.ids(Api::Chat, body).unwrap();
        assert_eq!(shape, "chat_system");
        let Renderer::Mistral(renderer) = &local.renderer else { panic!("not Mistral's renderer") };
        assert_eq!(renderer.tekken().decode_lossy(&ids), "<s>[INST]S\n\nu[/INST]");
        assert_eq!(local.verify(Api::Chat, body, None, &ids).1, Verdict::Match);
        let (ids, shape) = local.ids(Api::Completions, br#"{"prompt":"u[INST]"}"#).unwrap();
        assert_eq!((renderer.tekken().decode_lossy(&ids).as_str(), shape), ("<s>u[INST]", "completions"));
        assert_ne!(ids.last(), renderer.tekken().special("[INST]").as_ref(), "special-token text is text");
        let (ids, _) = local.ids(Api::Completions, br#"{"prompt":"u","add_special_tokens":false}"#).unwrap();
        assert_eq!(renderer.tekken().decode_lossy(&ids), "u");
        assert_eq!(local.ids(Api::Completions, br#"{"prompt":""}"#).err(), Some("vllm_rejects"));
        let reloaded = LocalIds::mistral("m", Arc::new(crate::render::Mistral::load(dir.path()).unwrap()), policy);
        assert!(local.same_as(&reloaded));
    }

    /// A verifier whose one worker is busy drops what its queue cannot hold, counted as
    /// `dropped`; the request never waits (each submit returns at once).
    #[test]
    fn a_busy_verifier_drops_checks_and_counts_them() {
        let registry = prometheus::Registry::new();
        let metrics = LocalMetrics::register(&registry).unwrap();
        let verifier = Verifier::start(1, 1, &metrics).unwrap();
        // Each check renders and encodes ~200k words: far slower than 50 submits.
        let body = Bytes::from(format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
            "word ".repeat(200_000)
        ));
        let local = local();
        for i in 0..50 {
            verifier.submit(Sample {
                local: Arc::clone(&local),
                request_id: format!("r{i}"),
                api: Api::Chat,
                body: body.clone(),
                echoed: PromptIds::from_ids(&[1, 2]),
                rendered: None,
            });
        }
        let text = String::from_utf8(crate::metrics::render(&registry)).unwrap();
        let dropped = text
            .lines()
            .find(|l| l.starts_with("tokenonce_local_ids_checks_total{") && l.contains("result=\"dropped\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(dropped >= 40.0, "{dropped} of 50 dropped:\n{text}");
    }
}
