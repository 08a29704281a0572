//! The config file as typed data: one serde struct per TOML table, every default at its field
//! (`#[default(..)]`), durations read as their kind by `duration.rs` (`"30s"`, or an integer in
//! the key's unit, within the kind's range). [`crate::toml_read`] fills these from the text,
//! reporting every problem; `check.rs` then checks what spans fields. Nothing here reads a file.
//!
//! Each field's doc is its entry in `docs/configuration.md`, which `tests/docs.rs` generates
//! from this file (`TOKENONCE_BLESS=1 cargo test --test docs` rewrites it): what the key
//! means, then a `Default:` line whose backticked value is written as in TOML (the test loads
//! it and checks it is what `#[default]` gives), then why that default.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::de::Visitor;
use serde::{Deserialize, Deserializer};
use smart_default::SmartDefault;

use super::duration;
use super::values::{
    AllowEntry, Balance, BlockSize, ClientHandoff, LocalIdsMode, LogFormat, Mode, ModelGlob, Net, OnClientGone,
    OnPrefillFailure, OtlpProtocol, ParityPolicy, RelayHandoff, ReuseShare, Version,
};

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Config {
    /// The client and admin listeners, threads, shutdown, logging and the client edge's limits.
    pub server: Server,
    /// Settings shared by every connection to an engine.
    pub upstream: Upstream,
    /// Named pools of engine endpoints; routes name them.
    pub pools: BTreeMap<String, Pool>,
    /// Where requests no route matches go: every other path too (`/v1/models`, `/health`,
    /// `/tokenize`, the engine's `/metrics`, ...), proxied byte for byte.
    pub defaults: Defaults,
    /// Ordered routing rules; the first match wins.
    pub routes: Vec<Route>,
    /// The relay-mode id cache.
    pub cache: Cache,
    /// OpenTelemetry trace export.
    pub tracing: Option<Tracing>,
}

/// `[server]`
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Server {
    /// Client listener, `ip:port` (port 0: any free port; the `tokenonce listening` log line
    /// names the bound addresses). Fixed at start.
    /// Default: `"0.0.0.0:8000"`.
    /// All interfaces, on vLLM's own default port, so clients need no change.
    #[default("0.0.0.0:8000".into())]
    pub listen: String,
    /// Admin listener for `/metrics`, `/healthz`, `/readyz`, `/drain` and `/admin/reload`.
    /// Fixed at start.
    /// Default: `"127.0.0.1:9000"`.
    /// Loopback only; metrics and probes are for the pod, not for clients.
    #[default("127.0.0.1:9000".into())]
    pub admin_listen: String,
    /// Worker threads of the proxy service (at most 256). Fixed at start.
    /// Default: `2`.
    /// A sidecar shares its pod's CPUs with the engine's API server.
    #[default(2)]
    pub threads: usize,
    /// `true`: one runtime whose idle threads steal queued tasks (pingora's default); `false`:
    /// each thread runs its own runtime and keeps the connections it accepted, with no
    /// cross-thread wake-ups (CPU per request within noise of the default, see the
    /// performance chapter) and a less even balance when a few connections carry most of
    /// the load. Fixed at start.
    /// Default: `true`.
    /// pingora's default; off measured within noise of on, and less even under uneven load.
    #[default(true)]
    pub work_stealing: bool,
    /// Seconds in-flight streams may finish after SIGTERM (at most 3600). Fixed at start.
    /// Default: `5`.
    /// Short decodes end well within it.
    #[serde(deserialize_with = "duration::ShutdownSeconds::read")]
    #[default(5)]
    pub grace_period_seconds: u64,
    /// Seconds services then get to stop (at most 3600). Fixed at start.
    /// Default: `5`.
    /// Seconds services get to stop after the grace period.
    #[serde(deserialize_with = "duration::ShutdownSeconds::read")]
    #[default(5)]
    pub graceful_shutdown_timeout_seconds: u64,
    /// Log filter in tracing's `EnvFilter` syntax (`warn,tokenonce=debug`; a bare word must be
    /// a level); the `TOKENONCE_LOG` environment variable overrides it. Fixed at start.
    /// Default: `"info"`.
    /// One line per request and every fallback, no per-chunk noise.
    #[default("info".into())]
    pub log_level: String,
    /// Log format, `text` or `json`. Fixed at start.
    /// Default: `"text"`.
    /// Text for people; `json` is opt-in for log pipelines.
    pub log_format: LogFormat,
    /// File holding the token (at least sixteen printable characters) that the admin
    /// listener's `/drain` and `POST /admin/reload` require as `Authorization: Bearer <token>`;
    /// without it both answer 403.
    pub admin_token_file: Option<String>,
    /// How often the config file is read to see whether it changed, ms (0: not watched; else
    /// 100 to 600000). A change that holds for one more interval is reloaded as on SIGHUP: a
    /// bad file is rejected, counted and kept out until it changes again. It follows the
    /// symlinks on every read, so a Kubernetes ConfigMap update (a `..data` symlink swap) is
    /// seen, as is a rewrite in place. Fixed at start.
    /// Default: `0`.
    /// Off: a reload happens when someone asks for it (SIGHUP, `POST /admin/reload`). In a
    /// ConfigMap volume `2000` takes a change within about 4 s of the kubelet writing it.
    #[serde(deserialize_with = "duration::WatchMs::read")]
    #[default(Duration::ZERO)]
    pub config_watch_interval_ms: Duration,
    /// Most header fields per request head (431 `headers_too_large` above; at most 256).
    /// Default: `100`.
    /// Several times what OpenAI SDKs and gateways send.
    #[default(100)]
    pub max_header_count: usize,
    /// Most header bytes per request head (431 `headers_too_large` above; at most 1 MiB).
    /// Default: `65536`.
    /// Room for long tokens and tracing headers.
    #[default(65536)]
    pub max_header_bytes: usize,
    /// Deadline for a whole request body, ms (408 `request_timeout` after: slow or stalled
    /// clients).
    /// Default: `60000`.
    /// A slow or stalled client (slowloris) is cut after a minute.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(60_000))]
    pub body_read_timeout_ms: Duration,
    /// Most client requests served at once, plain and TLS listeners together; past it 503
    /// `overloaded` with `Retry-After: 1`, before any leg (zero: no bound). A reload applies it
    /// to the next request.
    /// Default: `1024`.
    /// With the worst case of ~224 MiB per request (docs/failures.md, "Memory per request") the
    /// bound is far past any memory, but a typical request holds about 1 MB, and past a
    /// thousand in flight the engines queue anyway.
    #[default(1024)]
    pub max_in_flight: usize,
    /// A second client listener that speaks TLS (none: plain HTTP only).
    pub tls: Option<ServerTls>,
}

