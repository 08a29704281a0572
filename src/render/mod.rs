//! Renders chat and completion prompts to the text vLLM 0.32 would tokenize, exactly, or
//! says why it cannot ([`Unsupported`], one variant per reason, for the caller to fall back
//! and count). Pure: no pingora, no sockets, no caching (the token cache lives elsewhere).
//!
//! - `pyjson`: CPython's `json.loads`/`json.dumps` (order, duplicate keys, float repr).
//! - `template`: the model's chat template compiled into minijinja, and its render.
//! - `pyshims`: what makes minijinja render as jinja2 under transformers (Python's string
//!   methods, `tojson`, `raise_exception`, `strftime_now`, Python's `str()` of values).
//! - `content_format`: vLLM's "string" or "openai" content format, read from the template's
//!   text.
//! - `request`: the request body as vLLM reads it (its tool checks, the shape), and the
//!   completions prompt.
//! - `load`: a model folder loaded: the server flags, which renderer vLLM picks, the template
//!   texts and special tokens its files give, and why a folder cannot be loaded.
//! - `strftime`: the UTC dates templates and Harmony's system message print.
//! - `chat`: a chat request rendered in vLLM's steps (settings, messages, tools, developer
//!   role, template kwargs, render, post-processing).
//! - `message`: vLLM's preprocessing of one chat message before the template sees it.
//! - `harmony`: gpt-oss, which vLLM renders without its template: Harmony messages encoded
//!   to ids by the `openai-harmony` crate.
//! - `mistral`, `tekken`: Mistral's tokenizer mode, ids straight from the request
//!   (mistral-common's instruct encoding over the tekken tokenizer), no template;
//!   `mistral_tools`: the request's tools as mistral-common reads and checks them.
//!
//! Tokenizing the rendered text is `tokenizers` `encode(text, add_special_tokens=false)` for
//! chat and `encode(prompt, add_special_tokens=true)` for a completions string (see
//! [`encode`]).

mod chat;
mod content_format;
mod harmony;
mod load;
mod message;
mod mistral;
mod mistral_tools;
pub mod pyjson;
mod pyshims;
mod request;
mod strftime;
mod tekken;
mod template;

pub use chat::{render_chat, RenderedChat};
pub use harmony::{render_harmony, render_harmony_on, Harmony, RenderedHarmony};
pub use load::{LoadError, LoadOptions};
#[cfg(test)]
pub(crate) use mistral::testing as mistral_testing;
pub use mistral::{Mistral, MistralLoadError};
pub use request::{render_completion, RenderedCompletion, Shape};
pub use tekken::{Tekken, TekkenError, TEKKEN_FILE};
pub use template::ChatTemplate;

