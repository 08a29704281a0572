//! A chat request turned into ids as vLLM 0.32 does in its Mistral tokenizer mode, without a
//! template: vLLM's own steps, then mistral-common 1.13's request conversion, validator,
//! normalizer and v3 instruct encoding over tekken (other tokenizer versions refused at load).

use std::path::Path;
use std::sync::Arc;

use super::mistral_tools::{parse_tools, valid_name};
use super::pyjson::{self, DumpsOptions, PyValue};
use super::request::{body, check_tool_choice, flag, is_set, refuse_unrendered_fields, render_completion};
use super::tekken::{Tekken, TekkenError, TEKKEN_FILE};
use super::{LoadError, LoadOptions, Shape, Unsupported};

/// Whether vLLM's `tokenizer_mode=auto` takes a folder as Mistral's: a `tekken.json` or a
/// sentencepiece `tokenizer.model.v*` in it.
pub fn is_mistral_folder(folder: &Path) -> bool {
    folder.join(TEKKEN_FILE).exists()
        || std::fs::read_dir(folder).is_ok_and(|entries| {
            entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with("tokenizer.model.v"))
        })
}

/// What separates merged messages, and text parts of one message (`_DEFAULT_JOIN_STR`).
const JOIN: &str = "\n\n";

/// Why a Mistral folder gives no renderer.
#[derive(Debug, thiserror::Error)]
pub enum MistralLoadError {
    /// The tokenizer file does not load.
    #[error(transparent)]
    Tekken(#[from] TekkenError),
    /// A tokenizer version whose instruct encoding is not written here.
    #[error("Mistral tokenizer version {0} (only v3 is rendered here)")]
    Version(String),
    /// The file lacks a control token the v3 encoding uses.
    #[error("tekken.json has no special token {0}")]
    MissingToken(&'static str),
}

/// The control tokens of the v3 instruct encoding.
#[derive(Debug, Clone, Copy)]
struct Controls {
    bos: u32,
    eos: u32,
    inst: u32,
    inst_end: u32,
    tools: u32,
    tools_end: u32,
    results: u32,
    results_end: u32,
    calls: u32,
}

/// One pool's Mistral renderer: its tekken tokenizer and control tokens.
#[derive(Debug)]
pub struct Mistral {
    tekken: Arc<Tekken>,
    controls: Controls,
}

impl Mistral {
    /// The Mistral renderer of `folder` when vLLM would serve it in its Mistral tokenizer
    /// mode (`--tokenizer-mode` auto or mistral, and a `tekken.json` or a
    /// `tokenizer.model.v*`); `None` when it renders through a chat template.
    ///
    /// # Errors
    /// [`LoadError::Unsupported`] ([`Unsupported::Mistral`]) for a Mistral folder rendered
    /// otherwise than here (sentencepiece, a tekken version other than v3);
    /// [`LoadError::Config`] when its `tekken.json` does not load. `loaded` is the folder's
    /// tekken when the caller has it already (the pool's tokenizer).
    pub fn for_folder(
        folder: &Path,
        options: &LoadOptions,
        loaded: Option<&Arc<Tekken>>,
    ) -> Option<Result<Self, LoadError>> {
        if !matches!(options.tokenizer_mode.as_str(), "" | "auto" | "mistral") || !is_mistral_folder(folder) {
            return None;
        }
        let mistral = match loaded {
            Some(tekken) => Self::new(Arc::clone(tekken)),
            None => Self::load(folder),
        };
        Some(mistral.map_err(|e| match e {
            MistralLoadError::Tekken(e) => LoadError::Config { path: TEKKEN_FILE.into(), reason: e.to_string() },
            MistralLoadError::Version(_) | MistralLoadError::MissingToken(_) => {
                LoadError::Unsupported(Unsupported::Mistral)
            }
        }))
    }

    /// Loads the `tekken.json` of the model folder `folder`.
    ///
    /// # Errors
    /// [`MistralLoadError`]: unreadable, or a version not rendered here.
    pub fn load(folder: &Path) -> Result<Self, MistralLoadError> {
        Self::new(Arc::new(Tekken::load(&folder.join(TEKKEN_FILE))?))
    }

    /// The renderer over a loaded tekken tokenizer.
    ///
    /// # Errors
    /// [`MistralLoadError`]: a version not rendered here, or a control token missing.
    pub fn new(tekken: Arc<Tekken>) -> Result<Self, MistralLoadError> {
        if tekken.version() != "v3" {
            return Err(MistralLoadError::Version(tekken.version().to_owned()));
        }
        let id = |name: &'static str| tekken.special(name).ok_or(MistralLoadError::MissingToken(name));
        let controls = Controls {
            bos: id("<s>")?,
            eos: id("</s>")?,
            inst: id("[INST]")?,
            inst_end: id("[/INST]")?,
            tools: id("[AVAILABLE_TOOLS]")?,
            tools_end: id("[/AVAILABLE_TOOLS]")?,
            results: id("[TOOL_RESULTS]")?,
            results_end: id("[/TOOL_RESULTS]")?,
            calls: id("[TOOL_CALLS]")?,
        };
        Ok(Self { tekken, controls })
    }

    /// The tekken tokenizer.
    pub fn tekken(&self) -> &Tekken {
        &self.tekken
    }

    /// True when `other` was loaded from the same tokenizer file contents.
    pub fn same_as(&self, other: &Self) -> bool {
        self.tekken.fingerprint() == other.tekken.fingerprint()
    }

    /// The prompt ids of a chat completions body, and its shape: vLLM's own steps
    /// (`vllm/tokenizers/mistral.py`: tool-call ids cut to their last 9 characters, the
    /// last-message rules), then mistral-common 1.13's `ChatCompletionRequest.from_openai`,
    /// its test-mode validator, `InstructRequestNormalizer` (same-role runs merged, system
    /// prompts gathered) and `InstructTokenizerV3` over tekken, which is the instruct encoding
    /// a v3 `tekken.json` (Mistral Nemo's) gets.
    ///
    /// # Errors
    /// [`Unsupported`]: why the request must take the engine's own rendering.
    pub fn render_chat(&self, request: &[u8]) -> Result<(Vec<u32>, Shape), Unsupported> {
        let req = body(request)?;
        let settings = Settings::read(&req)?;
        let raw = match req.get("messages") {
            Some(PyValue::List(m)) if !m.is_empty() => m,
            _ => return Err(Unsupported::VllmRejects("messages missing, empty or not a list")),
        };
        let mut messages = raw.iter().map(parse_message).collect::<Result<Vec<_>, _>>()?;
        check_last_message(&messages, &settings)?;
        if settings.continue_final {
            if let Some(last) = messages.last_mut() {
                last.prefix = true;
            }
        }
        let tools = parse_tools(&req)?;
        validate(&messages)?;
        let shape = shape_of(&messages, !tools.is_empty(), settings.continue_final);
        let system_prompt = system_prompt(&messages);
        let normalized = normalize(&messages)?;
        let ids = self.encode(&normalized, system_prompt.as_deref(), &tools)?;
        Ok((ids, shape))
    }

    /// The prompt ids of a completions body as vLLM's Mistral tokenizer encodes it
    /// (`MistralTokenizer.__call__` -> transformers' `MistralCommonBackend._text_to_ids`):
    /// tekken's ids of the prompt, special-token text encoded as text, after `<s>` when
    /// `add_special_tokens` (default true), no `</s>` (vLLM's test validation mode).
    ///
    /// # Errors
    /// [`Unsupported`]: what [`render_completion`] refuses.
    pub fn render_completion(&self, request: &[u8]) -> Result<Vec<u32>, Unsupported> {
        let completion = render_completion(request)?;
        let mut ids = Vec::with_capacity(completion.text.len() / 3 + 1);
        if completion.add_special_tokens {
            ids.push(self.controls.bos);
        }
        ids.extend(self.text(&completion.text)?);
        Ok(ids)
    }

    /// `InstructTokenizerV3.encode_instruct` of a normalized request.
    fn encode(
        &self,
        messages: &[Turn],
        system_prompt: Option<&str>,
        tools: &[PyValue],
    ) -> Result<Vec<u32>, Unsupported> {
        let c = self.controls;
        let last_user = messages.iter().rposition(|m| matches!(m, Turn::User(_)));
        let mut ids = vec![c.bos];
        for (i, turn) in messages.iter().enumerate() {
            match turn {
                Turn::User(content) => {
                    let is_last = Some(i) == last_user;
                    if is_last && !tools.is_empty() {
                        ids.push(c.tools);
                        ids.extend(self.text(&dumps(&PyValue::List(tools.to_vec())))?);
                        ids.push(c.tools_end);
                    }
                    ids.push(c.inst);
                    // an empty system prompt is Python-false: nothing is added
                    match system_prompt {
                        Some(system) if is_last && !system.is_empty() => {
                            ids.extend(self.text(&format!("{system}{JOIN}{content}"))?);
                        }
                        _ => ids.extend(self.text(content)?),
                    }
                    ids.push(c.inst_end);
                }
                Turn::Assistant { content, calls, prefix } => {
                    // a merged run may hold both, or only empty text parts: v3 raises
                    if calls.is_empty() == content.is_empty() {
                        return Err(Unsupported::VllmRejects(
                            "assistant turn with both or neither content and tool calls",
                        ));
                    }
                    if calls.is_empty() {
                        ids.extend(self.text(content.trim_end_matches(' '))?);
                    } else {
                        let calls = calls.iter().map(Call::prepared).collect::<Result<Vec<_>, _>>()?;
                        ids.push(c.calls);
                        ids.extend(self.text(&dumps(&PyValue::List(calls)))?);
                    }
                    if !prefix {
                        ids.push(c.eos);
                    }
                }
                Turn::Tool { content, call_id } => {
                    let result = PyValue::Dict(vec![
                        ("content".into(), parse_json_content(content)?),
                        ("call_id".into(), PyValue::Str(call_id.clone())),
                    ]);
                    ids.push(c.results);
                    ids.extend(self.text(&dumps(&result))?);
                    ids.push(c.results_end);
                }
            }
        }
        Ok(ids)
    }

    fn text(&self, text: &str) -> Result<Vec<u32>, Unsupported> {
        self.tekken.encode(text).map_err(|_| Unsupported::Unverified("tekken pattern failed on the text"))
    }
}

/// What the request asks of the render, read as vLLM validates it for Mistral.
struct Settings {
    add_generation_prompt: bool,
    continue_final: bool,
}

impl Settings {
    fn read(req: &PyValue) -> Result<Self, Unsupported> {
        // vLLM's `validate_request_params`: no template of any kind with Mistral
        if is_set(req, "chat_template") || is_set(req, "chat_template_kwargs") {
            return Err(Unsupported::VllmRejects("chat_template with a Mistral tokenizer"));
        }
        refuse_unrendered_fields(req)?;
        if is_set(req, "reasoning_effort") {
            return Err(Unsupported::Unverified("reasoning_effort with a Mistral tokenizer"));
        }
        // vLLM validates the choice for every family (`check_tool_usage`); whichever it is,
        // the Mistral render never reads it (`apply_chat_template` gets messages and tools):
        // "required" and a named tool only constrain decoding, so the ids are auto's.
        check_tool_choice(req)?;
        let add_generation_prompt = flag(req, "add_generation_prompt", true)?;
        let continue_final = flag(req, "continue_final_message", false)?;
        if continue_final && add_generation_prompt {
            return Err(Unsupported::VllmRejects("continue_final_message with add_generation_prompt"));
        }
        Ok(Self { add_generation_prompt, continue_final })
    }
}

/// A message's role as mistral-common converts it (`developer` is `system`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// A tool call as `ToolCall.from_openai` holds it (its id already cut by vLLM).
#[derive(Debug, Clone)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

impl Call {
    /// `InstructTokenizerV3._prepare_function_call` of the normalized call.
    fn prepared(&self) -> Result<PyValue, Unsupported> {
        let mut call = vec![
            ("name".to_owned(), PyValue::Str(self.name.clone())),
            ("arguments".to_owned(), parse_json_content(&normalize_json_content(&self.arguments)?)?),
        ];
        if !self.id.is_empty() && self.id != "null" {
            call.push(("id".to_owned(), PyValue::Str(self.id.clone())));
        }
        Ok(PyValue::Dict(call))
    }
}

/// One message as `ChatCompletionRequest.from_openai` gives it.
#[derive(Debug, Clone)]
struct Message {
    role: Role,
    /// `None`, a string, or text parts.
    content: Content,
    calls: Vec<Call>,
    tool_call_id: Option<String>,
    name: Option<String>,
    prefix: bool,
}

#[derive(Debug, Clone)]
enum Content {
    Null,
    Text(String),
    Parts(Vec<String>),
}

impl Content {
    /// Python's truthiness of the content (a non-empty list is true even of empty parts).
    fn truthy(&self) -> bool {
        match self {
            Content::Null => false,
            Content::Text(s) => !s.is_empty(),
            Content::Parts(p) => !p.is_empty(),
        }
    }
}

/// A message of the OpenAI body, as vLLM and `convert_openai_messages` read it.
fn parse_message(m: &PyValue) -> Result<Message, Unsupported> {
    let role = match m.get("role").and_then(PyValue::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some("system" | "developer") => Role::System,
        _ => return Err(Unsupported::VllmRejects("unknown message role")),
    };
    let content = parse_content(m.get("content"))?;
    if matches!(content, Content::Null) && role != Role::Assistant {
        return Err(Unsupported::VllmRejects("null content"));
    }
    let mut message = Message { role, content, calls: Vec::new(), tool_call_id: None, name: None, prefix: false };
    match role {
        Role::Assistant => {
            for key in ["reasoning", "reasoning_content"] {
                if is_set(m, key) {
                    // a ThinkChunk, which v3's validator refuses
                    return Err(Unsupported::VllmRejects("reasoning in an assistant message"));
                }
            }
            if is_set(m, "prefix") {
                return Err(Unverified("assistant prefix field"));
            }
            message.calls = match m.get("tool_calls") {
                None | Some(PyValue::Null) => Vec::new(),
                Some(PyValue::List(calls)) => calls.iter().map(parse_call).collect::<Result<_, _>>()?,
                Some(_) => return Err(Unsupported::VllmRejects("tool_calls not a list")),
            };
        }
        Role::Tool => {
            message.tool_call_id = match m.get("tool_call_id") {
                Some(PyValue::Str(id)) => Some(last_nine(id)),
                _ => return Err(Unsupported::VllmRejects("tool message without a string tool_call_id")),
            };
            message.name = match m.get("name") {
                None | Some(PyValue::Null) => None,
                Some(PyValue::Str(name)) => Some(name.clone()),
                Some(_) => return Err(Unverified("tool message name not a string")),
            };
        }
        Role::System | Role::User => {}
    }
    Ok(message)
}

use Unsupported::Unverified;

/// Content as a string, `null`, or a list of `{"type": "text", "text": ...}` parts.
fn parse_content(content: Option<&PyValue>) -> Result<Content, Unsupported> {
    match content {
        None | Some(PyValue::Null) => Ok(Content::Null),
        Some(PyValue::Str(s)) => Ok(Content::Text(s.clone())),
        Some(PyValue::List(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let PyValue::Dict(fields) = part else { return Err(Unverified("content part not an object")) };
                match (part.get("type").and_then(PyValue::as_str), part.get("text")) {
                    (Some("text"), Some(PyValue::Str(text))) if fields.len() == 2 => texts.push(text.clone()),
                    (Some("image_url" | "input_audio" | "audio_url" | "video_url" | "image"), _) => {
                        return Err(Unsupported::Media)
                    }
                    _ => return Err(Unverified("content part other than plain text")),
                }
            }
            Ok(Content::Parts(texts))
        }
        Some(_) => Err(Unsupported::VllmRejects("content neither a string nor a list")),
    }
}

/// A tool call of the body (`ToolCall.from_openai`, after vLLM cut its id).
fn parse_call(call: &PyValue) -> Result<Call, Unsupported> {
    // OpenAI's schema requires the type; whether vLLM's pydantic defaults it is not checked
    if call.get("type").and_then(PyValue::as_str) != Some("function") {
        return Err(Unverified("tool call type missing or not function"));
    }
    let id = match call.get("id") {
        Some(PyValue::Str(id)) => last_nine(id),
        _ => return Err(Unsupported::VllmRejects("tool call without a string id")),
    };
    let function = call.get("function").ok_or(Unsupported::VllmRejects("tool call without a function"))?;
    let name = match function.get("name") {
        Some(PyValue::Str(name)) => name.clone(),
        _ => return Err(Unsupported::VllmRejects("tool call without a function name")),
    };
    let arguments = match function.get("arguments") {
        Some(PyValue::Str(arguments)) => arguments.clone(),
        _ => return Err(Unverified("tool call arguments not a string")),
    };
    Ok(Call { id, name, arguments })
}

/// vLLM's `truncate_tool_call_ids`: an id longer than 9 characters keeps its last 9.
fn last_nine(id: &str) -> String {
    let chars = id.chars().count();
    id.chars().skip(chars.saturating_sub(9)).collect()
}

/// vLLM's `_validate_apply_chat_template_args`, and mistral-common's refusal of a
/// conversation that ends with an assistant turn it is not to continue.
fn check_last_message(messages: &[Message], settings: &Settings) -> Result<(), Unsupported> {
    let last_is_assistant = messages.last().is_some_and(|m| m.role == Role::Assistant);
    if settings.add_generation_prompt && last_is_assistant {
        return Err(Unsupported::VllmRejects("generation prompt after an assistant message"));
    }
    if settings.continue_final && !last_is_assistant {
        return Err(Unsupported::VllmRejects("continue_final_message without a final assistant message"));
    }
    Ok(())
}

/// v3's tool-call id: `^[a-zA-Z0-9]{9}$`.
fn valid_call_id(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// `MistralRequestValidatorV3` in test mode (`vllm` builds the tokenizer so).
fn validate(messages: &[Message]) -> Result<(), Unsupported> {
    let rejects = Unsupported::VllmRejects;
    match messages {
        [] => return Err(rejects("no messages")),
        [only] if !matches!(only.role, Role::User | Role::System) => {
            return Err(rejects("a lone message that is not user or system"));
        }
        [_] => {}
        // mistral-common refuses only a last assistant turn it is not to continue
        [.., last] if last.role == Role::Assistant && !last.prefix => {
            return Err(rejects("last message an assistant turn not to continue"));
        }
        [..] => {}
    }
    // message order
    for (before, after) in messages.iter().zip(messages.iter().skip(1)) {
        let allowed = match before.role {
            Role::System => matches!(after.role, Role::User | Role::Assistant | Role::System),
            Role::User => matches!(after.role, Role::Assistant | Role::System | Role::User),
            Role::Assistant | Role::Tool => matches!(after.role, Role::Assistant | Role::User | Role::Tool),
        };
        if !allowed {
            return Err(rejects("unexpected role order"));
        }
    }
    // tool calls followed by as many tool messages, counted at each assistant turn
    let mut expected: i64 = 0;
    for m in messages.iter().skip(1) {
        match m.role {
            Role::Tool => expected -= 1,
            Role::Assistant => {
                if expected != 0 {
                    return Err(rejects("not the same number of function calls and responses"));
                }
                expected = i64::try_from(m.calls.len()).unwrap_or(i64::MAX);
            }
            Role::User | Role::System => {}
        }
    }
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::Assistant => {
                let has_calls = !m.calls.is_empty();
                if m.content.truthy() == has_calls {
                    return Err(rejects("assistant message needs content or tool calls, not both"));
                }
                for call in &m.calls {
                    if !valid_call_id(&call.id) {
                        return Err(rejects("tool call id not 9 letters or digits"));
                    }
                    if !valid_name(&call.name) {
                        return Err(rejects("function name not [a-zA-Z0-9_-]{1,64}"));
                    }
                }
                if m.prefix && i + 1 != messages.len() {
                    return Err(rejects("prefix assistant message not last"));
                }
            }
            Role::Tool => {
                if m.name.as_deref().is_some_and(|n| !valid_name(n)) {
                    return Err(rejects("tool message name not [a-zA-Z0-9_-]{1,64}"));
                }
                if !m.tool_call_id.as_deref().is_some_and(valid_call_id) {
                    return Err(rejects("tool call id not 9 letters or digits"));
                }
            }
            Role::System | Role::User => {}
        }
    }
    Ok(())
}

/// A normalized message (`InstructRequest.messages`): text only, runs merged.
#[derive(Debug, Clone)]
enum Turn {
    User(String),
    Assistant { content: String, calls: Vec<Call>, prefix: bool },
    Tool { content: String, call_id: String },
}

/// `_aggregate_content_chunks_impl` over text-only contents: empty ones skipped, messages
/// and parts joined by `\n\n`.
fn aggregate<'a>(contents: impl IntoIterator<Item = &'a Content>) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for content in contents {
        match content {
            Content::Null => {}
            Content::Text(s) => parts.push(s),
            Content::Parts(texts) => parts.extend(texts.iter().map(String::as_str)),
        }
    }
    let parts: Vec<&str> = parts.into_iter().filter(|s| !s.is_empty()).collect();
    parts.join(JOIN)
}

