//! Rewrites and framing run on bodies recorded from a real vLLM 0.32.0 (tests/fixtures/vllm,
//! re-recorded by tests/e2e/record_fixtures.py), and the fake engine checked against them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::value::RawValue;
use serde_json::Value;
use support::*;
use tokenonce::openai::request::{decode_body, prefill_body};
use tokenonce::openai::response::{extract_handoff, hide_token_ids, rewrite_cached_tokens, SseRewriter, StreamFraming};
use tokenonce::openai::{Api, RawObject, RequestView};
use tokenonce::sse::SseDecoder;

/// One recorded exchange.
struct Fixture {
    path: String,
    method: String,
    status: u16,
    request: String,
    response: String,
}

fn fixture(name: &str) -> Fixture {
    let path = format!("{}/tests/fixtures/vllm/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    Fixture {
        path: v["path"].as_str().unwrap().to_owned(),
        method: v["method"].as_str().unwrap().to_owned(),
        status: v["status"].as_u64().unwrap() as u16,
        request: v["request_body"].as_str().unwrap().to_owned(),
        response: v["response_body"].as_str().unwrap().to_owned(),
    }
}

const IDS: &str =
    "[151644,8948,198,2610,525,50537,13,151645,198,151644,872,198,9707,1052,0,151645,198,151644,77091,198]";

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

/// The handoff a recorded decode leg carried: its `kv_transfer_params` without the ids, as the
/// prefill of its own (sent just before it, not recorded) returned them.
fn recorded_handoff(decode: &str) -> String {
    let mut kv = json(&fixture(decode).request)["kv_transfer_params"].clone();
    kv.as_object_mut().unwrap().remove("prompt_token_ids");
    serde_json::to_string(&kv).unwrap()
}

/// The prefill rewrite of the recorded plain chat is the prefill request that real vLLM
/// answered with ids (same fields; values equal).
#[test]
fn prefill_rewrite_matches_the_recorded_prefill_request() {
    for (plain, prefill, api) in [
        ("chat_plain", "chat_prefill", Api::Chat),
        ("completions_plain_stream", "completions_prefill", Api::Completions),
        ("responses_plain", "responses_prefill", Api::Responses),
    ] {
        let plain = fixture(plain);
        let obj = RawObject::parse(&plain.request).unwrap();
        assert!(RequestView::parse(api, &obj).unwrap().reuse_blocker().is_none());
        let ours = json(std::str::from_utf8(&prefill_body(&obj, None, api, true).to_bytes()).unwrap());
        let recorded = json(&fixture(prefill).request);
        assert_eq!(ours, recorded, "{api:?}");
    }
}

/// The handoff read from real prefill responses (NixlConnector): the 20 ids of the README
/// prompt, the engine's kv params byte for byte, and the completions ids on the first choice.
#[test]
fn handoff_from_real_prefill_responses() {
    let f = fixture("chat_prefill");
    let h = extract_handoff(Api::Chat, f.response.as_bytes()).unwrap();
    assert_eq!(h.ids.unwrap().as_json(), IDS);
    let kv = h.kv_transfer_params.unwrap();
    assert_eq!(json(&kv), json(&f.response)["kv_transfer_params"]);
    assert!(f.response.contains(&kv), "verbatim: {kv}");
    let kv = json(&kv);
    assert_eq!((kv["transfer_mode"].as_str(), kv["remote_num_tokens"].as_u64()), (Some("pull"), Some(20)));
    assert_eq!(kv["remote_block_ids"].as_array().unwrap().len(), 1, "one list per KV-cache group");
    assert_eq!(kv["remote_block_ids"][0].as_array().unwrap().len(), 1, "20 tokens: one 128-token block");
    let h = extract_handoff(Api::Completions, fixture("completions_prefill").response.as_bytes()).unwrap();
    assert_eq!(h.ids.unwrap().to_vec(), vec![9707, 1052, 0]);
    for name in ["chat_tools_prefill", "chat_thinking_off_prefill", "chat_multiturn_prefill"] {
        let f = fixture(name);
        if f.status == 200 {
            let h = extract_handoff(Api::Chat, f.response.as_bytes()).unwrap();
            assert!(h.ids.is_ok(), "{name}");
        }
    }
    // A plain response (no return_token_ids) has no ids: a fallback, not an error.
    let h = extract_handoff(Api::Chat, fixture("chat_plain").response.as_bytes()).unwrap();
    assert!(h.ids.is_err());
}

