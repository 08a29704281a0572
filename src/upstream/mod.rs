//! Upstream engines: pools and the pick among their endpoints, the legs tokenonce sends them
//! (retry, budget, failover, ejection) over its own HTTP/1.1 client, and the probes and DNS
//! lookups that keep endpoints' health, engine facts and pools' members current.
//!
//! Layout: `pool` (pools, the pick), `choice` (the cache-aware choice), `endpoint` (one
//! endpoint's load, health and ejection), `facts` (what asking its engine taught: version,
//! model, load), `engine_load` (the reader of an engine's `/metrics`), `discovery` and `dns_name` (members a DNS name gives), `client` over `h1` (the
//! HTTP/1.1 client) and `resolve` (its name cache), `leg` (one leg under the deadline, retry,
//! failover and ejection rules), `budget` (the per-route retry budget), `health` (the probes),
//! `homes` (where each stored Responses answer lives), `metrics` (their family).

pub mod budget;
pub mod choice;
pub mod client;
pub mod discovery;
pub mod dns_name;
pub mod endpoint;
pub mod engine_load;
pub mod facts;
pub mod h1;
pub mod health;
pub mod homes;
pub mod leg;
pub mod metrics;
pub mod pool;
pub mod resolve;

pub use budget::RetryBudget;
pub use choice::{CacheAwareChoice, Prompt, PromptKey};
pub use client::{Delivery, Exchange, SendFailure, UpstreamClient, UpstreamError};
pub use discovery::{Discoverer, DiscoveryError};
pub use endpoint::{ComputingAlone, EjectionRule, Endpoint, Picked};
pub use engine_load::{EngineLoad, Pressure};
pub use facts::{EngineFacts, ModelIdentity};
pub use homes::ResponseHomes;
pub use leg::{named_endpoint, pick, pick_for, Failover, LegClient, LegError};
pub use pool::{Membership, Pool};

/// The request id header tokenonce reads from clients and sends on every leg and answer, as a
/// ready name (a `&str` name is parsed on every lookup and insert).
pub const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The header naming the data-parallel rank a vLLM server (one port, several ranks) runs a
/// request on; read on chat, completions and generate (vLLM 0.32, `X-data-parallel-rank`).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
