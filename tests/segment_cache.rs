//! Property test of the segment cache (`tokenonce::tokens`) with a byte-level BPE built in
//! memory (NFC, Qwen3's split, ChatML special tokens, a `normalized: true` token, `lstrip` and
//! `rstrip` tokens): for random conversations, ids with the cache equal the library's own
//! `encode(text, false)`. The same check with the real Qwen3 tokenizer is
//! `tests/segment_cache_qwen.rs` (run by the e2e tier).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod segments;

use std::sync::LazyLock;

use proptest::prelude::*;
use tokenonce::tokens::{Segmenter, Splitting};

static TOKENIZER: LazyLock<Segmenter> = LazyLock::new(segments::memory_tokenizer);

proptest! {
    #![proptest_config(segments::config(256))]

    /// Cold, warm, growing, evicting, expiring and shared caches give the library's ids.
    #[test]
    fn cached_ids_equal_uncached_ids(turns in segments::conversation()) {
        segments::check(&TOKENIZER, &turns)?;
    }
}

/// The in-memory tokenizer is cut (the property would prove nothing if it were encoded whole).
#[test]
fn the_memory_tokenizer_is_cut_at_its_raw_added_tokens() {
    assert_eq!(TOKENIZER.splitting(), &Splitting::AtAddedTokens(14));
}
