//! vLLM 0.32's preprocessing of a chat request before its template sees it
//! (`ChatCompletionRequest` validators, `parse_chat_messages`, `_postprocess_messages`,
//! developer→system, `build_chat_params`/`merge_kwargs`, transformers' continue-final-message
//! tag), then the render; and the completions prompt. Anything not proven equal to vLLM is an
//! [`Unsupported`].

use minijinja::Value;

use super::pyjson::{self, LoadsError, PyValue};
use super::template::{to_value, ChatTemplate};
use super::Unsupported;

/// A rendered chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The text vLLM would tokenize (with `add_special_tokens=false`).
    pub text: String,
    /// What kind of request it was, for counting matches per shape.
    pub shape: Shape,
    /// The template read the clock (`strftime_now`): the text depends on the time of day.
    pub reads_clock: bool,
}

/// The request shape, as the issue counts it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shape {
    /// A system (or developer) message.
    pub system: bool,
    /// More than one user turn.
    pub multi_turn: bool,
    /// Tool definitions passed to the template.
    pub tools: bool,
    /// Assistant tool calls in the history.
    pub tool_calls: bool,
    /// Tool results in the history.
    pub tool_results: bool,
    /// `enable_thinking` as the template gets it (`None`: not set).
    pub thinking: Option<bool>,
    /// `continue_final_message`.
    pub continue_final: bool,
}

/// transformers' marker for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Keys of `chat_template_kwargs` that vLLM or transformers consume or that collide with
/// what they pass; a request using one falls back.
const RESERVED_KWARGS: [&str; 16] = [
    "chat_template",
    "tokenize",
    "tools",
    "messages",
    "conversation",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "strftime_now",
];

/// Content-part types vLLM parses as text, and the key holding the text.
fn text_key(part_type: &str) -> Option<&'static str> {
    match part_type {
        "text" | "input_text" | "output_text" => Some("text"),
        "refusal" => Some("refusal"),
        "thinking" => Some("thinking"),
        _ => None,
    }
}

/// Keys that make a part media whatever its type (vLLM's `_MEDIA_CONTENT_PART_KEYS`).
const MEDIA_KEYS: [&str; 10] = [
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn body(bytes: &[u8]) -> Result<PyValue, Unsupported> {
    if bytes.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return Err(Unsupported::Body("UTF-8 byte order mark".into()));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| Unsupported::Body("not UTF-8".into()))?;
    let v = pyjson::loads(text).map_err(loads_error)?;
    match v {
        PyValue::Dict(_) => Ok(v),
        _ => Err(Unsupported::Body("not an object".into())),
    }
}

fn loads_error(e: LoadsError) -> Unsupported {
    match e {
        LoadsError::LoneSurrogate(_) => Unsupported::LoneSurrogate,
        LoadsError::IntTooLong(_) => Unsupported::BigInteger,
        other => Unsupported::Body(other.to_string()),
    }
}

/// A field read as pydantic's `bool` (strictly: JSON booleans or null/absent).
fn flag(req: &PyValue, key: &str, default: bool) -> Result<bool, Unsupported> {
    match req.get(key) {
        None => Ok(default),
        Some(PyValue::Bool(b)) => Ok(*b),
        Some(PyValue::Null) => Err(Unsupported::Unverified("null where vLLM wants a bool")),
        Some(_) => Err(Unsupported::Unverified("non-bool where vLLM wants a bool")),
    }
}

fn is_set(req: &PyValue, key: &str) -> bool {
    !matches!(req.get(key), None | Some(PyValue::Null))
}

/// vLLM's `merge_kwargs` "unset" values: `None` and `"auto"`.
fn unset(v: &PyValue) -> bool {
    matches!(v, PyValue::Null) || matches!(v, PyValue::Str(s) if s == "auto")
}

/// `defaults | {k: v for k, v in overrides if v not in (None, "auto")}` keeping Python's
/// dict order (an existing key keeps its place).
fn merge(defaults: &mut Vec<(String, PyValue)>, overrides: Vec<(String, PyValue)>) {
    for (k, v) in overrides {
        if unset(&v) {
            continue;
        }
        match defaults.iter_mut().find(|(dk, _)| *dk == k) {
            Some(slot) => slot.1 = v,
            None => defaults.push((k, v)),
        }
    }
}

