//! Relay id cache memory, measured: how much this process's resident set grows while the
//! cache takes 64 entries of 37k ids (each entry's ids are one ~148 KB allocation, served
//! from fresh pages), divided by the tokens cached; keys, map slots and bookkeeping included.
//! One test in this binary, so nothing else allocates meanwhile.

use std::time::{Duration, Instant};

use tokenonce::handoff::{CacheKey, IdCache, Lookup};
use tokenonce::openai::PromptIds;

/// VmRSS in bytes.
fn rss() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<i64>().ok()))
        .map_or(0, |kib| kib * 1024)
}

/// A 37k-token prompt's ids as an engine echoes them (ids up to 151k, so 5–6 digits).
fn echoed_ids(n: usize, seed: u64) -> String {
    let ids: Vec<u32> = (0..n as u64).map(|i| ((i * 7919 + seed * 104_729) % 151_000) as u32).collect();
    serde_json::to_string(&ids).unwrap_or_default()
}

#[test]
fn cached_ids_cost_under_four_and_a_half_bytes_per_token() {
    const ENTRIES: usize = 64;
    const TOKENS: usize = 37_000;
    let cache = IdCache::new(1 << 30, Duration::from_secs(60));
    let texts: Vec<String> = (0..ENTRIES as u64).map(|s| echoed_ids(TOKENS, s)).collect();
    let now = Instant::now();
    let before = rss();
    for (i, text) in texts.iter().enumerate() {
        // The relay path: validated ids, decoded to integers, stored under its three keys.
        let ids = PromptIds::parse(text, Some(TOKENS as u64)).map(|ids| ids.to_vec()).unwrap_or_default();
        assert_eq!(ids.len(), TOKENS);
        let keys = vec![
            CacheKey::RemoteRequestId(format!("cmpl-{i:032x}-0-abcd1234")),
            CacheKey::RequestId(format!("{i:08x}-1234-5678-9abc-def012345678")),
            CacheKey::Fingerprint(i as u64),
        ];
        cache.insert(keys, i as u64, ids, now);
    }
    let held = rss() - before;
    let per_token = held as f64 / (ENTRIES * TOKENS) as f64;
    println!("relay cache: {held} bytes for {} tokens = {per_token:.4} bytes/token", ENTRIES * TOKENS);
    assert!(per_token <= 4.5, "{per_token} bytes per cached token");
    assert!(per_token >= 4.0, "{per_token}: the ids themselves are 4 bytes each; is RSS readable?");
    // The entries are really there.
    let key = [CacheKey::Fingerprint(3)];
    assert!(matches!(cache.take(&key, 3, now).0, Lookup::Hit(ids) if ids.len() == TOKENS));
}
