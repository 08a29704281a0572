//! The TOML file format: serde structs only, mirroring what operators write. Every key is
//! optional here, scalars keep their span and their type error ([`Field`]) and each table
//! keeps the keys it does not know (`unknown`), so `model.rs` can report a missing key, a
//! wrong type and a typo next to every other problem. Defaults: [`super::defaults`].

use std::collections::BTreeMap;
use std::ops::Range;

use serde::de::{DeserializeOwned, Deserializer};
use serde::Deserialize;
use toml::Spanned;

/// Keys of a table that no field takes (reported by the validator, with their place).
pub type Unknown = BTreeMap<String, toml::Value>;

/// A scalar as written: where it is, and its value or why it has the wrong type.
#[derive(Debug, Clone)]
pub struct Field<T> {
    span: Range<usize>,
    value: Result<T, String>,
}

impl<T> Field<T> {
    /// Byte range of the value in the file.
    pub fn span(&self) -> Range<usize> {
        self.span.clone()
    }

    /// The value, or the type error (e.g. `invalid type: string "two", expected i64`).
    ///
    /// # Errors
    /// When the value has the wrong type.
    pub fn value(&self) -> Result<&T, &str> {
        self.value.as_ref().map_err(String::as_str)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Any value is accepted here; the type is checked second, so a wrong one is a problem
        // of this key instead of the end of the parse.
        let raw = Spanned::<toml::Value>::deserialize(deserializer)?;
        let span = raw.span();
        let value = T::deserialize(raw.into_inner()).map_err(|e| e.message().to_owned());
        Ok(Self { span, value })
    }
}

