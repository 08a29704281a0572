//! The one validation pass over a parsed [`Config`]: bounds of counts, addresses, names, and
//! the rules that span fields (pool references, a route's mode and its prefill, listeners that
//! must differ, a cache-aware pool hashing as its events). Durations and block sizes carry
//! their ranges in their types and were checked as they were read. Every problem is placed by
//! key path; a key whose value did not parse is not checked again.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;

use tracing_subscriber::filter::LevelFilter;

use super::file::{CacheAware, Config, Pool, PoolKvEvents, PoolTls, Prefill, Route};
use super::values::{AllowTarget, Balance, LocalIdsMode, Mode};
use crate::addr::{endpoint_ranks, MAX_RANKS_PER_ENTRY};
use crate::toml_read::{Doc, Problem};

// Upper bounds: a value past these is a typo, not a setting.
const MAX_THREADS: u64 = 256;
const MAX_IN_FLIGHT: u64 = 1 << 20;
const MAX_BODY_BYTES: u64 = 1 << 30;
/// An SSE event limit below this would cut ordinary token events (a few KB with logprobs).
const MIN_SSE_EVENT_BYTES: u64 = 64 * 1024;
const MAX_CACHE_BYTES: u64 = 1 << 40;
/// pingora refuses more than 256 header fields and 1 MiB of head itself.
const MAX_HEADER_COUNT: u64 = 256;
const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Where requests no route matches go when `defaults.passthrough_pool` is not written.
const PASSTHROUGH_POOL: &str = "decode";

/// Adds to `problems` what is wrong with `config` (`problems` holds the parse's).
pub(super) fn check(config: &Config, doc: &Doc<'_>, problems: &mut Vec<Problem>) {
    let parsed: BTreeSet<String> = problems.iter().map(|p| p.key.clone()).collect();
    let mut ck = Checker { doc, parsed, problems };
    check_server(&mut ck, config);
    check_limits(&mut ck, config);
    for (name, pool) in &config.pools {
        check_pool(&mut ck, &format!("pools.{name}"), pool);
    }
    if config.pools.is_empty() {
        ck.report(doc.at_value("pools", "at least one pool is needed"));
    }
    if doc.has("defaults.passthrough_pool") {
        ck.pool_ref(config, "defaults.passthrough_pool", &config.defaults.passthrough_pool);
    } else if !config.pools.contains_key(PASSTHROUGH_POOL) {
        let message = format!("not set and there is no pool named `{PASSTHROUGH_POOL}`");
        ck.report(Problem { line: 0, column: 0, key: "defaults.passthrough_pool".into(), message });
    }
    let mut names = BTreeSet::new();
    for (i, route) in config.routes.iter().enumerate() {
        check_route(&mut ck, config, &format!("routes[{i}]"), route, &mut names);
    }
    if let Some(tracing) = &config.tracing {
        ck.required("tracing", "endpoint");
        let rest = tracing.endpoint.strip_prefix("http://").filter(|r| !r.is_empty() && !r.starts_with('/'));
        if rest.is_none() && doc.has("tracing.endpoint") {
            let url = &tracing.endpoint;
            let message = format!("`{url}` is not an http:// URL (run a collector beside tokenonce for TLS)");
            ck.at("tracing.endpoint", message);
        }
        if !(0.0..=1.0).contains(&tracing.sampling_ratio) {
            ck.at("tracing.sampling_ratio", format!("{} is not between 0.0 and 1.0", tracing.sampling_ratio));
        }
        if tracing.service_name.trim().is_empty() {
            ck.at("tracing.service_name", "must not be empty");
        }
    }
}

/// Records problems, leaving alone keys whose value did not parse.
struct Checker<'a, 'd> {
    doc: &'a Doc<'d>,
    parsed: BTreeSet<String>,
    problems: &'a mut Vec<Problem>,
}

impl Checker<'_, '_> {
    fn report(&mut self, problem: Problem) {
        if !self.parsed.contains(&problem.key) {
            self.problems.push(problem);
        }
    }

    /// A problem at the value of `path`.
    fn at(&mut self, path: &str, message: impl Into<String>) {
        let problem = self.doc.at_value(path, message);
        self.report(problem);
    }

    /// `table.name` must be written.
    fn required(&mut self, table: &str, name: &str) -> bool {
        let present = self.doc.has(&format!("{table}.{name}"));
        if !present {
            let problem = self.doc.at_table(table, name, "required key is missing");
            self.report(problem);
        }
        present
    }

