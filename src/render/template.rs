//! A model folder's chat template, loaded as transformers loads it, and rendered with
//! minijinja the way transformers' `render_jinja_template` renders it (jinja2 sandbox with
//! `trim_blocks`/`lstrip_blocks`, its `tojson`, `raise_exception`, `strftime_now`, Python
//! string methods). Knows nothing of vLLM's request preprocessing (`chat.rs` and
//! `message.rs` do that).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use super::harmony::Harmony;
use super::load::{LoadError, LoadOptions};
use super::pyjson::{self, DumpsOptions, PyValue, Writer};
use super::strftime::strftime;
use super::Unsupported;

/// The named special tokens transformers passes to every template (`special_tokens_map`).
const SPECIAL_TOKEN_NAMES: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Marks the error `raise_exception` returns, to tell it from a renderer limitation.
const RAISED: &str = "template raised: ";

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

/// How vLLM renders a model's chat requests: its chat template, or (gpt-oss) Harmony.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renderer {
    Template,
    Harmony,
}

/// Refuses a model vLLM renders without its chat template in a way not done here: a
/// tokenizer mode other than auto/hf, Mistral (mistral-common), or a processor (multimodal)
/// template, which vLLM prefers when there are no tools; gpt-oss is rendered by Harmony.
fn refuse_other_renderers(folder: &Path, options: &LoadOptions) -> Result<Renderer, LoadError> {
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

/// The context variable through which `tojson` counts the `NaN`s it writes in one render.
const NAN_SINK: &str = "__tokenonce_nan_sink";

#[derive(Debug, Default)]
struct NanSink(std::sync::atomic::AtomicUsize);

impl minijinja::value::Object for NanSink {}

fn classify(e: Error) -> Unsupported {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(me) = err.downcast_ref::<Error>() {
            if let Some(detail) = me.detail() {
                if let Some(msg) = detail.strip_prefix(RAISED) {
                    return Unsupported::TemplateRaised(msg.to_string());
                }
            }
        }
        cur = err.source();
    }
    Unsupported::TemplateFeature(format!("{e:#}"))
}

/// The statements of a template (`{% ... %}`), their whitespace controls trimmed.
fn statements(source: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let after = rest.get(open + 2..).unwrap_or_default();
        let end = after.find("%}").unwrap_or(after.len());
        out.push(
            after.get(..end).unwrap_or_default().trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()),
        );
        rest = after.get(end..).unwrap_or_default();
    }
    out
}

/// A `for` statement's target and iterated expression.
fn for_loop(statement: &str) -> Option<(&str, &str)> {
    let (target, iter) = statement.strip_prefix("for ")?.split_once(" in ")?;
    Some((target.trim(), iter.trim()))
}

/// How vLLM's `_detect_content_format` reads the template: `Some(true)` for "openai" when
/// it certainly says so (a `for` over `M['content']` or `M.content`, `M` the target of a
/// loop over `messages` or a name set from it, e.g. `loop_messages = messages[1:]`),
/// `Some(false)` for "string" when no loop iterates anything named like content nor a macro's
/// parameter, `None` when only vLLM's AST walk can tell (that one is refused).
fn content_format_is_openai(source: &str) -> Option<bool> {
    let statements = statements(source);
    let loops: Vec<(&str, &str)> = statements.iter().filter_map(|s| for_loop(s)).collect();
    // a macro may be handed a message's content under another name; vLLM follows the calls
    let macro_params: Vec<&str> = statements
        .iter()
        .filter_map(|s| s.strip_prefix("macro ")?.split_once('(')?.1.split_once(')'))
        .flat_map(|(params, _)| params.split(',').map(|p| p.split('=').next().unwrap_or_default().trim()))
        .collect();
    if loops.iter().any(|(_, iter)| macro_params.contains(iter)) {
        return None;
    }
    if !loops.iter().any(|(_, iter)| iter.contains("content")) {
        return Some(false);
    }
    // names holding the messages: `messages`, and those set from it (a slice at most)
    let mut lists = vec!["messages"];
    for s in &statements {
        if let Some((name, value)) = s.strip_prefix("set ").and_then(|a| a.split_once('=')) {
            let (name, value) = (name.trim(), value.trim());
            let base = value.split('[').next().unwrap_or_default().trim();
            if lists.contains(&base) && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                lists.push(name);
            }
        }
    }
    let messages: Vec<&str> = loops
        .iter()
        .filter(|(target, iter)| {
            lists.contains(&iter.split('[').next().unwrap_or_default().trim())
                && target.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
        .map(|(target, _)| *target)
        .collect();
    let over_content = loops.iter().any(|(_, iter)| {
        messages.iter().any(|m| *iter == format!("{m}['content']") || *iter == format!("{m}.content"))
    });
    over_content.then_some(true)
}

/// The environment transformers' `_compile_jinja_template` sets up, in minijinja.
fn new_environment() -> Result<Environment<'static>, LoadError> {
    let mut env = Environment::new();
    let mut syntax = minijinja::syntax::SyntaxConfig::builder();
    syntax.trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false);
    let config = syntax.build().map_err(|e| LoadError::Unsupported(Unsupported::TemplateFeature(e.to_string())))?;
    env.set_syntax(config);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(python_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", |v: &Value, chars: Option<&str>| py_strip(&py_str(v), chars, true, true));
    // A float is printed as Python's str() prints it (1e+16, not 10000000000000000.0).
    env.set_formatter(|out, state, value| {
        if value.kind() == ValueKind::Number && !value.is_integer() {
            out.write_str(&py_str(value)).map_err(|_| Error::new(ErrorKind::WriteFailure, "formatter"))
        } else {
            minijinja::escape_formatter(out, state, value)
        }
    });
    // jinja2's floor/ceil rounding divides, so it gives a float even for an int.
    env.add_filter(
        "round",
        |value: Value, precision: Option<i32>, method: Option<&str>, kwargs: Kwargs| -> Result<Value, Error> {
            let directed = matches!(method, Some("ceil" | "floor"))
                || matches!(kwargs.get::<Option<&str>>("method"), Ok(Some("ceil" | "floor")));
            let rounded = minijinja::filters::round(value, precision, method, kwargs)?;
            if directed && rounded.is_integer() {
                let f = i128::try_from(rounded.clone()).map(|i| i as f64).unwrap_or(f64::NAN);
                return Ok(Value::from(f));
            }
            Ok(rounded)
        },
    );
    // jinja2's tests are Python's: None is not iterable; strings and dicts are sequences.
    env.add_test("iterable", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
                | ValueKind::Undefined
        )
    });
    env.add_test("sequence", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map | ValueKind::Undefined
        )
    });
    env.add_function("raise_exception", |msg: Value| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
    });
    Ok(env)
}

