//! The exact source of which endpoint holds which block: one ZeroMQ subscriber per endpoint of a
//! pool (per data-parallel rank) to its engine's KV events, kept current through gaps, engine
//! restarts and reconnects, feeding one bounded [`BlockIndex`] per pool and the [`HashCheck`].
//!
//! Decisions, and why:
//!
//! - **ZeroMQ client**: the `zeromq` crate (pure Rust on tokio, SUB and DEALER, maintained under
//!   the zeromq organisation): no C library in the build or the image, and a subscriber is a
//!   tokio task rather than a thread per endpoint. vLLM binds (`tcp://*:PORT`) and each
//!   subscriber connects to `host:port+R` (rank R), the replay DEALER to `host:replay_port+R`;
//!   an endpoint sharing its host with another has ports of its own (`endpoint_ports`).
//! - **Continuity**: the reconnect loop is ours (not the crate's), so every connection starts
//!   the same way: the endpoint's entries are cleared and its engine's replay buffer is asked
//!   from sequence 0 (vLLM keeps its last `buffer_steps` batches, 10,000 by default). That
//!   covers first contact with a running engine, a reconnect after missed batches and an
//!   engine restart (whose sequence restarts at 0) alike, without guessing which it was. On a
//!   live connection a jump in the sequence is a gap: replay from the first missing; a replay
//!   that cannot fill it (no replay port, no answer, or its buffer no longer reaches back)
//!   clears the endpoint, since a lost `BlockRemoved` would otherwise leave blocks the engine
//!   no longer holds. `AllBlocksCleared` clears the endpoint too.
//! - **Staleness**: vLLM publishes only when its cache changes, so silence from a connected
//!   engine means nothing changed; what makes an endpoint's entries stale is the connection:
//!   an endpoint not connected for `stale_after` answers 0 to `held` (usually an engine down,
//!   which health checks eject as well). The pool's source is `usable` while one endpoint is
//!   fresh and no hash mismatch turned it off: a mismatch keeps it off until the pool's source
//!   is built again (a reload that changes `kv_events`, or a restart).
//! - **Index bound**: `max_blocks` (endpoint, block) entries per pool, oldest stored evicted
//!   first (see `index.rs`). Only the device (GPU) cache of the first KV cache group is indexed:
//!   blocks offloaded to CPU or storage are not what prefix caching reuses on arrival.

use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt as _;
use zeromq::{Socket as _, SocketEvent, SocketRecv as _, SocketSend as _};

use super::check::{Drift, HashCheck};
use super::index::BlockIndex;
use super::metrics::PoolKvMetrics;
use super::wire::{self, Event, EventBatch, WireError};
use super::{BlockHash, BlockHasher, PrefixHolders};

/// First wait before connecting again; doubled per failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between connection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long one connection attempt (TCP and ZMTP handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a replay answer may stay silent: before its first batch, between two, before its
/// end marker.
const REPLAY_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a whole replay answer may take: an engine's full buffer (10,000 batches of a
/// request's blocks, their token ids included) read by a busy process takes tens of seconds.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(300);
/// First wait before a failed replay is asked again; doubled per failure up to
/// [`REPLAY_RETRY_MAX`].
const REPLAY_RETRY_MIN: Duration = Duration::from_secs(1);
/// Longest wait between two asks of a replay that keeps failing.
const REPLAY_RETRY_MAX: Duration = Duration::from_secs(60);
/// Most batches one replay answer is read for (vLLM keeps 10,000 by default).
const REPLAY_MAX_BATCHES: usize = 1_000_000;
/// Digests the hash check remembers per `max_blocks` entry of the index (parents of later
/// blocks: the chains sent recently and the blocks verified).
const CHECK_DIGESTS_PER_BLOCK: usize = 1;

