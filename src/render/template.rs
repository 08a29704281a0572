//! A model's chat template compiled into minijinja (one variant per template text, the
//! special tokens its context gets) and rendered as transformers' `render_jinja_template`
//! renders it. Folder loading is `load.rs`, the Python shims `pyshims.rs`.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use minijinja::{Environment, Error, Value};

use super::content_format::content_format_is_openai;
use super::harmony::Harmony;
use super::load::{refuse_other_renderers, FolderTemplates, LoadError, LoadOptions, Renderer};
use super::pyshims::{classify, new_environment, strftime_now, NanSink, NAN_SINK};
use super::Unsupported;

/// One template text and what vLLM decides from it.
#[derive(Debug)]
struct Variant {
    /// The template's name in the environment.
    name: String,
    /// The source text (vLLM tests it for `developer` and `content`).
    source: String,
    /// vLLM's `_detect_developer_role_support`.
    supports_developer: bool,
    /// vLLM's `_detect_content_format` said "openai" (content as text parts).
    content_parts: bool,
}

/// A model's chat template(s), compiled, with the special tokens the template context gets;
/// for gpt-oss, which vLLM renders without its template, the Harmony renderer instead.
pub struct ChatTemplate {
    env: Environment<'static>,
    default: Option<Variant>,
    tool_use: Option<Variant>,
    special_tokens: Vec<(String, String)>,
    pub(crate) options: LoadOptions,
    harmony: Option<Harmony>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("default", &self.default.as_ref().map(|v| v.source.len()))
            .field("tool_use", &self.tool_use.as_ref().map(|v| v.source.len()))
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads the chat template of a model folder as vLLM 0.32 (transformers 5) finds it:
    /// `chat_template.jinja` and `additional_chat_templates/*.jinja` first, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}`);
    /// the special tokens from `tokenizer_config.json`.
    ///
    /// # Errors
    /// [`LoadError`]: unreadable files, or a model vLLM renders another way
    /// ([`LoadError::Unsupported`]).
    pub fn load(folder: &Path, options: LoadOptions) -> Result<Self, LoadError> {
        if refuse_other_renderers(folder, &options)? == Renderer::Harmony {
            let harmony = Harmony::load(folder, &options)?;
            let env = new_environment()?;
            return Ok(ChatTemplate {
                env,
                default: None,
                tool_use: None,
                special_tokens: Vec::new(),
                options,
                harmony: Some(harmony),
            });
        }
        let FolderTemplates { default: default_src, tool_use: tool_use_src, special_tokens } =
            FolderTemplates::read(folder, &options)?;

        let mut env = new_environment()?;
        let default = default_src.map(|source| Variant::compile(&mut env, "default", source)).transpose()?;
        let tool_use = tool_use_src.map(|source| Variant::compile(&mut env, "tool_use", source)).transpose()?;
        Ok(ChatTemplate { env, default, tool_use, special_tokens, options, harmony: None })
    }

    /// A template from its text alone (tests; a folder is the real source).
    ///
    /// # Errors
    /// As [`ChatTemplate::load`].
    pub fn from_source(source: &str, special_tokens: &[(&str, &str)], options: LoadOptions) -> Result<Self, LoadError> {
        let mut env = new_environment()?;
        let default = Variant::compile(&mut env, "default", source.to_string())?;
        Ok(ChatTemplate {
            env,
            default: Some(default),
            tool_use: None,
            special_tokens: special_tokens.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect(),
            options,
            harmony: None,
        })
    }

    /// True when `other` was loaded from the same template text(s) and special tokens (a
    /// reload that changed neither renders alike; the load options are the caller's).
    pub fn same_as(&self, other: &Self) -> bool {
        fn sources(t: &ChatTemplate) -> (Option<&str>, Option<&str>) {
            (t.default.as_ref().map(|v| v.source.as_str()), t.tool_use.as_ref().map(|v| v.source.as_str()))
        }
        let harmony_same = match (&self.harmony, &other.harmony) {
            (Some(a), Some(b)) => a.same_as(b),
            (a, b) => a.is_none() && b.is_none(),
        };
        sources(self) == sources(other) && self.special_tokens == other.special_tokens && harmony_same
    }

