//! Cost of a cache-aware choice: an 8-endpoint pool scoring a 37k-token prompt (2,312 blocks
//! of 16, the pool's default block size) with 100k blocks indexed in the approximate source (where tokenonce sent each
//! prompt), and the same scoring against a stand-in events source of the same data layout
//! (a wire-hash map of endpoint bits, read block by block as the exact index would be).
//!
//! Run: `cargo bench --bench cache_aware` (`--runs N` rounds, default 2000). Prints min /
//! median / p99 per step, in µs. Timings are printed, never asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use tokenonce::config::{Config, PoolResources};
use tokenonce::kv::hash::{held_prefix, WireHashMap};
use tokenonce::kv::{BlockHash, PrefixHolders, SentPrefixes};
use tokenonce::upstream::{EjectionRule, Pool, PromptKey};

const ENDPOINTS: usize = 8;
const PROMPT_TOKENS: u32 = 37_000;
const INDEXED_BLOCKS: usize = 100_000;
/// Bounds the whole run whatever `--runs` says.
const MAX_SECONDS: u64 = 60;

/// The stand-in events source: one map from wire hash to endpoint bits, read block by block.
struct ExactStandIn {
    blocks: WireHashMap<u64>,
    names: Vec<String>,
}

impl PrefixHolders for ExactStandIn {
    fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
        let Some(n) = self.names.iter().position(|e| e == endpoint) else { return 0 };
        held_prefix(chain, |h| self.blocks.get(&h).is_some_and(|bits| bits & (1 << n) != 0))
    }
}

/// min / median / p99 of `samples`, in µs.
fn report(step: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!("{step:<58} {:>9.2} {:>9.2} {:>9.2}", at(0.0), at(0.5), at(0.99));
}

/// Times `f` `runs` times (within the bound).
fn time(runs: usize, started: Instant, mut f: impl FnMut()) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        if started.elapsed() > Duration::from_secs(MAX_SECONDS) {
            break;
        }
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    samples
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args.iter().position(|a| a == "--runs").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(2000);
    let started = Instant::now();
    let endpoints: Vec<String> = (0..ENDPOINTS).map(|i| format!("\"127.0.0.1:{}\"", 9000 + i)).collect();
    let text = format!(
        "[pools.p]\nendpoints = [{}]\nbalance = \"cache_aware\"\n[pools.p.cache_aware]\nmax_blocks = {}\n[defaults]\npassthrough_pool = \"p\"\n",
        endpoints.join(", "),
        INDEXED_BLOCKS
    );
    let config = Config::from_toml(&text, "bench").unwrap();
    let pool =
        Pool::new("p", &config.pools["p"], &PoolResources::default(), EjectionRule { after: 0, base: Duration::ZERO });
    let prompt = |seed: u32| -> Vec<u32> { (0..PROMPT_TOKENS).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect() };

    let t = Instant::now();
    let chain = pool.chain(&prompt(0), &tokenonce::kv::ExtraKeys::default()).unwrap();
    println!(
        "chain of a {PROMPT_TOKENS}-token prompt: {} blocks in {:.2} ms",
        chain.len(),
        t.elapsed().as_secs_f64() * 1e3
    );

    // Fill the index: prompts sent until 100k blocks are held, then the measured one.
    let approximate = SentPrefixes::new(INDEXED_BLOCKS);
    let mut exact = ExactStandIn { blocks: WireHashMap::default(), names: Vec::new() };
    exact.names = (0..ENDPOINTS).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect();
    let mut seed = 1;
    while approximate.len() + chain.len() < INDEXED_BLOCKS {
        let other = pool.chain(&prompt(seed), &tokenonce::kv::ExtraKeys::default()).unwrap();
        let picked = pool.pick_for(Instant::now(), &[], PromptKey::Tokens(&other)).unwrap();
        let at = exact.names.iter().position(|n| n == picked.name()).unwrap();
        approximate.sent(picked.name(), &other);
        other.iter().for_each(|h| *exact.blocks.entry(h.wire()).or_default() |= 1 << at);
        seed += 1;
    }
    approximate.sent("127.0.0.1:9003", &chain);
    chain.iter().for_each(|h| *exact.blocks.entry(h.wire()).or_default() |= 1 << 3);
    let home = pool.pick_for(Instant::now(), &[], PromptKey::Tokens(&chain)).unwrap().name().to_owned();
    println!(
        "indexed: {} blocks (approximate), {} (stand-in); {ENDPOINTS} endpoints\n",
        approximate.len(),
        exact.blocks.len()
    );
    println!("{:<58} {:>9} {:>9} {:>9}", "step (µs)", "min", "median", "p99");

    let score = |source: &dyn PrefixHolders| {
        let held: usize = exact.names.iter().map(|n| source.held(n, &chain)).sum();
        std::hint::black_box(held);
    };
    report("score 8 endpoints, approximate source (held only)", time(runs, started, || score(&approximate)));
    report("score 8 endpoints, stand-in events source (held only)", time(runs, started, || score(&exact)));
    report("record the sent chain (sent, 2,312 blocks)", time(runs, started, || approximate.sent(&home, &chain)));
    report(
        "whole pick: candidates, score, count, sent",
        time(runs, started, || {
            let picked = pool.pick_for(Instant::now(), &[], PromptKey::Tokens(&chain)).unwrap();
            assert_eq!(picked.name(), home);
        }),
    );
}
