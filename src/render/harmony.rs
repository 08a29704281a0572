//! gpt-oss chat requests to prompt ids as vLLM 0.32 makes them: Harmony messages built the way
//! vLLM's `harmony_utils` builds them from a chat request (system, developer, history), encoded
//! by the `openai-harmony` crate (Apache-2.0; the library vLLM calls through its Python binding),
//! its o200k vocabulary read from the model folder, never downloaded.

use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use openai_harmony::chat::{
    Author, Content, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent, TextContent,
    ToolDescription,
};
use openai_harmony::{load_harmony_encoding, HarmonyEncoding, HarmonyEncodingName};

use super::load::{LoadError, LoadOptions};
use super::pyjson::PyValue;
use super::request::{body, check_tool_choice, flag, is_set, refuse_unrendered_fields, tool_dump, Shape};
use super::strftime::strftime;
use super::Unsupported;

/// The vocabulary file openai-harmony reads for gpt-oss (o200k_base), in the model folder.
pub const VOCAB_FILE: &str = "o200k_base.tiktoken";

/// The variable openai-harmony reads its vocabulary's folder from (else it downloads it).
const VOCAB_DIR_VAR: &str = "TIKTOKEN_ENCODINGS_BASE";

/// A gpt-oss pool's renderer: the Harmony encoding (loaded once, at load) and the date vLLM's
/// system message carries.
pub struct Harmony {
    encoding: Arc<HarmonyEncoding>,
    /// vLLM's `VLLM_SYSTEM_START_DATE` (`YYYY-MM-DD`); `None`: the UTC date when rendering.
    start_date: Option<String>,
    /// `--exclude-tools-when-tool-choice-none`.
    exclude_tools_when_tool_choice_none: bool,
}

impl std::fmt::Debug for Harmony {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harmony").field("start_date", &self.start_date).finish()
    }
}

/// The encodings loaded so far, by their vocabulary file's sha256 (the crate accepts only
/// o200k_base's, so in practice one per process).
static LOADED: Mutex<Vec<(String, Arc<HarmonyEncoding>)>> = Mutex::new(Vec::new());

impl Harmony {
    /// The renderer of the gpt-oss folder `folder`, from its `o200k_base.tiktoken`.
    ///
    /// # Errors
    /// [`LoadError::Io`] when the vocabulary file is missing or unreadable, [`LoadError::Config`]
    /// when openai-harmony refuses it (not o200k_base: it checks the file's sha256).
    pub fn load(folder: &Path, options: &LoadOptions) -> Result<Self, LoadError> {
        let start_date = options.system_start_date.clone();
        let exclude_tools_when_tool_choice_none = options.exclude_tools_when_tool_choice_none;
        let vocab = folder.join(VOCAB_FILE);
        let path = vocab.display().to_string();
        let bytes = std::fs::read(&vocab).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        let sha = sha256_hex(&bytes);
        let mut loaded = LOADED.lock();
        if let Some((_, encoding)) = loaded.iter().find(|(s, _)| *s == sha) {
            return Ok(Harmony { encoding: Arc::clone(encoding), start_date, exclude_tools_when_tool_choice_none });
        }
        let encoding = Arc::new(load_from(folder).map_err(|e| LoadError::Config {
            path,
            reason: format!("openai-harmony cannot load its vocabulary from it: {e}"),
        })?);
        loaded.push((sha, Arc::clone(&encoding)));
        Ok(Harmony { encoding, start_date, exclude_tools_when_tool_choice_none })
    }

    /// True when `other` renders alike (same vocabulary, same pinned date).
    pub(crate) fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.encoding, &other.encoding)
            && self.start_date == other.start_date
            && self.exclude_tools_when_tool_choice_none == other.exclude_tools_when_tool_choice_none
    }
}