    /// gpt-oss's Harmony renderer, when this folder's model is rendered by it.
    pub fn harmony(&self) -> Option<&Harmony> {
        self.harmony.as_ref()
    }

    /// The special tokens the template context gets, as (name, string).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// transformers' `get_chat_template(None, tools)`: `tool_use` when tools are passed and
    /// there is one, else `default`.
    fn variant(&self, with_tools: bool) -> Result<&Variant, Unsupported> {
        let chosen = if with_tools { self.tool_use.as_ref().or(self.default.as_ref()) } else { self.default.as_ref() };
        chosen.ok_or(Unsupported::NoDefaultTemplate)
    }

    /// Whether the template chosen for these tools mentions the `developer` role.
    pub(crate) fn supports_developer(&self, with_tools: bool) -> Result<bool, Unsupported> {
        self.variant(with_tools).map(|v| v.supports_developer)
    }

    /// Whether the template chosen for these tools reads content as parts (vLLM's "openai"
    /// content format: every message's content becomes a list of `{"type": "text", "text"}`).
    pub(crate) fn reads_content_parts(&self, with_tools: bool) -> Result<bool, Unsupported> {
        self.variant(with_tools).map(|v| v.content_parts)
    }

    /// Whether the chosen template's text holds `needle` (transformers' continue check).
    pub(crate) fn source_contains(&self, with_tools: bool, needle: &str) -> Result<bool, Unsupported> {
        self.variant(with_tools).map(|v| v.source.contains(needle))
    }

    /// Renders the chosen template with `context` (the special tokens are added under it).
    pub(crate) fn render(&self, with_tools: bool, context: Vec<(String, Value)>) -> Result<Rendering, Unsupported> {
        let variant = self.variant(with_tools)?;
        let template = self.env.get_template(&variant.name).map_err(|e| Unsupported::TemplateFeature(e.to_string()))?;
        let mut ctx: indexmap::IndexMap<Value, Value> = indexmap::IndexMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(Value::from(k.as_str()), Value::from(v.as_str()));
        }
        for (k, v) in context {
            ctx.insert(Value::from(k), v);
        }
        let clock = Arc::new(AtomicBool::new(false));
        let state_clock = clock.clone();
        ctx.insert(
            Value::from("strftime_now"),
            Value::from_function(move |format: &str| -> Result<Value, Error> {
                state_clock.store(true, Ordering::Relaxed);
                strftime_now(format).map(Value::from)
            }),
        );
        let sink = Arc::new(NanSink::default());
        ctx.insert(Value::from(NAN_SINK), Value::from_dyn_object(sink.clone()));
        let text = template.render(Value::from(ctx)).map_err(classify)?;
        Ok(Rendering {
            text,
            reads_clock: clock.load(Ordering::Relaxed),
            nan_by_tojson: sink.0.load(Ordering::Relaxed),
        })
    }
}

impl Variant {
    /// Compiles `source` into `env` under `name`, noting whether it reads content as parts
    /// (vLLM's "openai" content format).
    fn compile(env: &mut Environment<'static>, name: &str, source: String) -> Result<Self, LoadError> {
        env.add_template_owned(name.to_string(), source.clone())
            .map_err(|e| LoadError::Unsupported(Unsupported::TemplateFeature(e.to_string())))?;
        let supports_developer = source.contains("\"developer\"") || source.contains("'developer'");
        let content_parts =
            content_format_is_openai(&source).ok_or(LoadError::Unsupported(Unsupported::ContentFormatOpenAi))?;
        Ok(Variant { name: name.to_string(), source, supports_developer, content_parts })
    }
}

/// A rendered template and whether it read the clock.
pub(crate) struct Rendering {
    pub(crate) text: String,
    pub(crate) reads_clock: bool,
    /// How many `NaN` tokens `tojson` wrote (minijinja prints a NaN as `NaN` too, Python as
    /// `nan`, so the caller compares counts).
    pub(crate) nan_by_tojson: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pools share one template across worker threads.
    #[test]
    fn a_chat_template_is_send_and_sync() {
        fn shared<T: Send + Sync>() {}
        shared::<ChatTemplate>();
    }
}
