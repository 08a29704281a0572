//! The segment cache: each segment's ids kept by content, shared by every request of a pool,
//! so a follow-up turn encodes only its new segments. Bounded in bytes (text + ids +
//! bookkeeping), an entry idle longer than the TTL expires, the least recently used goes
//! first (second-chance, so a hit only sets a flag); sharded locks held only for map
//! operations. Counters, no metrics (`stats`).
//!
//! Keys: a segment is found by a 64-bit hash of (tokenizer fingerprint, text) under keys
//! drawn at random per cache (aHash), and a hit counts only when the stored text and
//! fingerprint equal the asked ones. So a hash collision, crafted or not, costs a miss and
//! never hands one text another text's ids; the price is keeping each text (about as many
//! bytes as its ids), which the byte bound counts. A strong 128-bit hash would drop the texts
//! but costs more CPU than comparing on this path (a 45k-token prompt is ~180 KB to hash).

use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::segment::{Piece, Segmenter};
use super::TokensError;

/// Bytes charged per entry on top of its text and ids (map slots, order, allocations).
pub const ENTRY_OVERHEAD: usize = 128;
/// Segments this short are looked up first among those met earlier in the same text.
const SHORT: usize = 16;
/// How many such segments a text remembers.
const RECENT: usize = 4;
/// Lock shards of [`SegmentCache::new`].
pub const DEFAULT_SHARDS: usize = 16;

/// What the cache has done since it was built, and what it holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segments found.
    pub hits: u64,
    /// Segments encoded (not found, expired or colliding).
    pub misses: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes held now (texts, ids, [`ENTRY_OVERHEAD`] each).
    pub bytes: usize,
    /// Entries dropped to stay under the byte bound.
    pub evicted_capacity: u64,
    /// Entries dropped because they were idle longer than the TTL.
    pub evicted_ttl: u64,
    /// Segments not kept because one alone exceeds a shard's share of the bound.
    pub too_large: u64,
    /// Text bytes encoded by the tokenizer (misses and whole texts).
    pub encoded_bytes: u64,
    /// Text bytes whose ids came from the cache.
    pub reused_bytes: u64,
    /// Texts encoded whole, uncut (the tokenizer forbids cutting, or the text).
    pub whole_texts: u64,
}

impl CacheStats {
    /// Hits over lookups (0 before any).
    pub fn hit_rate(&self) -> f64 {
        share(self.hits, self.hits + self.misses)
    }

    /// Reused text bytes over all text bytes asked (0 before any).
    pub fn reused_share(&self) -> f64 {
        share(self.reused_bytes, self.reused_bytes + self.encoded_bytes)
    }
}

/// `part` over `whole` (0 for an empty whole).
#[expect(clippy::cast_precision_loss, reason = "a ratio for reports")]
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evicted_capacity: AtomicU64,
    evicted_ttl: AtomicU64,
    too_large: AtomicU64,
    encoded_bytes: AtomicU64,
    reused_bytes: AtomicU64,
    whole_texts: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn len64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A segment's ids and what they were computed from.
struct Entry {
    fingerprint: u64,
    text: Box<str>,
    ids: Box<[u32]>,
}

/// An entry kept inline (one pointer less to chase per hit than behind an `Arc`).
struct Slot {
    entry: Entry,
    /// The stamp of its record in `Shard::queue` (older records of the same hash are stale).
    queued: u64,
    /// Used since it was (re)queued: gets a second chance instead of being evicted.
    referenced: bool,
    used: Instant,
    bytes: usize,
}

/// One lock's share: slots by hash, and a queue of (hash, stamp) records in the order they
/// were inserted or last given a second chance. Eviction is second-chance (CLOCK): the front
/// record's entry goes unless it was used since it was queued, in which case it is queued
/// again; so a hit is a flag write, and the least recently used go first, approximately.
#[derive(Default)]
struct Shard {
    slots: HashMap<u64, Slot, BuildHasherDefault<Prehashed>>,
    queue: VecDeque<(u64, u64)>,
    bytes: usize,
    next_stamp: u64,
}

