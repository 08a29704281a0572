//! File structs → validated model. Each check records a [`Problem`] (key path, line:col) and
//! goes on with a placeholder, so one run reports every problem of a file; the model is
//! returned only when there are none. A syntax error, or a table/array of the wrong type,
//! stops the parse and is the one problem reported.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::time::Duration;

use globset::Glob;
use ipnet::IpNet;
use toml::de::{DeTable, DeValue};
use toml::Spanned;
use tracing_subscriber::filter::LevelFilter;

use super::{
    is_host_port, parse_allow, AdminToken, CacheSettings, Choice, Config, Mode, OnClientGone, PoolSpec, PrefillSource,
    Problem, ReuseShare, RouteMatch, RouteOptions, RouteSpec, ServerSettings, ServerTls, TracingSettings,
    UpstreamSettings, Version,
};
use crate::config::defaults;
use crate::config::file::{self, Field, Unknown};
use crate::tls::{self, Identity, UpstreamTls};

// Upper bounds: a value past these is a typo, not a setting.
const MAX_SECONDS: u64 = 3600;
const MAX_THREADS: u64 = 256;
const MAX_CONNECT_MS: u64 = 600_000;
/// vLLM closes idle keep-alive connections after 5 s; ours must close first.
const MAX_IDLE_MS: u64 = 4999;
const MAX_LEG_MS: u64 = 3_600_000;
/// A non-streamed answer may be a very long generation.
const MAX_ANSWER_MS: u64 = 6 * 3_600_000;
const MAX_IN_FLIGHT: u64 = 1 << 20;
const MAX_BODY_BYTES: u64 = 1 << 30;
/// An SSE event limit below this would cut ordinary token events (a few KB with logprobs).
const MIN_SSE_EVENT_BYTES: u64 = 64 * 1024;
const MAX_CACHE_BYTES: u64 = 1 << 40;
/// pingora refuses more than 256 header fields and 1 MiB of head itself.
const MAX_HEADER_COUNT: u64 = 256;
const MAX_HEADER_BYTES: u64 = 1 << 20;

/// Parses and validates; `Err` holds every problem, sorted by place.
pub(super) fn from_toml(text: &str) -> Result<Config, Vec<Problem>> {
    let doc = DeTable::parse(text).map_err(|e| vec![problem(text, e.span(), "(syntax)".into(), e.message())])?;
    let parsed: file::File = toml::from_str(text).map_err(|e| {
        let key = e.span().and_then(|s| key_at(doc.get_ref(), &s, "")).unwrap_or_else(|| "(file)".into());
        vec![problem(text, e.span(), key, e.message())]
    })?;
    let mut ck = Checker { source: text, doc: doc.get_ref(), problems: Vec::new() };
    let config = check(parsed, &mut ck);
    if ck.problems.is_empty() {
        Ok(config)
    } else {
        // File order; problems of the file as a whole (no place) last.
        ck.problems.sort_by_key(|p| (p.line == 0, p.line, p.column));
        Err(ck.problems)
    }
}

fn problem(source: &str, span: Option<Range<usize>>, key: String, message: &str) -> Problem {
    let (line, column) = span.map_or((0, 0), |s| line_col(source, s.start));
    Problem { line, column, key, message: message.to_owned() }
}

fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let before = source.get(..offset).unwrap_or(source);
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(before.len(), |nl| before.len() - nl - 1) + 1;
    (line, column)
}

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, Copy)]
enum Seg<'a> {
    Key(&'a str),
    Index(usize),
}

