//! What the tokenizer benches share: where the real Qwen3 tokenizer is, and `--runs N`.

use std::path::PathBuf;

/// `TOKENONCE_TOKENIZER`, else the e2e tier's model folder's `tokenizer.json`
/// (`tests/e2e/vllm/setup.sh` puts it there).
pub fn tokenizer_path() -> PathBuf {
    if let Ok(p) = std::env::var("TOKENONCE_TOKENIZER") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache"));
    cache.join("tokenonce-vllm-venv/models/tiny-qwen3/tokenizer.json")
}

/// `--runs N` from the command line, else `default`.
pub fn runs(default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}
