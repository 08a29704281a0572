//! A fake engine's prefix cache as vLLM keeps one: full blocks named by vLLM's chain hashes
//! (`tokenonce::kv::hash`, `sha256_cbor`), least recently used evicted past a capacity in
//! blocks, what it stores and evicts published as vLLM's KV events (real ZeroMQ: a PUB socket,
//! vLLM's three frames and msgpack batches, a ROUTER replay endpoint), and a prefill's time
//! taken from the tokens it did not hold, one prefill at a time; a decode's pull of a remote
//! prefill's KV stores its blocks with no compute time.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokenonce::kv::hash::{BlockHasher, ExtraKeys};
use tokio::sync::mpsc;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _};

/// How a [`KvEngine`] hashes, holds and times.
#[derive(Clone, Debug)]
pub struct KvEngineConfig {
    /// The engines' `PYTHONHASHSEED`.
    pub seed: String,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks held at most (the KV cache's size).
    pub capacity_blocks: usize,
    /// Prefill time per token not found cached.
    pub per_uncached_token: Duration,
    /// Prefill time of any request (scheduling, the last token's forward pass).
    pub per_request: Duration,
}

impl KvEngineConfig {
    /// An engine with seed `"0"`, blocks of `block_size` tokens, room for `capacity_blocks`,
    /// that prefills in no time (tests of what is cached and published, not of timing).
    pub fn instant(block_size: usize, capacity_blocks: usize) -> Self {
        Self {
            seed: "0".into(),
            block_size,
            capacity_blocks,
            per_uncached_token: Duration::ZERO,
            per_request: Duration::ZERO,
        }
    }
}

/// A prefix cache, its event publisher and its prefill clock.
pub struct KvEngine {
    config: KvEngineConfig,
    hasher: BlockHasher,
    cache: Mutex<Lru>,
    /// One prefill computes at a time; the rest wait their turn (FIFO).
    compute: tokio::sync::Mutex<()>,
    events: Option<mpsc::UnboundedSender<Vec<Ev>>>,
    /// Replay requests to leave unanswered (a busy engine, a buffer too long to read in time).
    unanswered_replays: Arc<AtomicUsize>,
    /// Batches the publisher has sent (and buffered for replays).
    published: Arc<AtomicU64>,
    /// Prompt tokens prefilled, and how many of them were found cached.
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Prefills asked of it (begun or not).
    pub requests: AtomicU64,
    /// Nanoseconds prefills waited their turn, over every prefill (its queue, apart from compute).
    pub queued_ns: AtomicU64,
    /// Remote prefills pulled ([`KvEngine::pull`]), and the prompt tokens they brought that
    /// were not held.
    pub pulls: AtomicU64,
    pub pulled_tokens: AtomicU64,
    /// Prefills waiting their turn, and the one computing (0 or 1): its `/metrics` queue.
    waiting: AtomicU64,
    running: AtomicU64,
    /// Blocks of the prefill computing now (what vLLM counts in use, unlike cached free ones).
    blocks_in_use: AtomicU64,
}

impl std::fmt::Debug for KvEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEngine").field("config", &self.config).finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Lru {
    /// Wire hash → its last use.
    used: HashMap<u64, u64>,
    /// Last use → wire hash (oldest first).
    order: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(old) = self.used.insert(hash, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, hash);
    }

    fn evict_oldest(&mut self) -> Option<u64> {
        let (_, hash) = self.order.pop_first()?;
        self.used.remove(&hash);
        Some(hash)
    }
}

/// One event as vLLM 0.32's msgspec encodes it (a map tagged by `type`).
#[derive(Serialize, Debug)]
#[serde(tag = "type")]
enum Ev {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        extra_keys: Vec<Option<Vec<String>>>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
}

/// `KVEventBatch`: `[timestamp, events, data_parallel_rank]`.
#[derive(Serialize)]
struct Batch<'a>(f64, &'a [Ev], Option<i64>);

/// Batches kept for the replay endpoint (vLLM's `buffer_steps` default).
const REPLAY_BUFFER: usize = 10_000;

impl KvEngine {
    /// A cache that publishes nothing.
    pub fn new(config: KvEngineConfig) -> Arc<Self> {
        Arc::new(Self::build(config, None))
    }