/// Renders an OpenAI chat completions request body as vLLM 0.32 renders it with `template`.
///
/// # Errors
/// [`Unsupported`]: the reason the request must take the engine's own rendering.
pub fn render_chat(template: &ChatTemplate, request: &[u8]) -> Result<RenderedChat, Unsupported> {
    let req = body(request)?;

    // Request-level settings that change rendering or tokenizing in ways not done here.
    if is_set(&req, "chat_template") {
        return Err(Unsupported::RequestChatTemplate);
    }
    if flag(&req, "echo", false)? {
        return Err(Unsupported::Echo);
    }
    if flag(&req, "add_special_tokens", false)? {
        return Err(Unsupported::AddSpecialTokens);
    }
    if is_set(&req, "truncate_prompt_tokens") {
        return Err(Unsupported::Truncation);
    }
    if req.get("kv_transfer_params").and_then(|k| k.get("prompt_token_ids")).is_some() {
        return Err(Unsupported::ClientPromptIds);
    }
    let add_generation_prompt = flag(&req, "add_generation_prompt", true)?;
    let continue_final = flag(&req, "continue_final_message", false)?;
    if continue_final && add_generation_prompt {
        return Err(Unsupported::VllmRejects("continue_final_message with add_generation_prompt"));
    }

    let user_kwargs: Vec<(String, PyValue)> = match req.get("chat_template_kwargs") {
        None | Some(PyValue::Null) => Vec::new(),
        Some(PyValue::Dict(items)) => items.clone(),
        Some(_) => return Err(Unsupported::Unverified("chat_template_kwargs not an object")),
    };
    for (k, v) in &user_kwargs {
        if k == "chat_template" && !matches!(v, PyValue::Null) {
            return Err(Unsupported::RequestChatTemplate);
        }
        if RESERVED_KWARGS.contains(&k.as_str()) {
            return Err(Unsupported::ReservedKwarg(k.clone()));
        }
    }

    // Messages.
    let messages = match req.get("messages") {
        Some(PyValue::List(m)) if !m.is_empty() => m,
        Some(PyValue::List(_)) => return Err(Unsupported::VllmRejects("empty messages")),
        _ => return Err(Unsupported::VllmRejects("messages missing or not a list")),
    };
    let mut conversation: Vec<Vec<(String, PyValue)>> = Vec::with_capacity(messages.len());
    let mut shape = Shape { continue_final, ..Shape::default() };
    let mut user_turns = 0usize;
    for msg in messages {
        let m = parse_message(msg)?;
        let role = m.iter().find(|(k, _)| k == "role").and_then(|(_, v)| v.as_str()).unwrap_or_default();
        match role {
            "system" | "developer" => shape.system = true,
            "user" => user_turns += 1,
            "tool" => shape.tool_results = true,
            _ => {}
        }
        if m.iter().any(|(k, _)| k == "tool_calls") {
            shape.tool_calls = true;
        }
        conversation.push(m);
    }
    shape.multi_turn = user_turns > 1;

    // Tools, rebuilt as `ChatCompletionToolsParam.model_dump()`.
    // check_tool_usage: an absent tool_choice is "auto" when tools are given, else "none".
    let tool_choice_none = match req.get("tool_choice") {
        None => !matches!(req.get("tools"), Some(PyValue::List(t)) if !t.is_empty()),
        Some(PyValue::Str(s)) => s == "none",
        Some(_) => false,
    };
    let tools = match req.get("tools") {
        None | Some(PyValue::Null) => None,
        Some(PyValue::List(items)) if items.is_empty() => {
            return Err(Unsupported::VllmRejects("tools: []"));
        }
        Some(PyValue::List(items)) => Some(items.iter().map(tool_dump).collect::<Result<Vec<_>, _>>()?),
        Some(_) => return Err(Unsupported::VllmRejects("tools not a list")),
    };
    let tools = if tool_choice_none && template.options.exclude_tools_when_tool_choice_none { None } else { tools };
    shape.tools = tools.is_some();
    let with_tools = tools.is_some();

    // developer → system when the template does not name the role; a template that does sees
    // the message's own tools after pydantic's validation, which is not reproduced here.
    if conversation.iter().any(|m| role_of(m) == "developer") {
        if !template.supports_developer(with_tools)? {
            conversation = developer_to_system(conversation);
        } else if conversation
            .iter()
            .any(|m| role_of(m) == "developer" && m.iter().any(|(k, v)| k == "tools" && *v != PyValue::Null))
        {
            return Err(Unsupported::Unverified("tools on a developer message"));
        }
    }

    // Documents: list[dict[str, str]].
    let documents = match req.get("documents") {
        None | Some(PyValue::Null) => None,
        Some(PyValue::List(docs)) => {
            for d in docs {
                match d {
                    PyValue::Dict(items) if items.iter().all(|(_, v)| matches!(v, PyValue::Str(_))) => {}
                    _ => return Err(Unsupported::Unverified("documents not a list of string dicts")),
                }
            }
            Some(PyValue::List(docs.clone()))
        }
        Some(_) => return Err(Unsupported::Unverified("documents not a list")),
    };

    // Template kwargs: build_chat_params, then with_defaults, then get_apply_chat_template_kwargs.
    let reasoning_effort = match req.get("reasoning_effort") {
        None | Some(PyValue::Null) => None,
        Some(PyValue::Str(s)) => Some(s.clone()),
        Some(_) => return Err(Unsupported::VllmRejects("reasoning_effort not a string")),
    };
    let mut extra: Vec<(String, PyValue)> = vec![
        ("add_generation_prompt".into(), PyValue::Bool(add_generation_prompt)),
        ("continue_final_message".into(), PyValue::Bool(continue_final)),
        ("documents".into(), documents.clone().unwrap_or(PyValue::Null)),
        ("reasoning_effort".into(), reasoning_effort.clone().map(PyValue::Str).unwrap_or(PyValue::Null)),
    ];
    if let Some(effort) = &reasoning_effort {
        if !user_kwargs.iter().any(|(k, _)| k == "enable_thinking") {
            extra.push(("enable_thinking".into(), PyValue::Bool(effort != "none")));
        }
    }
    let mut chat_kwargs = user_kwargs;
    merge(&mut chat_kwargs, extra);
    let mut defaults = template.options.default_chat_template_kwargs.clone();
    for (k, _) in &defaults {
        if k == "chat_template" || RESERVED_KWARGS.contains(&k.as_str()) {
            return Err(Unsupported::ReservedKwarg(k.clone()));
        }
    }
    merge(&mut defaults, vec![("tools".into(), PyValue::Null), ("tokenize".into(), PyValue::Bool(false))]);
    merge(&mut defaults, chat_kwargs);
    let kwargs = defaults;

    // What apply_chat_template consumes by name; the rest become template variables.
    let consumed = ["tools", "tokenize", "documents", "add_generation_prompt", "continue_final_message", "return_dict"];
    let mut context: Vec<(String, Value)> = Vec::new();
    let mut thinking = None;
    for (k, v) in &kwargs {
        if consumed.contains(&k.as_str()) {
            continue;
        }
        if k == "enable_thinking" {
            thinking = match v {
                PyValue::Bool(b) => Some(*b),
                _ => None,
            };
        }
        context.push((k.clone(), to_value(v)?));
    }
    shape.thinking = thinking;

    // transformers' continue_final_message: tag the final message's content.
    let mut final_content = None;
    if continue_final {
        if !template.source_contains(with_tools, "content")? {
            return Err(Unsupported::VllmRejects("continue_final_message: template has no content"));
        }
        let last = conversation.last_mut().ok_or(Unsupported::VllmRejects("empty messages"))?;
        match last.iter_mut().find(|(k, _)| k == "content") {
            Some((_, PyValue::Str(s))) => {
                final_content = Some(s.clone());
                s.push_str(CONTINUE_TAG);
            }
            _ => return Err(Unsupported::VllmRejects("continue_final_message: final message has no content")),
        }
    }

    let messages_value =
        Value::from(conversation.iter().map(|m| to_value(&PyValue::Dict(m.clone()))).collect::<Result<Vec<_>, _>>()?);
    let tools_value = match &tools {
        Some(t) => to_value(&PyValue::List(t.clone()))?,
        None => Value::from(()),
    };
    let docs_value = match kwargs.iter().find(|(k, _)| k == "documents") {
        Some((_, d)) => to_value(d)?,
        None => Value::from(()),
    };
    context.push(("messages".into(), messages_value));
    context.push(("tools".into(), tools_value));
    context.push(("documents".into(), docs_value));
    context.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));

    let floats = collect_unsafe_floats(&conversation, tools.as_deref(), &kwargs);
    let rendering = template.render(with_tools, context)?;
    let mut text = rendering.text.clone();
    for f in floats {
        let printed =
            if f == "NaN" { text.matches("NaN").count() > rendering.nan_by_tojson } else { text.contains(&f) };
        if printed {
            return Err(Unsupported::FloatDisplay);
        }
    }

    if let Some(final_message) = final_content {
        let stripped = final_message.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c));
        let tag = CONTINUE_TAG.trim();
        if !text.contains(stripped) || !text.contains(tag) {
            return Err(Unsupported::VllmRejects("continue_final_message: final message not in the render"));
        }
        let at = text.rfind(tag).unwrap_or(text.len());
        if text.get(at..at + CONTINUE_TAG.len()) == Some(CONTINUE_TAG) {
            text.truncate(at);
        } else {
            text.truncate(at);
            let trimmed =
                text.trim_end_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)).len();
            text.truncate(trimmed);
        }
    }

    Ok(RenderedChat { text, shape, reads_clock: rendering.reads_clock })
}