/// `routes[0].match` for `[Key("routes"), Index(0), Key("match")]`, then `.name` if given.
fn key_path(path: &[Seg<'_>], name: Option<&str>) -> String {
    let mut out = String::new();
    for seg in path.iter().copied().map(Some).chain([name.map(Seg::Key)]).flatten() {
        match seg {
            Seg::Key(k) if out.is_empty() => out.push_str(k),
            Seg::Key(k) => {
                out.push('.');
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// Span of the key `name` in the table at `path`.
fn locate(doc: &DeTable<'_>, path: &[Seg<'_>], name: &str) -> Option<Range<usize>> {
    let mut table = doc;
    let mut segs = path.iter().peekable();
    while let Some(seg) = segs.next() {
        let Seg::Key(key) = seg else { return None };
        let mut value = table.get(*key)?;
        while let Some(Seg::Index(i)) = segs.peek() {
            value = value.get_ref().as_array()?.get(*i)?;
            segs.next();
        }
        table = value.get_ref().as_table()?;
    }
    table.iter().find(|(k, _)| k.get_ref() == name).map(|(k, _)| k.span())
}

/// The deepest key whose value covers `span` (names the key of a serde type error).
fn key_at(table: &DeTable<'_>, span: &Range<usize>, prefix: &str) -> Option<String> {
    table.iter().find_map(|(k, v)| {
        let key = if prefix.is_empty() { k.get_ref().to_string() } else { format!("{prefix}.{}", k.get_ref()) };
        value_key_at(v, span, key)
    })
}

fn value_key_at(value: &Spanned<DeValue<'_>>, span: &Range<usize>, key: String) -> Option<String> {
    let inner = match value.get_ref() {
        DeValue::Table(t) => key_at(t, span, &key),
        DeValue::Array(a) => a.iter().enumerate().find_map(|(i, v)| value_key_at(v, span, format!("{key}[{i}]"))),
        _ => None,
    };
    let own = value.span();
    inner.or_else(|| (own.start <= span.start && span.end <= own.end).then_some(key))
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

/// Collects problems while converting.
struct Checker<'a> {
    source: &'a str,
    /// The spanned document, to find where unknown keys are.
    doc: &'a DeTable<'a>,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn at(&mut self, span: Option<Range<usize>>, key: impl Into<String>, message: impl Into<String>) {
        let (line, column) = span.map_or((0, 0), |s| line_col(self.source, s.start));
        self.problems.push(Problem { line, column, key: key.into(), message: message.into() });
    }

    /// Every key of the table at `path` that the file format does not have.
    fn unknown(&mut self, unknown: &Unknown, path: &[Seg<'_>]) {
        for name in unknown.keys() {
            let span = locate(self.doc, path, name);
            self.at(span, key_path(path, Some(name)), format!("unknown key `{name}`"));
        }
    }

    /// The value, or `None` after recording its type error.
    fn value<'f, T>(&mut self, field: &'f Field<T>, key: &str) -> Option<&'f T> {
        match field.value() {
            Ok(v) => Some(v),
            Err(e) => {
                self.at(Some(field.span()), key, e);
                None
            }
        }
    }

    /// A present, well-typed value with its span.
    fn get<'f, T>(&mut self, field: &'f Option<Field<T>>, key: &str) -> Option<(&'f T, Range<usize>)> {
        let field = field.as_ref()?;
        self.value(field, key).map(|v| (v, field.span()))
    }

    /// Like [`Checker::get`]; a missing key is a problem at its table (`table`).
    fn required<'f, T>(
        &mut self,
        field: &'f Option<Field<T>>,
        table: &Range<usize>,
        key: &str,
    ) -> Option<(&'f T, Range<usize>)> {
        if field.is_none() {
            self.at(Some(table.clone()), key, "required key is missing");
        }
        self.get(field, key)
    }

    /// One of `T`'s names; an unknown name is a problem that lists the allowed ones.
    fn choice<T: Choice>(&mut self, got: Option<(&String, Range<usize>)>, key: &str) -> Option<T> {
        let (text, span) = got?;
        let found = T::ALL.iter().copied().find(|c| c.name() == text.as_str());
        if found.is_none() {
            let names: Vec<&str> = T::ALL.iter().map(|c| c.name()).collect();
            self.at(Some(span), key, format!("`{text}` is not one of: {}", names.join(", ")));
        }
        found
    }

    fn optional_choice<T: Choice>(&mut self, field: &Option<Field<String>>, key: &str, default: T) -> T {
        let got = self.get(field, key);
        self.choice(got, key).unwrap_or(default)
    }

    fn positive(&mut self, field: &Option<Field<i64>>, key: &str, default: u64, max: u64) -> u64 {
        self.bounded(field, key, default, 1..=max)
    }

    fn bounded(
        &mut self,
        field: &Option<Field<i64>>,
        key: &str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> u64 {
        match self.get(field, key) {
            None => default,
            Some((v, span)) => match u64::try_from(*v).ok().filter(|v| range.contains(v)) {
                Some(v) => v,
                None => {
                    self.at(Some(span), key, format!("must be between {} and {}", range.start(), range.end()));
                    default
                }
            },
        }
    }

    fn millis(&mut self, field: &Option<Field<i64>>, key: &str, default: u64, max: u64) -> Duration {
        Duration::from_millis(self.positive(field, key, default, max))
    }

    fn addr(&mut self, field: &Option<Field<String>>, key: &str, default: &str) -> String {
        match self.get(field, key) {
            None => default.to_owned(),
            Some((text, span)) => {
                if text.parse::<SocketAddr>().is_err() {
                    self.at(Some(span), key, format!("`{text}` is not an ip:port address"));
                }
                text.clone()
            }
        }
    }

    /// Index of the pool named by `got`.
    fn pool_ref(&mut self, pools: &[PoolSpec], got: Option<(&String, Range<usize>)>, key: &str) -> Option<usize> {
        let (name, span) = got?;
        let found = pools.iter().position(|p| &p.name == name);
        if found.is_none() {
            let known: Vec<&str> = pools.iter().map(|p| p.name.as_str()).collect();
            self.at(Some(span), key, format!("no pool named `{name}` (pools: {})", known.join(", ")));
        }
        found
    }
}

fn check(f: file::File, ck: &mut Checker<'_>) -> Config {
    let file::File { server, upstream, pools, defaults: defaults_table, routes, cache, tracing, unknown } = f;
    ck.unknown(&unknown, &[]);
    let tracing = tracing.and_then(|t| check_tracing(ck, t));
    let server = check_server(ck, server);
    let upstream = check_upstream(ck, upstream);
    let cache = check_cache(ck, cache);
    let pools = check_pools(ck, &pools);

    let file::Defaults { passthrough_pool, unknown } = defaults_table;
    ck.unknown(&unknown, &[Seg::Key("defaults")]);
    const PASSTHROUGH_KEY: &str = "defaults.passthrough_pool";
    let passthrough_pool = if passthrough_pool.is_some() {
        let got = ck.get(&passthrough_pool, PASSTHROUGH_KEY);
        ck.pool_ref(&pools, got, PASSTHROUGH_KEY)
    } else {
        let found = pools.iter().position(|p| p.name == defaults::PASSTHROUGH_POOL);
        if found.is_none() {
            let message = format!("not set and there is no pool named `{}`", defaults::PASSTHROUGH_POOL);
            ck.at(None, PASSTHROUGH_KEY, message);
        }
        found
    };

    let mut seen_names = Vec::new();
    let routes = routes.into_iter().enumerate().map(|(i, r)| check_route(ck, i, r, &pools, &mut seen_names)).collect();
    if pools.is_empty() {
        ck.at(None, "pools", "at least one pool is needed");
    }
    Config { server, upstream, pools, routes, passthrough_pool: passthrough_pool.unwrap_or(0), cache, tracing }
}

/// `[tracing]`: an `http://` collector URL, a known protocol, a ratio in 0–1, a service name.
fn check_tracing(ck: &mut Checker<'_>, tracing: Spanned<file::Tracing>) -> Option<TracingSettings> {
    let span = tracing.span();
    let file::Tracing { endpoint, protocol, sampling_ratio, service_name, unknown } = tracing.into_inner();
    ck.unknown(&unknown, &[Seg::Key("tracing")]);
    let endpoint = ck.required(&endpoint, &span, "tracing.endpoint").and_then(|(url, at)| {
        let rest = url.strip_prefix("http://").filter(|r| !r.is_empty() && !r.starts_with('/'));
        if rest.is_none() {
            ck.at(
                Some(at),
                "tracing.endpoint",
                format!("`{url}` is not an http:// URL (run a collector beside tokenonce for TLS)"),
            );
        }
        rest.map(|_| url.clone())
    });
    let protocol = ck.optional_choice(&protocol, "tracing.protocol", defaults::TRACING_PROTOCOL);
    let sampling_ratio = match ck.get(&sampling_ratio, "tracing.sampling_ratio") {
        None => defaults::TRACING_SAMPLING_RATIO,
        Some((ratio, _)) if (0.0..=1.0).contains(ratio) => *ratio,
        Some((ratio, at)) => {
            ck.at(Some(at), "tracing.sampling_ratio", format!("{ratio} is not between 0.0 and 1.0"));
            defaults::TRACING_SAMPLING_RATIO
        }
    };
    let service_name = match ck.get(&service_name, "tracing.service_name") {
        None => defaults::TRACING_SERVICE_NAME.to_owned(),
        Some((name, at)) => {
            if name.trim().is_empty() {
                ck.at(Some(at), "tracing.service_name", "must not be empty");
            }
            name.clone()
        }
    };
    Some(TracingSettings { endpoint: endpoint?, protocol, sampling_ratio, service_name })
}

fn check_server(ck: &mut Checker<'_>, server: file::Server) -> ServerSettings {
    let file::Server {
        listen,
        admin_listen,
        threads,
        work_stealing,
        grace_period_seconds,
        graceful_shutdown_timeout_seconds,
        log_level,
        log_format,
        admin_token_file,
        max_header_count,
        max_header_bytes,
        body_read_timeout_ms,
        max_in_flight,
        tls,
        unknown,
    } = server;
    ck.unknown(&unknown, &[Seg::Key("server")]);
    let listen = ck.addr(&listen, "server.listen", defaults::LISTEN);
    let admin_listen = ck.addr(&admin_listen, "server.admin_listen", defaults::ADMIN_LISTEN);
    let tls = tls.map(|t| check_server_tls(ck, t, [&listen, &admin_listen]));
    let admin_token = ck.get(&admin_token_file, "server.admin_token_file").and_then(|(path, span)| {
        read_token(path).map_err(|why| ck.at(Some(span), "server.admin_token_file", why)).ok()
    });
    let log_level = match ck.get(&log_level, "server.log_level") {
        None => defaults::LOG_LEVEL.to_owned(),
        Some((text, span)) => {
            if let Some(why) = log_filter_problem(text) {
                ck.at(Some(span), "server.log_level", why);
            }
            text.clone()
        }
    };
    ServerSettings {
        listen,
        admin_listen,
        tls: tls.flatten(),
        threads: ck.positive(&threads, "server.threads", defaults::THREADS, MAX_THREADS) as usize,
        work_stealing: ck.get(&work_stealing, "server.work_stealing").map_or(defaults::WORK_STEALING, |(v, _)| *v),
        grace_period_seconds: ck.positive(
            &grace_period_seconds,
            "server.grace_period_seconds",
            defaults::GRACE_PERIOD_SECONDS,
            MAX_SECONDS,
        ),
        graceful_shutdown_timeout_seconds: ck.positive(
            &graceful_shutdown_timeout_seconds,
            "server.graceful_shutdown_timeout_seconds",
            defaults::GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS,
            MAX_SECONDS,
        ),
        log_level,
        log_format: ck.optional_choice(&log_format, "server.log_format", defaults::LOG_FORMAT),
        admin_token,
        max_header_count: ck.positive(
            &max_header_count,
            "server.max_header_count",
            defaults::MAX_HEADER_COUNT,
            MAX_HEADER_COUNT,
        ) as usize,
        max_header_bytes: ck.positive(
            &max_header_bytes,
            "server.max_header_bytes",
            defaults::MAX_HEADER_BYTES,
            MAX_HEADER_BYTES,
        ) as usize,
        body_read_timeout: ck.millis(
            &body_read_timeout_ms,
            "server.body_read_timeout_ms",
            defaults::BODY_READ_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        max_in_flight: ck.bounded(&max_in_flight, "server.max_in_flight", defaults::MAX_IN_FLIGHT, 0..=MAX_IN_FLIGHT)
            as usize,
    }
}

/// `[server.tls]`: its own address (not a plain listener's) and a certificate and key that
/// load and belong together.
fn check_server_tls(ck: &mut Checker<'_>, tls: Spanned<file::ServerTls>, plain: [&String; 2]) -> Option<ServerTls> {
    let span = tls.span();
    let file::ServerTls { listen, cert_file, key_file, unknown } = tls.into_inner();
    ck.unknown(&unknown, &[Seg::Key("server"), Seg::Key("tls")]);
    let listen_key = "server.tls.listen";
    let listen = match ck.required(&listen, &span, listen_key) {
        None => None,
        Some((text, at)) => {
            if text.parse::<SocketAddr>().is_err() {
                ck.at(Some(at), listen_key, format!("`{text}` is not an ip:port address"));
            } else if plain.contains(&text) && !text.ends_with(":0") {
                ck.at(Some(at), listen_key, "must differ from `server.listen` and `server.admin_listen`");
            }
            Some(text.clone())
        }
    };
    let cert = ck.required(&cert_file, &span, "server.tls.cert_file");
    let key = ck.required(&key_file, &span, "server.tls.key_file");
    let identity = identity(ck, cert, key, ["server.tls.cert_file", "server.tls.key_file"])?;
    Some(ServerTls { listen: listen?, identity })
}

/// A certificate and key loaded from their files: a file that cannot be read is a problem at
/// its own key (both are reported), one that does not parse or a pair that does not belong
/// together a problem at the certificate.
fn identity(
    ck: &mut Checker<'_>,
    cert: Option<(&String, Range<usize>)>,
    key: Option<(&String, Range<usize>)>,
    [cert_key, key_key]: [&str; 2],
) -> Option<Identity> {
    let ((cert, span), (key, key_span)) = (cert?, key?);
    let mut readable = |path: &str, at: Range<usize>, name: &str| {
        std::fs::File::open(path).map_err(|e| ck.at(Some(at), name, format!("cannot read `{path}`: {e}"))).is_ok()
    };
    let cert_readable = readable(cert, span.clone(), cert_key);
    if !(readable(key, key_span, key_key) && cert_readable) {
        return None;
    }
    Identity::load(cert, key).map_err(|why| ck.at(Some(span), cert_key, why)).ok()
}

/// `[pools.NAME.tls]`: files that load, a client certificate with its key, and a name to
/// check when verification is on and an endpoint is an IP (OpenSSL checks DNS names).
fn check_pool_tls(
    ck: &mut Checker<'_>,
    tls: &Spanned<file::PoolTls>,
    pool: &str,
    endpoints: &[String],
) -> Option<UpstreamTls> {
    let span = tls.span();
    let file::PoolTls { ca_file, server_name, cert_file, key_file, verify, unknown } = tls.get_ref();
    let path = [Seg::Key("pools"), Seg::Key(pool), Seg::Key("tls")];
    let key = &key_path(&path, None);
    ck.unknown(unknown, &path);
    let ca_key = format!("{key}.ca_file");
    let ca = match ck.get(ca_file, &ca_key) {
        None => Ok(None),
        Some((path, at)) => tls::load_ca(path).map(Some).map_err(|why| ck.at(Some(at), &ca_key, why)),
    };
    let name_key = format!("{key}.server_name");
    let server_name = ck.get(server_name, &name_key).map(|(name, at)| {
        let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || ".-_*".contains(c));
        if !ok {
            ck.at(Some(at), &name_key, format!("`{name}` is not a DNS name"));
        }
        name.clone()
    });
    let verify = ck.get(verify, &format!("{key}.verify")).map_or(defaults::UPSTREAM_TLS_VERIFY, |(v, _)| *v);
    let (cert_key, key_key) = (format!("{key}.cert_file"), format!("{key}.key_file"));
    let cert = ck.get(cert_file, &cert_key);
    let client_key = ck.get(key_file, &key_key);
    let client = match (&cert, &client_key) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => identity(ck, cert, client_key, [&cert_key, &key_key]).map(Some).ok_or(()),
        _ => {
            ck.at(Some(span.clone()), &cert_key, "`cert_file` and `key_file` go together (mTLS client certificate)");
            Err(())
        }
    };
    if verify && server_name.is_none() {
        if let Some(ip) = endpoints.iter().find(|e| tls::host_of(e).parse::<IpAddr>().is_ok()) {
            let why = format!(
                "endpoint `{ip}` is an IP address: set `server_name` to the DNS name in the engines' certificate"
            );
            ck.at(Some(span), &name_key, why);
        }
    }
    Some(UpstreamTls::new(ca.ok()?, server_name, client.ok()?, verify))
}

/// The admin token from its file: the file's text without surrounding white space, at least
/// 16 characters (a guessable token protects nothing).
fn read_token(path: &str) -> Result<AdminToken, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
    let token = text.trim();
    if token.len() < 16 || token.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(format!("`{path}` must hold one token of at least 16 printable characters"));
    }
    Ok(AdminToken::new(token.to_owned()))
}

