//! A model folder loaded for local rendering: the server flags that change rendering, which
//! renderer vLLM picks for the folder (refusing those not done here), the chat template texts
//! and special tokens its files give, and why a folder cannot be loaded.

use std::collections::BTreeMap;
use std::path::Path;

use super::pyjson::{self, PyValue};
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

/// How vLLM renders a model's chat requests: its chat template, or (gpt-oss) Harmony.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Renderer {
    /// The folder's chat template.
    Template,
    /// gpt-oss's Harmony encoding.
    Harmony,
}

/// Refuses a model vLLM renders without its chat template in a way not done here: a
/// tokenizer mode other than auto/hf, Mistral (mistral-common), or a processor (multimodal)
/// template, which vLLM prefers when there are no tools; gpt-oss is rendered by Harmony.
pub(super) fn refuse_other_renderers(folder: &Path, options: &LoadOptions) -> Result<Renderer, LoadError> {
    match options.tokenizer_mode.as_str() {
        "" | "auto" | "hf" => {}
        other => return Err(LoadError::Unsupported(Unsupported::TokenizerMode(other.to_string()))),
    }
    let has = |name: &str| folder.join(name).exists();
    if options.tokenizer_mode != "hf" && has("tekken.json") {
        return Err(LoadError::Unsupported(Unsupported::Mistral));
    }
    if options.tokenizer_mode != "hf" {
        if let Ok(entries) = std::fs::read_dir(folder) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("tokenizer.model.v") {
                    return Err(LoadError::Unsupported(Unsupported::Mistral));
                }
            }
        }
    }
    if has("config.json") {
        let config = pyjson::loads(&read(&folder.join("config.json"))?)
            .map_err(|e| LoadError::Config { path: "config.json".into(), reason: e.to_string() })?;
        if config.get("model_type").and_then(PyValue::as_str) == Some("gpt_oss") {
            return Ok(Renderer::Harmony);
        }
    }
    for processor_file in ["chat_template.json", "processor_config.json", "preprocessor_config.json"] {
        if has(processor_file) {
            return Err(LoadError::Unsupported(Unsupported::ProcessorTemplate));
        }
    }
    Ok(Renderer::Template)
}

/// The template texts a folder gives (`default`, `tool_use`) and the special tokens their
/// context gets, before they are compiled.
pub(super) struct FolderTemplates {
    /// The template used without tools (and with, when there is no `tool_use`).
    pub(super) default: Option<String>,
    /// The template used with tools.
    pub(super) tool_use: Option<String>,
    /// The named special tokens, as (name, string).
    pub(super) special_tokens: Vec<(String, String)>,
}

impl FolderTemplates {
    /// The folder's templates as vLLM 0.32 (transformers 5) finds them: `chat_template.jinja`
    /// and `additional_chat_templates/*.jinja` first, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of `{name, template}`), unless `--chat-template`
    /// names one or replaces them; the special tokens from `tokenizer_config.json`.
    pub(super) fn read(folder: &Path, options: &LoadOptions) -> Result<Self, LoadError> {
        let config = TokenizerConfig::read(folder)?;
        let named = named_templates(folder, &config)?;
        let (default_src, tool_use_src) = match &options.chat_template {
            // resolve_chat_template's first choice: get_chat_template(--chat-template, tools)
            Some(name_or_text) => {
                let text = named.get(name_or_text).cloned().unwrap_or_else(|| name_or_text.clone());
                (Some(text), None)
            }
            None => {
                let mut named = named;
                (named.remove("default"), named.remove("tool_use"))
            }
        };
        if default_src.is_none() && tool_use_src.is_none() {
            return Err(LoadError::Unsupported(Unsupported::NoDefaultTemplate));
        }
        let special_tokens = config.special_tokens(&[&default_src, &tool_use_src])?;
        Ok(FolderTemplates { default: default_src, tool_use: tool_use_src, special_tokens })
    }
}

/// `tokenizer_config.json` as transformers reads it (an empty dict when absent), with its
/// path for errors.
struct TokenizerConfig {
    path: String,
    value: PyValue,
}

impl TokenizerConfig {
    /// Reads the folder's config; it must be a JSON object.
    fn read(folder: &Path) -> Result<Self, LoadError> {
        let file = folder.join("tokenizer_config.json");
        let path = file.display().to_string();
        let value = if file.exists() {
            pyjson::loads(&read(&file)?).map_err(|e| LoadError::Config { path: path.clone(), reason: e.to_string() })?
        } else {
            PyValue::Dict(Vec::new())
        };
        let config = TokenizerConfig { path, value };
        if !matches!(config.value, PyValue::Dict(_)) {
            return Err(config.error("not a JSON object".into()));
        }
        Ok(config)
    }

