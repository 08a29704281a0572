//! What a 2xx prefill answer hands to the decode: its prompt ids (validated in one pass,
//! kept as a slice of the answer where they can be), `kv_transfer_params` byte for byte, and
//! the usage counts (prompt tokens, cached tokens).

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::openai::cut::CutAnswer;
use crate::openai::ids::{IdsError, PromptIds};
use crate::openai::json::is_null;
use crate::openai::Api;

/// Why the prefill's ids cannot be reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdsFault {
    /// The response carried no prompt ids.
    Missing,
    /// The ids failed validation.
    Invalid(IdsError),
}

/// What the prefill leg hands to the decode leg.
#[derive(Debug, Clone)]
pub struct Handoff {
    /// The prefill's `kv_transfer_params`, raw, when not null.
    pub kv_transfer_params: Option<String>,
    /// The echoed prompt ids, validated against `usage.prompt_tokens`.
    pub ids: Result<PromptIds, IdsFault>,
    /// The prefill's `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// The prefill's `usage.prompt_tokens`, when reported.
    pub prompt_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct PrefillResponse<'a> {
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    /// Parsed per API: chat/completions and Responses/Messages name their counts apart.
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<Vec<PrefillChoice<'a>>>,
    /// Responses with `enable_response_messages`: `[{"message","tokens","type"}]`.
    #[serde(borrow, default)]
    input_messages: Option<Vec<RawMessageTokens<'a>>>,
}

#[derive(Deserialize)]
struct RawMessageTokens<'a> {
    #[serde(borrow, default)]
    tokens: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct PrefillChoice<'a> {
    #[serde(borrow, default)]
    prompt_token_ids: Option<&'a RawValue>,
}

/// Chat/completions usage.
#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

/// Responses/Messages usage.
#[derive(Deserialize)]
struct InputUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    input_tokens_details: Option<Details>,
}

/// The prompt token count and its details, from `usage` as `api` shapes it.
fn usage_counts(api: Api, usage: Option<&RawValue>) -> Result<(Option<u64>, Option<Details>), HandoffError> {
    let Some(raw) = usage.map(RawValue::get).filter(|raw| !is_null(Some(raw))) else { return Ok((None, None)) };
    let err = |e: serde_json::Error| HandoffError(e.to_string());
    Ok(match api {
        Api::Chat | Api::Completions | Api::Generate => {
            let u: Usage = serde_json::from_str(raw).map_err(err)?;
            (u.prompt_tokens, u.prompt_tokens_details)
        }
        Api::Responses | Api::Messages => {
            let u: InputUsage = serde_json::from_str(raw).map_err(err)?;
            (u.input_tokens, u.input_tokens_details)
        }
    })
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// A 2xx prefill answer that is not a completion response (the parser's complaint inside).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("prefill answer is not a completion response: {0}")]
pub struct HandoffError(pub String);

/// Reads the handoff from a 2xx prefill body.
///
/// # Errors
/// [`HandoffError`] when the body is not a JSON object of the expected shape.
pub fn extract_handoff(api: Api, body: &[u8]) -> Result<Handoff, HandoffError> {
    extract_handoff_within(api, body, None)
}

/// [`extract_handoff`], with every id also checked to be below `vocab` (the route's
/// tokenizer) in the same validation pass.
///
/// # Errors
/// [`HandoffError`] when the body is not a JSON object of the expected shape.
pub fn extract_handoff_within(api: Api, body: &[u8], vocab: Option<u32>) -> Result<Handoff, HandoffError> {
    extract_from(api, body, None, vocab)
}

/// [`extract_handoff_within`] on the answer's own buffer: the ids it returns are a slice of
/// `body`, not a copy.
///
/// # Errors
/// As [`extract_handoff_within`].
pub fn extract_handoff_shared(api: Api, body: &Bytes, vocab: Option<u32>) -> Result<Handoff, HandoffError> {
    extract_from(api, body, Some(body), vocab)
}

fn extract_from(api: Api, body: &[u8], source: Option<&Bytes>, vocab: Option<u32>) -> Result<Handoff, HandoffError> {
    // Long prompts: the id arrays cut out, validated and counted in one pass, serde on the
    // rest. Anything the cut cannot vouch for (a value spanning a cut, ids not cut, a parse
    // error, whose message must point into the real answer) reads the whole answer.
    if let Some(cut) = ids_key(api).and_then(|key| CutAnswer::new(body, key, vocab)) {
        if let Ok(Some(handoff)) = read_handoff(api, cut.rest(), Some((&cut, source)), vocab) {
            return Ok(handoff);
        }
    }
    // Without a cut every value is the answer's own: there is always an answer.
    read_handoff(api, body, None, vocab)?.ok_or_else(|| HandoffError("unreadable".to_owned()))
}

/// The text that precedes an API's echoed id array in vLLM's compact JSON.
pub(super) fn ids_key(api: Api) -> Option<&'static [u8]> {
    match api {
        Api::Chat | Api::Completions => Some(b"\"prompt_token_ids\":["),
        Api::Responses => Some(b"\"tokens\":["),
        Api::Messages | Api::Generate => None,
    }
}