    /// A cache publishing its events on `tcp://{host}:{port}` (PUB, bound here as vLLM binds
    /// `tcp://*:PORT`) with its replay endpoint on `replay_port`, topic `topic`. Port 0 picks
    /// one; the bound ports are returned.
    pub async fn publishing(
        config: KvEngineConfig,
        host: &str,
        port: u16,
        replay_port: u16,
        topic: &str,
    ) -> (Arc<Self>, u16, u16) {
        let mut publisher = zeromq::PubSocket::new();
        let bound = publisher.bind(&format!("tcp://{host}:{port}")).await.unwrap();
        let mut replay = zeromq::RouterSocket::new();
        let replay_bound = replay.bind(&format!("tcp://{host}:{replay_port}")).await.unwrap();
        let port_of = |e: &zeromq::Endpoint| match e {
            zeromq::Endpoint::Tcp(_, p) => *p,
            _ => unreachable!("bound on tcp"),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let engine = Self::build(config, Some(tx));
        let counters = (Arc::clone(&engine.unanswered_replays), Arc::clone(&engine.published));
        tokio::spawn(publish(publisher, replay, rx, Bytes::copy_from_slice(topic.as_bytes()), counters));
        (Arc::new(engine), port_of(&bound), port_of(&replay_bound))
    }

    /// Batches published so far: a prefill's events leave on the publisher's task, so a test
    /// that needs them gone before a subscriber connects waits for this count.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::SeqCst)
    }

    /// The next `n` replay requests get no answer.
    pub fn leave_replays_unanswered(&self, n: usize) {
        self.unanswered_replays.store(n, Ordering::SeqCst);
    }

    fn build(config: KvEngineConfig, events: Option<mpsc::UnboundedSender<Vec<Ev>>>) -> Self {
        KvEngine {
            hasher: BlockHasher::new(&config.seed, config.block_size),
            config,
            cache: Mutex::new(Lru::default()),
            compute: tokio::sync::Mutex::new(()),
            events,
            unanswered_replays: Arc::new(AtomicUsize::new(0)),
            published: Arc::new(AtomicU64::new(0)),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            queued_ns: AtomicU64::new(0),
            pulls: AtomicU64::new(0),
            pulled_tokens: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            blocks_in_use: AtomicU64::new(0),
        }
    }

    /// Its `/metrics` page now, as vLLM 0.32 writes the series tokenonce reads: requests
    /// waiting and running, KV-cache use (the computing prefill's blocks over the capacity:
    /// cached blocks no request uses are free to vLLM) and its cache config.
    pub fn metrics_page(&self) -> String {
        let labels = "engine=\"0\",model_name=\"tiny-qwen3\"";
        let usage = self.blocks_in_use.load(Ordering::Relaxed) as f64 / self.config.capacity_blocks.max(1) as f64;
        format!(
            "vllm:num_requests_running{{{labels}}} {}\nvllm:num_requests_waiting{{{labels}}} {}\n\
             vllm:kv_cache_usage_perc{{{labels}}} {}\n\
             vllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0\n",
            self.running.load(Ordering::Relaxed),
            self.waiting.load(Ordering::Relaxed),
            usage.min(1.0),
            self.config.block_size,
            self.config.capacity_blocks
        )
    }

