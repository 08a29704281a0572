//! Relay-mode handoff state: the bounded, expiring id cache (`cache`) and the keys that
//! correlate a prefill with its decode (`key`). Pure data structures; no I/O. The cache's metric
//! family: `metrics`.

pub mod cache;
pub mod key;
pub mod metrics;

pub use cache::{Evicted, IdCache, Lookup};
pub use key::{prompt_fingerprint, CacheKey};
