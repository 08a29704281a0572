//! The oracles behind the fuzz targets (`fuzz/fuzz_targets/*.rs`) and the property tests
//! (`tests/properties.rs`): one implementation, two drivers. Each `check_*` panics when its
//! property fails; each `fuzz_*` maps raw fuzzer bytes onto a `check_*` call. References are
//! built from `serde_json` (the ground truth for "what is JSON") or written out plainly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, dead_code)]

use std::collections::{HashMap, HashSet};
use std::fmt;

use bytes::BytesMut;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use tokenonce::config::{Config, Mode};
use tokenonce::kv::check::{Drift, HashCheck, Outcome};
use tokenonce::kv::index::BlockIndex;
use tokenonce::kv::wire::{self as kv_wire, BlockKeys, EventBatch, Removed, Stored, WireHash};
use tokenonce::kv::{BlockHasher, RequestKeys};
use tokenonce::openai::ids::IdsError;
use tokenonce::openai::request::{
    decode_body, kv_params_with_ids, prefill_body, PromptShape, PREFILL_KV_TRANSFER_PARAMS,
};
use tokenonce::openai::response::{extract_handoff, hide_token_ids, rewrite_cached_tokens, IdsFault, SseRewriter};
use tokenonce::openai::{Api, FallbackReason, PromptIds, RawObject, RequestView};
use tokenonce::sse::{Event, SseDecoder, Unterminated};
use tokenonce::upstream::h1::{
    body_step, parse_head, Chunk, Framing, Step, WireError, LINE_LIMIT, MAX_TRAILERS, TRAILER_BYTES_LIMIT,
};

// === input plumbing ===

/// Splits fuzzer bytes at NUL (never valid inside JSON or TOML text) into at most `n` parts.
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    data.splitn(n, |&b| b == 0).collect()
}

fn api_of(flags: u8) -> Api {
    if flags & 1 == 0 {
        Api::Chat
    } else {
        Api::Completions
    }
}

/// Cut points derived from a seed: a small xorshift walk over `0..=len`.
pub fn cuts_from_seed(seed: u8, len: usize) -> Vec<usize> {
    let mut x = u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let max_step = usize::from(seed % 37) + 1;
    let mut cuts = Vec::new();
    let mut at = 0usize;
    while at < len && cuts.len() < 4096 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        at += (x % max_step as u64) as usize + 1;
        cuts.push(at.min(len));
    }
    cuts
}

const JSON_WS: [char; 4] = [' ', '\t', '\n', '\r'];

/// True when `text` is exactly one JSON value (syntax only, as `serde_json` checks it).
pub fn is_json(text: &str) -> bool {
    serde_json::from_str::<IgnoredAny>(text).is_ok()
}

// === reference member lists ===

/// An object's members as `serde_json` reads them: decoded keys, exact raw values, in order,
/// duplicates kept.
pub type Members = Vec<(String, String)>;

struct MembersRef(Members);

impl<'de> Deserialize<'de> for MembersRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Members, M::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                    out.push((k, v.get().to_owned()));
                }
                Ok(out)
            }
        }
        d.deserialize_map(V).map(MembersRef)
    }
}

/// The members of `text` when it is one JSON object whose keys are valid strings.
pub fn members(text: &str) -> Option<Members> {
    serde_json::from_str::<MembersRef>(text).ok().map(|m| m.0)
}

fn last<'m>(m: &'m Members, key: &str) -> Option<&'m str> {
    m.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn without(m: &Members, keys: &[&str]) -> Members {
    m.iter().filter(|(k, _)| !keys.contains(&k.as_str())).cloned().collect()
}

fn count(m: &Members, key: &str) -> usize {
    m.iter().filter(|(k, _)| k == key).count()
}

/// The documented `set_raw`: first occurrence replaced, later ones dropped, else appended.
pub fn ref_set(m: &Members, key: &str, value: &str) -> Members {
    let mut out = Vec::with_capacity(m.len() + 1);
    let mut done = false;
    for (k, v) in m {
        if k == key {
            if !done {
                out.push((k.clone(), value.to_owned()));
                done = true;
            }
        } else {
            out.push((k.clone(), v.clone()));
        }
    }
    if !done {
        out.push((key.to_owned(), value.to_owned()));
    }
    out
}

fn is_null_raw(raw: Option<&str>) -> bool {
    raw.is_none_or(|r| r == "null")
}

/// True when some object anywhere in `text` repeats a key (serde's derived structs reject
/// those, `Value` keeps the last), or when `text` is not JSON `serde_json` can nest.
fn has_duplicate_keys(text: &str) -> bool {
    struct Dup;
    impl<'de> Deserialize<'de> for Dup {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Dup;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("JSON")
                }
                fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Dup, M::Error> {
                    let mut seen = HashSet::new();
                    while let Some(k) = map.next_key::<String>()? {
                        if !seen.insert(k) {
                            return Err(de::Error::custom("duplicate"));
                        }
                        map.next_value::<Dup>()?;
                    }
                    Ok(Dup)
                }
                fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Dup, S::Error> {
                    while seq.next_element::<Dup>()?.is_some() {}
                    Ok(Dup)
                }
                fn visit_bool<E>(self, _: bool) -> Result<Dup, E> {
                    Ok(Dup)
                }
                fn visit_i64<E>(self, _: i64) -> Result<Dup, E> {
                    Ok(Dup)
                }
                fn visit_u64<E>(self, _: u64) -> Result<Dup, E> {
                    Ok(Dup)
                }
                fn visit_f64<E>(self, _: f64) -> Result<Dup, E> {
                    Ok(Dup)
                }
                fn visit_str<E>(self, _: &str) -> Result<Dup, E> {
                    Ok(Dup)
                }
                fn visit_unit<E>(self) -> Result<Dup, E> {
                    Ok(Dup)
                }
            }
            d.deserialize_any(V)
        }
    }
    serde_json::from_str::<Dup>(text).is_err()
}

/// Asserts `out` is one JSON object and returns its members.
fn object_out(out: &[u8], what: &str) -> Members {
    let text = std::str::from_utf8(out).unwrap_or_else(|e| panic!("{what}: output is not UTF-8: {e}"));
    assert!(is_json(text), "{what}: output is not JSON: {text}");
    members(text).unwrap_or_else(|| panic!("{what}: output is not an object: {text}"))
}

// === SSE decoder ===

/// Decodes `stream` fed in the pieces between `cuts`; the events, what is still pending, and
/// the finish result.
fn sse_decode(stream: &[u8], cuts: &[usize]) -> (Vec<Event>, usize, Result<(), Unterminated>) {
    let mut dec = SseDecoder::new();
    let mut events = Vec::new();
    let mut last = 0;
    for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
        let cut = cut.clamp(last, stream.len());
        events.extend(dec.feed(&stream[last..cut]));
        last = cut;
    }
    let pending = dec.pending();
    (events, pending, dec.finish())
}

/// The decoder's framing, written as one pass over a whole stream: lines end at LF (a CR
/// before it is dropped); a blank line ends the event if a line came before it since the
/// last event ended. A lone CR ends no line (vLLM and uvicorn send LF; documented deviation
/// from the SSE spec, which also splits at a lone CR).
fn sse_reference(stream: &[u8]) -> (Vec<Vec<u8>>, usize) {
    let mut events = Vec::new();
    let (mut start, mut line_start) = (0, 0);
    for (i, &b) in stream.iter().enumerate() {
        if b == b'\n' {
            let line = &stream[line_start..i];
            let blank = line.is_empty() || line == b"\r";
            if blank && line_start > start {
                events.push(stream[start..=i].to_vec());
                start = i + 1;
            }
            line_start = i + 1;
        }
    }
    (events, start)
}

/// The SSE `data` field of one event per the spec's field rule: `name[:[ ]value]`.
fn sse_data_reference(raw: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in raw.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let v = &line[colon + 1..];
                (&line[..colon], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        if name == b"data" {
            match data.as_mut() {
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(value);
                }
                None => data = Some(value.to_vec()),
            }
        }
    }
    data
}

fn rewrite_output(stream: &[u8], cuts: &[usize], cached: Option<u64>) -> Vec<u8> {
    let mut rw = SseRewriter::new(move |d: &str| cached.and_then(|n| rewrite_cached_tokens(d, n)));
    let mut out = Vec::new();
    let mut last = 0;
    for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
        let cut = cut.clamp(last, stream.len());
        out.extend(rw.feed(&stream[last..cut]));
        last = cut;
    }
    out.extend(rw.finish());
    out
}

/// The SSE decoder yields the same events whatever the cut points (whole, byte by byte,
/// `cuts`), equal to the one-pass reference; events and the pending tail add up to the input;
/// `data()` follows the spec's field rule. The rewriter with a no-op rewrite gives the input
/// back byte for byte; with the cached-tokens rewrite its output is cut-independent, frames
/// the same events, and each event's data is the original or its rewrite.
pub fn check_sse(stream: &[u8], cuts: &[usize]) {
    let whole = sse_decode(stream, &[]);
    let bytewise: Vec<usize> = (0..stream.len()).collect();
    let mut cuts = cuts.to_vec();
    cuts.sort_unstable();
    for other in [sse_decode(stream, &bytewise), sse_decode(stream, &cuts)] {
        assert_eq!(other.0, whole.0, "events depend on the cut points");
        assert_eq!(other.1, whole.1, "pending bytes depend on the cut points");
        assert_eq!(other.2, whole.2, "finish depends on the cut points");
    }
    let (events, pending, finish) = whole;
    let (ref_events, ref_tail) = sse_reference(stream);
    let raws: Vec<Vec<u8>> = events.iter().map(|e| e.raw().to_vec()).collect();
    assert_eq!(raws, ref_events, "events differ from the reference framing");
    assert_eq!(stream.len() - pending, ref_tail, "pending tail differs from the reference");
    let tail = &stream[ref_tail..];
    match finish {
        Ok(()) => assert!(tail.iter().all(|b| matches!(b, b'\r' | b'\n')), "finish Ok with data left"),
        Err(Unterminated(t)) => {
            assert_eq!(t, tail, "unterminated tail is not the leftover bytes");
            assert!(!t.iter().all(|b| matches!(b, b'\r' | b'\n')), "finish Err on blank lines only");
        }
    }
    for e in &events {
        assert_eq!(e.data(), sse_data_reference(e.raw()), "data() of {:?}", String::from_utf8_lossy(e.raw()));
    }

    // No-op rewrite: byte-identical pass-through at any cut. (The rewriter frames with the
    // decoder, whose cut-independence was checked byte by byte above; the fuzz targets' speed
    // comes from not repeating that here.)
    for c in [&[][..], &cuts[..]] {
        assert_eq!(rewrite_output(stream, c, None), stream, "a rewriter that changes nothing changed bytes");
    }
    // Cached-tokens rewrite: cut-independent, same events, data = original or its rewrite.
    let out = rewrite_output(stream, &[], Some(7));
    assert_eq!(rewrite_output(stream, &cuts, Some(7)), out, "rewritten stream depends on the cut points");
    let (out_events, out_pending, _) = sse_decode(&out, &[]);
    assert_eq!(out_events.len(), events.len(), "rewriting changed the number of events");
    assert_eq!(&out[out.len() - out_pending..], tail, "rewriting changed the tail");
    for (before, after) in events.iter().zip(&out_events) {
        let rewritten = before
            .data()
            .filter(|d| d.iter().find(|b| !b" \t\r\n".contains(b)) == Some(&b'{'))
            .and_then(|d| String::from_utf8(d).ok())
            .and_then(|d| rewrite_cached_tokens(&d, 7));
        match rewritten {
            None => assert_eq!(after.raw(), before.raw(), "an event the rewrite left alone changed"),
            Some(expected) => {
                let got = after.data().expect("a rewritten event has data");
                let got = String::from_utf8(got).expect("rewritten data is UTF-8");
                let want = String::from_utf8(expected).unwrap();
                let flat: String = want.chars().map(|c| if c == '\n' || c == '\r' { ' ' } else { c }).collect();
                assert_eq!(got, flat, "rewritten event does not carry the rewrite's JSON");
                assert!(is_json(&got), "rewritten event data is not JSON: {got}");
            }
        }
    }
}