/// `[server.tls]`: it speaks HTTP/1.1 and serves the same routes as the plain `server.listen`,
/// which keeps running beside it; its certificate is read again on SIGHUP (new handshakes get
/// the new certificate; files that do not load keep the old config).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct ServerTls {
    /// `ip:port` it listens on (required); must differ from both plain listeners. Fixed at start.
    pub listen: String,
    /// PEM certificate chain, leaf first (required).
    pub cert_file: String,
    /// PEM private key of the leaf certificate (required; it must belong to the certificate).
    pub key_file: String,
}

/// `[upstream]`
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Upstream {
    /// TCP connect deadline, ms. Fixed at start.
    /// Default: `2000`.
    /// Engines are on loopback or in the cluster.
    #[serde(deserialize_with = "duration::PollMs::read")]
    #[default(Duration::from_millis(2000))]
    pub connect_timeout_ms: Duration,
    /// How long an idle pooled connection is kept, ms; must stay below vLLM's keep-alive
    /// (under five seconds). Fixed at start.
    /// Default: `4000`.
    /// Below vLLM's 5 s keep-alive, so no socket goes stale.
    #[serde(deserialize_with = "duration::IdleMs::read")]
    #[default(Duration::from_millis(4000))]
    pub idle_timeout_ms: Duration,
    /// How often each endpoint's `/health` is polled, ms (all endpoints at once, each within a
    /// second). Fixed at start.
    /// Default: `2000`.
    /// Readiness follows the engine within 2 s.
    #[serde(deserialize_with = "duration::PollMs::read")]
    #[default(Duration::from_millis(2000))]
    pub health_interval_ms: Duration,
    /// Consecutive request failures (no answer, a 5xx, or a deadline that passed while the
    /// endpoint held the leg) that eject an endpoint from its pool's choice for
    /// `eject_base_ms`, doubling while it keeps failing (at most two minutes); one answer below
    /// 500 resets it,
    /// and a healthy `/health` does not readmit it early (an engine can answer `/health` and
    /// fail every request). Zero: never eject (a failing endpoint then keeps its share of
    /// first picks; a pool prefill still fails over from it).
    /// Default: `3`.
    /// One or two failures are the keep-alive race or a single bad request, three in a row is
    /// the engine.
    #[default(3)]
    pub eject_after_failures: u32,
    /// How long an endpoint's first ejection lasts, ms (at most two minutes); each further
    /// one in a row lasts twice as long as the last, up to two minutes. A reload that changes
    /// it starts the pools afresh (their ejections end).
    /// Default: `5000`.
    /// Long enough for an engine that was briefly overloaded to drain its queue, short enough
    /// that a pool of a few engines does not run on one for long after a blip.
    #[serde(deserialize_with = "duration::EjectionMs::read")]
    #[default(Duration::from_millis(5000))]
    pub eject_base_ms: Duration,
    /// The DNS server pools' `discover` names are asked, `ip:port` (none: the nameservers of
    /// `/etc/resolv.conf`, with its search domains).
    pub dns_server: Option<String>,
}

