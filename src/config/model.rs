//! The validated configuration tokenonce runs on. Built only from a parsed file through
//! [`Config::from_toml`], which reports every problem with its line and column; after that
//! its invariants hold (pool references resolve, timeouts are positive, globs compile).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use globset::{Glob, GlobMatcher};
use ipnet::IpNet;
use toml::Spanned;

use super::file;

/// One thing wrong with a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, when known.
    pub line: usize,
    /// 1-based column, when known.
    pub column: usize,
    /// Dotted key path, e.g. `routes[0].decode_pool`.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}: {}", self.line, self.column, self.key, self.message)
    }
}

/// Every problem found in one file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} problem(s) in {source_name}", problems.len())]
pub struct ConfigError {
    /// The file name (or `<embedded default>`).
    pub source_name: String,
    /// The problems, in file order.
    pub problems: Vec<Problem>,
}

/// How a pool picks an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Each endpoint in turn.
    RoundRobin,
    /// The endpoint with the fewest requests in flight (ties: round robin).
    LeastInFlight,
}

/// A vLLM version, compared numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// The first vLLM that reads `kv_transfer_params.prompt_token_ids` on chat.
    pub const CHAT_TOKEN_REUSE: Self = Self(0, 27, 0);

    /// Parses `0.32.0`, `0.32.0rc1.dev3+g...`, `v0.27`.
    pub fn parse(text: &str) -> Option<Self> {
        let mut nums = text.trim().trim_start_matches('v').split('.').map(|part| {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        let major = nums.next()??;
        let minor = nums.next().flatten().unwrap_or(0);
        let patch = nums.next().flatten().unwrap_or(0);
        Some(Self(major, minor, patch))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// A named set of engine endpoints.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    /// Pool name.
    pub name: String,
    /// `host:port` of each engine.
    pub endpoints: Vec<String>,
    /// Endpoint choice.
    pub balance: Balance,
    /// Pinned vLLM version, if any.
    pub vllm_version: Option<Version>,
}

/// What a route does with the requests it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// tokenonce runs the prefill and the decode leg itself.
    Orchestrate,
    /// An orchestrator sends both legs; tokenonce rewrites each and correlates them.
    Relay,
    /// Proxied byte for byte to the decode pool.
    Passthrough,
}

/// How relay mode hands ids from the prefill to the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayHandoff {
    /// Kept in this instance's cache, found again by correlation keys.
    Cache,
    /// Returned inside the prefill response's `kv_transfer_params.prompt_token_ids`.
    Stateless,
}

/// The relay cache bounds.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    /// Byte capacity.
    pub capacity_bytes: usize,
    /// Entry lifetime.
    pub ttl: Duration,
}

impl Mode {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Orchestrate => "orchestrate",
            Self::Relay => "relay",
            Self::Passthrough => "passthrough",
        }
    }
}

/// One entry of a prefiller allowlist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowEntry {
    /// Any IP in this network.
    Net(IpNet),
    /// This exact host name (case-insensitive).
    Host(String),
}

/// Where a route's prefill leg goes.
#[derive(Debug, Clone)]
pub enum PrefillSource {
    /// Index into [`Config::pools`].
    Pool(usize),
    /// A request header naming one `host:port`, checked against `allow`.
    Header {
        /// Lower-case header name.
        name: String,
        /// Permitted hosts and networks.
        allow: Vec<AllowEntry>,
    },
}

/// Per-route knobs.
#[derive(Debug, Clone)]
pub struct RouteOptions {
    /// Reuse prefill ids on the decode.
    pub token_reuse: bool,
    /// Whole prefill leg deadline.
    pub prefill_timeout: Duration,
    /// Decode response-header deadline.
    pub decode_first_byte_timeout: Duration,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Tests only: relay just the first N prompt ids.
    pub test_truncate_prompt_ids: Option<usize>,
    /// Relay mode: where the ids wait between the legs.
    pub relay_handoff: RelayHandoff,
}

/// What a route matches.
#[derive(Debug, Clone)]
pub struct RouteMatch {
    /// Exact paths; empty = any.
    pub paths: Vec<String>,
    /// Model glob; `None` = any.
    pub model: Option<GlobMatcher>,
    /// Required header values (lower-case names).
    pub headers: Vec<(String, String)>,
}

