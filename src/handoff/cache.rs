//! The relay-mode id cache: prompt ids kept between a prefill and its decode, found by any
//! of several correlation keys, bounded in bytes, expiring after a TTL, removed on use. A
//! hit is only returned when the decode's prompt fingerprint equals the prefill's, so a
//! reused or colliding request id can never hand one request another request's ids.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::key::CacheKey;
use crate::metrics::CacheLookup;

/// Bytes charged per entry on top of its ids (map slots, keys, bookkeeping).
const ENTRY_OVERHEAD: usize = 128;

/// Result of a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Ids found (and removed).
    Hit(Vec<u32>),
    /// No entry under any key.
    Miss,
    /// An entry was found but had expired.
    Expired,
    /// An entry was found under a key but for a different prompt; left in place.
    Mismatch,
}

impl Lookup {
    /// Its `cache_lookups_total{result}` label.
    pub fn label(&self) -> CacheLookup {
        match self {
            Self::Hit(_) => CacheLookup::Hit,
            Self::Miss => CacheLookup::Miss,
            Self::Expired => CacheLookup::Expired,
            Self::Mismatch => CacheLookup::Mismatch,
        }
    }
}

/// Evictions caused by one operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Entries dropped because their TTL passed.
    pub ttl: u64,
    /// Entries dropped (or refused) to stay under the byte capacity.
    pub capacity: u64,
}

struct Entry {
    ids: Vec<u32>,
    fingerprint: u64,
    keys: Vec<CacheKey>,
    inserted: Instant,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<u64, Entry>,
    by_key: HashMap<CacheKey, u64>,
    order: VecDeque<u64>,
    bytes: usize,
    next_id: u64,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.bytes -= entry.bytes;
        for key in &entry.keys {
            if self.by_key.get(key) == Some(&id) {
                self.by_key.remove(key);
            }
        }
        Some(entry)
    }

    /// Drops entries older than `ttl` (the queue is in insertion order, so stop at the first young one).
    fn expire(&mut self, now: Instant, ttl: Duration) -> u64 {
        let mut dropped = 0;
        while let Some(&id) = self.order.front() {
            match self.entries.get(&id) {
                Some(e) if now.saturating_duration_since(e.inserted) < ttl => break,
                Some(_) => {
                    self.order.pop_front();
                    self.remove(id);
                    dropped += 1;
                }
                None => {
                    self.order.pop_front(); // already taken
                }
            }
        }
        dropped
    }
}

/// The cache; shared by every request of a process.
pub struct IdCache {
    inner: Mutex<Inner>,
    capacity_bytes: usize,
    ttl: Duration,
}

impl IdCache {
    /// An empty cache holding at most `capacity_bytes`, each entry for at most `ttl`.
    pub fn new(capacity_bytes: usize, ttl: Duration) -> Self {
        Self { inner: Mutex::new(Inner::default()), capacity_bytes, ttl }
    }

    /// Bytes an entry of `ids` costs.
    pub fn entry_bytes(ids: usize) -> usize {
        ids * 4 + ENTRY_OVERHEAD
    }

