//! vLLM 0.32's way from a chat completions request to the text its tokenizer gets, one step
//! per function in the order vLLM takes them: the request's settings (`ChatCompletionRequest`
//! validators), its messages (`parse_chat_messages`, `message.rs`), its tools, the developer
//! role, the template kwargs (`build_chat_params`/`merge_kwargs`), the render (transformers'
//! `apply_chat_template`, `template.rs`) and the post-processing of the rendered text.
//! Anything not proven equal to vLLM is an [`Unsupported`].

use minijinja::Value;

use super::message::{developer_to_system, parse_message, role_of, Message};
use super::pyjson::{self, PyValue};
use super::pyshims::to_value;
use super::request::{body, check_tool_choice, flag, is_set, refuse_unrendered_fields, tool_dump, Shape};
use super::template::{ChatTemplate, Rendering};
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

/// The kwargs `apply_chat_template` consumes by name; the rest become template variables.
const CONSUMED_KWARGS: [&str; 6] =
    ["tools", "tokenize", "documents", "add_generation_prompt", "continue_final_message", "return_dict"];

/// Renders an OpenAI chat completions request body as vLLM 0.32 renders it with `template`.
///
/// # Errors
/// [`Unsupported`]: the reason the request must take the engine's own rendering.
pub fn render_chat(template: &ChatTemplate, request: &[u8]) -> Result<RenderedChat, Unsupported> {
    // vLLM's preprocessing: request settings, messages, tools, developer role, template kwargs.
    let req = body(request)?;
    let RenderSettings { add_generation_prompt, continue_final, user_kwargs } = RenderSettings::read(&req)?;
    let openai_parts = template.reads_content_parts(false)?;
    if matches!(req.get("tools"), Some(PyValue::List(t)) if !t.is_empty())
        && template.reads_content_parts(true)? != openai_parts
    {
        return Err(Unsupported::Unverified("content format differs between the tool_use and default templates"));
    }
    let conversation = parse_chat_messages(&req, openai_parts)?;
    let message_shape = Shape::of_messages(&conversation);
    let tools = request_tools(&req, template)?;
    let with_tools = tools.is_some();
    let mut conversation = resolve_developer_role(conversation, template, with_tools)?;
    let kwargs = template_kwargs(&req, template, user_kwargs, add_generation_prompt, continue_final)?;

    // transformers' `apply_chat_template`: the context, the continue tag, the render.
    let mut context = template_variables(&kwargs)?;
    let final_content =
        if continue_final { Some(tag_final_message(&mut conversation, template, with_tools)?) } else { None };
    context.extend(named_arguments(&conversation, tools.as_deref(), &kwargs, add_generation_prompt)?);
    let floats = collect_unsafe_floats(&conversation, tools.as_deref(), &kwargs);
    let rendering = template.render(with_tools, context)?;

    // Post-processing: what minijinja printed unlike Python falls back; the continue cut.
    refuse_misprinted_floats(&rendering, &floats)?;
    let mut text = rendering.text;
    if let Some(final_content) = final_content {
        cut_at_continue_tag(&mut text, &final_content)?;
    }
    let shape = Shape { tools: with_tools, thinking: enable_thinking(&kwargs), continue_final, ..message_shape };
    Ok(RenderedChat { text, shape, reads_clock: rendering.reads_clock })
}

/// What the request asks of the render, read as `ChatCompletionRequest` validates it.
struct RenderSettings {
    /// `add_generation_prompt` (default true).
    add_generation_prompt: bool,
    /// `continue_final_message` (default false; vLLM refuses it with a generation prompt).
    continue_final: bool,
    /// `chat_template_kwargs` as sent.
    user_kwargs: Vec<(String, PyValue)>,
}

impl RenderSettings {
    /// Reads the settings, refusing those that change rendering or tokenizing in ways not
    /// done here (a request template, echo, special tokens, truncation, client ids).
    fn read(req: &PyValue) -> Result<Self, Unsupported> {
        if is_set(req, "chat_template") {
            return Err(Unsupported::RequestChatTemplate);
        }
        refuse_unrendered_fields(req)?;
        let add_generation_prompt = flag(req, "add_generation_prompt", true)?;
        let continue_final = flag(req, "continue_final_message", false)?;
        if continue_final && add_generation_prompt {
            return Err(Unsupported::VllmRejects("continue_final_message with add_generation_prompt"));
        }
        let user_kwargs = user_template_kwargs(req)?;
        Ok(RenderSettings { add_generation_prompt, continue_final, user_kwargs })
    }
}

/// `chat_template_kwargs`, refused when it carries a template or a key vLLM or transformers
/// consume themselves.
fn user_template_kwargs(req: &PyValue) -> Result<Vec<(String, PyValue)>, Unsupported> {
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
    Ok(user_kwargs)
}