/// What the front of the queue says.
enum Front {
    Empty,
    /// A record whose entry is gone or newer (popped).
    Stale,
    /// An entry used since it was queued (queued again, flag cleared).
    Requeued,
    /// An entry idle for the TTL or longer, or the eviction candidate (its hash).
    Candidate(u64, bool),
}

impl Shard {
    fn remove(&mut self, hash: u64) -> Option<Slot> {
        let slot = self.slots.remove(&hash)?;
        self.bytes = self.bytes.saturating_sub(slot.bytes);
        Some(slot)
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Looks at the front record, handling stale and second-chance records; a candidate is
    /// left in place with whether it is idle for `ttl` at `now`.
    fn front(&mut self, now: Instant, ttl: Duration) -> Front {
        let Some(&(hash, stamp)) = self.queue.front() else { return Front::Empty };
        let next = self.next_stamp + 1;
        let Some(slot) = self.slots.get_mut(&hash).filter(|s| s.queued == stamp) else {
            self.queue.pop_front();
            return Front::Stale;
        };
        let idle = now.saturating_duration_since(slot.used) >= ttl;
        if slot.referenced && !idle {
            slot.referenced = false;
            slot.queued = next;
            self.next_stamp = next;
            self.queue.pop_front();
            self.queue.push_back((hash, next));
            return Front::Requeued;
        }
        Front::Candidate(hash, idle)
    }

    /// Appends the ids of `text` (for the tokenizer `fingerprint`) kept under `hash` to
    /// `out` and marks the entry used at `now`; false when there is none, it holds another
    /// text (a hash collision) or it expired (dropped, counted). The text is compared and
    /// the ids copied under the lock: a hit is a memcmp and a memcpy.
    fn hit(
        &mut self,
        key: (u64, u64, &str),
        now: Instant,
        ttl: Duration,
        counters: &Counters,
        out: &mut Vec<u32>,
    ) -> bool {
        let (hash, fingerprint, text) = key;
        let Some(slot) = self.slots.get_mut(&hash) else { return false };
        if now.saturating_duration_since(slot.used) >= ttl {
            self.remove(hash);
            add(&counters.evicted_ttl, 1);
            return false;
        }
        if slot.entry.fingerprint != fingerprint || *slot.entry.text != *text {
            return false;
        }
        slot.used = now;
        slot.referenced = true;
        out.extend_from_slice(&slot.entry.ids);
        true
    }

    /// Drops entries idle for `ttl` or longer from the front of the queue (an entry behind a
    /// fresh one is at least as fresh, so it stops there).
    fn expire(&mut self, now: Instant, ttl: Duration) -> u64 {
        let mut dropped = 0;
        // Each record is requeued at most once per call: bounded even if every entry is hot.
        for _ in 0..self.queue.len() * 2 + 1 {
            match self.front(now, ttl) {
                Front::Empty => break,
                Front::Stale | Front::Requeued => {}
                Front::Candidate(hash, idle) => {
                    if !idle {
                        break;
                    }
                    self.queue.pop_front();
                    self.remove(hash);
                    dropped += 1;
                }
            }
        }
        dropped
    }

    /// Keeps `entry` under `hash` (replacing what was there), evicting to stay under
    /// `capacity`. Returns (expired, evicted).
    fn insert(&mut self, hash: u64, entry: Entry, bytes: usize, now: Instant, limits: (usize, Duration)) -> (u64, u64) {
        let (capacity, ttl) = limits;
        let expired = self.expire(now, ttl);
        self.remove(hash);
        let mut evicted = 0;
        for _ in 0..self.queue.len() * 2 + 1 {
            if self.bytes + bytes <= capacity {
                break;
            }
            match self.front(now, ttl) {
                Front::Empty => break,
                Front::Stale | Front::Requeued => {}
                Front::Candidate(oldest, _) => {
                    self.queue.pop_front();
                    self.remove(oldest);
                    evicted += 1;
                }
            }
        }
        if self.bytes + bytes > capacity {
            return (expired, evicted); // cannot happen once the queue is drained; never overfill
        }
        let stamp = self.stamp();
        self.queue.push_back((hash, stamp));
        self.slots.insert(hash, Slot { entry, queued: stamp, referenced: false, used: now, bytes });
        self.bytes += bytes;
        if self.queue.len() > 2 * self.slots.len() + 64 {
            // Stale records (replaced or expired-on-touch entries) never outnumber live ones.
            let slots = &self.slots;
            self.queue.retain(|(h, st)| slots.get(h).is_some_and(|s| s.queued == *st));
        }
        (expired, evicted)
    }
}

/// The map's hasher: keys are already random-keyed hashes, so it passes them through.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Segment ids by content, for one tokenizer or several (the key holds its fingerprint);
/// meant to be shared (`Arc`) by every request of a pool.
pub struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    /// Each shard's share of the byte bound.
    shard_capacity: usize,
    capacity: usize,
    ttl: Duration,
    hasher: ahash::RandomState,
    counters: Counters,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SegmentCache({} bytes, {:?}, {} shards)", self.capacity, self.ttl, self.shards.len())
    }
}

