//! Engine responses: what the prefill hands over (ids, `kv_transfer_params`, cached tokens),
//! and the few rewrites of a decode or prefill response tokenonce makes on the way back.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::cut::CutAnswer;
use super::ids::{IdsError, PromptIds};
use super::json::{is_null, RawObject};
use super::request::Api;
use crate::sse::{Event, SseDecoder};

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
        Api::Chat | Api::Completions => {
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
fn ids_key(api: Api) -> Option<&'static [u8]> {
    match api {
        Api::Chat | Api::Completions => Some(b"\"prompt_token_ids\":["),
        Api::Responses => Some(b"\"tokens\":["),
        Api::Messages => None,
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
        Api::Messages => None,
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

/// Sets `usage.prompt_tokens_details.cached_tokens` in a response object; `None` when the
/// object has no non-null `usage` (nothing to change) or is not an object.
pub fn rewrite_cached_tokens(text: &str, cached: u64) -> Option<Vec<u8>> {
    let mut top = RawObject::parse(text).ok()?;
    let usage_raw = top.get("usage").filter(|u| !is_null(Some(u)))?;
    let mut usage = RawObject::parse(usage_raw).ok()?;
    let details = match usage.get("prompt_tokens_details").filter(|d| !is_null(Some(d))) {
        Some(raw) => {
            let mut d = RawObject::parse(raw).ok()?;
            d.set_raw("cached_tokens", cached.to_string());
            d.to_bytes()
        }
        None => format!("{{\"cached_tokens\":{cached}}}").into_bytes(),
    };
    usage.set_raw("prompt_tokens_details", String::from_utf8(details).ok()?);
    let usage = String::from_utf8(usage.to_bytes()).ok()?;
    top.set_raw("usage", usage);
    Some(top.to_bytes())
}

/// Sets the prefill's cached-token count in a response object or stream event of `api`:
/// chat/completions `usage.prompt_tokens_details.cached_tokens`; Responses
/// `usage.input_tokens_details.cached_tokens`, at the top (a JSON answer) or inside
/// `response` (the `response.completed` event; earlier events have `usage: null`).
/// `/v1/messages` reports no cached count on vLLM: nothing to set. `None`: unchanged.
pub fn rewrite_usage_cached(api: Api, text: &str, cached: u64) -> Option<Vec<u8>> {
    match api {
        Api::Chat | Api::Completions => rewrite_cached_tokens(text, cached),
        Api::Messages => None,
        Api::Responses => {
            let mut top = RawObject::parse(text).ok()?;
            if top.has_non_null("usage") {
                return set_usage_detail(&mut top, "input_tokens_details", cached).map(|()| top.to_bytes());
            }
            let mut response = RawObject::parse(top.get("response").filter(|r| !is_null(Some(r)))?).ok()?;
            set_usage_detail(&mut response, "input_tokens_details", cached)?;
            top.set_raw("response", String::from_utf8(response.to_bytes()).ok()?);
            Some(top.to_bytes())
        }
    }
}

/// Sets `usage.<details>.cached_tokens` in `obj`; `None` when it has no non-null `usage`.
fn set_usage_detail(obj: &mut RawObject<'_>, details_key: &str, cached: u64) -> Option<()> {
    let mut usage = RawObject::parse(obj.get("usage").filter(|u| !is_null(Some(u)))?).ok()?;
    let details = match usage.get(details_key).filter(|d| !is_null(Some(d))) {
        Some(raw) => {
            let mut d = RawObject::parse(raw).ok()?;
            d.set_raw("cached_tokens", cached.to_string());
            d.to_bytes()
        }
        None => format!("{{\"cached_tokens\":{cached}}}").into_bytes(),
    };
    usage.set_raw(details_key, String::from_utf8(details).ok()?);
    obj.set_raw("usage", String::from_utf8(usage.to_bytes()).ok()?);
    Some(())
}

/// Returns a response object with the echoed token ids set back to `null`, as vLLM answers
/// when `return_token_ids` was not asked for: chat `prompt_token_ids` (top level) and
/// `choices[].token_ids`; completions `choices[].prompt_token_ids` and `choices[].token_ids`.
/// `None` when nothing had to change.
pub fn hide_token_ids(api: Api, text: &str) -> Option<Vec<u8>> {
    // Long prompts: the echoed arrays cut out first (they are what becomes `null`), so the
    // parse reads only the rest; a kept value spanning a cut sends it to the whole answer.
    if let Some(cut) = ids_key(api).and_then(|key| CutAnswer::new(text.as_bytes(), key, None)) {
        if let Some(hidden) = std::str::from_utf8(cut.rest()).ok().and_then(|rest| hide_ids_in(api, rest, Some(&cut))) {
            return hidden;
        }
    }
    hide_ids_in(api, text, None).flatten()
}

/// [`hide_token_ids`] on `text`: the whole answer, or (`cut`) its rest, where the outer
/// `None` says a value kept in the output spans a cut (it would read `[]`).
fn hide_ids_in(api: Api, text: &str, cut: Option<&CutAnswer<'_>>) -> Option<Option<Vec<u8>>> {
    let whole = |obj: &RawObject<'_>| cut.is_none_or(|c| obj.values().all(|v| !c.spans_a_cut(v)));
    let Ok(mut top) = RawObject::parse(text) else { return Some(None) };
    let mut changed = false;
    if api == Api::Responses {
        // Responses echo through `enable_response_messages`: both raw message lists.
        for key in ["input_messages", "output_messages"] {
            if top.has_non_null(key) {
                top.set_raw(key, "null");
                changed = true;
            }
        }
        return whole(&top).then(|| changed.then(|| top.to_bytes()));
    }
    if api == Api::Chat && top.has_non_null("prompt_token_ids") {
        top.set_raw("prompt_token_ids", "null");
        changed = true;
    }
    if let Some(choices_raw) = top.get("choices") {
        let Ok(choices) = serde_json::from_str::<Vec<&RawValue>>(choices_raw) else { return Some(None) };
        let mut out = Vec::with_capacity(choices_raw.len());
        out.push(b'[');
        for (i, choice) in choices.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let Ok(mut c) = RawObject::parse(choice.get()) else { return Some(None) };
            for key in ["prompt_token_ids", "token_ids"] {
                if c.has_non_null(key) {
                    c.set_raw(key, "null");
                    changed = true;
                }
            }
            if !whole(&c) {
                return None;
            }
            c.write_to(&mut out);
        }
        out.push(b']');
        if changed {
            let Ok(choices) = String::from_utf8(out) else { return Some(None) };
            top.set_raw("choices", choices);
        }
    }
    whole(&top).then(|| changed.then(|| top.to_bytes()))
}

fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Rewrites a response stream event by event: each SSE event whose data is a JSON object
/// is passed through `rewrite` (which returns JSON text, or `None` to leave the event
/// alone); events it leaves alone keep their exact bytes.
pub struct SseRewriter<F> {
    decoder: SseDecoder,
    rewrite: F,
}

impl<F: FnMut(&str) -> Option<Vec<u8>>> SseRewriter<F> {
    /// A rewriter applying `rewrite` to each event's JSON data.
    pub fn new(rewrite: F) -> Self {
        Self { decoder: SseDecoder::new(), rewrite }
    }

    /// Feeds upstream bytes; returns the bytes ready for the client (possibly empty).
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        let events = self.decoder.feed(chunk);
        let mut out = Vec::with_capacity(chunk.len() + 64);
        for event in events {
            emit(&event, &mut self.rewrite, &mut out);
        }
        out
    }

    /// Ends the stream; returns whatever followed the last event (an unterminated tail or
    /// trailing blank lines) unchanged, so nothing is dropped.
    pub fn finish(self) -> Vec<u8> {
        self.decoder.into_pending()
    }
}