fn check_upstream(ck: &mut Checker<'_>, upstream: file::Upstream) -> UpstreamSettings {
    let file::Upstream { connect_timeout_ms, idle_timeout_ms, health_interval_ms, eject_after_failures, unknown } =
        upstream;
    ck.unknown(&unknown, &[Seg::Key("upstream")]);
    UpstreamSettings {
        connect_timeout: ck.millis(
            &connect_timeout_ms,
            "upstream.connect_timeout_ms",
            defaults::CONNECT_TIMEOUT_MS,
            MAX_CONNECT_MS,
        ),
        idle_timeout: ck.millis(&idle_timeout_ms, "upstream.idle_timeout_ms", defaults::IDLE_TIMEOUT_MS, MAX_IDLE_MS),
        health_interval: ck.millis(
            &health_interval_ms,
            "upstream.health_interval_ms",
            defaults::HEALTH_INTERVAL_MS,
            MAX_CONNECT_MS,
        ),
        eject_after_failures: ck.bounded(
            &eject_after_failures,
            "upstream.eject_after_failures",
            defaults::EJECT_AFTER_FAILURES,
            0..=1000,
        ) as u32,
    }
}

fn check_cache(ck: &mut Checker<'_>, cache: file::Cache) -> CacheSettings {
    let file::Cache { capacity_bytes, ttl_ms, unknown } = cache;
    ck.unknown(&unknown, &[Seg::Key("cache")]);
    CacheSettings {
        capacity_bytes: ck.positive(
            &capacity_bytes,
            "cache.capacity_bytes",
            defaults::CACHE_CAPACITY_BYTES,
            MAX_CACHE_BYTES,
        ) as usize,
        ttl: ck.millis(&ttl_ms, "cache.ttl_ms", defaults::CACHE_TTL_MS, MAX_LEG_MS),
    }
}