    fn range(&mut self, path: &str, value: u64, range: RangeInclusive<u64>) {
        if !range.contains(&value) {
            self.at(path, format!("must be between {} and {}", range.start(), range.end()));
        }
    }

    fn address(&mut self, path: &str, text: &str) -> bool {
        let ok = text.parse::<SocketAddr>().is_ok();
        if !ok {
            self.at(path, format!("`{text}` is not an ip:port address"));
        }
        ok
    }

    fn pool_ref(&mut self, config: &Config, path: &str, name: &str) {
        if !config.pools.contains_key(name) {
            let known: Vec<&str> = config.pools.keys().map(String::as_str).collect();
            self.at(path, format!("no pool named `{name}` (pools: {})", known.join(", ")));
        }
    }
}

/// Width of a count in the file; every count fits.
fn n(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

fn check_server(ck: &mut Checker<'_, '_>, config: &Config) {
    let s = &config.server;
    ck.address("server.listen", &s.listen);
    ck.address("server.admin_listen", &s.admin_listen);
    if let Some(why) = log_filter_problem(&s.log_level) {
        ck.at("server.log_level", why);
    }
    let Some(tls) = &s.tls else { return };
    ck.required("server.tls", "cert_file");
    ck.required("server.tls", "key_file");
    if ck.required("server.tls", "listen") && ck.address("server.tls.listen", &tls.listen) {
        let plain = [&s.listen, &s.admin_listen];
        if plain.contains(&&tls.listen) && !tls.listen.ends_with(":0") {
            ck.at("server.tls.listen", "must differ from `server.listen` and `server.admin_listen`");
        }
    }
}

/// The bounded numbers outside routes.
fn check_limits(ck: &mut Checker<'_, '_>, config: &Config) {
    let (s, u, c) = (&config.server, &config.upstream, &config.cache);
    ck.range("server.threads", n(s.threads), 1..=MAX_THREADS);
    ck.range("server.max_header_count", n(s.max_header_count), 1..=MAX_HEADER_COUNT);
    ck.range("server.max_header_bytes", n(s.max_header_bytes), 1..=MAX_HEADER_BYTES);
    ck.range("server.max_in_flight", n(s.max_in_flight), 0..=MAX_IN_FLIGHT);
    if let Some(server) = &u.dns_server {
        ck.address("upstream.dns_server", server);
    }
    ck.range("upstream.eject_after_failures", u64::from(u.eject_after_failures), 0..=1000);
    ck.range("cache.capacity_bytes", n(c.capacity_bytes), 1..=MAX_CACHE_BYTES);
}

/// Why `text` is not a log filter we accept: tracing's `EnvFilter` syntax, and a bare word
/// must be a level (tracing would read `warning` as a target and log nothing else).
fn log_filter_problem(text: &str) -> Option<String> {
    if text.trim().is_empty() {
        return Some("empty filter (`off` turns logging off)".into());
    }
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(text) {
        return Some(format!("not a tracing filter: {e}"));
    }
    text.split(',').map(str::trim).filter(|d| !d.is_empty() && !d.contains(['=', '['])).find_map(|d| {
        d.parse::<LevelFilter>().is_err().then(|| {
            format!("`{d}` is not a level (off, error, warn, info, debug, trace); a target needs `target=level`")
        })
    })
}

/// A pool: its endpoints (or the name that discovers them), its TLS, local ids, KV events
/// and cache-aware choice.
fn check_pool(ck: &mut Checker<'_, '_>, path: &str, pool: &Pool) {
    check_endpoints(ck, path, pool);
    if let Some(tls) = &pool.tls {
        check_pool_tls(ck, &format!("{path}.tls"), tls, endpoint_by_ip(pool));
    }
    check_local_ids(ck, path, pool);
    if let Some(kv) = &pool.kv_events {
        check_kv_events(ck, &format!("{path}.kv_events"), pool, kv);
    }
    check_cache_aware(ck, &format!("{path}.cache_aware"), &pool.cache_aware);
    if let (Some(kv), Balance::CacheAware) = (&pool.kv_events, pool.balance) {
        check_hashed_as_events(ck, path, &pool.cache_aware, kv);
    }
}

/// `endpoints` (required, unless `discover` names them), each `host:port` with its ranks.
fn check_endpoints(ck: &mut Checker<'_, '_>, path: &str, pool: &Pool) {
    let endpoints = format!("{path}.endpoints");
    if let Some(discover) = &pool.discover {
        check_discovery(ck, path, pool, discover);
    } else if ck.required(path, "endpoints") && pool.endpoints.is_empty() {
        ck.at(&endpoints, "needs at least one host:port");
    }
    for (i, endpoint) in pool.endpoints.iter().enumerate() {
        if endpoint_ranks(endpoint).is_none() {
            let message = format!("`{endpoint}` is not host:port, host:port#RANK or host:port#FIRST-LAST (at most {MAX_RANKS_PER_ENTRY} ranks)");
            ck.at(&format!("{endpoints}[{i}]"), message);
        }
    }
}

/// Why the pool's engines may be reached by IP address (which verified TLS needs a
/// `server_name` for), as a sentence; `None` when they are all named.
fn endpoint_by_ip(pool: &Pool) -> Option<String> {
    let ip = pool.endpoints.iter().find(|e| crate::addr::host_of(e).parse::<IpAddr>().is_ok());
    let ip = ip.map(|e| format!("endpoint `{e}` is an IP address"));
    ip.or_else(|| pool.discover.as_ref().map(|_| "discovered endpoints are IP addresses".to_owned()))
}

/// `local_ids` needs the pool's tokenizer; its counts and share are bounded.
fn check_local_ids(ck: &mut Checker<'_, '_>, path: &str, pool: &Pool) {
    if pool.local_ids != LocalIdsMode::Off && pool.tokenizer.is_none() {
        ck.at(&format!("{path}.local_ids"), "needs the pool's `tokenizer` (its model folder holds the chat template)");
    }
    ck.range(&format!("{path}.local_ids_verify_after"), u64::from(pool.local_ids_verify_after), 1..=1_000_000);
    if !(0.0..=1.0).contains(&pool.local_ids_recheck) {
        ck.at(&format!("{path}.local_ids_recheck"), "must be between 0 and 1");
    }
}

/// `[pools.NAME.kv_events]` at `at`: a port (required), ports every rank can offset, and a
/// bounded index.
fn check_kv_events(ck: &mut Checker<'_, '_>, at: &str, pool: &Pool, kv: &PoolKvEvents) {
    if ck.required(at, "port") {
        ck.range(&format!("{at}.port"), u64::from(kv.port), 1..=65535);
    }
    check_kv_ports(ck, at, pool, kv);
    if let Some(max_blocks) = kv.max_blocks {
        ck.range(&format!("{at}.max_blocks"), max_blocks, 1..=100_000_000);
    }
}

/// vLLM offsets the publisher's ports by the rank: the highest rank's must still be a port. A
/// per-endpoint port names an endpoint the pool lists (a discovered pool's engines share
/// `port`).
fn check_kv_ports(ck: &mut Checker<'_, '_>, at: &str, pool: &Pool, kv: &PoolKvEvents) {
    let top_rank = pool.endpoints.iter().filter_map(|e| endpoint_ranks(e)).flat_map(|(_, r)| r).flatten().max();
    let top = u64::from(top_rank.unwrap_or(0));
    for (key, port) in [("port", Some(kv.port)), ("replay_port", kv.replay_port)] {
        if let Some(port) = port.filter(|p| *p > 0 && u64::from(*p) + top > 65535) {
            ck.at(&format!("{at}.{key}"), format!("{port} + rank {top} is past 65535"));
        }
    }
    let listed: Vec<&str> = pool.endpoints.iter().filter_map(|e| endpoint_ranks(e)).map(|(addr, _)| addr).collect();
    for (key, ports) in [("endpoint_ports", &kv.endpoint_ports), ("endpoint_replay_ports", &kv.endpoint_replay_ports)] {
        for (endpoint, port) in ports {
            if !listed.contains(&endpoint.as_str()) {
                ck.at(&format!("{at}.{key}"), format!("`{endpoint}` is not a host:port of the pool's `endpoints`"));
            }
            if *port == 0 || u64::from(*port) + top > 65535 {
                ck.at(&format!("{at}.{key}"), format!("{port} for `{endpoint}` is not a port (rank {top} added)"));
            }
        }
    }
}

/// Largest weight of a cache-aware score term.
const MAX_WEIGHT: f64 = 1000.0;

/// `[pools.NAME.cache_aware]` at `at`: bounded weights and index.
fn check_cache_aware(ck: &mut Checker<'_, '_>, at: &str, cache_aware: &CacheAware) {
    for (key, weight) in [("prefix_weight", cache_aware.prefix_weight), ("load_weight", cache_aware.load_weight)] {
        if !(0.0..=MAX_WEIGHT).contains(&weight) {
            ck.at(&format!("{at}.{key}"), format!("must be between 0 and {MAX_WEIGHT}"));
        }
    }
    ck.range(&format!("{at}.max_blocks"), u64::from(cache_aware.max_blocks), 1..=100_000_000);
}

/// A cache-aware pool with KV events: the events name blocks as the engines hash them, and a
/// chain hashed otherwise never matches, so its block size and seed are the events'. A pair
/// where either value did not parse is not compared (its default would be named as if written).
fn check_hashed_as_events(ck: &mut Checker<'_, '_>, path: &str, cache_aware: &CacheAware, kv: &PoolKvEvents) {
    let both_read = |ck: &Checker<'_, '_>, key: &str| {
        [format!("{path}.cache_aware.{key}"), format!("{path}.kv_events.{key}")].iter().all(|k| !ck.parsed.contains(k))
    };
    if cache_aware.block_size != kv.block_size && both_read(ck, "block_size") {
        let message = format!(
            "is {} but kv_events.block_size is {}: both are the engines' --block-size",
            cache_aware.block_size, kv.block_size
        );
        ck.at(&format!("{path}.cache_aware.block_size"), message);
    }
    if cache_aware.hash_seed != kv.hash_seed && both_read(ck, "hash_seed") {
        let message = format!(
            "is `{}` but kv_events.hash_seed is `{}`: both are the engines' PYTHONHASHSEED",
            cache_aware.hash_seed, kv.hash_seed
        );
        ck.at(&format!("{path}.cache_aware.hash_seed"), message);
    }
}

/// A pool's `discover`: instead of `endpoints`, a DNS name with a port (and ranks).
fn check_discovery(ck: &mut Checker<'_, '_>, path: &str, pool: &Pool, discover: &str) {
    let key = format!("{path}.discover");
    if !pool.endpoints.is_empty() {
        ck.at(&key, "a pool takes `endpoints` or `discover`, not both");
    }
    let named = endpoint_ranks(discover).is_some_and(|(addr, _)| crate::addr::host_of(addr).parse::<IpAddr>().is_err());
    if !named {
        let message = format!("`{discover}` is not name:port, name:port#RANK or name:port#FIRST-LAST with a DNS name (at most {MAX_RANKS_PER_ENTRY} ranks)");
        ck.at(&key, message);
    }
}

/// `[pools.NAME.tls]` (and an allowlist entry's `tls`): a client certificate with its key, and
/// a name to check when verification is on and the peer is named by IP (`ip`: which, as a
/// sentence; OpenSSL checks DNS names).
fn check_pool_tls(ck: &mut Checker<'_, '_>, path: &str, tls: &PoolTls, ip: Option<String>) {
    let name_key = format!("{path}.server_name");
    if let Some(name) = &tls.server_name {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || ".-_*".contains(c)) {
            ck.at(&name_key, format!("`{name}` is not a DNS name"));
        }
    }
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        let problem =
            ck.doc.at_table(path, "cert_file", "`cert_file` and `key_file` go together (mTLS client certificate)");
        ck.report(problem);
    }
    if tls.verify && tls.server_name.is_none() {
        if let Some(ip) = ip {
            let why = format!("{ip}: set `server_name` to the DNS name in the engines' certificate");
            let problem = ck.doc.at_table(path, "server_name", why);
            ck.report(problem);
        }
    }
}