/// `[pools.NAME]`
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Pool {
    /// `host:port` of each engine (required, unless `discover` names them instead). A vLLM
    /// server running data parallelism with its own balancing (one port for several ranks)
    /// may be listed as `host:port#R` or `host:port#FIRST-LAST`: each rank is then an
    /// endpoint of its own (balanced, health polled and ejected alone) whose legs carry
    /// `X-data-parallel-rank: R`, which vLLM reads on chat, completions and generate.
    pub endpoints: Vec<String>,
    /// A DNS name whose addresses are the engines, as `name:port` (or `name:port#R`,
    /// `name:port#FIRST-LAST` for each address's data-parallel ranks), instead of
    /// `endpoints`: a Kubernetes headless Service, one address per pod. It is looked up every
    /// `discover_interval_ms` (through `upstream.dns_server`, else `/etc/resolv.conf`); each
    /// address (IPv4, else IPv6) is an endpoint named `ip:port`. An address that appears
    /// joins unhealthy and is probed in the same upkeep round (healthy endpoints are chosen
    /// first), one that stays keeps its state (health, ejection, version), one that leaves is
    /// chosen no more while the requests it holds finish. A failed lookup or an empty answer
    /// keeps the last set. Until the first answer the pool has no endpoint. For example
    /// `discover = "vllm-prefill:8000"` in a pod (its search list completes the name), one
    /// endpoint per ready prefill pod.
    pub discover: Option<String>,
    /// How often `discover` is looked up, ms (100 to 600000); a lookup runs at the first
    /// upkeep round (every `upstream.health_interval_ms`) after this has passed.
    /// Default: `5000`.
    /// A pod that starts or stops is followed within seconds, at one small query per pool.
    #[serde(deserialize_with = "duration::DiscoverMs::read")]
    #[default(Duration::from_millis(5000))]
    pub discover_interval_ms: Duration,
    /// `round_robin`, `least_in_flight`, or `cache_aware` (the endpoint holding most of the
    /// request's prompt, against its load: `[pools.NAME.cache_aware]`, and the concepts
    /// chapter); unhealthy endpoints are skipped while a healthy one exists.
    /// Default: `"round_robin"`.
    /// Round robin needs no state beyond a counter.
    pub balance: Balance,
    /// Pin the engines' vLLM version instead of asking `GET /version`.
    pub vllm_version: Option<Version>,
    /// The engines' `tokenizer.json`, or the model folder holding it; loaded at start and on
    /// SIGHUP (`tokenonce check` loads it too). A route uses its decode pool's, else its
    /// prefill pool's: relayed ids at or past its vocabulary (added tokens included) fall back
    /// (`ids_out_of_vocab`), and the parity watch samples the route (none: neither).
    pub tokenizer: Option<String>,
    /// TLS to the pool's engines (none: plain HTTP).
    pub tls: Option<PoolTls>,
    /// `shadow`: tokenonce renders and tokenizes each chat and completions request this pool
    /// prefilled with an echo (the chat template of the `tokenizer`'s model folder), off the
    /// request path, and counts whether its ids equal the echo, by request shape. `on`: also,
    /// a shape that matched `local_ids_verify_after` times in a row sends its prefills token-in
    /// with those ids (no echo), but for a `local_ids_recheck` share; a mismatch ends that
    /// (see the parity chapter). Needs `tokenizer`.
    /// Default: `"off"`.
    /// Local ids are proven on a pool's own traffic before anything depends on them.
    pub local_ids: LocalIdsMode,
    /// Matches in a row a shape needs before `local_ids = "on"` sends it token-in (1 to
    /// 1,000,000).
    /// Default: `100`.
    /// A hundred exact matches in a row make a rendering difference of that shape rare.
    #[default(100)]
    pub local_ids_verify_after: u32,
    /// Share of a verified shape's requests still sent as text with the echo, to keep
    /// checking (a float from none to all).
    /// Default: `0.01`.
    /// Keeps the check going (a template or engine change shows) at 1 % of the echo's cost.
    #[default(0.01)]
    pub local_ids_recheck: f64,
    /// How often each healthy endpoint's `GET /metrics` is read for its engine's own pressure
    /// (requests waiting and running, KV-cache use, cache blocks, LoRA adapters; per
    /// data-parallel rank), ms: 0 (never), or 100 to 600000. It is read at the first health
    /// round after this has passed, within the probe's second; a page that cannot be true
    /// (NaN, a negative or absurd count, a usage above 1) is not kept, and a value read more
    /// than three intervals ago (or three `upstream.health_interval_ms`, whichever is longer)
    /// is not believed: both are counted (`tokenonce_engine_metrics_reads_total`).
    /// Default: `2000`.
    /// The engine's own queue is the same whichever tokenonce instance reads it, unlike the
    /// requests one instance has in flight; a read each health round costs one small GET.
    #[serde(deserialize_with = "duration::EngineMetricsMs::read")]
    #[default(Duration::from_millis(2000))]
    pub engine_metrics_interval_ms: Duration,
    /// How `balance = "cache_aware"` scores the pool's endpoints and names a prompt's blocks.
    pub cache_aware: CacheAware,
    /// Follow the engines' KV cache events (vLLM's `--kv-events-config` with the `zmq`
    /// publisher): which endpoint holds which prefix blocks, for cache-aware endpoint choice,
    /// and every published block hash checked against tokenonce's (none: no events).
    pub kv_events: Option<PoolKvEvents>,
}