impl SegmentCache {
    /// An empty cache of at most `capacity_bytes`, an entry idle for `ttl` expiring, in
    /// [`DEFAULT_SHARDS`] shards (each holds an equal share; a segment larger than a share is
    /// encoded every time).
    pub fn new(capacity_bytes: usize, ttl: Duration) -> Self {
        Self::with_shards(capacity_bytes, ttl, DEFAULT_SHARDS)
    }

    /// As [`new`](Self::new) with `shards` locks (at least 1).
    pub fn with_shards(capacity_bytes: usize, ttl: Duration, shards: usize) -> Self {
        let shards = shards.max(1);
        Self {
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
            shard_capacity: capacity_bytes / shards,
            capacity: capacity_bytes,
            ttl,
            hasher: ahash::RandomState::new(),
            counters: Counters::default(),
        }
    }

    /// The bytes an entry of `text` with `ids` ids costs.
    pub fn entry_bytes(text: &str, ids: usize) -> usize {
        text.len() + ids * std::mem::size_of::<u32>() + ENTRY_OVERHEAD
    }

    /// The ids of `text`: exactly `encode(text, add_special_tokens = false)` of `tokenizer`,
    /// each segment taken from the cache when held and encoded and kept when not.
    ///
    /// # Errors
    /// The tokenizer's complaint about a segment (or the whole text).
    pub fn encode(&self, tokenizer: &Segmenter, text: &str) -> Result<Vec<u32>, TokensError> {
        self.encode_at(tokenizer, text, Instant::now())
    }

    /// [`encode`](Self::encode) at `now` (tests drive time).
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub fn encode_at(&self, tokenizer: &Segmenter, text: &str, now: Instant) -> Result<Vec<u32>, TokensError> {
        let Some(pieces) = tokenizer.split(text) else {
            add(&self.counters.whole_texts, 1);
            add(&self.counters.encoded_bytes, len64(text.len()));
            return tokenizer.encode_whole(text);
        };
        // About one id per 3.5 bytes of text (Qwen3, English); growing past it costs a copy.
        let mut ids = Vec::with_capacity(text.len() / 3 + pieces.len());
        // Short segments met earlier in this text (the `\n` between two turns recurs at every
        // turn) and where their ids sit in `ids`: copied from there, no hash, no lock.
        let mut recent: Vec<(&str, usize, usize)> = Vec::with_capacity(RECENT);
        let (mut local_hits, mut local_bytes) = (0, 0);
        for piece in pieces {
            let segment = match piece {
                Piece::Added(id) => {
                    ids.push(id);
                    continue;
                }
                Piece::Text(segment) => segment,
            };
            if segment.len() > SHORT {
                self.segment(tokenizer, segment, now, &mut ids)?;
                continue;
            }
            let seen = recent.iter().find(|(t, _, _)| *t == segment);
            if let Some(range) = seen.and_then(|&(_, start, len)| Some(start..start.checked_add(len)?)) {
                if range.end <= ids.len() {
                    ids.extend_from_within(range);
                    local_hits += 1;
                    local_bytes += segment.len();
                    continue;
                }
            }
            let start = ids.len();
            self.segment(tokenizer, segment, now, &mut ids)?;
            if recent.len() < RECENT {
                recent.push((segment, start, ids.len() - start));
            }
        }
        add(&self.counters.hits, local_hits);
        add(&self.counters.reused_bytes, len64(local_bytes));
        Ok(ids)
    }

