//! Tokenizing a rendered prompt one segment at a time, each segment once: `segment` cuts the
//! text where the tokenizer cuts it anyway (at added tokens) and encodes the pieces,
//! `cache` keeps each piece's ids by content across requests. Pure: no metrics, no I/O but
//! loading a tokenizer file; nothing here is on the request path yet.
//!
//! The contract: `SegmentCache::encode(segmenter, text)` returns exactly the ids of
//! `tokenizers` `encode(text, add_special_tokens = false)`, which are vLLM's ids for a
//! rendered chat prompt (`../shared/reference/vllm-rendering.md`, "Tokenizing is plain").

mod cache;
mod segment;

pub use cache::{CacheStats, SegmentCache, DEFAULT_SHARDS, ENTRY_OVERHEAD};
pub use segment::{Piece, Segmenter, Splitting, WholeReason};

/// Why a tokenizer could not be loaded or a text not encoded.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// The tokenizer file could not be read or parsed.
    #[error("cannot load tokenizer `{path}`: {reason}")]
    Load {
        /// The file tried.
        path: std::path::PathBuf,
        /// The library's complaint.
        reason: String,
    },
    /// The tokenizer could not be inspected (serialized) at load.
    #[error("cannot inspect tokenizer: {0}")]
    Inspect(String),
    /// The tokenizer refused to encode a text.
    #[error("cannot encode: {0}")]
    Encode(String),
}