/// openai-harmony's gpt-oss encoding with its vocabulary read from `folder`. The crate reads a
/// local vocabulary only from the folder `TIKTOKEN_ENCODINGS_BASE` names (else it downloads
/// one): the variable is set for the load alone, under [`LOADED`]'s lock, and put back.
fn load_from(folder: &Path) -> Result<HarmonyEncoding, String> {
    let before = std::env::var_os(VOCAB_DIR_VAR);
    #[expect(clippy::disallowed_methods, reason = "openai-harmony has no API taking the vocabulary's path")]
    std::env::set_var(VOCAB_DIR_VAR, folder);
    let encoding = load_harmony_encoding(HarmonyEncodingName::HarmonyGptOss).map_err(|e| format!("{e:#}"));
    match before {
        #[expect(clippy::disallowed_methods, reason = "puts back the operator's own value")]
        Some(v) => std::env::set_var(VOCAB_DIR_VAR, v),
        None => std::env::remove_var(VOCAB_DIR_VAR),
    }
    encoding
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A gpt-oss chat request rendered: its prompt ids and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedHarmony {
    /// The ids vLLM would send the engine.
    pub ids: Vec<u32>,
    /// What kind of request it was.
    pub shape: Shape,
}

/// Renders a chat completions body as vLLM 0.32 renders it for gpt-oss, dated today (UTC) or
/// with the pinned start date.
///
/// # Errors
/// [`Unsupported`]: the reason the request must take the engine's own rendering.
pub fn render_harmony(harmony: &Harmony, request: &[u8]) -> Result<RenderedHarmony, Unsupported> {
    let date = match &harmony.start_date {
        Some(date) => date.clone(),
        None => today_utc(),
    };
    render_harmony_on(harmony, request, &date)
}

/// `datetime.now().strftime("%Y-%m-%d")` on a UTC clock.
fn today_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime("%Y-%m-%d", i64::try_from(secs).unwrap_or(0)).unwrap_or_default()
}

/// [`render_harmony`] with the system message's date given (`YYYY-MM-DD`).
///
/// # Errors
/// As [`render_harmony`].
pub fn render_harmony_on(harmony: &Harmony, request: &[u8], date: &str) -> Result<RenderedHarmony, Unsupported> {
    let req = body(request)?;
    check_settings(&req)?;
    let reasoning_effort = reasoning_effort(&req)?;
    let tools = request_tools(&req, harmony.exclude_tools_when_tool_choice_none)?;
    let chat = match req.get("messages") {
        // no messages at all: vLLM's Harmony path renders the preamble alone (recorded)
        Some(PyValue::List(m)) => m.iter().map(ChatMessage::read).collect::<Result<Vec<_>, _>>()?,
        _ => return Err(Unsupported::VllmRejects("messages missing or not a list")),
    };
    let shape = shape_of(&chat, tools.is_some(), flag(&req, "continue_final_message", false)?);

    // _make_request_with_harmony: instructions from a leading system/developer message, the
    // preamble, then the rest of the conversation.
    let (instructions, rest) = match chat.split_first() {
        Some((first, rest)) if first.role == "system" || first.role == "developer" => (first.flat_text(), rest),
        _ => (None, chat.as_slice()),
    };
    let mut messages = preamble(instructions, tools, reasoning_effort, date);
    let tool_names = tool_id_names(rest);
    for m in rest {
        m.to_harmony(&tool_names, &mut messages);
    }

    // render_for_completion: vLLM drops analysis before the last final answer itself, then the
    // crate renders with its own dropping off.
    let messages = drop_earlier_analysis(messages);
    let ids = harmony
        .encoding
        .render_conversation_for_completion(&Conversation::from_messages(messages), Role::Assistant, None)
        .map_err(|_| Unsupported::Unverified("openai-harmony could not render the conversation"))?;
    Ok(RenderedHarmony { ids, shape })
}