/// The decode rewrite of the recorded plain requests with the recorded prefill ids and handoff
/// is the token-in request real vLLM answered (after pulling the KV) identically to the plain one.
#[test]
fn decode_rewrite_matches_the_recorded_token_in_requests() {
    let ids = extract_handoff(Api::Chat, fixture("chat_prefill").response.as_bytes()).unwrap().ids.unwrap();
    let plain = fixture("chat_plain");
    let kv = recorded_handoff("chat_decode_ids");
    let ours =
        decode_body(&RawObject::parse(&plain.request).unwrap(), None, Api::Chat, Some(&kv), Some(&ids)).to_bytes();
    assert_eq!(json(std::str::from_utf8(&ours).unwrap()), json(&fixture("chat_decode_ids").request));

    let ids =
        extract_handoff(Api::Completions, fixture("completions_prefill").response.as_bytes()).unwrap().ids.unwrap();
    let mut plain_cmpl = json(&fixture("completions_plain_stream").request);
    plain_cmpl.as_object_mut().unwrap().remove("stream");
    plain_cmpl.as_object_mut().unwrap().remove("stream_options");
    let plain_text = serde_json::to_string(&plain_cmpl).unwrap();
    let kv = recorded_handoff("completions_decode_ids");
    let ours =
        decode_body(&RawObject::parse(&plain_text).unwrap(), None, Api::Completions, Some(&kv), Some(&ids)).to_bytes();
    assert_eq!(json(std::str::from_utf8(&ours).unwrap()), json(&fixture("completions_decode_ids").request));

    // And on the real engine the answers were the same: text, ids, usage.
    let a = json(&fixture("chat_plain").response);
    let b = json(&fixture("chat_decode_ids").response);
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["usage"], b["usage"]);
}

/// Real vLLM followed the ids, not the messages: a shortened id list gave fewer prompt tokens.
#[test]
fn recorded_decode_follows_the_ids() {
    let short = json(&fixture("chat_decode_short_ids").response);
    assert_eq!(short["usage"]["prompt_tokens"], 10);
}

/// Every recorded stream decodes to the same events whatever byte it is cut at.
#[test]
fn recorded_streams_survive_every_cut() {
    for name in [
        "chat_decode_ids_stream",
        "chat_plain_stream",
        "chat_stream_return_ids",
        "completions_decode_ids_stream",
        "completions_plain_stream",
    ] {
        let raw = fixture(name).response.into_bytes();
        let mut whole = SseDecoder::new();
        let events = whole.feed(&raw);
        whole.finish().unwrap();
        assert!(events.len() >= 4, "{name}");
        assert_eq!(events.last().unwrap().data().unwrap(), b"[DONE]");
        for cut in 0..=raw.len() {
            let mut dec = SseDecoder::new();
            let mut got = dec.feed(&raw[..cut]);
            got.extend(dec.feed(&raw[cut..]));
            dec.finish().unwrap();
            assert_eq!(got, events, "{name} cut at {cut}");
        }
        // The cached-tokens rewriter changes only the usage event, at any cut.
        for cut in (0..=raw.len()).step_by(13) {
            let mut rw = SseRewriter::new(|d: &str| rewrite_cached_tokens(d, 4));
            let mut out = rw.feed(&raw[..cut]);
            out.extend(rw.feed(&raw[cut..]));
            out.extend(rw.finish());
            let text = String::from_utf8(out).unwrap();
            let changed: Vec<&str> = text.split("\n\n").filter(|e| e.contains("\"cached_tokens\":4")).collect();
            let usage_events = text.split("\n\n").filter(|e| e.contains("\"usage\":{")).count();
            assert_eq!(changed.len(), usage_events, "{name}");
            let original = String::from_utf8(raw.clone()).unwrap();
            let untouched_in: Vec<&str> = original.split("\n\n").filter(|e| !e.contains("\"usage\":{")).collect();
            let untouched_out: Vec<&str> = text.split("\n\n").filter(|e| !e.contains("\"usage\":{")).collect();
            assert_eq!(untouched_in, untouched_out, "{name}");
        }
    }
}

