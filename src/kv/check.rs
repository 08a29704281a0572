//! The hash check: every block an engine reports stored is hashed again by tokenonce (its seed,
//! its block size, vLLM's `sha256_cbor`) and must give the hash the engine published.
//!
//! Why recompute from the event rather than look the reported hash up among the chains
//! tokenonce sent: a `BlockStored` carries the engine's own token ids for its blocks, so
//! hashing them is a check that needs no guess about which request stored them (requests
//! overlap), and it separates the causes. The event's `block_size` differing from the
//! configured one is block-size drift; equal tokens giving another hash can only be the seed
//! (`PYTHONHASHSEED`) or the hash algorithm. The one difficulty is the parent: the wire carries
//! only its low 64 bits, and the chain hashes the parent's full 32 bytes. A block with no
//! parent starts from the seed's hash; for the others the full parent digest comes from a
//! bounded memory (`capacity` digests, oldest forgotten first) of the digests of the chains
//! tokenonce sent ([`HashCheck::expect`], fed by `PrefixHolders::sent`) and of the blocks this
//! check already verified. A block whose parent is unknown is not checked (not counted).
//! Blocks with extra keys (LoRA, cache salt, multimodal) are not checked either: the event
//! publishes the LoRA name without the path the hash includes; the chain after one is unknown.

use std::collections::VecDeque;

use super::hash::{Digest, WireHashMap};
use super::wire::Stored;
use super::{BlockHash, BlockHasher, ExtraKeys};

/// Why the engines' hashes are not tokenonce's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    /// The engine hashes blocks of another size than the configured `block_size`.
    BlockSize { engine: usize, configured: usize },
    /// The same tokens hash differently: another `PYTHONHASHSEED` (or none: random per
    /// process), or another `--prefix-caching-hash-algo` than `sha256_cbor`.
    SeedOrAlgorithm,
}

impl Drift {
    /// The label value of `kv_cache_aware_disabled{reason}`.
    pub fn label(&self) -> &'static str {
        match self {
            Drift::BlockSize { .. } => "block_size",
            Drift::SeedOrAlgorithm => "seed_or_algorithm",
        }
    }

    /// Every label value, so every series exists from the start.
    pub const LABELS: [&'static str; 2] = ["block_size", "seed_or_algorithm"];
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Drift::BlockSize { engine, configured } => {
                write!(f, "the engine stores blocks of {engine} tokens, kv_events.block_size is {configured}")
            }
            Drift::SeedOrAlgorithm => f.write_str(
                "the engine's tokens hash to another hash: its PYTHONHASHSEED is not kv_events.hash_seed, \
                 or it does not hash with sha256_cbor",
            ),
        }
    }
}

/// What checking one `BlockStored` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Blocks whose published hash is the one tokenonce computes.
    pub matched: u64,
    /// Blocks whose published hash is not (the check stops at the first).
    pub mismatched: u64,
    /// Why, when a block did not match.
    pub drift: Option<Drift>,
}

