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
//!
//! Extra keys: the event publishes each block's keys untagged (`wire::BlockKeys`). A salt on
//! the first block is hashed as vLLM hashes it; a LoRA block with the path the endpoint's
//! `/v1/models` lists for its adapter (the event names the adapter, not the path the hash
//! includes; [`LoraPaths`](super::LoraPaths)); a block keyed by anything else (media, prompt
//! embeddings, an adapter whose path is not known) is not checked, nor are the blocks after it.
//! A LoRA block that differs ([`Drift::LoraPath`]) is counted a mismatch but does not turn the
//! pool off: the plain blocks still hash alike, only that adapter's chains are wrong.

use std::collections::VecDeque;

use super::hash::{Digest, WireHashMap};
use super::wire::Stored;
use super::{BlockHash, BlockHasher, RequestKeys};

/// Why the engines' hashes are not tokenonce's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    /// The engine hashes blocks of another size than the configured `block_size`.
    BlockSize { engine: usize, configured: usize },
    /// The same tokens hash differently: another `PYTHONHASHSEED` (or none: random per
    /// process), or another `--prefix-caching-hash-algo` than `sha256_cbor`.
    SeedOrAlgorithm,
    /// A LoRA adapter's blocks hash differently from its name and the path the engine's
    /// `/v1/models` listed (the adapter was loaded again from elsewhere since): only that
    /// adapter's chains are wrong, so the pool stays on.
    LoraPath,
}