/// A recorded stream broken at every byte offset: the relay framing passes exactly the events
/// completed before the cut (their bytes kept; with the cached-tokens rewrite, the rewritten
/// ones) and drops the cut event, so the error event that follows starts on its own line.
#[test]
fn broken_stream_passes_only_whole_events_at_every_cut() {
    let raw = fixture("chat_decode_ids_stream").response.into_bytes();
    let events = SseDecoder::new().feed(&raw);
    let rewritten: Vec<Vec<u8>> = events
        .iter()
        .map(|e| {
            let mut f = StreamFraming::new(Some(4));
            let out = f.feed(e.raw());
            assert_eq!(f.broken(), 0);
            out
        })
        .collect();
    for cut in 0..=raw.len() {
        let whole = events.iter().scan(0, |end, e| {
            *end += e.raw().len();
            Some(*end)
        });
        let complete = whole.take_while(|&end| end <= cut).count();
        let expected_plain: Vec<u8> = events[..complete].iter().flat_map(|e| e.raw().to_vec()).collect();
        let expected_rewritten: Vec<u8> = rewritten[..complete].concat();
        for (cached, expected) in [(None, expected_plain), (Some(4), expected_rewritten)] {
            let mut framing = StreamFraming::new(cached);
            let mut out = Vec::new();
            // Fed as the network might: in two pieces around an earlier point.
            let mid = cut / 2;
            out.extend(framing.feed(&raw[..mid]));
            out.extend(framing.feed(&raw[mid..cut]));
            let dropped = framing.broken();
            assert_eq!(out, expected, "cut at {cut}, cached {cached:?}");
            let consumed: usize = events[..complete].iter().map(|e| e.raw().len()).sum();
            assert_eq!(dropped, cut - consumed, "cut at {cut}");
            assert!(out.is_empty() || out.ends_with(b"\n\n"), "cut at {cut}");
        }
    }
}

/// Hiding echoed ids makes a return_token_ids response look like the plain one.
#[test]
fn hiding_ids_restores_the_plain_shape() {
    let with_ids = fixture("chat_prefill").response;
    let hidden_bytes = hide_token_ids(Api::Chat, &with_ids).unwrap();
    let hidden_text = std::str::from_utf8(&hidden_bytes).unwrap();
    let hidden = json(hidden_text);
    assert!(hidden["prompt_token_ids"].is_null());
    assert!(hidden["choices"][0]["token_ids"].is_null());
    // the prefill's answer also names its KV blocks, where the plain answer has null
    let kv = extract_handoff(Api::Chat, with_ids.as_bytes()).unwrap().kv_transfer_params.unwrap();
    let plain = fixture("chat_plain").response;
    assert!(kv.starts_with('{') && plain.contains("\"kv_transfer_params\":null"), "{kv}");
    assert_eq!(
        shape(hidden_text),
        shape(&plain).replace("kv_transfer_params:null", &format!("kv_transfer_params:{}", shape(&kv)))
    );
    let first_chunk = fixture("chat_stream_return_ids")
        .response
        .split("\n\n")
        .next()
        .unwrap()
        .trim_start_matches("data: ")
        .to_owned();
    let plain_first =
        fixture("chat_plain_stream").response.split("\n\n").next().unwrap().trim_start_matches("data: ").to_owned();
    let hidden = hide_token_ids(Api::Chat, &first_chunk).unwrap();
    let (a, b) = (json(std::str::from_utf8(&hidden).unwrap()), json(&plain_first));
    assert_eq!(a["prompt_token_ids"], b["prompt_token_ids"]);
}