/// Fuzz input: byte 0 seeds the cut points, the rest is the stream.
pub fn fuzz_sse(data: &[u8]) {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    check_sse(stream, &cuts_from_seed(seed, stream.len()));
}

// === raw-object JSON splicer ===

/// `RawObject::parse` accepts exactly the JSON objects `serde_json` reads (keys decoded,
/// values the exact source bytes, order and duplicates kept); `to_bytes` is JSON with the
/// same members and the same `Value`; `set_raw` and `remove` touch only their key, every
/// other member byte-identical and in order.
pub fn check_raw_object(text: &str, key: &str, value: &str) {
    let reference = members(text);
    let parsed = RawObject::parse(text);
    assert_eq!(parsed.is_ok(), reference.is_some(), "parse disagrees with serde_json on {text:?}");
    assert_eq!(RawObject::parse_bytes(text.as_bytes()).is_ok(), parsed.is_ok(), "parse_bytes != parse");
    let (Ok(obj), Some(m)) = (parsed, reference) else {
        return;
    };
    assert!(is_json(text) && text.trim_start_matches(JSON_WS).starts_with('{'));
    let keys: Vec<&str> = obj.keys().collect();
    let ref_keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ref_keys, "keys differ");
    for (k, _) in &m {
        assert_eq!(obj.get(k), last(&m, k), "get({k:?}) is not the last duplicate");
        assert_eq!(obj.has_non_null(k), !is_null_raw(last(&m, k)));
    }
    let out = obj.to_bytes();
    assert_eq!(object_out(&out, "to_bytes"), m, "to_bytes changed a member");
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), v, "to_bytes changed the value");
    }

    let value = value.trim_matches(JSON_WS);
    if is_json(value) {
        let mut set = obj.clone();
        set.set_raw(key, value.to_owned());
        assert_eq!(set.get(key), Some(value));
        assert_eq!(object_out(&set.to_bytes(), "set_raw"), ref_set(&m, key, value), "set_raw({key:?})");
    }
    let mut removed = obj.clone();
    assert_eq!(removed.remove(key), count(&m, key) > 0);
    assert_eq!(removed.get(key), None);
    assert_eq!(object_out(&removed.to_bytes(), "remove"), without(&m, &[key]), "remove({key:?})");
}

/// Fuzz input: `text NUL key NUL value`.
pub fn fuzz_raw_object(data: &[u8]) {
    let p = parts(data, 3);
    let Ok(text) = std::str::from_utf8(p[0]) else {
        assert!(RawObject::parse_bytes(p[0]).is_err(), "parse_bytes took non-UTF-8");
        return;
    };
    let key = p.get(1).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or("k");
    let value = p.get(2).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or("1");
    check_raw_object(text, key, value);
}

// === prompt-id validator ===

/// `PromptIds::parse` agrees with `serde_json::from_str::<Vec<u32>>`: the same texts are
/// integer arrays (so `-0`, `1.0`, `1e3`, leading zeros, values past u32::MAX, strings,
/// nesting and non-JSON whitespace are refused by both), with the same values; the empty array
/// is the one deliberate difference (`Empty`, since a prompt has at least one token).
pub fn check_prompt_ids(text: &str) {
    let ours = PromptIds::parse(text, None);
    let theirs = serde_json::from_str::<Vec<u32>>(text);
    match (&ours, &theirs) {
        (Ok(ids), Ok(v)) => {
            assert_eq!(&ids.to_vec(), v, "values differ for {text:?}");
            assert_eq!(ids.len(), v.len());
            assert!(!ids.is_empty());
            assert_eq!(ids.as_json(), text.trim_matches(JSON_WS), "as_json is not the text");
            assert_eq!(serde_json::from_str::<Vec<u32>>(ids.as_json()).unwrap(), *v);
            assert!(PromptIds::parse(text, Some(v.len() as u64)).is_ok());
            assert_eq!(
                PromptIds::parse(text, Some(v.len() as u64 + 1)),
                Err(IdsError::CountMismatch { count: v.len(), expected: v.len() as u64 + 1 })
            );
            let again = PromptIds::from_ids(v);
            assert_eq!(serde_json::from_str::<Vec<u32>>(again.as_json()).unwrap(), *v);
            assert_eq!(PromptIds::parse(again.as_json(), None).as_ref(), Ok(&again));
        }
        (Err(IdsError::Empty), Ok(v)) => assert!(v.is_empty(), "Empty for a non-empty array {text:?}"),
        (Err(IdsError::Malformed(_)), Err(_)) => {}
        _ => panic!("validator {ours:?} vs serde_json {theirs:?} on {text:?}"),
    }
}

/// Fuzz input: the text.
pub fn fuzz_prompt_ids(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        check_prompt_ids(text);
    }
}

// === request view ===

/// What the reference expects of the media scan.
#[derive(Debug, PartialEq)]
enum Media {
    Yes,
    No,
    /// A part with a non-string `type`: the view must refuse the request.
    Invalid,
    /// A shape the view reads leniently (a message or part that is not an object, a non-array
    /// `messages`): either answer is accepted.
    Any,
}

fn media_reference(messages: &Value) -> Media {
    // The view reads every message first, then each message's parts, stopping at the first
    // message with a non-text part.
    let Some(list) = messages.as_array() else {
        return Media::Any;
    };
    if list.iter().any(|m| !m.is_object()) {
        return Media::Any;
    }
    for message in list {
        let Some(parts) = message.get("content").and_then(Value::as_array) else {
            continue;
        };
        if parts.iter().any(|p| !p.is_object()) {
            return Media::Any;
        }
        let mut media = false;
        for part in parts {
            match part.get("type") {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) => media |= t != "text",
                Some(_) => return Media::Invalid,
            }
        }
        if media {
            return Media::Yes;
        }
    }
    Media::No
}

fn scalar<T>(v: &Value, key: &str, get: impl Fn(&Value) -> Option<T>) -> Result<Option<T>, ()> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => get(x).map(Some).ok_or(()),
    }
}

/// `RequestView::parse` reads what `serde_json::Value` sees: `model`, `stream`, `n`, `echo`,
/// `return_token_ids` with their defaults, refusing wrong types; chat without `messages` is
/// refused; a content part with a non-text `type` is media (however the key is spelled); the
/// completions prompt shape follows the first element of a list; `reuse_blocker` follows the
/// documented precedence.
pub fn check_request_view(api: Api, body: &str) {
    let Ok(obj) = RawObject::parse(body) else {
        return;
    };
    let view = RequestView::parse(api, &obj);
    let Ok(v) = serde_json::from_str::<Value>(body) else {
        return; // nesting past serde_json's limit, a float out of range, a lone surrogate
    };
    let scalars = (|| {
        Ok::<_, ()>((
            scalar(&v, "model", |x| x.as_str().map(str::to_owned))?,
            scalar(&v, "stream", Value::as_bool)?.unwrap_or(false),
            scalar(&v, "n", Value::as_u64)?.unwrap_or(1),
            scalar(&v, "echo", Value::as_bool)?.unwrap_or(false),
            scalar(&v, "return_token_ids", Value::as_bool)?.unwrap_or(false),
        ))
    })();
    let Ok((model, stream, n, echo, return_token_ids)) = scalars else {
        assert!(view.is_err(), "a mistyped field was accepted: {body}");
        return;
    };
    let media = match api {
        Api::Chat => match v.get("messages") {
            None => {
                assert!(view.is_err(), "chat without messages was accepted");
                return;
            }
            Some(_) if has_duplicate_keys(body) => Media::Any,
            Some(m) => media_reference(m),
        },
        Api::Completions => Media::No,
        // This oracle models chat and completions; the new APIs have unit and table tests.
        Api::Responses | Api::Messages | Api::Generate => return,
    };
    let view = match (media, view) {
        (Media::Invalid, view) => {
            assert!(view.is_err(), "a non-string part type was accepted: {body}");
            return;
        }
        (Media::Any, Err(_)) => return,
        (_, Err(e)) => panic!("refused {body}: {e:?}"),
        (Media::Yes, Ok(view)) => {
            assert!(view.has_media, "media missed in {body}");
            view
        }
        (Media::No, Ok(view)) => {
            assert!(!view.has_media, "media seen in {body}");
            view
        }
        (Media::Any, Ok(view)) => view,
    };
    assert_eq!(view.api, api);
    assert_eq!(view.model, model);
    assert_eq!((view.stream, view.n, view.echo, view.return_token_ids), (stream, n, echo, return_token_ids));
    let shape = match (api, v.get("prompt")) {
        (Api::Completions, Some(Value::Array(items))) => match items.first() {
            Some(Value::String(_) | Value::Array(_)) => PromptShape::Batch,
            _ => PromptShape::Tokens,
        },
        _ => PromptShape::Text,
    };
    assert_eq!(view.prompt, shape, "prompt shape of {body}");
    let blocker = if view.has_media {
        Some(FallbackReason::Media)
    } else if echo {
        Some(FallbackReason::Echo)
    } else if n > 1 {
        Some(FallbackReason::NGreaterThanOne)
    } else if shape == PromptShape::Batch {
        Some(FallbackReason::BatchPrompt)
    } else if shape == PromptShape::Tokens {
        Some(FallbackReason::PromptIsTokens)
    } else {
        None
    };
    assert_eq!(view.reuse_blocker(), blocker);
}