/// The whole file.
#[derive(Debug, Deserialize, Default)]
pub struct File {
    /// Listeners, threads, shutdown, logging.
    #[serde(default)]
    pub server: Server,
    /// Settings shared by every upstream connection.
    #[serde(default)]
    pub upstream: Upstream,
    /// Named pools of engine endpoints.
    #[serde(default)]
    pub pools: BTreeMap<String, Spanned<Pool>>,
    /// Where unmatched requests go.
    #[serde(default)]
    pub defaults: Defaults,
    /// Ordered routing rules; the first match wins.
    #[serde(default)]
    pub routes: Vec<Spanned<Route>>,
    /// The relay-mode id cache.
    #[serde(default)]
    pub cache: Cache,
    /// OpenTelemetry trace export (none: off).
    pub tracing: Option<Spanned<Tracing>>,
    /// Unknown top-level keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[tracing]`: spans of each request and its legs, exported over OTLP.
#[derive(Debug, Deserialize, Default)]
pub struct Tracing {
    /// Collector URL (required): its OTLP/HTTP traces path for `http`, its address for `grpc`.
    pub endpoint: Option<Field<String>>,
    /// OTLP transport, `http` (protobuf) or `grpc` ([`TRACING_PROTOCOL`](super::defaults::TRACING_PROTOCOL)).
    pub protocol: Option<Field<String>>,
    /// Share of new traces sampled, from none to all; a client's `traceparent` decides for its own
    /// ([`TRACING_SAMPLING_RATIO`](super::defaults::TRACING_SAMPLING_RATIO)).
    pub sampling_ratio: Option<Field<f64>>,
    /// `service.name` of the spans ([`TRACING_SERVICE_NAME`](super::defaults::TRACING_SERVICE_NAME)).
    pub service_name: Option<Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[cache]`
#[derive(Debug, Deserialize, Default)]
pub struct Cache {
    /// Largest total size of cached ids, bytes ([`CACHE_CAPACITY_BYTES`](super::defaults::CACHE_CAPACITY_BYTES)).
    pub capacity_bytes: Option<Field<i64>>,
    /// How long ids wait for their decode, ms ([`CACHE_TTL_MS`](super::defaults::CACHE_TTL_MS)).
    pub ttl_ms: Option<Field<i64>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[server]`
#[derive(Debug, Deserialize, Default)]
pub struct Server {
    /// Client listener, `ip:port` ([`LISTEN`](super::defaults::LISTEN)).
    pub listen: Option<Field<String>>,
    /// Admin listener for `/metrics`, `/healthz`, `/readyz` ([`ADMIN_LISTEN`](super::defaults::ADMIN_LISTEN)).
    pub admin_listen: Option<Field<String>>,
    /// Worker threads of the proxy service ([`THREADS`](super::defaults::THREADS)).
    pub threads: Option<Field<i64>>,
    /// Whether idle worker threads steal queued tasks ([`WORK_STEALING`](super::defaults::WORK_STEALING)).
    pub work_stealing: Option<Field<bool>>,
    /// Seconds to let in-flight streams finish after SIGTERM
    /// ([`GRACE_PERIOD_SECONDS`](super::defaults::GRACE_PERIOD_SECONDS)).
    pub grace_period_seconds: Option<Field<i64>>,
    /// Seconds allowed for services to stop after the grace period
    /// ([`GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS`](super::defaults::GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS)).
    pub graceful_shutdown_timeout_seconds: Option<Field<i64>>,
    /// Log filter, tracing `EnvFilter` syntax ([`LOG_LEVEL`](super::defaults::LOG_LEVEL));
    /// `TOKENONCE_LOG` overrides it.
    pub log_level: Option<Field<String>>,
    /// Log format, `text` or `json` ([`LOG_FORMAT`](super::defaults::LOG_FORMAT)).
    pub log_format: Option<Field<String>>,
    /// File holding the token `/drain` requires (no file: `/drain` is off).
    pub admin_token_file: Option<Field<String>>,
    /// Most header fields per request head ([`MAX_HEADER_COUNT`](super::defaults::MAX_HEADER_COUNT)).
    pub max_header_count: Option<Field<i64>>,
    /// Most header bytes per request head ([`MAX_HEADER_BYTES`](super::defaults::MAX_HEADER_BYTES)).
    pub max_header_bytes: Option<Field<i64>>,
    /// Deadline for a whole request body, ms
    /// ([`BODY_READ_TIMEOUT_MS`](super::defaults::BODY_READ_TIMEOUT_MS)).
    pub body_read_timeout_ms: Option<Field<i64>>,
    /// Client requests served at once; past it `overloaded` (zero: no bound)
    /// ([`MAX_IN_FLIGHT`](super::defaults::MAX_IN_FLIGHT)).
    pub max_in_flight: Option<Field<i64>>,
    /// A second client listener that speaks TLS (none: plain HTTP only).
    pub tls: Option<Spanned<ServerTls>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[server.tls]`: the TLS client listener; its certificate is read again on SIGHUP.
#[derive(Debug, Deserialize, Default)]
pub struct ServerTls {
    /// `ip:port` it listens on (required).
    pub listen: Option<Field<String>>,
    /// PEM certificate chain, leaf first (required).
    pub cert_file: Option<Field<String>>,
    /// PEM private key of the leaf certificate (required).
    pub key_file: Option<Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[upstream]`
#[derive(Debug, Deserialize, Default)]
pub struct Upstream {
    /// TCP connect timeout, ms ([`CONNECT_TIMEOUT_MS`](super::defaults::CONNECT_TIMEOUT_MS)).
    pub connect_timeout_ms: Option<Field<i64>>,
    /// How long an idle pooled connection is kept, ms; must stay below vLLM's keep-alive
    /// ([`IDLE_TIMEOUT_MS`](super::defaults::IDLE_TIMEOUT_MS)).
    pub idle_timeout_ms: Option<Field<i64>>,
    /// How often each endpoint's `/health` is polled, ms
    /// ([`HEALTH_INTERVAL_MS`](super::defaults::HEALTH_INTERVAL_MS)).
    pub health_interval_ms: Option<Field<i64>>,
    /// Consecutive request failures (no answer, or a server error) that eject an endpoint for a
    /// growing backoff; zero: never ([`EJECT_AFTER_FAILURES`](super::defaults::EJECT_AFTER_FAILURES)).
    pub eject_after_failures: Option<Field<i64>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[pools.NAME]`
#[derive(Debug, Deserialize, Default)]
pub struct Pool {
    /// `host:port` of each engine (required).
    pub endpoints: Option<Spanned<Vec<Field<String>>>>,
    /// `round_robin` or `least_in_flight` ([`BALANCE`](super::defaults::BALANCE)).
    pub balance: Option<Field<String>>,
    /// Pin the engines' vLLM version instead of asking `GET /version`.
    pub vllm_version: Option<Field<String>>,
    /// The engines' `tokenizer.json` (or the model folder holding it): bounds relayed ids and
    /// drives the parity watch (none: neither).
    pub tokenizer: Option<Field<String>>,
    /// TLS to the pool's engines (none: plain HTTP).
    pub tls: Option<Spanned<PoolTls>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[pools.NAME.tls]`: how the pool's legs (and passthrough, and health polls) speak TLS.
#[derive(Debug, Deserialize, Default)]
pub struct PoolTls {
    /// PEM bundle of the CAs trusted for the engines' certificates (none: the system's).
    pub ca_file: Option<Field<String>>,
    /// Name sent as SNI and checked against the certificate (none: each endpoint's host).
    pub server_name: Option<Field<String>>,
    /// PEM client certificate chain, for engines that require mTLS (with `key_file`).
    pub cert_file: Option<Field<String>>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<Field<String>>,
    /// Check the engine's certificate chain and name ([`UPSTREAM_TLS_VERIFY`](super::defaults::UPSTREAM_TLS_VERIFY)).
    pub verify: Option<Field<bool>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[defaults]`
#[derive(Debug, Deserialize, Default)]
pub struct Defaults {
    /// Pool that receives every request no route matches
    /// ([`PASSTHROUGH_POOL`](super::defaults::PASSTHROUGH_POOL)).
    pub passthrough_pool: Option<Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[[routes]]`
#[derive(Debug, Deserialize, Default)]
pub struct Route {
    /// Name used in metrics and logs (required).
    pub name: Option<Field<String>>,
    /// What requests this route takes.
    #[serde(default, rename = "match")]
    pub matcher: Match,
    /// `orchestrate`, `relay` or `passthrough` (required).
    pub mode: Option<Field<String>>,
    /// Relay only: `cache` (ids kept here until the decode) or `stateless` (ids ride in the
    /// prefill response's `kv_transfer_params`, which the orchestrator copies to the decode)
    /// ([`RELAY_HANDOFF`](super::defaults::RELAY_HANDOFF)).
    pub relay_handoff: Option<Field<String>>,
    /// Where the prefill leg goes (required for orchestrate).
    pub prefill: Option<Spanned<Prefill>>,
    /// Pool of the decode leg and of passthrough (required).
    pub decode_pool: Option<Field<String>>,
    /// Reuse the prefill's prompt ids on the decode: `true`, `false`, or the share of
    /// requests (a fraction from zero to one) that reuse them, a canary ([`TOKEN_REUSE`](super::defaults::TOKEN_REUSE)).
    pub token_reuse: Option<Field<TokenReuse>>,
    /// Whole prefill leg deadline, ms ([`PREFILL_TIMEOUT_MS`](super::defaults::PREFILL_TIMEOUT_MS)).
    pub prefill_timeout_ms: Option<Field<i64>>,
    /// Decode response-header deadline, ms
    /// ([`DECODE_FIRST_BYTE_TIMEOUT_MS`](super::defaults::DECODE_FIRST_BYTE_TIMEOUT_MS)).
    pub decode_first_byte_timeout_ms: Option<Field<i64>>,
    /// A non-streamed answer's deadline (vLLM sends its head when generation is done), ms
    /// ([`DECODE_WHOLE_ANSWER_TIMEOUT_MS`](super::defaults::DECODE_WHOLE_ANSWER_TIMEOUT_MS)).
    pub decode_whole_answer_timeout_ms: Option<Field<i64>>,
    /// Silence allowed between body chunks or SSE events of a relayed answer, ms
    /// ([`STREAM_IDLE_TIMEOUT_MS`](super::defaults::STREAM_IDLE_TIMEOUT_MS)).
    pub stream_idle_timeout_ms: Option<Field<i64>>,
    /// How long one write to the client may wait for it to read, ms
    /// ([`CLIENT_WRITE_TIMEOUT_MS`](super::defaults::CLIENT_WRITE_TIMEOUT_MS)).
    pub client_write_timeout_ms: Option<Field<i64>>,
    /// Orchestrate: a client gone after a prefill holding KV, `release` or `abandon`
    /// ([`ON_CLIENT_GONE`](super::defaults::ON_CLIENT_GONE)).
    pub on_client_gone: Option<Field<String>>,
    /// Deadline of the release leg, ms ([`RELEASE_TIMEOUT_MS`](super::defaults::RELEASE_TIMEOUT_MS)).
    pub release_timeout_ms: Option<Field<i64>>,
    /// Longest SSE event relayed, bytes ([`MAX_SSE_EVENT_BYTES`](super::defaults::MAX_SSE_EVENT_BYTES)).
    pub max_sse_event_bytes: Option<Field<i64>>,
    /// Largest accepted request body, bytes ([`MAX_BODY_BYTES`](super::defaults::MAX_BODY_BYTES)).
    pub max_body_bytes: Option<Field<i64>>,
    /// Retries of unstarted legs as a share of legs sent, percent
    /// ([`RETRY_BUDGET_PERCENT`](super::defaults::RETRY_BUDGET_PERCENT)).
    pub retry_budget_percent: Option<Field<i64>>,
    /// Retries allowed per second whatever the traffic
    /// ([`RETRY_BUDGET_MIN_PER_SECOND`](super::defaults::RETRY_BUDGET_MIN_PER_SECOND)).
    pub retry_budget_min_per_second: Option<Field<i64>>,
    /// Pool prefill: endpoints tried when one fails before answering or with a server error, at most
    /// the pool's size ([`PREFILL_ATTEMPTS`](super::defaults::PREFILL_ATTEMPTS)).
    pub prefill_attempts: Option<Field<i64>>,
    /// Orchestrate: a failed prefill leg, `error` or `decode_alone`
    /// ([`ON_PREFILL_FAILURE`](super::defaults::ON_PREFILL_FAILURE)).
    pub on_prefill_failure: Option<Field<String>>,
    /// Orchestrate: a client's own `kv_transfer_params`, `strip` or `reject`
    /// ([`CLIENT_KV_TRANSFER_PARAMS`](super::defaults::CLIENT_KV_TRANSFER_PARAMS)).
    pub client_kv_transfer_params: Option<Field<String>>,
    /// Share of reused requests the parity watch checks, none to all
    /// ([`PARITY_SAMPLE`](super::defaults::PARITY_SAMPLE)); needs a pool `tokenizer`.
    pub parity_sample: Option<Field<f64>>,
    /// What a parity mismatch does, `alert` or `disable_reuse`
    /// ([`ON_PARITY_MISMATCH`](super::defaults::ON_PARITY_MISMATCH)).
    pub on_parity_mismatch: Option<Field<String>>,
    /// How long `disable_reuse` keeps reuse off at least, ms
    /// ([`PARITY_COOLDOWN_MS`](super::defaults::PARITY_COOLDOWN_MS)).
    pub parity_cooldown_ms: Option<Field<i64>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `token_reuse` as written: a switch, or a share of requests (range checked by the validator).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenReuse {
    /// `true` / `false`.
    Switch(bool),
    /// A number, meant to be a fraction from zero to one (integers are numbers too).
    Share(f64),
}

impl<'de> Deserialize<'de> for TokenReuse {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = TokenReuse;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a boolean or a fraction between 0.0 and 1.0")
            }
            fn visit_bool<E>(self, v: bool) -> Result<TokenReuse, E> {
                Ok(TokenReuse::Switch(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<TokenReuse, E> {
                Ok(TokenReuse::Share(v))
            }
            #[expect(clippy::cast_precision_loss, reason = "range-checked by the validator; 0 and 1 are exact")]
            fn visit_i64<E>(self, v: i64) -> Result<TokenReuse, E> {
                Ok(TokenReuse::Share(v as f64))
            }
            #[expect(clippy::cast_precision_loss, reason = "range-checked by the validator; 0 and 1 are exact")]
            fn visit_u64<E>(self, v: u64) -> Result<TokenReuse, E> {
                Ok(TokenReuse::Share(v as f64))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `[routes.match]`
#[derive(Debug, Deserialize, Default)]
pub struct Match {
    /// Exact paths (none: any path).
    #[serde(default)]
    pub paths: Vec<Field<String>>,
    /// Glob on the body's `model` (none: any model, including none).
    pub model: Option<Field<String>>,
    /// Header name → exact value, all required.
    #[serde(default)]
    pub headers: BTreeMap<String, Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[routes.prefill]`: a pool, or a header naming the prefiller (llm-d's endpoint picker).
#[derive(Debug, Deserialize, Default)]
pub struct Prefill {
    /// Name of a pool.
    pub pool: Option<Field<String>>,
    /// Header carrying one `host:port`, e.g. `x-prefiller-host-port`.
    pub header: Option<Field<String>>,
    /// Hosts or CIDRs the header may name, each optionally with `:port` or `:port-port`
    /// (required with `header`).
    #[serde(default)]
    pub allow: Vec<Field<String>>,
    /// CIDRs of the peers whose header is believed, e.g. the gateway (none: any peer).
    #[serde(default)]
    pub trusted_sources: Vec<Field<String>>,
    /// Send the client's credentials to the named prefiller
    /// ([`FORWARD_CREDENTIALS`](super::defaults::FORWARD_CREDENTIALS)).
    pub forward_credentials: Option<Field<bool>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}