/// One pool's `kv_events` settings, as the config gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The publisher's port on each endpoint's host (rank R: `port + R`).
    pub port: u16,
    /// The replay endpoint's port (rank R: `replay_port + R`); none: gaps are not replayed.
    pub replay_port: Option<u16>,
    /// By endpoint address (`host:port`): a publisher port other than `port` (engines
    /// sharing a host bind ports of their own).
    pub endpoint_ports: BTreeMap<String, u16>,
    /// By endpoint address: a replay port other than `replay_port`.
    pub endpoint_replay_ports: BTreeMap<String, u16>,
    /// The topic subscribed to (vLLM's `topic`; empty: every message).
    pub topic: String,
    /// The engines' `PYTHONHASHSEED`, or vLLM's default seed when they run without it.
    pub hash_seed: String,
    /// The engines' `--block-size`.
    pub block_size: usize,
    /// Most (endpoint, block) entries the pool's index holds.
    pub max_blocks: usize,
    /// How long an endpoint may stay disconnected before its entries are not believed.
    pub stale_after: Duration,
}

/// A pool endpoint to subscribe to: its name (`host:port` or `host:port#R`), host and rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddr {
    pub name: String,
    /// Its `host:port`, without the rank.
    pub addr: String,
    pub host: String,
    pub rank: u16,
}

impl EndpointAddr {
    /// From a pool endpoint's name; none when it is not `host:port` or `host:port#R`.
    pub fn parse(name: &str) -> Option<Self> {
        let (addr, ranks) = crate::addr::endpoint_ranks(name)?;
        let rank = match ranks.as_slice() {
            [None] => 0,
            [Some(r)] => u16::try_from(*r).ok()?,
            _ => return None,
        };
        Some(EndpointAddr {
            name: name.to_owned(),
            addr: addr.to_owned(),
            host: crate::addr::host_of(addr).to_owned(),
            rank,
        })
    }

    /// Its publisher's and replay endpoint's URLs under `settings` (its own ports where they
    /// name its address), each offset by its rank.
    fn urls(&self, settings: &Settings) -> (String, Option<String>) {
        let port = settings.endpoint_ports.get(&self.addr).copied().unwrap_or(settings.port);
        let replay = settings.endpoint_replay_ports.get(&self.addr).copied().or(settings.replay_port);
        (self.url(port), replay.map(|p| self.url(p)))
    }

    fn url(&self, port: u16) -> String {
        let port = u32::from(port) + u32::from(self.rank);
        if self.host.contains(':') {
            format!("tcp://[{}]:{port}", self.host)
        } else {
            format!("tcp://{}:{port}", self.host)
        }
    }
}

/// Why a pool's subscribers could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// An endpoint name is not `host:port` or `host:port#R`.
    #[error("kv events: endpoint {0:?} is not host:port or host:port#R")]
    Endpoint(String),
}

/// One pool's KV events: its subscribers, index and hash check. Implements [`PrefixHolders`];
/// the subscribers stop when it is dropped.
pub struct PoolKvEvents {
    shared: Arc<Shared>,
    tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    runtime: tokio::runtime::Handle,
}

struct Shared {
    pool: String,
    settings: Settings,
    metrics: PoolKvMetrics,
    state: RwLock<State>,
    check: Mutex<HashCheck>,
    disabled: AtomicBool,
}

struct State {
    index: BlockIndex,
    /// Endpoint name → its slot in the index and its connection.
    endpoints: HashMap<String, Endpoint>,
}

struct Endpoint {
    slot: usize,
    connected: bool,
    /// When `connected` last changed (or the endpoint was added).
    since: Instant,
    removed: bool,
}

impl Endpoint {
    fn stale(&self, after: Duration) -> bool {
        self.removed || (!self.connected && self.since.elapsed() >= after)
    }
}