/// `[pools.NAME.kv_events]`: one ZeroMQ subscriber per endpoint (per data-parallel rank) to
/// its engine's KV events publisher, which must bind (`"endpoint": "tcp://*:PORT"`).
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct PoolKvEvents {
    /// The publisher's port on each endpoint's host (the port of vLLM's `endpoint`); rank R of
    /// a `host:port#R` endpoint publishes on this port + R, as vLLM offsets it (required).
    pub port: u16,
    /// The replay endpoint's port (vLLM's `replay_endpoint`; rank R: + R), asked for missed
    /// batches and for what an engine holds when tokenonce connects (none: a gap clears the
    /// endpoint's entries instead).
    pub replay_port: Option<u16>,
    /// Per endpoint (`host:port` as its `endpoints` entry gives it), a publisher port other
    /// than `port`: engines sharing a host (several servers on one node, or on loopback) each
    /// bind a port of their own, e.g. `{ "127.0.0.1:8300" = 5567 }`. Ranks offset it as they
    /// offset `port`.
    pub endpoint_ports: BTreeMap<String, u16>,
    /// Per endpoint, as `endpoint_ports`, a replay port other than `replay_port`.
    pub endpoint_replay_ports: BTreeMap<String, u16>,
    /// The topic the engines publish on (vLLM's `topic`; a prefix match, empty: every message).
    /// Default: `""`.
    /// vLLM's default topic is empty.
    pub topic: String,
    /// The engines' `PYTHONHASHSEED`: the seed of vLLM's block hashes (`--prefix-caching-hash-algo
    /// sha256_cbor`). Engines without `PYTHONHASHSEED` hash with vLLM's fixed seed.
    /// Default: `"vllm-none-hash"`.
    /// vLLM's seed for `sha256` and `sha256_cbor` when `PYTHONHASHSEED` is unset.
    #[default(crate::kv::hash::DEFAULT_SEED.into())]
    pub hash_seed: String,
    /// The engines' `--block-size` (tokens per KV block; 1 to 65536).
    /// Default: `16`.
    /// vLLM's default on GPUs (its CPU backend needs a multiple of 32).
    #[default(BlockSize::DEFAULT)]
    pub block_size: BlockSize,
    /// Most (endpoint, block) entries the pool's index holds; past it the oldest stored are
    /// forgotten (1 to 100,000,000). At most about 120 bytes each: the entry, its place in
    /// the eviction order, and the hash check's memory of one digest. Unset, the bound follows
    /// what the engines say they hold: 1.25 x the sum of its endpoints' `num_gpu_blocks`
    /// (vLLM's `vllm:cache_config_info`, read with `engine_metrics_interval_ms`; an endpoint
    /// not read yet counted at the mean of those read), at least 250,000 (also the bound
    /// before the first read) and at most 16,000,000; logged when it changes and exported
    /// (`tokenonce_kv_index_max_blocks`).
    pub max_blocks: Option<u64>,
    /// How long an endpoint's subscriber may stay disconnected before its entries are no
    /// longer believed (the endpoint then holds nothing for choice; with every endpoint stale
    /// the pool's events are not used).
    /// Default: `"30s"`.
    /// Long enough for an engine's subscriber to reconnect, short enough that a dead engine's
    /// blocks stop attracting requests.
    #[serde(deserialize_with = "duration::StaleMs::read")]
    #[default(Duration::from_secs(30))]
    pub stale_after_ms: Duration,
}

