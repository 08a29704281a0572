//! The client request: a light view of the fields that decide reuse (parsed once), and the
//! two rewrites that turn it into the prefill leg and the decode leg, as byte splices.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::error::ApiError;
use super::ids::PromptIds;
use super::json::{is_null, Pieces, RawObject, IDS_HOLE};
use super::{Api, FallbackReason};

/// The shape of a completions `prompt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptShape {
    /// One string (or a chat request, which has messages instead).
    Text,
    /// One list of token ids: already token-in.
    Tokens,
    /// Several prompts (a list of strings or of id lists).
    Batch,
}

/// What tokenonce needs to know about a client request, read once from its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestView {
    /// The API of the path it came on.
    pub api: Api,
    /// `model`, when a string.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// `n` (default 1).
    pub n: u64,
    /// `echo: true`.
    pub echo: bool,
    /// Any message content part that is not text (image, audio, video, file, ...).
    pub has_media: bool,
    /// The completions prompt shape (chat: always `Text`).
    pub prompt: PromptShape,
    /// The client's own echo request: `return_token_ids: true` (Responses:
    /// `enable_response_messages: true`).
    pub return_token_ids: bool,
    /// Responses: the request needs server-side state the prefill engine does not have
    /// (`previous_response_id`, `conversation`, `background: true`).
    pub stateful: bool,
    /// vLLM refuses the request when it reads it, for a field the prefill leg rewrites
    /// ([`rewrite_hides_refusal`]): the prefill would take it, the decode would refuse it.
    pub rewrite_hides_refusal: bool,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

/// A generate request's `sampling_params`, as far as tokenonce reads them.
#[derive(Deserialize)]
struct SamplingParams {
    #[serde(default)]
    n: Option<u64>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<std::borrow::Cow<'a, str>>,
}

fn field<'a, T: Deserialize<'a>>(obj: &'a RawObject<'a>, key: &'static str) -> Result<Option<T>, ApiError> {
    match obj.get(key) {
        None => Ok(None),
        Some(raw) if raw.trim() == "null" => Ok(None),
        Some(raw) => serde_json::from_str(raw)
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("`{key}` has the wrong type: {e}"), Some(key))),
    }
}

/// False when `raw` (messages or input items) provably has no typed content part, so needs
/// no second parse: every part has a `"type"` key, and text inside strings has its quotes
/// escaped, so only the bare token `"type"` or a `\u` escape (`"typ\u0065"` is `"type"` too)
/// can make one. One pass over its quotes and backslashes.
fn may_hold_typed_parts(raw: &str) -> bool {
    let bytes = raw.as_bytes();
    memchr::memchr2_iter(b'"', b'\\', bytes).any(|at| {
        let from = bytes.get(at..).unwrap_or_default();
        from.starts_with(b"\"type\"") || from.starts_with(b"\\u")
    })
}