/// False when `raw` (an event's bytes) cannot hold a `usage` member, so no rewrite applies
/// and its JSON is not parsed (most events of a stream): neither the key's text nor a `\u`
/// escape (`"\u0075sage"` is the same key) appears in it.
fn may_hold_usage(raw: &[u8]) -> bool {
    memchr::memmem::find(raw, b"usage").is_some() || memchr::memmem::find(raw, b"\\u").is_some()
}

/// Appends `event` to `out`: `rewrite`'s version of its JSON data, else its exact bytes.
fn emit(event: &Event, rewrite: &mut impl FnMut(&str) -> Option<Vec<u8>>, out: &mut Vec<u8>) {
    let rewritten = Some(event)
        .filter(|e| may_hold_usage(e.raw()))
        .and_then(Event::data)
        .filter(|d| d.iter().find(|b| !is_json_ws(**b)) == Some(&b'{'))
        .and_then(|d| String::from_utf8(d).ok())
        .and_then(|d| rewrite(&d));
    match rewritten {
        Some(data) => {
            // The event's other fields first (`event: response.completed` names the event).
            for line in event.other_lines() {
                out.extend_from_slice(line);
                // A line read as ending in CR came with CRLF after it: written back with a
                // bare LF it would lose that CR and read as another field.
                out.extend_from_slice(if line.ends_with(b"\r") { b"\r\n" } else { b"\n" });
            }
            // One `data:` line: in JSON text a CR or LF can only be whitespace between
            // tokens (strings escape them), and either would end the SSE line early.
            out.extend_from_slice(b"data: ");
            out.extend(data.iter().map(|&b| if b == b'\n' || b == b'\r' { b' ' } else { b }));
            out.extend_from_slice(b"\n\n");
        }
        None => out.extend_from_slice(event.raw()),
    }
}