/// `[pools.NAME.cache_aware]`: read when the pool's `balance` is `cache_aware`. Each candidate
/// endpoint costs, in tokens its engine computes before the prompt's first token,
/// `prefix_weight` x the prompt tokens it does not hold plus `load_weight` x the tokens
/// queued ahead there (the larger of this instance's own requests in flight there and the
/// engine's reported waiting and running requests at the mean request); the least wins (ties
/// rotate). A held prefix counts for less as the engine's KV cache fills past 90 %.
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct CacheAware {
    /// Weight of each prompt token an endpoint would compute (0 to 1000).
    /// Default: `1.0`.
    /// The cost's unit: tokens.
    #[default(1.0)]
    pub prefix_weight: f64,
    /// Weight of each token queued ahead at an endpoint (0 to 1000).
    /// Default: `0.3`.
    /// A token computed again elsewhere is capacity the whole fleet then waits on, a queued
    /// one only delays this request: in the fleet simulation (8 prefills, 256 clients, 8
    /// instances) 0.3 kept 79 % of prompt tokens cached (the sticky oracle 75 %) with the
    /// busiest prefill at 1.14x the mean, where 1.0 moved conversations off their holders
    /// (53 %) and 0.1 herded (1.32x).
    #[default(0.3)]
    pub load_weight: f64,
    /// Tokens per block, as the engines' `--block-size` (1 to 65536): a prompt's full blocks
    /// are what it is matched by. With `kv_events` it must equal `kv_events.block_size`.
    /// Default: `16`.
    /// vLLM's default on GPUs, as `kv_events.block_size` (its CPU backend needs a multiple of 32).
    #[default(BlockSize::DEFAULT)]
    pub block_size: BlockSize,
    /// The seed of the first block's hash: the engines' `PYTHONHASHSEED` (vLLM's own
    /// `"vllm-none-hash"` when they run without one). Matters where block hashes are compared
    /// with the engines' KV events: with `kv_events` it must equal `kv_events.hash_seed`.
    /// Default: `"vllm-none-hash"`.
    /// What vLLM hashes with (`sha256_cbor`) when `PYTHONHASHSEED` is unset.
    #[default("vllm-none-hash".into())]
    pub hash_seed: String,
    /// Blocks the index of where tokenonce sent each prompt keeps (1 to 100,000,000; about
    /// 40 bytes each), and as many text keys the index of prompts known by their text; a
    /// block not sent again for longest goes first (clock eviction).
    /// Default: `262144`.
    /// About 10 MB: eight engines holding a million tokens each, in blocks of 32.
    #[default(262_144)]
    pub max_blocks: u32,
}

/// `[pools.NAME.tls]`: every connection to the pool's engines is then TLS (the prefill and
/// decode legs, passthrough, health and version polls).
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct PoolTls {
    /// PEM bundle of the CAs trusted for the engines' certificates (none: the system's store).
    pub ca_file: Option<String>,
    /// Name sent as SNI and checked against the engines' certificates (none: each endpoint's
    /// host; required with verification when an endpoint is an IP address).
    pub server_name: Option<String>,
    /// PEM client certificate chain, for engines that require mTLS (with `key_file`).
    pub cert_file: Option<String>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<String>,
    /// Check the engine's certificate chain and name; `false` accepts any certificate
    /// (encryption without authentication).
    /// Default: `true`.
    /// A pool that crosses pods must not accept whoever answers on the address.
    #[default(true)]
    pub verify: bool,
}

/// `[defaults]`
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Defaults {
    /// Pool that receives every request no route matches.
    /// Default: `"decode"`.
    /// The decode engine serves `/v1/models` and the rest.
    #[default("decode".into())]
    pub passthrough_pool: String,
}