/// Why a request cannot be rendered here with proof of equality to vLLM. Each variant is one
/// fallback reason; [`Unsupported::label`] is its metric label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    /// The body is not a JSON object as Python's `json.loads` reads it.
    #[error("body is not a JSON object Python reads: {0}")]
    Body(String),
    /// A string holds a lone surrogate (`\ud800`), which vLLM refuses.
    #[error("lone surrogate in a string")]
    LoneSurrogate,
    /// An integer beyond 128 bits (or past CPython's 4300 digits).
    #[error("integer too large to carry exactly")]
    BigInteger,
    /// Image, audio, video, embeddings or other media content parts.
    #[error("media content part")]
    Media,
    /// A `tool_reference` content part.
    #[error("tool_reference content part")]
    ToolReference,
    /// A request-level `chat_template` (or one in `chat_template_kwargs`).
    #[error("request-level chat template")]
    RequestChatTemplate,
    /// A `chat_template_kwargs` key vLLM or transformers consumes itself.
    #[error("chat_template_kwargs key {0:?} is not a plain template variable")]
    ReservedKwarg(String),
    /// `echo: true` (vLLM renders, and ignores forwarded ids).
    #[error("echo")]
    Echo,
    /// `add_special_tokens: true` (the tokenizer's own specials are added).
    #[error("add_special_tokens")]
    AddSpecialTokens,
    /// `truncate_prompt_tokens` (vLLM cuts the ids).
    #[error("truncate_prompt_tokens")]
    Truncation,
    /// The client sent `kv_transfer_params.prompt_token_ids` itself.
    #[error("client sent prompt_token_ids")]
    ClientPromptIds,
    /// A request vLLM answers with an error (the engine says why, on today's path).
    #[error("vLLM refuses this request: {0}")]
    VllmRejects(&'static str),
    /// A request shape whose handling by vLLM is not proven equal here (e.g. a field of an
    /// unexpected type that pydantic might coerce).
    #[error("shape not proven equal to vLLM: {0}")]
    Unverified(&'static str),
    /// The template uses something the renderer lacks (syntax, filter, method, ...).
    #[error("template feature the renderer lacks: {0}")]
    TemplateFeature(String),
    /// The template called `raise_exception` (vLLM answers 400 with this message).
    #[error("template raised: {0}")]
    TemplateRaised(String),
    /// The template printed a float whose minijinja text differs from Python's `str()`.
    #[error("template printed a float Python writes differently")]
    FloatDisplay,
    /// The model's tokenizer mode is Mistral (vLLM renders with mistral-common) and its
    /// folder is not one rendered here (a sentencepiece file, a tekken version other than v3).
    #[error("Mistral tokenizer")]
    Mistral,
    /// A `--tokenizer-mode` other than auto/hf (deepseek_v32, kimi_k3, cohere, ...).
    #[error("tokenizer mode {0:?}")]
    TokenizerMode(String),
    /// The folder has a processor (multimodal) template, which vLLM prefers.
    #[error("processor chat template")]
    ProcessorTemplate,
    /// The template loops over something content-like in a way only vLLM's AST walk tells
    /// apart (the "string" or "openai" content format).
    #[error("template may read content parts (content format not certain)")]
    ContentFormatOpenAi,
    /// No usable chat template (none, or named ones without `default`).
    #[error("no default chat template")]
    NoDefaultTemplate,
    /// A special token the template reads is not set in tokenizer_config.json (its value
    /// would come from the tokenizer class).
    #[error("special token {0} not in tokenizer_config.json")]
    SpecialTokenUnknown(String),
}

impl Unsupported {
    /// The reason as a bounded metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Unsupported::Body(_) => "body",
            Unsupported::LoneSurrogate => "lone_surrogate",
            Unsupported::BigInteger => "big_integer",
            Unsupported::Media => "media",
            Unsupported::ToolReference => "tool_reference",
            Unsupported::RequestChatTemplate => "request_chat_template",
            Unsupported::ReservedKwarg(_) => "reserved_template_kwarg",
            Unsupported::Echo => "echo",
            Unsupported::AddSpecialTokens => "add_special_tokens",
            Unsupported::Truncation => "truncation",
            Unsupported::ClientPromptIds => "client_prompt_ids",
            Unsupported::VllmRejects(_) => "vllm_rejects",
            Unsupported::Unverified(_) => "unverified_shape",
            Unsupported::TemplateFeature(_) => "template_feature",
            Unsupported::TemplateRaised(_) => "template_raised",
            Unsupported::FloatDisplay => "float_display",
            Unsupported::Mistral => "mistral",
            Unsupported::TokenizerMode(_) => "tokenizer_mode",
            Unsupported::ProcessorTemplate => "processor_template",
            Unsupported::ContentFormatOpenAi => "content_format_openai",
            Unsupported::NoDefaultTemplate => "no_template",
            Unsupported::SpecialTokenUnknown(_) => "special_token_unknown",
        }
    }
}

/// vLLM's tokenizing of rendered text: `encode(text, add_special_tokens)` (false for chat,
/// true for a completions string), without truncation.
///
/// # Errors
/// The tokenizer's error, as text.
pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
    tokenizer.encode(text, add_special_tokens).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
}