/// `parse_chat_messages`: every message as the template will see it (`message.rs`), its
/// content as text parts when the template reads `openai_parts`.
fn parse_chat_messages(req: &PyValue, openai_parts: bool) -> Result<Vec<Message>, Unsupported> {
    match req.get("messages") {
        Some(PyValue::List(m)) if !m.is_empty() => m.iter().map(|m| parse_message(m, openai_parts)).collect(),
        Some(PyValue::List(_)) => Err(Unsupported::VllmRejects("empty messages")),
        _ => Err(Unsupported::VllmRejects("messages missing or not a list")),
    }
}

impl Shape {
    /// What the messages alone show, as sent (before developer turns become system).
    fn of_messages(conversation: &[Message]) -> Self {
        let mut shape = Shape::default();
        let mut user_turns = 0usize;
        for m in conversation {
            match role_of(m) {
                "system" | "developer" => shape.system = true,
                "user" => user_turns += 1,
                "tool" => shape.tool_results = true,
                _ => {}
            }
            if m.iter().any(|(k, _)| k == "tool_calls") {
                shape.tool_calls = true;
            }
        }
        shape.multi_turn = user_turns > 1;
        shape
    }
}

/// The request's `tools`, each rebuilt as `ChatCompletionToolsParam.model_dump()`; none when
/// `tool_choice` is "none" and the server runs with `--exclude-tools-when-tool-choice-none`.
fn request_tools(req: &PyValue, template: &ChatTemplate) -> Result<Option<Vec<PyValue>>, Unsupported> {
    check_tool_choice(req)?;
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
    let excluded = tool_choice_none && template.options.exclude_tools_when_tool_choice_none;
    Ok(if excluded { None } else { tools })
}

/// vLLM's developer role: messages become system ones when the template does not name the
/// role; a template that does sees the message's own tools after pydantic's validation,
/// which is not reproduced here.
fn resolve_developer_role(
    conversation: Vec<Message>,
    template: &ChatTemplate,
    with_tools: bool,
) -> Result<Vec<Message>, Unsupported> {
    let is_developer = |m: &Message| role_of(m) == "developer";
    if !conversation.iter().any(is_developer) {
        return Ok(conversation);
    }
    if !template.supports_developer(with_tools)? {
        return Ok(developer_to_system(conversation));
    }
    if conversation.iter().any(|m| is_developer(m) && m.iter().any(|(k, v)| k == "tools" && *v != PyValue::Null)) {
        return Err(Unsupported::Unverified("tools on a developer message"));
    }
    Ok(conversation)
}