fn role_of(m: &[(String, PyValue)]) -> &str {
    m.iter().find(|(k, _)| k == "role").and_then(|(_, v)| v.as_str()).unwrap_or_default()
}

/// `_parse_chat_message_content` for the "string" content format.
fn parse_message(msg: &PyValue) -> Result<Vec<(String, PyValue)>, Unsupported> {
    let PyValue::Dict(_) = msg else {
        return Err(Unsupported::VllmRejects("message not an object"));
    };
    let role = match msg.get("role") {
        Some(PyValue::Str(r)) => r.clone(),
        _ => return Err(Unsupported::VllmRejects("message without a string role")),
    };
    // The before-validator: reasoning_content → reasoning unless reasoning is set.
    let reasoning = match (msg.get("reasoning"), msg.get("reasoning_content")) {
        (Some(PyValue::Str(r)), _) => Some(r.clone()),
        (None | Some(PyValue::Null), None | Some(PyValue::Null)) => None,
        (None | Some(PyValue::Null), Some(PyValue::Str(r))) => Some(r.clone()),
        _ => return Err(Unsupported::Unverified("reasoning not a string")),
    };

    let parts: Vec<&PyValue> = match msg.get("content") {
        None => {
            if role != "assistant" {
                return Err(Unsupported::Unverified("message without content"));
            }
            Vec::new()
        }
        Some(PyValue::Null) => {
            if role != "assistant" {
                return Err(Unsupported::VllmRejects("content null"));
            }
            Vec::new()
        }
        Some(c @ PyValue::Str(_)) => vec![c],
        Some(PyValue::List(items)) => items.iter().collect(),
        Some(_) => return Err(Unsupported::VllmRejects("content of another type")),
    };
    let mut texts: Vec<String> = Vec::new();
    for part in parts {
        let text = match part {
            PyValue::Str(s) => s.clone(),
            PyValue::Dict(items) => {
                if items.iter().any(|(k, _)| MEDIA_KEYS.contains(&k.as_str()) || k == "uuid") {
                    return Err(Unsupported::Media);
                }
                let part_type = match part.get("type") {
                    Some(PyValue::Str(t)) => t.as_str(),
                    Some(_) => return Err(Unsupported::VllmRejects("content part type not a string")),
                    None => {
                        if part.get("tool_reference").is_some() {
                            return Err(Unsupported::ToolReference);
                        }
                        return Err(Unsupported::VllmRejects("content part without type"));
                    }
                };
                if part_type == "tool_reference" {
                    return Err(Unsupported::ToolReference);
                }
                let Some(key) = text_key(part_type) else {
                    if MEDIA_KEYS.contains(&part_type) {
                        return Err(Unsupported::Media);
                    }
                    return Err(Unsupported::VllmRejects("unknown content part type"));
                };
                match part.get(key) {
                    Some(PyValue::Str(s)) => s.clone(),
                    None | Some(PyValue::Null) => String::new(), // skipped (logged by vLLM)
                    Some(_) => return Err(Unsupported::Unverified("content part text not a string")),
                }
            }
            _ => return Err(Unsupported::Unverified("content part neither string nor object")),
        };
        texts.push(text);
    }
    if role == "system" {
        // _strip_claude_code_billing_header: only plain strings and "text" parts; done before
        // the parts are joined, so it looks at each part.
        texts = strip_billing_header(msg, texts);
    }
    // `if parse_res:` drops empty strings before the join.
    let content = texts.into_iter().filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n");

    let mut out: Vec<(String, PyValue)> =
        vec![("role".into(), PyValue::Str(role.clone())), ("content".into(), PyValue::Str(content))];
    if role == "assistant" {
        match msg.get("tool_calls") {
            None | Some(PyValue::Null) => {}
            Some(PyValue::List(calls)) => {
                if !calls.is_empty() {
                    let calls = calls.iter().map(tool_call).collect::<Result<Vec<_>, _>>()?;
                    out.push(("tool_calls".into(), PyValue::List(calls)));
                }
            }
            Some(_) => return Err(Unsupported::VllmRejects("tool_calls not a list")),
        }
        if let Some(r) = reasoning {
            out.push(("reasoning".into(), PyValue::Str(r.clone())));
            out.push(("reasoning_content".into(), PyValue::Str(r)));
        }
    } else if msg.get("tool_calls").is_some_and(|t| !matches!(t, PyValue::Null)) {
        return Err(Unsupported::Unverified("tool_calls on a non-assistant message"));
    }
    if role == "tool" {
        match msg.get("tool_call_id") {
            None => {}
            Some(v @ (PyValue::Str(_) | PyValue::Null)) => out.push(("tool_call_id".into(), v.clone())),
            Some(_) => return Err(Unsupported::Unverified("tool_call_id not a string")),
        }
    }
    match msg.get("name") {
        Some(n @ PyValue::Str(_)) => out.push(("name".into(), n.clone())),
        None | Some(PyValue::Null) => {}
        Some(_) => return Err(Unsupported::Unverified("name not a string")),
    }
    match msg.get("task") {
        Some(t @ PyValue::Str(_)) => out.push(("task".into(), t.clone())),
        None | Some(PyValue::Null) => {}
        Some(_) => return Err(Unsupported::Unverified("task not a string")),
    }
    if role == "developer" {
        out.push(("tools".into(), msg.get("tools").cloned().unwrap_or(PyValue::Null)));
    }
    Ok(out)
}

