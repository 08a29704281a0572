//! The approximate prefix source: where tokenonce itself sent each block of each prompt,
//! bounded in blocks (clock eviction), answering [`PrefixHolders::held`] without allocating.
//!
//! It knows what it sent, not what the engine kept: an engine that evicted a prefix still
//! counts as holding it here until the index evicts it too. Each block remembers which
//! endpoints (up to [`MAX_ENDPOINTS`] names; a 65th name starts the index afresh) were sent
//! a prompt holding it. `held` assumes what a prefix cache guarantees (a block is only found
//! through its parents): it binary-searches the chain for the last block the endpoint was
//! sent, so a choice over a 1,000-block chain costs about ten map lookups per endpoint.

use parking_lot::RwLock;
use std::collections::HashMap;

use super::hash::{BlockHash, WireHashMap};
use super::PrefixHolders;

/// Endpoints one index tells apart (one bit each per block).
pub const MAX_ENDPOINTS: usize = 64;

/// One block sent somewhere.
#[derive(Debug, Clone, Copy)]
struct Block {
    /// Bit `i`: the endpoint numbered `i` was sent a prompt holding this block.
    endpoints: u64,
    /// Sent again since the clock hand last passed: spared once.
    referenced: bool,
}

/// The index behind the lock.
#[derive(Debug, Default)]
struct Index {
    /// Blocks by wire hash.
    blocks: WireHashMap<Block>,
    /// The clock ring: the wire hash in each slot (at most `max_blocks` slots).
    ring: Vec<u64>,
    /// The clock hand: the next slot eviction looks at.
    hand: usize,
    /// Endpoint names and their bit.
    names: HashMap<String, u32>,
}

/// Where tokenonce sent each prefix: a bounded map from block hash to the endpoints sent it.
#[derive(Debug)]
pub struct SentPrefixes {
    max_blocks: usize,
    index: RwLock<Index>,
}

impl SentPrefixes {
    /// An empty index holding at most `max_blocks` blocks (at least one).
    pub fn new(max_blocks: usize) -> Self {
        Self { max_blocks: max_blocks.max(1), index: RwLock::new(Index::default()) }
    }

    /// Blocks indexed now.
    pub fn len(&self) -> usize {
        self.index.read().blocks.len()
    }

    /// True when no block is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound on blocks indexed.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
}

impl Index {
    /// The bit of `endpoint`, numbering it if new; a name past [`MAX_ENDPOINTS`] clears the
    /// index first (the bits of old names would be reused otherwise).
    fn bit(&mut self, endpoint: &str) -> u64 {
        if let Some(&n) = self.names.get(endpoint) {
            return 1 << n;
        }
        if self.names.len() >= MAX_ENDPOINTS {
            *self = Self::default();
        }
        let n = u32::try_from(self.names.len()).unwrap_or(0);
        self.names.insert(endpoint.to_owned(), n);
        1 << n
    }

    /// Records `block` as sent to the endpoints of `bit`, evicting one block when `max` are
    /// held already.
    fn record(&mut self, wire: u64, bit: u64, max: usize) {
        if let Some(b) = self.blocks.get_mut(&wire) {
            b.endpoints |= bit;
            b.referenced = true;
            return;
        }
        if self.ring.len() < max {
            self.ring.push(wire);
        } else {
            let slot = self.victim();
            if let Some(old) = self.ring.get_mut(slot) {
                self.blocks.remove(old);
                *old = wire;
            }
        }
        self.blocks.insert(wire, Block { endpoints: bit, referenced: false });
    }

    /// The slot to reuse: the first, from the hand on, whose block was not sent again since
    /// the hand last passed (each referenced block passed is spared once; two turns at most).
    fn victim(&mut self) -> usize {
        let n = self.ring.len();
        for _ in 0..2 * n {
            let slot = self.hand;
            self.hand = (self.hand + 1) % n;
            let Some(wire) = self.ring.get(slot) else { break };
            match self.blocks.get_mut(wire) {
                Some(b) if b.referenced => b.referenced = false,
                _ => return slot,
            }
        }
        self.hand
    }

    /// True when the endpoints of `bit` were sent `block`.
    fn has(&self, block: &BlockHash, bit: u64) -> bool {
        self.blocks.get(&block.wire()).is_some_and(|b| b.endpoints & bit != 0)
    }
}

