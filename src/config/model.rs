//! The validated configuration tokenonce runs on. Built only from a parsed file through
//! [`Config::from_toml`], which reports every problem with its line and column; after that
//! its invariants hold (pool references resolve, timeouts are positive, globs compile), so
//! the fields are private and read through accessors. The checking itself is in `check.rs`.

mod check;

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use globset::GlobMatcher;
use ipnet::IpNet;

use crate::tls::{Identity, UpstreamTls};

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

/// A config value spelled as one of a fixed set of names.
pub(crate) trait Choice: Copy + 'static {
    /// Every value, in the order the error message lists them.
    const ALL: &'static [Self];
    /// Its name in the file.
    fn name(self) -> &'static str;
}

/// How a pool picks an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Each endpoint in turn.
    RoundRobin,
    /// The endpoint with the fewest requests in flight (ties: round robin).
    LeastInFlight,
}

impl Choice for Balance {
    const ALL: &'static [Self] = &[Self::RoundRobin, Self::LeastInFlight];
    fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastInFlight => "least_in_flight",
        }
    }
}

/// A vLLM version, compared numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// The first vLLM that reads `kv_transfer_params.prompt_token_ids` on chat.
    pub const CHAT_TOKEN_REUSE: Self = Self(0, 27, 0);

    /// The vLLM on which `/v1/responses` was verified to read the same ids (0.32.0, the e2e
    /// tier's; its media and echo guards are 0.32's too): older decodes get the text decode.
    pub const RESPONSES_TOKEN_REUSE: Self = Self(0, 32, 0);

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
    name: String,
    endpoints: Vec<String>,
    balance: Balance,
    vllm_version: Option<Version>,
    tokenizer: Option<std::sync::Arc<crate::parity::Tokenizer>>,
    tls: Option<UpstreamTls>,
}

impl PoolSpec {
    /// Pool name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `host:port` of each engine; never empty.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Endpoint choice.
    pub fn balance(&self) -> Balance {
        self.balance
    }

    /// Pinned vLLM version, if any.
    pub fn vllm_version(&self) -> Option<Version> {
        self.vllm_version
    }

    /// The engines' tokenizer, loaded when the config was, if configured.
    pub fn tokenizer(&self) -> Option<&std::sync::Arc<crate::parity::Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// TLS to its engines (`None`: plain HTTP).
    pub fn tls(&self) -> Option<&UpstreamTls> {
        self.tls.as_ref()
    }
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

impl Mode {
    /// Label value (and its name in the file).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Orchestrate => "orchestrate",
            Self::Relay => "relay",
            Self::Passthrough => "passthrough",
        }
    }
}

impl Choice for Mode {
    const ALL: &'static [Self] = &[Self::Orchestrate, Self::Relay, Self::Passthrough];
    fn name(self) -> &'static str {
        self.as_str()
    }
}

/// How relay mode hands ids from the prefill to the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayHandoff {
    /// Kept in this instance's cache, found again by correlation keys.
    Cache,
    /// Returned inside the prefill response's `kv_transfer_params.prompt_token_ids`.
    Stateless,
}

impl Choice for RelayHandoff {
    const ALL: &'static [Self] = &[Self::Cache, Self::Stateless];
    fn name(self) -> &'static str {
        match self {
            Self::Cache => "cache",
            Self::Stateless => "stateless",
        }
    }
}

/// What an orchestrate route does with handoff fields (`kv_transfer_params`, ...) a client
/// put in its own body: the handoff is tokenonce's, never the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientHandoff {
    /// Remove them before any leg.
    Strip,
    /// Refuse the request with a 400.
    Reject,
}

impl Choice for ClientHandoff {
    const ALL: &'static [Self] = &[Self::Strip, Self::Reject];
    fn name(self) -> &'static str {
        match self {
            Self::Strip => "strip",
            Self::Reject => "reject",
        }
    }
}

/// What an orchestrate route does when its prefill leg fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnPrefillFailure {
    /// Answer the prefill's error.
    Error,
    /// Send the client's request to the decode alone (text path, no KV handoff).
    DecodeAlone,
}

impl Choice for OnPrefillFailure {
    const ALL: &'static [Self] = &[Self::Error, Self::DecodeAlone];
    fn name(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::DecodeAlone => "decode_alone",
        }
    }
}

/// The OTLP transport of the trace exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (`POST .../v1/traces`).
    Http,
    /// OTLP/gRPC.
    Grpc,
}