    /// Prefills `ids`: waits its turn, counts the leading blocks held, computes the rest (its
    /// time), stores its new blocks and evicts past the capacity, publishing both. Returns the
    /// cached token count.
    pub async fn prefill(&self, ids: &[u32]) -> usize {
        let chain = self.hasher.chain(ids, &ExtraKeys::default());
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let asked = tokio::time::Instant::now();
        let _turn = self.compute.lock().await;
        let queued = u64::try_from(asked.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.queued_ns.fetch_add(queued, Ordering::Relaxed);
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.running.store(1, Ordering::Relaxed);
        self.blocks_in_use.store(chain.len() as u64, Ordering::Relaxed);
        let held = {
            let cache = self.cache.lock();
            chain.iter().take_while(|h| cache.used.contains_key(&h.wire())).count()
        };
        let cached = held * self.config.block_size;
        let uncached = ids.len().saturating_sub(cached) as u32;
        tokio::time::sleep(self.config.per_request + self.config.per_uncached_token * uncached).await;
        self.running.store(0, Ordering::Relaxed);
        self.blocks_in_use.store(0, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        self.store(ids, &chain);
        cached
    }

    /// Pulls a remote prefill's KV of `ids`, as a NIXL decode does: no compute and no turn to
    /// wait (the transfer's time is the caller's), the blocks it did not hold stored and
    /// published, evicting past the capacity. Counted apart from prefills. Returns the cached
    /// token count.
    pub fn pull(&self, ids: &[u32]) -> usize {
        let chain = self.hasher.chain(ids, &ExtraKeys::default());
        let held = {
            let cache = self.cache.lock();
            chain.iter().take_while(|h| cache.used.contains_key(&h.wire())).count()
        };
        let cached = (held * self.config.block_size).min(ids.len());
        self.pulls.fetch_add(1, Ordering::Relaxed);
        self.pulled_tokens.fetch_add((ids.len() - cached) as u64, Ordering::Relaxed);
        self.store(ids, &chain);
        cached
    }

    /// Stores the blocks of `ids` (its `chain`) not held, touches the rest, evicts past the
    /// capacity, and publishes both.
    fn store(&self, ids: &[u32], chain: &[tokenonce::kv::hash::BlockHash]) {
        // Runs of consecutive blocks this request stored (index of the first, hashes).
        let mut stored: Vec<(usize, Vec<u64>)> = Vec::new();
        let mut removed = Vec::new();
        {
            let mut cache = self.cache.lock();
            for (i, h) in chain.iter().enumerate() {
                let wire = h.wire();
                if !cache.used.contains_key(&wire) {
                    match stored.last_mut() {
                        Some((first, run)) if *first + run.len() == i => run.push(wire),
                        _ => stored.push((i, vec![wire])),
                    }
                }
            }
            // Last block first, as vLLM frees a request's blocks: a chain is evicted from its
            // tail, so what stays held is always a prefix.
            for h in chain.iter().rev() {
                cache.touch(h.wire());
            }
            while cache.used.len() > self.config.capacity_blocks {
                match cache.evict_oldest() {
                    Some(h) => removed.push(h),
                    None => break,
                }
            }
        }
        if let Some(tx) = &self.events {
            let mut batch = Vec::new();
            if !removed.is_empty() {
                batch.push(Ev::BlockRemoved { block_hashes: removed, medium: Some("GPU".into()) });
            }
            let bs = self.config.block_size;
            for (first, run) in stored {
                batch.push(Ev::BlockStored {
                    extra_keys: vec![None; run.len()],
                    parent_block_hash: first.checked_sub(1).map(|p| chain[p].wire()),
                    token_ids: ids[first * bs..(first + run.len()) * bs].to_vec(),
                    block_hashes: run,
                    block_size: bs,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                });
            }
            if !batch.is_empty() {
                let _ = tx.send(batch);
            }
        }
    }

    /// A restart: the cache emptied, with no event said (a restarted vLLM's new publisher
    /// starts afresh; its subscribers learn nothing of what the old one held).
    pub fn restart(&self) {
        *self.cache.lock() = Lru::default();
    }

    /// Prompt tokens found cached so far, over every prefill.
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens.load(Ordering::Relaxed)
    }

    /// Blocks held now.
    pub fn blocks(&self) -> usize {
        self.cache.lock().used.len()
    }
}

/// Numbers, publishes and buffers each batch; answers replay requests from the buffer.
async fn publish(
    mut publisher: zeromq::PubSocket,
    mut replay: zeromq::RouterSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<Ev>>,
    topic: Bytes,
    (unanswered, published): (Arc<AtomicUsize>, Arc<AtomicU64>),
) {
    let mut seq: u64 = 0;
    let mut buffer: std::collections::VecDeque<(u64, Bytes)> = std::collections::VecDeque::new();
    loop {
        tokio::select! {
            batch = rx.recv() => {
                let Some(batch) = batch else { return };
                let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
                let payload = Bytes::from(rmp_serde::to_vec_named(&Batch(ts, &batch, Some(0))).unwrap());
                let mut message = zeromq::ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                message.push_back(payload.clone());
                let _ = publisher.send(message).await;
                buffer.push_back((seq, payload));
                if buffer.len() > REPLAY_BUFFER {
                    buffer.pop_front();
                }
                seq += 1;
                published.store(seq, Ordering::SeqCst);
            }
            request = replay.recv() => {
                let Ok(request) = request else { continue };
                if unanswered.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                    continue;
                }
                let frames = request.into_vec();
                let (Some(identity), Some(start)) = (frames.first(), frames.get(2)) else { continue };
                let from = <[u8; 8]>::try_from(start.as_ref()).map_or(0, u64::from_be_bytes);
                for (s, payload) in buffer.iter().filter(|(s, _)| *s >= from) {
                    let parts = [identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&s.to_be_bytes()), payload.clone()];
                    let _ = replay.send(zeromq::ZmqMessage::try_from(parts.to_vec()).unwrap()).await;
                }
                let end = [identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&u64::MAX.to_be_bytes()), Bytes::new()];
                let _ = replay.send(zeromq::ZmqMessage::try_from(end.to_vec()).unwrap()).await;
            }
        }
    }
}
