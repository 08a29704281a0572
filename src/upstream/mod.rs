//! Upstream engines: pools and endpoint choice (`pool`), pools whose members DNS gives
//! (`discovery`), the HTTP client for the legs
//! tokenonce sends itself (`client`, speaking HTTP/1.1 in `h1`) and its name cache (`resolve`),
//! one leg sent under the deadline, retry, failover and ejection rules (`leg`), the background health, version and
//! model poller (`health`), the per-route retry budget (`budget`), and where each stored
//! Responses answer lives (`homes`); their metric family (`metrics`).

pub mod budget;
pub mod client;
pub mod discovery;
pub mod dns_name;
pub mod h1;
pub mod health;
pub mod homes;
pub mod leg;
pub mod metrics;
pub mod pool;
pub mod resolve;

pub use budget::RetryBudget;
pub use client::{Delivery, Exchange, SendFailure, UpstreamClient, UpstreamError};
pub use discovery::{Discoverer, DiscoveryError};
pub use homes::ResponseHomes;
pub use leg::{named_endpoint, pick, pick_for, Failover, LegClient, LegError};
pub use pool::{CacheAwareChoice, EjectionRule, Endpoint, Membership, ModelIdentity, Picked, Pool, PromptKey};

/// The request id header tokenonce reads from clients and sends on every leg and answer, as a
/// ready name (a `&str` name is parsed on every lookup and insert).
pub const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The header naming the data-parallel rank a vLLM server (one port, several ranks) runs a
/// request on; read on chat, completions and generate (vLLM 0.32, `X-data-parallel-rank`).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