/// The handoff from `text`: the whole answer (`cut` `None`), or its rest after `cut` (with
/// the answer's buffer, when the ids may be kept as a slice of it), where `Ok(None)` says
/// the cut cannot be vouched for.
fn read_handoff(
    api: Api,
    text: &[u8],
    cut: Option<(&CutAnswer<'_>, Option<&Bytes>)>,
    vocab: Option<u32>,
) -> Result<Option<Handoff>, HandoffError> {
    let (cut, source) = (cut.map(|(c, _)| c), cut.and_then(|(_, s)| s));
    let resp: PrefillResponse<'_> = serde_json::from_slice(text).map_err(|e| HandoffError(e.to_string()))?;
    let raw_ids = match api {
        Api::Chat => resp.prompt_token_ids,
        Api::Completions => resp.choices.as_ref().and_then(|c| c.first()).and_then(|c| c.prompt_token_ids),
        // One prompt, one raw message (vLLM's SimpleContext); more would be a multi-turn
        // tool loop, whose first entry is not the whole prompt.
        Api::Responses => match resp.input_messages.as_deref() {
            Some([only]) => only.tokens,
            _ => None,
        },
        Api::Messages | Api::Generate => None,
    }
    .filter(|raw| raw.get() != "null");
    let kv = resp.kv_transfer_params.map(RawValue::get).filter(|raw| !is_null(Some(raw)));
    let spans_a_cut = |raw: Option<&str>| raw.is_some_and(|raw| cut.is_some_and(|c| c.spans_a_cut(raw)));
    if spans_a_cut(kv) || spans_a_cut(resp.usage.map(RawValue::get)) {
        return Ok(None);
    }
    let (expected, details) = usage_counts(api, resp.usage)?;
    let ids = match raw_ids {
        None => Err(IdsFault::Missing),
        Some(raw) => match (expected, cut.and_then(|c| c.ids_of(raw))) {
            (None, _) => Err(IdsFault::Invalid(IdsError::Malformed("usage's prompt token count missing"))),
            (Some(n), Some(ids)) => {
                PromptIds::counted_in(source, ids.raw, ids.count, Some(n)).map_err(IdsFault::Invalid)
            }
            (Some(_), None) if spans_a_cut(Some(raw.get())) => return Ok(None),
            (Some(n), None) => PromptIds::parse_within(raw.get(), Some(n), vocab).map_err(IdsFault::Invalid),
        },
    };
    let cached_tokens = details.and_then(|d| d.cached_tokens);
    Ok(Some(Handoff { kv_transfer_params: kv.map(str::to_owned), ids, cached_tokens, prompt_tokens: expected }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_handoff_reads_top_level_ids() {
        let body = br#"{"id":"x","prompt_token_ids":[1,2,3],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2}},"kv_transfer_params":{"remote_port":5600,"x":1.0}}"#;
        let h = extract_handoff(Api::Chat, body).unwrap();
        assert_eq!(h.ids.unwrap().as_json(), "[1,2,3]");
        assert_eq!(h.kv_transfer_params.as_deref(), Some(r#"{"remote_port":5600,"x":1.0}"#));
        assert_eq!(h.cached_tokens, Some(2));
    }

    #[test]
    fn completions_handoff_reads_first_choice() {
        let body = br#"{"choices":[{"prompt_token_ids":[9,8]}],"usage":{"prompt_tokens":2},"kv_transfer_params":null}"#;
        let h = extract_handoff(Api::Completions, body).unwrap();
        assert_eq!(h.ids.unwrap().len(), 2);
        assert_eq!(h.kv_transfer_params, None);
        assert_eq!(h.cached_tokens, None);
    }

    #[test]
    fn missing_or_bad_ids_are_faults_not_errors() {
        let h = extract_handoff(Api::Chat, br#"{"prompt_token_ids":null,"usage":{"prompt_tokens":2}}"#).unwrap();
        assert_eq!(h.ids.unwrap_err(), IdsFault::Missing);
        let h = extract_handoff(Api::Chat, br#"{"prompt_token_ids":[1,2],"usage":{"prompt_tokens":3}}"#).unwrap();
        assert!(matches!(h.ids.unwrap_err(), IdsFault::Invalid(IdsError::CountMismatch { .. })));
        let h = extract_handoff(Api::Chat, br#"{"prompt_token_ids":[1,-2],"usage":{"prompt_tokens":2}}"#).unwrap();
        assert!(matches!(h.ids.unwrap_err(), IdsFault::Invalid(IdsError::Malformed(_))));
        assert!(extract_handoff(Api::Chat, b"<html>").is_err());
    }

    #[test]
    fn responses_handoff_reads_input_messages_tokens() {
        let body = br#"{"usage":{"input_tokens":3,"input_tokens_details":{"cached_tokens":1}},"input_messages":[{"message":"x","tokens":[5,6,7],"type":"raw_message_tokens"}],"kv_transfer_params":{"a":1}}"#;
        let h = extract_handoff(Api::Responses, body).unwrap();
        assert_eq!(h.ids.unwrap().as_json(), "[5,6,7]");
        assert_eq!((h.cached_tokens, h.kv_transfer_params.as_deref()), (Some(1), Some(r#"{"a":1}"#)));
        let none = extract_handoff(Api::Responses, br#"{"usage":{"input_tokens":3},"input_messages":null}"#).unwrap();
        assert_eq!(none.ids.unwrap_err(), IdsFault::Missing);
        let two = br#"{"usage":{"input_tokens":1},"input_messages":[{"tokens":[1]},{"tokens":[2]}]}"#;
        assert_eq!(extract_handoff(Api::Responses, two).unwrap().ids.unwrap_err(), IdsFault::Missing);
        let short = br#"{"usage":{"input_tokens":4},"input_messages":[{"tokens":[1,2]}]}"#;
        assert!(matches!(extract_handoff(Api::Responses, short).unwrap().ids, Err(IdsFault::Invalid(_))));
    }

    #[test]
    fn messages_handoff_has_no_ids() {
        let h = extract_handoff(Api::Messages, br#"{"prompt_token_ids":[1],"usage":{"input_tokens":1}}"#).unwrap();
        assert_eq!(h.ids.unwrap_err(), IdsFault::Missing);
    }
}