fn strip_billing_header(msg: &PyValue, texts: Vec<String>) -> Vec<String> {
    // Parts of other types than plain strings and "text" are not stripped.
    let kinds: Vec<bool> = match msg.get("content") {
        Some(PyValue::List(items)) => items
            .iter()
            .map(|p| matches!(p, PyValue::Str(_)) || p.get("type").and_then(PyValue::as_str) == Some("text"))
            .collect(),
        _ => vec![true],
    };
    texts
        .into_iter()
        .zip(kinds)
        .filter_map(|(t, strippable)| {
            if strippable && t.starts_with(BILLING_HEADER) {
                let rest = t.split_once('\n').map(|(_, r)| r.to_string()).unwrap_or_default();
                (!rest.is_empty()).then_some(rest)
            } else {
                Some(t)
            }
        })
        .collect()
}

/// One assistant tool call after pydantic (`{id, function: {arguments, name}, type}`) and
/// `_postprocess_messages` (arguments parsed; malformed, non-object or empty → `{}`).
fn tool_call(call: &PyValue) -> Result<PyValue, Unsupported> {
    let PyValue::Dict(_) = call else {
        return Err(Unsupported::VllmRejects("tool call not an object"));
    };
    let id = match call.get("id") {
        Some(PyValue::Str(s)) => s.clone(),
        _ => return Err(Unsupported::Unverified("tool call id missing or not a string")),
    };
    match call.get("type") {
        Some(PyValue::Str(t)) if t == "function" => {}
        _ => return Err(Unsupported::Unverified("tool call type not \"function\"")),
    }
    let function = match call.get("function") {
        Some(f @ PyValue::Dict(_)) => f,
        _ => return Err(Unsupported::Unverified("tool call without a function object")),
    };
    let name = match function.get("name") {
        Some(PyValue::Str(s)) => s.clone(),
        _ => return Err(Unsupported::Unverified("tool call name missing or not a string")),
    };
    let arguments = match function.get("arguments") {
        Some(PyValue::Str(s)) if s.is_empty() => PyValue::Dict(Vec::new()),
        Some(PyValue::Str(s)) => match pyjson::loads(s) {
            Ok(v @ PyValue::Dict(_)) => v,
            Ok(_) => PyValue::Dict(Vec::new()),
            Err(LoadsError::Invalid(_) | LoadsError::TooDeep) => PyValue::Dict(Vec::new()),
            Err(e) => return Err(loads_error(e)),
        },
        Some(PyValue::Dict(_)) => return Err(Unsupported::VllmRejects("tool call arguments as an object")),
        _ => return Err(Unsupported::Unverified("tool call arguments missing or not a string")),
    };
    Ok(PyValue::Dict(vec![
        ("id".into(), PyValue::Str(id)),
        ("function".into(), PyValue::Dict(vec![("arguments".into(), arguments), ("name".into(), PyValue::Str(name))])),
        ("type".into(), PyValue::Str("function".into())),
    ]))
}

