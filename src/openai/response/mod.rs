//! Engine responses, one room per concern: what the prefill hands over (`handoff.rs`), the
//! rewrites of an answer on its way back (`rewrite.rs`: cached tokens, hidden ids), and the
//! framing of a relayed stream (`stream.rs`).

mod handoff;
mod rewrite;
mod stream;

pub use handoff::{extract_handoff, extract_handoff_shared, extract_handoff_within, Handoff, HandoffError, IdsFault};
pub use rewrite::{hide_token_ids, rewrite_cached_tokens, rewrite_usage_cached};
pub use stream::{carries_content, SseRewriter, StreamFraming};
