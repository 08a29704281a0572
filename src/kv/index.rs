//! The bounded index of which endpoint holds which block, as the engines' KV events said.
//!
//! One map per endpoint (wire hash → when it was stored), so `held` is one lookup per block
//! of the chain in one map (`held_prefix`), with no per-block set of holders to allocate. The
//! bound, `max_blocks`, counts (endpoint, block) entries over every endpoint of the pool: when a
//! store would pass it, the oldest stored entries go first (a FIFO of stores; an entry removed
//! or stored again meanwhile leaves a stale FIFO slot, skipped by its stamp and compacted when
//! the FIFO grows past twice the bound). Oldest-stored approximates the engines' own LRU
//! eviction well enough for choice: an evicted entry only makes an endpoint look colder.

use std::collections::VecDeque;

use super::hash::{held_prefix, WireHashMap};
use super::BlockHash;

/// Which endpoint holds which blocks, bounded.
#[derive(Debug)]
pub struct BlockIndex {
    /// Per endpoint slot: wire hash → the stamp of its store.
    slots: Vec<WireHashMap<u64>>,
    /// Stores in order: (slot, wire hash, stamp).
    order: VecDeque<(usize, u64, u64)>,
    entries: usize,
    max_blocks: usize,
    next_stamp: u64,
}

impl BlockIndex {
    /// An empty index for `endpoints` slots holding at most `max_blocks` entries (at least 1).
    pub fn new(endpoints: usize, max_blocks: usize) -> Self {
        BlockIndex {
            slots: (0..endpoints).map(|_| WireHashMap::default()).collect(),
            order: VecDeque::new(),
            entries: 0,
            max_blocks: max_blocks.max(1),
            next_stamp: 0,
        }
    }

    /// (endpoint, block) entries held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// A new empty slot (an endpoint added); returns its number.
    pub fn add_slot(&mut self) -> usize {
        self.slots.push(WireHashMap::default());
        self.slots.len() - 1
    }

    /// The endpoint in `slot` stored `hashes`; returns how many entries the bound evicted.
    pub fn store(&mut self, slot: usize, hashes: impl IntoIterator<Item = u64>) -> usize {
        let mut evicted = 0;
        for hash in hashes {
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            let Some(map) = self.slots.get_mut(slot) else { return evicted };
            if map.insert(hash, stamp).is_none() {
                self.entries += 1;
            }
            self.order.push_back((slot, hash, stamp));
            while self.entries > self.max_blocks {
                if !self.evict_oldest() {
                    break;
                }
                evicted += 1;
            }
        }
        if self.order.len() > 2 * self.max_blocks.max(self.entries) {
            self.compact();
        }
        evicted
    }

    /// The bound now.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Sets the bound to `max_blocks` (at least 1); returns how many entries a lower bound
    /// evicted (the oldest stored first).
    pub fn set_max_blocks(&mut self, max_blocks: usize) -> usize {
        self.max_blocks = max_blocks.max(1);
        let mut evicted = 0;
        while self.entries > self.max_blocks && self.evict_oldest() {
            evicted += 1;
        }
        evicted
    }

    /// The endpoint in `slot` no longer holds `hashes`.
    pub fn remove(&mut self, slot: usize, hashes: impl IntoIterator<Item = u64>) {
        let Some(map) = self.slots.get_mut(slot) else { return };
        for hash in hashes {
            if map.remove(&hash).is_some() {
                self.entries -= 1;
            }
        }
    }

    /// The endpoint in `slot` holds nothing (engine restarted, cache cleared, continuity lost).
    pub fn clear(&mut self, slot: usize) {
        if let Some(map) = self.slots.get_mut(slot) {
            self.entries -= map.len();
            *map = WireHashMap::default();
        }
    }

    /// How many leading blocks of `chain` the endpoint in `slot` holds.
    pub fn held(&self, slot: usize, chain: &[BlockHash]) -> usize {
        self.slots.get(slot).map_or(0, |map| held_prefix(chain, |w| map.contains_key(&w)))
    }

    /// Whether the endpoint in `slot` holds the block with wire hash `hash`.
    pub fn holds(&self, slot: usize, hash: u64) -> bool {
        self.slots.get(slot).is_some_and(|map| map.contains_key(&hash))
    }

    /// Drops the oldest live entry; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        while let Some((slot, hash, stamp)) = self.order.pop_front() {
            let Some(map) = self.slots.get_mut(slot) else { continue };
            if map.get(&hash) == Some(&stamp) {
                map.remove(&hash);
                self.entries -= 1;
                return true;
            }
        }
        false
    }

    /// Drops the FIFO slots whose entry was removed or stored again since.
    fn compact(&mut self) {
        let slots = &self.slots;
        self.order.retain(|(slot, hash, stamp)| slots.get(*slot).and_then(|m| m.get(hash)) == Some(stamp));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockHasher, ExtraKeys};

    fn chain(n: u32) -> Vec<BlockHash> {
        let ids: Vec<u32> = (0..n * 4).collect();
        BlockHasher::new("0", 4).chain(&ids, &ExtraKeys::default())
    }

    #[test]
    fn held_answers_the_leading_blocks_per_endpoint() {
        let c = chain(4);
        let mut index = BlockIndex::new(2, 100);
        index.store(0, c.iter().take(3).map(BlockHash::wire));
        index.store(1, c.iter().skip(1).map(BlockHash::wire));
        assert_eq!((index.held(0, &c), index.held(1, &c), index.held(7, &c)), (3, 0, 0));
        assert_eq!(index.len(), 6);
        index.remove(0, c.get(1).map(BlockHash::wire));
        assert_eq!(index.held(0, &c), 1);
        index.clear(1);
        assert_eq!((index.len(), index.held(0, &c)), (2, 1));
    }

    #[test]
    fn the_bound_evicts_the_oldest_stored_first() {
        let c = chain(5);
        let mut index = BlockIndex::new(1, 3);
        let evicted = index.store(0, c.iter().map(BlockHash::wire));
        assert_eq!((evicted, index.len()), (2, 3));
        assert!(!index.holds(0, c[0].wire()) && !index.holds(0, c[1].wire()) && index.holds(0, c[4].wire()));
        // Storing block 2 again makes it the newest: block 3 goes next.
        index.store(0, [c[2].wire()]);
        index.store(0, [c[0].wire()]);
        assert!(index.holds(0, c[2].wire()) && !index.holds(0, c[3].wire()) && index.holds(0, c[0].wire()));
        assert_eq!(index.len(), 3);
    }

    #[test]
    fn a_lower_bound_evicts_the_oldest_and_a_higher_one_keeps_more() {
        let c = chain(6);
        let mut index = BlockIndex::new(1, 4);
        index.store(0, c.iter().take(4).map(BlockHash::wire));
        assert_eq!(index.set_max_blocks(2), 2);
        assert!(!index.holds(0, c[1].wire()) && index.holds(0, c[2].wire()) && index.len() == 2);
        assert_eq!(index.set_max_blocks(10), 0);
        assert_eq!(index.store(0, c.iter().map(BlockHash::wire)), 0, "room for all six now");
        assert_eq!((index.len(), index.max_blocks()), (6, 10));
    }

    #[test]
    fn churn_keeps_the_fifo_bounded() {
        let c = chain(8);
        let mut index = BlockIndex::new(1, 4);
        for _ in 0..1000 {
            index.store(0, c.iter().take(2).map(BlockHash::wire));
            index.remove(0, c.iter().take(2).map(BlockHash::wire));
        }
        assert!(index.order.len() <= 8, "{} FIFO slots", index.order.len());
        assert!(index.is_empty());
    }
}