/// The template kwargs vLLM passes: `build_chat_params` (its own over the request's
/// `chat_template_kwargs`), then `merge_kwargs` of those over `--default-chat-template-kwargs`.
fn template_kwargs(
    req: &PyValue,
    template: &ChatTemplate,
    user_kwargs: Vec<(String, PyValue)>,
    add_generation_prompt: bool,
    continue_final: bool,
) -> Result<Vec<(String, PyValue)>, Unsupported> {
    let documents = documents(req)?;
    let reasoning_effort = match req.get("reasoning_effort") {
        None | Some(PyValue::Null) => None,
        Some(PyValue::Str(s)) => Some(s.clone()),
        Some(_) => return Err(Unsupported::VllmRejects("reasoning_effort not a string")),
    };
    let mut extra: Vec<(String, PyValue)> = vec![
        ("add_generation_prompt".into(), PyValue::Bool(add_generation_prompt)),
        ("continue_final_message".into(), PyValue::Bool(continue_final)),
        ("documents".into(), documents.unwrap_or(PyValue::Null)),
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
    Ok(defaults)
}

/// The request's `documents`, checked to be pydantic's `list[dict[str, str]]`.
fn documents(req: &PyValue) -> Result<Option<PyValue>, Unsupported> {
    match req.get("documents") {
        None | Some(PyValue::Null) => Ok(None),
        Some(PyValue::List(docs)) => {
            for d in docs {
                match d {
                    PyValue::Dict(items) if items.iter().all(|(_, v)| matches!(v, PyValue::Str(_))) => {}
                    _ => return Err(Unsupported::Unverified("documents not a list of string dicts")),
                }
            }
            Ok(Some(PyValue::List(docs.clone())))
        }
        Some(_) => Err(Unsupported::Unverified("documents not a list")),
    }
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

/// The kwargs `apply_chat_template` does not consume by name, as template variables.
fn template_variables(kwargs: &[(String, PyValue)]) -> Result<Vec<(String, Value)>, Unsupported> {
    kwargs
        .iter()
        .filter(|(k, _)| !CONSUMED_KWARGS.contains(&k.as_str()))
        .map(|(k, v)| Ok((k.clone(), to_value(v)?)))
        .collect()
}

/// `enable_thinking` as the template gets it (`None`: not set, or not a bool).
fn enable_thinking(kwargs: &[(String, PyValue)]) -> Option<bool> {
    match kwargs.iter().rev().find(|(k, _)| k == "enable_thinking") {
        Some((_, PyValue::Bool(b))) => Some(*b),
        _ => None,
    }
}

/// transformers' `continue_final_message`: tags the final message's content so the render can
/// be cut there; returns the content as sent.
fn tag_final_message(
    conversation: &mut [Message],
    template: &ChatTemplate,
    with_tools: bool,
) -> Result<String, Unsupported> {
    if !template.source_contains(with_tools, "content")? {
        return Err(Unsupported::VllmRejects("continue_final_message: template has no content"));
    }
    let last = conversation.last_mut().ok_or(Unsupported::VllmRejects("empty messages"))?;
    match last.iter_mut().find(|(k, _)| k == "content") {
        Some((_, PyValue::Str(s))) => {
            let sent = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(sent)
        }
        // text parts: the last one with a text is continued
        Some((_, PyValue::List(parts))) => {
            let text = parts.iter_mut().rev().find_map(|p| match p {
                PyValue::Dict(items) => items.iter_mut().find(|(k, _)| k == "text").map(|(_, v)| v),
                _ => None,
            });
            match text {
                Some(PyValue::Str(s)) => {
                    let sent = s.clone();
                    s.push_str(CONTINUE_TAG);
                    Ok(sent)
                }
                _ => Err(Unsupported::VllmRejects("continue_final_message: final message has no text")),
            }
        }
        _ => Err(Unsupported::VllmRejects("continue_final_message: final message has no content")),
    }
}

/// The variables `apply_chat_template` passes by name: messages, tools, documents and
/// `add_generation_prompt`.
fn named_arguments(
    conversation: &[Message],
    tools: Option<&[PyValue]>,
    kwargs: &[(String, PyValue)],
    add_generation_prompt: bool,
) -> Result<[(String, Value); 4], Unsupported> {
    let messages =
        Value::from(conversation.iter().map(|m| to_value(&PyValue::Dict(m.clone()))).collect::<Result<Vec<_>, _>>()?);
    let tools = match tools {
        Some(t) => to_value(&PyValue::List(t.to_vec()))?,
        None => Value::from(()),
    };
    let documents = match kwargs.iter().find(|(k, _)| k == "documents") {
        Some((_, d)) => to_value(d)?,
        None => Value::from(()),
    };
    Ok([
        ("messages".into(), messages),
        ("tools".into(), tools),
        ("documents".into(), documents),
        ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
    ])
}

/// The minijinja text of every float whose Python `str()` differs (exponent form, NaN,
/// infinities), for the check that the template did not print one directly.
fn collect_unsafe_floats(
    conversation: &[Message],
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

/// Refuses a render that printed one of `floats` (from [`collect_unsafe_floats`]) as
/// minijinja writes it, not as Python would; `NaN`s that `tojson` wrote are Python's own.
fn refuse_misprinted_floats(rendering: &Rendering, floats: &[String]) -> Result<(), Unsupported> {
    let text = &rendering.text;
    for f in floats {
        let printed = if f == "NaN" { text.matches("NaN").count() > rendering.nan_by_tojson } else { text.contains(f) };
        if printed {
            return Err(Unsupported::FloatDisplay);
        }
    }
    Ok(())
}

/// transformers' continue cut: the text ends where the tagged final message ends (at the
/// tag, or before the whitespace in front of it when the template stripped the content);
/// refused when the final message is not in the render.
fn cut_at_continue_tag(text: &mut String, final_content: &str) -> Result<(), Unsupported> {
    let stripped = final_content.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c));
    let tag = CONTINUE_TAG.trim();
    if !text.contains(stripped) || !text.contains(tag) {
        return Err(Unsupported::VllmRejects("continue_final_message: final message not in the render"));
    }
    let at = text.rfind(tag).unwrap_or(text.len());
    if text.get(at..at + CONTINUE_TAG.len()) == Some(CONTINUE_TAG) {
        text.truncate(at);
    } else {
        text.truncate(at);
        let trimmed = text.trim_end_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)).len();
        text.truncate(trimmed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::load::LoadOptions;

    const ECHO: &str = "{% for m in messages %}[{{ m.role }}|{{ m.content }}{% if m.tool_calls %}|{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% if m.reasoning_content is defined %}|r={{ m.reasoning_content }}{% endif %}]{% endfor %}{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% if add_generation_prompt %}<gen>{% endif %}{% if enable_thinking is defined %}think={{ enable_thinking }}{% endif %}";

    fn t() -> ChatTemplate {
        ChatTemplate::from_source(ECHO, &[], LoadOptions::default()).unwrap()
    }

    fn r(body: &str) -> Result<String, Unsupported> {
        render_chat(&t(), body.as_bytes()).map(|x| x.text)
    }

    /// The `tool_choice` requests vLLM refuses before rendering are never rendered (so never
    /// sent token-in); the ones it accepts are.
    #[test]
    fn tool_choices_vllm_refuses_are_refused_as_vllm_rejects() {
        let tool = r#"{"type":"function","function":{"name":"f","parameters":{}}}"#;
        let with = |choice: &str, tools: &str| {
            r(&format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"tool_choice":{choice}{tools}}}"#))
                .map_err(|e| e.label())
        };
        let tools = format!(r#","tools":[{tool}]"#);
        for (choice, tools) in [
            (r#""required""#, ""),
            (r#""auto""#, ""),
            (r#"{"type":"function","function":{"name":"f"}}"#, ""),
            (r#"{"type":"function","function":{"name":"g"}}"#, tools.as_str()),
            (r#"{"type":"function","function":{"name":""}}"#, tools.as_str()),
            (r#"{"type":"function","function":{}}"#, tools.as_str()),
            (r#"{"type":"function"}"#, tools.as_str()),
            (r#""sometimes""#, tools.as_str()),
        ] {
            assert_eq!(with(choice, tools), Err("vllm_rejects"), "{choice}{tools}");
        }
        for (choice, tools) in [
            (r#""none""#, ""),
            ("null", ""),
            (r#""required""#, tools.as_str()),
            (r#""auto""#, tools.as_str()),
            (r#"{"type":"function","function":{"name":"f"}}"#, tools.as_str()),
        ] {
            assert!(with(choice, tools).is_ok(), "{choice}{tools}");
        }
    }

    #[test]
    fn text_parts_are_joined_with_newlines_and_empty_ones_dropped() {
        let got = r(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""},"b",{"type":"input_text","text":"c"},{"type":"text"}]}]}"#,
        );
        assert_eq!(got.unwrap(), "[user|a\nb\nc]<gen>");
    }

    /// A template that loops over a message's content gets vLLM's "openai" content format:
    /// every content a list of text parts, empty ones kept, textless ones skipped; a
    /// continued final message is cut after its last text part; developer turns merged into
    /// the system one join their parts with newlines (into a string).
    #[test]
    fn a_template_reading_parts_gets_text_parts() {
        let parts = "{% for m in messages %}[{{ m.role }}{% for p in m.content %}|{{ p.type }}:{{ p.text }}{% endfor %}]{% endfor %}";
        let t = ChatTemplate::from_source(parts, &[], LoadOptions::default()).unwrap();
        let r = |body: &str| render_chat(&t, body.as_bytes()).map(|r| r.text);
        let got = r(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""},"b",{"type":"text"}]},{"role":"assistant","content":null},{"role":"user","content":"c"}]}"#,
        );
        assert_eq!(got.unwrap(), "[user|text:a|text:|text:b][assistant][user|text:c]");
        let cont = r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"text","text":"x"},{"type":"text","text":"y "}]}],"continue_final_message":true,"add_generation_prompt":false}"#;
        assert_eq!(r(cont).unwrap(), "[user|text:q][assistant|text:x|text:y ");
        let dev = r#"{"messages":[{"role":"system","content":[{"type":"text","text":"s1"},{"type":"text","text":"s2"}]},{"role":"user","content":"u"},{"role":"developer","content":"d"}]}"#;
        // the merged system content is a string again (vLLM's `_consolidate_system_messages`),
        // so the loop walks its characters
        assert_eq!(r(dev).unwrap(), format!("[system{}][user|text:u]", "|:".repeat("s1\ns2\n\nd".len())));
        let own_keys = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{}}]}]}"#;
        assert!(matches!(r(own_keys), Err(Unsupported::Unverified(_))));
        // no content key: no parts at all (an empty string would be one empty part)
        assert_eq!(r(r#"{"messages":[{"role":"user"}]}"#).unwrap(), "[user]");
        assert_eq!(r(r#"{"messages":[{"role":"user","content":""}]}"#).unwrap(), "[user|text:]");
    }

    /// A message without a `content` key is taken as vLLM takes it, whatever its role: no
    /// parts, so an empty string to a template that prints it (a null content is refused).
    #[test]
    fn a_message_without_content_renders_as_empty() {
        assert_eq!(r(r#"{"messages":[{"role":"system"},{"role":"user"}]}"#).unwrap(), "[system|][user|]<gen>");
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
}
