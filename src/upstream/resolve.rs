//! Endpoint names to socket addresses, remembered for a short while: a hostname endpoint (a
//! Kubernetes service name) is looked up once per [`RESOLVE_TTL`], not on every leg
//! (`getaddrinfo` on tokio's blocking pool); an IP literal is parsed, never looked up.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a looked-up address is used before the name is looked up again: short enough
/// that a service whose address changed (a pod replaced behind a headless service) is
/// followed within seconds, long enough that a busy route looks up a few times a minute.
pub const RESOLVE_TTL: Duration = Duration::from_secs(5);

/// Most names remembered: configured endpoints are few, but header-named prefillers come
/// from requests, so the table must not grow with them. A full table remembers nothing new
/// (those names are looked up per leg, as before).
const MAX_NAMES: usize = 256;

/// Why a name gave no address.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ResolveError(pub String);

/// The remembered names.
#[derive(Debug, Default)]
pub struct Resolver {
    names: Mutex<HashMap<String, (SocketAddr, Instant)>>,
    lookups: AtomicU64,
}

impl Resolver {
    /// The address of `addr` (`host:port`): parsed when it is an IP literal, else remembered
    /// or looked up.
    ///
    /// # Errors
    /// [`ResolveError`] when the lookup fails or yields no address.
    pub async fn resolve(&self, addr: &str) -> Result<SocketAddr, ResolveError> {
        if let Ok(ip) = addr.parse::<SocketAddr>() {
            return Ok(ip);
        }
        if let Some(known) = self.remembered(addr) {
            return Ok(known);
        }
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let found = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| ResolveError(e.to_string()))?
            .next()
            .ok_or_else(|| ResolveError("no address".into()))?;
        self.remember(addr, found);
        Ok(found)
    }

    /// Drops what is remembered of `addr` (its connect failed: the next leg looks it up).
    pub fn forget(&self, addr: &str) {
        self.names.lock().remove(addr);
    }

    /// Lookups made so far (tests).
    pub fn lookups(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }

    fn remembered(&self, addr: &str) -> Option<SocketAddr> {
        let names = self.names.lock();
        names.get(addr).filter(|(_, at)| at.elapsed() < RESOLVE_TTL).map(|(a, _)| *a)
    }

    fn remember(&self, addr: &str, found: SocketAddr) {
        let mut names = self.names.lock();
        if names.len() >= MAX_NAMES && !names.contains_key(addr) {
            names.retain(|_, (_, at)| at.elapsed() < RESOLVE_TTL);
            if names.len() >= MAX_NAMES {
                return;
            }
        }
        names.insert(addr.to_owned(), (found, Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_name_is_looked_up_once_until_forgotten_and_an_ip_never() {
        let r = Resolver::default();
        assert_eq!(r.resolve("127.0.0.1:8200").await.unwrap(), "127.0.0.1:8200".parse().unwrap());
        assert_eq!(r.lookups(), 0);
        let first = r.resolve("localhost:8200").await.unwrap();
        assert!(first.ip().is_loopback() && first.port() == 8200, "{first}");
        assert_eq!(r.resolve("localhost:8200").await.unwrap(), first);
        assert_eq!(r.lookups(), 1);
        r.forget("localhost:8200");
        r.resolve("localhost:8200").await.unwrap();
        assert_eq!(r.lookups(), 2);
    }

    #[tokio::test]
    async fn a_full_table_remembers_no_new_name() {
        let r = Resolver::default();
        for i in 0..MAX_NAMES {
            r.remember(&format!("h{i}:1"), "127.0.0.1:1".parse().unwrap());
        }
        r.resolve("localhost:9").await.unwrap();
        r.resolve("localhost:9").await.unwrap();
        assert_eq!(r.lookups(), 2);
        assert_eq!(r.names.lock().len(), MAX_NAMES);
    }
}
