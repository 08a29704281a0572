//! A request body as vLLM 0.32's server reads it (Python's `json.loads`, pydantic's strict
//! bools, its tool and `tool_choice` checks, the fields no renderer here reproduces), shared by
//! every renderer, the request's shape, and the completions prompt, which vLLM tokenizes as
//! sent. The chat render is `chat.rs`.

use super::pyjson::{self, LoadsError, PyValue};
use super::Unsupported;

/// The body as a Python dict: UTF-8 without a byte order mark, read by `json.loads`.
pub(super) fn body(bytes: &[u8]) -> Result<PyValue, Unsupported> {
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

/// A `json.loads` failure as a fallback reason (surrogates and huge integers named apart).
pub(super) fn loads_error(e: LoadsError) -> Unsupported {
    match e {
        LoadsError::LoneSurrogate(_) => Unsupported::LoneSurrogate,
        LoadsError::IntTooLong(_) => Unsupported::BigInteger,
        other => Unsupported::Body(other.to_string()),
    }
}

/// A field read as pydantic's `bool` (strictly: JSON booleans or null/absent).
pub(super) fn flag(req: &PyValue, key: &str, default: bool) -> Result<bool, Unsupported> {
    match req.get(key) {
        None => Ok(default),
        Some(PyValue::Bool(b)) => Ok(*b),
        Some(PyValue::Null) => Err(Unsupported::Unverified("null where vLLM wants a bool")),
        Some(_) => Err(Unsupported::Unverified("non-bool where vLLM wants a bool")),
    }
}

/// Whether the field is present and not null.
pub(super) fn is_set(req: &PyValue, key: &str) -> bool {
    !matches!(req.get(key), None | Some(PyValue::Null))
}

/// Refuses the chat fields that change the ids in ways no renderer here does (echo, special
/// tokens added to a chat prompt, truncation, the client's own prompt ids): every family.
pub(super) fn refuse_unrendered_fields(req: &PyValue) -> Result<(), Unsupported> {
    if flag(req, "echo", false)? {
        return Err(Unsupported::Echo);
    }
    if flag(req, "add_special_tokens", false)? {
        return Err(Unsupported::AddSpecialTokens);
    }
    if is_set(req, "truncate_prompt_tokens") {
        return Err(Unsupported::Truncation);
    }
    if req.get("kv_transfer_params").and_then(|k| k.get("prompt_token_ids")).is_some() {
        return Err(Unsupported::ClientPromptIds);
    }
    Ok(())
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
/// [`Unsupported`]: lists, token ids, embeddings, `suffix`, `echo`, truncation; an empty or
/// missing prompt, which vLLM's request model refuses (`validate_prompt_and_prompt_embeds`)
/// whatever the tokenizer would make of it (a tokenizer that adds BOS gives `""` one id, which
/// vLLM would take token-in).
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
        Some(PyValue::Str(s)) if s.is_empty() => Err(Unsupported::VllmRejects("empty prompt")),
        Some(PyValue::Str(s)) => Ok(RenderedCompletion { text: s.clone(), add_special_tokens }),
        Some(PyValue::List(_)) => Err(Unsupported::Unverified("prompt list or token ids")),
        _ => Err(Unsupported::VllmRejects("prompt missing")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_prompts_are_passed_as_is() {
        let c = render_completion(br#"{"prompt":"<|im_start|>x","max_tokens":1}"#).unwrap();
        assert_eq!(c, RenderedCompletion { text: "<|im_start|>x".into(), add_special_tokens: true });
        assert_eq!(render_completion(br#"{"prompt":[1,2]}"#).map_err(|e| e.label()), Err("unverified_shape"));
        assert_eq!(render_completion(br#"{"prompt":"x","echo":true}"#).map_err(|e| e.label()), Err("echo"));
    }

    /// vLLM refuses an empty or missing prompt when it reads the request, before tokenizing:
    /// never rendered, so never sent token-in, whatever ids the tokenizer gives `""`.
    #[test]
    fn an_empty_prompt_is_refused_as_vllm_does() {
        for body in [r#"{"prompt":""}"#, r#"{"prompt":null}"#, "{}"] {
            assert_eq!(render_completion(body.as_bytes()).map_err(|e| e.label()), Err("vllm_rejects"), "{body}");
        }
        assert!(render_completion(br#"{"prompt":" "}"#).is_ok(), "a space is a prompt");
    }
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

/// The `tool_choice` rules of vLLM's `check_tool_usage` (it validates the request before any
/// rendering and answers 400): a choice other than `none` needs `tools`; a string must be
/// `auto` or `required`; a named choice needs `function.name`, a non-empty string naming one
/// of `tools`. Such a request is sent as text, for vLLM to refuse in its own words.
pub(super) fn check_tool_choice(req: &PyValue) -> Result<(), Unsupported> {
    let choice = match req.get("tool_choice") {
        None | Some(PyValue::Null) => return Ok(()),
        Some(PyValue::Str(s)) if s == "none" => return Ok(()),
        Some(choice) => choice,
    };
    let Some(PyValue::List(tools)) = req.get("tools") else {
        return Err(Unsupported::VllmRejects("tool_choice without tools"));
    };
    match choice {
        PyValue::Str(s) if s == "auto" || s == "required" => Ok(()),
        PyValue::Dict(_) => {
            let Some(PyValue::Str(name)) = choice.get("function").and_then(|f| f.get("name")) else {
                return Err(Unsupported::VllmRejects("tool_choice without a function name"));
            };
            let named = |tool: &PyValue| matches!(tool.get("function").and_then(|f| f.get("name")), Some(PyValue::Str(n)) if n == name);
            if name.is_empty() || !tools.iter().any(named) {
                return Err(Unsupported::VllmRejects("tool_choice names no tool of tools"));
            }
            Ok(())
        }
        _ => Err(Unsupported::VllmRejects("tool_choice not none, auto, required or a named tool")),
    }
}

/// `ChatCompletionToolsParam(**tool).model_dump()`.
pub(super) fn tool_dump(tool: &PyValue) -> Result<PyValue, Unsupported> {
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