/// One routing rule.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// Name for metrics and logs.
    pub name: String,
    /// What it matches.
    pub matcher: RouteMatch,
    /// What it does.
    pub mode: Mode,
    /// Prefill destination (orchestrate).
    pub prefill: Option<PrefillSource>,
    /// Index of the decode pool.
    pub decode_pool: usize,
    /// Knobs.
    pub options: RouteOptions,
}

/// Process-level settings.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Client listener.
    pub listen: String,
    /// Admin listener.
    pub admin_listen: String,
    /// Proxy worker threads.
    pub threads: usize,
    /// Grace period after SIGTERM.
    pub grace_period_seconds: u64,
    /// Shutdown timeout after the grace period.
    pub graceful_shutdown_timeout_seconds: u64,
    /// Log filter.
    pub log_level: String,
    /// JSON logs.
    pub log_json: bool,
}

/// Upstream connection settings.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Pooled idle connection lifetime.
    pub idle_timeout: Duration,
    /// Health poll period.
    pub health_interval: Duration,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Process settings.
    pub server: ServerSettings,
    /// Upstream settings.
    pub upstream: UpstreamSettings,
    /// Pools, referenced by index.
    pub pools: Vec<PoolSpec>,
    /// Routes in match order.
    pub routes: Vec<RouteSpec>,
    /// Pool for unmatched requests.
    pub passthrough_pool: usize,
    /// Relay cache bounds.
    pub cache: CacheSettings,
}

/// Collects problems while converting.
struct Checker<'s> {
    source: &'s str,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn at(&mut self, span: Option<Range<usize>>, key: impl Into<String>, message: impl Into<String>) {
        let (line, column) = span.map_or((0, 0), |s| line_col(self.source, s.start));
        self.problems.push(Problem { line, column, key: key.into(), message: message.into() });
    }

    fn positive(&mut self, v: &Option<Spanned<i64>>, key: &str, default: u64, max: u64) -> u64 {
        match v {
            None => default,
            Some(s) if *s.get_ref() >= 1 && (*s.get_ref() as u64) <= max => *s.get_ref() as u64,
            Some(s) => {
                self.at(Some(s.span()), key, format!("must be between 1 and {max}"));
                default
            }
        }
    }

    fn addr(&mut self, v: &Option<Spanned<String>>, key: &str, default: &str) -> String {
        match v {
            None => default.to_owned(),
            Some(s) => {
                if s.get_ref().parse::<SocketAddr>().is_err() {
                    self.at(Some(s.span()), key, format!("`{}` is not an ip:port address", s.get_ref()));
                }
                s.get_ref().clone()
            }
        }
    }
}

fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let before = source.get(..offset).unwrap_or(source);
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before.len(), |nl| before.len() - nl - 1) + 1;
    (line, column)
}

/// True for `host:port` with a non-empty host (name or IP, IPv6 in brackets) and a port.
pub fn is_host_port(text: &str) -> bool {
    let Some((host, port)) = text.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty() && host.len() <= 253 && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// Parses an allowlist entry: a CIDR, a bare IP (as a /32 or /128) or a host name.
pub fn parse_allow(text: &str) -> Option<AllowEntry> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Some(AllowEntry::Net(net));
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(AllowEntry::Net(IpNet::from(ip)));
    }
    (!text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'))
        .then(|| AllowEntry::Host(text.to_ascii_lowercase()))
}

const DEFAULT_BODY_LIMIT: u64 = 32 * 1024 * 1024;

