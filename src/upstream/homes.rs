//! Where each stored Responses answer lives: vLLM keeps a response in the memory of the
//! engine that decoded it, so a follow-up naming it (`previous_response_id`,
//! `GET /v1/responses/{id}`) must reach that endpoint.
//!
//! Bounded (the oldest entry is forgotten first), and an endpoint's entries go when a health
//! poll finds it down: an engine that restarted has an empty store.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};

/// Entries kept: a few MB (an id and an address each), far past the answers a decode pod
/// keeps in memory in a day of agentic traffic.
pub const RESPONSE_HOMES: usize = 65_536;

/// Response id → the `host:port` of the decode endpoint that stored it.
#[derive(Debug)]
pub struct ResponseHomes {
    capacity: usize,
    inner: Mutex<Homes>,
}

#[derive(Debug, Default)]
struct Homes {
    by_id: HashMap<String, String>,
    /// Ids oldest first (an id may stand here after it was forgotten: skipped on eviction).
    order: VecDeque<String>,
}

impl Default for ResponseHomes {
    fn default() -> Self {
        Self::new(RESPONSE_HOMES)
    }
}

impl ResponseHomes {
    /// Keeping at most `capacity` entries.
    pub fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), inner: Mutex::default() }
    }

    /// `endpoint` stored the response `id`.
    pub fn remember(&self, id: &str, endpoint: &str) {
        let mut homes = self.inner.lock();
        if homes.by_id.insert(id.to_owned(), endpoint.to_owned()).is_none() {
            homes.order.push_back(id.to_owned());
        }
        while homes.by_id.len() > self.capacity {
            let Some(oldest) = homes.order.pop_front() else { break };
            homes.by_id.remove(&oldest);
        }
        // Forgotten ids left in `order` are dropped once they are most of it.
        if homes.order.len() > 2 * self.capacity {
            let Homes { by_id, order } = &mut *homes;
            order.retain(|id| by_id.contains_key(id));
        }
    }

    /// The endpoint that stored `id`, if known.
    pub fn home(&self, id: &str) -> Option<String> {
        self.inner.lock().by_id.get(id).cloned()
    }

    /// Forgets every response `endpoint` stored (it was seen down).
    pub fn forget_endpoint(&self, endpoint: &str) {
        self.inner.lock().by_id.retain(|_, home| home != endpoint);
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.inner.lock().by_id.len()
    }

    /// True when no entry is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_until_the_oldest_is_pushed_out_or_its_endpoint_goes_down() {
        let homes = ResponseHomes::new(2);
        homes.remember("a", "e1:1");
        homes.remember("b", "e2:1");
        assert_eq!(homes.home("a").as_deref(), Some("e1:1"));
        homes.remember("c", "e1:1");
        assert_eq!((homes.home("a"), homes.len()), (None, 2), "the oldest went");
        homes.forget_endpoint("e1:1");
        assert_eq!((homes.home("c"), homes.home("b").as_deref()), (None, Some("e2:1")));
        for i in 0..100 {
            homes.remember(&format!("x{i}"), "e3:1");
        }
        assert_eq!(homes.len(), 2);
        assert!(homes.inner.lock().order.len() <= 4, "the order list stays bounded");
    }
}