impl Choice for OtlpProtocol {
    const ALL: &'static [Self] = &[Self::Http, Self::Grpc];
    fn name(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Grpc => "grpc",
        }
    }
}

/// What a route does when the parity watch finds ids that do not carry their request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParityPolicy {
    /// Count and log it (the alert rule fires on the counter).
    Alert,
    /// Also send the route's decodes as text for a cool-down, until samples match again.
    DisableReuse,
}

impl Choice for ParityPolicy {
    const ALL: &'static [Self] = &[Self::Alert, Self::DisableReuse];
    fn name(self) -> &'static str {
        match self {
            Self::Alert => "alert",
            Self::DisableReuse => "disable_reuse",
        }
    }
}

/// What an orchestrate route does when the client leaves after a prefill that holds KV
/// blocks for the decode, before the decode answered a byte of its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnClientGone {
    /// Send the decode anyway with one token, not streamed, and discard its answer: the
    /// decode pulls the blocks and the prefill frees them.
    Release,
    /// Send nothing; the prefill keeps the blocks until its KV lease runs out.
    Abandon,
}

impl Choice for OnClientGone {
    const ALL: &'static [Self] = &[Self::Release, Self::Abandon];
    fn name(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Abandon => "abandon",
        }
    }
}

/// Where and how spans are exported (`[tracing]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    endpoint: String,
    protocol: OtlpProtocol,
    sampling_ratio: f64,
    service_name: String,
}

impl TracingSettings {
    /// Collector URL (`http://...`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// OTLP transport.
    pub fn protocol(&self) -> OtlpProtocol {
        self.protocol
    }

    /// Share of new traces sampled (0.0–1.0).
    pub fn sampling_ratio(&self) -> f64 {
        self.sampling_ratio
    }

    /// `service.name`.
    pub fn service_name(&self) -> &str {
        &self.service_name
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for a log pipeline.
    Json,
}

impl Choice for LogFormat {
    const ALL: &'static [Self] = &[Self::Text, Self::Json];
    fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

/// The relay cache bounds.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    capacity_bytes: usize,
    ttl: Duration,
}

impl CacheSettings {
    /// Byte capacity (positive).
    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    /// Entry lifetime (positive).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// What an allowlist entry names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowTarget {
    /// Any IP in this network.
    Net(IpNet),
    /// This exact host name (case-insensitive).
    Host(String),
}

/// One entry of a prefiller allowlist: a network or host name, and the ports it may be
/// named with (`None`: any port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowEntry {
    target: AllowTarget,
    ports: Option<(u16, u16)>,
}

impl AllowEntry {
    /// The network or host.
    pub fn target(&self) -> &AllowTarget {
        &self.target
    }

    /// True when `host:port` (a name, or the IP `ip` it is) is permitted.
    pub fn permits(&self, host: &str, ip: Option<IpAddr>, port: u16) -> bool {
        let target_ok = match (&self.target, ip) {
            (AllowTarget::Net(net), Some(ip)) => net.contains(&ip),
            (AllowTarget::Host(h), None) => h.eq_ignore_ascii_case(host),
            _ => false,
        };
        target_ok && self.ports.is_none_or(|(lo, hi)| (lo..=hi).contains(&port))
    }
}

/// Where a route's prefill leg goes.
#[derive(Debug, Clone)]
pub enum PrefillSource {
    /// Index into [`Config::pools`] (in range).
    Pool(usize),
    /// A request header naming one `host:port`, checked against `allow`.
    Header {
        /// Lower-case header name.
        name: String,
        /// Permitted hosts and networks (never empty).
        allow: Vec<AllowEntry>,
        /// Peers whose header is believed (the gateway); empty: any peer.
        trusted_sources: Vec<IpNet>,
        /// Send the client's credentials to the named prefiller too.
        forward_credentials: bool,
    },
}

/// `token_reuse`, validated: the share of requests whose decode reuses the prefill's ids,
/// in parts per million (0: off, 1,000,000: on). Which requests are in is decided by a
/// fixed-key hash of the request id ([`ReuseShare::admits`]): the same id always gets the
/// same answer (so a retried or logged request can be explained), and raising the share
/// only adds requests, never swaps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReuseShare {
    ppm: u32,
}

impl ReuseShare {
    /// Parts per million of "all".
    const WHOLE: u32 = 1_000_000;
    /// Reuse for every request.
    pub const ON: Self = Self { ppm: Self::WHOLE };
    /// Reuse for none (`token_reuse = false`).
    pub const OFF: Self = Self { ppm: 0 };