fn check_pools(ck: &mut Checker<'_>, pools: &BTreeMap<String, Spanned<file::Pool>>) -> Vec<PoolSpec> {
    let mut specs = Vec::with_capacity(pools.len());
    for (name, pool) in pools {
        let path = [Seg::Key("pools"), Seg::Key(name)];
        let key = key_path(&path, None);
        let file::Pool { endpoints, balance, vllm_version, tokenizer, tls, unknown } = pool.get_ref();
        ck.unknown(unknown, &path);
        let endpoints_key = format!("{key}.endpoints");
        let endpoints = match endpoints {
            None => {
                ck.at(Some(pool.span()), &endpoints_key, "required key is missing");
                Vec::new()
            }
            Some(list) => {
                if list.get_ref().is_empty() {
                    ck.at(Some(list.span()), &endpoints_key, "needs at least one host:port");
                }
                let mut addrs = Vec::with_capacity(list.get_ref().len());
                for ep in list.get_ref() {
                    let Some(text) = ck.value(ep, &endpoints_key) else { continue };
                    if !is_host_port(text) {
                        ck.at(Some(ep.span()), &endpoints_key, format!("`{text}` is not host:port"));
                    }
                    addrs.push(text.clone());
                }
                addrs
            }
        };
        let balance = ck.optional_choice(balance, &format!("{key}.balance"), defaults::BALANCE);
        let version_key = format!("{key}.vllm_version");
        let vllm_version = ck.get(vllm_version, &version_key).and_then(|(text, span)| {
            let parsed = Version::parse(text);
            if parsed.is_none() {
                ck.at(Some(span), &version_key, format!("`{text}` is not a version"));
            }
            parsed
        });
        let tokenizer_key = format!("{key}.tokenizer");
        let tokenizer = ck.get(tokenizer, &tokenizer_key).and_then(|(path, span)| {
            crate::parity::Tokenizer::load(std::path::Path::new(path))
                .map(std::sync::Arc::new)
                .map_err(|why| ck.at(Some(span), &tokenizer_key, why))
                .ok()
        });
        let tls = tls.as_ref().and_then(|t| check_pool_tls(ck, t, name, &endpoints));
        specs.push(PoolSpec { name: name.clone(), endpoints, balance, vllm_version, tokenizer, tls });
    }
    specs
}

