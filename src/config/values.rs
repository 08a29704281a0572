//! The value types of the config file: the named choices, and values parsed from one string
//! or number (a block size, a version, a canary share, an allowlist entry, a network, a model
//! glob). Each deserializes itself and says in its error what it wanted.

use std::fmt;
use std::net::IpAddr;

use globset::{Glob, GlobMatcher};
use ipnet::IpNet;
use serde::de::{Deserializer, Visitor};
use serde::Deserialize;

/// How a pool picks an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// Each endpoint in turn.
    #[default]
    RoundRobin,
    /// The endpoint with the fewest requests in flight (ties: round robin).
    LeastInFlight,
    /// The endpoint that holds most of the request's prompt, weighed against its load
    /// (`[pools.NAME.cache_aware]`); least in flight when nothing is known of the prompt.
    CacheAware,
}

/// What a route does with the requests it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// tokenonce runs the prefill and the decode leg itself.
    #[default]
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

/// How relay mode hands ids from the prefill to the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelayHandoff {
    /// Kept in this instance's cache, found again by correlation keys.
    #[default]
    Cache,
    /// Returned inside the prefill response's `kv_transfer_params.prompt_token_ids`.
    Stateless,
}

/// What an orchestrate route does with handoff fields (`kv_transfer_params`, ...) a client
/// put in its own body: the handoff is tokenonce's, never the client's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientHandoff {
    /// Remove them before any leg.
    #[default]
    Strip,
    /// Refuse the request with a 400.
    Reject,
}

/// What an orchestrate route does when its prefill leg fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPrefillFailure {
    /// Answer the prefill's error.
    #[default]
    Error,
    /// Send the client's request to the decode alone (text path, no KV handoff).
    DecodeAlone,
}

/// The OTLP transport of the trace exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (`POST .../v1/traces`).
    #[default]
    Http,
    /// OTLP/gRPC.
    Grpc,
}

/// What a route does when the parity watch finds ids that do not carry their request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParityPolicy {
    /// Count and log it (the alert rule fires on the counter).
    #[default]
    Alert,
    /// Also send the route's decodes as text for a cool-down, until samples match again.
    DisableReuse,
}

/// What an orchestrate route does when the client leaves after a prefill that holds KV
/// blocks for the decode, before the decode answered a byte of its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnClientGone {
    /// Send the decode anyway with one token, not streamed, and discard its answer: the
    /// decode pulls the blocks and the prefill frees them.
    #[default]
    Release,
    /// Send nothing; the prefill keeps the blocks until its KV lease runs out.
    Abandon,
}

/// What a pool does with the prompt ids tokenonce can compute itself (`local_ids`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalIdsMode {
    /// Nothing.
    #[default]
    Off,
    /// Compute them off the request path and compare with the prefill's echo; counted only.
    Shadow,
    /// Shadow, and a request of a shape that matched `local_ids_verify_after` times in a row
    /// sends its prefill token-in (no echo), but for a `local_ids_recheck` share.
    On,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for a log pipeline.
    Json,
}

/// Tokens per KV block, as the engines' `--block-size`: 1 to 65,536, for both
/// `kv_events.block_size` and `cache_aware.block_size`, which name that one engine setting
/// (where both are used they must also be equal: a rule across keys, in `check.rs`). vLLM
/// takes any positive size (older releases a power of two from 8 to 256, or 1; its CPU backend
/// a multiple of 32) and raises a hybrid (Mamba) model's attention block to hundreds or
/// thousands of tokens so its pages line up with the Mamba state's: the bound leaves room for
/// those, and a larger number is a typo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "u32")]
pub struct BlockSize(u32);

impl BlockSize {
    /// The largest block size taken.
    pub const MAX: u32 = 65_536;
    /// vLLM's default on GPUs.
    pub const DEFAULT: Self = Self(16);

    /// Tokens per block.
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = String;
    fn try_from(n: u32) -> Result<Self, String> {
        (1..=Self::MAX).contains(&n).then_some(Self(n)).ok_or_else(|| format!("must be between 1 and {}", Self::MAX))
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A vLLM version, compared numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
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

impl TryFrom<String> for Version {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        Self::parse(&text).ok_or_else(|| format!("`{text}` is not a version"))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// `token_reuse`: the share of requests whose decode reuses the prefill's ids, in parts per
/// million (0: off, 1,000,000: on), written as a switch or a fraction. Which requests are in
/// is decided by a fixed-key hash of the request id ([`ReuseShare::admits`]): the same id
/// always gets the same answer (so a retried or logged request can be explained), and raising
/// the share only adds requests, never swaps them.
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

impl<'de> Deserialize<'de> for ReuseShare {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Share;
        impl Visitor<'_> for Share {
            type Value = ReuseShare;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true, false or a fraction between 0.0 and 1.0")
            }
            fn visit_bool<E>(self, v: bool) -> Result<ReuseShare, E> {
                Ok(if v { ReuseShare::ON } else { ReuseShare::OFF })
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ReuseShare, E> {
                ReuseShare::from_fraction(v)
                    .ok_or_else(|| E::custom(format!("a share must be between 0.0 and 1.0, not {v}")))
            }
            #[expect(clippy::cast_precision_loss, reason = "only 0 and 1 are in range, and exact")]
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ReuseShare, E> {
                self.visit_f64(v as f64)
            }
        }
        deserializer.deserialize_any(Share)
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
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
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

impl TryFrom<String> for AllowEntry {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        parse_allow(&text).ok_or_else(|| format!("`{text}` is not a host or CIDR with an optional :port or :port-port"))
    }
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

/// A network written as a CIDR or a bare IP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Net(pub IpNet);

impl TryFrom<String> for Net {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse::<IpNet>()
            .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
            .map(Net)
            .map_err(|_| format!("`{text}` is not an IP or CIDR"))
    }
}

/// A glob on the body's `model`, compiled once.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "String")]
pub struct ModelGlob(pub GlobMatcher);

impl PartialEq for ModelGlob {
    fn eq(&self, other: &Self) -> bool {
        self.0.glob() == other.0.glob()
    }
}

impl TryFrom<String> for ModelGlob {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        Glob::new(&text).map(|g| Self(g.compile_matcher())).map_err(|e| format!("bad glob: {e}"))
    }
}