/// `_aggregate_system_prompts`: every non-empty system message, joined.
fn system_prompt(messages: &[Message]) -> Option<String> {
    let prompts: Vec<String> = messages
        .iter()
        .filter(|m| m.role == Role::System && m.content.truthy())
        .map(|m| aggregate([&m.content]))
        .collect();
    (!prompts.is_empty()).then(|| prompts.join(JOIN))
}

/// `_aggregate_messages`: runs of one role merged (system runs dropped, tool messages kept
/// one by one), and an empty user turn first when the first is not a user's.
fn normalize(messages: &[Message]) -> Result<Vec<Turn>, Unsupported> {
    let mut turns = Vec::new();
    for run in messages.chunk_by(|a, b| a.role == b.role) {
        let Some(first) = run.first() else { continue };
        match first.role {
            Role::System => {}
            Role::User => turns.push(Turn::User(aggregate(run.iter().map(|m| &m.content)))),
            Role::Assistant => turns.push(Turn::Assistant {
                content: aggregate(run.iter().map(|m| &m.content)),
                calls: run.iter().flat_map(|m| m.calls.iter().cloned()).collect(),
                prefix: run.iter().any(|m| m.prefix),
            }),
            Role::Tool => {
                for m in run {
                    let content = normalize_json_content(&aggregate([&m.content]))?;
                    turns.push(Turn::Tool { content, call_id: m.tool_call_id.clone().unwrap_or_default() });
                }
            }
        }
    }
    if !matches!(turns.first(), Some(Turn::User(_))) {
        turns.insert(0, Turn::User(String::new()));
    }
    Ok(turns)
}