/// `ChatCompletionToolsParam(**tool).model_dump()`.
fn tool_dump(tool: &PyValue) -> Result<PyValue, Unsupported> {
    let PyValue::Dict(_) = tool else {
        return Err(Unsupported::VllmRejects("tool not an object"));
    };
    match tool.get("type") {
        None => {}
        Some(PyValue::Str(t)) if t == "function" => {}
        _ => return Err(Unsupported::VllmRejects("tool type not \"function\"")),
    }
    let opt_bool = |v: Option<&PyValue>| -> Result<Option<bool>, Unsupported> {
        match v {
            None | Some(PyValue::Null) => Ok(None),
            Some(PyValue::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(Unsupported::Unverified("tool flag not a bool")),
        }
    };
    let top_defer = opt_bool(tool.get("defer_loading"))?;
    let function = match tool.get("function") {
        Some(f @ PyValue::Dict(_)) => f,
        _ => return Err(Unsupported::VllmRejects("tool without a function object")),
    };
    let name = match function.get("name") {
        Some(PyValue::Str(s)) => s.clone(),
        _ => return Err(Unsupported::VllmRejects("tool function without a string name")),
    };
    let description = match function.get("description") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(d @ PyValue::Str(_)) => d.clone(),
        Some(_) => return Err(Unsupported::Unverified("tool description not a string")),
    };
    let parameters = match function.get("parameters") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(p @ PyValue::Dict(_)) => p.clone(),
        Some(_) => return Err(Unsupported::Unverified("tool parameters not an object")),
    };
    let strict = opt_bool(function.get("strict"))?;
    let defer = opt_bool(function.get("defer_loading"))?.or(top_defer);
    let mut f = vec![
        ("name".into(), PyValue::Str(name)),
        ("description".into(), description),
        ("parameters".into(), parameters),
    ];
    if let Some(s) = strict {
        f.push(("strict".into(), PyValue::Bool(s)));
    }
    if let Some(d) = defer {
        f.push(("defer_loading".into(), PyValue::Bool(d)));
    }
    let mut out = vec![("type".into(), PyValue::Str("function".into())), ("function".into(), PyValue::Dict(f))];
    if let Some(d) = top_defer {
        out.push(("defer_loading".into(), PyValue::Bool(d)));
    }
    Ok(PyValue::Dict(out))
}