/// The framing of a relayed decode stream: only complete events go to the client, each as
/// soon as its blank line arrives, with their exact bytes (or, given `cached_tokens`, with
/// `usage.prompt_tokens_details.cached_tokens` set). An event the engine cut by breaking the
/// stream is dropped, so an error event after it starts on a line of its own.
#[derive(Debug)]
pub struct StreamFraming {
    decoder: SseDecoder,
    cached_tokens: Option<u64>,
    api: Api,
    max_event: usize,
    /// A complete event over `max_event` was seen (and it and all after it dropped).
    overlong: bool,
}

impl StreamFraming {
    /// Framing for one chat or completions stream; `cached_tokens` as the prefill reported
    /// it. No event limit.
    pub fn new(cached_tokens: Option<u64>) -> Self {
        Self::for_api(Api::Chat, cached_tokens)
    }

    /// Framing for one stream of `api` (whose usage shape the rewrite follows).
    pub fn for_api(api: Api, cached_tokens: Option<u64>) -> Self {
        Self { decoder: SseDecoder::new(), cached_tokens, api, max_event: usize::MAX, overlong: false }
    }

    /// The same framing, with [`Self::too_long`] true once an event (complete, or still
    /// being received) is longer than `max_event` bytes; that event is never emitted, and
    /// the relay then ends the stream. Memory stays bounded by `max_event` plus one read.
    pub fn with_event_limit(self, max_event: usize) -> Self {
        Self { max_event, ..self }
    }

    /// True when an event longer than the limit was seen or is being received.
    pub fn too_long(&self) -> bool {
        self.overlong || self.decoder.pending() > self.max_event
    }