    /// Appends `text`'s ids to `out`, from the cache or encoded (and kept).
    fn segment(&self, tokenizer: &Segmenter, text: &str, now: Instant, out: &mut Vec<u32>) -> Result<(), TokensError> {
        let fingerprint = tokenizer.fingerprint();
        let hash = self.hasher.hash_one((fingerprint, text));
        let hit =
            self.shard(hash).is_some_and(|mut s| s.hit((hash, fingerprint, text), now, self.ttl, &self.counters, out));
        if hit {
            add(&self.counters.hits, 1);
            add(&self.counters.reused_bytes, len64(text.len()));
            return Ok(());
        }
        add(&self.counters.misses, 1);
        add(&self.counters.encoded_bytes, len64(text.len()));
        let ids = tokenizer.encode_whole(text)?;
        out.extend_from_slice(&ids);
        let bytes = Self::entry_bytes(text, ids.len());
        if bytes > self.shard_capacity {
            add(&self.counters.too_large, 1);
            return Ok(());
        }
        let entry = Entry { fingerprint, text: text.into(), ids: ids.into_boxed_slice() };
        if let Some(mut shard) = self.shard(hash) {
            let (expired, evicted) = shard.insert(hash, entry, bytes, now, (self.shard_capacity, self.ttl));
            drop(shard);
            add(&self.counters.evicted_ttl, expired);
            add(&self.counters.evicted_capacity, evicted);
        }
        Ok(())
    }

    fn shard(&self, hash: u64) -> Option<MutexGuard<'_, Shard>> {
        // High bits pick the shard; the map uses the low ones (and the top 7 as tags).
        let index = usize::try_from((hash >> 40) % len64(self.shards.len())).ok()?;
        // No code panics while holding a shard, so a poisoned one is still consistent.
        self.shards.get(index).map(|m| m.lock())
    }

    /// Drops every entry idle for the TTL or longer, now; returns how many.
    pub fn purge(&self, now: Instant) -> u64 {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            dropped += shard.lock().expire(now, self.ttl);
        }
        add(&self.counters.evicted_ttl, dropped);
        dropped
    }

    /// The counters and what is held now.
    pub fn stats(&self) -> CacheStats {
        let (mut entries, mut bytes) = (0, 0);
        for shard in self.shards.iter() {
            let s = shard.lock();
            entries += s.slots.len();
            bytes += s.bytes;
        }
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            entries,
            bytes,
            evicted_capacity: get(&c.evicted_capacity),
            evicted_ttl: get(&c.evicted_ttl),
            too_large: get(&c.too_large),
            encoded_bytes: get(&c.encoded_bytes),
            reused_bytes: get(&c.reused_bytes),
            whole_texts: get(&c.whole_texts),
        }
    }

    /// The byte bound.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity
    }

    /// How long an idle entry lives.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

#[cfg(test)]
mod tests {
    use tokenizers::AddedToken;

    use std::sync::Arc;

    use super::super::segment::testing::{chatml_bpe, reference};
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    fn seg() -> Segmenter {
        Segmenter::new(chatml_bpe(), "memory".into()).unwrap()
    }

    fn turn(role: &str, content: &str) -> String {
        format!("<|im_start|>{role}\n{content}<|im_end|>\n")
    }

