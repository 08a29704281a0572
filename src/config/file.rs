//! The TOML file format: serde structs only, mirroring what operators write. Every key is
//! optional here, scalars keep their span and their type error ([`Field`]) and each table
//! keeps the keys it does not know (`unknown`), so `model.rs` can report a missing key, a
//! wrong type and a typo next to every other problem. Defaults: [`super::defaults`].
//!
//! Each field's doc is its entry in `docs/configuration.md`, which `tests/docs.rs` generates
//! from this file (`TOKENONCE_BLESS=1 cargo test --test docs` rewrites it): what the key
//! means, then a `Default:` line whose backticked value is written as in TOML (the test loads
//! it and checks it changes nothing) and links the constant whose doc gives the reason.

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
    /// The client and admin listeners, threads, shutdown, logging and the client edge's limits.
    #[serde(default)]
    pub server: Server,
    /// Settings shared by every connection to an engine.
    #[serde(default)]
    pub upstream: Upstream,
    /// Named pools of engine endpoints; routes name them.
    #[serde(default)]
    pub pools: BTreeMap<String, Spanned<Pool>>,
    /// Where requests no route matches go: every other path too (`/v1/models`, `/health`,
    /// `/tokenize`, the engine's `/metrics`, ...), proxied byte for byte.
    #[serde(default)]
    pub defaults: Defaults,
    /// Ordered routing rules; the first match wins.
    #[serde(default)]
    pub routes: Vec<Spanned<Route>>,
    /// The relay-mode id cache.
    #[serde(default)]
    pub cache: Cache,
    /// OpenTelemetry trace export.
    pub tracing: Option<Spanned<Tracing>>,
    /// Unknown top-level keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[tracing]`: spans of each request and its legs, exported over OTLP. Without this table