fn check_route(
    ck: &mut Checker<'_>,
    index: usize,
    route: Spanned<file::Route>,
    pools: &[PoolSpec],
    seen_names: &mut Vec<String>,
) -> RouteSpec {
    let span = route.span();
    let path = [Seg::Key("routes"), Seg::Index(index)];
    let key = key_path(&path, None);
    let route = route.into_inner();
    let options = check_route_options(ck, &key, &route);
    #[rustfmt::skip]
    let file::Route {
        name, matcher, mode, prefill, decode_pool, unknown,
        relay_handoff: _, token_reuse: _, prefill_timeout_ms: _, decode_first_byte_timeout_ms: _, decode_whole_answer_timeout_ms: _,
        max_body_bytes: _, client_kv_transfer_params: _, retry_budget_percent: _, retry_budget_min_per_second: _,
        prefill_attempts: _, on_prefill_failure: _, stream_idle_timeout_ms: _, client_write_timeout_ms: _,
        on_client_gone: _, release_timeout_ms: _, max_sse_event_bytes: _, parity_sample: _, on_parity_mismatch: _,
        parity_cooldown_ms: _,
    } = route;
    ck.unknown(&unknown, &path);
    let name = check_route_name(ck, &name, &span, &key, seen_names);
    let mode_key = format!("{key}.mode");
    let got = ck.required(&mode, &span, &mode_key);
    let mode: Option<Mode> = ck.choice(got, &mode_key);
    let matcher = check_match(ck, matcher, &path);

    let prefill_span = prefill.as_ref().map(Spanned::span);
    let source = prefill.map(|p| check_prefill(ck, p, &path, pools));
    let prefill_key = format!("{key}.prefill");
    let prefill = match (mode, source) {
        (Some(Mode::Orchestrate), None) => {
            ck.at(Some(span.clone()), &prefill_key, "orchestrate needs `prefill` (a pool or a header)");
            None
        }
        (Some(Mode::Passthrough), Some(_)) => {
            ck.at(prefill_span, &prefill_key, "passthrough routes have no prefill");
            None
        }
        (Some(Mode::Relay), Some(Some(PrefillSource::Header { .. }))) => {
            ck.at(prefill_span, &prefill_key, "relay routes take only `prefill = { pool = ... }`");
            None
        }
        (_, source) => source.flatten(),
    };

    let decode_key = format!("{key}.decode_pool");
    let got = ck.required(&decode_pool, &span, &decode_key);
    let decode_pool = ck.pool_ref(pools, got, &decode_key).unwrap_or(0);
    RouteSpec { name, matcher, mode: mode.unwrap_or(Mode::Passthrough), prefill, decode_pool, options }
}