impl PrefixHolders for SentPrefixes {
    fn held(&self, endpoint: &str, chain: &[BlockHash]) -> usize {
        let index = self.index.read();
        let Some(&n) = index.names.get(endpoint) else { return 0 };
        let bit = 1u64 << n;
        // The held blocks are a prefix: find its end by binary search, the last block first
        // (a conversation's next turn usually holds all but its new tail).
        if chain.last().is_some_and(|b| index.has(b, bit)) {
            return chain.len();
        }
        chain.partition_point(|b| index.has(b, bit))
    }

    fn sent(&self, endpoint: &str, chain: &[BlockHash]) {
        let mut index = self.index.write();
        let bit = index.bit(endpoint);
        for block in chain {
            index.record(block.wire(), bit, self.max_blocks);
        }
    }

    /// Clears the endpoint's bit on every block (its blocks stay in the ring for the others).
    fn forget(&self, endpoint: &str) {
        let mut index = self.index.write();
        let Some(&n) = index.names.get(endpoint) else { return };
        let bit = 1u64 << n;
        index.blocks.values_mut().for_each(|b| b.endpoints &= !bit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockHasher, ExtraKeys};

    /// The chain of `blocks` blocks of 4 ids, the ids starting at `from`.
    fn chain(from: u32, blocks: u32) -> Vec<BlockHash> {
        let ids: Vec<u32> = (from..from + blocks * 4).collect();
        BlockHasher::new("0", 4).chain(&ids, &ExtraKeys::default())
    }

    #[test]
    fn an_endpoint_holds_what_was_sent_to_it_and_no_other_does() {
        let index = SentPrefixes::new(100);
        let c = chain(0, 10);
        assert_eq!(index.held("a:1", &c), 0, "nothing sent yet");
        index.sent("a:1", &c[..6]);
        assert_eq!(index.held("a:1", &c), 6, "the sent prefix of a longer chain");
        assert_eq!(index.held("a:1", &c[..3]), 3);
        assert_eq!(index.held("b:1", &c), 0);
        index.sent("b:1", &c);
        assert_eq!(index.held("b:1", &c), 10);
        assert_eq!(index.held("a:1", &c), 6, "b's blocks are not a's");
        assert_eq!(index.held("a:1", &chain(1, 10)), 0, "another prompt");
        assert_eq!(index.held("a:1", &[]), 0);
        assert_eq!(index.len(), 10);
    }

    #[test]
    fn the_bound_evicts_blocks_not_sent_again_first() {
        let index = SentPrefixes::new(8);
        let (old, hot) = (chain(0, 4), chain(100, 4));
        index.sent("a:1", &old);
        index.sent("a:1", &hot);
        index.sent("a:1", &hot); // sent again: spared once by the clock
        index.sent("a:1", &chain(200, 4));
        assert_eq!(index.len(), 8, "never over the bound");
        assert_eq!(index.held("a:1", &hot), 4, "the block sent again survives");
        assert_eq!(index.held("a:1", &old), 0, "the oldest, never sent again, went");
    }

    #[test]
    fn a_forgotten_endpoint_holds_nothing_and_learns_again() {
        let index = SentPrefixes::new(100);
        let c = chain(0, 6);
        index.sent("a:1", &c);
        index.sent("b:1", &c);
        index.forget("a:1");
        assert_eq!(index.held("a:1", &c), 0, "what it was sent is gone");
        assert_eq!(index.held("b:1", &c), 6, "another's is not");
        index.forget("never:1");
        index.sent("a:1", &c[..2]);
        assert_eq!(index.held("a:1", &c), 2, "sent again, held again");
        assert_eq!(index.len(), 6);
    }

    #[test]
    fn a_name_past_the_limit_starts_afresh() {
        let index = SentPrefixes::new(1000);
        let c = chain(0, 2);
        for i in 0..MAX_ENDPOINTS {
            index.sent(&format!("h:{i}"), &c);
        }
        assert_eq!(index.held("h:0", &c), 2);
        assert_eq!(index.held(&format!("h:{}", MAX_ENDPOINTS - 1), &c), 2);
        index.sent("new:1", &c);
        assert_eq!(index.held("h:0", &c), 0, "the old names are forgotten");
        assert_eq!(index.held("new:1", &c), 2);
    }

    #[test]
    fn it_is_always_usable() {
        assert!(SentPrefixes::new(1).usable());
        assert_eq!(SentPrefixes::new(0).max_blocks(), 1);
    }
}