/// `[[routes]]`
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Route {
    /// Name used in metrics and logs, unique, `[A-Za-z0-9._-]` (required).
    pub name: String,
    /// What requests this route takes (none: every request).
    #[serde(rename = "match")]
    pub matcher: Match,
    /// `orchestrate` (POST `/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
    /// `/v1/messages`, `/inference/v1/generate`: tokenonce sends both legs), `relay` (an orchestrator sends both legs
    /// through tokenonce) or `passthrough` (bytes to the decode pool unchanged) (required).
    pub mode: Mode,
    /// Relay only: `cache` (ids kept here until the decode) or `stateless` (ids ride in the
    /// prefill response's `kv_transfer_params`, which the orchestrator copies to the decode).
    /// Default: `"cache"`.
    /// The cache keeps the ids off the orchestrator's wire.
    pub relay_handoff: RelayHandoff,
    /// Where the prefill leg goes: a pool, or the prefiller a request header names (required
    /// for orchestrate).
    pub prefill: Option<Prefill>,
    /// Pool of the decode leg, and of passthrough (required).
    pub decode_pool: String,
    /// Reuse the prefill's prompt ids on the decode: `true`, `false`, or the share of requests
    /// (a fraction from zero to one) that reuse them, a canary decided by a hash of the request
    /// id (the rest counted as `reason="canary"`).
    /// Default: `true`.
    /// Token reuse is what tokenonce is for.
    #[default(ReuseShare::ON)]
    pub token_reuse: ReuseShare,
    /// Deadline of the whole prefill leg, ms (the prefill's KV lease is thirty seconds by
    /// default).
    /// Default: `30000`.
    /// vLLM holds the prefill's KV for the decode 30 s by default.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(30_000))]
    pub prefill_timeout_ms: Duration,
    /// Deadline of the decode's response head for a streamed request (`stream: true`), ms;
    /// for non-API paths through pingora's pipeline, of every engine read (with the idle
    /// timeout).
    /// Default: `60000`.
    /// A queued decode may wait behind long prefills.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(60_000))]
    pub decode_first_byte_timeout_ms: Duration,
    /// Deadline of the decode's response head for a request not streamed, which vLLM sends only
    /// once generation is done, ms (at most six hours).
    /// Default: `1800000`.
    /// A reasoning model's or an evaluation job's long output (tens of thousands of tokens at
    /// tens per second, slower under load) takes many minutes; 30 min covers those and still
    /// ends a decode that never answers.
    #[serde(deserialize_with = "duration::AnswerMs::read")]
    #[default(Duration::from_millis(1_800_000))]
    pub decode_whole_answer_timeout_ms: Duration,
    /// Silence allowed between two body chunks (SSE events) of an engine answer being relayed,
    /// on every mode, ms; past it: 504 `stream_idle_timeout` before the client got a byte, else
    /// an SSE error event and `[DONE]` (not SSE: the connection is cut).
    /// Default: `60000`.
    /// vLLM streams a token every few tens of ms and a preempted or recomputing decode resumes
    /// within seconds; a minute of nothing is a stuck engine.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(60_000))]
    pub stream_idle_timeout_ms: Duration,
    /// How long one write to the client may wait for it to read, ms; past it the client
    /// connection is cut and the engine leg closed.
    /// Default: `30000`.
    /// A client that has not read for 30 s while every socket buffer is full has stalled, and
    /// its decode is freed.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(30_000))]
    pub client_write_timeout_ms: Duration,
    /// Orchestrate: the client left after a prefill that returned `kv_transfer_params`, before
    /// the decode leg reached the engine whole. `release` sends the decode with `max_tokens`
    /// (and `max_completion_tokens`) one, `stream: false`, and discards the answer, so the
    /// decode pulls the KV blocks and the prefill frees them now; `abandon` sends nothing (the
    /// prefill holds them until its KV lease ends). Once the decode had its request, nothing
    /// is sent under either (`left_to_decode`).
    /// Default: `"release"`.
    /// The decode pulls the blocks and the prefill frees them now, not when its lease runs out
    /// (vLLM #50425: stranded blocks exhaust KV under load).
    pub on_client_gone: OnClientGone,
    /// Deadline of that release leg, ms.
    /// Default: `30000`.
    /// Past vLLM's 30 s KV lease the prefill has freed the blocks anyway.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(30_000))]
    pub release_timeout_ms: Duration,
    /// Longest SSE event relayed, bytes (at least 64 KiB); a longer one ends the stream with an
    /// error event and `[DONE]`.
    /// Default: `16777216`.
    /// A token event with 20 top logprobs is a few KB, but a first event echoing the prompt ids
    /// (`return_token_ids`) or carrying prompt logprobs grows with the prompt: ~7 bytes per id,
    /// so 16 MiB holds the echo of a 2M-token prompt.
    #[default(16 * 1024 * 1024)]
    pub max_sse_event_bytes: usize,
    /// Largest accepted request body, bytes, passthrough routes too: a `Content-Length` over
    /// it, or a chunked body growing past it, is 413 `body_too_large`.
    /// Default: `33554432`.
    /// A 128k-token chat is a few MB of JSON.
    #[default(32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// A leg the engine provably never got (the connect failed, or the request could not be
    /// written whole: the keep-alive race) is re-sent once, within a budget: each leg sent
    /// earns this share of a retry, percent.
    /// Default: `20`.
    /// A failing engine sees at most 1.2× the load, while the rare keep-alive race is still
    /// retried.
    #[default(20)]
    pub retry_budget_percent: u32,
    /// Retries the budget earns per second whatever the traffic (so a quiet route can retry);
    /// it saves at most ten seconds of this (at least ten retries) and a retry spends one.
    /// Default: `3`.
    /// A quiet route can still retry.
    #[default(3)]
    pub retry_budget_min_per_second: u32,
    /// Pool prefill: endpoints tried, at most the pool's size; a prefill that fails before any
    /// answer (connect, reset, closed) or answers 5xx moves to another endpoint of the pool,
    /// all within `prefill_timeout_ms`; a 4xx is the client's and returned as is; a
    /// header-named prefiller gets one attempt.
    /// Default: `2`.
    /// One failover rides out one bad engine without doubling the load of a pool that is
    /// failing as a whole.
    #[default(2)]
    pub prefill_attempts: usize,
    /// Orchestrate: when the prefill leg fails (unreachable after failover, a 5xx, timed out,
    /// or a 2xx that is not a completion; never a 4xx), `error` answers it; `decode_alone`
    /// sends the client's request to the decode alone (text path, no KV handoff), counted as
    /// `token_reuse_total{reason="prefill_failed"}`.
    /// Default: `"error"`.
    /// A decode alone would run the whole prompt on the decode engine, which a route must opt
    /// into.
    pub on_prefill_failure: OnPrefillFailure,
    /// Orchestrate: a client's own `kv_transfer_params` (and `ec_transfer_params`, and those
    /// keys inside `vllm_xargs`) are removed before any leg (`strip`), or answered 400
    /// (`reject`).
    /// Default: `"strip"`.
    /// Clients that copy a whole vLLM request keep working while never steering the handoff.
    pub client_kv_transfer_params: ClientHandoff,
    /// Share of reused requests (from none to all, written as a float: `1.0`) whose ids the
    /// parity watch decodes and checks against the request; needs a `tokenizer` on the
    /// route's pools.
    /// Default: `0.01`.
    /// 1 % keeps its cost (a few ms of one worker per sample at 37k tokens) far below the
    /// proxy's, and still catches a bad rollout within a few hundred requests.
    #[default(0.01)]
    pub parity_sample: f64,
    /// `alert` counts and logs a parity mismatch; `disable_reuse` also sends the route's
    /// decodes as text (`parity_reuse_off`) for at least `parity_cooldown_ms`, checking every
    /// request's ids meanwhile, and turns reuse back on at the first match after it.
    /// Default: `"alert"`.
    /// A mismatch alerts (counted, logged); turning reuse off is a route's choice.
    pub on_parity_mismatch: ParityPolicy,
    /// Least time `disable_reuse` keeps reuse off after a mismatch, ms (each further mismatch
    /// restarts it).
    /// Default: `60000`.
    /// A rollout or a bad engine is not fixed in less.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(60_000))]
    pub parity_cooldown_ms: Duration,
}