/// Fuzz input: byte 0 bit 0 picks the API (0 chat, 1 completions); the rest is the body.
pub fn fuzz_request_view(data: &[u8]) {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    if let Ok(body) = std::str::from_utf8(body) {
        check_request_view(api_of(flags), body);
    }
}

// === the two rewrites ===

/// The prefill and decode rewrites are JSON objects in which only the documented keys change
/// (to the documented values); every other member keeps its bytes, order and duplicates.
/// `kv_params_with_ids` keeps every member of an object `kv_transfer_params` and sets
/// `prompt_token_ids` to the ids' exact text (a non-object is replaced by a fresh object).
pub fn check_rewrites(api: Api, body: &str, kv: Option<&str>, ids: Option<&PromptIds>, want_ids: bool) {
    // Parsed from a shared buffer, as the proxy does: large values become pieces of it.
    let source = bytes::Bytes::copy_from_slice(body.as_bytes());
    let Ok(obj) = RawObject::parse(std::str::from_utf8(&source).unwrap()) else {
        return;
    };
    let m = members(body).expect("RawObject parsed what serde_json did not");
    let kv = kv.map(|k| k.trim_matches(JSON_WS)).filter(|k| is_json(k));

    // Prefill leg.
    let shared = prefill_body(&obj, Some(&source), api, want_ids).to_bytes();
    assert_eq!(shared, prefill_body(&obj, None, api, want_ids).to_bytes(), "prefill pieces differ from the copy");
    let out = object_out(&shared, "prefill_body");
    let mut touched =
        vec!["max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens", "stream", "stream_options"];
    touched.push("kv_transfer_params");
    if want_ids {
        touched.push("return_token_ids");
    }
    assert_eq!(without(&out, &touched), without(&m, &touched), "prefill_body changed an untouched member");
    let single = |m: &Members, key: &str| -> Option<String> {
        assert!(count(m, key) <= 1, "{key} left duplicated");
        last(m, key).map(str::to_owned)
    };
    assert_eq!(single(&out, "max_tokens").as_deref(), Some("1"));
    let mct = count(&m, "max_completion_tokens") > 0;
    assert_eq!(single(&out, "max_completion_tokens").as_deref(), mct.then_some("1"));
    for gone in ["min_tokens", "min_completion_tokens", "stream_options"] {
        assert_eq!(count(&out, gone), 0, "{gone} kept");
    }
    assert_eq!(single(&out, "stream").as_deref(), Some("false"));
    assert_eq!(single(&out, "kv_transfer_params").as_deref(), Some(PREFILL_KV_TRANSFER_PARAMS));
    if want_ids {
        assert_eq!(single(&out, "return_token_ids").as_deref(), Some("true"));
    }

    // kv_transfer_params with the ids.
    if let Some(ids) = ids {
        let merged = kv_params_with_ids(kv, ids);
        let got = object_out(merged.as_bytes(), "kv_params_with_ids");
        let base = kv.filter(|k| *k != "null").and_then(members).unwrap_or_default();
        assert_eq!(got, ref_set(&base, "prompt_token_ids", ids.as_json()), "kv_params_with_ids");
    }

    // Decode leg.
    let shared = decode_body(&obj, Some(&source), api, kv, ids).to_bytes();
    assert_eq!(shared, decode_body(&obj, None, api, kv, ids).to_bytes(), "decode pieces differ from the copy");
    let out = object_out(&shared, "decode_body");
    let kv_given = kv.filter(|k| *k != "null");
    let mut touched: Vec<&str> = Vec::new();
    match (api, ids) {
        (Api::Chat | Api::Responses | Api::Messages, Some(ids)) => {
            touched.push("kv_transfer_params");
            assert_eq!(single(&out, "kv_transfer_params"), Some(kv_params_with_ids(kv_given, ids)));
        }
        (Api::Completions, Some(ids)) => {
            touched.push("prompt");
            assert_eq!(single(&out, "prompt").as_deref(), Some(ids.as_json()));
        }
        (Api::Generate, _) | (_, None) => {}
    }
    if let (Some(k), false) = (kv_given, api != Api::Completions && ids.is_some()) {
        touched.push("kv_transfer_params");
        assert_eq!(single(&out, "kv_transfer_params").as_deref(), Some(k));
    }
    assert_eq!(without(&out, &touched), without(&m, &touched), "decode_body changed an untouched member");
}

/// Fuzz input: byte 0 bit 0 API, bit 1 `want_ids`, bit 2 "no kv"; then `body NUL kv NUL ids`
/// (ids that fail validation mean "no ids").
pub fn fuzz_rewrites(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let p = parts(rest, 3);
    let Ok(body) = std::str::from_utf8(p[0]) else {
        return;
    };
    let kv = p.get(1).and_then(|b| std::str::from_utf8(b).ok()).filter(|_| flags & 4 == 0);
    let ids = p.get(2).and_then(|b| std::str::from_utf8(b).ok()).and_then(|t| PromptIds::parse(t, None).ok());
    check_rewrites(api_of(flags), body, kv, ids.as_ref(), flags & 2 != 0);
}

// === prefill-answer handoff extraction and the response rewrites ===

fn obj_or_absent(v: Option<&Value>) -> Result<Option<&serde_json::Map<String, Value>>, ()> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(_) => Err(()),
    }
}

fn u64_or_absent(v: Option<&Value>) -> Result<Option<u64>, ()> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or(()),
    }
}

/// What `extract_handoff` must return for `v`: `Err(())` for a mistyped field, `Ok(None)`
/// for a shape serde reads leniently (an array standing for a struct), else the fields.
#[allow(clippy::type_complexity)]
fn handoff_reference(
    api: Api,
    v: &Value,
) -> Result<Option<(Option<&Value>, Option<u64>, Option<u64>, Option<&Value>)>, ()> {
    if v.is_array() {
        return Ok(None);
    }
    let top = v.as_object().ok_or(())?;
    let lenient = |x: Option<&Value>| matches!(x, Some(Value::Array(_)));
    if lenient(top.get("usage")) {
        return Ok(None);
    }
    let usage = obj_or_absent(top.get("usage"))?;
    let prompt_tokens = u64_or_absent(usage.and_then(|u| u.get("prompt_tokens")))?;
    let details_v = usage.and_then(|u| u.get("prompt_tokens_details"));
    if lenient(details_v) {
        return Ok(None);
    }
    let details = obj_or_absent(details_v)?;
    let cached = u64_or_absent(details.and_then(|d| d.get("cached_tokens")))?;
    let choices = match top.get("choices") {
        None | Some(Value::Null) => None,
        Some(Value::Array(c)) => Some(c),
        Some(_) => return Err(()),
    };
    let mut first_ids = None;
    for (i, c) in choices.into_iter().flatten().enumerate() {
        match c {
            Value::Object(o) => {
                if i == 0 {
                    first_ids = o.get("prompt_token_ids");
                }
            }
            Value::Array(_) => return Ok(None),
            _ => return Err(()),
        }
    }
    let raw_ids = match api {
        Api::Chat => top.get("prompt_token_ids"),
        Api::Completions => first_ids,
        Api::Responses | Api::Messages | Api::Generate => return Ok(None),
    }
    .filter(|x| !x.is_null());
    let kv = top.get("kv_transfer_params").filter(|x| !x.is_null());
    Ok(Some((raw_ids, prompt_tokens, cached, kv)))
}

/// `extract_handoff` reads what `serde_json::Value` sees (ids where the API puts them, checked
/// like the id validator against `usage.prompt_tokens`; `kv_transfer_params` raw; cached
/// tokens) and refuses mistyped fields. `rewrite_cached_tokens` changes only
/// `usage.prompt_tokens_details.cached_tokens`, every other member byte-identical.
/// `hide_token_ids` nulls exactly the echoed ids and nothing else.
pub fn check_handoff(api: Api, body: &[u8], cached: u64) {
    let got = extract_handoff(api, body);
    let Ok(text) = std::str::from_utf8(body) else {
        return; // serde_json skips unknown fields without checking their UTF-8: no oracle
    };
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        if !has_duplicate_keys(text) {
            match (handoff_reference(api, &v), &got) {
                (Err(()), Ok(h)) => panic!("mistyped prefill answer accepted: {h:?} from {text}"),
                (Ok(Some(_)), Err(e)) => panic!("prefill answer refused: {e} in {text}"),
                (Ok(Some((raw_ids, prompt_tokens, cached_tokens, kv))), Ok(h)) => {
                    assert_eq!(h.cached_tokens, cached_tokens);
                    let kv_got = h.kv_transfer_params.as_deref().map(|k| serde_json::from_str::<Value>(k).unwrap());
                    assert_eq!(kv_got.as_ref(), kv);
                    match (raw_ids, prompt_tokens, &h.ids) {
                        (None, _, Err(IdsFault::Missing)) => {}
                        (Some(_), None, Err(IdsFault::Invalid(IdsError::Malformed(_)))) => {}
                        (Some(ids), Some(n), got_ids) => {
                            let want = serde_json::from_value::<Vec<u32>>(ids.clone())
                                .ok()
                                .filter(|v| !v.is_empty() && v.len() as u64 == n);
                            match (want, got_ids) {
                                (Some(w), Ok(g)) => assert_eq!(g.to_vec(), w),
                                (None, Err(IdsFault::Invalid(_))) => {}
                                (w, g) => panic!("ids: want {w:?}, got {g:?} in {text}"),
                            }
                        }
                        (r, n, g) => panic!("ids: raw {r:?}, prompt_tokens {n:?}, got {g:?}"),
                    }
                }
                _ => {}
            }
        }
    }
    if let Ok(h) = &got {
        if let Ok(ids) = &h.ids {
            check_prompt_ids(ids.as_json());
        }
    }
    check_cached_tokens(text, cached);
    check_hide_ids(api, text);
}

fn check_cached_tokens(text: &str, cached: u64) {
    let got = rewrite_cached_tokens(text, cached);
    let expected = (|| {
        let top = members(text)?;
        let usage_raw = last(&top, "usage").filter(|u| *u != "null")?;
        let usage = members(usage_raw)?;
        let details = match last(&usage, "prompt_tokens_details").filter(|d| *d != "null") {
            Some(d) => ref_set(&members(d)?, "cached_tokens", &cached.to_string()),
            None => vec![("cached_tokens".to_owned(), cached.to_string())],
        };
        Some((top, usage, details))
    })();
    match (expected, got) {
        (None, None) => {}
        (None, Some(out)) => panic!("rewrote {text} into {}", String::from_utf8_lossy(&out)),
        (Some(_), None) => panic!("did not rewrite {text}"),
        (Some((top, usage, details)), Some(out)) => {
            let out_top = object_out(&out, "rewrite_cached_tokens");
            assert_eq!(without(&out_top, &["usage"]), without(&top, &["usage"]), "a top-level member changed");
            assert_eq!(count(&out_top, "usage"), 1);
            let out_usage = members(last(&out_top, "usage").unwrap()).unwrap();
            let field = "prompt_tokens_details";
            assert_eq!(without(&out_usage, &[field]), without(&usage, &[field]), "a usage member changed");
            assert_eq!(count(&out_usage, field), 1);
            assert_eq!(members(last(&out_usage, field).unwrap()).unwrap(), details, "details");
            if let Ok(mut v) = serde_json::from_str::<Value>(text) {
                v["usage"]["prompt_tokens_details"]["cached_tokens"] = Value::from(cached);
                assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), v);
            }
        }
    }
}