/// The request fields that change the ids in ways not done here (as for every family), and
/// the flags pydantic checks.
fn check_settings(req: &PyValue) -> Result<(), Unsupported> {
    if is_set(req, "chat_template") {
        return Err(Unsupported::RequestChatTemplate);
    }
    refuse_unrendered_fields(req)?;
    // Harmony renders the same with or without these. vLLM's validator refuses the pair
    // only when both are sent (`data.get(..) and data.get(..)`): with the generation prompt
    // left to its default vLLM renders it (recorded).
    if flag(req, "continue_final_message", false)?
        && flag(req, "add_generation_prompt", true)?
        && req.get("add_generation_prompt").is_some()
    {
        return Err(Unsupported::VllmRejects("continue_final_message with add_generation_prompt"));
    }
    match req.get("chat_template_kwargs") {
        None | Some(PyValue::Null | PyValue::Dict(_)) => Ok(()),
        Some(_) => Err(Unsupported::Unverified("chat_template_kwargs not an object")),
    }
}

/// `reasoning_effort`: unset keeps Harmony's default (medium); `none` and unknown efforts
/// vLLM answers with a 400.
fn reasoning_effort(req: &PyValue) -> Result<Option<ReasoningEffort>, Unsupported> {
    match req.get("reasoning_effort") {
        None | Some(PyValue::Null) => Ok(None),
        Some(PyValue::Str(s)) => match s.as_str() {
            "low" => Ok(Some(ReasoningEffort::Low)),
            "medium" => Ok(Some(ReasoningEffort::Medium)),
            "high" => Ok(Some(ReasoningEffort::High)),
            _ => Err(Unsupported::VllmRejects("reasoning_effort Harmony does not support")),
        },
        Some(_) => Err(Unsupported::VllmRejects("reasoning_effort not a string")),
    }
}

/// The request's tools as Harmony tool descriptions (`create_tool_definition`), after vLLM's
/// `tool_choice` checks; none when `tools` is absent, or when `tool_choice` is "none" and the
/// server runs with `--exclude-tools-when-tool-choice-none` (`exclude_on_none`).
fn request_tools(req: &PyValue, exclude_on_none: bool) -> Result<Option<Vec<ToolDescription>>, Unsupported> {
    check_tool_choice(req)?;
    if exclude_on_none && matches!(req.get("tool_choice"), Some(PyValue::Str(s)) if s == "none") {
        return Ok(None);
    }
    let items = match req.get("tools") {
        None | Some(PyValue::Null) => return Ok(None),
        Some(PyValue::List(items)) if items.is_empty() => return Err(Unsupported::VllmRejects("tools: []")),
        Some(PyValue::List(items)) => items,
        Some(_) => return Err(Unsupported::VllmRejects("tools not a list")),
    };
    let mut tools = Vec::with_capacity(items.len());
    for item in items {
        let dumped = tool_dump(item)?;
        let function = dumped.get("function");
        let name = function.and_then(|f| f.get("name")).and_then(PyValue::as_str).unwrap_or_default();
        let description = function.and_then(|f| f.get("description")).and_then(PyValue::as_str).unwrap_or_default();
        let parameters = match function.and_then(|f| f.get("parameters")) {
            None | Some(PyValue::Null) => None,
            Some(p) => Some(to_json(p)?),
        };
        tools.push(ToolDescription::new(name, description, parameters));
    }
    Ok(Some(tools))
}

