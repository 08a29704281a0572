//! The OpenAI/vLLM wire protocol as pure functions on bytes: request view and rewrites,
//! prefill handoff extraction, response rewrites, prompt-id validation, error bodies.
//! Nothing here knows about pingora or sockets.

pub mod api;
mod cut;
pub mod error;
pub mod fallback;
pub mod hash_inputs;
pub mod ids;
pub mod json;
pub mod prefix;
pub mod request;
pub mod response;

pub use api::Api;
pub use error::ApiError;
pub use fallback::FallbackReason;
pub use hash_inputs::HashInputs;
pub use ids::{IdsError, PromptIds};
pub use json::RawObject;
pub use request::RequestView;
