//! Pools whose endpoints a DNS name gives (`discover`, a Kubernetes headless Service): what
//! the name is (`dns_name`), the resolver that asks it ([`Discoverer`]), and the round the
//! upkeep runs before each health round ([`round`]).
//!
//! The resolver is hickory, reading `/etc/resolv.conf` like getaddrinfo, or the one server
//! `upstream.dns_server` names.
//!
//! Why this shape: the upkeep already runs every health interval, reads the current state
//! each round and stops on shutdown, so discovery rides on it instead of owning a task a
//! reload would have to stop; a pool due for a lookup is looked up (each bounded by
//! [`LOOKUP_LIMIT`], all pools at once), its members replaced as one snapshot (those that
//! stay keep their state), and the health round that follows probes the newcomers, which
//! join unhealthy so a healthy member is chosen before them. A failed lookup or an empty
//! answer keeps the last set: a DNS outage or a Service briefly without ready pods must not
//! empty a pool that still has engines serving.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_resolver::config::{NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;

use super::homes::ResponseHomes;
use super::metrics::UpstreamMetrics;
use super::pool::Pool;
use crate::metrics::DnsLookup;

/// Longest one lookup takes (the resolver's own tries included): a DNS server that does not
/// answer delays a round by this, once.
pub const LOOKUP_LIMIT: Duration = Duration::from_secs(3);

/// How long one query to the named `upstream.dns_server` waits before its one retry.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a lookup gave no endpoints.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The resolver could not be set up (no readable `/etc/resolv.conf`, or a bad server).
    #[error("DNS resolver: {0}")]
    Resolver(String),
    /// The lookup failed: no server answered, or one answered with an error.
    #[error("lookup of `{name}` failed: {reason}")]
    Failed {
        /// The name asked.
        name: String,
        /// What the resolver said.
        reason: String,
    },
    /// The lookup took longer than [`LOOKUP_LIMIT`].
    #[error("lookup of `{0}` got no answer within {LOOKUP_LIMIT:?}")]
    Timeout(String),
    /// The name exists with no address, or does not exist.
    #[error("`{0}` has no address")]
    Empty(String),
}

impl DiscoveryError {
    /// Its `discovery_lookups_total` result.
    pub fn result(&self) -> DnsLookup {
        match self {
            Self::Empty(_) => DnsLookup::Empty,
            Self::Resolver(_) | Self::Failed { .. } | Self::Timeout(_) => DnsLookup::Failed,
        }
    }
}

/// Asks DNS for the addresses of discovered pools' names.
pub struct Discoverer {
    resolver: TokioResolver,
    /// The server it asks (`None`: those of `/etc/resolv.conf`).
    server: Option<SocketAddr>,
}

impl std::fmt::Debug for Discoverer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discoverer").field("server", &self.server).finish_non_exhaustive()
    }
}