/// A Python value as the crate gets it (`json.dumps` read by serde_json): an integer beyond
/// 64 bits becomes the nearest float, as serde_json reads its digits; NaN and infinities
/// (which serde_json refuses) are not rendered.
fn to_json(v: &PyValue) -> Result<serde_json::Value, Unsupported> {
    use serde_json::Value;
    Ok(match v {
        PyValue::Null => Value::Null,
        PyValue::Bool(b) => Value::Bool(*b),
        PyValue::Int(digits) => serde_json::from_str::<Value>(digits)
            .map_err(|_| Unsupported::Unverified("integer serde_json does not read"))?,
        PyValue::Float(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .ok_or(Unsupported::Unverified("NaN or infinity in tool parameters"))?,
        PyValue::Str(s) => Value::String(s.clone()),
        PyValue::List(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        PyValue::Dict(items) => {
            Value::Object(items.iter().map(|(k, v)| Ok((k.clone(), to_json(v)?))).collect::<Result<_, Unsupported>>()?)
        }
    })
}

/// One chat message as vLLM's Harmony path reads it (a dict after pydantic's validation).
struct ChatMessage {
    role: String,
    /// `content`: absent/null, a string, or the texts of its text parts (in order).
    content: MessageText,
    /// `reasoning` (or `reasoning_content`).
    reasoning: Option<String>,
    /// (id, function name, arguments) of each tool call.
    tool_calls: Vec<(Option<String>, String, String)>,
    /// A tool message's `tool_call_id`.
    tool_call_id: Option<String>,
}

/// A message's content: none, a string, or text parts.
enum MessageText {
    None,
    Text(String),
    Parts(Vec<String>),
}

impl ChatMessage {
    /// Reads a message, refusing what pydantic or Harmony would answer with an error and what
    /// is not reproduced (media parts).
    fn read(m: &PyValue) -> Result<Self, Unsupported> {
        if !matches!(m, PyValue::Dict(_)) {
            return Err(Unsupported::VllmRejects("message not an object"));
        }
        let role = match m.get("role").and_then(PyValue::as_str) {
            Some(r @ ("system" | "developer" | "user" | "assistant" | "tool")) => r.to_string(),
            // pydantic or Harmony's Author refuses every other role
            _ => return Err(Unsupported::VllmRejects("a role Harmony does not know")),
        };
        let content = match m.get("content") {
            // no `content` key passes pydantic for any role (vLLM's custom message type); a
            // null one only for an assistant
            None => MessageText::None,
            Some(PyValue::Null) if role == "assistant" => MessageText::None,
            Some(PyValue::Null) => return Err(Unsupported::VllmRejects("content null")),
            Some(PyValue::Str(s)) => MessageText::Text(s.clone()),
            Some(PyValue::List(parts)) => MessageText::Parts(parts.iter().map(text_part).collect::<Result<_, _>>()?),
            Some(_) => return Err(Unsupported::VllmRejects("content neither a string nor a list")),
        };
        let text_field = |key: &str| match m.get(key) {
            None | Some(PyValue::Null) => Ok(None),
            Some(PyValue::Str(s)) => Ok(Some(s.clone())),
            Some(_) => Err(Unsupported::Unverified("reasoning or tool_call_id not a string")),
        };
        let reasoning = match (text_field("reasoning")?, text_field("reasoning_content")?) {
            (Some(_), Some(_)) => return Err(Unsupported::Unverified("both reasoning and reasoning_content")),
            (r, rc) => r.or(rc),
        };
        let tool_calls = match m.get("tool_calls") {
            None => Vec::new(),
            Some(PyValue::List(calls)) if role == "assistant" => {
                calls.iter().map(tool_call).collect::<Result<_, _>>()?
            }
            Some(PyValue::List(calls)) if calls.is_empty() => Vec::new(),
            _ => return Err(Unsupported::Unverified("tool_calls null, or not on an assistant message")),
        };
        Ok(ChatMessage { role, content, reasoning, tool_calls, tool_call_id: text_field("tool_call_id")? })
    }

    /// `flatten_input_text_content`: a string as is, text parts joined with nothing (`None`
    /// when there are none).
    fn flat_text(&self) -> Option<String> {
        match &self.content {
            MessageText::None => None,
            MessageText::Text(s) => Some(s.clone()),
            MessageText::Parts(parts) if parts.is_empty() => None,
            MessageText::Parts(parts) => Some(parts.concat()),
        }
    }

    /// `parse_chat_input_to_harmony_message`: this message as Harmony messages.
    fn to_harmony(&self, tool_names: &[(Option<String>, String)], out: &mut Vec<Message>) {
        let assistant = |text: &str, channel: &str| {
            Message::from_role_and_content(Role::Assistant, text.to_string()).with_channel(channel.to_string())
        };
        let reasoning = self.reasoning.as_deref().filter(|r| !r.is_empty());
        match self.role.as_str() {
            "assistant" if !self.tool_calls.is_empty() => {
                if let Some(text) = self.flat_text().filter(|t| !t.is_empty()) {
                    out.push(assistant(&text, "commentary"));
                }
                if let Some(r) = reasoning {
                    out.push(assistant(r, "analysis"));
                }
                for (_, name, arguments) in &self.tool_calls {
                    out.push(
                        assistant(arguments, "commentary")
                            .with_recipient(format!("functions.{name}"))
                            .with_content_type("json"),
                    );
                }
            }
            "tool" => {
                let id = self.tool_call_id.as_deref().unwrap_or_default();
                // the last call with this id names the tool (a dict built over every call)
                let name = tool_names.iter().rev().find(|(i, _)| i.as_deref() == Some(id)).map(|(_, n)| n.as_str());
                let author = Author::new(Role::Tool, format!("functions.{}", name.unwrap_or_default()));
                let text = self.flat_text().unwrap_or_default();
                // vLLM's oss-harmony (0.0.10 on) writes a tool's recipient after its channel
                // (`functions.f<|channel|>commentary to=assistant`), openai-harmony 0.0.8
                // before it: the recipient rides in the channel's text to be written where
                // vLLM writes it (the same ids: o200k splits before " to" either way).
                out.push(Message::from_author_and_content(author, text).with_channel("commentary to=assistant"));
            }
            "assistant" => {
                if let Some(r) = reasoning {
                    out.push(assistant(r, "analysis"));
                }
                let contents = self.contents();
                if matches!(contents.first(), Some(Content::Text(TextContent { text })) if !text.is_empty()) {
                    out.push(Message::from_role_and_contents(Role::Assistant, contents).with_channel("final"));
                }
            }
            "system" | "developer" => {
                if let Some(instructions) = self.flat_text() {
                    let developer = DeveloperContent::new().with_instructions(instructions);
                    out.push(Message::from_role_and_content(Role::Developer, developer));
                }
            }
            _ => out.push(Message::from_role_and_contents(Role::User, self.contents())),
        }
    }

    /// The content as Harmony text contents: one per part (a string is one).
    fn contents(&self) -> Vec<Content> {
        let text = |t: &str| Content::Text(TextContent { text: t.to_string() });
        match &self.content {
            MessageText::None => vec![text("")],
            MessageText::Text(s) => vec![text(s)],
            MessageText::Parts(parts) => parts.iter().map(|p| text(p)).collect(),
        }
    }
}

/// A content part's text: only `{"type": "text", "text": ...}` parts are rendered here (vLLM's
/// Harmony path turns media parts into empty text; not reproduced).
fn text_part(part: &PyValue) -> Result<String, Unsupported> {
    match (part.get("type").and_then(PyValue::as_str), part.get("text")) {
        (Some("text"), Some(PyValue::Str(t))) => Ok(t.clone()),
        (Some("image_url" | "input_audio" | "video_url" | "audio_url" | "image_embeds" | "file"), _) => {
            Err(Unsupported::Media)
        }
        _ => Err(Unsupported::Unverified("content part other than text")),
    }
}

/// A tool call's (id, function name, arguments string), as pydantic accepts it.
fn tool_call(call: &PyValue) -> Result<(Option<String>, String, String), Unsupported> {
    let id = match call.get("id") {
        None | Some(PyValue::Null) => None,
        Some(PyValue::Str(s)) => Some(s.clone()),
        Some(_) => return Err(Unsupported::VllmRejects("tool call id not a string")),
    };
    let function = call.get("function");
    let name = match function.and_then(|f| f.get("name")) {
        // vLLM re-encodes a call's header as text that may not hold special tokens
        Some(PyValue::Str(s)) if s.contains("<|") => {
            return Err(Unsupported::Unverified("special token in a call's name"))
        }
        Some(PyValue::Str(s)) => s.clone(),
        _ => return Err(Unsupported::VllmRejects("tool call without a function name")),
    };
    let arguments = match function.and_then(|f| f.get("arguments")) {
        Some(PyValue::Str(s)) => s.clone(),
        _ => return Err(Unsupported::VllmRejects("tool call arguments not a string")),
    };
    Ok((id, name, arguments))
}

/// Every tool call's (id, name) in order (`parse_chat_inputs_to_harmony_messages`' map).
fn tool_id_names(messages: &[ChatMessage]) -> Vec<(Option<String>, String)> {
    messages.iter().flat_map(|m| m.tool_calls.iter().map(|(id, name, _)| (id.clone(), name.clone()))).collect()
}

/// `build_harmony_preamble`: the system message (identity, reasoning effort, knowledge cutoff,
/// date, channels) and, with instructions or tools, the developer message.
fn preamble(
    instructions: Option<String>,
    tools: Option<Vec<ToolDescription>>,
    reasoning_effort: Option<ReasoningEffort>,
    date: &str,
) -> Vec<Message> {
    let mut system = SystemContent::new();
    if let Some(effort) = reasoning_effort {
        system = system.with_reasoning_effort(effort);
    }
    let system = system.with_conversation_start_date(date);
    let mut out = vec![Message::from_role_and_content(Role::System, system)];
    let has_instructions = instructions.as_deref().is_some_and(|i| !i.is_empty());
    if has_instructions || tools.is_some() {
        let mut developer = DeveloperContent::new();
        if let Some(i) = instructions {
            developer = developer.with_instructions(i);
        }
        if let Some(tools) = tools {
            developer = developer.with_function_tools(tools);
        }
        out.push(Message::from_role_and_content(Role::Developer, developer));
    }
    out
}

/// `auto_drop_analysis_messages`: analysis messages before the last assistant message to the
/// final channel are dropped.
fn drop_earlier_analysis(messages: Vec<Message>) -> Vec<Message> {
    let is_final = |m: &Message| m.author.role == Role::Assistant && m.channel.as_deref() == Some("final");
    let Some(last_final) = messages.iter().rposition(is_final) else {
        return messages;
    };
    messages
        .into_iter()
        .enumerate()
        .filter(|(i, m)| !(*i < last_final && m.channel.as_deref() == Some("analysis")))
        .map(|(_, m)| m)
        .collect()
}

/// The request's shape from its messages.
fn shape_of(chat: &[ChatMessage], tools: bool, continue_final: bool) -> Shape {
    Shape {
        system: chat.iter().any(|m| m.role == "system" || m.role == "developer"),
        multi_turn: chat.iter().filter(|m| m.role == "user").count() > 1,
        tools,
        tool_calls: chat.iter().any(|m| !m.tool_calls.is_empty()),
        tool_results: chat.iter().any(|m| m.role == "tool"),
        thinking: None,
        continue_final,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::pyjson;

    fn message(json: &str) -> Result<ChatMessage, Unsupported> {
        ChatMessage::read(&pyjson::loads(json).unwrap())
    }

    fn harmony_of(messages: &[&str]) -> Vec<Message> {
        let chat: Vec<ChatMessage> = messages.iter().map(|m| message(m).unwrap()).collect();
        let names = tool_id_names(&chat);
        let mut out = Vec::new();
        for m in &chat {
            m.to_harmony(&names, &mut out);
        }
        out
    }

    /// What vLLM answers with a 400, and what is not reproduced, is refused by name.
    #[test]
    fn messages_vllm_refuses_or_not_reproduced_are_refused_by_name() {
        let label = |json: &str| message(json).err().map(|e| e.label());
        assert_eq!(label(r#"{"role": "narrator", "content": "x"}"#), Some("vllm_rejects"));
        assert_eq!(label(r#"{"role": "user", "content": null}"#), Some("vllm_rejects"));
        assert_eq!(
            label(r#"{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}"#),
            Some("media")
        );
        assert_eq!(
            label(r#"{"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}"#),
            Some("unverified_shape")
        );
        assert_eq!(label(r#"{"role": "assistant", "content": null}"#), None);
        // no content key at all is taken for every role (null content only for an assistant)
        assert_eq!(label(r#"{"role": "user"}"#), None);
        assert_eq!(label(r#"{"role": "system"}"#), None);
        let effort = |v: &str| reasoning_effort(&pyjson::loads(&format!(r#"{{"reasoning_effort": {v}}}"#)).unwrap());
        assert_eq!(effort(r#""none""#).unwrap_err().label(), "vllm_rejects");
        assert_eq!(effort(r#""high""#).unwrap(), Some(ReasoningEffort::High));
    }

    /// A call's reasoning goes to analysis, its arguments as sent to `functions.NAME`; the
    /// tool's answer comes from the tool its id names (the last call with that id).
    #[test]
    fn tool_calls_and_results_become_harmony_messages() {
        let out = harmony_of(&[
            r#"{"role": "assistant", "reasoning_content": "think", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
                {"id": "a", "type": "function", "function": {"name": "g", "arguments": ""}}]}"#,
            r#"{"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "o"}, {"type": "text", "text": "k"}]}"#,
        ]);
        let summary: Vec<(String, Option<&str>, Option<&str>)> = out
            .iter()
            .map(|m| {
                (
                    m.author.name.clone().unwrap_or(m.author.role.to_string()),
                    m.channel.as_deref(),
                    m.recipient.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("assistant".into(), Some("analysis"), None),
                ("assistant".into(), Some("commentary"), Some("functions.f")),
                ("assistant".into(), Some("commentary"), Some("functions.g")),
                ("functions.g".into(), Some("commentary to=assistant"), None),
            ]
        );
        assert_eq!(out[1].content, vec![Content::from("{\"x\":1}")]);
        assert_eq!(out[3].content, vec![Content::from("ok")]);
    }

    /// vLLM's `auto_drop_analysis_messages`: analysis before the last final answer goes, the
    /// analysis after it stays.
    #[test]
    fn analysis_before_the_last_final_answer_is_dropped() {
        let out = harmony_of(&[
            r#"{"role": "user", "content": "q1"}"#,
            r#"{"role": "assistant", "content": "a1", "reasoning": "r1"}"#,
            r#"{"role": "user", "content": "q2"}"#,
            r#"{"role": "assistant", "content": "a2", "reasoning": "r2"}"#,
            r#"{"role": "user", "content": "q3"}"#,
            r#"{"role": "assistant", "content": "", "reasoning": "r3"}"#,
        ]);
        let kept = drop_earlier_analysis(out);
        let kept: Vec<Option<&str>> = kept.iter().map(|m| m.channel.as_deref()).collect();
        assert_eq!(kept, [None, Some("final"), None, Some("final"), None, Some("analysis")]);
    }

    /// Tool parameters reach the crate as Python's `json.dumps` would hand them to serde_json:
    /// key order kept, a huge integer as serde_json's float, NaN refused.
    #[test]
    fn tool_parameters_reach_the_crate_as_from_python() {
        let v =
            to_json(&pyjson::loads(r#"{"b": 1, "a": 123456789012345678901234567890, "b": 2.50}"#).unwrap()).unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), r#"{"b":2.5,"a":1.2345678901234568e+29}"#);
        assert_eq!(to_json(&pyjson::loads(r#"{"d": NaN}"#).unwrap()).unwrap_err().label(), "unverified_shape");
    }
}
