//! What the engines' prefix caches hold: vLLM's block hashes computed from a request's ids
//! (`hash`) and extra keys (`extra_keys`: its LoRA adapter's path, its salt), and the sources
//! that say which endpoint holds which blocks.
//!
//! A source answers one question for endpoint choice: how many leading blocks of a request's
//! chain an endpoint holds. The exact source is the engines' own KV events; the approximate
//! one is where tokenonce itself sent each prefix (`sent`). Both sit below `upstream/`, which
//! asks them when it picks an endpoint. The events' metric family: `metrics`.
//!
//! The events source: `events` (`PoolKvEvents`, the subscribers) over `state` (the pool's
//! index and hash check, a batch applied), `sequence` (gaps), `replay` (replays asked and
//! applied), `settings` (ports, addresses), `wire` (frames), `index` and `check`.

pub mod check;
pub mod events;
pub mod extra_keys;
pub mod hash;
pub mod index;
pub mod metrics;
pub mod replay;
pub mod sent;
pub mod sequence;
pub mod settings;
mod state;
pub mod wire;

pub use extra_keys::{LoraPaths, RequestKeys};
pub use hash::{BlockHash, BlockHasher, ExtraKeys};
pub use sent::SentPrefixes;

/// Which endpoint holds which blocks, as one source knows it.
pub trait PrefixHolders: Send + Sync {
    /// How many leading blocks of `chain` the endpoint named `endpoint` (a pool endpoint's
    /// name: `host:port`, or `host:port#R` for one data-parallel rank) holds; 0 when none or
    /// unknown.
    fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize;

    /// A request whose prompt has `chain` was just sent to `endpoint`: the approximate source
    /// remembers it; the events source expects the engine to report these blocks stored and
    /// checks the hashes it then reports against them.
    fn sent(&self, endpoint: &str, chain: &[BlockHash]) {
        let _ = (endpoint, chain);
    }

    /// The endpoint named `endpoint` lost what its cache held (it went down, and an engine
    /// that comes back restarted starts empty): it holds nothing here until it is sent prompts
    /// or reports blocks again.
    fn forget(&self, endpoint: &str) {
        let _ = endpoint;
    }

    /// False while this source must not be believed (events stale, or cache-aware choice
    /// turned off after a hash mismatch): choice then falls to the next source.
    fn usable(&self) -> bool {
        true
    }
}