    #[test]
    fn a_follow_up_encodes_only_its_new_segments() {
        let tk = seg();
        let cache = SegmentCache::new(1 << 20, TTL);
        let t0 = Instant::now();
        let first = turn("system", "be brief") + &turn("user", "the café is open");
        let ids = cache.encode_at(&tk, &first, t0).unwrap();
        assert_eq!(ids, reference(tk.tokenizer(), &first));
        let s = cache.stats();
        // "system\nbe brief", "\n", "user\nthe café is open", "\n"
        assert_eq!((s.hits, s.misses, s.entries), (1, 3, 3), "the second newline is a hit");

        let follow = first.clone() + &turn("assistant", "yes") + &turn("user", "and the tea?");
        assert_eq!(cache.encode_at(&tk, &follow, t0).unwrap(), reference(tk.tokenizer(), &follow));
        let s = cache.stats();
        assert_eq!((s.hits, s.misses), (1 + 6, 3 + 2), "only the two new turns' texts were encoded");
        assert_eq!(
            s.encoded_bytes,
            len64("system\nbe brief\nuser\nthe café is open".len() + "assistant\nyesuser\nand the tea?".len())
        );
        // First request: its second "\n"; follow-up: both old texts and four "\n".
        assert_eq!(s.reused_bytes, len64(1 + "system\nbe brief".len() + "user\nthe café is open".len() + 4));
    }

    #[test]
    fn entries_idle_past_the_ttl_expire_and_used_ones_stay() {
        let tk = seg();
        let cache = SegmentCache::with_shards(1 << 20, TTL, 1);
        let t0 = Instant::now();
        cache.encode_at(&tk, &turn("user", "old"), t0).unwrap();
        cache.encode_at(&tk, &turn("user", "kept"), t0).unwrap();
        let half = t0 + TTL / 2;
        cache.encode_at(&tk, &turn("user", "kept"), half).unwrap();
        assert_eq!(cache.purge(t0 + TTL), 1, "`user\\nold` idle a full TTL; `\\n` and `kept` used at half");
        assert_eq!(cache.stats().entries, 2);
        assert_eq!(cache.purge(half + TTL), 2);
        let s = cache.stats();
        assert_eq!((s.entries, s.bytes, s.evicted_ttl), (0, 0, 3));
    }

    #[test]
    fn the_byte_bound_evicts_the_least_recently_used_first() {
        let tk = seg();
        let t0 = Instant::now();
        let a = "a".repeat(100);
        let b = "b".repeat(100);
        let c = "c".repeat(100);
        let one = SegmentCache::entry_bytes(&a, reference(tk.tokenizer(), &a).len());
        let cache = SegmentCache::with_shards(2 * one + one / 2, TTL, 1);
        cache.encode_at(&tk, &a, t0).unwrap();
        cache.encode_at(&tk, &b, t0).unwrap();
        cache.encode_at(&tk, &a, t0).unwrap(); // a is now more recent than b
        cache.encode_at(&tk, &c, t0).unwrap(); // evicts b
        let s = cache.stats();
        assert_eq!((s.entries, s.evicted_capacity, s.hits), (2, 1, 1));
        assert!(s.bytes <= cache.capacity_bytes());
        cache.encode_at(&tk, &a, t0).unwrap();
        assert_eq!(cache.stats().hits, 2, "a stayed");
        cache.encode_at(&tk, &b, t0).unwrap();
        assert_eq!(cache.stats().misses, 4, "b was evicted");
    }

    #[test]
    fn a_segment_larger_than_a_shard_is_encoded_every_time() {
        let tk = seg();
        let cache = SegmentCache::with_shards(64, TTL, 1);
        let text = "the long document ".repeat(10);
        for _ in 0..2 {
            assert_eq!(cache.encode(&tk, &text).unwrap(), reference(tk.tokenizer(), &text));
        }
        let s = cache.stats();
        assert_eq!((s.misses, s.too_large, s.entries, s.bytes), (2, 2, 0, 0));
    }

