//! One chat message as vLLM 0.32 hands it to the template: pydantic's validation,
//! `_parse_chat_message_content` (the "string" content format joins text parts, the "openai"
//! one keeps them as `{"type": "text", "text"}` parts; media refused), `_postprocess_messages`
//! (tool-call arguments parsed), and `_convert_developer_to_system`/
//! `_consolidate_system_messages` over the conversation.

use super::pyjson::{self, LoadsError, PyValue};
use super::request::loads_error;
use super::Unsupported;

/// A message as the template sees it: its keys in vLLM's order.
pub(super) type Message = Vec<(String, PyValue)>;

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

/// The first line Claude Code puts in its system prompt, which vLLM strips.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The message's role (empty when it has none).
pub(super) fn role_of(m: &[(String, PyValue)]) -> &str {
    m.iter().find(|(k, _)| k == "role").and_then(|(_, v)| v.as_str()).unwrap_or_default()
}

/// `_parse_chat_message_content`: role, content (joined text, or text parts when the
/// template reads `openai_parts`), then the fields the template may read, each checked as
/// pydantic would.
pub(super) fn parse_message(msg: &PyValue, openai_parts: bool) -> Result<Message, Unsupported> {
    let PyValue::Dict(_) = msg else {
        return Err(Unsupported::VllmRejects("message not an object"));
    };
    let role = match msg.get("role") {
        Some(PyValue::Str(r)) => r.clone(),
        _ => return Err(Unsupported::VllmRejects("message without a string role")),
    };
    let reasoning = reasoning(msg)?;
    let texts = content_texts(msg, &role, openai_parts)?;
    let content = if openai_parts {
        let part = |t: String| {
            PyValue::Dict(vec![("type".into(), PyValue::Str("text".into())), ("text".into(), PyValue::Str(t))])
        };
        PyValue::List(texts.into_iter().map(part).collect())
    } else {
        // `if parse_res:` drops empty texts before the join
        PyValue::Str(texts.into_iter().filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n"))
    };

    let mut out: Message = vec![("role".into(), PyValue::Str(role.clone())), ("content".into(), content)];
    if role == "assistant" {
        push_assistant_fields(&mut out, msg, reasoning)?;
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
    push_optional_string(&mut out, msg, "name", "name not a string")?;
    push_optional_string(&mut out, msg, "task", "task not a string")?;
    if role == "developer" {
        out.push(("tools".into(), msg.get("tools").cloned().unwrap_or(PyValue::Null)));
    }
    Ok(out)
}

/// The before-validator: `reasoning_content` becomes `reasoning` unless `reasoning` is set.
fn reasoning(msg: &PyValue) -> Result<Option<String>, Unsupported> {
    match (msg.get("reasoning"), msg.get("reasoning_content")) {
        (Some(PyValue::Str(r)), _) => Ok(Some(r.clone())),
        (None | Some(PyValue::Null), None | Some(PyValue::Null)) => Ok(None),
        (None | Some(PyValue::Null), Some(PyValue::Str(r))) => Ok(Some(r.clone())),
        _ => Err(Unsupported::Unverified("reasoning not a string")),
    }
}

/// The content's texts, part by part: a plain string is one part; parts without text are
/// skipped, and a system message's billing line is stripped first. As `openai_parts`, a part
/// with keys beyond its type and text is refused (vLLM would keep them in the part).
fn content_texts(msg: &PyValue, role: &str, openai_parts: bool) -> Result<Vec<String>, Unsupported> {
    let parts: Vec<&PyValue> = match msg.get("content") {
        // no `content` key: pydantic takes it (vLLM's custom message type) and vLLM parses
        // it as no parts, whatever the role (recorded for user and system turns)
        None => Vec::new(),
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
    if openai_parts && parts.iter().any(|p| has_own_keys(p)) {
        return Err(Unsupported::Unverified("content part with keys of its own"));
    }
    let mut texts = parts.into_iter().map(part_text).collect::<Result<Vec<_>, _>>()?;
    if role == "system" {
        // _strip_claude_code_billing_header: done before parsing, so it looks at each part.
        texts = strip_billing_header(msg, texts);
    }
    Ok(texts.into_iter().flatten().collect())
}

/// Whether a part object has keys besides its `type` and the key of its text.
fn has_own_keys(part: &PyValue) -> bool {
    let text = part.get("type").and_then(PyValue::as_str).and_then(text_key);
    match part {
        PyValue::Dict(items) => items.iter().any(|(k, _)| k != "type" && Some(k.as_str()) != text),
        _ => false,
    }
}

/// One content part's text (a string, or a text-like part; `None` when it has none and vLLM
/// skips it); media and unknown parts refused.
fn part_text(part: &PyValue) -> Result<Option<String>, Unsupported> {
    let items = match part {
        PyValue::Str(s) => return Ok(Some(s.clone())),
        PyValue::Dict(items) => items,
        _ => return Err(Unsupported::Unverified("content part neither string nor object")),
    };
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
        Some(PyValue::Str(s)) => Ok(Some(s.clone())),
        None | Some(PyValue::Null) => Ok(None), // skipped (logged by vLLM)
        Some(_) => Err(Unsupported::Unverified("content part text not a string")),
    }
}

/// Drops a leading billing-header line from each plain-string or "text" part (parts of other
/// types are kept as they are); a part left empty is dropped.
fn strip_billing_header(msg: &PyValue, texts: Vec<Option<String>>) -> Vec<Option<String>> {
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
        .filter_map(|(t, strippable)| match t {
            Some(t) if strippable && t.starts_with(BILLING_HEADER) => {
                let rest = t.split_once('\n').map(|(_, r)| r.to_string()).unwrap_or_default();
                (!rest.is_empty()).then_some(Some(rest))
            }
            other => Some(other),
        })
        .collect()
}

/// An assistant message's tool calls (when any) and reasoning, under both names the
/// templates read.
fn push_assistant_fields(out: &mut Message, msg: &PyValue, reasoning: Option<String>) -> Result<(), Unsupported> {
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
    Ok(())
}

/// Copies `key` when it is a string; null or absent is left out, another type refused with
/// `not_string`.
fn push_optional_string(
    out: &mut Message,
    msg: &PyValue,
    key: &str,
    not_string: &'static str,
) -> Result<(), Unsupported> {
    match msg.get(key) {
        Some(v @ PyValue::Str(_)) => out.push((key.into(), v.clone())),
        None | Some(PyValue::Null) => {}
        Some(_) => return Err(Unsupported::Unverified(not_string)),
    }
    Ok(())
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

/// `_convert_developer_to_system` then `_consolidate_system_messages`.
pub(super) fn developer_to_system(conversation: Vec<Message>) -> Vec<Message> {
    let converted: Vec<Message> = conversation
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
            let content = match m.iter().find(|(k, _)| k == "content").map(|(_, v)| v) {
                Some(PyValue::Str(s)) => s.clone(),
                // text parts: their texts joined with newlines, empty ones too
                Some(PyValue::List(parts)) => {
                    parts.iter().filter_map(|p| p.get("text").and_then(PyValue::as_str)).collect::<Vec<_>>().join("\n")
                }
                _ => String::new(),
            };
            if !content.is_empty() {
                system_contents.push(content);
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
