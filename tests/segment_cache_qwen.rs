//! The segment cache's property test with the real Qwen3 tokenizer (the e2e tier's model):
//! for random conversations, ids with the cache equal `encode(text, false)`. The tokenizer is
//! not in the repo, so this target is not run by `cargo test` (Cargo.toml: `test = false`);
//! tests/e2e/run.sh runs it after installing the model:
//! `TOKENONCE_QWEN_TOKENIZER=<model folder or tokenizer.json> cargo test --test segment_cache_qwen`.
//! It fails, never skips, when the variable is unset or names no tokenizer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod segments;

use std::path::PathBuf;
use std::sync::LazyLock;

use proptest::prelude::*;
use tokenonce::tokens::{Segmenter, Splitting};

/// Names the model folder (or its `tokenizer.json`).
const ENV: &str = "TOKENONCE_QWEN_TOKENIZER";

static TOKENIZER: LazyLock<Segmenter> = LazyLock::new(|| {
    let path = std::env::var_os(ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{ENV} is unset: name the Qwen3 model folder (tests/e2e/vllm/setup.sh installs it)"));
    Segmenter::load(&path).unwrap_or_else(|e| panic!("{ENV}={}: {e}", path.display()))
});

proptest! {
    #![proptest_config(segments::config(256))]

    /// Cold, warm, growing, evicting, expiring and shared caches give the library's ids.
    #[test]
    fn cached_ids_equal_uncached_ids_with_qwen3(turns in segments::conversation()) {
        segments::check(&TOKENIZER, &turns)?;
    }
}

/// Qwen3 is cut at all 26 of its added tokens (all `normalized: false`, no strip flags).
#[test]
fn qwen3_is_cut_at_its_26_added_tokens() {
    assert_eq!(TOKENIZER.splitting(), &Splitting::AtAddedTokens(26));
}

/// A long document pasted with no special token inside is one segment, encoded once.
#[test]
fn a_pasted_document_is_one_segment_encoded_once() {
    let cache = tokenonce::tokens::SegmentCache::new(64 << 20, std::time::Duration::from_secs(60));
    let doc = "Zürich, naïve café: the 30k-token document nobody reads twice. ".repeat(500);
    let text = format!("<|im_start|>user\n{doc}<|im_end|>\n<|im_start|>assistant\n");
    let want = TOKENIZER.tokenizer().encode(text.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(cache.encode(&TOKENIZER, &text).unwrap(), want);
    assert_eq!(cache.encode(&TOKENIZER, &text).unwrap(), want);
    let s = cache.stats();
    assert_eq!(
        (s.misses, s.hits),
        (3, 3),
        "`user\\n` + the document, `\\n`, `assistant\\n`; then all from the cache: {s:?}"
    );
}