/// A route's name: present, unique, `[A-Za-z0-9._-]`.
fn check_route_name(
    ck: &mut Checker<'_>,
    name: &Option<Field<String>>,
    table: &Range<usize>,
    key: &str,
    seen_names: &mut Vec<String>,
) -> String {
    let name_key = format!("{key}.name");
    let Some((name, name_span)) = ck.required(name, table, &name_key) else { return String::new() };
    if seen_names.contains(name) {
        ck.at(Some(name_span.clone()), &name_key, format!("duplicate route name `{name}`"));
    }
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        ck.at(Some(name_span), &name_key, "must be non-empty [A-Za-z0-9._-]");
    }
    seen_names.push(name.clone());
    name.clone()
}

/// `token_reuse`: a switch, or a fraction 0.0–1.0 (a canary share).
fn check_token_reuse(ck: &mut Checker<'_>, field: &Option<Field<file::TokenReuse>>, key: &str) -> ReuseShare {
    match ck.get(field, key) {
        None => ReuseShare::from_switch(defaults::TOKEN_REUSE),
        Some((file::TokenReuse::Switch(on), _)) => ReuseShare::from_switch(*on),
        Some((file::TokenReuse::Share(f), span)) => ReuseShare::from_fraction(*f).unwrap_or_else(|| {
            ck.at(Some(span), key, format!("a share must be between 0.0 and 1.0, not {f}"));
            ReuseShare::from_switch(defaults::TOKEN_REUSE)
        }),
    }
}