fn messages_have_media(raw: &str) -> Result<bool, ApiError> {
    if !may_hold_typed_parts(raw) {
        return Ok(false);
    }
    let messages: Vec<Message<'_>> = serde_json::from_str(raw)
        .map_err(|e| ApiError::invalid(format!("`messages` must be an array of objects: {e}"), Some("messages")))?;
    for message in messages {
        let Some(content) = message.content else {
            continue;
        };
        if !content.get().trim_start().starts_with('[') {
            continue;
        }
        let parts: Vec<Part<'_>> = serde_json::from_str(content.get())
            .map_err(|e| ApiError::invalid(format!("message content parts must be objects: {e}"), Some("messages")))?;
        if parts.iter().any(|p| p.kind.as_deref().is_some_and(|k| k != "text")) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Responses `input` items: a content part other than text (`input_text`, `output_text`,
/// `reasoning_text`, `summary_text`, `refusal`, a chat-style `text`) is media
/// (`input_image`, `input_file`, `input_audio`, ...).
fn responses_input_has_media(raw: &str) -> Result<bool, ApiError> {
    if !may_hold_typed_parts(raw) {
        return Ok(false);
    }
    let items: Vec<Message<'_>> = serde_json::from_str(raw).map_err(|e| {
        ApiError::invalid(format!("`input` must be a string or an array of objects: {e}"), Some("input"))
    })?;
    for item in items {
        let Some(content) = item.content.filter(|c| c.get().trim_start().starts_with('[')) else { continue };
        let parts: Vec<Part<'_>> = serde_json::from_str(content.get())
            .map_err(|e| ApiError::invalid(format!("input content parts must be objects: {e}"), Some("input")))?;
        let text = |k: &str| {
            matches!(k, "input_text" | "output_text" | "text" | "refusal" | "reasoning_text" | "summary_text")
        };
        if parts.iter().any(|p| p.kind.as_deref().is_some_and(|k| !text(k))) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether vLLM 0.32's chat and completions request models refuse `obj` for a field the
/// prefill leg rewrites (it sets `stream: false` and drops `stream_options`), so only the
/// decode would refuse it: `stream_options` set (Python-truthy) without `stream`
/// (`validate_stream_options`), or `prompt_logprobs` above 0 or -1 with `stream`
/// (`check_logprobs`).
pub fn rewrite_hides_refusal(obj: &RawObject<'_>, stream: bool) -> bool {
    let stream_options = obj.get("stream_options").is_some_and(truthy);
    let prompt_logprobs =
        obj.get("prompt_logprobs").and_then(|raw| raw.trim().parse::<f64>().ok()).is_some_and(|v| v > 0.0 || v == -1.0);
    (stream_options && !stream) || (prompt_logprobs && stream)
}

/// Python's truth value of a JSON value's text: false for null, false, zero, `""`, `{}`, `[]`.
fn truthy(raw: &str) -> bool {
    let raw = raw.trim();
    let empty_container = |open: char, close: char| {
        raw.strip_prefix(open).and_then(|r| r.strip_suffix(close)).is_some_and(|inner| inner.trim().is_empty())
    };
    let zero = raw.parse::<f64>().is_ok_and(|v| v == 0.0);
    !(matches!(raw, "null" | "false" | "\"\"") || zero || empty_container('{', '}') || empty_container('[', ']'))
}

fn prompt_shape(raw: Option<&str>) -> PromptShape {
    let Some(raw) = raw.map(str::trim) else {
        return PromptShape::Text;
    };
    if !raw.starts_with('[') {
        return PromptShape::Text;
    }
    let inner = raw.strip_prefix('[').unwrap_or(raw).trim_start();
    match inner.as_bytes().first() {
        Some(b'"' | b'[') => {
            // A one-element list of strings is still one prompt, but vLLM treats a list as
            // a batch of engine requests; keep it out of the P/D rewrite either way.
            PromptShape::Batch
        }
        _ => PromptShape::Tokens,
    }
}

impl RequestView {
    /// Reads the view from a parsed body.
    ///
    /// # Errors
    /// [`ApiError::InvalidRequest`] when a field tokenonce reads has the wrong type.
    pub fn parse(api: Api, obj: &RawObject<'_>) -> Result<Self, ApiError> {
        let model: Option<String> = field(obj, "model")?;
        let stream = field::<bool>(obj, "stream")?.unwrap_or(false);
        let n = field::<u64>(obj, "n")?.unwrap_or(1);
        let echo = field::<bool>(obj, "echo")?.unwrap_or(false);
        let return_token_ids = match api.echo_field() {
            Some(key) => field::<bool>(obj, key)?.unwrap_or(false),
            None => false,
        };
        let (has_media, prompt) = match api {
            Api::Chat | Api::Messages => {
                let messages =
                    obj.get("messages").ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
                (messages_have_media(messages)?, PromptShape::Text)
            }
            Api::Responses => {
                let input = obj.get("input").ok_or_else(|| ApiError::invalid("`input` is required", Some("input")))?;
                // A string input is text; a list holds items whose content parts are typed.
                let listed = input.trim_start().starts_with('[');
                (listed && responses_input_has_media(input)?, PromptShape::Text)
            }
            Api::Completions => (false, prompt_shape(obj.get("prompt"))),
            Api::Generate => return Self::parse_generate(obj, model, stream),
        };
        let stateful = api == Api::Responses
            && (obj.has_non_null("previous_response_id")
                || obj.has_non_null("conversation")
                || field::<bool>(obj, "background")?.unwrap_or(false));
        let rewrite_hides_refusal = matches!(api, Api::Chat | Api::Completions) && rewrite_hides_refusal(obj, stream);
        Ok(Self { api, model, stream, n, echo, has_media, prompt, return_token_ids, stateful, rewrite_hides_refusal })
    }

    /// The view of a generate request: `token_ids` (its prompt, always ids) and
    /// `sampling_params` (where its limits sit) are required, as vLLM requires them; media
    /// come as `content_parts` or `features`.
    fn parse_generate(obj: &RawObject<'_>, model: Option<String>, stream: bool) -> Result<Self, ApiError> {
        // Present is enough: the id array is the engine's to validate (not scanned again here).
        if !obj.has_non_null("token_ids") {
            return Err(ApiError::invalid("`token_ids` is required", Some("token_ids")));
        }
        let required = || ApiError::invalid("`sampling_params` is required, as an object", Some("sampling_params"));
        let raw = obj.get("sampling_params").filter(|raw| raw.trim_start().starts_with('{')).ok_or_else(required)?;
        let params: SamplingParams = serde_json::from_str(raw).map_err(|e| {
            ApiError::invalid(format!("`sampling_params` has the wrong type: {e}"), Some("sampling_params"))
        })?;
        let has_media = obj.has_non_null("content_parts") || obj.has_non_null("features");
        Ok(Self {
            api: Api::Generate,
            model,
            stream,
            n: params.n.unwrap_or(1),
            echo: false,
            has_media,
            prompt: PromptShape::Tokens,
            return_token_ids: false,
            stateful: false,
            rewrite_hides_refusal: false,
        })
    }

    /// Why this request must not reuse prefill ids, if it must not.
    pub fn reuse_blocker(&self) -> Option<FallbackReason> {
        if self.api == Api::Generate {
            // Its prompt is ids already: the decode gets them as the client sent them.
            Some(FallbackReason::PromptIsTokens)
        } else if self.api.echo_field().is_none() {
            Some(FallbackReason::IdsNotEchoed)
        } else if self.has_media {
            Some(FallbackReason::Media)
        } else if self.echo {
            Some(FallbackReason::Echo)
        } else if self.n > 1 {
            Some(FallbackReason::NGreaterThanOne)
        } else if self.prompt == PromptShape::Batch {
            Some(FallbackReason::BatchPrompt)
        } else if self.prompt == PromptShape::Tokens {
            Some(FallbackReason::PromptIsTokens)
        } else {
            None
        }
    }
}

/// The `kv_transfer_params` every prefill leg carries (vLLM's toy proxy, NIXL pull).
pub const PREFILL_KV_TRANSFER_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The prefill leg: token limits to 1 (Responses: `max_output_tokens`), `min_*` removed, not
/// streamed, ids echoed when `want_ids` (the API's [`Api::echo_field`]), and the
/// remote-decode `kv_transfer_params`. Responses prefills are also `store: false`: the
/// 1-token answer must not land in the prefill engine's response store (unbounded, and
/// never read: later turns go to the decode, which stores the real answer).
/// Other fields keep their bytes.
/// Large values found in `shared` (the client body's buffer) are referenced, not copied.
pub fn prefill_body(client: &RawObject<'_>, shared: Option<&Bytes>, api: Api, want_ids: bool) -> Pieces {
    let mut obj = client.clone();
    one_token(&mut obj, api);
    if let Some(key) = api.echo_field().filter(|_| want_ids) {
        obj.set_raw(key, "true");
    }
    obj.set_raw("kv_transfer_params", PREFILL_KV_TRANSFER_PARAMS);
    obj.to_pieces(shared, None, None)
}

/// The prefill leg token-in, with tokenonce's own `ids` (`local_ids = "on"`): as
/// [`prefill_body`] without asking the echo, and the prompt given as ids (chat:
/// `kv_transfer_params.prompt_token_ids` next to the remote-decode params, which vLLM 0.32
/// reads on any chat request and then neither renders nor tokenizes; completions: `prompt`).
/// Other APIs get [`prefill_body`] with the echo.
pub fn prefill_body_token_in(client: &RawObject<'_>, shared: Option<&Bytes>, api: Api, ids: &PromptIds) -> Pieces {
    let mut obj = client.clone();
    one_token(&mut obj, api);
    match api {
        Api::Chat => {
            let mut kv = RawObject::parse(PREFILL_KV_TRANSFER_PARAMS).unwrap_or_default();
            kv.set_raw("prompt_token_ids", IDS_HOLE);
            obj.set_raw("kv_transfer_params", "null");
            obj.to_pieces(shared, Some(("kv_transfer_params", &kv)), Some(ids.shared()))
        }
        Api::Completions => {
            obj.set_raw("prompt", IDS_HOLE);
            obj.set_raw("kv_transfer_params", PREFILL_KV_TRANSFER_PARAMS);
            obj.to_pieces(shared, None, Some(ids.shared()))
        }
        Api::Responses | Api::Messages | Api::Generate => prefill_body(client, shared, api, true),
    }
}

/// One token, not streamed: the API's token limit (`max_completion_tokens` only when
/// present: it wins over `max_tokens` in chat) to 1, `min_*` removed (vLLM refuses
/// `min_tokens > max_tokens`), `stream: false`, `stream_options` removed (refused without
/// `stream`); a Responses leg is not stored.
fn one_token(obj: &mut RawObject<'_>, api: Api) {
    if api == Api::Generate {
        one_token_sampling(obj);
    } else {
        obj.set_raw(api.limit_field(), "1");
        if obj.get("max_completion_tokens").is_some() {
            obj.set_raw("max_completion_tokens", "1");
        }
        obj.remove("min_tokens");
        obj.remove("min_completion_tokens");
    }
    obj.set_raw("stream", "false");
    obj.remove("stream_options");
    if api == Api::Responses {
        obj.set_raw("store", "false");
    }
}

/// Generate's limits, inside `sampling_params`: `max_tokens` 1, `min_tokens` removed (vLLM
/// refuses `min_tokens > max_tokens`); the prompt's echo (`return_token_ids`) is not asked,
/// as no prefill answer's ids are read. A `sampling_params` that is not an object is left
/// for the engine to refuse.
fn one_token_sampling(obj: &mut RawObject<'_>) {
    obj.remove("return_token_ids");
    let Some(mut params) = obj.get("sampling_params").and_then(|raw| RawObject::parse(raw).ok()) else { return };
    params.set_raw(Api::Generate.limit_field(), "1");
    params.remove("min_tokens");
    let bytes = params.to_bytes();
    // Valid UTF-8: every piece came from `&str`s.
    if let Ok(text) = String::from_utf8(bytes) {
        obj.set_raw("sampling_params", text);
    }
}

/// The release leg, from a decode body of `api`: the same request (its
/// `kv_transfer_params`, its prompt) for one token, not streamed, without echoed ids, so
/// the decode engine pulls the prefill's KV blocks (which frees them) at the least cost;
/// its answer is discarded. `None` when `decode` is not a JSON object.
pub fn release_body(decode: &[u8], api: Api) -> Option<Vec<u8>> {
    let mut obj = RawObject::parse_bytes(decode).ok()?;
    one_token(&mut obj, api);
    obj.remove("return_token_ids");
    if let Some(key) = api.echo_field() {
        obj.remove(key);
    }
    Some(obj.to_bytes())
}

/// Merges `ids` into a `kv_transfer_params` object text (or a fresh object when absent/null).
pub fn kv_params_with_ids(kv_transfer_params: Option<&str>, ids: &PromptIds) -> String {
    let mut kv = match kv_transfer_params.filter(|raw| !is_null(Some(raw))) {
        Some(raw) => RawObject::parse(raw).unwrap_or_default(),
        None => RawObject::new(),
    };
    kv.set_raw("prompt_token_ids", ids.as_json());
    // Valid UTF-8 by construction: every piece came from `&str`s.
    String::from_utf8(kv.to_bytes()).unwrap_or_default()
}

/// The decode leg: the client's body with the prefill's `kv_transfer_params` and, when
/// `ids` is given, the token-in form (chat, Responses, Messages:
/// `kv_transfer_params.prompt_token_ids`, which vLLM 0.32 reads on all three;
/// completions: `prompt = ids`). The client's limits, `stream*` and `return_token_ids` stay.
/// Neither the ids nor large values found in `shared` (the client body's buffer) are copied:
/// they are pieces of their own.
pub fn decode_body(
    client: &RawObject<'_>,
    shared: Option<&Bytes>,
    api: Api,
    kv_transfer_params: Option<&str>,
    ids: Option<&PromptIds>,
) -> Pieces {
    let mut obj = client.clone();
    let kv = kv_transfer_params.filter(|raw| !is_null(Some(raw)));
    let hole = ids.map(PromptIds::shared);
    match (api, ids) {
        (Api::Chat | Api::Responses | Api::Messages, Some(_)) => {
            let mut kv_obj = kv.and_then(|raw| RawObject::parse(raw).ok()).unwrap_or_default();
            kv_obj.set_raw("prompt_token_ids", IDS_HOLE);
            obj.set_raw("kv_transfer_params", "null");
            return obj.to_pieces(shared, Some(("kv_transfer_params", &kv_obj)), hole);
        }
        (Api::Completions, Some(_)) => {
            obj.set_raw("prompt", IDS_HOLE);
            if let Some(kv) = kv {
                obj.set_raw("kv_transfer_params", kv);
            }
        }
        // Generate's prompt is ids already: never given other ids.
        (Api::Generate, _) | (_, None) => {
            if let Some(kv) = kv {
                obj.set_raw("kv_transfer_params", kv);
            }
        }
    }
    obj.to_pieces(shared, None, hole)
}

/// A JSON string value's text, when `raw` is one without escapes (ids are plain ASCII).
fn plain_string(raw: &str) -> Option<&str> {
    let inner = raw.trim().strip_prefix('"')?.strip_suffix('"')?;
    (!inner.contains(['\\', '"'])).then_some(inner)
}

/// The stored answer a Responses request follows up on (`previous_response_id`).
pub fn previous_response_id<'o>(obj: &'o RawObject<'_>) -> Option<&'o str> {
    obj.get("previous_response_id").and_then(plain_string)
}

/// A Responses request whose answer vLLM stores (`store` absent or true): the id it will be
/// stored under, which vLLM 0.32 takes from the body's `request_id` (default: a fresh
/// `resp_<uuid>`). A body without one gets one here, in vLLM's own form, so the id is known
/// before the answer comes: `Some((id, Some(body with it)))`; with the client's own,
/// `Some((id, None))`. `None`: not stored, or a `request_id` that is not a plain string.
pub fn stored_response_id<'a>(obj: &RawObject<'a>) -> Option<(String, Option<RawObject<'a>>)> {
    if obj.get("store").is_some_and(|v| v.trim() != "true") {
        return None;
    }
    match obj.get("request_id") {
        Some(raw) => plain_string(raw).map(|id| (id.to_owned(), None)),
        None => {
            let id = format!("resp_{}", uuid::Uuid::new_v4().simple());
            let mut named = obj.clone();
            named.set_raw("request_id", format!("\"{id}\""));
            Some((id, Some(named)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_responses_request_names_its_answer() {
        fn parse(text: &str) -> RawObject<'_> {
            RawObject::parse(text).unwrap()
        }
        let (id, named) = stored_response_id(&parse(r#"{"input":"hi"}"#)).unwrap();
        assert!(id.starts_with("resp_") && id.len() == 37, "{id}");
        assert_eq!(named.unwrap().get("request_id"), Some(format!("\"{id}\"").as_str()));
        let own = parse(r#"{"input":"hi","request_id":"resp_mine","store":true}"#);
        assert_eq!(stored_response_id(&own).map(|(id, named)| (id, named.is_none())), Some(("resp_mine".into(), true)));
        for not_stored in [r#"{"store":false}"#, r#"{"store":null}"#, r#"{"request_id":7}"#, r#"{"request_id":"a\"b"}"#]
        {
            assert!(stored_response_id(&parse(not_stored)).is_none(), "{not_stored}");
        }
        assert_eq!(previous_response_id(&parse(r#"{"previous_response_id":"resp_1"}"#)), Some("resp_1"));
        assert_eq!(previous_response_id(&parse(r#"{"previous_response_id":null}"#)), None);
    }

    fn view(api: Api, body: &str) -> RequestView {
        RequestView::parse(api, &RawObject::parse(body).unwrap()).unwrap()
    }

    /// The refusals only the decode would make (the prefill leg sets `stream: false` and
    /// drops `stream_options`), read with Python's truth values as vLLM's validators read them.
    #[test]
    fn refusals_the_prefill_rewrite_hides_are_seen() {
        let hides =
            |api, fields: &str| view(api, &format!(r#"{{"messages":[],"prompt":"x"{fields}}}"#)).rewrite_hides_refusal;
        for (fields, refused) in [
            (r#","stream_options":{"include_usage":true}"#, true),
            (r#","stream_options":{"include_usage":true},"stream":false"#, true),
            (r#","stream_options":{"include_usage":true},"stream":true"#, false),
            (r#","stream_options":{ }"#, false),
            (r#","stream_options":null"#, false),
            (r#","stream_options":0"#, false),
            (r#","stream_options":" ""#, true),
            (r#","prompt_logprobs":1,"stream":true"#, true),
            (r#","prompt_logprobs":-1,"stream":true"#, true),
            (r#","prompt_logprobs":0,"stream":true"#, false),
            (r#","prompt_logprobs":1"#, false),
            ("", false),
        ] {
            assert_eq!(hides(Api::Chat, fields), refused, "chat {fields}");
            assert_eq!(hides(Api::Completions, fields), refused, "completions {fields}");
        }
        let responses = view(Api::Responses, r#"{"input":"x","stream_options":{"include_usage":true}}"#);
        assert!(!responses.rewrite_hides_refusal, "only chat and completions");
    }

    #[test]
    fn view_reads_the_deciding_fields() {
        let v = view(Api::Chat, r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"n":1}"#);
        assert_eq!(v.model.as_deref(), Some("m"));
        assert!(v.stream && !v.has_media && !v.echo);
        assert_eq!(v.reuse_blocker(), None);
    }

    #[test]
    fn media_echo_n_and_batches_block_reuse() {
        let media = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert_eq!(view(Api::Chat, media).reuse_blocker(), Some(FallbackReason::Media));
        let text_parts = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}"#;
        assert_eq!(view(Api::Chat, text_parts).reuse_blocker(), None);
        assert_eq!(view(Api::Chat, r#"{"messages":[],"echo":true}"#).reuse_blocker(), Some(FallbackReason::Echo));
        assert_eq!(view(Api::Chat, r#"{"messages":[],"n":2}"#).reuse_blocker(), Some(FallbackReason::NGreaterThanOne));
        assert_eq!(
            view(Api::Completions, r#"{"prompt":["a","b"]}"#).reuse_blocker(),
            Some(FallbackReason::BatchPrompt)
        );
        assert_eq!(
            view(Api::Completions, r#"{"prompt":[[1],[2]]}"#).reuse_blocker(),
            Some(FallbackReason::BatchPrompt)
        );
        assert_eq!(view(Api::Completions, r#"{"prompt":[1,2]}"#).reuse_blocker(), Some(FallbackReason::PromptIsTokens));
        assert_eq!(view(Api::Completions, r#"{"prompt":"hi"}"#).reuse_blocker(), None);
    }

    #[test]
    fn media_is_seen_whatever_the_key_spelling() {
        for key in ["typ\\u0065", "\\u0074ype", "t\\u0079pe"] {
            let body = format!(
                r#"{{"messages":[{{"role":"user","content":[{{"{key}":"image_url","image_url":{{"url":"x"}}}}]}}]}}"#
            );
            assert_eq!(view(Api::Chat, &body).reuse_blocker(), Some(FallbackReason::Media), "{body}");
        }
        let text = r#"{"messages":[{"role":"user","content":"caf\u00e9"}]}"#;
        assert_eq!(view(Api::Chat, text).reuse_blocker(), None);
    }

    #[test]
    fn the_parts_prefilter_finds_what_either_token_scan_finds() {
        let cases = [
            r#"[{"role":"user","content":"plain"}]"#,
            r#"[{"role":"user","content":[{"type":"text","text":"a"}]}]"#,
            r#"[{"role":"user","content":"say \"type\" twice"}]"#,
            r#"[{"role":"user","content":"caf\u00e9"}]"#,
            r#"[{"role":"user","content":"a \\ b \" c"}]"#,
            r#"[{"role":"user","content":"ends in a quote\""}]"#,
            r#""type""#,
            r#"\u"#,
            r#"\"#,
            "",
        ];
        for raw in cases {
            let either = raw.contains("\"type\"") || raw.contains("\\u");
            assert_eq!(may_hold_typed_parts(raw), either, "{raw}");
        }
    }

    #[test]
    fn responses_media_and_state_are_read() {
        let img = r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image","image_url":"x"}]}]}"#;
        assert_eq!(view(Api::Responses, img).reuse_blocker(), Some(FallbackReason::Media));
        let text = r#"{"input":[{"type":"reasoning","content":[{"type":"reasoning_text","text":"r"}]},{"role":"user","content":[{"type":"input_text","text":"a"}]}]}"#;
        assert_eq!(view(Api::Responses, text).reuse_blocker(), None);
        assert_eq!(view(Api::Responses, r#"{"input":"a type"}"#).reuse_blocker(), None);
        assert!(view(Api::Responses, r#"{"input":"a","background":true}"#).stateful);
        assert!(!view(Api::Responses, r#"{"input":"a","previous_response_id":null}"#).stateful);
        let ids = view(Api::Responses, r#"{"input":"a","enable_response_messages":true,"return_token_ids":false}"#);
        assert!(ids.return_token_ids, "the client's own echo request on Responses");
        assert_eq!(view(Api::Messages, r#"{"messages":[]}"#).reuse_blocker(), Some(FallbackReason::IdsNotEchoed));
        let err = RequestView::parse(Api::Responses, &RawObject::parse(r#"{"model":"m"}"#).unwrap()).unwrap_err();
        assert_eq!(err.status(), 400);
    }

    #[test]
    fn wrong_types_are_invalid_requests() {
        let obj = RawObject::parse(r#"{"messages":[],"stream":"yes"}"#).unwrap();
        let err = RequestView::parse(Api::Chat, &obj).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
        let obj = RawObject::parse(r#"{"model":"m"}"#).unwrap();
        assert_eq!(RequestView::parse(Api::Chat, &obj).unwrap_err().status(), 400);
    }

    #[test]
    fn prefill_rewrite_sets_limits_and_kv_params() {
        let body = r#"{"model":"m","messages":[],"max_tokens":50,"max_completion_tokens":60,"min_tokens":3,"min_completion_tokens":2,"stream":true,"stream_options":{"include_usage":true},"temperature":0.70}"#;
        let out = prefill_body(&RawObject::parse(body).unwrap(), None, Api::Chat, true).to_bytes().to_vec();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert_eq!(v["return_token_ids"], true);
        for gone in ["min_tokens", "min_completion_tokens", "stream_options"] {
            assert!(v.get(gone).is_none(), "{gone}");
        }
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert!(String::from_utf8(out).unwrap().contains(r#""temperature":0.70"#));
    }

    #[test]
    fn release_body_is_the_decode_for_one_token_unstreamed() {
        let decode = br#"{"messages":[],"max_tokens":50,"max_completion_tokens":60,"min_tokens":3,"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,"kv_transfer_params":{"remote_block_ids":[[1,2]],"remote_port":5600,"prompt_token_ids":[7,8]},"temperature":0.70}"#;
        let out = release_body(decode, Api::Chat).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!((v["max_tokens"].clone(), v["max_completion_tokens"].clone()), (1.into(), 1.into()));
        assert_eq!(v["stream"], false);
        for gone in ["min_tokens", "stream_options", "return_token_ids"] {
            assert!(v.get(gone).is_none(), "{gone}");
        }
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains(
                r#""kv_transfer_params":{"remote_block_ids":[[1,2]],"remote_port":5600,"prompt_token_ids":[7,8]}"#
            ),
            "the handoff is kept byte for byte: {text}"
        );
        assert!(text.contains(r#""temperature":0.70"#));
        let plain = release_body(br#"{"prompt":[1,2],"max_tokens":9}"#, Api::Completions).unwrap();
        assert!(serde_json::from_slice::<serde_json::Value>(&plain).unwrap().get("max_completion_tokens").is_none());
        assert_eq!(release_body(b"[1]", Api::Chat), None);
    }

    #[test]
    fn generate_legs_set_their_limits_inside_sampling_params() {
        let body = r#"{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":50,"min_tokens":3,"temperature":0.70},"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,"request_id":"r1"}"#;
        let obj = RawObject::parse(body).unwrap();
        let view = RequestView::parse(Api::Generate, &obj).unwrap();
        assert_eq!((view.stream, view.prompt), (true, PromptShape::Tokens));
        assert_eq!(view.reuse_blocker(), Some(FallbackReason::PromptIsTokens));
        let out = String::from_utf8(prefill_body(&obj, None, Api::Generate, false).to_bytes().to_vec()).unwrap();
        assert!(out.contains(r#""sampling_params":{"max_tokens":1,"temperature":0.70}"#), "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!((v["stream"].clone(), v["request_id"].clone()), (false.into(), "r1".into()));
        for gone in ["stream_options", "return_token_ids", "max_tokens"] {
            assert!(v.get(gone).is_none(), "{gone}: {out}");
        }
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert!(out.contains(r#""token_ids":[1,2,3]"#));
        // The decode: the client's body, the handoff added, limits untouched.
        let kv = r#"{"remote_block_ids":[[1]],"remote_port":5600}"#;
        let decode = decode_body(&obj, None, Api::Generate, Some(kv), None).to_bytes();
        let expected =
            body.replace(r#","request_id":"r1"}"#, &format!(r#","request_id":"r1","kv_transfer_params":{kv}}}"#));
        assert_eq!(std::str::from_utf8(&decode).unwrap(), expected);
        let release = release_body(&decode, Api::Generate).unwrap();
        let r: serde_json::Value = serde_json::from_slice(&release).unwrap();
        assert_eq!(r["sampling_params"], serde_json::json!({"max_tokens": 1, "temperature": 0.70}));
        assert_eq!(r["kv_transfer_params"]["remote_port"], 5600);
    }

    #[test]
    fn generate_requires_token_ids_and_sampling_params() {
        let view = |body: &str| RequestView::parse(Api::Generate, &RawObject::parse(body).unwrap());
        let param = |body: &str| match view(body) {
            Err(ApiError::InvalidRequest { param, .. }) => param,
            other => panic!("{other:?}"),
        };
        assert_eq!(param(r#"{"sampling_params":{}}"#), Some("token_ids"));
        assert_eq!(param(r#"{"token_ids":null,"sampling_params":{}}"#), Some("token_ids"));
        assert_eq!(param(r#"{"token_ids":[1]}"#), Some("sampling_params"));
        assert_eq!(param(r#"{"token_ids":[1],"sampling_params":[]}"#), Some("sampling_params"));
        assert_eq!(param(r#"{"token_ids":[1],"sampling_params":{},"stream":"yes"}"#), Some("stream"));
        let mm = view(r#"{"token_ids":[1],"sampling_params":{"n":2},"content_parts":[{"type":"image_url"}]}"#).unwrap();
        assert!(mm.has_media && mm.n == 2);
        assert_eq!(Api::from_path("/inference/v1/generate/"), Some(Api::Generate));
    }
    #[test]
    fn prefill_rewrite_without_reuse_leaves_return_token_ids_alone() {
        let out =
            prefill_body(&RawObject::parse(r#"{"messages":[]}"#).unwrap(), None, Api::Chat, false).to_bytes().to_vec();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(v.get("return_token_ids").is_none());
        assert!(v.get("max_completion_tokens").is_none());
    }

    #[test]
    fn chat_decode_carries_ids_inside_kv_params_verbatim() {
        let client =
            RawObject::parse(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":9,"stream":true}"#).unwrap();
        let ids = PromptIds::parse("[1,2,3]", Some(3)).unwrap();
        let kv = r#"{"remote_port":5600,"tp_size":1,"f":1.0,"nested":{"a":[1,2]}}"#;
        let out =
            String::from_utf8(decode_body(&client, None, Api::Chat, Some(kv), Some(&ids)).to_bytes().to_vec()).unwrap();
        assert_eq!(
            out,
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":9,"stream":true,"kv_transfer_params":{"remote_port":5600,"tp_size":1,"f":1.0,"nested":{"a":[1,2]},"prompt_token_ids":[1,2,3]}}"#
        );
    }

    #[test]
    fn completions_decode_replaces_prompt() {
        let client = RawObject::parse(r#"{"prompt":"hello","max_tokens":5}"#).unwrap();
        let ids = PromptIds::parse("[7,8]", Some(2)).unwrap();
        let out = decode_body(&client, None, Api::Completions, None, Some(&ids)).to_bytes().to_vec();
        assert_eq!(out, br#"{"prompt":[7,8],"max_tokens":5}"#);
    }

    #[test]
    fn text_decode_only_adds_non_null_kv_params() {
        let client = RawObject::parse(r#"{"messages":[]}"#).unwrap();
        assert_eq!(
            decode_body(&client, None, Api::Chat, Some("null"), None).to_bytes().to_vec(),
            br#"{"messages":[]}"#
        );
        assert_eq!(
            decode_body(&client, None, Api::Chat, Some(r#"{"a":1}"#), None).to_bytes().to_vec(),
            br#"{"messages":[],"kv_transfer_params":{"a":1}}"#
        );
    }
}
