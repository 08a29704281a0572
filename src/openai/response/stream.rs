//! The framing of a relayed engine stream: whole SSE events only, each with its exact bytes
//! unless a usage rewrite applies to it, bounded in length; a cut event is dropped. The events
//! that carry generated content are counted (time to first token, inter-token latency).

use super::rewrite::rewrite_usage_cached;
use crate::openai::Api;
use crate::sse::{data_of, other_lines_of, SseDecoder};

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
        let mut out = Vec::with_capacity(chunk.len() + 64);
        let rewrite = &mut self.rewrite;
        self.decoder.feed_each(chunk, |raw| emit(raw, rewrite, &mut out));
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

/// Appends the event `raw` to `out`: `rewrite`'s version of its JSON data, else its exact
/// bytes.
fn emit(raw: &[u8], rewrite: &mut impl FnMut(&str) -> Option<Vec<u8>>, out: &mut Vec<u8>) {
    let rewritten = Some(raw)
        .filter(|raw| may_hold_usage(raw))
        .and_then(data_of)
        .filter(|d| d.iter().find(|b| !is_json_ws(**b)) == Some(&b'{'))
        .and_then(|d| String::from_utf8(d).ok())
        .and_then(|d| rewrite(&d));
    match rewritten {
        Some(data) => {
            // The event's other fields first (`event: response.completed` names the event).
            for line in other_lines_of(raw) {
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
        None => out.extend_from_slice(raw),
    }
}

/// The `sequence_number` of a Responses event (`raw`, its bytes): the value after the last
/// `"sequence_number":` key (vLLM writes it last, after the nested response).
fn sequence_number(raw: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"sequence_number\":";
    let at = memchr::memmem::rfind(raw, KEY)? + KEY.len();
    let rest = raw.get(at..)?;
    let digits: Vec<u8> = rest.iter().copied().skip_while(|b| *b == b' ').take_while(u8::is_ascii_digit).collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

/// True when `raw` (one SSE event of an `api` stream, its bytes) carries generated content,
/// found by a byte search instead of a JSON parse per event: a key of the API's content with
/// a non-empty value after it: a string (`"content":""` or `null` is not content), an array
/// for `tool_calls` and `token_ids` (`[]` is not).
///
/// - chat: `choices[].delta` `content`, `reasoning` (vLLM 0.32), `reasoning_content` (older
///   vLLM) or `tool_calls`;
/// - completions: `choices[].text`;
/// - Responses: a `delta` (`response.output_text.delta`, `response.reasoning_text.delta`,
///   `response.function_call_arguments.delta`, ...);
/// - Messages: a `content_block_delta`'s `text`, `thinking` or `partial_json`
///   (`signature_delta` is not content);
/// - generate: `choices[].token_ids`.
///
/// The quoted key followed by `:` cannot occur inside a JSON string (its quotes would be
/// escaped there), so a match is a key. A key spelled with `\u` escapes is not recognised:
/// vLLM writes its keys plainly.
pub fn carries_content(api: Api, raw: &[u8]) -> bool {
    // Each key with what its value opens with: a string (`"`) or an array (`[`).
    let keys: &[(&[u8], u8)] = match api {
        Api::Chat => &[
            (b"\"content\":", b'"'),
            (b"\"reasoning\":", b'"'),
            (b"\"reasoning_content\":", b'"'),
            (b"\"tool_calls\":", b'['),
        ],
        Api::Completions => &[(b"\"text\":", b'"')],
        Api::Responses => &[(b"\"delta\":", b'"')],
        Api::Messages => &[(b"\"text\":", b'"'), (b"\"thinking\":", b'"'), (b"\"partial_json\":", b'"')],
        Api::Generate => &[(b"\"token_ids\":", b'[')],
    };
    keys.iter().any(|&(key, open)| {
        memchr::memmem::find_iter(raw, key).any(|at| {
            let mut value = raw.iter().skip(at + key.len()).copied().skip_while(|b| is_json_ws(*b));
            match value.next() {
                // A string's first byte, whitespace included, is content; its closing quote not.
                Some(b'"') if open == b'"' => value.next().is_some_and(|b| b != b'"'),
                Some(b'[') if open == b'[' => value.find(|b| !is_json_ws(*b)).is_some_and(|b| b != b']'),
                _ => false,
            }
        })
    })
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
    /// The `sequence_number` an event tokenonce adds to a Responses stream takes: one past
    /// the last passed event's.
    next_sequence: u64,
    /// Events passed that carry generated content ([`carries_content`]).
    content_events: u64,
}

impl StreamFraming {
    /// Framing for one chat or completions stream; `cached_tokens` as the prefill reported
    /// it. No event limit.
    pub fn new(cached_tokens: Option<u64>) -> Self {
        Self::for_api(Api::Chat, cached_tokens)
    }

    /// Framing for one stream of `api` (whose usage shape the rewrite follows).
    pub fn for_api(api: Api, cached_tokens: Option<u64>) -> Self {
        Self {
            decoder: SseDecoder::new(),
            cached_tokens,
            api,
            max_event: usize::MAX,
            overlong: false,
            next_sequence: 0,
            content_events: 0,
        }
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
        let mut out = Vec::with_capacity(chunk.len());
        self.feed_into(chunk, &mut out);
        out
    }

    /// [`Self::feed`], appending to `out` (several engine reads framed into one write).
    pub fn feed_into(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        let Self { decoder, cached_tokens, api, max_event, overlong, next_sequence, content_events } = self;
        let (api, max_event) = (*api, *max_event);
        decoder.feed_each(chunk, |raw| {
            // Every event after one over the limit is dropped too.
            if *overlong || raw.len() > max_event {
                *overlong = true;
                return;
            }
            match *cached_tokens {
                Some(n) => emit(raw, &mut |d: &str| rewrite_usage_cached(api, d, n), out),
                None => out.extend_from_slice(raw),
            }
            if api == Api::Responses {
                *next_sequence = sequence_number(raw).map_or(*next_sequence + 1, |n| n + 1);
            }
            if carries_content(api, raw) {
                *content_events += 1;
            }
        });
    }

    /// How many of the events passed so far carry generated content ([`carries_content`]).
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// For a Responses stream, the `sequence_number` of an event added after those passed
    /// (an error event): one past the last one's, or the count of events when they had none.
    pub fn next_sequence(&self) -> u64 {
        self.next_sequence
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
    use crate::openai::response::rewrite::rewrite_cached_tokens;
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
    fn a_responses_stream_gives_the_next_sequence_number() {
        let mut f = StreamFraming::for_api(Api::Responses, None);
        assert_eq!(f.next_sequence(), 0, "nothing passed yet");
        f.feed(b"event: response.created\ndata: {\"response\":{\"sequence_number\":99},\"sequence_number\":0,\"type\":\"response.created\"}\n\n");
        assert_eq!(f.next_sequence(), 1);
        f.feed(b"event: response.output_text.delta\ndata: {\"delta\":\"x\",\"sequence_number\": 5}\n\nevent: x\ndata: {\"sequence_");
        assert_eq!(f.next_sequence(), 6, "a cut event does not count");
        f.feed(b"number\":6}\n\nevent: odd\ndata: {}\n\n");
        assert_eq!(f.next_sequence(), 8, "an event without one counts as the next");
        let mut chat = StreamFraming::new(None);
        chat.feed(b"data: {\"sequence_number\":4}\n\n");
        assert_eq!(chat.next_sequence(), 0, "only Responses streams number their events");
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
    fn content_events_are_those_with_generated_text_of_each_api() {
        let yes: &[(Api, &[u8])] = &[
            (Api::Chat, br#"data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"index":0,"delta":{"content": " "}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"index":0,"delta":{"reasoning":" Aircraft"}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"delta":{"reasoning_content":"so"}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#),
            (Api::Completions, br#"data: {"choices":[{"index":0,"text":"attice","logprobs":null}]}"#),
            (Api::Responses, b"event: response.output_text.delta\ndata: {\"delta\":\"x\",\"sequence_number\":5}"),
            (
                Api::Responses,
                br#"data: {"content_index":0,"delta":" Aircraft","type":"response.reasoning_text.delta"}"#,
            ),
            (Api::Messages, br#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"hi"}}"#),
            (
                Api::Messages,
                br#"data: {"type":"content_block_delta","delta":{"type":"thinking_delta","thinking":" A"}}"#,
            ),
            (Api::Generate, br#"data: {"choices":[{"index":0,"token_ids":[58845]}]}"#),
        ];
        let no: &[(Api, &[u8])] = &[
            (Api::Chat, br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"delta":{"content":null},"logprobs":{"content":[{"token":"a"}]}}]}"#),
            (Api::Chat, br#"data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":5}}"#),
            (Api::Chat, br#"data: {"choices":[{"delta":{"content":null,"x":"say \"content\":\"x\""}}]}"#),
            (Api::Chat, br#"data: {"choices":[{"delta":{"tool_calls":[ ]}}]}"#),
            (Api::Chat, b"data: [DONE]"),
            (Api::Completions, br#"data: {"choices":[{"text":"","logprobs":{"text_offset":[1]}}]}"#),
            (Api::Responses, br#"data: {"response":{"output":[],"text":null},"type":"response.created"}"#),
            (Api::Messages, br#"data: {"type":"content_block_start","content_block":{"type":"text","text":""}}"#),
            (
                Api::Messages,
                br#"data: {"type":"content_block_delta","delta":{"type":"signature_delta","signature":"5"}}"#,
            ),
            (Api::Generate, br#"data: {"choices":[{"finish_reason":"length","token_ids":[]}]}"#),
        ];
        for (api, raw) in yes {
            assert!(carries_content(*api, raw), "{api:?}: {}", String::from_utf8_lossy(raw));
        }
        for (api, raw) in no {
            assert!(!carries_content(*api, raw), "{api:?}: {}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn framing_counts_the_content_events_it_passed() {
        // vLLM's chat stream: a role event with empty content, N content events, usage, [DONE].
        let stream = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"c\"}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut f = StreamFraming::new(Some(1));
            f.feed(&stream.as_bytes()[..cut]);
            f.feed(&stream.as_bytes()[cut..]);
            assert_eq!(f.content_events(), 3, "cut at {cut}");
        }
        let mut f = StreamFraming::new(None).with_event_limit(40);
        f.feed(stream.as_bytes());
        assert_eq!(f.content_events(), 0, "the first event is over the limit: nothing passed");
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