    /// A share from a fraction 0.0–1.0, rounded to a millionth; `None` outside the range
    /// (or NaN).
    pub fn from_fraction(f: f64) -> Option<Self> {
        if !(0.0..=1.0).contains(&f) {
            return None;
        }
        #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "0 <= f*1e6 <= 1e6")]
        let ppm = (f * f64::from(Self::WHOLE)).round() as u32;
        Some(Self { ppm })
    }

    /// `true` → all, `false` → none.
    pub fn from_switch(on: bool) -> Self {
        if on {
            Self::ON
        } else {
            Self::OFF
        }
    }

    /// No request reuses ids.
    pub fn is_off(self) -> bool {
        self.ppm == 0
    }

    /// The share as a fraction (for the startup log and the canary metric).
    pub fn fraction(self) -> f64 {
        f64::from(self.ppm) / f64::from(Self::WHOLE)
    }

    /// Whether the request with id `key` is inside the share: its bucket, a SipHash (fixed
    /// keys: stable across processes and restarts) of the id modulo a million, is below the
    /// share. Every request is in at 1.0 and none at 0.0.
    pub fn admits(self, key: &str) -> bool {
        use std::hash::{Hash, Hasher};
        if self.ppm >= Self::WHOLE {
            return true;
        }
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new();
        key.hash(&mut h);
        // u64 % 1e6 < 1e6 fits u32; the modulo bias is below 1e-13.
        let bucket = u32::try_from(h.finish() % u64::from(Self::WHOLE)).unwrap_or(0);
        bucket < self.ppm
    }
}

/// Per-route knobs.
#[derive(Debug, Clone)]
pub struct RouteOptions {
    token_reuse: ReuseShare,
    prefill_timeout: Duration,
    decode_first_byte_timeout: Duration,
    decode_whole_answer_timeout: Duration,
    max_body_bytes: usize,
    relay_handoff: RelayHandoff,
    client_handoff: ClientHandoff,
    retry_budget_percent: u32,
    retry_budget_min_per_second: u32,
    prefill_attempts: usize,
    on_prefill_failure: OnPrefillFailure,
    stream_idle_timeout: Duration,
    client_write_timeout: Duration,
    on_client_gone: OnClientGone,
    release_timeout: Duration,
    max_sse_event_bytes: usize,
    parity_sample: f64,
    on_parity_mismatch: ParityPolicy,
    parity_cooldown: Duration,
}

impl RouteOptions {
    /// The share of requests that reuse prefill ids on the decode.
    pub fn token_reuse(&self) -> ReuseShare {
        self.token_reuse
    }

    /// Whole prefill leg deadline (positive).
    pub fn prefill_timeout(&self) -> Duration {
        self.prefill_timeout
    }

    /// Decode response-header deadline (positive).
    pub fn decode_first_byte_timeout(&self) -> Duration {
        self.decode_first_byte_timeout
    }

    /// A non-streamed answer's deadline (positive).
    pub fn decode_whole_answer_timeout(&self) -> Duration {
        self.decode_whole_answer_timeout
    }

    /// Largest accepted body (positive).
    pub fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// Relay mode: where the ids wait between the legs.
    pub fn relay_handoff(&self) -> RelayHandoff {
        self.relay_handoff
    }

    /// Orchestrate: what to do with a client's own handoff fields.
    pub fn client_handoff(&self) -> ClientHandoff {
        self.client_handoff
    }

    /// Retries as a share of legs sent, percent (0–100).
    pub fn retry_budget_percent(&self) -> u32 {
        self.retry_budget_percent
    }

    /// Retries allowed per second whatever the traffic.
    pub fn retry_budget_min_per_second(&self) -> u32 {
        self.retry_budget_min_per_second
    }

    /// Pool prefill: endpoints tried (1–16; at most the pool's size at run time).
    pub fn prefill_attempts(&self) -> usize {
        self.prefill_attempts
    }

    /// Orchestrate: what a failed prefill leg leads to.
    pub fn on_prefill_failure(&self) -> OnPrefillFailure {
        self.on_prefill_failure
    }

    /// Silence allowed between body chunks of a relayed answer (positive).
    pub fn stream_idle_timeout(&self) -> Duration {
        self.stream_idle_timeout
    }

    /// How long one write to the client may wait (positive).
    pub fn client_write_timeout(&self) -> Duration {
        self.client_write_timeout
    }

    /// Orchestrate: a client gone after a prefill that holds KV.
    pub fn on_client_gone(&self) -> OnClientGone {
        self.on_client_gone
    }

