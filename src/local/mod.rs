//! Local ids, in shadow: for a request whose prefill echoed its prompt ids, tokenonce renders
//! and tokenizes the request itself (`render`, then the pool's tokenizer, chat prompts segment
//! by segment through the pool's [`SegmentCache`], so a conversation's earlier turns are not
//! encoded again) off the request path and compares its ids with the echo, exactly; every
//! result is counted by request shape, and a mismatch is logged with where the two first
//! differ. Nothing a client gets depends on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::metrics::{LocalIdsResult, Metrics};
use crate::openai::{Api, PromptIds};
use crate::parity::Tokenizer;
use crate::render::{self, ChatTemplate, Shape};
use crate::tokens::{SegmentCache, Segmenter};

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

/// One pool's local rendering: its chat template and tokenizer.
pub struct LocalIds {
    /// The pool's name (the metric label).
    pub pool: String,
    template: Arc<ChatTemplate>,
    tokenizer: Arc<Tokenizer>,
    /// The tokenizer with where it may be cut (chat prompts).
    segmenter: Segmenter,
    cache: SegmentCache,
    /// Segment hits and misses already counted in the metrics (they are read when scraped).
    counted: [AtomicU64; 2],
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
    pub fn new(pool: &str, template: Arc<ChatTemplate>, tokenizer: Arc<Tokenizer>) -> Result<Self, String> {
        let segmenter =
            Segmenter::new(tokenizer.library().clone(), tokenizer.path().to_path_buf()).map_err(|e| e.to_string())?;
        let cache = SegmentCache::new(SEGMENT_CACHE_BYTES, SEGMENT_IDLE);
        Ok(Self { pool: pool.to_owned(), template, tokenizer, segmenter, cache, counted: Default::default() })
    }

    /// Counts the segment cache's hits and misses since the last call, and sets its size
    /// (at a scrape).
    pub fn report(&self, metrics: &Metrics) {
        let stats = self.cache.stats();
        let [hits, misses] = &self.counted;
        let new_hits = stats.hits.saturating_sub(hits.swap(stats.hits, Ordering::Relaxed));
        let new_misses = stats.misses.saturating_sub(misses.swap(stats.misses, Ordering::Relaxed));
        metrics.segment_cache(&self.pool, new_hits, new_misses, stats.bytes);
    }

    /// The ids tokenonce computes for `body` on `api`, and the request's shape label.
    ///
    /// # Errors
    /// The reason label when the request is not rendered here.
    pub fn ids(&self, api: Api, body: &[u8]) -> Result<(Vec<u32>, &'static str), &'static str> {
        match api {
            Api::Chat => {
                let chat = render::render_chat(&self.template, body).map_err(|e| e.label())?;
                let ids = self.cache.encode(&self.segmenter, &chat.text).map_err(|_| "encode")?;
                Ok((ids, shape_label(&chat.shape)))
            }
            Api::Completions => {
                let prompt = render::render_completion(body).map_err(|e| e.label())?;
                let ids = render::encode(self.tokenizer.library(), &prompt.text, prompt.add_special_tokens)
                    .map_err(|_| "encode")?;
                Ok((ids, "completions"))
            }
            Api::Responses | Api::Messages => Err("api"),
        }
    }

    /// Compares what tokenonce computes for `body` with the ids the prefill `echoed`.
    pub fn verify(&self, api: Api, body: &[u8], echoed: &[u32]) -> (&'static str, Verdict) {
        match self.ids(api, body) {
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
}

/// The verifier threads; dropping the last handle ends them once the queue is drained.
pub struct Verifier {
    tx: SyncSender<Sample>,
    metrics: Metrics,
}

impl Verifier {
    /// Starts `workers` threads behind a queue of `queue` samples, counting in `metrics`.
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn start(workers: usize, queue: usize, metrics: &Metrics) -> std::io::Result<Self> {
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
        let pool = sample.local.pool.clone();
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(sample) {
            self.metrics.local_ids(&pool, "none", LocalIdsResult::Dropped);
        }
    }
}

/// A worker: verifies samples until every sender is gone.
fn work(rx: &Mutex<Receiver<Sample>>, metrics: &Metrics) {
    loop {
        let next = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(sample) = next else { return };
        let (shape, verdict) = sample.local.verify(sample.api, &sample.body, &sample.echoed.to_vec());
        let pool = &sample.local.pool;
        match verdict {
            Verdict::Match => metrics.local_ids(pool, shape, LocalIdsResult::Match),
            Verdict::Unsupported(reason) => {
                metrics.local_ids(pool, shape, LocalIdsResult::Unsupported);
                metrics.local_ids_unsupported(pool, reason);
            }
            Verdict::Mismatch { at, lengths } => {
                metrics.local_ids(pool, shape, LocalIdsResult::Mismatch);
                tracing::warn!(request_id = %sample.request_id, pool = %pool, shape, at, local = lengths.0, echoed = lengths.1,
                    "local ids differ from the prefill's echo");
            }
        }
    }
}
