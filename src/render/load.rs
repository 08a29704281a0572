//! What a model folder is loaded with for local rendering (vLLM's server flags that change
//! rendering), and why a folder cannot be.

use super::pyjson::PyValue;
use super::Unsupported;

/// What the server was started with that changes rendering (vLLM flags).
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `--tokenizer-mode` (`auto` when empty): only `auto` and `hf` render through the
    /// chat template.
    pub tokenizer_mode: String,
    /// `--default-chat-template-kwargs`, a JSON object (empty: none).
    pub default_chat_template_kwargs: Vec<(String, PyValue)>,
    /// `--exclude-tools-when-tool-choice-none`.
    pub exclude_tools_when_tool_choice_none: bool,
    /// `--chat-template`, as text (vLLM reads a path's file): a template name the folder
    /// defines picks that one, any other text is the template for every request.
    pub chat_template: Option<String>,
    /// gpt-oss: the date of Harmony's system message (vLLM's `VLLM_SYSTEM_START_DATE`,
    /// `YYYY-MM-DD`); `None`: the UTC date at the request.
    pub system_start_date: Option<String>,
}

/// Why a model folder's template cannot be loaded for local rendering.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not the JSON object transformers reads.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The model renders in a way this module does not reproduce: every chat request of the
    /// pool takes today's path with this reason.
    #[error("cannot render this model locally: {0}")]
    Unsupported(Unsupported),
}
