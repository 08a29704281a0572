//! The exact source of which endpoint holds which block: one ZeroMQ subscriber per endpoint of a
//! pool (per data-parallel rank) to its engine's KV events, kept current through gaps, engine
//! restarts and reconnects, feeding the pool's `PoolState` (its index and hash check, `state.rs`).
//!
//! Decisions, and why:
//!
//! - **ZeroMQ client**: the `zeromq` crate (pure Rust on tokio, SUB and DEALER, maintained under
//!   the zeromq organisation): no C library in the build or the image, and a subscriber is a
//!   tokio task rather than a thread per endpoint. Where each endpoint's engine publishes and
//!   answers replays: `settings.rs`.
//! - **Continuity**: the reconnect loop is ours (not the crate's), so every connection starts
//!   the same way: the endpoint's entries are cleared and its engine's replay buffer is asked
//!   from sequence 0 (vLLM keeps its last `buffer_steps` batches, 10,000 by default). That
//!   covers first contact with a running engine, a reconnect after missed batches and an
//!   engine restart (whose sequence restarts at 0) alike, without guessing which it was. On a
//!   live connection a jump in the sequence is a gap: replay from the first missing; a replay
//!   that cannot fill it (no replay port, no answer, or its buffer no longer reaches back)
//!   clears the endpoint, since a lost `BlockRemoved` would otherwise leave blocks the engine
//!   no longer holds. `AllBlocksCleared` clears the endpoint too. The sequence bookkeeping:
//!   `sequence.rs`; the replays: `replay.rs`; staleness and the index bound: `state.rs`.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use zeromq::{Socket as _, SocketEvent, SocketRecv as _};

use super::metrics::PoolKvMetrics;
use super::replay::{resync, ReplayRetry, Resync, CONNECT_TIMEOUT};
use super::sequence::{Replay, Sequencer, Step};
use super::state::PoolState;
use super::wire;
use super::{BlockHash, PrefixHolders};

pub use super::settings::{EndpointAddr, Settings};

/// First wait before connecting again; doubled per failure up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between connection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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
    state: Arc<PoolState>,
    tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    runtime: tokio::runtime::Handle,
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
        let state = Arc::new(PoolState::new(pool, settings, metrics));
        let events = Arc::new(PoolKvEvents { state, tasks: Mutex::new(HashMap::new()), runtime: runtime.clone() });
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
        self.state.remove_endpoint(name);
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
                tracing::warn!(pool = %self.state.pool, endpoint = %name, error = %e, "kv events: a new member cannot be subscribed to");
            }
        }
    }

    /// Where the pool's engines loaded their LoRA adapters from (the pool's
    /// [`LoraPaths`](super::LoraPaths)): the hash check hashes LoRA blocks with them.
    pub fn use_lora_paths(&self, paths: Arc<super::LoraPaths>) {
        self.state.use_lora_paths(paths);
    }

    /// Sizes the pool's index for engines that say they hold `engine_blocks` KV-cache blocks
    /// between them (a configured `max_blocks` stays); logs a change.
    pub fn size_for(&self, engine_blocks: u64) {
        if let Some(bound) = self.state.size_for(engine_blocks) {
            tracing::info!(pool = %self.state.pool, engine_blocks, max_blocks = bound,
                "kv events index sized from what the engines hold");
        }
    }

    /// The index bound now.
    pub fn max_blocks(&self) -> usize {
        self.state.max_blocks()
    }

    /// Whether a hash mismatch turned this pool's cache-aware choice off.
    pub fn disabled(&self) -> bool {
        self.state.disabled()
    }

    /// Whether the endpoint named `name` is connected now.
    pub fn connected(&self, name: &str) -> bool {
        self.state.connected(name)
    }

    /// The pool's settings.
    pub fn settings(&self) -> &Settings {
        &self.state.settings
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
        let slot = self.state.add_endpoint(&addr.name);
        let state = Arc::clone(&self.state);
        let name = addr.name.clone();
        tasks.insert(name, self.runtime.spawn(subscribe(state, slot, addr)));
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
        self.state.held(endpoint, chain)
    }

    fn sent(&self, _endpoint: &str, chain: &[BlockHash]) {
        self.state.expect(chain);
    }

    fn forget(&self, endpoint: &str) {
        if let Some(slot) = self.state.slot(endpoint) {
            self.state.clear(slot);
        }
    }

    fn usable(&self) -> bool {
        self.state.usable()
    }
}

/// One endpoint's subscriber, for as long as the task lives: connect, replay, follow.
async fn subscribe(state: Arc<PoolState>, slot: usize, addr: EndpointAddr) {
    let (url, replay_url) = addr.urls(&state.settings);
    let mut backoff = BACKOFF_MIN;
    let mut connected_before = false;
    loop {
        let mut options = zeromq::SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut socket = zeromq::SubSocket::with_options(options);
        let mut monitor = socket.monitor();
        let connected = match socket.subscribe(&state.settings.topic).await {
            Ok(()) => socket.connect(&url).await,
            Err(e) => Err(e),
        };
        if let Err(e) = connected {
            tracing::debug!(pool = %state.pool, endpoint = %addr.name, error = %e, "kv events: cannot connect");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            continue;
        }
        backoff = BACKOFF_MIN;
        if connected_before {
            state.metrics.reconnects.inc();
        }
        connected_before = true;
        state.set_connected(slot, true);
        tracing::info!(pool = %state.pool, endpoint = %addr.name, "kv events: connected to {url}");

        let mut sequencer = Sequencer::default();
        state.clear(slot);
        let mut retry = ReplayRetry::default();
        retry.after(Some(resync(&state, slot, replay_url.as_deref(), Replay::Start, &mut sequencer).await));
        loop {
            tokio::select! {
                message = socket.recv() => match message {
                    Ok(message) => {
                        let frames = message.into_vec();
                        retry.after(follow(&state, slot, &addr, replay_url.as_deref(), &mut sequencer, &frames).await);
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
                    tracing::info!(pool = %state.pool, endpoint = %addr.name, "kv events: asking the failed replay again");
                    retry.after(Some(resync(&state, slot, replay_url.as_deref(), Replay::Start, &mut sequencer).await));
                }
            }
        }
        state.set_connected(slot, false);
        tracing::warn!(pool = %state.pool, endpoint = %addr.name, "kv events: connection lost; connecting again");
        drop(socket);
    }
}

/// One live message; `Failed` when it showed a gap whose replay brought nothing. A gap's
/// replay that answered says nothing of an earlier failed replay from the start (it covers
/// only the gap), so it never ends those retries.
async fn follow(
    state: &PoolState,
    slot: usize,
    addr: &EndpointAddr,
    replay_url: Option<&str>,
    sequencer: &mut Sequencer,
    frames: &[bytes::Bytes],
) -> Option<Resync> {
    let (seq, batch) = match wire::decode_message(frames) {
        Ok(decoded) => decoded,
        Err(e) => {
            tracing::warn!(pool = %state.pool, endpoint = %addr.name, error = %e, "kv events: a message skipped");
            return None;
        }
    };
    match sequencer.live(seq) {
        Step::Apply => state.apply(slot, &batch),
        Step::Skip => {}
        Step::Gap { from } => {
            state.metrics.gaps.inc();
            tracing::info!(pool = %state.pool, endpoint = %addr.name, from, to = seq, "kv events: gap; replaying");
            let outcome = resync(state, slot, replay_url, Replay::Gap { from }, sequencer).await;
            if sequencer.live(seq) == Step::Apply {
                state.apply(slot, &batch);
            }
            return (outcome == Resync::Failed).then_some(outcome);
        }
    }
    None
}