/// tracing is off (no layer installed, no span made, a client's `traceparent`
/// reaches the engines unchanged). Fixed at start.
#[derive(Debug, Deserialize, Default)]
pub struct Tracing {
    /// The collector's URL (required): `http://host:4318/v1/traces` for `http`,
    /// `http://host:4317` for `grpc` (plain HTTP: run a collector beside tokenonce).
    pub endpoint: Option<Field<String>>,
    /// OTLP transport: `http` (protobuf) or `grpc`.
    /// Default: `"http"` ([`TRACING_PROTOCOL`](super::defaults::TRACING_PROTOCOL)).
    pub protocol: Option<Field<String>>,
    /// Share (from none to all, a float) of the traces started here that are sampled; a
    /// client's `traceparent` decides for its own trace (parent-based sampling).
    /// Default: `1.0` ([`TRACING_SAMPLING_RATIO`](super::defaults::TRACING_SAMPLING_RATIO)).
    pub sampling_ratio: Option<Field<f64>>,
    /// `service.name` of the spans.
    /// Default: `"tokenonce"` ([`TRACING_SERVICE_NAME`](super::defaults::TRACING_SERVICE_NAME)).
    pub service_name: Option<Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[cache]`: shared by every relay route with `relay_handoff = "cache"`; ids are stored as
/// 4-byte integers and the oldest entries are evicted first. Fixed at start.
#[derive(Debug, Deserialize, Default)]
pub struct Cache {
    /// Largest total size of the cached ids, bytes.
    /// Default: `268435456` ([`CACHE_CAPACITY_BYTES`](super::defaults::CACHE_CAPACITY_BYTES)).
    pub capacity_bytes: Option<Field<i64>>,
    /// How long ids wait for their decode, ms; an entry also leaves when used.
    /// Default: `30000` ([`CACHE_TTL_MS`](super::defaults::CACHE_TTL_MS)).
    pub ttl_ms: Option<Field<i64>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[server]`
#[derive(Debug, Deserialize, Default)]
pub struct Server {
    /// Client listener, `ip:port` (port 0: any free port; the `tokenonce listening` log line
    /// names the bound addresses). Fixed at start.
    /// Default: `"0.0.0.0:8000"` ([`LISTEN`](super::defaults::LISTEN)).
    pub listen: Option<Field<String>>,
    /// Admin listener for `/metrics`, `/healthz`, `/readyz` and `/drain`. Fixed at start.
    /// Default: `"127.0.0.1:9000"` ([`ADMIN_LISTEN`](super::defaults::ADMIN_LISTEN)).
    pub admin_listen: Option<Field<String>>,
    /// Worker threads of the proxy service. Fixed at start.
    /// Default: `2` ([`THREADS`](super::defaults::THREADS)).
    pub threads: Option<Field<i64>>,
    /// `true`: one runtime whose idle threads steal queued tasks (pingora's default); `false`:
    /// each thread runs its own runtime and keeps the connections it accepted, with no
    /// cross-thread wake-ups (CPU per request within noise of the default, see the
    /// performance chapter) and a less even balance when a few connections carry most of
    /// the load. Fixed at start.
    /// Default: `true` ([`WORK_STEALING`](super::defaults::WORK_STEALING)).
    pub work_stealing: Option<Field<bool>>,
    /// Seconds in-flight streams may finish after SIGTERM. Fixed at start.
    /// Default: `5` ([`GRACE_PERIOD_SECONDS`](super::defaults::GRACE_PERIOD_SECONDS)).
    pub grace_period_seconds: Option<Field<i64>>,
    /// Seconds services then get to stop. Fixed at start.
    /// Default: `5` ([`GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS`](super::defaults::GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS)).
    pub graceful_shutdown_timeout_seconds: Option<Field<i64>>,
    /// Log filter in tracing's `EnvFilter` syntax (`warn,tokenonce=debug`; a bare word must be
    /// a level); the `TOKENONCE_LOG` environment variable overrides it. Fixed at start.
    /// Default: `"info"` ([`LOG_LEVEL`](super::defaults::LOG_LEVEL)).
    pub log_level: Option<Field<String>>,
    /// Log format, `text` or `json`. Fixed at start.
    /// Default: `"text"` ([`LOG_FORMAT`](super::defaults::LOG_FORMAT)).
    pub log_format: Option<Field<String>>,
    /// File holding the token (at least sixteen printable characters) that `/drain` requires
    /// as `Authorization: Bearer <token>`; without it `/drain` answers 403.
    pub admin_token_file: Option<Field<String>>,
    /// Most header fields per request head (431 `headers_too_large` above).
    /// Default: `100` ([`MAX_HEADER_COUNT`](super::defaults::MAX_HEADER_COUNT)).
    pub max_header_count: Option<Field<i64>>,
    /// Most header bytes per request head (431 `headers_too_large` above).
    /// Default: `65536` ([`MAX_HEADER_BYTES`](super::defaults::MAX_HEADER_BYTES)).
    pub max_header_bytes: Option<Field<i64>>,
    /// Deadline for a whole request body, ms (408 `request_timeout` after: slow or stalled
    /// clients).
    /// Default: `60000` ([`BODY_READ_TIMEOUT_MS`](super::defaults::BODY_READ_TIMEOUT_MS)).
    pub body_read_timeout_ms: Option<Field<i64>>,
    /// Most client requests served at once, plain and TLS listeners together; past it 503
    /// `overloaded` with `Retry-After: 1`, before any leg (zero: no bound). A reload applies it
    /// to the next request.
    /// Default: `1024` ([`MAX_IN_FLIGHT`](super::defaults::MAX_IN_FLIGHT)).
    pub max_in_flight: Option<Field<i64>>,
    /// A second client listener that speaks TLS (none: plain HTTP only).
    pub tls: Option<Spanned<ServerTls>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[server.tls]`: it speaks HTTP/1.1 and serves the same routes as the plain `server.listen`,
/// which keeps running beside it; its certificate is read again on SIGHUP (new handshakes get
/// the new certificate; files that do not load keep the old config).
#[derive(Debug, Deserialize, Default)]
pub struct ServerTls {
    /// `ip:port` it listens on (required); must differ from both plain listeners. Fixed at start.
    pub listen: Option<Field<String>>,
    /// PEM certificate chain, leaf first (required).
    pub cert_file: Option<Field<String>>,
    /// PEM private key of the leaf certificate (required; it must belong to the certificate).
    pub key_file: Option<Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[upstream]`
#[derive(Debug, Deserialize, Default)]
pub struct Upstream {
    /// TCP connect deadline, ms. Fixed at start.
    /// Default: `2000` ([`CONNECT_TIMEOUT_MS`](super::defaults::CONNECT_TIMEOUT_MS)).
    pub connect_timeout_ms: Option<Field<i64>>,
    /// How long an idle pooled connection is kept, ms; must stay below vLLM's keep-alive
    /// (under five seconds). Fixed at start.
    /// Default: `4000` ([`IDLE_TIMEOUT_MS`](super::defaults::IDLE_TIMEOUT_MS)).
    pub idle_timeout_ms: Option<Field<i64>>,
    /// How often each endpoint's `/health` is polled, ms (all endpoints at once, each within a
    /// second). Fixed at start.
    /// Default: `2000` ([`HEALTH_INTERVAL_MS`](super::defaults::HEALTH_INTERVAL_MS)).
    pub health_interval_ms: Option<Field<i64>>,
    /// Consecutive request failures (no answer, a 5xx, or a deadline that passed while the
    /// endpoint held the leg) that eject an endpoint from its pool's choice for five seconds,
    /// doubling while it keeps failing (at most two minutes); one answer below 500 resets it,
    /// and a healthy `/health` does not readmit it early (an engine can answer `/health` and
    /// fail every request). Zero: never eject (a failing endpoint then keeps its share of
    /// first picks; a pool prefill still fails over from it).
    /// Default: `3` ([`EJECT_AFTER_FAILURES`](super::defaults::EJECT_AFTER_FAILURES)).
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
    /// `round_robin` or `least_in_flight`; unhealthy endpoints are skipped while a healthy one
    /// exists.
    /// Default: `"round_robin"` ([`BALANCE`](super::defaults::BALANCE)).
    pub balance: Option<Field<String>>,
    /// Pin the engines' vLLM version instead of asking `GET /version`.
    pub vllm_version: Option<Field<String>>,
    /// The engines' `tokenizer.json`, or the model folder holding it; loaded at start and on
    /// SIGHUP (`tokenonce check` loads it too). A route uses its decode pool's, else its
    /// prefill pool's: relayed ids at or past its vocabulary (added tokens included) fall back
    /// (`ids_out_of_vocab`), and the parity watch samples the route (none: neither).
    pub tokenizer: Option<Field<String>>,
    /// TLS to the pool's engines (none: plain HTTP).
    pub tls: Option<Spanned<PoolTls>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[pools.NAME.tls]`: every connection to the pool's engines is then TLS (the prefill and
/// decode legs, passthrough, health and version polls).
#[derive(Debug, Deserialize, Default)]
pub struct PoolTls {
    /// PEM bundle of the CAs trusted for the engines' certificates (none: the system's store).
    pub ca_file: Option<Field<String>>,
    /// Name sent as SNI and checked against the engines' certificates (none: each endpoint's
    /// host; required with verification when an endpoint is an IP address).
    pub server_name: Option<Field<String>>,
    /// PEM client certificate chain, for engines that require mTLS (with `key_file`).
    pub cert_file: Option<Field<String>>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<Field<String>>,
    /// Check the engine's certificate chain and name; `false` accepts any certificate
    /// (encryption without authentication).
    /// Default: `true` ([`UPSTREAM_TLS_VERIFY`](super::defaults::UPSTREAM_TLS_VERIFY)).
    pub verify: Option<Field<bool>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[defaults]`
#[derive(Debug, Deserialize, Default)]
pub struct Defaults {
    /// Pool that receives every request no route matches.
    /// Default: `"decode"` ([`PASSTHROUGH_POOL`](super::defaults::PASSTHROUGH_POOL)).
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
    /// What requests this route takes (none: every request).
    #[serde(default, rename = "match")]
    pub matcher: Match,
    /// `orchestrate` (POST `/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
    /// `/v1/messages`: tokenonce sends both legs), `relay` (an orchestrator sends both legs
    /// through tokenonce) or `passthrough` (bytes to the decode pool unchanged) (required).
    pub mode: Option<Field<String>>,
    /// Relay only: `cache` (ids kept here until the decode) or `stateless` (ids ride in the
    /// prefill response's `kv_transfer_params`, which the orchestrator copies to the decode).
    /// Default: `"cache"` ([`RELAY_HANDOFF`](super::defaults::RELAY_HANDOFF)).
    pub relay_handoff: Option<Field<String>>,
    /// Where the prefill leg goes: a pool, or the prefiller a request header names (required
    /// for orchestrate).
    pub prefill: Option<Spanned<Prefill>>,
    /// Pool of the decode leg, and of passthrough (required).
    pub decode_pool: Option<Field<String>>,
    /// Reuse the prefill's prompt ids on the decode: `true`, `false`, or the share of requests
    /// (a fraction from zero to one) that reuse them, a canary decided by a hash of the request
    /// id (the rest counted as `reason="canary"`).
    /// Default: `true` ([`TOKEN_REUSE`](super::defaults::TOKEN_REUSE)).
    pub token_reuse: Option<Field<TokenReuse>>,
    /// Deadline of the whole prefill leg, ms (the prefill's KV lease is thirty seconds by
    /// default).
    /// Default: `30000` ([`PREFILL_TIMEOUT_MS`](super::defaults::PREFILL_TIMEOUT_MS)).
    pub prefill_timeout_ms: Option<Field<i64>>,
    /// Deadline of the decode's response head for a streamed request (`stream: true`), ms;
    /// for non-API paths through pingora's pipeline, of every engine read (with the idle
    /// timeout).
    /// Default: `60000` ([`DECODE_FIRST_BYTE_TIMEOUT_MS`](super::defaults::DECODE_FIRST_BYTE_TIMEOUT_MS)).
    pub decode_first_byte_timeout_ms: Option<Field<i64>>,
    /// Deadline of the decode's response head for a request not streamed, which vLLM sends only
    /// once generation is done, ms (at most six hours).
    /// Default: `1800000` ([`DECODE_WHOLE_ANSWER_TIMEOUT_MS`](super::defaults::DECODE_WHOLE_ANSWER_TIMEOUT_MS)).
    pub decode_whole_answer_timeout_ms: Option<Field<i64>>,
    /// Silence allowed between two body chunks (SSE events) of an engine answer being relayed,
    /// on every mode, ms; past it: 504 `stream_idle_timeout` before the client got a byte, else
    /// an SSE error event and `[DONE]` (not SSE: the connection is cut).
    /// Default: `60000` ([`STREAM_IDLE_TIMEOUT_MS`](super::defaults::STREAM_IDLE_TIMEOUT_MS)).
    pub stream_idle_timeout_ms: Option<Field<i64>>,
    /// How long one write to the client may wait for it to read, ms; past it the client
    /// connection is cut and the engine leg closed.
    /// Default: `30000` ([`CLIENT_WRITE_TIMEOUT_MS`](super::defaults::CLIENT_WRITE_TIMEOUT_MS)).
    pub client_write_timeout_ms: Option<Field<i64>>,
    /// Orchestrate: the client left after a prefill that returned `kv_transfer_params`, before
    /// the decode leg reached the engine whole. `release` sends the decode with `max_tokens`
    /// (and `max_completion_tokens`) one, `stream: false`, and discards the answer, so the
    /// decode pulls the KV blocks and the prefill frees them now; `abandon` sends nothing (the
    /// prefill holds them until its KV lease ends). Once the decode had its request, nothing
    /// is sent under either (`left_to_decode`).
    /// Default: `"release"` ([`ON_CLIENT_GONE`](super::defaults::ON_CLIENT_GONE)).
    pub on_client_gone: Option<Field<String>>,
    /// Deadline of that release leg, ms.
    /// Default: `30000` ([`RELEASE_TIMEOUT_MS`](super::defaults::RELEASE_TIMEOUT_MS)).
    pub release_timeout_ms: Option<Field<i64>>,
    /// Longest SSE event relayed, bytes (at least 64 KiB); a longer one ends the stream with an
    /// error event and `[DONE]`.
    /// Default: `16777216` ([`MAX_SSE_EVENT_BYTES`](super::defaults::MAX_SSE_EVENT_BYTES)).
    pub max_sse_event_bytes: Option<Field<i64>>,
    /// Largest accepted request body, bytes, passthrough routes too: a `Content-Length` over
    /// it, or a chunked body growing past it, is 413 `body_too_large`.
    /// Default: `33554432` ([`MAX_BODY_BYTES`](super::defaults::MAX_BODY_BYTES)).
    pub max_body_bytes: Option<Field<i64>>,
    /// A leg the engine provably never got (the connect failed, or the request could not be
    /// written whole: the keep-alive race) is re-sent once, within a budget: each leg sent
    /// earns this share of a retry, percent.
    /// Default: `20` ([`RETRY_BUDGET_PERCENT`](super::defaults::RETRY_BUDGET_PERCENT)).
    pub retry_budget_percent: Option<Field<i64>>,
    /// Retries the budget earns per second whatever the traffic (so a quiet route can retry);
    /// it saves at most ten seconds of this (at least ten retries) and a retry spends one.
    /// Default: `3` ([`RETRY_BUDGET_MIN_PER_SECOND`](super::defaults::RETRY_BUDGET_MIN_PER_SECOND)).
    pub retry_budget_min_per_second: Option<Field<i64>>,
    /// Pool prefill: endpoints tried, at most the pool's size; a prefill that fails before any
    /// answer (connect, reset, closed) or answers 5xx moves to another endpoint of the pool,
    /// all within `prefill_timeout_ms`; a 4xx is the client's and returned as is; a
    /// header-named prefiller gets one attempt.
    /// Default: `2` ([`PREFILL_ATTEMPTS`](super::defaults::PREFILL_ATTEMPTS)).
    pub prefill_attempts: Option<Field<i64>>,
    /// Orchestrate: when the prefill leg fails (unreachable after failover, a 5xx, timed out,
    /// or a 2xx that is not a completion; never a 4xx), `error` answers it; `decode_alone`
    /// sends the client's request to the decode alone (text path, no KV handoff), counted as
    /// `token_reuse_total{reason="prefill_failed"}`.
    /// Default: `"error"` ([`ON_PREFILL_FAILURE`](super::defaults::ON_PREFILL_FAILURE)).
    pub on_prefill_failure: Option<Field<String>>,
    /// Orchestrate: a client's own `kv_transfer_params` (and `ec_transfer_params`, and those
    /// keys inside `vllm_xargs`) are removed before any leg (`strip`), or answered 400
    /// (`reject`).
    /// Default: `"strip"` ([`CLIENT_KV_TRANSFER_PARAMS`](super::defaults::CLIENT_KV_TRANSFER_PARAMS)).
    pub client_kv_transfer_params: Option<Field<String>>,
    /// Share of reused requests (from none to all, written as a float: `1.0`) whose ids the
    /// parity watch decodes and checks against the request; needs a `tokenizer` on the
    /// route's pools.
    /// Default: `0.01` ([`PARITY_SAMPLE`](super::defaults::PARITY_SAMPLE)).
    pub parity_sample: Option<Field<f64>>,
    /// `alert` counts and logs a parity mismatch; `disable_reuse` also sends the route's
    /// decodes as text (`parity_reuse_off`) for at least `parity_cooldown_ms`, checking every
    /// request's ids meanwhile, and turns reuse back on at the first match after it.
    /// Default: `"alert"` ([`ON_PARITY_MISMATCH`](super::defaults::ON_PARITY_MISMATCH)).
    pub on_parity_mismatch: Option<Field<String>>,
    /// Least time `disable_reuse` keeps reuse off after a mismatch, ms (each further mismatch
    /// restarts it).
    /// Default: `60000` ([`PARITY_COOLDOWN_MS`](super::defaults::PARITY_COOLDOWN_MS)).
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

/// `[routes.match]`: every condition given must hold.
#[derive(Debug, Deserialize, Default)]
pub struct Match {
    /// Exact paths (none: any path).
    #[serde(default)]
    pub paths: Vec<Field<String>>,
    /// Glob on the body's `model`, e.g. `Qwen/*` (none: any model, including none).
    pub model: Option<Field<String>>,
    /// Header name → exact value, all required, e.g. `{ "x-tenant" = "b" }`.
    #[serde(default)]
    pub headers: BTreeMap<String, Field<String>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[routes.prefill]`: written inline too, `prefill = { pool = "prefill" }`. A header is how
/// llm-d's endpoint picker names the prefiller; it is removed before forwarding, and a request
/// without it goes to the decode alone.
#[derive(Debug, Deserialize, Default)]
pub struct Prefill {
    /// Name of a pool.
    pub pool: Option<Field<String>>,
    /// Header carrying one `host:port`, e.g. `x-prefiller-host-port`.
    pub header: Option<Field<String>>,
    /// Hosts or CIDRs the header may name, each optionally with `:port` or `:port-port`
    /// (`10.0.0.0/8:8000`, `prefill.svc:8000-8009`; IPv6 in brackets, `[fd00::/8]:8000`)
    /// (required with `header`).
    #[serde(default)]
    pub allow: Vec<Field<String>>,
    /// CIDRs of the peers (the gateway) whose header is believed; others get 403
    /// `prefiller_header_untrusted` (none: any peer).
    #[serde(default)]
    pub trusted_sources: Vec<Field<String>>,
    /// Header only: send the client's `Authorization`, `Proxy-Authorization`, `Cookie`,
    /// `X-Api-Key` and `Api-Key` to the named prefiller too.
    /// Default: `false` ([`FORWARD_CREDENTIALS`](super::defaults::FORWARD_CREDENTIALS)).
    pub forward_credentials: Option<Field<bool>>,
    /// Unknown keys.
    #[serde(flatten)]
    pub unknown: Unknown,
}