/// `_normalize_json_content`: empty is `{}`, JSON is written again, other text kept.
fn normalize_json_content(content: &str) -> Result<String, Unsupported> {
    if content.is_empty() {
        return Ok("{}".to_owned());
    }
    Ok(loads_json(content)?.map_or_else(|| content.to_owned(), |value| dumps(&value)))
}

/// `_parse_json_content`: the JSON value of the text, or the text itself where Python's
/// `json.loads` raises (what it reads but is not carried here is refused).
fn parse_json_content(content: &str) -> Result<PyValue, Unsupported> {
    Ok(loads_json(content)?.unwrap_or_else(|| PyValue::Str(content.to_owned())))
}

/// `json.loads(text)`: `None` where Python raises `JSONDecodeError`; what Python reads but
/// is not carried here (a lone surrogate, a huge integer) is refused.
fn loads_json(text: &str) -> Result<Option<PyValue>, Unsupported> {
    match pyjson::loads(text) {
        Ok(value) => Ok(Some(value)),
        Err(pyjson::LoadsError::Invalid(_)) => Ok(None),
        Err(_) => Err(Unverified("JSON content Python reads but is not carried here")),
    }
}

/// `json.dumps(value, ensure_ascii=False)`.
fn dumps(value: &PyValue) -> String {
    pyjson::dumps(value, &DumpsOptions { ensure_ascii: false, ..DumpsOptions::default() })
}