impl PoolKvEvents {
    /// Starts one subscriber per endpoint of pool `pool` on `runtime`.
    ///
    /// # Errors
    /// When an endpoint name cannot be subscribed to.
    pub fn start(
        pool: &str,
        endpoints: &[String],
        settings: Settings,
        metrics: PoolKvMetrics,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Arc<Self>, StartError> {
        let addrs = endpoints
            .iter()
            .map(|name| EndpointAddr::parse(name).ok_or_else(|| StartError::Endpoint(name.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        let hasher = BlockHasher::new(&settings.hash_seed, settings.block_size);
        let digests = settings.max_blocks.saturating_mul(CHECK_DIGESTS_PER_BLOCK);
        for gauge in &metrics.disabled {
            gauge.set(0);
        }
        let shared = Arc::new(Shared {
            pool: pool.to_owned(),
            state: RwLock::new(State { index: BlockIndex::new(0, settings.max_blocks), endpoints: HashMap::new() }),
            check: Mutex::new(HashCheck::new(hasher, digests)),
            disabled: AtomicBool::new(false),
            settings,
            metrics,
        });
        let events = Arc::new(PoolKvEvents { shared, tasks: Mutex::new(HashMap::new()), runtime: runtime.clone() });
        for addr in addrs {
            events.add(addr);
        }
        Ok(events)
    }

    /// Subscribes to one more endpoint (pool membership grew). Adding a name already
    /// subscribed to does nothing.
    pub fn add_endpoint(&self, name: &str) -> Result<(), StartError> {
        let addr = EndpointAddr::parse(name).ok_or_else(|| StartError::Endpoint(name.to_owned()))?;
        self.add(addr);
        Ok(())
    }

    /// Stops subscribing to an endpoint and forgets what it held.
    pub fn remove_endpoint(&self, name: &str) {
        if let Some(task) = self.tasks.lock().remove(name) {
            task.abort();
        }
        let mut state = self.shared.state.write();
        if let Some(slot) = state.endpoints.get_mut(name).map(|e| {
            e.removed = true;
            e.slot
        }) {
            state.index.clear(slot);
            self.shared.metrics.blocks.set(gauge_value(state.index.len()));
        }
    }

    /// Follows the pool's membership (a discovered pool's set changed): subscribes to members
    /// not subscribed to yet and stops those no longer members (what they held is forgotten).
    pub fn follow(&self, members: &[String]) {
        let gone: Vec<String> = self.tasks.lock().keys().filter(|n| !members.contains(n)).cloned().collect();
        for name in &gone {
            self.remove_endpoint(name);
        }
        for name in members.iter().filter(|n| !self.subscribed(n)) {
            if let Err(e) = self.add_endpoint(name) {
                tracing::warn!(pool = %self.shared.pool, endpoint = %name, error = %e, "kv events: a new member cannot be subscribed to");
            }
        }
    }

    /// Whether a hash mismatch turned this pool's cache-aware choice off.
    pub fn disabled(&self) -> bool {
        self.shared.disabled.load(Ordering::Relaxed)
    }

    /// Whether the endpoint named `name` is connected now.
    pub fn connected(&self, name: &str) -> bool {
        self.shared.state.read().endpoints.get(name).is_some_and(|e| e.connected && !e.removed)
    }

    /// The pool's settings.
    pub fn settings(&self) -> &Settings {
        &self.shared.settings
    }

    /// Whether the endpoint named `name` is subscribed to.
    pub fn subscribed(&self, name: &str) -> bool {
        self.tasks.lock().contains_key(name)
    }

    /// How many endpoints are subscribed to.
    pub fn len(&self) -> usize {
        self.tasks.lock().len()
    }

    /// True when no endpoint is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn add(&self, addr: EndpointAddr) {
        let mut tasks = self.tasks.lock();
        if tasks.contains_key(&addr.name) {
            return;
        }
        let slot = {
            let mut state = self.shared.state.write();
            let slot = match state.endpoints.get(&addr.name) {
                Some(known) => known.slot,
                None => state.index.add_slot(),
            };
            let endpoint = Endpoint { slot, connected: false, since: Instant::now(), removed: false };
            state.endpoints.insert(addr.name.clone(), endpoint);
            slot
        };
        let shared = Arc::clone(&self.shared);
        let name = addr.name.clone();
        tasks.insert(name, self.runtime.spawn(subscribe(shared, slot, addr)));
    }
}

impl Drop for PoolKvEvents {
    fn drop(&mut self) {
        for (_, task) in self.tasks.lock().drain() {
            task.abort();
        }
    }
}

impl PrefixHolders for PoolKvEvents {
    fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
        let state = self.shared.state.read();
        match state.endpoints.get(endpoint) {
            Some(e) if !e.stale(self.shared.settings.stale_after) => state.index.held(e.slot, chain),
            _ => 0,
        }
    }

    fn sent(&self, _endpoint: &str, chain: &[BlockHash]) {
        self.shared.check.lock().expect(chain);
    }

    fn forget(&self, endpoint: &str) {
        let slot = self.shared.state.read().endpoints.get(endpoint).map(|e| e.slot);
        if let Some(slot) = slot {
            self.shared.clear(slot);
        }
    }

    fn usable(&self) -> bool {
        let after = self.shared.settings.stale_after;
        !self.disabled() && self.shared.state.read().endpoints.values().any(|e| !e.stale(after))
    }
}

impl Shared {
    fn set_connected(&self, slot: usize, connected: bool) {
        let mut state = self.state.write();
        if let Some(e) = state.endpoints.values_mut().find(|e| e.slot == slot) {
            e.connected = connected;
            e.since = Instant::now();
        }
    }

    fn clear(&self, slot: usize) {
        let mut state = self.state.write();
        state.index.clear(slot);
        self.metrics.blocks.set(gauge_value(state.index.len()));
    }

    /// One batch from the endpoint in `slot`, in sequence order.
    fn apply(&self, slot: usize, batch: &EventBatch) {
        let mut drifts = Vec::new();
        {
            let mut state = self.state.write();
            for event in &batch.events {
                match event {
                    Event::BlockStored(stored) => {
                        if wire::in_device_cache(stored.medium.as_deref(), stored.group_idx) {
                            let evicted = state.index.store(slot, stored.block_hashes.iter().map(|h| h.0));
                            self.metrics.evicted.inc_by(evicted as u64);
                        }
                        let outcome = self.check.lock().check(stored);
                        self.metrics.checks_matched.inc_by(outcome.matched);
                        self.metrics.checks_mismatched.inc_by(outcome.mismatched);
                        drifts.extend(outcome.drift);
                    }
                    Event::BlockRemoved(removed) => {
                        if wire::in_device_cache(removed.medium.as_deref(), removed.group_idx) {
                            state.index.remove(slot, removed.block_hashes.iter().map(|h| h.0));
                        }
                    }
                    Event::AllBlocksCleared => state.index.clear(slot),
                    Event::Other => {}
                }
            }
            self.metrics.blocks.set(gauge_value(state.index.len()));
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.metrics.lag.set((now - batch.ts).max(0.0));
        for drift in drifts {
            self.turn_off(drift);
        }
    }

    /// A hash mismatch: cache-aware choice off for the pool, said once.
    fn turn_off(&self, drift: Drift) {
        let position = Drift::LABELS.iter().position(|l| *l == drift.label());
        if let Some(gauge) = position.and_then(|i| self.metrics.disabled.get(i)) {
            gauge.set(1);
        }
        if !self.disabled.swap(true, Ordering::Relaxed) {
            tracing::error!(pool = %self.pool, reason = drift.label(), "cache-aware choice off for the pool: the KV events' block hashes are not tokenonce's: {drift}");
        }
    }
}

/// What a sequence number means for an endpoint's continuity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next one (or the first since continuity was lost): apply it.
    Apply,
    /// Already applied (a replay covered it): skip it.
    Skip,
    /// Batches from `from` on were missed: replay them first.
    Gap { from: u64 },
}

/// An endpoint's position in its publisher's sequence.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sequencer {
    next: Option<u64>,
}

impl Sequencer {
    /// The step for a live message with sequence `seq` (moves past it unless a gap). A
    /// sequence below the next expected is a batch the connection's replay already brought,
    /// never a restart: a restarted engine is a new connection, which starts over anyway
    /// (a sequence back to 0 on the same connection cannot be told from such a duplicate).
    pub fn live(&mut self, seq: u64) -> Step {
        match self.next {
            Some(next) if seq > next => return Step::Gap { from: next },
            Some(next) if seq < next => return Step::Skip,
            _ => {}
        }
        self.next = Some(seq.saturating_add(1));
        Step::Apply
    }

