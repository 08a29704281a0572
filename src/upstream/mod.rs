//! Upstream engines: pools and endpoint choice (`pool`), the HTTP client for the legs
//! tokenonce sends itself (`client`), and the background health and version poller (`health`).

pub mod client;
pub mod health;
pub mod pool;

pub use client::{Exchange, UpstreamClient, UpstreamError};
pub use pool::{Endpoint, Picked, Pool};
