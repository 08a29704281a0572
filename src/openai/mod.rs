//! The OpenAI/vLLM wire protocol as pure functions on bytes: request view and rewrites,
//! prefill handoff extraction, response rewrites, prompt-id validation, error bodies.
//! Nothing here knows about pingora or sockets.

pub mod error;
pub mod ids;
pub mod json;
pub mod request;
pub mod response;

pub use error::ApiError;
pub use ids::{IdsError, PromptIds};
pub use json::RawObject;
pub use request::{Api, RequestView};

/// Why a request took the text decode instead of reusing the prefill's ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// The route turns token reuse off.
    Disabled,
    /// The decode vLLM is older than 0.27 (no `kv_transfer_params.prompt_token_ids`).
    DecodeVersionOld,
    /// The decode vLLM's version could not be learned.
    DecodeVersionUnknown,
    /// Messages carry media: ids alone would drop it.
    Media,
    /// `echo` is set.
    Echo,
    /// `n > 1`.
    NGreaterThanOne,
    /// A completions batch (several prompts).
    BatchPrompt,
    /// The client already sent token ids: nothing to save.
    PromptIsTokens,
    /// The prefill echoed no ids.
    IdsMissing,
    /// The prefill's ids failed validation.
    IdsMalformed,
    /// Relay mode: no cached ids for this decode.
    CacheMiss,
}

impl FallbackReason {
    /// Every reason, for pre-creating metric series.
    pub const ALL: [Self; 11] = [
        Self::Disabled,
        Self::DecodeVersionOld,
        Self::DecodeVersionUnknown,
        Self::Media,
        Self::Echo,
        Self::NGreaterThanOne,
        Self::BatchPrompt,
        Self::PromptIsTokens,
        Self::IdsMissing,
        Self::IdsMalformed,
        Self::CacheMiss,
    ];

    /// Label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::DecodeVersionOld => "decode_version_old",
            Self::DecodeVersionUnknown => "decode_version_unknown",
            Self::Media => "media",
            Self::Echo => "echo",
            Self::NGreaterThanOne => "n_gt_1",
            Self::BatchPrompt => "batch_prompt",
            Self::PromptIsTokens => "prompt_is_tokens",
            Self::IdsMissing => "ids_missing",
            Self::IdsMalformed => "ids_malformed",
            Self::CacheMiss => "cache_miss",
        }
    }
}
