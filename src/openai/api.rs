//! Which API a request speaks ([`Api`]): its path, its metric label, and the body fields
//! that set its token limit and ask vLLM to echo the prompt ids. Both the request view and
//! the error bodies read it.

label_enum! {
    /// Which OpenAI API a request speaks; the label is its `api` metric label.
    Api {
        /// `POST /v1/chat/completions`
        Chat => "chat",
        /// `POST /v1/completions`
        Completions => "completions",
        /// `POST /v1/responses` (OpenAI Responses API)
        Responses => "responses",
        /// `POST /v1/messages` (Anthropic Messages API, as vLLM serves it)
        Messages => "messages",
        /// `POST /inference/v1/generate` (vLLM's token-in generate, served with
        /// `--enable-scale-out` or `--tokens-only`): ids in, limits in `sampling_params`.
        Generate => "generate",
    }
}

impl Api {
    /// The API served at `path`, if tokenonce orchestrates it.
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completions),
            "/v1/responses" => Some(Self::Responses),
            "/v1/messages" => Some(Self::Messages),
            "/inference/v1/generate" => Some(Self::Generate),
            _ => None,
        }
    }

    /// The body field holding the token limit that the prefill leg sets to 1 (generate:
    /// the same name inside `sampling_params`).
    pub(super) fn limit_field(self) -> &'static str {
        match self {
            Self::Responses => "max_output_tokens",
            Self::Chat | Self::Completions | Self::Messages | Self::Generate => "max_tokens",
        }
    }

    /// The body field that makes vLLM 0.32 echo the prompt ids on this API, if any:
    /// `return_token_ids` (chat, completions), `enable_response_messages` (Responses: the
    /// ids come back in `input_messages[0].tokens`; `return_token_ids` is ignored there).
    /// `/v1/messages` echoes none; generate's prompt is ids already.
    pub fn echo_field(self) -> Option<&'static str> {
        match self {
            Self::Chat | Self::Completions => Some("return_token_ids"),
            Self::Responses => Some("enable_response_messages"),
            Self::Messages | Self::Generate => None,
        }
    }
}
