//! The OpenAI/vLLM wire protocol as pure functions on bytes: request view and rewrites,
//! prefill handoff extraction, response rewrites, prompt-id validation, error bodies.
//! Nothing here knows about pingora or sockets.

mod cut;
pub mod error;
pub mod ids;
pub mod json;
pub mod request;
pub mod response;

pub use error::ApiError;
pub use ids::{IdsError, PromptIds};
pub use json::RawObject;
pub use request::{Api, RequestView};

/// Fallback reasons are metric label values, so `metrics` owns them.
pub use crate::metrics::FallbackReason;
