//! A discovered pool's DNS name: the port and ranks each of its addresses serves, and when it
//! is due for its next lookup (`discovery` looks it up; `pool` expands its ranks).

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// A pool's DNS name, the port and ranks each of its addresses serves, and when it was last
/// looked up.
#[derive(Debug)]
pub struct Discovery {
    name: String,
    /// The port each address serves on.
    pub port: u16,
    ranks: Vec<Option<u32>>,
    interval: Duration,
    last_lookup: Mutex<Option<Instant>>,
}

impl Discovery {
    /// The discovery a pool's `discover` entry (`name:port`, `name:port#R`,
    /// `name:port#FIRST-LAST`) describes, looked up every `interval`; `None` when the entry is
    /// malformed (config validation refuses it first).
    pub fn parse(entry: &str, interval: Duration) -> Option<Self> {
        let (addr, ranks) = crate::addr::endpoint_ranks(entry)?;
        let (name, port) = addr.rsplit_once(':')?;
        Some(Self { name: name.to_owned(), port: port.parse().ok()?, ranks, interval, last_lookup: Mutex::new(None) })
    }

    /// The name looked up.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ranks each address serves (`[None]`: the whole server).
    pub fn ranks(&self) -> &[Option<u32>] {
        &self.ranks
    }

    /// True when a lookup is due at `now` (never looked up, or `interval` ago); marks it
    /// looked up then.
    pub fn take_turn(&self, now: Instant) -> bool {
        let mut last = self.last_lookup.lock();
        let due = last.is_none_or(|at| now.saturating_duration_since(at) >= self.interval);
        if due {
            *last = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_discover_entry_gives_its_name_port_and_ranks() {
        let d = Discovery::parse("vllm-prefill.llm.svc.cluster.local:8100#0-3", Duration::from_secs(5)).unwrap();
        assert_eq!((d.name(), d.port), ("vllm-prefill.llm.svc.cluster.local", 8100));
        assert_eq!(d.ranks(), &[Some(0), Some(1), Some(2), Some(3)]);
        let plain = Discovery::parse("engines:8000", Duration::from_secs(5)).unwrap();
        assert_eq!(plain.ranks(), &[None]);
        assert!(Discovery::parse("engines", Duration::from_secs(5)).is_none());
    }

    #[test]
    fn a_lookup_is_due_once_per_interval() {
        let d = Discovery::parse("engines:8000", Duration::from_secs(5)).unwrap();
        let t0 = Instant::now();
        assert!(d.take_turn(t0), "never looked up");
        assert!(!d.take_turn(t0 + Duration::from_secs(4)));
        assert!(d.take_turn(t0 + Duration::from_secs(5)));
        assert!(!d.take_turn(t0 + Duration::from_secs(6)));
    }
}