fn check_route(ck: &mut Checker<'_, '_>, config: &Config, path: &str, route: &Route, names: &mut BTreeSet<String>) {
    let key = |name: &str| format!("{path}.{name}");
    if ck.required(path, "name") {
        let name = &route.name;
        if !names.insert(name.clone()) {
            ck.at(&key("name"), format!("duplicate route name `{name}`"));
        }
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            ck.at(&key("name"), "must be non-empty [A-Za-z0-9._-]");
        }
    }
    let mode_known = ck.required(path, "mode") && !ck.parsed.contains(&key("mode"));
    for (i, p) in route.matcher.paths.iter().enumerate() {
        if !p.starts_with('/') {
            ck.at(&key(&format!("match.paths[{i}]")), "a path starts with /");
        }
    }
    for name in route.matcher.headers.keys() {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            ck.at(&key(&format!("match.headers.{name}")), format!("`{name}` is not a header name"));
        }
    }
    let prefill_key = key("prefill");
    match (&route.prefill, mode_known.then_some(route.mode)) {
        (None, Some(Mode::Orchestrate)) => {
            let problem = ck.doc.at_table(path, "prefill", "orchestrate needs `prefill` (a pool or a header)");
            ck.report(problem);
        }
        (Some(_), Some(Mode::Passthrough)) => ck.at(&prefill_key, "passthrough routes have no prefill"),
        (Some(p), Some(Mode::Relay)) if p.header.is_some() && p.pool.is_none() => {
            ck.at(&prefill_key, "relay routes take only `prefill = { pool = ... }`");
        }
        (Some(_), Some(Mode::Relay)) if ck.doc.has(&format!("{prefill_key}.skip_below_tokens")) => {
            let why = "relay routes do not decide the prefill: their orchestrator sends both legs";
            ck.at(&format!("{prefill_key}.skip_below_tokens"), why);
        }
        _ => {}
    }
    if let Some(prefill) = &route.prefill {
        check_prefill(ck, config, &prefill_key, prefill);
    }
    if ck.required(path, "decode_pool") {
        ck.pool_ref(config, &key("decode_pool"), &route.decode_pool);
    }
    let r = route;
    let bounded: [(&str, u64, RangeInclusive<u64>); 5] = [
        ("max_sse_event_bytes", n(r.max_sse_event_bytes), MIN_SSE_EVENT_BYTES..=MAX_BODY_BYTES),
        ("max_body_bytes", n(r.max_body_bytes), 1..=MAX_BODY_BYTES),
        ("retry_budget_percent", u64::from(r.retry_budget_percent), 0..=100),
        ("retry_budget_min_per_second", u64::from(r.retry_budget_min_per_second), 0..=1000),
        ("prefill_attempts", n(r.prefill_attempts), 1..=16),
    ];
    for (name, value, range) in bounded {
        ck.range(&key(name), value, range);
    }
    if !(0.0..=1.0).contains(&route.parity_sample) {
        ck.at(&key("parity_sample"), "must be between 0 and 1");
    }
}