    /// Deadline of the release leg (positive).
    pub fn release_timeout(&self) -> Duration {
        self.release_timeout
    }

    /// Longest SSE event relayed (positive).
    pub fn max_sse_event_bytes(&self) -> usize {
        self.max_sse_event_bytes
    }

    /// Share of reused requests the parity watch checks (0–1).
    pub fn parity_sample(&self) -> f64 {
        self.parity_sample
    }

    /// What a parity mismatch does.
    pub fn on_parity_mismatch(&self) -> ParityPolicy {
        self.on_parity_mismatch
    }

    /// Least time `disable_reuse` keeps reuse off (positive).
    pub fn parity_cooldown(&self) -> Duration {
        self.parity_cooldown
    }
}

/// What a route matches.
#[derive(Debug, Clone)]
pub struct RouteMatch {
    paths: Vec<String>,
    model: Option<GlobMatcher>,
    headers: Vec<(String, String)>,
}

impl RouteMatch {
    /// Exact paths (each starts with `/`); empty = any.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }

    /// Compiled model glob; `None` = any.
    pub fn model(&self) -> Option<&GlobMatcher> {
        self.model.as_ref()
    }

    /// Required header values (valid, lower-case names).
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }
}

/// One routing rule.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    name: String,
    matcher: RouteMatch,
    mode: Mode,
    prefill: Option<PrefillSource>,
    decode_pool: usize,
    options: RouteOptions,
}

impl RouteSpec {
    /// Name for metrics and logs (unique, `[A-Za-z0-9._-]+`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it matches.
    pub fn matcher(&self) -> &RouteMatch {
        &self.matcher
    }

    /// What it does.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Prefill destination: always set for orchestrate, a pool (or none) for relay, none for
    /// passthrough.
    pub fn prefill(&self) -> Option<&PrefillSource> {
        self.prefill.as_ref()
    }

    /// Index into [`Config::pools`] of the prefill pool, when the prefill goes to a pool.
    pub fn prefill_pool(&self) -> Option<usize> {
        match self.prefill {
            Some(PrefillSource::Pool(i)) => Some(i),
            _ => None,
        }
    }

    /// Index into [`Config::pools`] of the decode (and passthrough) pool; always in range.
    pub fn decode_pool(&self) -> usize {
        self.decode_pool
    }

    /// Knobs.
    pub fn options(&self) -> &RouteOptions {
        &self.options
    }
}

/// Process-level settings.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    listen: String,
    admin_listen: String,
    threads: usize,
    work_stealing: bool,
    grace_period_seconds: u64,
    graceful_shutdown_timeout_seconds: u64,
    log_level: String,
    log_format: LogFormat,
    admin_token: Option<AdminToken>,
    max_header_count: usize,
    max_header_bytes: usize,
    body_read_timeout: Duration,
    max_in_flight: usize,
    tls: Option<ServerTls>,
}

/// The TLS client listener.
#[derive(Debug, Clone)]
pub struct ServerTls {
    listen: String,
    identity: Identity,
}

impl ServerTls {
    /// Its address (`ip:port`, not one of the plain listeners').
    pub fn listen(&self) -> &str {
        &self.listen
    }

    /// Its certificate chain and key, as read when the config was loaded.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }
}

/// The secret state-changing admin requests must carry; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl AdminToken {
    /// A validated token (the checker's rules: long enough, printable).
    pub(crate) fn new(token: String) -> Self {
        Self(token)
    }

    /// True when `presented` is the token (compared in time independent of where they differ).
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

impl ServerSettings {
    /// Client listener (`ip:port`).
    pub fn listen(&self) -> &str {
        &self.listen
    }

    /// Admin listener (`ip:port`).
    pub fn admin_listen(&self) -> &str {
        &self.admin_listen
    }

    /// Proxy worker threads (positive).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether the worker threads share one work-stealing runtime.
    pub fn work_stealing(&self) -> bool {
        self.work_stealing
    }

    /// Grace period after SIGTERM.
    pub fn grace_period_seconds(&self) -> u64 {
        self.grace_period_seconds
    }

    /// Shutdown timeout after the grace period.
    pub fn graceful_shutdown_timeout_seconds(&self) -> u64 {
        self.graceful_shutdown_timeout_seconds
    }

    /// Log filter, valid `EnvFilter` syntax.
    pub fn log_level(&self) -> &str {
        &self.log_level
    }

    /// The token `/drain` requires; `None`: state-changing admin endpoints are off.
    pub fn admin_token(&self) -> Option<&AdminToken> {
        self.admin_token.as_ref()
    }