impl Drift {
    /// The label value of `kv_cache_aware_disabled{reason}`.
    pub fn label(&self) -> &'static str {
        match self {
            Drift::BlockSize { .. } => "block_size",
            Drift::SeedOrAlgorithm => "seed_or_algorithm",
            Drift::LoraPath => "lora_path",
        }
    }

    /// Whether it turns the pool's cache-aware choice off (every chain is wrong), not only
    /// one adapter's.
    pub fn turns_off(&self) -> bool {
        !matches!(self, Drift::LoraPath)
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
            Drift::LoraPath => f.write_str(
                "the engine's blocks for a LoRA adapter hash to another hash than its name and the path \
                 its /v1/models listed give: the adapter was loaded from another path since",
            ),
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

    /// Checks the blocks of one `BlockStored`; `lora_path` gives the path the publishing
    /// endpoint loaded an adapter from, by its name.
    pub fn check(&mut self, stored: &Stored, lora_path: &dyn Fn(&str) -> Option<String>) -> Outcome {
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
            let first = parent.is_none();
            let Some(keys) = block_keys(stored, i, first, lora_path) else { break };
            let ours = self.hasher.hash_block(parent.as_ref(), tokens, &keys.as_extra(), first);
            if ours.wire() != reported.0 {
                outcome.mismatched += 1;
                outcome.drift = Some(if keys.lora.is_some() { Drift::LoraPath } else { Drift::SeedOrAlgorithm });
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

/// The extra keys of block `i` of `stored` (`first`: it starts at token 0) when tokenonce can
/// hash them: none; a salt on the first block; a LoRA adapter whose path `lora_path` knows,
/// with a salt on the first block. `None` for anything else (media, prompt embeddings, an
/// unknown adapter path, keys not in vLLM's order).
fn block_keys(
    stored: &Stored,
    i: usize,
    first: bool,
    lora_path: &dyn Fn(&str) -> Option<String>,
) -> Option<RequestKeys> {
    let keys = stored.extra_keys.as_ref().and_then(|k| k.get(i)).and_then(Option::as_ref);
    let (Some(name), Some(keys)) = (stored.lora_name.as_ref(), keys) else {
        return match keys {
            None if stored.lora_name.is_none() => Some(RequestKeys::default()),
            Some(keys) if stored.lora_name.is_none() => salt_only(&keys.texts, keys.other, first),
            _ => None,
        };
    };
    let (named, rest) = keys.texts.split_first()?;
    if named != name {
        return None;
    }
    let mut out = salt_only(rest, keys.other, first)?;
    out.lora = Some((name.clone(), lora_path(name)?));
    Some(out)
}

/// Keys holding at most a salt, which only the first block may carry.
fn salt_only(texts: &[String], other: bool, first: bool) -> Option<RequestKeys> {
    match (texts, other) {
        ([], false) => Some(RequestKeys::default()),
        ([salt], false) if first => Some(RequestKeys { lora: None, cache_salt: Some(salt.clone()) }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::wire::{BlockKeys, WireHash};
    use crate::kv::ExtraKeys;

    /// No adapter's path known.
    fn no_lora(_: &str) -> Option<String> {
        None
    }

    fn stored(hasher: &BlockHasher, ids: &[u32], skip: usize) -> Stored {
        stored_with(hasher, ids, skip, &RequestKeys::default())
    }

    /// A `BlockStored` of `ids` from block `skip` on, hashed with `keys`, publishing them as
    /// vLLM does (untagged: the LoRA name on every block, the salt on the first).
    fn stored_with(hasher: &BlockHasher, ids: &[u32], skip: usize, keys: &RequestKeys) -> Stored {
        let chain = hasher.chain(ids, &keys.as_extra());
        let published = |i: usize| {
            let mut texts: Vec<String> = keys.lora.iter().map(|(name, _)| name.clone()).collect();
            texts.extend(keys.cache_salt.iter().filter(|_| i == 0).cloned());
            (!texts.is_empty()).then_some(BlockKeys { texts, other: false })
        };
        let extra: Vec<Option<BlockKeys>> = (skip..chain.len()).map(published).collect();
        let bs = hasher.block_size();
        Stored {
            block_hashes: chain.iter().skip(skip).map(|h| WireHash(h.wire())).collect(),
            parent_block_hash: skip.checked_sub(1).and_then(|p| chain.get(p)).map(|h| WireHash(h.wire())),
            token_ids: ids.get(skip * bs..chain.len() * bs).unwrap_or_default().to_vec(),
            block_size: bs,
            lora_name: keys.lora.as_ref().map(|(name, _)| name.clone()),
            medium: None,
            extra_keys: extra.iter().any(Option::is_some).then_some(extra),
            group_idx: None,
        }
    }

    #[test]
    fn the_same_seed_and_block_size_match_and_chain_on() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (100..120).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        assert_eq!(check.check(&stored(&engine, &ids[..8], 0), &no_lora).matched, 2);
        // The follow-up's parent is one this check verified.
        let later = check.check(&stored(&engine, &ids, 2), &no_lora);
        assert_eq!((later.matched, later.mismatched), (3, 0));
    }

    #[test]
    fn a_parent_known_only_from_a_sent_chain_is_found() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..16).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let follow = stored(&engine, &ids, 2);
        assert_eq!(check.check(&follow, &no_lora), Outcome::default(), "unknown parent: not checked");
        check.expect(&engine.chain(&ids[..8], &ExtraKeys::default()));
        assert_eq!(check.check(&follow, &no_lora).matched, 2);
    }

    #[test]
    fn another_seed_or_block_size_is_drift_and_says_which() {
        let ids: Vec<u32> = (0..16).collect();
        let mut check = HashCheck::new(BlockHasher::new("vllm-none-hash", 4), 100);
        let other_seed = check.check(&stored(&BlockHasher::new("0", 4), &ids, 0), &no_lora);
        assert_eq!((other_seed.mismatched, other_seed.drift), (1, Some(Drift::SeedOrAlgorithm)));
        let other_size = check.check(&stored(&BlockHasher::new("vllm-none-hash", 8), &ids, 0), &no_lora);
        assert_eq!(other_size.drift, Some(Drift::BlockSize { engine: 8, configured: 4 }));
    }

    /// A salted chain and a LoRA chain are hashed as vLLM hashes them (the salt on the first
    /// block, the adapter's name and path on every block) and match, follow-ups included.
    #[test]
    fn salted_and_lora_blocks_are_checked_like_the_others() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..16).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let salted = RequestKeys { lora: None, cache_salt: Some("tenant".into()) };
        assert_eq!(check.check(&stored_with(&engine, &ids[..8], 0, &salted), &no_lora).matched, 2);
        assert_eq!(check.check(&stored_with(&engine, &ids, 2, &salted), &no_lora).matched, 2, "chained on");
        let lora = RequestKeys { lora: Some(("sql".into(), "/loras/sql".into())), cache_salt: Some("t".into()) };
        let path = |name: &str| (name == "sql").then(|| "/loras/sql".to_owned());
        let out = check.check(&stored_with(&engine, &ids, 0, &lora), &path);
        assert_eq!((out.matched, out.mismatched), (4, 0));
    }

    #[test]
    fn blocks_keyed_by_what_tokenonce_cannot_hash_are_not_checked() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..8).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let lora = RequestKeys { lora: Some(("sql".into(), "/loras/sql".into())), cache_salt: None };
        let unknown_path = stored_with(&engine, &ids, 0, &lora);
        assert_eq!(check.check(&unknown_path, &no_lora), Outcome::default(), "the adapter's path is not known");
        let mut media = stored(&engine, &ids, 0);
        media.extra_keys = Some(vec![None, Some(BlockKeys { texts: vec![], other: true })]);
        assert_eq!(check.check(&media, &no_lora).matched, 1, "checked up to the block with an image");
        let mut late_salt = stored(&engine, &ids, 0);
        late_salt.extra_keys = Some(vec![None, Some(BlockKeys { texts: vec!["s".into()], other: false })]);
        assert_eq!(check.check(&late_salt, &no_lora).matched, 1, "a salt past block 0 is not vLLM's");
    }

    /// An adapter's blocks hashed from another path than its engine listed: a mismatch that
    /// says so, which does not turn the pool off.
    #[test]
    fn a_lora_block_from_another_path_is_lora_path_drift() {
        let engine = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..8).collect();
        let mut check = HashCheck::new(BlockHasher::new("0", 4), 100);
        let lora = RequestKeys { lora: Some(("sql".into(), "/loras/sql-v2".into())), cache_salt: None };
        let out = check.check(&stored_with(&engine, &ids, 0, &lora), &|_| Some("/loras/sql".into()));
        assert_eq!((out.matched, out.mismatched, out.drift), (0, 1, Some(Drift::LoraPath)));
        assert!(!Drift::LoraPath.turns_off() && Drift::SeedOrAlgorithm.turns_off());
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