fn check_hide_ids(api: Api, text: &str) {
    let got = hide_token_ids(api, text);
    let Some(top) = members(text) else {
        assert!(got.is_none(), "hid ids in a non-object");
        return;
    };
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let mut want = v.clone();
    if api == Api::Chat && !want["prompt_token_ids"].is_null() {
        want["prompt_token_ids"] = Value::Null;
    }
    let mut readable = true;
    match want.get_mut("choices") {
        None => {}
        Some(Value::Array(choices)) => {
            for c in choices {
                match c.as_object_mut() {
                    Some(c) => {
                        for key in ["prompt_token_ids", "token_ids"] {
                            if c.get(key).is_some_and(|x| !x.is_null()) {
                                c.insert(key.to_owned(), Value::Null);
                            }
                        }
                    }
                    None => readable = false,
                }
            }
        }
        Some(_) => readable = false,
    }
    match got {
        None => assert!(!readable || want == v, "ids left visible in {text}"),
        Some(out) => {
            assert_ne!(want, v, "reported a change where there was none");
            let out_top = object_out(&out, "hide_token_ids");
            let touched: &[&str] = if api == Api::Chat { &["prompt_token_ids", "choices"] } else { &["choices"] };
            assert_eq!(without(&out_top, touched), without(&top, touched), "hide_token_ids changed another member");
            assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), want, "hide_token_ids of {text}");
        }
    }
}

/// Fuzz input: byte 0 bit 0 API, bits 1.. the cached-token count; the rest is the body.
pub fn fuzz_handoff(data: &[u8]) {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    check_handoff(api_of(flags), body, u64::from(flags >> 1));
}

// === config parser ===

/// `Config::from_toml` never panics and is deterministic; an error lists at least one
/// problem, each placed inside the text (line:column 1-based, column at most one past the
/// line's end, or 0:0 for problems with no place), in file order (unplaced last); an Ok config keeps the
/// model's invariants (pool indices resolve, timeouts positive, endpoints host:port, unique
/// route names, orchestrate routes have a prefill, passthrough routes none).
pub fn check_config(text: &str) {
    let first = Config::from_toml(text, "fuzz.toml");
    let second = Config::from_toml(text, "fuzz.toml");
    assert_eq!(format!("{first:?}"), format!("{second:?}"), "validation is not deterministic");
    match first {
        Err(e) => {
            assert_eq!(e.source_name, "fuzz.toml");
            assert!(!e.problems.is_empty(), "an error without problems");
            let lines: Vec<&str> = text.split('\n').collect();
            for p in &e.problems {
                let _ = p.to_string();
                if (p.line, p.column) == (0, 0) {
                    continue;
                }
                assert!(p.line >= 1 && p.line <= lines.len(), "{p} outside the text's {} lines", lines.len());
                assert!(p.column >= 1 && p.column <= lines[p.line - 1].len() + 1, "{p} outside its line");
            }
            let placed: Vec<(usize, usize)> = e.problems.iter().map(|p| (p.line, p.column)).collect();
            let mut sorted = placed.clone();
            // File order; problems with no place (0:0) last.
            sorted.sort_unstable_by_key(|&(line, column)| (line == 0, line, column));
            assert_eq!(placed, sorted, "problems not in file order");
        }
        Ok(c) => {
            assert!(!c.pools.is_empty());
            assert!(c.pools.contains_key(&c.defaults.passthrough_pool));
            let server = &c.server;
            assert!(server.listen.parse::<std::net::SocketAddr>().is_ok());
            assert!(server.admin_listen.parse::<std::net::SocketAddr>().is_ok());
            assert!(server.threads >= 1 && c.cache.capacity_bytes >= 1 && !c.cache.ttl_ms.is_zero());
            for p in c.pools.values() {
                assert!(!p.endpoints.is_empty());
                assert!(p.endpoints.iter().all(|e| tokenonce::addr::endpoint_ranks(e).is_some()), "{:?}", p.endpoints);
            }
            let mut names = HashSet::new();
            for r in &c.routes {
                assert!(names.insert(r.name.clone()), "duplicate route name {}", r.name);
                assert!(!r.name.is_empty());
                assert!(c.pools.contains_key(&r.decode_pool));
                assert!(!r.prefill_timeout_ms.is_zero() && !r.decode_first_byte_timeout_ms.is_zero());
                assert!(r.max_body_bytes >= 1);
                match (&r.mode, &r.prefill) {
                    (Mode::Orchestrate, None) => panic!("orchestrate route {} without prefill", r.name),
                    (Mode::Passthrough, Some(_)) => panic!("passthrough route {} with prefill", r.name),
                    (_, Some(p)) => match (&p.pool, &p.header) {
                        (Some(pool), None) => assert!(c.pools.contains_key(pool)),
                        (None, Some(_)) => assert!(!p.allow.is_empty()),
                        other => panic!("route {} prefill with {other:?}", r.name),
                    },
                    _ => {}
                }
                assert!(r.matcher.paths.iter().all(|p| p.starts_with('/')));
            }
        }
    }
}

/// Fuzz input: the TOML text.
pub fn fuzz_config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        check_config(text);
    }
}

// === HTTP/1.1 response framing (the leg client) ===

/// How a body decode ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The body ended; these bytes followed it.
    Done(Vec<u8>),
    /// The framing is malformed.
    Error,
    /// More bytes were needed.
    Incomplete,
}

/// Decodes `input` from `framing` fed in the pieces between `cuts`: the body and how it ended.
/// Checks on the way that each piece is non-empty and that a need for more bytes holds at
/// most one line's worth (the reader's memory is bounded whatever the input).
pub fn h1_decode(framing: Framing, input: &[u8], cuts: &[usize]) -> (Vec<u8>, Ended) {
    let (mut framing, mut buf, mut body, mut last) = (framing, BytesMut::new(), Vec::new(), 0);
    for &cut in cuts.iter().chain(std::iter::once(&input.len())) {
        let cut = cut.clamp(last, input.len());
        buf.extend_from_slice(&input[last..cut]);
        last = cut;
        loop {
            match body_step(&mut framing, &mut buf) {
                Ok(Step::Piece(piece)) => {
                    assert!(!piece.is_empty(), "empty piece at {framing:?}");
                    body.extend_from_slice(&piece);
                }
                Ok(Step::More) => {
                    let held = match framing {
                        Framing::Chunked(Chunk::Size | Chunk::Trailers { .. }) => LINE_LIMIT + 1,
                        Framing::Chunked(Chunk::DataEnd) => 1,
                        _ => 0,
                    };
                    assert!(buf.len() <= held, "{} bytes held at {framing:?}", buf.len());
                    break;
                }
                Ok(Step::End) => {
                    assert_eq!(framing, Framing::Done);
                    let mut rest = buf.to_vec();
                    rest.extend_from_slice(&input[last..]);
                    return (body, Ended::Done(rest));
                }
                Err(_) => return (body, Ended::Error),
            }
        }
    }
    (body, Ended::Incomplete)
}