    /// Most header fields a request head may have.
    pub fn max_header_count(&self) -> usize {
        self.max_header_count
    }

    /// Most header bytes a request head may have.
    pub fn max_header_bytes(&self) -> usize {
        self.max_header_bytes
    }

    /// Deadline for a whole request body to arrive.
    pub fn body_read_timeout(&self) -> Duration {
        self.body_read_timeout
    }

    /// Client requests served at once (0: no bound).
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// Log format.
    pub fn log_format(&self) -> LogFormat {
        self.log_format
    }

    /// The TLS client listener, if configured.
    pub fn tls(&self) -> Option<&ServerTls> {
        self.tls.as_ref()
    }
}

/// Upstream connection settings.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    connect_timeout: Duration,
    idle_timeout: Duration,
    health_interval: Duration,
    eject_after_failures: u32,
}

impl UpstreamSettings {
    /// TCP connect timeout (positive).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Pooled idle connection lifetime (positive, below vLLM's 5 s keep-alive).
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Health poll period (positive).
    pub fn health_interval(&self) -> Duration {
        self.health_interval
    }

    /// Consecutive request failures that eject an endpoint (0: never).
    pub fn eject_after_failures(&self) -> u32 {
        self.eject_after_failures
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    server: ServerSettings,
    upstream: UpstreamSettings,
    pools: Vec<PoolSpec>,
    routes: Vec<RouteSpec>,
    passthrough_pool: usize,
    cache: CacheSettings,
    tracing: Option<TracingSettings>,
}

impl Config {
    /// Parses and validates TOML text; `source_name` labels the problems.
    ///
    /// # Errors
    /// [`ConfigError`] listing every problem found, in file order.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        check::from_toml(text).map_err(|problems| ConfigError { source_name: source_name.to_owned(), problems })
    }

    /// Process settings.
    pub fn server(&self) -> &ServerSettings {
        &self.server
    }

    /// Upstream settings.
    pub fn upstream(&self) -> &UpstreamSettings {
        &self.upstream
    }

    /// Pools (at least one, names unique), referenced by index from routes.
    pub fn pools(&self) -> &[PoolSpec] {
        &self.pools
    }

    /// Routes in match order.
    pub fn routes(&self) -> &[RouteSpec] {
        &self.routes
    }

    /// Index into [`Config::pools`] of the pool for unmatched requests; always in range.
    pub fn passthrough_pool(&self) -> usize {
        self.passthrough_pool
    }

    /// Relay cache bounds.
    pub fn cache(&self) -> &CacheSettings {
        &self.cache
    }

    /// Trace export (`None`: off).
    pub fn tracing(&self) -> Option<&TracingSettings> {
        self.tracing.as_ref()
    }
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
///
/// A port or port range may follow: `10.0.0.0/8:8000`, `prefill.svc:8000-8009`,
/// `[fd00::/8]:8000` (IPv6 needs the brackets when a port follows).
pub fn parse_allow(text: &str) -> Option<AllowEntry> {
    let (target, ports) = split_ports(text)?;
    let target = if let Ok(net) = target.parse::<IpNet>() {
        AllowTarget::Net(net)
    } else if let Ok(ip) = target.parse::<IpAddr>() {
        AllowTarget::Net(IpNet::from(ip))
    } else if !target.is_empty() && target.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-') {
        AllowTarget::Host(target.to_ascii_lowercase())
    } else {
        return None;
    };
    Some(AllowEntry { target, ports })
}

/// `target[:ports]` → target and the port range; `None` when the ports do not parse.
fn split_ports(text: &str) -> Option<(&str, Option<(u16, u16)>)> {
    let (target, ports) = if let Some(rest) = text.strip_prefix('[') {
        let (inner, after) = rest.split_once(']')?;
        match after.strip_prefix(':') {
            Some(p) => (inner, Some(p)),
            None if after.is_empty() => (inner, None),
            None => return None,
        }
    } else if text.matches(':').count() == 1 {
        let (t, p) = text.split_once(':')?;
        (t, Some(p))
    } else {
        (text, None) // a bare IPv6 address or network, or no port
    };
    let Some(ports) = ports else { return Some((target, None)) };
    let (lo, hi) = ports.split_once('-').unwrap_or((ports, ports));
    let (lo, hi) = (lo.parse::<u16>().ok()?, hi.parse::<u16>().ok()?);
    (lo >= 1 && lo <= hi).then_some((target, Some((lo, hi))))
}