    /// The next sequence expected, if continuity holds.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Continuity from `next` on.
    pub fn resume_at(&mut self, next: Option<u64>) {
        self.next = next;
    }
}

/// One endpoint's subscriber, for as long as the task lives: connect, replay, follow.
async fn subscribe(shared: Arc<Shared>, slot: usize, addr: EndpointAddr) {
    let (url, replay_url) = addr.urls(&shared.settings);
    let mut backoff = BACKOFF_MIN;
    let mut connected_before = false;
    loop {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut socket = zeromq::SubSocket::with_options(options);
        let mut monitor = socket.monitor();
        let connected = match socket.subscribe(&shared.settings.topic).await {
            Ok(()) => socket.connect(&url).await,
            Err(e) => Err(e),
        };
        if let Err(e) = connected {
            tracing::debug!(pool = %shared.pool, endpoint = %addr.name, error = %e, "kv events: cannot connect");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            continue;
        }
        backoff = BACKOFF_MIN;
        if connected_before {
            shared.metrics.reconnects.inc();
        }
        connected_before = true;
        shared.set_connected(slot, true);
        tracing::info!(pool = %shared.pool, endpoint = %addr.name, "kv events: connected to {url}");

        let mut sequencer = Sequencer::default();
        shared.clear(slot);
        let mut retry = ReplayRetry::default();
        retry.after(Some(resync(&shared, slot, replay_url.as_deref(), Replay::Start, &mut sequencer).await));
        loop {
            tokio::select! {
                message = socket.recv() => match message {
                    Ok(message) => {
                        let frames = message.into_vec();
                        retry.after(follow(&shared, slot, &addr, replay_url.as_deref(), &mut sequencer, &frames).await);
                    }
                    Err(_) => break,
                },
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => break,
                    Some(_) => {}
                },
                // A replay that brought nothing left the endpoint with only what came live
                // since: what the engine held before (a shared system prompt's blocks, never
                // stored again) is asked again, the whole buffer applied in order over it.
                () = retry.due() => {
                    tracing::info!(pool = %shared.pool, endpoint = %addr.name, "kv events: asking the failed replay again");
                    retry.after(Some(resync(&shared, slot, replay_url.as_deref(), Replay::Start, &mut sequencer).await));
                }
            }
        }
        shared.set_connected(slot, false);
        tracing::warn!(pool = %shared.pool, endpoint = %addr.name, "kv events: connection lost; connecting again");
        drop(socket);
    }
}

