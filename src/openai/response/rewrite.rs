//! The rewrites of an engine's JSON answer (or one stream event's data) on its way to the
//! client: the prefill's cached-token count set in `usage`, and echoed ids hidden again when
//! the client did not ask for them.

use serde_json::value::RawValue;

use super::handoff::ids_key;
use crate::openai::cut::CutAnswer;
use crate::openai::json::{is_null, RawObject};
use crate::openai::Api;

/// Sets `usage.prompt_tokens_details.cached_tokens` in a response object, every byte outside
/// `usage` kept; `None` when the object has no non-null `usage` (nothing to change) or is not
/// an object.
pub fn rewrite_cached_tokens(text: &str, cached: u64) -> Option<Vec<u8>> {
    let top = RawObject::parse(text).ok()?;
    with_usage_detail(text, &top, "prompt_tokens_details", cached)
}

/// Sets the prefill's cached-token count in a response object or stream event of `api`:
/// chat/completions `usage.prompt_tokens_details.cached_tokens`; Responses
/// `usage.input_tokens_details.cached_tokens`, at the top (a JSON answer) or inside
/// `response` (the `response.completed` event; earlier events have `usage: null`).
/// `/v1/messages` reports no cached count on vLLM: nothing to set. `None`: unchanged.
pub fn rewrite_usage_cached(api: Api, text: &str, cached: u64) -> Option<Vec<u8>> {
    match api {
        Api::Chat | Api::Completions | Api::Generate => rewrite_cached_tokens(text, cached),
        Api::Messages => None,
        Api::Responses => {
            let top = RawObject::parse(text).ok()?;
            if top.has_non_null("usage") {
                return with_usage_detail(text, &top, "input_tokens_details", cached);
            }
            let response_text = top.get("response").filter(|r| !is_null(Some(r)))?;
            let response = RawObject::parse(response_text).ok()?;
            let rewritten = with_usage_detail(response_text, &response, "input_tokens_details", cached)?;
            replace_member(text, &top, "response", rewritten)
        }
    }
}

/// `text`, the object `obj` was parsed from, with `usage.<details>.cached_tokens` set to
/// `cached`; `None` when `obj` has no non-null `usage`.
fn with_usage_detail(text: &str, obj: &RawObject<'_>, details_key: &str, cached: u64) -> Option<Vec<u8>> {
    let usage = obj.get("usage").filter(|u| !is_null(Some(u)))?;
    replace_member(text, obj, "usage", usage_with_detail(usage, details_key, cached)?)
}

/// `text`, the object `obj` was parsed from, with the value of member `key` (which `obj` has)
/// replaced by `value`, every other byte as it came (written member by member, keys were
/// re-quoted and the whitespace between members dropped). A repeated `key` (never vLLM's) is
/// written once, at its first place, as parsers read the last.
fn replace_member(text: &str, obj: &RawObject<'_>, key: &str, value: Vec<u8>) -> Option<Vec<u8>> {
    if obj.keys().filter(|k| *k == key).nth(1).is_some() {
        let mut obj = obj.clone();
        obj.set_raw(key, String::from_utf8(value).ok()?);
        return Some(obj.to_bytes());
    }
    let old = obj.get(key)?;
    let start = (old.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let (before, after) = (text.as_bytes().get(..start)?, text.as_bytes().get(start + old.len()..)?);
    Some([before, &value, after].concat())
}

/// The `usage` object `usage_text` with `<details>.cached_tokens` set (the details object
/// made when absent or null).
fn usage_with_detail(usage_text: &str, details_key: &str, cached: u64) -> Option<Vec<u8>> {
    let mut usage = RawObject::parse(usage_text).ok()?;
    let details = match usage.get(details_key).filter(|d| !is_null(Some(d))) {
        Some(raw) => {
            let mut d = RawObject::parse(raw).ok()?;
            d.set_raw("cached_tokens", cached.to_string());
            d.to_bytes()
        }
        None => format!("{{\"cached_tokens\":{cached}}}").into_bytes(),
    };
    usage.set_raw(details_key, String::from_utf8(details).ok()?);
    Some(usage.to_bytes())
}

/// Returns a response object with the echoed token ids set back to `null`, as vLLM answers
/// when `return_token_ids` was not asked for: chat `prompt_token_ids` (top level) and
/// `choices[].token_ids`; completions `choices[].prompt_token_ids` and `choices[].token_ids`.
/// `None` when nothing had to change.
pub fn hide_token_ids(api: Api, text: &str) -> Option<Vec<u8>> {
    // Generate's `choices[].token_ids` are its answer; Messages echo nothing.
    if matches!(api, Api::Generate | Api::Messages) {
        return None;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn cached_tokens_rewrite_keeps_every_byte_outside_usage() {
        let text = "{ \"a\": 1.0,\n \"usage\" : {\"prompt_tokens\": 5} , \"b\":[1, 2e0], \"s\":\"\\u00e9\" }";
        let out = rewrite_cached_tokens(text, 3).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{ \"a\": 1.0,\n \"usage\" : {\"prompt_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":3}} , \"b\":[1, 2e0], \"s\":\"\\u00e9\" }"
        );
        // A repeated key: the last one is what parsers read; it is set, and written once.
        let out = rewrite_cached_tokens(r#"{"usage":{"x":1},"a":0,"usage":{"y":2}}"#, 4).unwrap();
        assert_eq!(out, br#"{"usage":{"y":2,"prompt_tokens_details":{"cached_tokens":4}},"a":0}"#);
        let event = "{\"response\": {\"usage\": {\"input_tokens\": 5}}, \"type\": \"response.completed\"}";
        assert_eq!(
            String::from_utf8(rewrite_usage_cached(Api::Responses, event, 2).unwrap()).unwrap(),
            "{\"response\": {\"usage\": {\"input_tokens\":5,\"input_tokens_details\":{\"cached_tokens\":2}}}, \"type\": \"response.completed\"}"
        );
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
}