    /// Stores `ids` under every key in `keys`, for the prompt with `fingerprint`; evicts the
    /// oldest entries when over capacity. An entry larger than the whole capacity is refused.
    pub fn insert(&self, keys: Vec<CacheKey>, fingerprint: u64, ids: Vec<u32>, now: Instant) -> Evicted {
        let mut inner = self.inner.lock();
        let mut evicted = Evicted { ttl: inner.expire(now, self.ttl), capacity: 0 };
        let bytes = Self::entry_bytes(ids.len());
        if bytes > self.capacity_bytes || keys.is_empty() {
            evicted.capacity += u64::from(bytes > self.capacity_bytes);
            return evicted;
        }
        while inner.bytes + bytes > self.capacity_bytes {
            let Some(oldest) = inner.order.pop_front() else { break };
            if inner.remove(oldest).is_some() {
                evicted.capacity += 1;
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        for key in &keys {
            // A key already naming a live entry now names the newer one (request ids can be reused).
            inner.by_key.insert(key.clone(), id);
        }
        inner.bytes += bytes;
        inner.order.push_back(id);
        inner.entries.insert(id, Entry { ids, fingerprint, keys, inserted: now, bytes });
        evicted
    }

    /// Finds the entry for the first key (in order) that names one, and takes it when its
    /// fingerprint matches and it has not expired.
    pub fn take(&self, keys: &[CacheKey], fingerprint: u64, now: Instant) -> (Lookup, Evicted) {
        let mut inner = self.inner.lock();
        let Some(id) = keys.iter().find_map(|k| inner.by_key.get(k).copied()) else {
            let ttl = inner.expire(now, self.ttl);
            return (Lookup::Miss, Evicted { ttl, capacity: 0 });
        };
        let Some(entry) = inner.entries.get(&id) else { return (Lookup::Miss, Evicted::default()) };
        if now.saturating_duration_since(entry.inserted) >= self.ttl {
            inner.remove(id);
            let ttl = 1 + inner.expire(now, self.ttl);
            return (Lookup::Expired, Evicted { ttl, capacity: 0 });
        }
        if entry.fingerprint != fingerprint {
            return (Lookup::Mismatch, Evicted::default());
        }
        let ids = inner.remove(id).map(|e| e.ids).unwrap_or_default();
        (Lookup::Hit(ids), Evicted::default())
    }

    /// Drops expired entries now.
    pub fn purge(&self, now: Instant) -> Evicted {
        let ttl = self.inner.lock().expire(now, self.ttl);
        Evicted { ttl, capacity: 0 }
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.stats().0 == 0
    }

    /// (entries, bytes) held.
    pub fn stats(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.entries.len(), inner.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> CacheKey {
        CacheKey::RequestId(s.to_owned())
    }

    #[test]
    fn take_removes_the_entry() {
        let c = IdCache::new(1 << 20, Duration::from_secs(30));
        let t0 = Instant::now();
        c.insert(vec![key("a"), CacheKey::Fingerprint(7)], 7, vec![1, 2, 3], t0);
        assert_eq!(c.stats(), (1, IdCache::entry_bytes(3)));
        assert_eq!(c.take(&[key("a")], 7, t0).0, Lookup::Hit(vec![1, 2, 3]));
        assert_eq!(c.take(&[CacheKey::Fingerprint(7)], 7, t0).0, Lookup::Miss, "gone under every key");
        assert_eq!(c.stats(), (0, 0));
    }

    #[test]
    fn keys_are_tried_in_order() {
        let c = IdCache::new(1 << 20, Duration::from_secs(30));
        let t0 = Instant::now();
        c.insert(vec![CacheKey::RemoteRequestId("r".into())], 1, vec![1], t0);
        c.insert(vec![key("x")], 2, vec![2], t0);
        assert_eq!(c.take(&[CacheKey::RemoteRequestId("nope".into()), key("x")], 2, t0).0, Lookup::Hit(vec![2]));
    }

    #[test]
    fn a_different_prompt_never_gets_the_ids() {
        let c = IdCache::new(1 << 20, Duration::from_secs(30));
        let t0 = Instant::now();
        c.insert(vec![key("same-id")], 1, vec![1], t0);
        assert_eq!(c.take(&[key("same-id")], 2, t0).0, Lookup::Mismatch);
        assert_eq!(c.take(&[key("same-id")], 1, t0).0, Lookup::Hit(vec![1]));
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let c = IdCache::new(1 << 20, Duration::from_secs(30));
        let t0 = Instant::now();
        c.insert(vec![key("a")], 1, vec![1], t0);
        c.insert(vec![key("b")], 2, vec![2], t0 + Duration::from_secs(10));
        assert_eq!(c.take(&[key("a")], 1, t0 + Duration::from_secs(31)).0, Lookup::Expired);
        assert_eq!(c.purge(t0 + Duration::from_secs(39)), Evicted::default());
        assert_eq!(c.stats().0, 1);
        assert_eq!(c.purge(t0 + Duration::from_secs(40)).ttl, 1);
        assert_eq!(c.stats(), (0, 0));
    }

    #[test]
    fn capacity_evicts_oldest_and_refuses_giants() {
        let per = IdCache::entry_bytes(10);
        let c = IdCache::new(per * 3, Duration::from_secs(30));
        let t0 = Instant::now();
        for i in 0..5u32 {
            let ev = c.insert(vec![key(&i.to_string())], u64::from(i), vec![i; 10], t0);
            assert_eq!(ev.capacity, u64::from(i >= 3));
        }
        assert_eq!(c.stats(), (3, per * 3));
        assert_eq!(c.take(&[key("0")], 0, t0).0, Lookup::Miss);
        assert_eq!(c.take(&[key("4")], 4, t0).0, Lookup::Hit(vec![4; 10]));
        let ev = c.insert(vec![key("big")], 9, vec![0; 1000], t0);
        assert_eq!(ev.capacity, 1);
        assert!(c.stats().1 <= per * 3);
    }

    #[test]
    fn a_reused_key_points_at_the_newest_entry() {
        let c = IdCache::new(1 << 20, Duration::from_secs(30));
        let t0 = Instant::now();
        c.insert(vec![key("dup"), CacheKey::Fingerprint(1)], 1, vec![1], t0);
        c.insert(vec![key("dup"), CacheKey::Fingerprint(2)], 2, vec![2], t0);
        assert_eq!(c.take(&[key("dup")], 2, t0).0, Lookup::Hit(vec![2]));
        assert_eq!(c.take(&[key("dup"), CacheKey::Fingerprint(1)], 1, t0).0, Lookup::Hit(vec![1]));
    }
}
