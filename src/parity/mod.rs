//! Proof that relayed ids belong to their request: a pool's tokenizer (`tokenizer.rs`) bounds
//! the vocabulary on the hot path, and a sampled parity watch (`watch.rs`) decodes ids off
//! the request path and checks them against the request's contents (`check.rs`), counted in its
//! metric family (`metrics.rs`).

pub mod check;
pub mod metrics;
mod tokenizer;
mod watch;

#[cfg(test)]
pub(crate) use tokenizer::testing;
pub use tokenizer::{Tokenizer, TOKENIZER_FILE};
pub use watch::{ParityHold, RouteParity, Sample, Watch, QUEUE, WORKERS};