/// How a replay went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resync {
    /// Nothing to replay, or it answered (whether or not its buffer reached back).
    Done,
    /// It brought no answer (unreachable, silent, cut): worth asking again.
    Failed,
}

/// When a failed replay is asked again: after a wait doubling per failure.
#[derive(Default)]
struct ReplayRetry {
    /// When, and the wait after the next failure.
    next: Option<(tokio::time::Instant, Duration)>,
}

impl ReplayRetry {
    /// Notes how a replay went: a failure schedules (or backs off) the next ask, an answer
    /// from the start ends the retries; none (a live message) changes nothing.
    fn after(&mut self, outcome: Option<Resync>) {
        match outcome {
            Some(Resync::Done) => self.next = None,
            Some(Resync::Failed) => {
                let wait = self.next.map_or(REPLAY_RETRY_MIN, |(_, wait)| wait);
                self.next = Some((tokio::time::Instant::now() + wait, (wait * 2).min(REPLAY_RETRY_MAX)));
            }
            None => {}
        }
    }

    /// Resolves when the next ask is due; never when none is scheduled.
    async fn due(&self) {
        match self.next {
            Some((at, _)) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }
}

/// One live message; `Failed` when it showed a gap whose replay brought nothing. A gap's
/// replay that answered says nothing of an earlier failed replay from the start (it covers
/// only the gap), so it never ends those retries.
async fn follow(
    shared: &Shared,
    slot: usize,
    addr: &EndpointAddr,
    replay_url: Option<&str>,
    sequencer: &mut Sequencer,
    frames: &[bytes::Bytes],
) -> Option<Resync> {
    let (seq, batch) = match wire::decode_message(frames) {
        Ok(decoded) => decoded,
        Err(e) => {
            tracing::warn!(pool = %shared.pool, endpoint = %addr.name, error = %e, "kv events: a message skipped");
            return None;
        }
    };
    match sequencer.live(seq) {
        Step::Apply => shared.apply(slot, &batch),
        Step::Skip => {}
        Step::Gap { from } => {
            shared.metrics.gaps.inc();
            tracing::info!(pool = %shared.pool, endpoint = %addr.name, from, to = seq, "kv events: gap; replaying");
            let outcome = resync(shared, slot, replay_url, Replay::Gap { from }, sequencer).await;
            if sequencer.live(seq) == Step::Apply {
                shared.apply(slot, &batch);
            }
            return (outcome == Resync::Failed).then_some(outcome);
        }
    }
    None
}

/// What a replay is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replay {
    /// The whole buffer: a first contact, or one whose replay failed, asked again.
    Start,
    /// The batches from `from` on, missed on the live connection.
    Gap { from: u64 },
}