    /// A [`LoadError::Config`] about this file.
    fn error(&self, reason: String) -> LoadError {
        LoadError::Config { path: self.path.clone(), reason }
    }

    /// The config's `chat_template`: a string (the default), or a list of `{name, template}`.
    fn chat_templates(&self, named: &mut BTreeMap<String, String>) -> Result<(), LoadError> {
        match self.value.get("chat_template") {
            Some(PyValue::Str(s)) => {
                named.insert("default".into(), s.clone());
            }
            Some(PyValue::List(items)) => {
                for item in items {
                    match (item.get("name"), item.get("template")) {
                        (Some(PyValue::Str(n)), Some(PyValue::Str(t))) => {
                            named.insert(n.clone(), t.clone());
                        }
                        _ => return Err(self.error("chat_template list entry without name/template".into())),
                    }
                }
            }
            None | Some(PyValue::Null) => {}
            Some(_) => return Err(self.error("chat_template is neither a string nor a list".into())),
        }
        Ok(())
    }

    /// The named special tokens transformers passes to the template (`special_tokens_map`).
    /// One absent from the config would come from the tokenizer class, unknown here: refused
    /// if one of `sources` reads it.
    fn special_tokens(&self, sources: &[&Option<String>]) -> Result<Vec<(String, String)>, LoadError> {
        let mut special_tokens = Vec::new();
        for name in SPECIAL_TOKEN_NAMES {
            match self.value.get(name) {
                Some(PyValue::Null) => {}
                Some(v) => match token_string(v) {
                    Some(s) => special_tokens.push((name.to_string(), s)),
                    None => return Err(self.error(format!("{name} is neither a string nor an AddedToken"))),
                },
                None => {
                    if sources.iter().any(|src| src.as_ref().is_some_and(|s| s.contains(name))) {
                        return Err(LoadError::Unsupported(Unsupported::SpecialTokenUnknown(name.to_string())));
                    }
                }
            }
        }
        // `extra_special_tokens` (Gemma 3's image markers) never reach the template:
        // transformers 5's `special_tokens_map` holds the named tokens only.
        Ok(special_tokens)
    }
}

/// The folder's templates by name: files first (transformers 5 `from_pretrained`:
/// `chat_template.jinja`, `additional_chat_templates/*.jinja`), else the config's.
fn named_templates(folder: &Path, config: &TokenizerConfig) -> Result<BTreeMap<String, String>, LoadError> {
    let mut named: BTreeMap<String, String> = BTreeMap::new();
    let default_file = folder.join("chat_template.jinja");
    if default_file.exists() {
        named.insert("default".into(), read(&default_file)?);
    }
    let extra_dir = folder.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let entries = std::fs::read_dir(&extra_dir)
            .map_err(|source| LoadError::Io { path: extra_dir.display().to_string(), source })?;
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().to_string();
            if let Some(name) = file.strip_suffix(".jinja") {
                named.insert(name.to_string(), read(&e.path())?);
            }
        }
    }
    if named.is_empty() {
        config.chat_templates(&mut named)?;
    }
    Ok(named)
}

/// The named special tokens transformers passes to every template (`special_tokens_map`).
const SPECIAL_TOKEN_NAMES: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io { path: path.display().to_string(), source })
}

