//! Every default of the config file, in the file's own units, each with its reason. The
//! validator applies these; each key's doc in `file.rs` states its default and links here, and
//! `tests/docs.rs` checks that stated value loads as this one and copies the reason into
//! `docs/configuration.md`, so a reason here is written for operators.

use super::model::{
    Balance, ClientHandoff, LogFormat, OnClientGone, OnPrefillFailure, OtlpProtocol, ParityPolicy, RelayHandoff,
};

/// Client listener: all interfaces, on vLLM's own default port, so clients need no change.
pub const LISTEN: &str = "0.0.0.0:8000";
/// Admin listener: loopback only; metrics and probes are for the pod, not for clients.
pub const ADMIN_LISTEN: &str = "127.0.0.1:9000";
/// Proxy worker threads: a sidecar shares its pod's CPUs with the engine's API server.
pub const THREADS: u64 = 2;
/// Work stealing: one multi-threaded runtime whose idle threads take queued tasks (pingora's
/// default). Off, each thread runs its own runtime and keeps the connections it was handed,
/// with no cross-thread wake-ups (measured within noise of on), less even under uneven load.
pub const WORK_STEALING: bool = true;
/// Seconds in-flight streams may finish after SIGTERM: short decodes end well within it.
pub const GRACE_PERIOD_SECONDS: u64 = 5;
/// Seconds services get to stop after the grace period.
pub const GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS: u64 = 5;
/// Log filter: one line per request and every fallback, no per-chunk noise.
pub const LOG_LEVEL: &str = "info";
/// Log format: text for people; `json` is opt-in for log pipelines.
pub const LOG_FORMAT: LogFormat = LogFormat::Text;
/// TCP connect deadline, ms: engines are on loopback or in the cluster.
pub const CONNECT_TIMEOUT_MS: u64 = 2000;
/// Pooled connection idle limit, ms: below vLLM's 5 s keep-alive, so no socket goes stale.
pub const IDLE_TIMEOUT_MS: u64 = 4000;
/// `GET /health` period of every endpoint, ms: readiness follows the engine within 2 s.
pub const HEALTH_INTERVAL_MS: u64 = 2000;
/// Endpoint choice: round robin needs no state beyond a counter.
pub const BALANCE: Balance = Balance::RoundRobin;
/// Pool for requests no route matches: the decode engine serves `/v1/models` and the rest.
pub const PASSTHROUGH_POOL: &str = "decode";
/// Relay handoff: the cache keeps the ids off the orchestrator's wire.
pub const RELAY_HANDOFF: RelayHandoff = RelayHandoff::Cache;
/// Token reuse is what tokenonce is for.
pub const TOKEN_REUSE: bool = true;
/// Whole prefill leg, ms: vLLM holds the prefill's KV for the decode 30 s by default.
pub const PREFILL_TIMEOUT_MS: u64 = 30_000;
/// Decode response header, ms: a queued decode may wait behind long prefills.
pub const DECODE_FIRST_BYTE_TIMEOUT_MS: u64 = 60_000;
/// A non-streamed answer, ms: vLLM sends its head only when generation is done, and a
/// reasoning model's or an evaluation job's long output (tens of thousands of tokens at
/// tens per second, slower under load) takes many minutes; 30 min covers those and still
/// ends a decode that never answers.
pub const DECODE_WHOLE_ANSWER_TIMEOUT_MS: u64 = 1_800_000;
/// Client requests served at once, per client listener service (plain and TLS together):
/// with the worst case of ~224 MiB per request (docs/failures.md, "Memory per request") the
/// bound is far past any memory, but a typical request holds about 1 MB, and past a thousand
/// in flight the engines queue anyway.
pub const MAX_IN_FLIGHT: u64 = 1024;
/// Silence allowed between two body chunks (SSE events) of an engine answer being relayed,
/// ms: vLLM streams a token every few tens of ms and a preempted or recomputing decode resumes
/// within seconds; a minute of nothing is a stuck engine.
pub const STREAM_IDLE_TIMEOUT_MS: u64 = 60_000;
/// How long one write to the client may wait for it to take bytes, ms: a client that has not
/// read for 30 s while every socket buffer is full has stalled, and its decode is freed.
pub const CLIENT_WRITE_TIMEOUT_MS: u64 = 30_000;
/// A client gone after a prefill that holds KV blocks: the decode is still sent (one token,
/// discarded) so the decode pulls the blocks and the prefill frees them now, not when its
/// lease runs out (vLLM #50425: stranded blocks exhaust KV under load).
pub const ON_CLIENT_GONE: OnClientGone = OnClientGone::Release;
/// The whole release leg, ms: past vLLM's 30 s KV lease the prefill has freed the blocks anyway.
pub const RELEASE_TIMEOUT_MS: u64 = 30_000;
/// Longest SSE event relayed, bytes (16 MiB): a token event with 20 top logprobs is a few KB,
/// but a first event echoing the prompt ids (`return_token_ids`) or carrying prompt logprobs
/// grows with the prompt: ~7 bytes per id, so 16 MiB holds the echo of a 2M-token prompt.
pub const MAX_SSE_EVENT_BYTES: u64 = 16 * 1024 * 1024;
/// Retries as a share of a route's legs, percent: a failing engine sees at most 1.2× the
/// load, while the rare keep-alive race is still retried.
pub const RETRY_BUDGET_PERCENT: u64 = 20;
/// Retries a route may make per second whatever its traffic, so a quiet route can retry.
pub const RETRY_BUDGET_MIN_PER_SECOND: u64 = 3;
/// Endpoints a pool prefill may try (a failure before any answer, or a 5xx, moves to
/// another endpoint of the pool): one failover rides out one bad engine without doubling
/// the load of a pool that is failing as a whole.
pub const PREFILL_ATTEMPTS: u64 = 2;
/// Consecutive request failures that eject an endpoint from its pool's choice: one or two
/// are the keep-alive race or a single bad request, three in a row is the engine.
pub const EJECT_AFTER_FAILURES: u64 = 3;
/// A failed prefill leg: its error goes to the client (a decode alone would run the whole
/// prompt on the decode engine, which a route must opt into).
pub const ON_PREFILL_FAILURE: OnPrefillFailure = OnPrefillFailure::Error;
/// Request body limit, bytes (32 MiB): a 128k-token chat is a few MB of JSON.
pub const MAX_BODY_BYTES: u64 = 32 * 1024 * 1024;
/// Relay id cache bound, bytes (256 MiB): ~64M ids at 4 bytes each.
pub const CACHE_CAPACITY_BYTES: u64 = 256 * 1024 * 1024;
/// Relay id cache entry lifetime, ms: vLLM's KV hold on the prefill, after which ids are useless.
pub const CACHE_TTL_MS: u64 = 30_000;
/// A client's own `kv_transfer_params` on an orchestrate route: removed, so clients that
/// copy a whole vLLM request keep working while never steering the handoff.
pub const CLIENT_KV_TRANSFER_PARAMS: ClientHandoff = ClientHandoff::Strip;
/// Client credentials to a prefiller a request header names: not sent; that host is less
/// trusted than a configured pool.
pub const FORWARD_CREDENTIALS: bool = false;
/// Header fields per request head: several times what OpenAI SDKs and gateways send.
pub const MAX_HEADER_COUNT: u64 = 100;
/// Header bytes per request head (64 KiB): room for long tokens and tracing headers.
pub const MAX_HEADER_BYTES: u64 = 64 * 1024;
/// Whole request body, ms: a slow or stalled client (slowloris) is cut after a minute.
pub const BODY_READ_TIMEOUT_MS: u64 = 60_000;
/// Upstream TLS checks the engine's certificate: a pool that crosses pods must not accept
/// whoever answers on the address.
pub const UPSTREAM_TLS_VERIFY: bool = true;
/// OTLP transport: HTTP with protobuf, the OpenTelemetry SDKs' default, which every collector takes.
pub const TRACING_PROTOCOL: OtlpProtocol = OtlpProtocol::Http;
/// Share of traces started here that are sampled: all; a sidecar sees its pod's traffic only,
/// and a client's `traceparent` still decides for its own traces.
pub const TRACING_SAMPLING_RATIO: f64 = 1.0;
/// `service.name` of tokenonce's spans.
pub const TRACING_SERVICE_NAME: &str = "tokenonce";
/// Share of reused requests the parity watch checks: 1 % keeps its cost (a few ms of one
/// worker per sample at 37k tokens) far below the proxy's, and still catches a bad rollout
/// within a few hundred requests.
pub const PARITY_SAMPLE: f64 = 0.01;
/// A parity mismatch alerts (counted, logged); turning reuse off is a route's choice.
pub const ON_PARITY_MISMATCH: ParityPolicy = ParityPolicy::Alert;
/// Reuse stays off at least this long after a mismatch under `disable_reuse`, ms: a rollout
/// or a bad engine is not fixed in less.
pub const PARITY_COOLDOWN_MS: u64 = 60_000;