impl Discoverer {
    /// A resolver asking `server` (`ip:port`, over UDP then TCP, with no search domain and no
    /// hosts file), or, without one, the nameservers, search domains and options of
    /// `/etc/resolv.conf`. Answers are not cached: each lookup asks.
    ///
    /// # Errors
    /// [`DiscoveryError::Resolver`] when `/etc/resolv.conf` cannot be read.
    pub fn new(server: Option<SocketAddr>) -> Result<Self, DiscoveryError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match server {
            Some(at) => {
                let mut ns = NameServerConfig::udp_and_tcp(at.ip());
                ns.connections.iter_mut().for_each(|c| c.port = at.port());
                let mut builder =
                    TokioResolver::builder_with_config(ResolverConfig::from_name_servers(vec![ns]), provider);
                let options: &mut ResolverOpts = builder.options_mut();
                options.timeout = QUERY_TIMEOUT;
                options.attempts = 1;
                options.use_hosts_file = hickory_resolver::config::ResolveHosts::Never;
                builder
            }
            None => TokioResolver::builder(provider).map_err(|e| DiscoveryError::Resolver(e.to_string()))?,
        };
        builder.options_mut().cache_size = 0;
        let resolver = builder.build().map_err(|e| DiscoveryError::Resolver(e.to_string()))?;
        Ok(Self { resolver, server })
    }

    /// The server it asks (`None`: those of `/etc/resolv.conf`).
    pub fn server(&self) -> Option<SocketAddr> {
        self.server
    }

    /// The addresses of `name` now (IPv4, else IPv6), within [`LOOKUP_LIMIT`].
    ///
    /// # Errors
    /// [`DiscoveryError::Failed`], [`DiscoveryError::Timeout`], or [`DiscoveryError::Empty`]
    /// when the name has no address.
    pub async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, DiscoveryError> {
        self.resolver.clear_cache();
        let answer = tokio::time::timeout(LOOKUP_LIMIT, self.resolver.lookup_ip(name))
            .await
            .map_err(|_| DiscoveryError::Timeout(name.to_owned()))?;
        let ips: Vec<IpAddr> = match answer {
            Ok(found) => found.iter().collect(),
            Err(e) if e.is_no_records_found() => Vec::new(),
            Err(e) => return Err(DiscoveryError::Failed { name: name.to_owned(), reason: e.to_string() }),
        };
        if ips.is_empty() {
            return Err(DiscoveryError::Empty(name.to_owned()));
        }
        Ok(ips)
    }
}

/// Looks up the name of every discovered pool of `pools` that is due, all at once, and
/// replaces each one's members with the answer: newcomers get their error series, leavers
/// lose their series and their stored-answer homes (requests holding them finish). A failure
/// or an empty answer keeps the members, counted and logged.
pub async fn round(
    discoverer: &Arc<Discoverer>,
    pools: &[Arc<Pool>],
    metrics: &UpstreamMetrics,
    homes: &Arc<ResponseHomes>,
) {
    let now = Instant::now();
    let mut lookups = tokio::task::JoinSet::new();
    for pool in pools.iter().filter(|p| p.discovery().is_some_and(|d| d.take_turn(now))) {
        let (discoverer, pool, metrics, homes) =
            (Arc::clone(discoverer), Arc::clone(pool), metrics.clone(), Arc::clone(homes));
        lookups.spawn(async move { refresh(&discoverer, &pool, &metrics, &homes).await });
    }
    while lookups.join_next().await.is_some() {}
}

/// One pool's lookup and what follows from its answer.
async fn refresh(discoverer: &Discoverer, pool: &Pool, metrics: &UpstreamMetrics, homes: &ResponseHomes) {
    let Some(discovery) = pool.discovery() else { return };
    let ips = match discoverer.lookup(discovery.name()).await {
        Ok(ips) => ips,
        Err(e) => {
            metrics.discovery_lookup(&pool.name, e.result());
            let kept = pool.endpoints().len();
            tracing::warn!(pool = %pool.name, error = %e, endpoints_kept = kept, "discovery lookup gave no endpoints; the last set stays");
            return;
        }
    };
    metrics.discovery_lookup(&pool.name, DnsLookup::Ok);
    let addrs: Vec<SocketAddr> = ips.into_iter().map(|ip| SocketAddr::new(ip, discovery.port)).collect();
    let change = pool.replace_members(&addrs);
    for e in &change.joined {
        e.count_errors_in(metrics.endpoint(&pool.name, &e.name));
        tracing::info!(pool = %pool.name, endpoint = %e.name, "endpoint discovered: joins once healthy");
    }
    for e in &change.left {
        metrics.forget_endpoint(&pool.name, &e.name);
        homes.forget_endpoint(&e.name);
        tracing::info!(pool = %pool.name, endpoint = %e.name, in_flight = e.inflight(), "endpoint left its DNS name: chosen no more");
    }
    metrics.pool_endpoints(&pool.name, pool.endpoints().len());
}