/// `_convert_developer_to_system` then `_consolidate_system_messages`.
fn developer_to_system(conversation: Vec<Vec<(String, PyValue)>>) -> Vec<Vec<(String, PyValue)>> {
    let converted: Vec<Vec<(String, PyValue)>> = conversation
        .into_iter()
        .map(|m| {
            if role_of(&m) == "developer" {
                m.into_iter()
                    .filter(|(k, _)| k != "tools")
                    .map(|(k, v)| if k == "role" { (k, PyValue::Str("system".into())) } else { (k, v) })
                    .collect()
            } else {
                m
            }
        })
        .collect();
    let mut system_contents: Vec<String> = Vec::new();
    let mut non_system = Vec::new();
    let mut needs = false;
    let mut seen_system = false;
    for (i, m) in converted.iter().enumerate() {
        if role_of(m) == "system" {
            if i > 0 || seen_system {
                needs = true;
            }
            seen_system = true;
            let content = m.iter().find(|(k, _)| k == "content").and_then(|(_, v)| v.as_str()).unwrap_or_default();
            if !content.is_empty() {
                system_contents.push(content.to_string());
            }
        } else {
            non_system.push(m.clone());
        }
    }
    if !needs {
        return converted;
    }
    let mut out = vec![vec![
        ("role".to_string(), PyValue::Str("system".into())),
        ("content".to_string(), PyValue::Str(system_contents.join("\n\n"))),
    ]];
    out.extend(non_system);
    out
}