/// The request shape, as the issue counts it.
fn shape_of(messages: &[Message], tools: bool, continue_final: bool) -> Shape {
    Shape {
        system: messages.iter().any(|m| m.role == Role::System),
        multi_turn: messages.iter().filter(|m| m.role == Role::User).count() > 1,
        tools,
        tool_calls: messages.iter().any(|m| !m.calls.is_empty()),
        tool_results: messages.iter().any(|m| m.role == Role::Tool),
        thinking: None,
        continue_final,
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A small Mistral folder written to a temporary directory.

    use base64::Engine;

    use super::*;

    /// A v3 tekken folder over a byte-level vocabulary (every byte its own token, no merges)
    /// and mistral-common's default special tokens, with its renderer.
    pub(crate) fn folder() -> (tempfile::TempDir, Mistral) {
        let engine = base64::engine::general_purpose::STANDARD;
        let vocab: Vec<String> = (0u8..=255)
            .map(|b| format!("{{\"rank\":{b},\"token_bytes\":\"{}\",\"token_str\":null}}", engine.encode([b])))
            .collect();
        let text = format!(
            "{{\"config\":{{\"pattern\":\"(?s).\",\"num_vocab_tokens\":256,\"default_vocab_size\":1256,\
             \"default_num_special_tokens\":1000,\"version\":\"v3\"}},\"vocab\":[{}]}}",
            vocab.join(",")
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TEKKEN_FILE), text).unwrap();
        let mistral = Mistral::load(dir.path()).unwrap();
        (dir, mistral)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::folder;
    use super::*;

    /// The request's prompt as text, control tokens by name.
    fn render(mistral: &Mistral, body: &str) -> Result<String, &'static str> {
        let (ids, _) = mistral.render_chat(body.as_bytes()).map_err(|e| e.label())?;
        Ok(mistral.tekken().decode_lossy(&ids))
    }

    /// mistral-common's normalizer: same-role runs joined by a blank line, the system
    /// prompts gathered before the last user turn's text, assistant text right-stripped of
    /// spaces and closed by `</s>`.
    #[test]
    fn runs_merge_and_the_system_prompt_joins_the_last_user_turn() {
        let (_dir, mistral) = folder();
        // a system message ends a run of user turns (mistral-common's output, read from it)
        let body = r#"{"messages":[{"role":"system","content":"S1"},{"role":"user","content":"a"},
            {"role":"assistant","content":"b  "},{"role":"user","content":"c"},{"role":"user","content":"c2"},
            {"role":"developer","content":"S2"},
            {"role":"user","content":[{"type":"text","text":"d"},{"type":"text","text":"e"}]}]}"#;
        let want = "<s>[INST]a[/INST]b</s>[INST]c\n\nc2[/INST][INST]S1\n\nS2\n\nd\n\ne[/INST]";
        assert_eq!(render(&mistral, body).unwrap(), want);
        // an empty system prompt adds nothing; a conversation may end on a system message
        let empty_system = r#"{"messages":[{"role":"system","content":[{"type":"text","text":""}]},
            {"role":"user","content":"u"},{"role":"system","content":""}]}"#;
        assert_eq!(render(&mistral, empty_system).unwrap(), "<s>[INST]u[/INST]");
        // an assistant turn cannot be followed by a system one
        let misplaced = r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},
            {"role":"system","content":"S"},{"role":"user","content":"c"}]}"#;
        assert_eq!(render(&mistral, misplaced), Err("vllm_rejects"));
        let assistant_first = r#"{"messages":[{"role":"assistant","content":"hi"},{"role":"user","content":"u"}]}"#;
        assert_eq!(render(&mistral, assistant_first).unwrap(), "<s>[INST][/INST]hi</s>[INST]u[/INST]");
        let continued = r#"{"messages":[{"role":"user","content":"u"},{"role":"assistant","content":"go on "}],
            "continue_final_message":true,"add_generation_prompt":false}"#;
        assert_eq!(render(&mistral, continued).unwrap(), "<s>[INST]u[/INST]go on");
    }

    /// An empty `tools` list is refused as vLLM refuses it in Mistral mode, never rendered (so
    /// never sent token-in, which would skip vLLM's refusal); absent or null, no tools.
    #[test]
    fn an_empty_tools_list_is_refused_as_vllm_refuses_it() {
        let (_dir, mistral) = folder();
        let messages = r#""messages":[{"role":"user","content":"q"}]"#;
        assert_eq!(render(&mistral, &format!(r#"{{{messages},"tools":[]}}"#)), Err("vllm_rejects"));
        assert_eq!(render(&mistral, &format!(r#"{{{messages},"tools":null}}"#)).unwrap(), "<s>[INST]q[/INST]");
        assert_eq!(render(&mistral, &format!("{{{messages}}}")).unwrap(), "<s>[INST]q[/INST]");
    }

    /// Tools go before the last `[INST]`; vLLM keeps a long tool-call id's last 9
    /// characters; calls and results are JSON written again by Python's rules.
    #[test]
    fn tools_calls_and_results_take_their_control_tokens() {
        let (_dir, mistral) = folder();
        let body = r#"{"messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"call_abcdefghi","type":"function",
              "function":{"name":"f","arguments":"{\"x\":1.50,\"y\":\"é\"}"}}]},
            {"role":"tool","tool_call_id":"call_abcdefghi","content":"{\"ok\":true}"},
            {"role":"user","content":"r"}],
            "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}"#;
        assert_eq!(
            render(&mistral, body).unwrap(),
            "<s>[INST]q[/INST][TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1.5, \"y\": \"é\"}, \"id\": \"abcdefghi\"}]</s>\
             [TOOL_RESULTS]{\"content\": {\"ok\": true}, \"call_id\": \"abcdefghi\"}[/TOOL_RESULTS]\
             [AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"\", \
             \"parameters\": {\"type\": \"object\"}}}][/AVAILABLE_TOOLS][INST]r[/INST]"
        );
    }

    /// What vLLM's Mistral mode answers with a 400 is never rendered (it goes as text).
    #[test]
    fn what_vllm_refuses_is_not_rendered() {
        let (_dir, mistral) = folder();
        let call = |id: &str| {
            format!(
                r#"{{"role":"assistant","tool_calls":[{{"id":"{id}","type":"function","function":{{"name":"f","arguments":"{{}}"}}}}]}}"#
            )
        };
        let refused = [
            r#"{"messages":[{"role":"user","content":"u"},{"role":"assistant","content":"a"}]}"#.to_owned(),
            r#"{"messages":[{"role":"user","content":"u"},{"role":"assistant","content":"a"}],"add_generation_prompt":false}"#
                .to_owned(),
            format!(r#"{{"messages":[{{"role":"user","content":"u"}},{},{{"role":"tool","tool_call_id":"call_0","content":"x"}}]}}"#, call("call_0")),
            r#"{"messages":[{"role":"user","content":"u"},{"role":"assistant","content":"a","reasoning_content":"r"},{"role":"user","content":"v"}]}"#.to_owned(),
            r#"{"messages":[{"role":"user","content":"u"}],"chat_template_kwargs":{}}"#.to_owned(),
            r#"{"messages":[{"role":"user","content":"u"},{"role":"tool","tool_call_id":"abcdefghi","content":"x"}]}"#.to_owned(),
            r#"{"messages":[{"role":"narrator","content":"u"}]}"#.to_owned(),
            // two assistant messages merge into one turn holding text and a call
            format!(r#"{{"messages":[{{"role":"user","content":"u"}},{{"role":"assistant","content":"a"}},{},{{"role":"tool","tool_call_id":"abcdefghi","content":"x"}}]}}"#, call("abcdefghi")),
            r#"{"messages":[{"role":"user","content":null}]}"#.to_owned(),
        ];
        for body in &refused {
            assert_eq!(render(&mistral, body), Err("vllm_rejects"), "{body}");
        }
        let answered = format!(
            r#"{{"messages":[{{"role":"user","content":"u"}},{},{{"role":"tool","tool_call_id":"xyzabcdefghi","content":"x"}}]}}"#,
            call("abcdefghi")
        );
        assert!(render(&mistral, &answered).is_ok(), "{answered}");
    }
}
