//! Cost of asking the KV events index how many leading blocks of a request's chain an endpoint
//! holds (`BlockIndex::held`, what cache-aware choice asks per candidate), with 100,000 blocks
//! indexed over 8 endpoints and a 1,000-block chain (32k tokens at block size 32): a chain the
//! endpoint holds whole, and one it holds none of.
//!
//! Run: `cargo bench --bench kv_held` (`--runs N` rounds, default 200). Prints min / median /
//! p99 per case, in microseconds. Timings are printed, never asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use tokenonce::kv::index::BlockIndex;
use tokenonce::kv::{BlockHash, BlockHasher, ExtraKeys};

const ENDPOINTS: usize = 8;
const BLOCKS: usize = 100_000;
const CHAIN_BLOCKS: u32 = 1_000;
const BLOCK_SIZE: usize = 32;
/// Bounds the whole run whatever `--runs` says.
const MAX_SECONDS: u64 = 60;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args.iter().position(|a| a == "--runs").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(200usize);
    let hasher = BlockHasher::new("0", BLOCK_SIZE);
    let chain_of = |seed: u32| {
        let ids: Vec<u32> =
            (0..CHAIN_BLOCKS * BLOCK_SIZE as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect();
        hasher.chain(&ids, &ExtraKeys::default())
    };
    let held_chain = chain_of(1);
    let cold_chain = chain_of(2);
    let mut index = BlockIndex::new(ENDPOINTS, BLOCKS);
    index.store(0, held_chain.iter().map(BlockHash::wire));
    // Fill the rest with other blocks, spread over the endpoints.
    let mut filler = 0u64;
    while index.len() < BLOCKS && filler < 4 * BLOCKS as u64 {
        let slot = (filler as usize) % ENDPOINTS;
        index.store(slot, [filler.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1]);
        filler += 1;
    }
    assert_eq!(index.held(0, &held_chain), held_chain.len(), "the held chain survived the filling");
    let deadline = Instant::now() + Duration::from_secs(MAX_SECONDS);
    for (name, chain) in [("held whole (1000 blocks)", &held_chain), ("held none", &cold_chain)] {
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            if Instant::now() > deadline {
                break;
            }
            let start = Instant::now();
            let held = std::hint::black_box(index.held(0, std::hint::black_box(chain)));
            times.push(start.elapsed());
            std::hint::black_box(held);
        }
        times.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
        println!(
            "{name}: min {:.1} us, median {:.1} us, p99 {:.1} us ({} runs, {} blocks indexed)",
            us(times[0]),
            us(at(0.5)),
            us(at(0.99)),
            times.len(),
            index.len()
        );
    }
}
