//! The TOML file format: serde structs only, mirroring what operators write. Validation and
//! defaults that depend on other fields live in `model.rs`; nothing else reads these types.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

/// The whole file.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
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
}

/// `[cache]`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Cache {
    /// Largest total size of cached ids, bytes (default 256 MiB).
    pub capacity_bytes: Option<Spanned<i64>>,
    /// How long ids wait for their decode, ms (default 30000: vLLM's KV hold on the prefill).
    pub ttl_ms: Option<Spanned<i64>>,
}

/// `[server]`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Server {
    /// Client listener, `host:port` (default `0.0.0.0:8000`).
    pub listen: Option<Spanned<String>>,
    /// Admin listener for `/metrics`, `/healthz`, `/readyz` (default `127.0.0.1:9000`).
    pub admin_listen: Option<Spanned<String>>,
    /// Worker threads of the proxy service (default 2).
    pub threads: Option<Spanned<i64>>,
    /// Seconds to let in-flight streams finish after SIGTERM (default 5).
    pub grace_period_seconds: Option<Spanned<i64>>,
    /// Seconds allowed for services to stop after the grace period (default 5).
    pub graceful_shutdown_timeout_seconds: Option<Spanned<i64>>,
    /// Log filter (tracing `EnvFilter` syntax, default `info`); `TOKENONCE_LOG` overrides it.
    pub log_level: Option<Spanned<String>>,
    /// Log format: `text` (default) or `json`.
    pub log_format: Option<Spanned<String>>,
}

/// `[upstream]`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    /// TCP connect timeout in ms (default 2000).
    pub connect_timeout_ms: Option<Spanned<i64>>,
    /// How long an idle pooled connection is kept, ms (default 4000; vLLM closes at 5 s).
    pub idle_timeout_ms: Option<Spanned<i64>>,
    /// How often each decode endpoint's `/health` is polled, ms (default 2000).
    pub health_interval_ms: Option<Spanned<i64>>,
}

/// `[pools.NAME]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// `host:port` of each engine.
    pub endpoints: Spanned<Vec<Spanned<String>>>,
    /// `round_robin` (default) or `least_in_flight`.
    pub balance: Option<Spanned<String>>,
    /// Pin the engines' vLLM version instead of asking `GET /version`.
    pub vllm_version: Option<Spanned<String>>,
}

/// `[defaults]`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Pool that receives every request no route matches (default `decode`).
    pub passthrough_pool: Option<Spanned<String>>,
}

/// `[[routes]]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Name used in metrics and logs.
    pub name: Spanned<String>,
    /// What requests this route takes.
    #[serde(default, rename = "match")]
    pub matcher: Match,
    /// `orchestrate`, `relay` or `passthrough`.
    pub mode: Spanned<String>,
    /// Relay only: `cache` (ids kept here until the decode) or `stateless` (ids ride in the
    /// prefill response's `kv_transfer_params`, which the orchestrator copies to the decode).
    pub relay_handoff: Option<Spanned<String>>,
    /// Where the prefill leg goes (orchestrate only).
    pub prefill: Option<Spanned<Prefill>>,
    /// Pool of the decode leg (and of passthrough).
    pub decode_pool: Spanned<String>,
    /// Reuse the prefill's prompt ids on the decode (default true).
    pub token_reuse: Option<bool>,
    /// Whole prefill leg deadline, ms (default 30000).
    pub prefill_timeout_ms: Option<Spanned<i64>>,
    /// Decode response-header deadline, ms (default 60000).
    pub decode_first_byte_timeout_ms: Option<Spanned<i64>>,
    /// Largest accepted request body, bytes (default 32 MiB).
    pub max_body_bytes: Option<Spanned<i64>>,
    /// TESTS ONLY: cut the relayed prompt ids to this many, to prove the decode follows the
    /// ids and not the messages. Never set in production: the answer is for a shorter prompt.
    pub test_truncate_prompt_ids: Option<Spanned<i64>>,
}

/// `[routes.match]`
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// Exact paths (default: any).
    #[serde(default)]
    pub paths: Vec<Spanned<String>>,
    /// Glob on the body's `model` (default: any, including none).
    pub model: Option<Spanned<String>>,
    /// Header name → exact value, all required.
    #[serde(default)]
    pub headers: BTreeMap<String, Spanned<String>>,
}

/// `[routes.prefill]`: a pool, or a header naming the prefiller (llm-d's endpoint picker).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prefill {
    /// Name of a pool.
    pub pool: Option<Spanned<String>>,
    /// Header carrying one `host:port`, e.g. `x-prefiller-host-port`.
    pub header: Option<Spanned<String>>,
    /// Hosts or CIDRs the header may name (required with `header`).
    #[serde(default)]
    pub allow: Vec<Spanned<String>>,
}