impl Config {
    /// Parses and validates TOML text; `source_name` labels the problems.
    ///
    /// # Errors
    /// [`ConfigError`] listing every problem found.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        let fail = |problems| ConfigError { source_name: source_name.to_owned(), problems };
        let parsed: file::File = match toml::from_str(text) {
            Ok(f) => f,
            Err(e) => {
                let (line, column) = e.span().map_or((0, 0), |s| line_col(text, s.start));
                let message = e.message().to_owned();
                return Err(fail(vec![Problem { line, column, key: String::from("(syntax)"), message }]));
            }
        };
        let mut ck = Checker { source: text, problems: Vec::new() };
        let config = Self::check(parsed, &mut ck);
        if ck.problems.is_empty() {
            Ok(config)
        } else {
            ck.problems.sort_by_key(|p| (p.line, p.column));
            Err(fail(ck.problems))
        }
    }

    fn check(f: file::File, ck: &mut Checker<'_>) -> Self {
        let file::File { server, upstream, pools, defaults, routes, cache } = f;
        let file::Cache { capacity_bytes, ttl_ms } = cache;
        let cache = CacheSettings {
            capacity_bytes: ck.positive(&capacity_bytes, "cache.capacity_bytes", 256 * 1024 * 1024, 1 << 40) as usize,
            ttl: Duration::from_millis(ck.positive(&ttl_ms, "cache.ttl_ms", 30_000, 3_600_000)),
        };

        let file::Server {
            listen,
            admin_listen,
            threads,
            grace_period_seconds,
            graceful_shutdown_timeout_seconds,
            log_level,
            log_format,
        } = server;
        let log_json = match &log_format {
            None => false,
            Some(s) if s.get_ref() == "text" => false,
            Some(s) if s.get_ref() == "json" => true,
            Some(s) => {
                ck.at(Some(s.span()), "server.log_format", "must be `text` or `json`");
                false
            }
        };
        let server = ServerSettings {
            listen: ck.addr(&listen, "server.listen", "0.0.0.0:8000"),
            admin_listen: ck.addr(&admin_listen, "server.admin_listen", "127.0.0.1:9000"),
            threads: ck.positive(&threads, "server.threads", 2, 256) as usize,
            grace_period_seconds: ck.positive(&grace_period_seconds, "server.grace_period_seconds", 5, 3600),
            graceful_shutdown_timeout_seconds: ck.positive(
                &graceful_shutdown_timeout_seconds,
                "server.graceful_shutdown_timeout_seconds",
                5,
                3600,
            ),
            log_level: log_level.map_or_else(|| "info".to_owned(), Spanned::into_inner),
            log_json,
        };

        let file::Upstream { connect_timeout_ms, idle_timeout_ms, health_interval_ms } = upstream;
        let upstream = UpstreamSettings {
            connect_timeout: Duration::from_millis(ck.positive(
                &connect_timeout_ms,
                "upstream.connect_timeout_ms",
                2000,
                600_000,
            )),
            idle_timeout: Duration::from_millis(ck.positive(&idle_timeout_ms, "upstream.idle_timeout_ms", 4000, 4999)),
            health_interval: Duration::from_millis(ck.positive(
                &health_interval_ms,
                "upstream.health_interval_ms",
                2000,
                600_000,
            )),
        };

        let mut pool_specs = Vec::with_capacity(pools.len());
        for (name, pool) in &pools {
            let key = format!("pools.{name}");
            let file::Pool { endpoints, balance, vllm_version } = pool.get_ref();
            if endpoints.get_ref().is_empty() {
                ck.at(Some(endpoints.span()), format!("{key}.endpoints"), "needs at least one host:port");
            }
            for ep in endpoints.get_ref() {
                if !is_host_port(ep.get_ref()) {
                    ck.at(Some(ep.span()), format!("{key}.endpoints"), format!("`{}` is not host:port", ep.get_ref()));
                }
            }
            let balance = match balance.as_ref().map(|b| (b.get_ref().as_str(), b.span())) {
                None | Some(("round_robin", _)) => Balance::RoundRobin,
                Some(("least_in_flight", _)) => Balance::LeastInFlight,
                Some((other, span)) => {
                    ck.at(
                        Some(span),
                        format!("{key}.balance"),
                        format!("`{other}` is not round_robin or least_in_flight"),
                    );
                    Balance::RoundRobin
                }
            };
            let vllm_version = vllm_version.as_ref().and_then(|v| {
                let parsed = Version::parse(v.get_ref());
                if parsed.is_none() {
                    ck.at(Some(v.span()), format!("{key}.vllm_version"), format!("`{}` is not a version", v.get_ref()));
                }
                parsed
            });
            pool_specs.push(PoolSpec {
                name: name.clone(),
                endpoints: endpoints.get_ref().iter().map(|e| e.get_ref().clone()).collect(),
                balance,
                vllm_version,
            });
        }
        let pool_index = |ck: &mut Checker<'_>, name: &Spanned<String>, key: &str| -> usize {
            match pool_specs.iter().position(|p| &p.name == name.get_ref()) {
                Some(i) => i,
                None => {
                    let known: Vec<&str> = pool_specs.iter().map(|p| p.name.as_str()).collect();
                    ck.at(
                        Some(name.span()),
                        key,
                        format!("no pool named `{}` (pools: {})", name.get_ref(), known.join(", ")),
                    );
                    0
                }
            }
        };

        let file::Defaults { passthrough_pool } = defaults;
        let passthrough_pool = match &passthrough_pool {
            Some(name) => pool_index(ck, name, "defaults.passthrough_pool"),
            None => match pool_specs.iter().position(|p| p.name == "decode") {
                Some(i) => i,
                None => {
                    ck.at(None, "defaults.passthrough_pool", "not set and there is no pool named `decode`");
                    0
                }
            },
        };

        let mut route_specs = Vec::with_capacity(routes.len());
        let mut seen_names: Vec<String> = Vec::new();
        for (i, route) in routes.into_iter().enumerate() {
            let span = route.span();
            let key = format!("routes[{i}]");
            let file::Route {
                name,
                matcher,
                mode,
                relay_handoff,
                prefill,
                decode_pool,
                token_reuse,
                prefill_timeout_ms,
                decode_first_byte_timeout_ms,
                max_body_bytes,
                test_truncate_prompt_ids,
            } = route.into_inner();
            if seen_names.contains(name.get_ref()) {
                ck.at(Some(name.span()), format!("{key}.name"), format!("duplicate route name `{}`", name.get_ref()));
            }
            if name.get_ref().is_empty()
                || !name.get_ref().chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                ck.at(Some(name.span()), format!("{key}.name"), "must be non-empty [A-Za-z0-9._-]");
            }
            seen_names.push(name.get_ref().clone());
            let mode = match mode.get_ref().as_str() {
                "orchestrate" => Mode::Orchestrate,
                "relay" => Mode::Relay,
                "passthrough" => Mode::Passthrough,
                other => {
                    ck.at(
                        Some(mode.span()),
                        format!("{key}.mode"),
                        format!("`{other}` is not orchestrate, relay or passthrough"),
                    );
                    Mode::Passthrough
                }
            };
            let file::Match { paths, model, headers } = matcher;
            for p in &paths {
                if !p.get_ref().starts_with('/') {
                    ck.at(Some(p.span()), format!("{key}.match.paths"), "a path starts with /");
                }
            }
            let model = model.and_then(|g| match Glob::new(g.get_ref()) {
                Ok(glob) => Some(glob.compile_matcher()),
                Err(e) => {
                    ck.at(Some(g.span()), format!("{key}.match.model"), format!("bad glob: {e}"));
                    None
                }
            });
            let headers = headers
                .into_iter()
                .map(|(name, value)| {
                    if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                        ck.at(
                            Some(value.span()),
                            format!("{key}.match.headers"),
                            format!("`{name}` is not a header name"),
                        );
                    }
                    (name.to_ascii_lowercase(), value.into_inner())
                })
                .collect();
            let prefill = match (mode, prefill) {
                (Mode::Orchestrate, None) => {
                    ck.at(
                        Some(span.clone()),
                        format!("{key}.prefill"),
                        "orchestrate needs `prefill` (a pool or a header)",
                    );
                    None
                }
                (Mode::Passthrough, Some(p)) => {
                    ck.at(Some(p.span()), format!("{key}.prefill"), "passthrough routes have no prefill");
                    None
                }
                (Mode::Passthrough | Mode::Relay, None) => None,
                (Mode::Relay, Some(p)) => {
                    let pspan = p.span();
                    let file::Prefill { pool, header, allow } = p.into_inner();
                    match (pool, header, allow.is_empty()) {
                        (Some(pool), None, true) => {
                            Some(PrefillSource::Pool(pool_index(ck, &pool, &format!("{key}.prefill.pool"))))
                        }
                        _ => {
                            ck.at(
                                Some(pspan),
                                format!("{key}.prefill"),
                                "relay routes take only `prefill = { pool = ... }`",
                            );
                            None
                        }
                    }
                }
                (Mode::Orchestrate, Some(p)) => {
                    let pspan = p.span();
                    let file::Prefill { pool, header, allow } = p.into_inner();
                    match (pool, header) {
                        (Some(pool), None) => {
                            if !allow.is_empty() {
                                ck.at(
                                    Some(pspan),
                                    format!("{key}.prefill.allow"),
                                    "`allow` goes with `header`, not `pool`",
                                );
                            }
                            Some(PrefillSource::Pool(pool_index(ck, &pool, &format!("{key}.prefill.pool"))))
                        }
                        (None, Some(header)) => {
                            if http::HeaderName::from_bytes(header.get_ref().as_bytes()).is_err() {
                                ck.at(Some(header.span()), format!("{key}.prefill.header"), "not a header name");
                            }
                            if allow.is_empty() {
                                ck.at(
                                    Some(pspan),
                                    format!("{key}.prefill.allow"),
                                    "a header prefill needs an allowlist of hosts or CIDRs",
                                );
                            }
                            let allow = allow
                                .iter()
                                .filter_map(|a| {
                                    let entry = parse_allow(a.get_ref());
                                    if entry.is_none() {
                                        ck.at(
                                            Some(a.span()),
                                            format!("{key}.prefill.allow"),
                                            format!("`{}` is not a host or CIDR", a.get_ref()),
                                        );
                                    }
                                    entry
                                })
                                .collect();
                            Some(PrefillSource::Header { name: header.get_ref().to_ascii_lowercase(), allow })
                        }
                        _ => {
                            ck.at(Some(pspan), format!("{key}.prefill"), "set exactly one of `pool` or `header`");
                            None
                        }
                    }
                }
            };
            let decode_pool = pool_index(ck, &decode_pool, &format!("{key}.decode_pool"));
            let options = RouteOptions {
                token_reuse: token_reuse.unwrap_or(true),
                prefill_timeout: Duration::from_millis(ck.positive(
                    &prefill_timeout_ms,
                    &format!("{key}.prefill_timeout_ms"),
                    30_000,
                    3_600_000,
                )),
                decode_first_byte_timeout: Duration::from_millis(ck.positive(
                    &decode_first_byte_timeout_ms,
                    &format!("{key}.decode_first_byte_timeout_ms"),
                    60_000,
                    3_600_000,
                )),
                max_body_bytes: ck.positive(
                    &max_body_bytes,
                    &format!("{key}.max_body_bytes"),
                    DEFAULT_BODY_LIMIT,
                    1 << 30,
                ) as usize,
                relay_handoff: match relay_handoff.as_ref().map(|h| (h.get_ref().as_str(), h.span())) {
                    None | Some(("cache", _)) => RelayHandoff::Cache,
                    Some(("stateless", _)) => RelayHandoff::Stateless,
                    Some((other, span)) => {
                        ck.at(
                            Some(span),
                            format!("{key}.relay_handoff"),
                            format!("`{other}` is not cache or stateless"),
                        );
                        RelayHandoff::Cache
                    }
                },
                test_truncate_prompt_ids: test_truncate_prompt_ids.as_ref().map(|_| {
                    ck.positive(&test_truncate_prompt_ids, &format!("{key}.test_truncate_prompt_ids"), 1, 1 << 24)
                        as usize
                }),
            };
            route_specs.push(RouteSpec {
                name: name.into_inner(),
                matcher: RouteMatch { paths: paths.into_iter().map(Spanned::into_inner).collect(), model, headers },
                mode,
                prefill,
                decode_pool,
                options,
            });
        }
        if pool_specs.is_empty() {
            ck.at(None, "pools", "at least one pool is needed");
        }
        Self { server, upstream, pools: pool_specs, routes: route_specs, passthrough_pool, cache }
    }
}
