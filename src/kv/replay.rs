//! Replays: vLLM's replay endpoint asked for its buffered batches, what they continue applied
//! to the pool's state (or the endpoint cleared when they cannot), a failed ask asked again.

use std::time::Duration;

use zeromq::{Socket as _, SocketRecv as _, SocketSend as _};

use super::sequence::{Replay, Sequencer};
use super::state::PoolState;
use super::wire::{self, EventBatch, WireError};

/// How long one connection attempt (TCP and ZMTP handshake) to an engine's publisher or
/// replay endpoint may take.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
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

/// How a replay went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Resync {
    /// Nothing to replay, or it answered (whether or not its buffer reached back).
    Done,
    /// It brought no answer (unreachable, silent, cut): worth asking again.
    Failed,
}

/// When a failed replay is asked again: after a wait doubling per failure.
#[derive(Default)]
pub(super) struct ReplayRetry {
    /// When, and the wait after the next failure.
    next: Option<(tokio::time::Instant, Duration)>,
}

impl ReplayRetry {
    /// Notes how a replay went: a failure schedules (or backs off) the next ask, an answer
    /// from the start ends the retries; none (a live message) changes nothing.
    pub(super) fn after(&mut self, outcome: Option<Resync>) {
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
    pub(super) async fn due(&self) {
        match self.next {
            Some((at, _)) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }
}

/// Replays and applies what continues the sequence. After a gap, when the replay cannot bring
/// the endpoint to continuity (no replay port, no answer, the buffer no longer reaching back
/// to `from`), clears the endpoint and starts over from the next live message. From the start
/// the whole buffer is applied in order over what the endpoint holds, which ends it in the
/// engine's state; a failure there leaves the endpoint and its continuity as they were.
pub(super) async fn resync(
    state: &PoolState,
    slot: usize,
    replay_url: Option<&str>,
    ask: Replay,
    sequencer: &mut Sequencer,
) -> Resync {
    let from = ask.from();
    let (replayed, outcome) = match replay_url {
        Some(url) => {
            state.metrics.replays.inc();
            match replay(url, from).await {
                Ok(batches) => (Some(batches), Resync::Done),
                Err(e) => {
                    state.metrics.replays_failed.inc();
                    tracing::warn!(pool = %state.pool, error = %e, "kv events: replay failed; asking again later");
                    (None, Resync::Failed)
                }
            }
        }
        None => (None, Resync::Done),
    };
    let Some(batches) = replayed else {
        if matches!(ask, Replay::Gap { .. }) {
            state.clear(slot);
            sequencer.resume_at(None);
        }
        return outcome;
    };
    if !sequencer.replay_answered(from, batches.first().map(|(seq, _)| *seq)) {
        state.clear(slot);
    }
    for (seq, batch) in &batches {
        if sequencer.replayed(*seq) {
            state.apply(slot, batch);
        }
    }
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