/// One CRLF-ended line of at most `LINE_LIMIT` bytes from `at`, without CR, LF or NUL inside:
/// `Ok(None)` when it may still come, `Err` when it cannot be a line.
fn ref_line(input: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, ()> {
    let rest = &input[at..];
    match rest.windows(2).position(|w| w == b"\r\n") {
        Some(end) if end > LINE_LIMIT => Err(()),
        Some(end) if rest[..end].iter().any(|b| matches!(b, b'\r' | b'\n' | 0)) => Err(()),
        Some(end) => Ok(Some((&rest[..end], at + end + 2))),
        None if rest.len() > LINE_LIMIT + 1 => Err(()),
        None => Ok(None),
    }
}

/// A chunk-size line per RFC 9112 §7.1: hex digits (1 to 15), optional spaces or tabs, then
/// nothing or `;` and an extension.
fn ref_chunk_size(line: &[u8]) -> Option<u64> {
    let n = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let after: Vec<u8> = line[n..].iter().copied().skip_while(|&b| b == b' ' || b == b'\t').collect();
    if n == 0 || n > 15 || !(after.is_empty() || after[0] == b';') {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(&line[..n]).unwrap(), 16).ok()
}

/// The chunked grammar read in one pass over the whole input, with the reader's limits.
pub fn chunked_reference(input: &[u8]) -> (Vec<u8>, Ended) {
    let mut body = Vec::new();
    let mut at = 0;
    macro_rules! line {
        () => {
            match ref_line(input, at) {
                Err(()) => return (body, Ended::Error),
                Ok(None) => return (body, Ended::Incomplete),
                Ok(Some((line, next))) => {
                    at = next;
                    line
                }
            }
        };
    }
    loop {
        let Some(size) = ref_chunk_size(line!()) else { return (body, Ended::Error) };
        if size == 0 {
            break;
        }
        let left = input.len() - at;
        if size > left as u64 {
            body.extend_from_slice(&input[at..]);
            return (body, Ended::Incomplete);
        }
        let end = at + usize::try_from(size).unwrap();
        body.extend_from_slice(&input[at..end]);
        at = end;
        let tail = &input[at..input.len().min(at + 2)];
        if tail != b"\r\n" {
            return (body, if tail.len() < 2 && b"\r\n".starts_with(tail) { Ended::Incomplete } else { Ended::Error });
        }
        at += 2;
    }
    let (mut lines, mut bytes) = (0, 0);
    loop {
        let line = line!();
        if line.is_empty() {
            return (body, Ended::Done(input[at..].to_vec()));
        }
        lines += 1;
        bytes += line.len() + 2;
        if lines > MAX_TRAILERS || bytes > TRAILER_BYTES_LIMIT {
            return (body, Ended::Error);
        }
    }
}

/// RFC 9112 §6.3 as a table over a parsed head: the framing and whether the connection may
/// be reused, or `None` where the framing is an error (invalid or differing lengths,
/// `Transfer-Encoding` in HTTP/1.0).
fn framing_reference(
    status: u16,
    http11: bool,
    headers: &[httparse::Header<'_>],
    to_head: bool,
) -> Option<(Framing, bool)> {
    let values = |name: &str| -> Vec<&[u8]> {
        headers.iter().filter(|h| h.name.eq_ignore_ascii_case(name)).map(|h| h.value).collect()
    };
    let mut lengths = HashSet::new();
    for item in values("content-length").iter().flat_map(|v| v.split(|&b| b == b',')) {
        let item = item.trim_ascii();
        if item.is_empty() || !item.iter().all(u8::is_ascii_digit) {
            return None;
        }
        lengths.insert(std::str::from_utf8(item).unwrap().parse::<u64>().ok()?);
    }
    if lengths.len() > 1 {
        return None;
    }
    let length = lengths.into_iter().next();
    let codings = values("transfer-encoding");
    if !codings.is_empty() && !http11 {
        return None;
    }
    let last_coding = codings.last().map(|v| v.rsplit(|&b| b == b',').next().unwrap().trim_ascii());
    let close = values("connection")
        .iter()
        .flat_map(|v| v.split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 || to_head {
        Framing::Done
    } else if let Some(last) = last_coding {
        if last.eq_ignore_ascii_case(b"chunked") {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        }
    } else {
        length.map_or(Framing::UntilClose, Framing::Length)
    };
    let both = !codings.is_empty() && length.is_some();
    Some((framing, http11 && status != 101 && !close && !both && framing != Framing::UntilClose))
}

/// A response head is parsed to the framing of the §6.3 table and never past its bytes; the
/// body after it decodes the same whatever the cuts, and (chunked) as the one-pass reference.
pub fn check_h1_head(raw: &[u8], to_head: bool, cuts: &[usize]) {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut reference = httparse::Response::new(&mut headers);
    let parsed = reference.parse(raw);
    let got = parse_head(raw, to_head);
    let Ok(httparse::Status::Complete(len)) = parsed else {
        assert!(!matches!(got, Ok(Some(_))), "httparse sees no complete head");
        return;
    };
    let want = framing_reference(reference.code.unwrap(), reference.version == Some(1), reference.headers, to_head);
    let (answer, got_len) = match (got, want) {
        (Ok(Some(got)), Some(want)) => {
            assert_eq!((got.0.framing(), got.0.keep_alive()), want, "{}", String::from_utf8_lossy(raw));
            got
        }
        (Err(WireError::Malformed(_)), None) => return,
        // Names and values httparse passes but `http`'s types refuse.
        (Err(WireError::Malformed("bad header" | "bad header value" | "bad status")), _) => return,
        (got, want) => {
            panic!("{}: got {:?}, want {want:?}", String::from_utf8_lossy(raw), got.map(|g| g.map(|a| a.0.framing())))
        }
    };
    assert_eq!(got_len, len);
    let body = &raw[len..];
    let whole = h1_decode(answer.framing(), body, &[]);
    assert_eq!(h1_decode(answer.framing(), body, cuts), whole, "cut-dependent");
    let bytewise: Vec<usize> = (1..body.len()).collect();
    assert_eq!(h1_decode(answer.framing(), body, &bytewise), whole, "byte-by-byte differs");
    match answer.framing() {
        Framing::Chunked(_) => assert_eq!(whole, chunked_reference(body)),
        Framing::Length(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            let want = if n <= body.len() { Ended::Done(body[n..].to_vec()) } else { Ended::Incomplete };
            assert_eq!(whole, (body[..n.min(body.len())].to_vec(), want));
        }
        Framing::UntilClose => assert_eq!(whole, (body.to_vec(), Ended::Incomplete)),
        Framing::Done => assert_eq!(whole, (Vec::new(), Ended::Done(body.to_vec()))),
    }
}

/// Chunk extensions and trailers the encoder picks from.
const EXTENSIONS: [&str; 5] = ["", ";a=1", " ;name=\"q;v\"", "\t;x", ";a;b=2"];
const TRAILERS: [&str; 3] = ["x-t: 1\r\n", "Server-Timing: a;dur=1\r\n", "x-e:\r\n"];

/// `body` chunk-encoded with chunk sizes, extensions and trailers drawn from `seed`, then the
/// next answer's first bytes: the reader gives back the body exactly, ends at the last CRLF,
/// whatever the cuts; a length-framed copy reads the same.
pub fn check_h1_chunked(body: &[u8], seed: u8, cuts: &[usize]) {
    let mut raw = Vec::new();
    let mut at = 0;
    let mut x = u32::from(seed) | 0x100;
    while at < body.len() {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let size = ((x >> 8) as usize % 300 + 1).min(body.len() - at);
        let hex = if x & 1 == 0 { format!("{size:x}") } else { format!("{size:X}") };
        let pad = if x & 2 == 0 { "" } else { "000" };
        raw.extend_from_slice(format!("{pad}{hex}{}\r\n", EXTENSIONS[(x >> 4) as usize % EXTENSIONS.len()]).as_bytes());
        raw.extend_from_slice(&body[at..at + size]);
        raw.extend_from_slice(b"\r\n");
        at += size;
    }
    raw.extend_from_slice(format!("0{}\r\n", EXTENSIONS[usize::from(seed) % EXTENSIONS.len()]).as_bytes());
    for t in 0..usize::from(seed >> 5) {
        raw.extend_from_slice(TRAILERS[t % TRAILERS.len()].as_bytes());
    }
    raw.extend_from_slice(b"\r\n");
    let next = b"HTTP/1.1 200 OK\r\n";
    raw.extend_from_slice(next);
    let want = (body.to_vec(), Ended::Done(next.to_vec()));
    assert_eq!(h1_decode(Framing::Chunked(Chunk::Size), &raw, cuts), want);
    assert_eq!(h1_decode(Framing::Chunked(Chunk::Size), &raw, &[]), want);
    assert_eq!(chunked_reference(&raw), want);
    let mut framed = body.to_vec();
    framed.extend_from_slice(next);
    assert_eq!(h1_decode(Framing::Length(body.len() as u64), &framed, cuts), want);
}

/// Fuzz input: byte 0 = flags (bit 0: raw bytes, else a body to encode; bit 1: the request
/// was a `HEAD`; bit 2: raw bytes are a chunked body, not a head), byte 1 seeds the cuts and
/// the encoding, the rest is the data.
pub fn fuzz_h1(data: &[u8]) {
    let [flags, seed, rest @ ..] = data else { return };
    let cuts = cuts_from_seed(*seed, rest.len() + 64);
    match (flags & 1 == 1, flags & 4 == 4) {
        (false, _) => check_h1_chunked(rest, *seed, &cuts),
        (true, false) => check_h1_head(rest, flags & 2 == 2, &cuts),
        (true, true) => {
            let whole = h1_decode(Framing::Chunked(Chunk::Size), rest, &[]);
            assert_eq!(h1_decode(Framing::Chunked(Chunk::Size), rest, &cuts), whole, "cut-dependent");
            assert_eq!(whole, chunked_reference(rest));
        }
    }
}

// === an engine's /metrics page (its own pressure) ===

/// Reads `page` for `rank` and checks what any read must keep: never a panic; the same
/// answer twice; an answer only within the reader's bounds (counts, a usage from 0 to 1,
/// adapter names); comment lines and series it does not read change nothing; a whole
/// server's counts are at least any one rank's.
pub fn check_engine_metrics(page: &[u8], rank: Option<u32>) {
    use tokenonce::upstream::engine_load::{read, Rejected, MAX_COUNT, MAX_ENGINES, MAX_LORAS, MAX_METRICS_BYTES};
    let got = read(page, rank);
    assert_eq!(read(page, rank), got, "deterministic");
    if page.len() > MAX_METRICS_BYTES {
        assert_eq!(got, Err(Rejected::TooLarge));
        return;
    }
    if let Ok(load) = &got {
        let most = MAX_COUNT as u64 * MAX_ENGINES as u64;
        assert!(load.waiting <= most && load.running <= most, "{load:?}");
        assert!(load.kv_usage.is_finite() && (0.0..=1.0).contains(&load.kv_usage), "{load:?}");
        assert!(load.block_size.is_none_or(|b| f64::from(b) <= MAX_COUNT), "{load:?}");
        assert!(load.num_gpu_blocks.is_none_or(|b| b <= most), "{load:?}");
        for names in [&load.loras_running, &load.loras_waiting] {
            assert!(names.len() <= MAX_LORAS);
            assert!(names.iter().all(|n| !n.is_empty() && !n.contains(',') && n.len() <= 256), "{names:?}");
        }
    }
    // Lines the reader does not read change nothing, wherever they stand.
    let mut padded =
        b"# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting_by_reason{engine=\"0\"} NaN\n".to_vec();
    padded.extend_from_slice(page);
    padded.extend_from_slice(b"\n# TYPE vllm:kv_cache_usage_perc gauge\n");
    if padded.len() <= MAX_METRICS_BYTES {
        assert_eq!(read(&padded, rank), got, "other lines changed the read");
    }
    // The whole server sums its ranks.
    if let (Some(_), Ok(one), Ok(all)) = (rank, &got, read(page, None)) {
        assert!(all.waiting >= one.waiting && all.running >= one.running, "{all:?} < {one:?}");
    }
}

/// Fuzz input: byte 0 = the rank (bit 7 set: the whole server, else bits 0-1), the rest = the
/// page.
pub fn fuzz_engine_metrics(data: &[u8]) {
    let [which, page @ ..] = data else { return };
    let rank = (which & 0x80 == 0).then_some(u32::from(which & 3));
    check_engine_metrics(page, rank);
}

// === vLLM's KV events: ZeroMQ frames and msgpack batches ===

/// A msgpack value as the msgpack spec frames it, read by the reference's own reader (not
/// rmp's). Strings keep their bytes: rmp_serde hands invalid UTF-8 on as bytes.
#[derive(Debug, Clone)]
enum Mp {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(Vec<u8>),
    Bin(Vec<u8>),
    Arr(Vec<Mp>),
    Map(Vec<(Mp, Mp)>),
}

/// What the reference says of a payload it does not read as a batch: `Invalid` the decoder
/// must refuse; `Unknown` where serde's leniency may read it either way (no claim).
#[derive(Debug)]
enum Verdict {
    Invalid(String),
    /// One whole value, then these many bytes.
    Trailing(usize),
    Unknown(String),
}

/// Nesting the reference reads; deeper is `Unknown` (rmp_serde's own limit is 1024).
const MP_DEPTH: usize = 64;

fn mp_take<'a>(data: &'a [u8], at: &mut usize, n: u64) -> Result<&'a [u8], Verdict> {
    let end = usize::try_from(n).ok().and_then(|n| at.checked_add(n)).filter(|&end| end <= data.len());
    let end = end.ok_or_else(|| Verdict::Invalid("the msgpack ends early".into()))?;
    let out = &data[*at..end];
    *at = end;
    Ok(out)
}

fn mp_uint(data: &[u8], at: &mut usize, n: u64) -> Result<u64, Verdict> {
    Ok(mp_take(data, at, n)?.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b)))
}

