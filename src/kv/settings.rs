//! One pool's `kv_events` settings, and where each endpoint's engine publishes its KV events
//! and answers replays (the pool's ports, or the endpoint's own, offset by its rank).
//!
//! vLLM binds (`tcp://*:PORT`) and each subscriber connects to `host:port+R` (rank R), the
//! replay DEALER to `host:replay_port+R`; an endpoint sharing its host with another has ports
//! of its own (`endpoint_ports`).

use std::collections::BTreeMap;
use std::time::Duration;

/// The index bound of a pool whose `max_blocks` is not set, before its engines say what they
/// hold, and the least it is sized to after.
pub const SIZED_FLOOR: usize = 250_000;

/// The most a bound sized from the engines reaches (about 2 GB of index).
pub const SIZED_CAP: usize = 16_000_000;

/// The index bound for engines that hold `engine_blocks` KV-cache blocks between them: a
/// quarter more (their events arrive after their evictions are decided), within
/// [`SIZED_FLOOR`] and [`SIZED_CAP`].
pub fn bound_for(engine_blocks: u64) -> usize {
    let wanted = engine_blocks.saturating_add(engine_blocks / 4);
    usize::try_from(wanted).unwrap_or(usize::MAX).clamp(SIZED_FLOOR, SIZED_CAP)
}

/// One pool's `kv_events` settings, as the config gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The publisher's port on each endpoint's host (rank R: `port + R`).
    pub port: u16,
    /// The replay endpoint's port (rank R: `replay_port + R`); none: gaps are not replayed.
    pub replay_port: Option<u16>,
    /// By endpoint address (`host:port`): a publisher port other than `port` (engines
    /// sharing a host bind ports of their own).
    pub endpoint_ports: BTreeMap<String, u16>,
    /// By endpoint address: a replay port other than `replay_port`.
    pub endpoint_replay_ports: BTreeMap<String, u16>,
    /// The topic subscribed to (vLLM's `topic`; empty: every message).
    pub topic: String,
    /// The engines' `PYTHONHASHSEED`, or vLLM's default seed when they run without it.
    pub hash_seed: String,
    /// The engines' `--block-size`.
    pub block_size: usize,
    /// Most (endpoint, block) entries the pool's index holds: the bound to start with.
    pub max_blocks: usize,
    /// True when `max_blocks` was configured; false when the bound follows what the engines
    /// say they hold ([`bound_for`]).
    pub fixed_bound: bool,
    /// How long an endpoint may stay disconnected before its entries are not believed.
    pub stale_after: Duration,
}

/// A pool endpoint to subscribe to: its name (`host:port` or `host:port#R`), host and rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddr {
    pub name: String,
    /// Its `host:port`, without the rank.
    pub addr: String,
    pub host: String,
    pub rank: u16,
}

impl EndpointAddr {
    /// From a pool endpoint's name; none when it is not `host:port` or `host:port#R`.
    pub fn parse(name: &str) -> Option<Self> {
        let (addr, ranks) = crate::addr::endpoint_ranks(name)?;
        let rank = match ranks.as_slice() {
            [None] => 0,
            [Some(r)] => u16::try_from(*r).ok()?,
            _ => return None,
        };
        Some(EndpointAddr {
            name: name.to_owned(),
            addr: addr.to_owned(),
            host: crate::addr::host_of(addr).to_owned(),
            rank,
        })
    }

    /// Its publisher's and replay endpoint's URLs under `settings` (its own ports where they
    /// name its address), each offset by its rank.
    pub(super) fn urls(&self, settings: &Settings) -> (String, Option<String>) {
        let port = settings.endpoint_ports.get(&self.addr).copied().unwrap_or(settings.port);
        let replay = settings.endpoint_replay_ports.get(&self.addr).copied().or(settings.replay_port);
        (self.url(port), replay.map(|p| self.url(p)))
    }

    fn url(&self, port: u16) -> String {
        let port = u32::from(port) + u32::from(self.rank);
        if self.host.contains(':') {
            format!("tcp://[{}]:{port}", self.host)
        } else {
            format!("tcp://{}:{port}", self.host)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_from_the_engines_adds_a_quarter_within_its_floor_and_cap() {
        assert_eq!(bound_for(0), SIZED_FLOOR, "before any read, or tiny engines");
        assert_eq!(bound_for(800_000), 1_000_000);
        assert_eq!(bound_for(u64::MAX), SIZED_CAP);
    }

    #[test]
    fn endpoint_addresses_offset_the_port_by_rank() {
        let plain = EndpointAddr::parse("10.0.0.1:8000");
        assert_eq!(plain.as_ref().map(|a| a.url(5557)), Some("tcp://10.0.0.1:5557".to_owned()));
        let ranked = EndpointAddr::parse("[::1]:8000#3");
        assert_eq!(ranked.as_ref().map(|a| a.url(5557)), Some("tcp://[::1]:5560".to_owned()));
        assert_eq!(EndpointAddr::parse("host:8000#0-3"), None, "one rank per endpoint");
        assert_eq!(EndpointAddr::parse("nope"), None);
    }

    /// Engines sharing a host publish on ports of their own: an endpoint named in
    /// `endpoint_ports` / `endpoint_replay_ports` is subscribed there (rank offset kept), the
    /// others on the pool's ports.
    #[test]
    fn an_endpoint_with_ports_of_its_own_is_subscribed_there() {
        let settings = Settings {
            port: 5557,
            replay_port: Some(5558),
            endpoint_ports: BTreeMap::from([("127.0.0.1:8300".to_owned(), 5567)]),
            endpoint_replay_ports: BTreeMap::from([("127.0.0.1:8300".to_owned(), 5568)]),
            topic: String::new(),
            hash_seed: "0".into(),
            block_size: 32,
            max_blocks: 10,
            fixed_bound: true,
            stale_after: Duration::from_secs(1),
        };
        let urls = |name: &str| EndpointAddr::parse(name).map(|a| a.urls(&settings));
        let url = |s: &str| s.to_owned();
        assert_eq!(urls("127.0.0.1:8100"), Some((url("tcp://127.0.0.1:5557"), Some(url("tcp://127.0.0.1:5558")))));
        assert_eq!(urls("127.0.0.1:8300"), Some((url("tcp://127.0.0.1:5567"), Some(url("tcp://127.0.0.1:5568")))));
        assert_eq!(urls("127.0.0.1:8300#2"), Some((url("tcp://127.0.0.1:5569"), Some(url("tcp://127.0.0.1:5570")))));
    }
}