/// A route's knobs, each with its default.
fn check_route_options(ck: &mut Checker<'_>, key: &str, route: &file::Route) -> RouteOptions {
    #[rustfmt::skip]
    let file::Route {
        token_reuse, prefill_timeout_ms, decode_first_byte_timeout_ms, max_body_bytes, relay_handoff,
        client_kv_transfer_params, retry_budget_percent, retry_budget_min_per_second, prefill_attempts,
        on_prefill_failure, parity_sample, on_parity_mismatch, parity_cooldown_ms, stream_idle_timeout_ms: _,
        client_write_timeout_ms: _, on_client_gone: _, release_timeout_ms: _, max_sse_event_bytes: _, name: _, decode_whole_answer_timeout_ms: _,
        matcher: _, mode: _, prefill: _, decode_pool: _, unknown: _,
    } = route;
    let waits = check_route_waits(ck, key, route);
    RouteOptions {
        token_reuse: check_token_reuse(ck, token_reuse, &format!("{key}.token_reuse")),
        prefill_timeout: ck.millis(
            prefill_timeout_ms,
            &format!("{key}.prefill_timeout_ms"),
            defaults::PREFILL_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        decode_first_byte_timeout: ck.millis(
            decode_first_byte_timeout_ms,
            &format!("{key}.decode_first_byte_timeout_ms"),
            defaults::DECODE_FIRST_BYTE_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        max_body_bytes: ck.positive(
            max_body_bytes,
            &format!("{key}.max_body_bytes"),
            defaults::MAX_BODY_BYTES,
            MAX_BODY_BYTES,
        ) as usize,
        relay_handoff: ck.optional_choice(relay_handoff, &format!("{key}.relay_handoff"), defaults::RELAY_HANDOFF),
        client_handoff: ck.optional_choice(
            client_kv_transfer_params,
            &format!("{key}.client_kv_transfer_params"),
            defaults::CLIENT_KV_TRANSFER_PARAMS,
        ),
        retry_budget_percent: ck.bounded(
            retry_budget_percent,
            &format!("{key}.retry_budget_percent"),
            defaults::RETRY_BUDGET_PERCENT,
            0..=100,
        ) as u32,
        retry_budget_min_per_second: ck.bounded(
            retry_budget_min_per_second,
            &format!("{key}.retry_budget_min_per_second"),
            defaults::RETRY_BUDGET_MIN_PER_SECOND,
            0..=1000,
        ) as u32,
        prefill_attempts: ck.bounded(
            prefill_attempts,
            &format!("{key}.prefill_attempts"),
            defaults::PREFILL_ATTEMPTS,
            1..=16,
        ) as usize,
        on_prefill_failure: ck.optional_choice(
            on_prefill_failure,
            &format!("{key}.on_prefill_failure"),
            defaults::ON_PREFILL_FAILURE,
        ),
        decode_whole_answer_timeout: waits.decode_whole_answer_timeout,
        stream_idle_timeout: waits.stream_idle_timeout,
        client_write_timeout: waits.client_write_timeout,
        on_client_gone: waits.on_client_gone,
        release_timeout: waits.release_timeout,
        max_sse_event_bytes: waits.max_sse_event_bytes,
        parity_sample: check_share(ck, parity_sample, &format!("{key}.parity_sample")),
        on_parity_mismatch: ck.optional_choice(
            on_parity_mismatch,
            &format!("{key}.on_parity_mismatch"),
            defaults::ON_PARITY_MISMATCH,
        ),
        parity_cooldown: ck.millis(
            parity_cooldown_ms,
            &format!("{key}.parity_cooldown_ms"),
            defaults::PARITY_COOLDOWN_MS,
            MAX_LEG_MS,
        ),
    }
}

/// A share between 0 and 1 (the parity sample), else the default with a problem.
fn check_share(ck: &mut Checker<'_>, field: &Option<Field<f64>>, key: &str) -> f64 {
    match ck.get(field, key) {
        None => defaults::PARITY_SAMPLE,
        Some((v, _)) if (0.0..=1.0).contains(v) => *v,
        Some((_, span)) => {
            ck.at(Some(span), key, "must be between 0 and 1");
            defaults::PARITY_SAMPLE
        }
    }
}

/// A route's bounds on waits and on relayed events (part of its [`RouteOptions`]).
struct RouteWaits {
    decode_whole_answer_timeout: Duration,
    stream_idle_timeout: Duration,
    client_write_timeout: Duration,
    on_client_gone: OnClientGone,
    release_timeout: Duration,
    max_sse_event_bytes: usize,
}

fn check_route_waits(ck: &mut Checker<'_>, key: &str, route: &file::Route) -> RouteWaits {
    let file::Route {
        decode_whole_answer_timeout_ms,
        stream_idle_timeout_ms,
        client_write_timeout_ms,
        on_client_gone,
        release_timeout_ms,
        max_sse_event_bytes,
        ..
    } = route;
    RouteWaits {
        decode_whole_answer_timeout: ck.millis(
            decode_whole_answer_timeout_ms,
            &format!("{key}.decode_whole_answer_timeout_ms"),
            defaults::DECODE_WHOLE_ANSWER_TIMEOUT_MS,
            MAX_ANSWER_MS,
        ),
        stream_idle_timeout: ck.millis(
            stream_idle_timeout_ms,
            &format!("{key}.stream_idle_timeout_ms"),
            defaults::STREAM_IDLE_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        client_write_timeout: ck.millis(
            client_write_timeout_ms,
            &format!("{key}.client_write_timeout_ms"),
            defaults::CLIENT_WRITE_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        on_client_gone: ck.optional_choice(on_client_gone, &format!("{key}.on_client_gone"), defaults::ON_CLIENT_GONE),
        release_timeout: ck.millis(
            release_timeout_ms,
            &format!("{key}.release_timeout_ms"),
            defaults::RELEASE_TIMEOUT_MS,
            MAX_LEG_MS,
        ),
        max_sse_event_bytes: ck.bounded(
            max_sse_event_bytes,
            &format!("{key}.max_sse_event_bytes"),
            defaults::MAX_SSE_EVENT_BYTES,
            MIN_SSE_EVENT_BYTES..=MAX_BODY_BYTES,
        ) as usize,
    }
}

fn check_match(ck: &mut Checker<'_>, matcher: file::Match, route: &[Seg<'_>]) -> RouteMatch {
    let path = [route, &[Seg::Key("match")]].concat();
    let key = key_path(&path, None);
    let file::Match { paths, model, headers, unknown } = matcher;
    ck.unknown(&unknown, &path);
    let paths_key = format!("{key}.paths");
    let mut exact = Vec::with_capacity(paths.len());
    for p in &paths {
        let Some(text) = ck.value(p, &paths_key) else { continue };
        if !text.starts_with('/') {
            ck.at(Some(p.span()), &paths_key, "a path starts with /");
        }
        exact.push(text.clone());
    }
    let model_key = format!("{key}.model");
    let model = ck.get(&model, &model_key).and_then(|(glob, span)| match Glob::new(glob) {
        Ok(glob) => Some(glob.compile_matcher()),
        Err(e) => {
            ck.at(Some(span), &model_key, format!("bad glob: {e}"));
            None
        }
    });
    let headers_key = format!("{key}.headers");
    let mut required = Vec::with_capacity(headers.len());
    for (name, value) in &headers {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            ck.at(Some(value.span()), &headers_key, format!("`{name}` is not a header name"));
        }
        if let Some(value) = ck.value(value, &headers_key) {
            required.push((name.to_ascii_lowercase(), value.clone()));
        }
    }
    RouteMatch { paths: exact, model, headers: required }
}

/// The prefill table on its own; the mode's rules are checked by the caller.
fn check_prefill(
    ck: &mut Checker<'_>,
    prefill: Spanned<file::Prefill>,
    route: &[Seg<'_>],
    pools: &[PoolSpec],
) -> Option<PrefillSource> {
    let span = prefill.span();
    let path = [route, &[Seg::Key("prefill")]].concat();
    let key = key_path(&path, None);
    let file::Prefill { pool, header, allow, trusted_sources, forward_credentials, unknown } = prefill.into_inner();
    ck.unknown(&unknown, &path);
    let allow_key = format!("{key}.allow");
    match (&pool, &header) {
        (Some(_), None) => {
            let header_only = [
                (!allow.is_empty(), "allow"),
                (!trusted_sources.is_empty(), "trusted_sources"),
                (forward_credentials.is_some(), "forward_credentials"),
            ];
            for (_, field) in header_only.iter().filter(|(set, _)| *set) {
                ck.at(
                    Some(span.clone()),
                    format!("{key}.{field}"),
                    format!("`{field}` goes with `header`, not `pool`"),
                );
            }
            let pool_key = format!("{key}.pool");
            let got = ck.get(&pool, &pool_key);
            ck.pool_ref(pools, got, &pool_key).map(PrefillSource::Pool)
        }
        (None, Some(_)) => {
            let header_key = format!("{key}.header");
            let name = ck.get(&header, &header_key).map(|(name, name_span)| {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                    ck.at(Some(name_span), &header_key, "not a header name");
                }
                name.to_ascii_lowercase()
            });
            if allow.is_empty() {
                ck.at(Some(span), &allow_key, "a header prefill needs an allowlist of hosts or CIDRs");
            }
            let mut entries = Vec::with_capacity(allow.len());
            for a in &allow {
                let Some(text) = ck.value(a, &allow_key) else { continue };
                match parse_allow(text) {
                    Some(entry) => entries.push(entry),
                    None => {
                        let why = format!("`{text}` is not a host or CIDR with an optional :port or :port-port");
                        ck.at(Some(a.span()), &allow_key, why);
                    }
                }
            }
            let trusted_key = format!("{key}.trusted_sources");
            let mut trusted = Vec::with_capacity(trusted_sources.len());
            for t in &trusted_sources {
                let Some(text) = ck.value(t, &trusted_key) else { continue };
                match text.parse::<IpNet>().or_else(|_| text.parse::<IpAddr>().map(IpNet::from)) {
                    Ok(net) => trusted.push(net),
                    Err(_) => ck.at(Some(t.span()), &trusted_key, format!("`{text}` is not an IP or CIDR")),
                }
            }
            let credentials_key = format!("{key}.forward_credentials");
            let forward_credentials =
                ck.get(&forward_credentials, &credentials_key).map_or(defaults::FORWARD_CREDENTIALS, |(v, _)| *v);
            name.map(|name| PrefillSource::Header {
                name,
                allow: entries,
                trusted_sources: trusted,
                forward_credentials,
            })
        }
        _ => {
            ck.at(Some(span), &key, "set exactly one of `pool` or `header`");
            None
        }
    }
}