/// One msgpack value from `data[*at..]`: `Invalid` when the bytes end early or hold the
/// never-used marker 0xc1; `Unknown` at an extension type (rmp_serde reads only its type byte
/// and then its data as more values) or past `MP_DEPTH`.
fn mp_read(data: &[u8], at: &mut usize, depth: usize) -> Result<Mp, Verdict> {
    if depth > MP_DEPTH {
        return Err(Verdict::Unknown("nested deeper than the reference reads".into()));
    }
    let m = mp_take(data, at, 1)?[0];
    let items = |at: &mut usize, n: u64| -> Result<Vec<Mp>, Verdict> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(mp_read(data, at, depth + 1)?);
        }
        Ok(out)
    };
    let pairs = |at: &mut usize, n: u64| -> Result<Mp, Verdict> {
        let mut out = Vec::new();
        for _ in 0..n {
            let k = mp_read(data, at, depth + 1)?;
            out.push((k, mp_read(data, at, depth + 1)?));
        }
        Ok(Mp::Map(out))
    };
    Ok(match m {
        0x00..=0x7f => Mp::Int(m.into()),
        0x80..=0x8f => pairs(at, u64::from(m & 0x0f))?,
        0x90..=0x9f => Mp::Arr(items(at, u64::from(m & 0x0f))?),
        0xa0..=0xbf => Mp::Str(mp_take(data, at, u64::from(m & 0x1f))?.to_vec()),
        0xc0 => Mp::Nil,
        0xc1 => return Err(Verdict::Invalid("the never-used marker 0xc1".into())),
        0xc2 | 0xc3 => Mp::Bool,
        0xc4..=0xc6 => {
            let n = mp_uint(data, at, 1 << (m - 0xc4))?;
            Mp::Bin(mp_take(data, at, n)?.to_vec())
        }
        0xc7..=0xc9 | 0xd4..=0xd8 => return Err(Verdict::Unknown("an extension type".into())),
        0xca => Mp::Float(f64::from(f32::from_bits(mp_uint(data, at, 4)? as u32))),
        0xcb => Mp::Float(f64::from_bits(mp_uint(data, at, 8)?)),
        0xcc..=0xcf => Mp::Int(mp_uint(data, at, 1 << (m - 0xcc))?.into()),
        0xd0..=0xd3 => {
            let bytes = 1u32 << (m - 0xd0);
            let shift = 64 - 8 * bytes;
            let raw = mp_uint(data, at, u64::from(bytes))?;
            Mp::Int(i128::from(((raw << shift) as i64) >> shift))
        }
        0xd9..=0xdb => {
            let n = mp_uint(data, at, 1 << (m - 0xd9))?;
            Mp::Str(mp_take(data, at, n)?.to_vec())
        }
        0xdc | 0xdd => {
            let n = mp_uint(data, at, 2 << (m - 0xdc))?;
            Mp::Arr(items(at, n)?)
        }
        0xde | 0xdf => {
            let n = mp_uint(data, at, 2 << (m - 0xde))?;
            pairs(at, n)?
        }
        0xe0..=0xff => Mp::Int(i128::from(m as i8)),
    })
}

/// True when every map key anywhere in `v` is a UTF-8 string (serde also reads an integer key
/// as a field's index, and bytes as its name: no claim then).
fn mp_string_keys(v: &Mp) -> bool {
    match v {
        Mp::Arr(items) => items.iter().all(mp_string_keys),
        Mp::Map(pairs) => {
            pairs.iter().all(|(k, v)| matches!(k, Mp::Str(s) if std::str::from_utf8(s).is_ok()) && mp_string_keys(v))
        }
        _ => true,
    }
}

/// Collects the reference's findings over a whole batch: one `Unknown` anywhere outweighs an
/// `Invalid` (serde may have read that part otherwise, and then stopped elsewhere).
#[derive(Default)]
struct Judge {
    unknown: Option<String>,
    invalid: Option<String>,
}

impl Judge {
    fn invalid<T>(&mut self, why: impl Into<String>) -> Option<T> {
        self.invalid.get_or_insert_with(|| why.into());
        None
    }
    fn unknown<T>(&mut self, why: impl Into<String>) -> Option<T> {
        self.unknown.get_or_insert_with(|| why.into());
        None
    }
}

fn kv_int(v: &Mp) -> Option<i128> {
    if let Mp::Int(n) = v {
        Some(*n)
    } else {
        None
    }
}

/// A block hash: an unsigned integer, or a digest of at least 8 bytes (its last 8, big-endian);
/// a string that is not UTF-8 reaches serde as bytes, like a digest.
fn kv_hash(v: &Mp, j: &mut Judge) -> Option<WireHash> {
    match v {
        Mp::Int(n) => u64::try_from(*n).ok().map(WireHash).or_else(|| j.invalid(format!("block hash {n}"))),
        Mp::Bin(b) | Mp::Str(b) if v_is_bytes(v) && b.len() >= 8 => {
            Some(WireHash(u64::from_be_bytes(b[b.len() - 8..].try_into().unwrap())))
        }
        _ => j.invalid(format!("block hash {v:?}")),
    }
}

/// Bytes as serde sees them inside an event: a bin, or a string that is not UTF-8.
fn v_is_bytes(v: &Mp) -> bool {
    match v {
        Mp::Bin(_) => true,
        Mp::Str(s) => std::str::from_utf8(s).is_err(),
        _ => false,
    }
}

fn kv_list<T>(v: &Mp, j: &mut Judge, what: &str, mut item: impl FnMut(&Mp, &mut Judge) -> Option<T>) -> Option<Vec<T>> {
    let Mp::Arr(items) = v else { return j.invalid(format!("{what} is not an array: {v:?}")) };
    let mut out = Vec::with_capacity(items.len());
    let mut ok = true;
    for v in items {
        match item(v, j) {
            Some(x) => out.push(x),
            None => ok = false,
        }
    }
    ok.then_some(out)
}

/// An optional field: `Some(None)` for nil.
fn kv_opt<T>(v: &Mp, j: &mut Judge, item: impl FnOnce(&Mp, &mut Judge) -> Option<T>) -> Option<Option<T>> {
    match v {
        Mp::Nil => Some(None),
        v => item(v, j).map(Some),
    }
}

fn kv_i64(v: &Mp, j: &mut Judge) -> Option<i64> {
    kv_int(v).and_then(|n| i64::try_from(n).ok()).or_else(|| j.invalid(format!("not an i64: {v:?}")))
}

/// A string field: a UTF-8 string, or bytes that are UTF-8 (serde's `String` takes both).
fn kv_string(v: &Mp, j: &mut Judge) -> Option<String> {
    match v {
        Mp::Str(b) | Mp::Bin(b) => String::from_utf8(b.clone()).ok().or_else(|| j.invalid("a string field not UTF-8")),
        _ => j.invalid(format!("not a string: {v:?}")),
    }
}

/// An event's map without its `type`, each known field at most once.
fn kv_fields<'a>(fields: &[(&'a str, &'a Mp)], known: &[&str], j: &mut Judge) -> Option<HashMap<&'a str, &'a Mp>> {
    let mut out = HashMap::new();
    for &(k, v) in fields {
        if known.contains(&k) && out.insert(k, v).is_some() {
            return j.invalid(format!("field {k} twice"));
        }
    }
    Some(out)
}

fn kv_stored(fields: &[(&str, &Mp)], j: &mut Judge) -> Option<kv_wire::Event> {
    const KNOWN: [&str; 8] = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_name",
        "medium",
        "extra_keys",
        "group_idx",
    ];
    let f = kv_fields(fields, &KNOWN, j)?;
    let required = |name: &str, j: &mut Judge| f.get(name).copied().or_else(|| j.invalid(format!("no {name}")));
    let block_hashes = required("block_hashes", j).and_then(|v| kv_list(v, j, "block_hashes", kv_hash));
    let parent = f.get("parent_block_hash").map_or(Some(None), |v| kv_opt(v, j, kv_hash));
    let token_ids = required("token_ids", j).and_then(|v| {
        kv_list(v, j, "token_ids", |v, j| {
            kv_int(v).and_then(|n| u32::try_from(n).ok()).or_else(|| j.invalid(format!("token id {v:?}")))
        })
    });
    let block_size = required("block_size", j).and_then(|v| {
        kv_int(v).and_then(|n| usize::try_from(n).ok()).or_else(|| j.invalid(format!("block_size {v:?}")))
    });
    let lora_name = f.get("lora_name").map_or(Some(None), |v| kv_opt(v, j, kv_string));
    let medium = f.get("medium").map_or(Some(None), |v| kv_opt(v, j, kv_string));
    let extra_keys = f
        .get("extra_keys")
        .map_or(Some(None), |v| kv_opt(v, j, |v, j| kv_list(v, j, "extra_keys", |v, _| Some(kv_block_keys(v)))));
    let group_idx = f.get("group_idx").map_or(Some(None), |v| kv_opt(v, j, kv_i64));
    Some(kv_wire::Event::BlockStored(Stored {
        block_hashes: block_hashes?,
        parent_block_hash: parent?,
        token_ids: token_ids?,
        block_size: block_size?,
        lora_name: lora_name?,
        medium: medium?,
        extra_keys: extra_keys?,
        group_idx: group_idx?,
    }))
}

/// One block's extra keys: `None` for nil; an array's UTF-8 strings kept and anything else
/// flagged; any other value flagged whole.
fn kv_block_keys(v: &Mp) -> Option<BlockKeys> {
    let text = |v: &Mp| match v {
        Mp::Str(b) => String::from_utf8(b.clone()).ok(),
        _ => None,
    };
    match v {
        Mp::Nil => None,
        Mp::Arr(items) => {
            let texts: Vec<String> = items.iter().filter_map(text).collect();
            Some(BlockKeys { other: texts.len() < items.len(), texts })
        }
        _ => Some(BlockKeys { texts: Vec::new(), other: true }),
    }
}

fn kv_removed(fields: &[(&str, &Mp)], j: &mut Judge) -> Option<kv_wire::Event> {
    let f = kv_fields(fields, &["block_hashes", "medium", "group_idx"], j)?;
    let block_hashes = match f.get("block_hashes") {
        Some(v) => kv_list(v, j, "block_hashes", kv_hash),
        None => j.invalid("no block_hashes"),
    };
    let medium = f.get("medium").map_or(Some(None), |v| kv_opt(v, j, kv_string));
    let group_idx = f.get("group_idx").map_or(Some(None), |v| kv_opt(v, j, kv_i64));
    Some(kv_wire::Event::BlockRemoved(Removed { block_hashes: block_hashes?, medium: medium?, group_idx: group_idx? }))
}