/// `[routes.match]`: every condition given must hold.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct Match {
    /// Exact paths (none: any path).
    pub paths: Vec<String>,
    /// Glob on the body's `model`, e.g. `Qwen/*` (none: any model, including none).
    pub model: Option<ModelGlob>,
    /// Header name → exact value, all required, e.g. `{ "x-tenant" = "b" }`.
    pub headers: BTreeMap<String, String>,
}

/// `[routes.prefill]`: written inline too, `prefill = { pool = "prefill" }`. A header is how
/// llm-d's endpoint picker names the prefiller; it is removed before forwarding, and a request
/// without it goes to the decode alone.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Prefill {
    /// Name of a pool.
    pub pool: Option<String>,
    /// Header carrying one `host:port`, e.g. `x-prefiller-host-port`.
    pub header: Option<String>,
    /// Hosts or CIDRs the header may name, each optionally with `:port` or `:port-port`
    /// (`10.0.0.0/8:8000`, `prefill.svc:8000-8009`; IPv6 in brackets, `[fd00::/8]:8000`),
    /// dialled in plain HTTP; or a table with its TLS, `{ match = "prefill.svc:8443", tls = {
    /// ca_file = "/etc/tokenonce/ca.pem" } }`. The first entry that permits the named address
    /// decides how it is dialled (required with `header`).
    #[serde(deserialize_with = "allow_list")]
    pub allow: Vec<AllowRule>,
    /// CIDRs of the peers (the gateway) whose header is believed; others get 403
    /// `prefiller_header_untrusted` (none: any peer).
    pub trusted_sources: Vec<Net>,
    /// Header only: send the client's `Authorization`, `Proxy-Authorization`, `Cookie`,
    /// `X-Api-Key` and `Api-Key` to the named prefiller too.
    /// Default: `false`.
    /// That host is less trusted than a configured pool.
    pub forward_credentials: bool,
    /// Pool only, orchestrate: the decode computes the prompt alone, token-in with the local
    /// ids, no prefill leg, when the tokens it lacks (the prompt's blocks its KV events do not
    /// show it holding, plus the partial last block) are at most this many; 0 turns it off.
    /// Needs trusted local ids and a cache-aware decode pool following its engines' KV events
    /// (else the prefill runs as always).
    /// It is also the most prompt tokens a decode computes alone at once for one instance, and
    /// a decode whose engine reports requests waiting computes none.
    /// Default: `512`.
    /// On the real NIXL pair, turns under 512 answered in 0.16-0.32x always-P/D's time at 8
    /// sessions and 0.52-0.69x at one, the decode's running streams and every other turn as
    /// fast as under always-P/D; 2048 made the turns over it slower under load
    /// (docs/performance.md, "Prefill only when it pays"). Only routes whose decode pool follows
    /// its engines' KV events decide; the rest are unchanged.
    pub skip_below_tokens: u64,
}