/// A JSON value's shape: object keys in order with their value shapes, array element shapes,
/// scalar types. Values themselves are ignored.
fn shape(text: &str) -> String {
    let text = text.trim();
    match text.as_bytes().first() {
        Some(b'{') => {
            let obj = RawObject::parse(text).unwrap();
            let parts: Vec<String> = obj.keys().map(|k| format!("{k}:{}", shape(obj.get(k).unwrap()))).collect();
            format!("{{{}}}", parts.join(","))
        }
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(text).unwrap();
            match items.first() {
                None => "[]".into(),
                Some(first) => format!("[{}]", shape(first.get())),
            }
        }
        Some(b'"') => "s".into(),
        Some(b't' | b'f') => "b".into(),
        Some(b'n') => "null".into(),
        _ => "n".into(),
    }
}

fn stream_shapes(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.trim_start_matches("data: ");
            if data == "[DONE]" {
                data.to_owned()
            } else {
                shape(data)
            }
        })
        .collect()
}

/// The fake engine answers the recorded requests with the recorded shapes: same keys in the
/// same order, same JSON types, same statuses, SSE event by event.
#[tokio::test(flavor = "multi_thread")]
async fn fake_engine_matches_the_recordings() {
    // like the recorded pair: a KV connector, answers split by the qwen3 reasoning parser
    let fake = FakeVllm::start(FakeConfig { connector: true, ..FakeConfig::default() }).await;
    let names = [
        "chat_plain",
        "chat_plain_stream",
        "chat_prefill",
        "chat_decode_ids",
        "chat_decode_ids_stream",
        "chat_stream_return_ids",
        "chat_multiturn_prefill",
        "chat_thinking_off_prefill",
        "chat_prefill_nixl",
        "completions_prefill",
        "completions_decode_ids",
        "completions_decode_ids_stream",
        "completions_plain_stream",
        "err_unknown_model",
        "err_stream_options_without_stream",
        "err_min_tokens_gt_max",
        "err_decode_empty_ids",
        "get_version",
        "get_models",
        "generate_prefill",
        "generate_plain",
        "generate_plain_stream",
        "generate_decode",
        "generate_decode_stream",
        "err_generate_no_sampling_params",
    ];
    let client = reqwest::Client::new();
    for name in names {
        let f = fixture(name);
        let url = format!("http://{}{}", fake.host_port(), f.path);
        let resp = if f.method == "GET" {
            client.get(&url).send().await.unwrap()
        } else {
            client.post(&url).header("content-type", "application/json").body(f.request.clone()).send().await.unwrap()
        };
        assert_eq!(resp.status().as_u16(), f.status, "{name}");
        let body = resp.text().await.unwrap();
        if f.response.starts_with("data: ") {
            assert_eq!(stream_shapes(&body), stream_shapes(&f.response), "{name}");
        } else if !f.response.is_empty() {
            assert_eq!(shape(&body), shape(&f.response), "{name}\nfake: {body}\nreal: {}", f.response);
        }
    }
}

/// Generate: the prefill leg tokenonce makes of the recorded plain request is the recorded
/// prefill request; its real answer hands over the engine's kv params verbatim (no ids); the
/// decode made of the plain request and that handoff is the recorded decode, which pulled
/// the KV and answered the plain request's ids.
#[test]
fn recorded_generate_legs() {
    let plain = fixture("generate_plain");
    let obj = RawObject::parse(&plain.request).unwrap();
    let view = RequestView::parse(Api::Generate, &obj).unwrap();
    assert_eq!(view.reuse_blocker(), Some(tokenonce::openai::FallbackReason::PromptIsTokens));
    let ours = json(std::str::from_utf8(&prefill_body(&obj, None, Api::Generate, false).to_bytes()).unwrap());
    assert_eq!(ours, json(&fixture("generate_prefill").request));
    let prefill = fixture("generate_prefill");
    let h = extract_handoff(Api::Generate, prefill.response.as_bytes()).unwrap();
    let kv = h.kv_transfer_params.unwrap();
    assert!(prefill.response.contains(&kv), "verbatim: {kv}");
    assert!(h.ids.is_err(), "generate echoes no prompt ids");
    let decode = fixture("generate_decode");
    let kv = serde_json::to_string(&json(&decode.request)["kv_transfer_params"]).unwrap();
    let ours = json(std::str::from_utf8(&decode_body(&obj, None, Api::Generate, Some(&kv), None).to_bytes()).unwrap());
    assert_eq!(ours, json(&decode.request));
    let tokens = |name: &str| json(&fixture(name).response)["choices"][0]["token_ids"].clone();
    assert_eq!(tokens("generate_decode"), tokens("generate_plain"));
}

