//! tokenonce: a sidecar reverse proxy for vLLM prefill/decode disaggregation that sends the
//! prefill's prompt token ids to the decode, so the prompt is rendered and tokenized once.
//!
//! The rooms, from the top down (a room imports only rooms below it); ARCHITECTURE.md is
//! the one-page map, docs/contributing.md walks the request path:
//! - `drain`: `tokenonce drain`, the client of the admin listener's `/drain` (a preStop hook).
//! - `server`: wiring a loaded config into a pingora server (listeners, TLS, admin, upkeep,
//!   SIGHUP); `reload`: the config file read again and swapped in whole, or rejected.
//! - `proxy`: pingora glue: the client edge, reading and dispatching API requests, the
//!   orchestrate and relay handlers, the leg executor, writing answers, the one error exit,
//!   passthrough and the admin listener.
//! - `app`: the composition root: `App` built from a config and rebuilt on reload, the
//!   admission count, and the upkeep (health rounds, gauges) that walks it.
//! - `routes`: the runtime route table (routes holding their pools, policy, metric handles)
//!   and what each route learns at run time (`RouteState`, kept across reloads).
//! - `local`: local ids: requests rendered (`render`) and tokenized (`tokens`) by tokenonce,
//!   checked against the prefill's echo, trusted per shape and then sent token-in.
//! - `upstream`: pools, their endpoints (load, health, ejection) and what probing their engines
//!   taught, the cache-aware choice, the leg client (retry, budget, ejection) over the HTTP/1.1
//!   client, endpoint probes, DNS-discovered pools, Responses' homes.
//! - `tokens`: a rendered prompt tokenized segment by segment, each segment once (segment cache).
//! - `plan`: pure decisions per request: legs, reuse gate, prefill and decode bodies.
//! - `parity`: pool tokenizers, the vocabulary bound and the sampled parity watch.
//! - `telemetry`: logging and OpenTelemetry spans of each request and its legs.
//! - `handoff`: the relay-mode id cache and correlation keys.
//! - `metrics`: what every metric family stands on (registration, buckets, label enums); each
//!   family lives in its room's `metrics.rs`, `app/metrics.rs` holds them all.
//! - `openai`: the wire protocol as pure functions on bytes (the API, request view,
//!   rewrites, handoff extraction, prompt-id validation, fallback reasons, error bodies).
//! - `config`: the TOML file as typed data, checked, with what it names loaded; the embedded default.
//! - `render`: chat and completion prompts rendered as vLLM renders them (pure).
//! - `kv`: vLLM's prefix-cache block hashes from a request's ids, and which endpoint holds which
//!   blocks (where tokenonce sent them, or the engines' KV events: subscribed, replayed, applied).
//! - `sse`: incremental SSE framing; `addr`: `host:port` and rank-naming pool entries;
//!   `tls`: certificates from files, the TLS listener's certificate, pools' upstream TLS;
//!   `toml_read`: TOML text into serde types with every problem at its key and line:column;
//!   `labels`: the macro that declares a label enum; `deadline`: deadlines on pingora's fast
//!   timer; `build`: what this binary is.

#[macro_use]
mod labels;

pub mod addr;
pub mod app;
pub mod config;
pub mod deadline;
pub mod drain;

/// What this binary is: its version and the build facts `build.rs` recorded, as
/// `tokenonce --version` prints them and `tokenonce_build_info` labels them.
pub mod build {
    /// The crate version.
    pub const VERSION: &str = env!("CARGO_PKG_VERSION");
    /// The git commit built (`unknown` outside a checkout).
    pub const COMMIT: &str = env!("TOKENONCE_COMMIT");
    /// The compiler's version.
    pub const RUSTC: &str = env!("TOKENONCE_RUSTC");
    /// The cargo profile (`release`, `debug`).
    pub const PROFILE: &str = env!("TOKENONCE_PROFILE");
    /// `--version`'s line after the name.
    pub const LONG_VERSION: &str = concat!(
        env!("CARGO_PKG_VERSION"),
        " (commit ",
        env!("TOKENONCE_COMMIT"),
        ", rustc ",
        env!("TOKENONCE_RUSTC"),
        ", ",
        env!("TOKENONCE_PROFILE"),
        " profile)"
    );
}
pub mod handoff;
pub mod kv;
pub mod local;
pub mod metrics;
pub mod openai;
pub mod parity;
pub mod plan;
pub mod proxy;
pub mod reload;
pub mod render;
pub mod routes;
pub mod server;
pub mod sse;
pub mod telemetry;
pub mod tls;
pub mod tokens;
pub mod toml_read;
pub mod upstream;