/// Tokens a decode may lack and still compute a prompt alone, unless configured
/// (`prefill.skip_below_tokens`).
pub const DEFAULT_SKIP_BELOW_TOKENS: u64 = 512;

impl Default for Prefill {
    fn default() -> Self {
        Self {
            pool: None,
            header: None,
            allow: Vec::new(),
            trusted_sources: Vec::new(),
            forward_credentials: false,
            skip_below_tokens: DEFAULT_SKIP_BELOW_TOKENS,
        }
    }
}

/// `[[routes.prefill.allow]]`: an entry written as a table, inline among the strings or as
/// an array of tables: what it permits, and the TLS to dial that with.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct AllowRule {
    /// Host or CIDR with optional ports, as a string entry reads (required).
    #[serde(rename = "match")]
    pub matcher: Option<AllowEntry>,
    /// TLS to the prefillers it permits, the keys of `[pools.NAME.tls]`; the server name
    /// defaults to the host the header names (required with verification when `match` is a
    /// network) (none: plain HTTP).
    pub tls: Option<PoolTls>,
}

/// `routes.prefill.allow`: each entry a string (plain HTTP) or an [`AllowRule`] table.
fn allow_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<AllowRule>, D::Error> {
    /// One entry, either way.
    struct Either(AllowRule);

    impl<'de> Deserialize<'de> for Either {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_struct("AllowRule", &["match", "tls"], EitherVisitor).map(Either)
        }
    }

    struct EitherVisitor;

    impl<'de> Visitor<'de> for EitherVisitor {
        type Value = AllowRule;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a host or CIDR, or a table with `match` and `tls`")
        }
        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<AllowRule, E> {
            let entry = AllowEntry::try_from(text.to_owned()).map_err(E::custom)?;
            Ok(AllowRule { matcher: Some(entry), tls: None })
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<AllowRule, A::Error> {
            AllowRule::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }

    Ok(Vec::<Either>::deserialize(d)?.into_iter().map(|e| e.0).collect())
}

/// `[cache]`: shared by every relay route with `relay_handoff = "cache"`; ids are stored as
/// 4-byte integers and the oldest entries are evicted first. Fixed at start.
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Cache {
    /// Largest total size of the cached ids, bytes.
    /// Default: `268435456`.
    /// 256 MiB: ~64M ids at 4 bytes each.
    #[default(256 * 1024 * 1024)]
    pub capacity_bytes: usize,
    /// How long ids wait for their decode, ms; an entry also leaves when used.
    /// Default: `30000`.
    /// vLLM's KV hold on the prefill, after which ids are useless.
    #[serde(deserialize_with = "duration::LegMs::read")]
    #[default(Duration::from_millis(30_000))]
    pub ttl_ms: Duration,
}

/// `[tracing]`: spans of each request and its legs, exported over OTLP. Without this table
/// tracing is off (no layer installed, no span made, a client's `traceparent`
/// reaches the engines unchanged). Fixed at start.
#[derive(Debug, Clone, PartialEq, SmartDefault, Deserialize)]
#[serde(default)]
pub struct Tracing {
    /// The collector's URL (required): `http://host:4318/v1/traces` for `http`,
    /// `http://host:4317` for `grpc` (plain HTTP: run a collector beside tokenonce).
    pub endpoint: String,
    /// OTLP transport: `http` (protobuf) or `grpc`.
    /// Default: `"http"`.
    /// HTTP with protobuf, the OpenTelemetry SDKs' default, which every collector takes.
    pub protocol: OtlpProtocol,
    /// Share (from none to all, a float) of the traces started here that are sampled; a
    /// client's `traceparent` decides for its own trace (parent-based sampling).
    /// Default: `1.0`.
    /// A sidecar sees its pod's traffic only, and a client's `traceparent` still decides for
    /// its own traces.
    #[default(1.0)]
    pub sampling_ratio: f64,
    /// `service.name` of the spans.
    /// Default: `"tokenonce"`.
    /// `service.name` of tokenonce's spans.
    #[default("tokenonce".into())]
    pub service_name: String,
}

impl PoolKvEvents {
    /// The subscribers' settings.
    pub fn settings(&self) -> crate::kv::events::Settings {
        crate::kv::events::Settings {
            port: self.port,
            replay_port: self.replay_port,
            endpoint_ports: self.endpoint_ports.clone(),
            endpoint_replay_ports: self.endpoint_replay_ports.clone(),
            topic: self.topic.clone(),
            hash_seed: self.hash_seed.clone(),
            block_size: self.block_size.get(),
            max_blocks: self
                .max_blocks
                .map_or(crate::kv::settings::SIZED_FLOOR, |n| usize::try_from(n).unwrap_or(usize::MAX)),
            fixed_bound: self.max_blocks.is_some(),
            stale_after: self.stale_after_ms,
        }
    }
}
