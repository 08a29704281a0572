//! A request body as vLLM 0.32's server reads it (Python's `json.loads`, pydantic's strict
//! bools), shared by both renderers, and the completions prompt, which vLLM tokenizes as
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