/// With a real NIXL prefill response (vLLM 0.32, NixlConnector), the decode body carries the
/// engine's kv_transfer_params byte for byte, ids added inside, and the relay cache key
/// (remote_request_id) is the one the engine reported.
#[test]
fn real_nixl_kv_params_are_spliced_verbatim() {
    let prefill = fixture("chat_prefill_nixl");
    let h = extract_handoff(Api::Chat, prefill.response.as_bytes()).unwrap();
    let kv = h.kv_transfer_params.clone().unwrap();
    assert!(
        kv.contains("\"remote_request_id\":\"chatcmpl-fixture-rid-0001-"),
        "vLLM names it after X-Request-Id: {kv}"
    );
    let ids = h.ids.unwrap();
    let plain = fixture("chat_plain");
    let body =
        decode_body(&RawObject::parse(&plain.request).unwrap(), None, Api::Chat, Some(&kv), Some(&ids)).to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    let expected = format!("\"kv_transfer_params\":{},\"prompt_token_ids\":{IDS}}}", kv.trim_end_matches('}'));
    assert!(text.contains(&expected), "{text}");
    assert!(text.contains("\"remote_port\":19100,\"tp_size\":1"), "integers stay integers");
}

/// vLLM 0.32's Responses prefill (`enable_response_messages`) hands over the 20 ids it
/// rendered, the same ids the chat prefill of the same conversation echoes; `return_token_ids`
/// alone gives none; the Messages prefill gives none.
#[test]
fn recorded_responses_and_messages_prefills() {
    let h = extract_handoff(Api::Responses, fixture("responses_prefill").response.as_bytes()).unwrap();
    let chat = extract_handoff(Api::Chat, fixture("chat_prefill").response.as_bytes()).unwrap();
    assert_eq!(h.ids.unwrap().to_vec(), chat.ids.unwrap().to_vec());
    assert_eq!(h.cached_tokens, Some(0));
    let h = extract_handoff(Api::Responses, fixture("responses_prefill_return_token_ids").response.as_bytes()).unwrap();
    assert!(h.ids.is_err());
    let h = extract_handoff(Api::Messages, fixture("messages_prefill").response.as_bytes()).unwrap();
    assert!(h.ids.is_err());
    // The decode tokenonce builds from the recorded plain request is the recorded decode.
    let plain = fixture("responses_plain");
    let ids = extract_handoff(Api::Responses, fixture("responses_prefill").response.as_bytes()).unwrap().ids.unwrap();
    let obj = RawObject::parse(&plain.request).unwrap();
    let kv = recorded_handoff("responses_decode_ids");
    let ours =
        json(std::str::from_utf8(&decode_body(&obj, None, Api::Responses, Some(&kv), Some(&ids)).to_bytes()).unwrap());
    assert_eq!(ours, json(&fixture("responses_decode_ids").request));
}

/// The recorded Responses stream through the relay framing with a cached count: only
/// `response.completed` changes (its `event:` line kept, the count set inside `response`),
/// every other event keeps its bytes.
#[test]
fn recorded_responses_stream_keeps_event_names_through_the_usage_rewrite() {
    let raw = fixture("responses_decode_ids_stream").response.into_bytes();
    let mut framing = StreamFraming::for_api(Api::Responses, Some(4));
    let mut out = framing.feed(&raw);
    out.extend(framing.end());
    let before = SseDecoder::new().feed(&raw);
    let after = SseDecoder::new().feed(&out);
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        let data: Value = serde_json::from_slice(&b.data().unwrap()).unwrap();
        if data["type"] == "response.completed" {
            assert!(a.raw().starts_with(b"event: response.completed\ndata: "));
            let got: Value = serde_json::from_slice(&a.data().unwrap()).unwrap();
            assert_eq!(got["response"]["usage"]["input_tokens_details"]["cached_tokens"], 4);
            assert_eq!(got["response"]["usage"]["input_tokens"], data["response"]["usage"]["input_tokens"]);
        } else {
            assert_eq!(a.raw(), b.raw());
        }
    }
}