/// Python's `str(x)` of a template value as jinja2's `soft_str` gives it (undefined is "").
fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Number if !v.is_integer() => match f64::try_from(v.clone()) {
            Ok(f) if f.is_nan() => "nan".into(),
            Ok(f) if f.is_infinite() => (if f > 0.0 { "inf" } else { "-inf" }).into(),
            Ok(f) => pyjson::float_repr(f),
            Err(_) => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// Python's `str.isspace()` characters (Rust's `char::is_whitespace` lacks U+001C-U+001F).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let test = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(test);
    }
    if right {
        out = out.trim_end_matches(test);
    }
    out.to_string()
}

/// Python's string methods: `strip`/`lstrip`/`rstrip` with Python's whitespace, and
/// `split()` without a separator; the rest from minijinja-contrib's pycompat.
fn python_methods(state: &mut State<'_, '_>, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let strip = match method {
            "strip" => Some((true, true)),
            "lstrip" => Some((true, false)),
            "rstrip" => Some((false, true)),
            _ => None,
        };
        if let Some((left, right)) = strip {
            let chars: Option<Value> = match args {
                [] => None,
                [a] => Some(a.clone()),
                _ => return Err(Error::new(ErrorKind::TooManyArguments, "strip takes one argument")),
            };
            return match chars {
                None => Ok(Value::from(py_strip(s, None, left, right))),
                Some(c) if c.is_none() => Ok(Value::from(py_strip(s, None, left, right))),
                Some(c) => match c.as_str() {
                    Some(set) => Ok(Value::from(py_strip(s, Some(set), left, right))),
                    None => Err(Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str")),
                },
            };
        }
        if method == "split" && (args.is_empty() || args.first().is_some_and(Value::is_none)) && args.len() <= 1 {
            return Ok(s.split(py_space).filter(|p| !p.is_empty()).map(Value::from).collect());
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`; positional arguments in that order.
fn tojson(state: &State, value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = DumpsOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut given: Vec<(&str, Value)> = Vec::new();
    for (i, v) in args.iter().enumerate() {
        let name =
            names.get(i).ok_or_else(|| Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"))?;
        given.push((name, v.clone()));
    }
    for name in names {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            given.push((name, v));
        }
    }
    kwargs.assert_all_used()?;
    for (name, v) in given {
        match name {
            "ensure_ascii" => opts.ensure_ascii = v.is_true(),
            "sort_keys" => opts.sort_keys = v.is_true(),
            "indent" => {
                opts.indent = if v.is_none() {
                    None
                } else if let Some(s) = v.as_str() {
                    Some(s.to_string())
                } else if v.is_integer() {
                    let n = v.as_i64().unwrap_or(0).max(0);
                    Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
                } else {
                    return Err(Error::new(ErrorKind::InvalidOperation, "indent must be an int or str"));
                }
            }
            _ => {
                // separators: a 2-sequence of strings
                if v.is_none() {
                    opts.separators = None;
                } else {
                    let parts: Vec<Value> = v.try_iter()?.collect();
                    match parts.as_slice() {
                        [a, b] => match (a.as_str(), b.as_str()) {
                            (Some(a), Some(b)) => opts.separators = Some((a.to_string(), b.to_string())),
                            _ => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be strings")),
                        },
                        _ => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
                    }
                }
            }
        }
    }
    let mut w = Writer::new(&opts);
    let mut nans = 0;
    dump_value(&mut w, value, 0, &mut nans)?;
    if nans > 0 {
        if let Some(sink) = state.lookup(NAN_SINK).and_then(|v| v.downcast_object::<NanSink>()) {
            sink.0.fetch_add(nans, Ordering::Relaxed);
        }
    }
    Ok(Value::from(w.out))
}

fn dump_value(w: &mut Writer<'_>, v: &Value, level: usize, nans: &mut usize) -> Result<(), Error> {
    let unsupported = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson of {what}"));
    match v.kind() {
        ValueKind::None => w.raw("null"),
        ValueKind::Bool => w.raw(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(PyFloat(f)) = as_float(v) {
                if f.is_nan() {
                    *nans += 1;
                }
                w.raw(&pyjson::float_repr(f));
            } else {
                // integers: minijinja prints them in decimal, as Python does
                w.raw(&v.to_string());
            }
        }
        ValueKind::String => w.str(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            w.list(items.len(), level, |w, i, l| match items.get(i) {
                Some(x) => dump_value(w, x, l, nans),
                None => Ok(()),
            })?;
        }
        ValueKind::Map => {
            let mut keys = Vec::new();
            let mut values = Vec::new();
            for k in v.try_iter()? {
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    _ => return Err(unsupported("a non-string key")),
                };
                values.push(v.get_item(&k)?);
                keys.push(key);
            }
            w.dict(&keys, level, |w, i, l| match values.get(i) {
                Some(x) => dump_value(w, x, l, nans),
                None => Ok(()),
            })?;
        }
        ValueKind::Undefined => return Err(unsupported("Undefined")),
        _ => return Err(unsupported("this value")),
    }
    Ok(())
}

struct PyFloat(f64);

/// The float inside a number value (integers are `None`).
fn as_float(v: &Value) -> Option<PyFloat> {
    if v.is_integer() {
        return None;
    }
    f64::try_from(v.clone()).ok().map(PyFloat)
}

/// `datetime.now().strftime(format)` with the UTC clock and glibc's common directives.
fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(format, i64::try_from(secs).unwrap_or(0))
}

/// A [`PyValue`] as a template value.
///
/// # Errors
/// [`Unsupported::BigInteger`] for an integer beyond 128 bits.
pub(crate) fn to_value(v: &PyValue) -> Result<Value, Unsupported> {
    Ok(match v {
        PyValue::Null => Value::from(()),
        PyValue::Bool(b) => Value::from(*b),
        PyValue::Int(d) => match d.parse::<i64>() {
            Ok(i) => Value::from(i),
            Err(_) => Value::from(d.parse::<i128>().map_err(|_| Unsupported::BigInteger)?),
        },
        PyValue::Float(f) => Value::from(*f),
        PyValue::Str(s) => Value::from(s.as_str()),
        PyValue::List(items) => Value::from(items.iter().map(to_value).collect::<Result<Vec<_>, _>>()?),
        PyValue::Dict(items) => {
            let mut map: indexmap::IndexMap<Value, Value> = indexmap::IndexMap::new();
            for (k, x) in items {
                map.insert(Value::from(k.as_str()), to_value(x)?);
            }
            Value::from(map)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: &[(&str, PyValue)]) -> Result<String, Unsupported> {
        let t = ChatTemplate::from_source(src, &[("eos_token", "<|im_end|>")], LoadOptions::default()).map_err(
            |e| match e {
                LoadError::Unsupported(u) => u,
                other => Unsupported::TemplateFeature(other.to_string()),
            },
        )?;
        let ctx = ctx.iter().map(|(k, v)| ((*k).to_string(), to_value(v).unwrap())).collect();
        t.render(false, ctx).map(|r| r.text)
    }

    fn j(s: &str) -> PyValue {
        pyjson::loads(s).unwrap()
    }

    #[test]
    fn tojson_is_transformers_json_dumps() {
        let x = j(r#"{"b": [1, 2.50, 1e16, "<&>'é"], "a": null, "c": true}"#);
        assert_eq!(
            render("{{ x | tojson }}", &[("x", x.clone())]).unwrap(),
            r#"{"b": [1, 2.5, 1e+16, "<&>'é"], "a": null, "c": true}"#
        );
        assert_eq!(render("{{ x | tojson(indent=2) }}", &[("x", j("[1]"))]).unwrap(), "[\n  1\n]");
        assert_eq!(
            render("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", &[("x", x)]).unwrap(),
            r#"{"a":null,"b":[1,2.5,1e+16,"<&>'é"],"c":true}"#
        );
        assert_eq!(render("{{ 'é' | tojson(ensure_ascii=true) }}", &[]).unwrap(), r#""\u00e9""#);
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_sets_jinja() {
        let src = "{% for m in ms %}\n  {% if m %}\n[{{ m }}]\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(render(src, &[("ms", j("[1, 2]"))]).unwrap(), "[1]\n[2]\n");
    }

    #[test]
    fn special_tokens_and_python_methods_are_available() {
        let src = "{{ eos_token }}|{{ s.strip() }}|{{ s.lstrip('\\x1c ') }}|{{ s.split() | length }}|{{ s.startswith('\\x1c') }}";
        assert_eq!(
            render(src, &[("s", PyValue::Str("\u{1c} a b \u{1c}".into()))]).unwrap(),
            "<|im_end|>|a b|a b \u{1c}|2|True"
        );
    }

    /// jinja2 prints containers with Python's repr; so does minijinja (strings in single quotes).
    #[test]
    fn containers_print_as_python_repr() {
        let src = r#"{{ [1, "a", none, true, 1.5] }}|{{ {"k": "it's", "n": {"x": []}} }}|{{ undefined_name }}|{{ x }}"#;
        assert_eq!(
            render(src, &[("x", j(r#"{"q": "a\"b"}"#))]).unwrap(),
            r#"[1, 'a', None, True, 1.5]|{'k': "it's", 'n': {'x': []}}||{'q': 'a"b'}"#
        );
    }

    /// `is iterable` / `is sequence` as jinja2 answers them (minijinja counts none as iterable).
    #[test]
    fn iterable_and_sequence_tests_follow_python() {
        let src = "{{ n is iterable }} {{ s is iterable }} {{ l is iterable }} {{ d is iterable }} {{ i is iterable }} {{ u is iterable }}|{{ s is sequence }} {{ d is sequence }} {{ n is sequence }} {{ i is sequence }}";
        let ctx = [("n", PyValue::Null), ("s", j(r#""x""#)), ("l", j("[1]")), ("d", j("{}")), ("i", j("3"))];
        assert_eq!(render(src, &ctx).unwrap(), "False True True True False True|True True False False");
        assert_eq!(render("{{ ' xax ' | trim(' x') }}", &[]).unwrap(), "a");
        assert_eq!(
            render("[{{ nothing | trim }}][{{ 1e20 | trim }}][{{ none | trim }}]", &[]).unwrap(),
            "[][1e+20][None]"
        );
    }

    #[test]
    fn raise_exception_is_its_own_outcome() {
        assert_eq!(
            render("{{ raise_exception('no system') }}", &[]),
            Err(Unsupported::TemplateRaised("no system".into()))
        );
        assert!(matches!(render("{{ x.nomethod() }}", &[("x", j("1"))]), Err(Unsupported::TemplateFeature(_))));
    }

    #[test]
    fn a_template_looping_over_content_is_openai_format() {
        let openai = "{% for message in messages %}{% for part in message['content'] %}{% endfor %}{% endfor %}";
        assert_eq!(content_format_is_openai(openai), Some(true));
        let sliced = "{%- set loop_messages = messages[1:] -%}{%- for m in loop_messages -%}{%- for c in m.content -%}";
        assert_eq!(content_format_is_openai(sliced), Some(true));
        let string = "{% for message in messages %}{{ message.content }}{% endfor %}";
        assert_eq!(content_format_is_openai(string), Some(false));
        // a loop over something content-like that is not a message's content: only vLLM's AST walk knows
        assert_eq!(content_format_is_openai("{% for c in contents %}{% endfor %}"), None);
        assert_eq!(content_format_is_openai("{# for x in content #}{{ 'for a in content' }}"), Some(false));
        // a macro looping over its parameter may be handed message.content
        let in_macro = "{% macro parts(c, sep='') %}{% for p in c %}{% endfor %}{% endmacro %}";
        assert_eq!(content_format_is_openai(in_macro), None);
    }

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

    /// Pools share one template across worker threads.
    #[test]
    fn a_chat_template_is_send_and_sync() {
        fn shared<T: Send + Sync>() {}
        shared::<ChatTemplate>();
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j %-d %B %y %p %I", t).unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 29 February 24 PM 01"
        );
        assert!(strftime("%Z", t).is_err());
    }
}