    #[test]
    fn two_tokenizers_sharing_a_cache_never_get_each_others_ids() {
        let a = seg();
        let mut other = chatml_bpe();
        let _ = other.add_tokens([AddedToken::from("open", true)]);
        let b = Segmenter::new(other, "other".into()).unwrap();
        let cache = SegmentCache::new(1 << 20, TTL);
        let text = turn("user", "open the door");
        let ids_a = cache.encode(&a, &text).unwrap();
        let ids_b = cache.encode(&b, &text).unwrap();
        assert_ne!(ids_a, ids_b);
        assert_eq!(ids_b, reference(b.tokenizer(), &text));
        assert_eq!(cache.encode(&a, &text).unwrap(), ids_a);
    }

    #[test]
    fn a_tokenizer_that_forbids_cutting_encodes_whole_and_caches_nothing() {
        let mut tk = chatml_bpe();
        tk.set_encode_special_tokens(true);
        let tk = Segmenter::new(tk, "memory".into()).unwrap();
        let cache = SegmentCache::new(1 << 20, TTL);
        let text = turn("user", "hi");
        assert_eq!(cache.encode(&tk, &text).unwrap(), reference(tk.tokenizer(), &text));
        let s = cache.stats();
        assert_eq!((s.whole_texts, s.entries, s.encoded_bytes), (1, 0, len64(text.len())));
    }

    #[test]
    fn a_hash_collision_is_a_miss_never_another_texts_ids() {
        let counters = Counters::default();
        let mut shard = Shard::default();
        let t0 = Instant::now();
        let entry = Entry { fingerprint: 1, text: "one text".into(), ids: vec![1, 2].into_boxed_slice() };
        shard.insert(42, entry, 100, t0, (1 << 20, TTL));
        let mut out = Vec::new();
        assert!(!shard.hit((42, 1, "another text"), t0, TTL, &counters, &mut out), "same hash, other text");
        assert!(!shard.hit((42, 2, "one text"), t0, TTL, &counters, &mut out), "same hash, other tokenizer");
        assert!(out.is_empty());
        assert!(shard.hit((42, 1, "one text"), t0, TTL, &counters, &mut out));
        assert_eq!(out, vec![1, 2]);
        // The colliding text takes the slot when it is kept; the first one is then a miss.
        let other = Entry { fingerprint: 1, text: "another text".into(), ids: vec![9].into_boxed_slice() };
        shard.insert(42, other, 100, t0, (1 << 20, TTL));
        assert!(!shard.hit((42, 1, "one text"), t0, TTL, &counters, &mut out));
        assert_eq!((shard.slots.len(), shard.bytes), (1, 100));
    }

    #[test]
    fn stale_queue_records_are_compacted() {
        let mut shard = Shard::default();
        let t0 = Instant::now();
        for i in 0..1000u32 {
            let entry = Entry { fingerprint: 1, text: "same".into(), ids: vec![i].into_boxed_slice() };
            shard.insert(7, entry, 100, t0, (1 << 20, TTL));
        }
        assert_eq!(shard.slots.len(), 1);
        assert!(shard.queue.len() <= 2 + 64, "{}", shard.queue.len());
    }

    #[test]
    fn many_threads_share_one_cache() {
        let tk = Arc::new(seg());
        let cache = Arc::new(SegmentCache::with_shards(4096, TTL, 4));
        let texts: Vec<String> = (0..12).map(|i| turn("user", &format!("message {i} the and"))).collect();
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (tk, cache, texts) = (Arc::clone(&tk), Arc::clone(&cache), texts.clone());
                std::thread::spawn(move || {
                    for round in 0..30 {
                        let text: String = texts.iter().cycle().skip(t + round).take(5).cloned().collect();
                        assert_eq!(cache.encode(&tk, &text).unwrap(), reference(tk.tokenizer(), &text));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let s = cache.stats();
        assert!(s.bytes <= 4096 && s.hits > 0, "{s:?}");
    }
}