/// Recomputes published block hashes (see the module doc).
#[derive(Debug)]
pub struct HashCheck {
    hasher: BlockHasher,
    known: WireHashMap<Digest>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl HashCheck {
    /// A check with tokenonce's `hasher` remembering at most `capacity` digests (at least 1).
    pub fn new(hasher: BlockHasher, capacity: usize) -> Self {
        HashCheck { hasher, known: WireHashMap::default(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// A chain tokenonce sent: its digests are the parents its blocks' successors chain on.
    pub fn expect(&mut self, chain: &[BlockHash]) {
        for block in chain {
            self.remember(block.wire(), block.0);
        }
    }

    /// Checks the blocks of one `BlockStored`.
    pub fn check(&mut self, stored: &Stored) -> Outcome {
        let mut outcome = Outcome::default();
        let configured = self.hasher.block_size();
        if stored.block_size != configured {
            outcome.mismatched = 1;
            outcome.drift = Some(Drift::BlockSize { engine: stored.block_size, configured });
            return outcome;
        }
        let mut parent = match stored.parent_block_hash {
            None => None,
            Some(wire) => match self.known.get(&wire.0) {
                Some(digest) => Some(*digest),
                None => return outcome,
            },
        };
        let blocks = stored.token_ids.chunks_exact(configured);
        for (i, (reported, tokens)) in stored.block_hashes.iter().zip(blocks).enumerate() {
            if stored.has_extra_keys(i) {
                break;
            }
            let first = parent.is_none();
            let ours = self.hasher.hash_block(parent.as_ref(), tokens, &ExtraKeys::default(), first);
            if ours.wire() != reported.0 {
                outcome.mismatched += 1;
                outcome.drift = Some(Drift::SeedOrAlgorithm);
                return outcome;
            }
            outcome.matched += 1;
            self.remember(reported.0, ours.0);
            parent = Some(ours.0);
        }
        outcome
    }

    fn remember(&mut self, wire: u64, digest: Digest) {
        if self.known.insert(wire, digest).is_none() {
            self.order.push_back(wire);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.known.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::wire::WireHash;

    fn stored(hasher: &BlockHasher, ids: &[u32], skip: usize) -> Stored {
        let chain = hasher.chain(ids, &ExtraKeys::default());
        let bs = hasher.block_size();
        Stored {
            block_hashes: chain.iter().skip(skip).map(|h| WireHash(h.wire())).collect(),
            parent_block_hash: skip.checked_sub(1).and_then(|p| chain.get(p)).map(|h| WireHash(h.wire())),
            token_ids: ids.get(skip * bs..chain.len() * bs).unwrap_or_default().to_vec(),
            block_size: bs,
            lora_name: None,
            medium: None,
            extra_keys: None,
            group_idx: None,
        }
    }

    #[test]
    fn the_same_seed_and_block_size_match_and_chain_on() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (100..120).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        assert_eq!(check.check(&stored(&engine, &ids[..8], 0)).matched, 2);
        // The follow-up's parent is one this check verified.
        let later = check.check(&stored(&engine, &ids, 2));
        assert_eq!((later.matched, later.mismatched), (3, 0));
    }

    #[test]
    fn a_parent_known_only_from_a_sent_chain_is_found() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..16).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let follow = stored(&engine, &ids, 2);
        assert_eq!(check.check(&follow), Outcome::default(), "unknown parent: not checked");
        check.expect(&engine.chain(&ids[..8], &ExtraKeys::default()));
        assert_eq!(check.check(&follow).matched, 2);
    }

    #[test]
    fn another_seed_or_block_size_is_drift_and_says_which() {
        let ids: Vec<u32> = (0..16).collect();
        let mut check = HashCheck::new(BlockHasher::new("vllm-none-hash", 4), 100);
        let other_seed = check.check(&stored(&BlockHasher::new("0", 4), &ids, 0));
        assert_eq!((other_seed.mismatched, other_seed.drift), (1, Some(Drift::SeedOrAlgorithm)));
        let other_size = check.check(&stored(&BlockHasher::new("vllm-none-hash", 8), &ids, 0));
        assert_eq!(other_size.drift, Some(Drift::BlockSize { engine: 8, configured: 4 }));
    }

    #[test]
    fn blocks_with_extra_keys_are_not_checked() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..8).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let mut lora = stored(&engine, &ids, 0);
        lora.lora_name = Some("adapter".into());
        lora.block_hashes = vec![WireHash(1), WireHash(2)];
        assert_eq!(check.check(&lora), Outcome::default());
    }

    #[test]
    fn the_memory_of_digests_is_bounded() {
        let chain = BlockHasher::new("0", 1).chain(&(0..50).collect::<Vec<u32>>(), &ExtraKeys::default());
        let mut check = HashCheck::new(BlockHasher::new("0", 1), 10);
        check.expect(&chain);
        assert_eq!((check.known.len(), check.order.len()), (10, 10));
        assert!(check.known.contains_key(&chain[49].wire()) && !check.known.contains_key(&chain[0].wire()));
    }
}