    /// Feeds engine bytes; returns the complete events among them (possibly none), up to
    /// the first one over the limit.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        let events = self.decoder.feed(chunk);
        let mut out = Vec::with_capacity(chunk.len());
        for event in &events {
            if self.overlong || event.raw().len() > self.max_event {
                self.overlong = true;
                break;
            }
            match self.cached_tokens {
                Some(n) => emit(event, &mut |d: &str| rewrite_usage_cached(self.api, d, n), &mut out),
                None => out.extend_from_slice(event.raw()),
            }
        }
        out
    }

    /// The stream ended cleanly: whatever followed the last event (a last event without its
    /// blank line, trailing blank lines) is passed as it came.
    pub fn end(self) -> Vec<u8> {
        self.decoder.into_pending()
    }

    /// The stream broke: the unfinished event is dropped; returns how many bytes that was.
    pub fn broken(self) -> usize {
        self.decoder.pending()
    }
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
    fn cached_tokens_rewrite_creates_or_updates_details() {
        let out =
            rewrite_cached_tokens(r#"{"a":1.0,"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}"#, 3).unwrap();
        assert_eq!(out, br#"{"a":1.0,"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":3}}}"#);
        let out =
            rewrite_cached_tokens(r#"{"usage":{"prompt_tokens_details":{"cached_tokens":5,"audio_tokens":0}}}"#, 1)
                .unwrap();
        assert_eq!(out, br#"{"usage":{"prompt_tokens_details":{"cached_tokens":1,"audio_tokens":0}}}"#);
        assert_eq!(rewrite_cached_tokens(r#"{"usage":null}"#, 1), None);
        assert_eq!(rewrite_cached_tokens(r#"{"choices":[]}"#, 1), None);
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

    #[test]
    fn responses_usage_rewrite_sets_input_tokens_details() {
        let json = r#"{"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0}}}"#;
        assert_eq!(
            rewrite_usage_cached(Api::Responses, json, 4).unwrap(),
            br#"{"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":4,"cache_write_tokens":0}}}"#
        );
        let completed =
            r#"{"response":{"id":"r","usage":{"input_tokens":5}},"sequence_number":9,"type":"response.completed"}"#;
        assert_eq!(
            rewrite_usage_cached(Api::Responses, completed, 2).unwrap(),
            br#"{"response":{"id":"r","usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":2}}},"sequence_number":9,"type":"response.completed"}"#
        );
        let created = r#"{"response":{"id":"r","usage":null},"type":"response.created"}"#;
        assert_eq!(rewrite_usage_cached(Api::Responses, created, 2), None);
        assert_eq!(rewrite_usage_cached(Api::Responses, r#"{"delta":"x"}"#, 2), None);
        assert_eq!(rewrite_usage_cached(Api::Messages, r#"{"usage":{"input_tokens":5}}"#, 2), None);
    }

    #[test]
    fn hide_token_ids_nulls_responses_raw_messages() {
        let body = r#"{"output":[],"input_messages":[{"tokens":[1]}],"output_messages":[{"tokens":[2]}]}"#;
        assert_eq!(
            hide_token_ids(Api::Responses, body).unwrap(),
            br#"{"output":[],"input_messages":null,"output_messages":null}"#
        );
        assert_eq!(hide_token_ids(Api::Responses, r#"{"input_messages":null}"#), None);
    }

    #[test]
    fn hidden_ids_keep_a_cut_array_that_stays_in_the_answer() {
        // The echo is cut and nulled; the same key inside `kv_transfer_params` is cut too but
        // kept, so the answer is read whole for it: its ids come back as they were.
        let chat = r#"{"choices":[{"token_ids":[9]}],"prompt_token_ids":[1,2,3],"kv_transfer_params":{"prompt_token_ids":[4,5]}}"#;
        let want = r#"{"choices":[{"token_ids":null}],"prompt_token_ids":null,"kv_transfer_params":{"prompt_token_ids":[4,5]}}"#;
        assert_eq!(String::from_utf8(hide_token_ids(Api::Chat, chat).unwrap()).unwrap(), want);
        let cmpl = r#"{"choices":[{"prompt_token_ids":[1,2],"token_ids":[7],"text":"a"}],"id":"x"}"#;
        let want = r#"{"choices":[{"prompt_token_ids":null,"token_ids":null,"text":"a"}],"id":"x"}"#;
        assert_eq!(String::from_utf8(hide_token_ids(Api::Completions, cmpl).unwrap()).unwrap(), want);
    }

    #[test]
    fn hide_token_ids_nulls_echoes() {
        let chat = r#"{"choices":[{"index":0,"token_ids":[5]}],"prompt_token_ids":[1,2]}"#;
        assert_eq!(
            hide_token_ids(Api::Chat, chat).unwrap(),
            br#"{"choices":[{"index":0,"token_ids":null}],"prompt_token_ids":null}"#
        );
        let cmpl = r#"{"choices":[{"prompt_token_ids":[1],"token_ids":[2]}]}"#;
        assert_eq!(
            hide_token_ids(Api::Completions, cmpl).unwrap(),
            br#"{"choices":[{"prompt_token_ids":null,"token_ids":null}]}"#
        );
        assert_eq!(hide_token_ids(Api::Chat, r#"{"choices":[{"token_ids":null}],"prompt_token_ids":null}"#), None);
    }

    #[test]
    fn sse_rewriter_touches_only_usage_events() {
        let stream = b"data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":4}}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut rw = SseRewriter::new(|d: &str| rewrite_cached_tokens(d, 2));
            let mut out = rw.feed(&stream[..cut]);
            out.extend(rw.feed(&stream[cut..]));
            out.extend(rw.finish());
            assert_eq!(
                String::from_utf8(out).unwrap(),
                "data: {\"choices\":[{\"delta\":{}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\n\ndata: [DONE]\n\n"
            );
        }
    }

    #[test]
    fn sse_rewriter_keeps_multi_line_data_one_event() {
        let stream =
            b"data: {\"usage\":{\"prompt_tokens\":1},\ndata: \"x\":[1,\r\ndata: 2]}\n\ndata:   {\"usage\":{}}\n\n";
        let mut rw = SseRewriter::new(|d: &str| rewrite_cached_tokens(d, 2));
        let mut out = rw.feed(stream);
        out.extend(rw.finish());
        let events = SseDecoder::new().feed(&out);
        assert_eq!(events.len(), 2, "{}", String::from_utf8_lossy(&out));
        let first: serde_json::Value = serde_json::from_slice(&events[0].data().unwrap()).unwrap();
        assert_eq!(first["x"], serde_json::json!([1, 2]));
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        let second: serde_json::Value = serde_json::from_slice(&events[1].data().unwrap()).unwrap();
        assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    }

    #[test]
    fn framing_flags_an_event_longer_than_its_limit() {
        let mut f = StreamFraming::new(None).with_event_limit(16);
        assert_eq!(f.feed(b"data: {\"a\":1}\n\ndata: {\"b\":"), b"data: {\"a\":1}\n\n");
        assert!(!f.too_long(), "10 bytes pending");
        assert!(f.feed(b"\"0123456789\"").is_empty());
        assert!(f.too_long(), "22 bytes pending, limit 16");
        let mut f = StreamFraming::new(None).with_event_limit(16);
        assert_eq!(
            f.feed(b"data: 1\n\ndata: {\"b\":\"0123456789\"}\n\ndata: 2\n\n"),
            b"data: 1\n\n",
            "stops at the long one"
        );
        assert!(f.too_long(), "a whole event over the limit counts too");
    }

    #[test]
    fn a_rewritten_event_keeps_its_other_lines_as_they_read() {
        // `data\r` (a field named "data\r", written `data\r\r\n`) must not come back as
        // `data\r\n`, which reads as an empty data line.
        let stream = b"data\r\r\nevent: e\ndata: {\"usage\":{\"prompt_tokens\":3}}\n\n";
        let mut framing = StreamFraming::new(Some(7));
        let out = framing.feed(stream);
        let events = crate::sse::SseDecoder::new().feed(&out);
        let before = crate::sse::SseDecoder::new().feed(stream);
        let want = rewrite_cached_tokens(&String::from_utf8(before[0].data().unwrap()).unwrap(), 7).unwrap();
        assert_eq!(events[0].data().unwrap(), want);
        assert_eq!(events[0].other_lines().collect::<Vec<_>>(), before[0].other_lines().collect::<Vec<_>>());
    }

    #[test]
    fn only_events_that_can_hold_usage_are_parsed_and_an_escaped_key_still_counts() {
        // Deltas without usage pass as they came (even when their JSON would not parse);
        // a usage key spelled with a `\u` escape is the same key and is rewritten.
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {not json\n\n";
        assert_eq!(StreamFraming::new(Some(7)).feed(stream), stream.to_vec());
        let escaped = b"data: {\"\\u0075sage\":{\"prompt_tokens\":3}}\n\n";
        let out = StreamFraming::new(Some(7)).feed(escaped);
        let events = crate::sse::SseDecoder::new().feed(&out);
        let data: serde_json::Value = serde_json::from_slice(&events[0].data().unwrap()).unwrap();
        assert_eq!(data["usage"]["prompt_tokens_details"]["cached_tokens"], 7);
        assert!(may_hold_usage(br#"{"usage":null}"#) && !may_hold_usage(br#"{"u":"sage"}"#));
    }

    #[test]
    fn sse_rewriter_hands_back_trailing_blank_lines() {
        for stream in [&b"data: [DONE]\n\n\n"[..], b"\r\n", b"data: {\"a\":1}\n\n\r\n\r"] {
            let mut rw = SseRewriter::new(|_: &str| None);
            let mut out = rw.feed(stream);
            out.extend(rw.finish());
            assert_eq!(out, stream);
        }
    }
}