/// One event as msgspec writes it: a map with its class name under `type` beside its fields;
/// unknown fields are skipped, an unknown `type` is `Other`.
fn kv_event(v: &Mp, j: &mut Judge) -> Option<kv_wire::Event> {
    let pairs = match v {
        Mp::Map(pairs) => pairs,
        Mp::Arr(_) => return j.unknown("an event as an array (serde takes its first element as the tag)"),
        _ => return j.invalid(format!("an event that is not a map: {v:?}")),
    };
    let mut tag = None;
    let mut fields = Vec::new();
    for (k, v) in pairs {
        let Some(k) = (if let Mp::Str(k) = k { std::str::from_utf8(k).ok() } else { None }) else {
            return j.unknown("a key that is not a UTF-8 string");
        };
        if k == "type" {
            if tag.replace(v).is_some() {
                return j.invalid("type twice");
            }
        } else {
            fields.push((k, v));
        }
    }
    let name = match tag {
        None => return j.invalid("an event without its type"),
        Some(Mp::Str(name)) => match std::str::from_utf8(name) {
            Ok(name) => name,
            Err(_) => return j.unknown("a type that is not UTF-8"),
        },
        Some(_) => return j.unknown("a type that is not a string (serde reads an integer as the variant's index)"),
    };
    match name {
        "BlockStored" => kv_stored(&fields, j),
        "BlockRemoved" => kv_removed(&fields, j),
        "AllBlocksCleared" => Some(kv_wire::Event::AllBlocksCleared),
        _ => Some(kv_wire::Event::Other),
    }
}

/// vLLM 0.32's `KVEventBatch` read from `payload` by the msgpack spec and msgspec's shape:
/// exactly one value, an array `[ts, events]` or `[ts, events, data_parallel_rank]`, `ts` a
/// number, `events` an array of event maps, the rank nil or an i64. What lies outside that
/// shape but serde may read (a batch as a map, keys that are not strings, extension types) is
/// `Unknown`.
fn kv_reference(payload: &[u8]) -> Result<EventBatch, Verdict> {
    let mut at = 0;
    let value = mp_read(payload, &mut at, 0)?;
    if at != payload.len() {
        return Err(Verdict::Trailing(payload.len() - at));
    }
    if !mp_string_keys(&value) {
        return Err(Verdict::Unknown("a map key that is not a UTF-8 string".into()));
    }
    let items = match value {
        Mp::Arr(items) => items,
        Mp::Map(_) => return Err(Verdict::Unknown("a batch as a map (msgspec writes an array)".into())),
        other => return Err(Verdict::Invalid(format!("a batch that is not an array: {other:?}"))),
    };
    if !(2..=3).contains(&items.len()) {
        return Err(Verdict::Invalid(format!("a batch of {} elements", items.len())));
    }
    let mut j = Judge::default();
    let ts = match items[0] {
        Mp::Int(n) => Some(i64::try_from(n).map_or(n as u64 as f64, |n| n as f64)),
        Mp::Float(x) => Some(x),
        ref other => j.invalid(format!("ts {other:?}")),
    };
    let events = match &items[1] {
        // rmp_serde reads bytes where it wants a sequence as a sequence of integers.
        Mp::Bin(b) if b.is_empty() => Some(Vec::new()),
        v => kv_list(v, &mut j, "events", kv_event),
    };
    let rank = items.get(2).map_or(Some(None), |v| kv_opt(v, &mut j, kv_i64));
    match (j.unknown, j.invalid) {
        (Some(why), _) => Err(Verdict::Unknown(why)),
        (None, Some(why)) => Err(Verdict::Invalid(why)),
        (None, None) => Ok(EventBatch { ts: ts.unwrap(), events: events.unwrap(), data_parallel_rank: rank.unwrap() }),
    }
}

// The writer: msgpack as msgspec writes it (smallest forms, floats as float64).