/// The prefill table: a pool or a header, each with its own keys.
fn check_prefill(ck: &mut Checker<'_, '_>, config: &Config, path: &str, prefill: &Prefill) {
    match (&prefill.pool, &prefill.header) {
        (Some(pool), None) => {
            for field in ["allow", "trusted_sources", "forward_credentials"] {
                if ck.doc.has(&format!("{path}.{field}")) {
                    let problem = ck.doc.at_table(path, field, format!("`{field}` goes with `header`, not `pool`"));
                    ck.report(problem);
                }
            }
            ck.pool_ref(config, &format!("{path}.pool"), pool);
        }
        (None, Some(header)) => {
            if ck.doc.has(&format!("{path}.skip_below_tokens")) {
                let why = "`skip_below_tokens` goes with `pool`: a header names its prefiller per request";
                let problem = ck.doc.at_table(path, "skip_below_tokens", why);
                ck.report(problem);
            }
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                ck.at(&format!("{path}.header"), "not a header name");
            }
            if prefill.allow.is_empty() {
                let why = "a header prefill needs an allowlist of hosts or CIDRs";
                let problem = ck.doc.at_table(path, "allow", why);
                ck.report(problem);
            }
            for (j, rule) in prefill.allow.iter().enumerate() {
                let at = format!("{path}.allow[{j}]");
                let Some(entry) = &rule.matcher else {
                    ck.required(&at, "match"); // a bad value: its parse said so
                    continue;
                };
                if let Some(tls) = &rule.tls {
                    let by_ip = matches!(entry.target(), AllowTarget::Net(_));
                    let ip = by_ip.then(|| "`match` names IP addresses".to_owned());
                    check_pool_tls(ck, &format!("{at}.tls"), tls, ip);
                }
            }
        }
        _ => ck.at(path, "set exactly one of `pool` or `header`"),
    }
}
