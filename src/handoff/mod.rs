//! Relay-mode handoff state: the bounded, expiring id cache (`cache`) and the keys that
//! correlate a prefill with its decode (`key`). Pure data structures; no I/O.

pub mod cache;
pub mod key;

pub use cache::{Evicted, IdCache, Lookup};
pub use key::{prompt_fingerprint, CacheKey};