fn mp_uint_out(out: &mut Vec<u8>, n: u64) {
    match n {
        0..=0x7f => out.push(n as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, n as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

fn mp_int_out(out: &mut Vec<u8>, n: i64) {
    match n {
        0.. => mp_uint_out(out, n as u64),
        -32..=-1 => out.push(n as u8),
        -128..=-33 => out.extend_from_slice(&[0xd0, n as u8]),
        -32768..=-129 => {
            out.push(0xd1);
            out.extend_from_slice(&(n as i16).to_be_bytes());
        }
        -2_147_483_648..=-32769 => {
            out.push(0xd2);
            out.extend_from_slice(&(n as i32).to_be_bytes());
        }
        _ => {
            out.push(0xd3);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

/// A length-prefixed head: `fix` form below `fix_max`, then the 8/16/32-bit forms from
/// `wide` (`None` where the type has no 8-bit form).
fn mp_head(out: &mut Vec<u8>, len: usize, fix: u8, fix_max: usize, wide: [Option<u8>; 3]) {
    if len < fix_max {
        out.push(fix | len as u8);
    } else if let (Some(m), true) = (wide[0], len <= 0xff) {
        out.extend_from_slice(&[m, len as u8]);
    } else if len <= 0xffff {
        out.push(wide[1].unwrap());
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(wide[2].unwrap());
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

fn mp_str_out(out: &mut Vec<u8>, s: &str) {
    mp_head(out, s.len(), 0xa0, 32, [Some(0xd9), Some(0xda), Some(0xdb)]);
    out.extend_from_slice(s.as_bytes());
}

fn mp_bin_out(out: &mut Vec<u8>, b: &[u8]) {
    mp_head(out, b.len(), 0xc4, 0, [Some(0xc4), Some(0xc5), Some(0xc6)]);
    out.extend_from_slice(b);
}

fn mp_arr_out(out: &mut Vec<u8>, len: usize) {
    mp_head(out, len, 0x90, 16, [None, Some(0xdc), Some(0xdd)]);
}

fn mp_map_out(out: &mut Vec<u8>, len: usize) {
    mp_head(out, len, 0x80, 16, [None, Some(0xde), Some(0xdf)]);
}

fn mp_opt_str_out(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => mp_str_out(out, s),
        None => out.push(0xc0),
    }
}

/// The `block_hashes` member: its key, then the hashes as one array.
fn mp_hashes_out(out: &mut Vec<u8>, hashes: &[WireHash], digests: bool) {
    mp_str_out(out, "block_hashes");
    mp_arr_out(out, hashes.len());
    for h in hashes {
        mp_hash_out(out, *h, digests);
    }
}

/// A block hash as vLLM publishes it: the integer (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
/// the default) or a 32-byte digest whose last 8 bytes are that integer.
fn mp_hash_out(out: &mut Vec<u8>, h: WireHash, digests: bool) {
    if digests {
        let mut digest = [0xa5u8; 32];
        digest[24..].copy_from_slice(&h.0.to_be_bytes());
        mp_bin_out(out, &digest);
    } else {
        mp_uint_out(out, h.0);
    }
}

/// `batch` as vLLM 0.32's msgspec encodes a `KVEventBatch` (`fuzz/seeds.py` writes the same
/// and checks it against vLLM's own encoder): `[ts, events, rank]` (a `None` rank as nil), each
/// event a map of `type` and its fields in vLLM's order, nil for the fields without a default
/// (`lora_id` always), fields left at their default omitted. An `Other` event is written as a
/// type this version does not know.
pub fn kv_encode(batch: &EventBatch, digests: bool) -> Vec<u8> {
    let mut out = Vec::new();
    mp_arr_out(&mut out, 3);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_bits().to_be_bytes());
    mp_arr_out(&mut out, batch.events.len());
    for event in &batch.events {
        match event {
            kv_wire::Event::BlockStored(s) => {
                mp_map_out(&mut out, 8 + usize::from(s.extra_keys.is_some()) + usize::from(s.group_idx.is_some()));
                mp_str_out(&mut out, "type");
                mp_str_out(&mut out, "BlockStored");
                mp_hashes_out(&mut out, &s.block_hashes, digests);
                mp_str_out(&mut out, "parent_block_hash");
                match s.parent_block_hash {
                    Some(h) => mp_hash_out(&mut out, h, digests),
                    None => out.push(0xc0),
                }
                mp_str_out(&mut out, "token_ids");
                mp_arr_out(&mut out, s.token_ids.len());
                for &t in &s.token_ids {
                    mp_uint_out(&mut out, t.into());
                }
                mp_str_out(&mut out, "block_size");
                mp_uint_out(&mut out, s.block_size as u64);
                mp_str_out(&mut out, "lora_id");
                out.push(0xc0);
                mp_str_out(&mut out, "medium");
                mp_opt_str_out(&mut out, s.medium.as_deref());
                mp_str_out(&mut out, "lora_name");
                mp_opt_str_out(&mut out, s.lora_name.as_deref());
                if let Some(keys) = &s.extra_keys {
                    mp_str_out(&mut out, "extra_keys");
                    mp_arr_out(&mut out, keys.len());
                    for key in keys {
                        match key {
                            // As vLLM publishes them: a tuple of the block's keys, untagged (a
                            // key not a string written as an integer).
                            Some(k) => {
                                mp_arr_out(&mut out, k.texts.len() + usize::from(k.other));
                                k.texts.iter().for_each(|t| mp_str_out(&mut out, t));
                                if k.other {
                                    mp_uint_out(&mut out, 7);
                                }
                            }
                            None => out.push(0xc0),
                        }
                    }
                }
                if let Some(g) = s.group_idx {
                    mp_str_out(&mut out, "group_idx");
                    mp_int_out(&mut out, g);
                }
            }
            kv_wire::Event::BlockRemoved(r) => {
                mp_map_out(&mut out, 3 + usize::from(r.group_idx.is_some()));
                mp_str_out(&mut out, "type");
                mp_str_out(&mut out, "BlockRemoved");
                mp_hashes_out(&mut out, &r.block_hashes, digests);
                mp_str_out(&mut out, "medium");
                mp_opt_str_out(&mut out, r.medium.as_deref());
                if let Some(g) = r.group_idx {
                    mp_str_out(&mut out, "group_idx");
                    mp_int_out(&mut out, g);
                }
            }
            kv_wire::Event::AllBlocksCleared => {
                mp_map_out(&mut out, 1);
                mp_str_out(&mut out, "type");
                mp_str_out(&mut out, "AllBlocksCleared");
            }
            kv_wire::Event::Other => {
                mp_map_out(&mut out, 2);
                mp_str_out(&mut out, "type");
                mp_str_out(&mut out, "BlockPinned");
                mp_str_out(&mut out, "block_hashes");
                mp_arr_out(&mut out, 0);
            }
        }
    }
    match batch.data_parallel_rank {
        Some(rank) => mp_int_out(&mut out, rank),
        None => out.push(0xc0),
    }
    out
}

/// Equal batches, `ts` compared by its bits (a NaN is itself).
fn same_batch(a: &EventBatch, b: &EventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits() && a.events == b.events && a.data_parallel_rank == b.data_parallel_rank
}

/// The seed and block size the hash check is given: those of the recorded vLLM
/// (`tests/fixtures/kv_hashes/`), so its real batches match.
pub const KV_SEED: &str = "0";
pub const KV_BLOCK: usize = 32;

/// One `BlockStored` through the hash check: at most one mismatch, with its drift; another
/// block size is block-size drift and nothing else; without a parent, the blocks matched are
/// exactly the leading ones (before the first with extra keys) that tokenonce's own chain of
/// the event's tokens gives, and a mismatch is the first that differs.
fn check_hash_check(check: &mut HashCheck, hasher: &BlockHasher, s: &Stored) {
    let out = check.check(s, &|_| None);
    assert!(out.mismatched <= 1 && out.drift.is_some() == (out.mismatched == 1), "{out:?}");
    let blocks = s.block_hashes.len().min(s.token_ids.len() / KV_BLOCK);
    assert!(out.matched as usize <= blocks, "{out:?} of {blocks} blocks");
    if s.block_size != KV_BLOCK {
        let drift = Drift::BlockSize { engine: s.block_size, configured: KV_BLOCK };
        assert_eq!(out, Outcome { matched: 0, mismatched: 1, drift: Some(drift) });
        return;
    }
    if s.parent_block_hash.is_none() {
        // No adapter's path is known: blocks are checked up to the first with a LoRA, media or
        // a salt past block 0; a salt alone on block 0 is hashed in.
        let keys = |i: usize| s.extra_keys.as_ref().and_then(|k| k.get(i).cloned().flatten());
        let salt = match keys(0) {
            Some(BlockKeys { texts, other: false }) if texts.len() == 1 && s.lora_name.is_none() => {
                texts.first().cloned()
            }
            _ => None,
        };
        let plain = |i: usize| s.lora_name.is_none() && keys(i).is_none_or(|k| k.texts.is_empty() && !k.other);
        let checked = (0..blocks).take_while(|&i| plain(i) || (i == 0 && salt.is_some())).count();
        let salted = RequestKeys { lora: None, cache_salt: salt };
        let chain = hasher.chain(&s.token_ids[..checked * KV_BLOCK], &salted.as_extra());
        let agree = (0..checked).take_while(|&i| chain[i].wire() == s.block_hashes[i].0).count();
        assert_eq!((out.matched as usize, out.mismatched), (agree, u64::from(agree < checked)), "{s:?}");
        if agree < checked {
            assert_eq!(out.drift, Some(Drift::SeedOrAlgorithm));
        }
    }
}

/// `batch` applied as `kv/state.rs` applies one (device-cache blocks stored, removed, a slot
/// cleared; every `BlockStored` through the hash check) to a two-endpoint `BlockIndex` bounded
/// at `max_blocks`, first to `slot` then to the other, against a model: a list of (slot, hash)
/// in store order, a block stored again moved to the end, the oldest dropped past the bound.
/// After each event the index holds exactly the model's entries, never more than the bound, and
/// each store evicted as many as the model dropped.
pub fn check_kv_apply(batch: &EventBatch, max_blocks: usize, slot: usize) {
    let max_blocks = max_blocks.max(1);
    let mut index = BlockIndex::new(2, max_blocks);
    let mut model: Vec<(usize, u64)> = Vec::new();
    let hasher = BlockHasher::new(KV_SEED, KV_BLOCK);
    let mut check = HashCheck::new(hasher.clone(), 64);
    let named: HashSet<u64> = batch
        .events
        .iter()
        .flat_map(|e| match e {
            kv_wire::Event::BlockStored(s) => s.block_hashes.as_slice(),
            kv_wire::Event::BlockRemoved(r) => r.block_hashes.as_slice(),
            _ => &[],
        })
        .map(|h| h.0)
        .collect();
    for slot in [slot & 1, 1 - (slot & 1)] {
        for event in &batch.events {
            match event {
                kv_wire::Event::BlockStored(s) => {
                    if kv_wire::in_device_cache(s.medium.as_deref(), s.group_idx) {
                        let mut evicted = 0;
                        for h in &s.block_hashes {
                            model.retain(|e| *e != (slot, h.0));
                            model.push((slot, h.0));
                            if model.len() > max_blocks {
                                model.remove(0);
                                evicted += 1;
                            }
                        }
                        assert_eq!(index.store(slot, s.block_hashes.iter().map(|h| h.0)), evicted, "evictions");
                    }
                    check_hash_check(&mut check, &hasher, s);
                }
                kv_wire::Event::BlockRemoved(r) => {
                    if kv_wire::in_device_cache(r.medium.as_deref(), r.group_idx) {
                        index.remove(slot, r.block_hashes.iter().map(|h| h.0));
                        model.retain(|(s, h)| *s != slot || !r.block_hashes.contains(&WireHash(*h)));
                    }
                }
                kv_wire::Event::AllBlocksCleared => {
                    index.clear(slot);
                    model.retain(|(s, _)| *s != slot);
                }
                kv_wire::Event::Other => {}
            }
            assert!(index.len() <= max_blocks, "{} entries past the bound {max_blocks}", index.len());
            assert_eq!(index.len(), model.len(), "entries");
            for &h in &named {
                for s in 0..2 {
                    assert_eq!(index.holds(s, h), model.contains(&(s, h)), "slot {s} block {h:#x}");
                }
            }
        }
    }
}

/// One msgpack payload: the decoder agrees with the reference (what the reference reads as a
/// batch decodes to the same batch; what it calls malformed is an `Err`, never a default);
/// it is deterministic; whatever it decodes, written again as msgspec writes it (hashes as
/// integers, or as digests with `digests`), decodes to the same batch, which the reference
/// reads too; and that batch applies to a bounded index as `check_kv_apply` says.
pub fn check_kv_batch(payload: &[u8], digests: bool, max_blocks: usize, slot: usize) {
    let got = kv_wire::decode_batch(payload);
    match (kv_reference(payload), &got) {
        (Ok(want), Ok(got)) => assert!(same_batch(&want, got), "reference {want:?}\ndecoder {got:?}"),
        (Ok(want), Err(e)) => panic!("the reference reads {want:?}; the decoder refuses it: {e}"),
        (Err(Verdict::Invalid(why)), Ok(got)) => panic!("malformed ({why}), yet decoded as {got:?}"),
        (Err(Verdict::Invalid(_)), Err(e)) => assert!(matches!(e, kv_wire::WireError::Payload(_)), "{e:?}"),
        (Err(Verdict::Trailing(n)), Ok(got)) => panic!("{n} bytes after the batch, yet decoded as {got:?}"),
        // Refused for what the value holds, or for what follows it.
        (Err(Verdict::Trailing(n)), Err(e)) => assert!(
            matches!(e, kv_wire::WireError::Payload(_)) || matches!(e, kv_wire::WireError::Trailing(m) if *m == n),
            "{e:?}, not {n} bytes after"
        ),
        (Err(Verdict::Unknown(_)), _) => {}
    }
    let Ok(batch) = got else { return };
    let again = kv_wire::decode_batch(payload).expect("decoded once, then not");
    assert!(same_batch(&batch, &again), "not deterministic");
    let written = kv_encode(&batch, digests);
    match kv_wire::decode_batch(&written) {
        Ok(back) => assert!(same_batch(&batch, &back), "round trip\n{batch:?}\n{back:?}"),
        Err(e) => panic!("{batch:?} written again does not decode: {e}"),
    }
    match kv_reference(&written) {
        Ok(back) => assert!(same_batch(&batch, &back), "the reference reads the written batch otherwise: {back:?}"),
        Err(v) => panic!("the reference does not read the written batch: {v:?}"),
    }
    check_kv_apply(&batch, max_blocks, slot);
}

/// A ZeroMQ message `frames`: not three frames is `Frames(n)`; a sequence frame not 8 bytes
/// is `Sequence(len)`; else the sequence is the frame's big-endian value (written back to the
/// same 8 bytes; `REPLAY_END` exactly when all bits are set), and the message decodes exactly
/// when its payload does, to the same batch.
pub fn check_kv_message(frames: &[Vec<u8>]) {
    let got = kv_wire::decode_message(frames);
    if frames.len() != 3 {
        assert!(matches!(got, Err(kv_wire::WireError::Frames(n)) if n == frames.len()), "{got:?}");
        return;
    }
    let (seq_frame, payload) = (&frames[1], &frames[2]);
    let Ok(seq) = kv_wire::sequence(seq_frame) else {
        assert_ne!(seq_frame.len(), 8);
        assert!(matches!(got, Err(kv_wire::WireError::Sequence(n)) if n == seq_frame.len()), "{got:?}");
        return;
    };
    assert_eq!(seq.to_be_bytes().as_slice(), seq_frame.as_slice());
    assert_eq!(seq == kv_wire::REPLAY_END, seq_frame.iter().all(|&b| b == 0xff));
    match (got, kv_wire::decode_batch(payload)) {
        (Ok((s, a)), Ok(b)) => assert!(s == seq && same_batch(&a, &b)),
        (Err(kv_wire::WireError::Payload(_)), Err(kv_wire::WireError::Payload(_))) => {}
        (Err(kv_wire::WireError::Trailing(n)), Err(kv_wire::WireError::Trailing(m))) if n == m => {}
        (got, alone) => panic!("message {got:?}, its payload alone {alone:?}"),
    }
}

/// Fuzz input: byte 0 = flags (bits 0–1: 0 and 1 three frames, 2 two (no payload), 3 four (an
/// empty delimiter first, as a replay answer has before `kv/replay.rs` strips it); bit 2: the
/// sequence frame is `flags >> 4` bytes long (9 for 8), not 8; bit 3: the round trip writes
/// block hashes as 32-byte digests; bits 4–7: the index bound minus 1, and the first slot),
/// byte 1's low 4 bits = the topic's length; then the topic, the sequence frame and the
/// payload (the rest), which is also checked as a batch on its own.
pub fn fuzz_kv_wire(data: &[u8]) {
    let [flags, topic_len, rest @ ..] = data else { return };
    let (topic, rest) = rest.split_at(usize::from(topic_len & 15).min(rest.len()));
    let seq_len = match (flags & 4, flags >> 4) {
        (0, _) => 8,
        (_, 8) => 9,
        (_, n) => usize::from(n),
    };
    let (seq, payload) = rest.split_at(seq_len.min(rest.len()));
    let mut frames = vec![topic.to_vec(), seq.to_vec(), payload.to_vec()];
    match flags & 3 {
        2 => drop(frames.pop()),
        3 => frames.insert(0, Vec::new()),
        _ => {}
    }
    check_kv_message(&frames);
    check_kv_batch(payload, flags & 8 != 0, usize::from(flags >> 4) + 1, usize::from(flags >> 4));
}