/// The minijinja text of every float whose Python `str()` differs (exponent form, NaN,
/// infinities), for the check that the template did not print one directly.
fn collect_unsafe_floats(
    conversation: &[Vec<(String, PyValue)>],
    tools: Option<&[PyValue]>,
    kwargs: &[(String, PyValue)],
) -> Vec<String> {
    fn walk(v: &PyValue, out: &mut Vec<String>) {
        match v {
            PyValue::Float(f) => {
                let shown = Value::from(*f).to_string();
                let python = if f.is_nan() {
                    "nan".to_string()
                } else if f.is_infinite() {
                    if *f > 0.0 {
                        "inf".into()
                    } else {
                        "-inf".into()
                    }
                } else {
                    pyjson::float_repr(*f)
                };
                // minijinja's Display (`~`, `|string`) and, inside a container, Rust's Debug
                for shown in [shown, format!("{f:?}")] {
                    if shown != python && !out.contains(&shown) {
                        out.push(shown);
                    }
                }
            }
            PyValue::List(items) => items.iter().for_each(|x| walk(x, out)),
            PyValue::Dict(items) => items.iter().for_each(|(_, x)| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for m in conversation {
        for (_, v) in m {
            walk(v, &mut out);
        }
    }
    for t in tools.unwrap_or_default() {
        walk(t, &mut out);
    }
    for (_, v) in kwargs {
        walk(v, &mut out);
    }
    out
}

/// A completions request's prompt as vLLM tokenizes it: a single string prompt, as is, to be
/// encoded with `add_special_tokens` (the request's, default true).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedCompletion {
    /// The prompt text.
    pub text: String,
    /// Whether the tokenizer adds its special tokens (`add_special_tokens`, default true).
    pub add_special_tokens: bool,
}

/// The text of a completions request body (`prompt` a string), or why not.
///
/// # Errors
/// [`Unsupported`]: lists, token ids, embeddings, `suffix`, `echo`, truncation.
pub fn render_completion(request: &[u8]) -> Result<RenderedCompletion, Unsupported> {
    let req = body(request)?;
    if flag(&req, "echo", false)? {
        return Err(Unsupported::Echo);
    }
    if is_set(&req, "truncate_prompt_tokens") {
        return Err(Unsupported::Truncation);
    }
    if is_set(&req, "suffix") {
        return Err(Unsupported::Unverified("suffix (FIM rendering)"));
    }
    if is_set(&req, "prompt_embeds") {
        return Err(Unsupported::Media);
    }
    let add_special_tokens = flag(&req, "add_special_tokens", true)?;
    match req.get("prompt") {
        Some(PyValue::Str(s)) => Ok(RenderedCompletion { text: s.clone(), add_special_tokens }),
        Some(PyValue::List(_)) => Err(Unsupported::Unverified("prompt list or token ids")),
        _ => Err(Unsupported::VllmRejects("prompt missing")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::template::LoadOptions;

    const ECHO: &str = "{% for m in messages %}[{{ m.role }}|{{ m.content }}{% if m.tool_calls %}|{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% if m.reasoning_content is defined %}|r={{ m.reasoning_content }}{% endif %}]{% endfor %}{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% if add_generation_prompt %}<gen>{% endif %}{% if enable_thinking is defined %}think={{ enable_thinking }}{% endif %}";

    fn t() -> ChatTemplate {
        ChatTemplate::from_source(ECHO, &[], LoadOptions::default()).unwrap()
    }

    fn r(body: &str) -> Result<String, Unsupported> {
        render_chat(&t(), body.as_bytes()).map(|x| x.text)
    }

    #[test]
    fn text_parts_are_joined_with_newlines_and_empty_ones_dropped() {
        let got = r(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""},"b",{"type":"input_text","text":"c"},{"type":"text"}]}]}"#,
        );
        assert_eq!(got.unwrap(), "[user|a\nb\nc]<gen>");
    }

    #[test]
    fn developer_becomes_system_and_systems_are_consolidated() {
        let got = r(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"developer","content":"d"}]}"#,
        );
        assert_eq!(got.unwrap(), "[system|s\n\nd][user|u]<gen>");
        let got = r(r#"{"messages":[{"role":"developer","content":"d"},{"role":"user","content":"u"}]}"#);
        assert_eq!(got.unwrap(), "[system|d][user|u]<gen>");
    }

    #[test]
    fn tool_call_arguments_are_reparsed_and_bad_ones_become_empty() {
        let got = r(r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[
            {"id":"1","type":"function","function":{"name":"f","arguments":"{\"a\":1.50,\"a\":2,\"b\":\"é\"}"}},
            {"id":"2","type":"function","function":{"name":"f","arguments":"[1]"}},
            {"id":"3","type":"function","function":{"name":"f","arguments":"{bad"}},
            {"id":"4","type":"function","function":{"name":"f","arguments":""}}]}],"add_generation_prompt":false}"#);
        assert_eq!(got.unwrap(), r#"[assistant||{"a": 2, "b": "é"}{}{}{}]"#);
        let obj = r#"{"messages":[{"role":"assistant","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":{}}}]}]}"#;
        assert_eq!(r(obj), Err(Unsupported::VllmRejects("tool call arguments as an object")));
    }

    #[test]
    fn tools_are_rebuilt_in_vllm_shape() {
        let got = r(
            r#"{"messages":[{"role":"user","content":"u"}],"tools":[{"function":{"parameters":{"z":1e5,"a":true},"name":"f","extra":1},"defer_loading":true,"x":2}],"add_generation_prompt":false}"#,
        );
        assert_eq!(
            got.unwrap(),
            r#"[user|u]{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 100000.0, "a": true}, "defer_loading": true}, "defer_loading": true}"#
        );
    }

    #[test]
    fn reasoning_content_is_renamed_and_reasoning_wins() {
        let got = r(
            r#"{"messages":[{"role":"assistant","content":"x","reasoning_content":"rc"},{"role":"assistant","content":"y","reasoning":"r","reasoning_content":"rc"}],"add_generation_prompt":false}"#,
        );
        assert_eq!(got.unwrap(), "[assistant|x|r=rc][assistant|y|r=r]");
    }

    #[test]
    fn reasoning_effort_sets_enable_thinking_unless_given() {
        assert_eq!(
            r(r#"{"messages":[{"role":"user","content":"u"}],"reasoning_effort":"none"}"#).unwrap(),
            "[user|u]<gen>think=False"
        );
        assert_eq!(
            r(r#"{"messages":[{"role":"user","content":"u"}],"reasoning_effort":"low","chat_template_kwargs":{"enable_thinking":false}}"#).unwrap(),
            "[user|u]<gen>think=False"
        );
        // None and "auto" kwargs are dropped by merge_kwargs.
        assert_eq!(
            r(r#"{"messages":[{"role":"user","content":"u"}],"chat_template_kwargs":{"enable_thinking":null}}"#)
                .unwrap(),
            "[user|u]<gen>"
        );
    }

    #[test]
    fn continue_final_message_cuts_at_the_tag() {
        let got = r(
            r#"{"messages":[{"role":"user","content":"u"},{"role":"assistant","content":"Sure, "}],"continue_final_message":true,"add_generation_prompt":false}"#,
        );
        assert_eq!(got.unwrap(), "[user|u][assistant|Sure, ");
        let both = r#"{"messages":[{"role":"user","content":"u"}],"continue_final_message":true}"#;
        assert!(matches!(r(both), Err(Unsupported::VllmRejects(_))));
    }

    #[test]
    fn the_claude_code_billing_line_is_dropped_from_system_text() {
        let got = r(
            r#"{"messages":[{"role":"system","content":"x-anthropic-billing-header: cch=1\nreal"},{"role":"user","content":"x-anthropic-billing-header: u"}]}"#,
        );
        assert_eq!(got.unwrap(), "[system|real][user|x-anthropic-billing-header: u]<gen>");
    }

    #[test]
    fn every_unsupported_shape_says_why() {
        for (body, want) in [
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#, "media"),
            (r#"{"messages":[{"role":"user","content":"u"}],"chat_template":"x"}"#, "request_chat_template"),
            (
                r#"{"messages":[{"role":"user","content":"u"}],"chat_template_kwargs":{"chat_template":"x"}}"#,
                "request_chat_template",
            ),
            (
                r#"{"messages":[{"role":"user","content":"u"}],"chat_template_kwargs":{"tokenize":true}}"#,
                "reserved_template_kwarg",
            ),
            (r#"{"messages":[{"role":"user","content":"u"}],"echo":true}"#, "echo"),
            (r#"{"messages":[{"role":"user","content":"u"}],"add_special_tokens":true}"#, "add_special_tokens"),
            (r#"{"messages":[{"role":"user","content":"u"}],"truncate_prompt_tokens":5}"#, "truncation"),
            (
                r#"{"messages":[{"role":"user","content":"u"}],"kv_transfer_params":{"prompt_token_ids":[1]}}"#,
                "client_prompt_ids",
            ),
            (r#"{"messages":[{"role":"user","content":"\ud800"}]}"#, "lone_surrogate"),
            (r#"{"messages":[{"role":"user","content":null}]}"#, "vllm_rejects"),
            (r#"{"messages":[]}"#, "vllm_rejects"),
            (r#"{"messages":[{"role":"user","content":"u"}],"tools":[]}"#, "vllm_rejects"),
            (r#"{"messages":[{"role":"user","content":[{"type":"tool_reference","name":"f"}]}]}"#, "tool_reference"),
            (r#"{"messages":[{"role":"user","content":"u"}],"echo":"yes"}"#, "unverified_shape"),
            (r#"[1]"#, "body"),
        ] {
            assert_eq!(r(body).map_err(|e| e.label()), Err(want), "{body}");
        }
    }

    #[test]
    fn a_float_minijinja_prints_unlike_python_falls_back() {
        let tpl = |src: &str| ChatTemplate::from_source(src, &[], LoadOptions::default()).unwrap();
        let with = |x: &str| {
            format!(
                r#"{{"messages":[{{"role":"user","content":"u"}}],"tools":[{{"type":"function","function":{{"name":"f","parameters":{{"x":{x}}}}}}}]}}"#
            )
        };
        let render = |src: &str, x: &str| render_chat(&tpl(src), with(x).as_bytes()).map(|r| r.text);
        // printed on its own, a float is written as Python's str() writes it
        assert_eq!(render("{{ tools[0].function.parameters.x }}", "1e20"), Ok("1e+20".into()));
        assert_eq!(render("{{ tools[0].function.parameters.x }}", "NaN"), Ok("nan".into()));
        assert_eq!(render("{{ tools[0].function.parameters.x }}", "1.5"), Ok("1.5".into()));
        // inside a container or concatenated, minijinja's text differs from Python's: fall back
        assert_eq!(render("{{ tools[0].function.parameters }}", "1e20"), Err(Unsupported::FloatDisplay));
        assert_eq!(render("{{ 'x' ~ tools[0].function.parameters.x }}", "1e20"), Err(Unsupported::FloatDisplay));
        assert_eq!(render("{{ tools[0].function.parameters }}", "NaN"), Err(Unsupported::FloatDisplay));
        assert_eq!(render("{{ tools[0].function.parameters }}", "1.5"), Ok("{'x': 1.5}".into()));
        // tojson writes Python's json.dumps text, NaN included
        assert_eq!(render("{{ tools[0].function.parameters | tojson }}", "NaN"), Ok(r#"{"x": NaN}"#.into()));
        assert_eq!(
            render("{{ tools[0].function.parameters | tojson }}{{ tools[0].function.parameters }}", "NaN"),
            Err(Unsupported::FloatDisplay)
        );
    }

    #[test]
    fn completions_prompts_are_passed_as_is() {
        let c = render_completion(br#"{"prompt":"<|im_start|>x","max_tokens":1}"#).unwrap();
        assert_eq!(c, RenderedCompletion { text: "<|im_start|>x".into(), add_special_tokens: true });
        assert_eq!(render_completion(br#"{"prompt":[1,2]}"#).map_err(|e| e.label()), Err("unverified_shape"));
        assert_eq!(render_completion(br#"{"prompt":"x","echo":true}"#).map_err(|e| e.label()), Err("echo"));
    }
}