/// A special token's string as transformers stores it: a string, or an `AddedToken` dict's
/// `content`.
fn token_string(v: &PyValue) -> Option<String> {
    match v {
        PyValue::Str(s) => Some(s.clone()),
        PyValue::Dict(_) => v.get("content").and_then(PyValue::as_str).map(str::to_string),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use minijinja::Value;

    use super::*;
    use crate::render::ChatTemplate;

    fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    fn load(files: &[(&str, &str)]) -> Result<ChatTemplate, LoadError> {
        ChatTemplate::load(folder(files).path(), LoadOptions::default())
    }

    fn reason(r: Result<ChatTemplate, LoadError>) -> String {
        match r {
            Err(LoadError::Unsupported(u)) => u.label().to_string(),
            Err(other) => format!("error: {other}"),
            Ok(_) => "loaded".into(),
        }
    }

    fn render_with(t: &ChatTemplate, tools: bool) -> String {
        t.render(tools, vec![("messages".into(), Value::from(Vec::<Value>::new()))]).unwrap().text
    }

    /// transformers 5: chat_template.jinja and additional_chat_templates/ win over the config;
    /// the list form picks `tool_use` with tools, else `default`.
    #[test]
    fn templates_are_found_where_transformers_looks() {
        let config = r#"{"chat_template": "from config {{ eos_token }}", "eos_token": {"content": "</s>", "special": true}, "bos_token": null}"#;
        let t = load(&[("tokenizer_config.json", config)]).unwrap();
        assert_eq!(render_with(&t, false), "from config </s>");
        let t = load(&[("tokenizer_config.json", config), ("chat_template.jinja", "from file")]).unwrap();
        assert_eq!(render_with(&t, false), "from file");
        let t = load(&[
            ("tokenizer_config.json", config),
            ("chat_template.jinja", "default file"),
            ("additional_chat_templates/tool_use.jinja", "tool file"),
        ])
        .unwrap();
        assert_eq!((render_with(&t, false), render_with(&t, true)), ("default file".into(), "tool file".into()));
        let list =
            r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#;
        let t = load(&[("tokenizer_config.json", list)]).unwrap();
        assert_eq!((render_with(&t, false), render_with(&t, true)), ("D".into(), "T".into()));
        let no_default = r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#;
        assert_eq!(reason(load(&[("tokenizer_config.json", no_default)])), "no_template");
        assert_eq!(reason(load(&[("tokenizer_config.json", "{}")])), "no_template");
    }

    /// Models vLLM renders another way, and templates whose inputs are not known, refuse to load.
    #[test]
    fn models_vllm_renders_otherwise_are_refused_at_load() {
        let ok = ("tokenizer_config.json", r#"{"chat_template": "x", "bos_token": "<s>"}"#);
        assert_eq!(reason(load(&[ok, ("tekken.json", "{}")])), "mistral");
        assert_eq!(reason(load(&[ok, ("tokenizer.model.v3", "")])), "mistral");
        // gpt-oss renders through Harmony, whose vocabulary the folder must hold
        let gpt_oss = reason(load(&[ok, ("config.json", r#"{"model_type": "gpt_oss"}"#)]));
        assert!(gpt_oss.starts_with("error: reading ") && gpt_oss.contains("o200k_base.tiktoken"), "{gpt_oss}");
        assert_eq!(reason(load(&[ok, ("processor_config.json", "{}")])), "processor_template");
        let reads_unk = ("tokenizer_config.json", r#"{"chat_template": "{{ unk_token }}"}"#);
        assert_eq!(reason(load(&[reads_unk])), "special_token_unknown");
        let openai = (
            "tokenizer_config.json",
            r#"{"chat_template": "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"}"#,
        );
        assert_eq!(reason(load(&[openai])), "loaded");
        let uncertain = (
            "tokenizer_config.json",
            r#"{"chat_template": "{% for m in messages %}{% set c = m.content %}{% for p in c.contents %}{% endfor %}{% endfor %}"}"#,
        );
        assert_eq!(reason(load(&[uncertain])), "content_format_openai");
        // Gemma 3's image markers: not in the template context (transformers 5)
        let extra = (
            "tokenizer_config.json",
            r#"{"chat_template": "{{ bos_token }}", "bos_token": "<bos>", "extra_special_tokens": {"image_token": "<img>"}}"#,
        );
        let t = load(&[extra]).unwrap();
        assert_eq!(t.special_tokens(), [("bos_token".to_string(), "<bos>".to_string())]);
        let bad = ("tokenizer_config.json", r#"{"chat_template": "{% if %}"}"#);
        assert_eq!(reason(load(&[bad])), "template_feature");
        let mode = LoadOptions { tokenizer_mode: "deepseek_v32".into(), ..LoadOptions::default() };
        assert!(matches!(
            ChatTemplate::load(folder(&[ok]).path(), mode),
            Err(LoadError::Unsupported(Unsupported::TokenizerMode(_)))
        ));
        let hf = LoadOptions { tokenizer_mode: "hf".into(), ..LoadOptions::default() };
        assert!(ChatTemplate::load(folder(&[ok, ("tekken.json", "{}")]).path(), hf).is_ok());
        assert_eq!(reason(load(&[ok])), "loaded");
    }

    /// `--chat-template` replaces the folder's template (or names one of its named templates).
    #[test]
    fn the_server_chat_template_option_wins() {
        let files = [(
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "rag", "template": "R"}]}"#,
        )];
        let with = |t: &str| LoadOptions { chat_template: Some(t.into()), ..LoadOptions::default() };
        let t = ChatTemplate::load(folder(&files).path(), with("own {{ 1 }}")).unwrap();
        assert_eq!((render_with(&t, false), render_with(&t, true)), ("own 1".into(), "own 1".into()));
        let t = ChatTemplate::load(folder(&files).path(), with("rag")).unwrap();
        assert_eq!(render_with(&t, true), "R");
    }
}