/// Replays and applies what continues the sequence. After a gap, when the replay cannot bring
/// the endpoint to continuity (no replay port, no answer, the buffer no longer reaching back
/// to `from`), clears the endpoint and starts over from the next live message. From the start
/// the whole buffer is applied in order over what the endpoint holds, which ends it in the
/// engine's state; a failure there leaves the endpoint and its continuity as they were.
async fn resync(
    shared: &Shared,
    slot: usize,
    replay_url: Option<&str>,
    ask: Replay,
    sequencer: &mut Sequencer,
) -> Resync {
    let from = match ask {
        Replay::Start => 0,
        Replay::Gap { from } => from,
    };
    let (replayed, outcome) = match replay_url {
        Some(url) => {
            shared.metrics.replays.inc();
            match replay(url, from).await {
                Ok(batches) => (Some(batches), Resync::Done),
                Err(e) => {
                    shared.metrics.replays_failed.inc();
                    tracing::warn!(pool = %shared.pool, error = %e, "kv events: replay failed; asking again later");
                    (None, Resync::Failed)
                }
            }
        }
        None => (None, Resync::Done),
    };
    let Some(batches) = replayed else {
        if matches!(ask, Replay::Gap { .. }) {
            shared.clear(slot);
            sequencer.resume_at(None);
        }
        return outcome;
    };
    // From the start whatever is buffered is a start, and an empty buffer means nothing was
    // published yet: the next live batch must be 0 (one published before this subscription
    // reached the publisher then shows as a gap).
    let fills = from == 0 || batches.first().is_some_and(|(seq, _)| *seq <= from);
    if !fills {
        shared.clear(slot);
    }
    let mut next = fills.then_some(from);
    for (seq, batch) in &batches {
        if next.is_none_or(|n| *seq >= n) {
            shared.apply(slot, batch);
            next = Some(seq.saturating_add(1));
        }
    }
    sequencer.resume_at(next);
    Resync::Done
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay endpoint: {0}")]
    Socket(#[from] zeromq::ZmqError),
    #[error("replay: silent for {0:?}")]
    Silent(Duration),
    #[error("replay: no end marker within {0:?}")]
    Timeout(Duration),
    #[error("replay: more than {0} batches")]
    TooLong(usize),
    #[error("replay: {0}")]
    Wire(#[from] WireError),
}

/// Asks vLLM's replay endpoint (a ROUTER) for every buffered batch from `from`: the request is
/// `["", seq]`; each answer `["", topic, seq, payload]`; the last has sequence -1.
pub async fn replay(url: &str, from: u64) -> Result<Vec<(u64, EventBatch)>, ReplayError> {
    let work = async {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut dealer = zeromq::DealerSocket::with_options(options);
        dealer.connect(url).await?;
        let mut request = zeromq::ZmqMessage::from(bytes::Bytes::new());
        request.push_back(bytes::Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer.send(request).await?;
        let mut batches = Vec::new();
        while batches.len() <= REPLAY_MAX_BATCHES {
            let frames = tokio::time::timeout(REPLAY_IDLE_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| ReplayError::Silent(REPLAY_IDLE_TIMEOUT))??
                .into_vec();
            let frames = frames.get(1..).unwrap_or_default();
            if frames.get(1).is_some_and(|seq| wire::sequence(seq).ok() == Some(wire::REPLAY_END)) {
                return Ok(batches);
            }
            batches.push(wire::decode_message(frames)?);
        }
        Err(ReplayError::TooLong(REPLAY_MAX_BATCHES))
    };
    tokio::time::timeout(REPLAY_TIMEOUT, work).await.unwrap_or(Err(ReplayError::Timeout(REPLAY_TIMEOUT)))
}

fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequencer_applies_in_order_and_sees_gaps_and_duplicates() {
        let mut s = Sequencer::default();
        assert_eq!(s.live(5), Step::Apply, "the first after connecting");
        assert_eq!(s.live(6), Step::Apply);
        assert_eq!(s.live(9), Step::Gap { from: 7 });
        assert_eq!(s.next(), Some(7), "a gap does not move past it");
        s.resume_at(Some(9));
        assert_eq!(s.live(8), Step::Skip);
        assert_eq!(s.live(9), Step::Apply);
        assert_eq!(s.live(0), Step::Skip, "a replayed batch arriving live too");
        s.resume_at(None);
        assert_eq!(s.live(0), Step::Apply, "continuity lost: any sequence starts it again");
    }

    #[test]
    fn endpoint_addresses_offset_the_port_by_rank() {
        let plain = EndpointAddr::parse("10.0.0.1:8000");
        assert_eq!(plain.as_ref().map(|a| a.url(5557)), Some("tcp://10.0.0.1:5557".to_owned()));
        let ranked = EndpointAddr::parse("[::1]:8000#3");
        assert_eq!(ranked.as_ref().map(|a| a.url(5557)), Some("tcp://[::1]:5560".to_owned()));
        assert_eq!(EndpointAddr::parse("host:8000#0-3"), None, "one rank per endpoint");
        assert_eq!(EndpointAddr::parse("nope"), None);
    }

    /// Engines sharing a host publish on ports of their own: an endpoint named in
    /// `endpoint_ports` / `endpoint_replay_ports` is subscribed there (rank offset kept), the
    /// others on the pool's ports.
    #[test]
    fn an_endpoint_with_ports_of_its_own_is_subscribed_there() {
        let settings = Settings {
            port: 5557,
            replay_port: Some(5558),
            endpoint_ports: BTreeMap::from([("127.0.0.1:8300".to_owned(), 5567)]),
            endpoint_replay_ports: BTreeMap::from([("127.0.0.1:8300".to_owned(), 5568)]),
            topic: String::new(),
            hash_seed: "0".into(),
            block_size: 32,
            max_blocks: 10,
            stale_after: Duration::from_secs(1),
        };
        let urls = |name: &str| EndpointAddr::parse(name).map(|a| a.urls(&settings));
        let url = |s: &str| s.to_owned();
        assert_eq!(urls("127.0.0.1:8100"), Some((url("tcp://127.0.0.1:5557"), Some(url("tcp://127.0.0.1:5558")))));
        assert_eq!(urls("127.0.0.1:8300"), Some((url("tcp://127.0.0.1:5567"), Some(url("tcp://127.0.0.1:5568")))));
        assert_eq!(urls("127.0.0.1:8300#2"), Some((url("tcp://127.0.0.1:5569"), Some(url("tcp://127.0.0.1:5570")))));
    }
}
