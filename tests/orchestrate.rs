//! Orchestrate mode end to end against fake engines: both legs' rewrites, token reuse and
//! every fallback, streaming relay, error mapping, disconnects, concurrency, big bodies.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::Duration;

use serde_json::{json, Value};
use support::*;

/// Chat, not streamed: the prefill gets the P/D rewrite with return_token_ids, the decode
/// gets the prefill's ids in kv_transfer_params and the client's own fields unchanged, and
/// the client receives exactly what the decode answers to a direct plain request.
#[tokio::test(flavor = "multi_thread")]
async fn chat_reuses_prefill_ids_and_answers_like_the_plain_decode() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let body = chat_body("Hello there!", json!({"max_completion_tokens": 4, "min_tokens": 2, "stream_options": null}));
    let (status, headers, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[("x-request-id", "req-1")]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(headers.get("x-request-id").unwrap(), "req-1");

    let prefill = &p.posts()[0];
    let pj = prefill.json();
    assert_eq!(pj["max_tokens"], 1);
    assert_eq!(pj["max_completion_tokens"], 1);
    assert!(pj.get("min_tokens").is_none());
    assert_eq!(pj["stream"], false);
    assert_eq!(pj["return_token_ids"], true);
    assert_eq!(
        pj["kv_transfer_params"],
        json!({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null})
    );
    assert_eq!(prefill.header("x-request-id").as_deref(), Some("req-1"));

    let decode = &d.posts()[0];
    let dj = decode.json();
    let expected_ids: Vec<u64> = fake_tokenize(&fake_render_chat(&body));
    assert_eq!(dj["kv_transfer_params"]["prompt_token_ids"], json!(expected_ids));
    assert_eq!(dj["max_completion_tokens"], 4);
    assert_eq!(dj["min_tokens"], 2);
    assert_eq!(dj["messages"], body["messages"]);
    assert!(dj.get("return_token_ids").is_none(), "the client's return_token_ids must be restored (absent)");
    assert_eq!(decode.header("x-request-id").as_deref(), Some("req-1"));

    // The same request sent straight to the decode as plain text gives identical bytes.
    let (_, _, direct) =
        post_json(&format!("http://{}/v1/chat/completions", d.host_port()), &body, &[("x-request-id", "req-1")]).await;
    assert_eq!(text, direct);
    assert_eq!(proxy.metric(&reuse_series("pd", "applied", "none")).await, 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_reused_prompt_tokens_total{route="pd"}"#).await, expected_ids.len() as f64);
}

/// Chat, streamed with events cut every 7 bytes: the client stream equals the decode's.
#[tokio::test(flavor = "multi_thread")]
async fn chat_stream_is_relayed_unchanged_across_arbitrary_cuts() {
    let decode_conf = FakeConfig { split_every: Some(7), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), decode_conf, "").await;
    let body = chat_body("Stream me", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (status, headers, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[("x-request-id", "s-1")]).await;
    assert_eq!(status, 200);
    assert!(headers.get("content-type").unwrap().to_str().unwrap().starts_with("text/event-stream"));
    let (_, _, direct) =
        post_json(&format!("http://{}/v1/chat/completions", d.host_port()), &body, &[("x-request-id", "s-1")]).await;
    assert_eq!(text, direct);
    assert!(text.ends_with("data: [DONE]\n\n"));
    // The decode leg kept the client's stream settings.
    let dj = d.posts()[0].json();
    assert_eq!(dj["stream"], true);
    assert_eq!(dj["stream_options"], json!({"include_usage": true}));
}

/// Completions: the decode gets `prompt = ids`, streaming and not.
#[tokio::test(flavor = "multi_thread")]
async fn completions_decode_gets_token_prompt() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    for stream in [false, true] {
        let body = json!({"model": "tiny-qwen3", "prompt": "Hello there friend", "max_tokens": 3, "stream": stream});
        let (status, _, text) =
            post_json(&format!("{}/v1/completions", proxy.url), &body, &[("x-request-id", "c-1")]).await;
        assert_eq!(status, 200, "{text}");
        let dj = d.posts().last().unwrap().json();
        assert_eq!(dj["prompt"], json!(fake_tokenize("Hello there friend")));
        assert_eq!(dj["max_tokens"], 3);
        let (_, _, direct) =
            post_json(&format!("http://{}/v1/completions", d.host_port()), &body, &[("x-request-id", "c-1")]).await;
        assert_eq!(text, direct, "stream={stream}");
    }
    assert_eq!(p.posts()[0].json()["return_token_ids"], true);
}

/// Each unsafe case takes the text decode and is counted with its reason.
#[tokio::test(flavor = "multi_thread")]
async fn unsafe_requests_fall_back_to_text_and_are_counted() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let chat = format!("{}/v1/chat/completions", proxy.url);
    let cmpl = format!("{}/v1/completions", proxy.url);
    let media = json!({"model":"tiny-qwen3","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]}],"max_tokens":2});
    let cases: Vec<(&str, Value, &str)> = vec![
        (&chat, media, "media"),
        (&chat, chat_body("n two", json!({"n": 2})), "n_gt_1"),
        (&chat, chat_body("echo", json!({"echo": true})), "echo"),
        (&cmpl, json!({"model":"tiny-qwen3","prompt":["a","b"],"max_tokens":2}), "batch_prompt"),
        (&cmpl, json!({"model":"tiny-qwen3","prompt":[1,2,3],"max_tokens":2}), "prompt_is_tokens"),
    ];
    for (url, body, reason) in cases {
        let (status, _, text) = post_json(url, &body, &[]).await;
        assert_eq!(status, 200, "{reason}: {text}");
        let dj = d.posts().last().unwrap().json();
        assert!(dj["kv_transfer_params"].get("prompt_token_ids").is_none(), "{reason}");
        assert_eq!(dj.get("prompt"), body.get("prompt"), "{reason}: prompt must be untouched");
        let series = format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="pd"}}"#);
        assert_eq!(proxy.metric(&series).await, 1.0, "{reason}");
    }
}

/// Prefill ids missing, malformed, or miscounted: text decode, counted, never forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn bad_prefill_ids_fall_back() {
    for (config, reason) in [
        (FakeConfig { omit_prompt_ids: true, ..FakeConfig::default() }, "ids_missing"),
        (FakeConfig { corrupt_prompt_ids: Some("[1,-5,3]".into()), ..FakeConfig::default() }, "ids_malformed"),
        (FakeConfig { corrupt_prompt_ids: Some("[1,2]".into()), ..FakeConfig::default() }, "ids_malformed"),
        (FakeConfig { corrupt_prompt_ids: Some("[1.5,2]".into()), ..FakeConfig::default() }, "ids_malformed"),
    ] {
        let (_p, d, proxy) = pd_setup(config, FakeConfig::default(), "").await;
        let (status, _, text) =
            post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("ids please", json!({})), &[]).await;
        assert_eq!(status, 200, "{text}");
        assert!(d.posts()[0].json()["kv_transfer_params"].get("prompt_token_ids").is_none());
        let series = format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="pd"}}"#);
        assert_eq!(proxy.metric(&series).await, 1.0, "{reason}");
    }
}

/// A decode vLLM older than 0.27 gets the text decode for chat, but token prompts for
/// completions (which every version accepts); a pinned version overrides /version.
#[tokio::test(flavor = "multi_thread")]
async fn old_decode_versions_gate_chat_reuse() {
    let old = FakeConfig { version: "0.26.0".into(), ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(FakeConfig::default(), old, "").await;
    post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("old", json!({})), &[]).await;
    assert!(p.posts()[0].json().get("return_token_ids").is_none(), "no ids asked when they cannot be used");
    assert!(d.posts()[0].json()["kv_transfer_params"].is_null());
    assert_eq!(proxy.metric(&reuse_series("pd", "fallback", "decode_version_old")).await, 1.0);
    post_json(
        &format!("{}/v1/completions", proxy.url),
        &json!({"model":"tiny-qwen3","prompt":"a b","max_tokens":2}),
        &[],
    )
    .await;
    assert_eq!(d.posts()[1].json()["prompt"], json!(fake_tokenize("a b")));

    // Pinning 0.32 in config trusts the operator over /version.
    let p2 = FakeVllm::start(FakeConfig::default()).await;
    let d2 = FakeVllm::start(FakeConfig { version: "0.26.0".into(), ..FakeConfig::default() }).await;
    let conf = pd_config(&p2, &d2, "").replace("[pools.decode]\n", "[pools.decode]\nvllm_version = \"0.32.0\"\n");
    let proxy2 = TokenOnce::start(&conf).await;
    post_json(&format!("{}/v1/chat/completions", proxy2.url), &chat_body("pinned", json!({})), &[]).await;
    assert!(d2.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());
}

/// token_reuse = false: P/D as the toy proxy does it, counted as `disabled`.
#[tokio::test(flavor = "multi_thread")]
async fn reuse_can_be_turned_off_per_route() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "token_reuse = false").await;
    post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("off", json!({})), &[]).await;
    assert!(p.posts()[0].json().get("return_token_ids").is_none());
    assert!(d.posts()[0].json().get("kv_transfer_params").is_none());
    assert_eq!(proxy.metric(&reuse_series("pd", "fallback", "disabled")).await, 1.0);
}

/// The prefill's kv_transfer_params reach the decode byte for byte (ints stay ints, floats
/// stay floats, nested objects intact), with the ids added inside.
#[tokio::test(flavor = "multi_thread")]
async fn kv_transfer_params_are_relayed_verbatim() {
    let raw = r#"{"do_remote_prefill":true,"remote_block_ids":[[12,13],[14]],"remote_port":5600,"tp_size":1,"weight":1.0,"ratio":2.50,"big":12345678901234,"nested":{"a":{"b":[1,2.0,"x",null,true]}},"remote_engine_id":"e-1"}"#;
    let prefill = FakeConfig { kv_params_raw: Some(raw.into()), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(prefill.clone(), FakeConfig::default(), "").await;
    post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("kv", json!({})), &[]).await;
    let decode_text = d.posts()[0].text();
    let inner = raw.trim_end_matches('}');
    assert!(decode_text.contains(&format!("\"kv_transfer_params\":{inner},\"prompt_token_ids\":[")), "{decode_text}");
    // Completions: the params are relayed as they are.
    post_json(
        &format!("{}/v1/completions", proxy.url),
        &json!({"model":"tiny-qwen3","prompt":"x y","max_tokens":1}),
        &[],
    )
    .await;
    assert!(d.posts()[1].text().contains(&format!("\"kv_transfer_params\":{raw}")));
}

/// The prefill's cached_tokens replace the decode's in usage, JSON and SSE.
#[tokio::test(flavor = "multi_thread")]
async fn usage_reports_the_prefill_cached_tokens() {
    let prefill = FakeConfig { cached_tokens: Some(7), ..FakeConfig::default() };
    let decode = FakeConfig { cached_tokens: Some(99), split_every: Some(5), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(prefill, decode, "").await;
    let (_, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("cache", json!({})), &[]).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 7);
    let body = chat_body("cache", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (_, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    let usage_event = text.split("\n\n").find(|e| e.contains("\"usage\"")).unwrap();
    assert!(usage_event.contains("\"cached_tokens\":7"), "{usage_event}");
    assert!(text.ends_with("data: [DONE]\n\n"));
}

/// Errors: the prefill's own 4xx unchanged; unreachable 502; slow 504; bad body 400;
/// oversized 413; a prefill answering garbage 502.
#[tokio::test(flavor = "multi_thread")]
async fn errors_are_openai_shaped_with_the_right_status() {
    let (p, d, proxy) =
        pd_setup(FakeConfig::default(), FakeConfig::default(), "prefill_timeout_ms = 500\nmax_body_bytes = 100000")
            .await;
    let chat = format!("{}/v1/chat/completions", proxy.url);

    let (status, _, text) = post_json(&chat, &chat_body("m", json!({"model": "nope"})), &[]).await;
    assert_eq!(status, 404);
    assert_eq!(
        text,
        r#"{"error":{"message":"The model `nope` does not exist. Valid aliases: tiny-qwen3.","type":"NotFoundError","param":"model","code":404}}"#
    );
    assert!(d.posts().is_empty(), "a failed prefill must not reach the decode");

    let (status, _, text) = post_raw(&chat, r#"{"model":"tiny-qwen3","messages":["#, &[]).await;
    assert_eq!(status, 400);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "invalid_request");

    let big = chat_body(&"word ".repeat(30_000), json!({}));
    let (status, _, text) = post_json(&chat, &big, &[]).await;
    assert_eq!(status, 413, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "body_too_large");

    p.configure(|c| c.delay = Duration::from_secs(3));
    let (status, _, text) = post_json(&chat, &chat_body("slow", json!({})), &[]).await;
    assert_eq!(status, 504, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "prefill_timeout");

    p.configure(|c| {
        c.delay = Duration::ZERO;
        c.fail_with = Some((200, "<html>oops</html>".into()));
    });
    let (status, _, text) = post_json(&chat, &chat_body("garbage", json!({})), &[]).await;
    assert_eq!(status, 502);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "prefill_bad_response");
    assert!(d.posts().is_empty());
    assert!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="timeout",stage="prefill"}"#).await >= 1.0);
}

/// Unreachable engines: prefill 502 prefill_unavailable, decode 502 decode_unavailable.
#[tokio::test(flavor = "multi_thread")]
async fn unreachable_engines_are_502() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    // Bound but never listening: connects are refused, and the port stays ours meanwhile.
    let refused = RefusedAddr::new();
    let dead = refused.addr.to_string();
    let conf = pd_config(&d, &d, "").replacen(&d.host_port(), &dead, 1);
    let proxy = TokenOnce::start(&conf).await;
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &[]).await;
    assert_eq!(status, 502);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "prefill_unavailable");
    for key in ["message", "type", "param", "code"] {
        assert!(v["error"].as_object().unwrap().contains_key(key), "{key}");
    }
    // The message says what failed and how, never where (the address stays in the log).
    assert_eq!(v["error"]["message"], "prefill engine unavailable: connection refused", "{text}");
    assert!(!text.contains("127.0.0.1") && !text.contains("context"), "{text}");

    let p = FakeVllm::start(FakeConfig::default()).await;
    let conf = pd_config(&p, &p, "").replace(
        &format!("[pools.decode]\nendpoints = [\"{}\"]", p.host_port()),
        &format!("[pools.decode]\nendpoints = [\"{dead}\"]"),
    );
    let proxy = TokenOnce::start(&conf).await;
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &[]).await;
    assert_eq!(status, 502, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "decode_unavailable");
    assert!(!text.contains("127.0.0.1"), "{text}");
}

/// A decode stream that breaks mid-way ends with an SSE error event, not a silent cut.
#[tokio::test(flavor = "multi_thread")]
async fn broken_decode_stream_ends_with_an_error_event() {
    let decode =
        FakeConfig { break_stream_after: Some(2), chunk_delay: Duration::from_millis(100), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let body = chat_body("break", json!({"stream": true}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200);
    assert!(text.contains("\"code\":\"decode_stream_failed\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
}

/// A decode stream the engine cuts mid-event, at many offsets (each side of every event
/// boundary and a stride in between), with and without the cached-tokens rewrite: the client
/// gets exactly the events completed before the cut, then the error event and `[DONE]`, each
/// on lines of their own.
#[tokio::test(flavor = "multi_thread")]
async fn cut_decode_stream_sends_only_whole_events_then_the_error() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let body = chat_body("cut me", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let rid = [("x-request-id", "cut-1")];
    let (_, _, plain) = post_json(&url, &body, &rid).await;
    assert!(plain.ends_with("data: [DONE]\n\n"), "{plain}");
    let ends: Vec<usize> = plain.match_indices("\n\n").map(|(i, _)| i + 2).collect();
    let mut cuts: Vec<usize> =
        ends.iter().flat_map(|&e| [e - 1, e, e + 1]).chain((0..plain.len()).step_by(17)).collect();
    cuts.retain(|&c| c < plain.len());
    cuts.sort_unstable();
    cuts.dedup();
    for cached in [None, Some(3)] {
        p.configure(|c| c.cached_tokens = cached);
        d.configure(|c| c.cut_stream_at_byte = None);
        let (_, _, full) = post_json(&url, &body, &rid).await;
        let events: Vec<&str> = full.split_inclusive("\n\n").collect();
        assert_eq!(events.len(), ends.len(), "{full}");
        for &cut in &cuts {
            d.configure(|c| c.cut_stream_at_byte = Some(cut));
            let (status, _, text) = post_json(&url, &body, &rid).await;
            assert_eq!(status, 200);
            let complete = ends.iter().filter(|&&e| e <= cut).count();
            let expected: String = events[..complete].concat();
            let rest = text.strip_prefix(&expected).unwrap_or_else(|| panic!("cut {cut} {cached:?}: {text}"));
            let error = rest.strip_suffix("\n\ndata: [DONE]\n\n").unwrap_or_else(|| panic!("cut {cut}: {rest}"));
            let json: Value = serde_json::from_str(error.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(json["error"]["code"], "decode_stream_failed", "cut {cut}: {rest}");
        }
    }
}

/// A client that disconnects mid-stream makes tokenonce close the decode leg; one that
/// disconnects during the prefill makes it close the prefill leg (and never send a decode).
#[tokio::test(flavor = "multi_thread")]
async fn client_disconnect_closes_both_legs() {
    let decode = FakeConfig { chunk_delay: Duration::from_millis(300), ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let body = chat_body("slow stream", json!({"stream": true, "max_tokens": 20}));
    let resp =
        reqwest::Client::new().post(format!("{}/v1/chat/completions", proxy.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = futures_util::StreamExt::next(&mut stream).await;
    assert!(first.is_some());
    drop(stream);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while d.cancelled() == 0 {
        assert!(std::time::Instant::now() < deadline, "decode stream was not closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    p.configure(|c| c.delay = Duration::from_secs(2));
    let client = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    let posts_before = d.posts().len();
    assert!(client
        .post(format!("{}/v1/chat/completions", proxy.url))
        .json(&chat_body("gone", json!({})))
        .send()
        .await
        .is_err());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while p.cancelled() == 0 {
        assert!(std::time::Instant::now() < deadline, "prefill leg was not closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert_eq!(d.posts().len(), posts_before, "no decode after the client left");
}

/// 256 concurrent requests with distinct prompts: every decode carries exactly its own
/// prompt's ids, and every client gets its own answer.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_never_cross_ids() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..256 {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let body = chat_body(&format!("prompt number {i} with words {}", i * 7), json!({"stream": i % 2 == 0}));
            let resp = client.post(&url).header("x-request-id", format!("c-{i}")).json(&body).send().await.unwrap();
            (i, resp.status().as_u16(), resp.text().await.unwrap())
        }));
    }
    for t in tasks {
        let (i, status, text) = tokio::time::timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
        assert_eq!(status, 200, "{i}: {text}");
        assert!(text.contains(&format!("chatcmpl-c-{i}\"")), "{i} got another request's answer");
    }
    let posts = d.posts();
    assert_eq!(posts.len(), 256);
    for r in posts {
        let j = r.json();
        let expected = fake_tokenize(&fake_render_chat(&j));
        assert_eq!(
            j["kv_transfer_params"]["prompt_token_ids"],
            json!(expected),
            "{}",
            r.header("x-request-id").unwrap()
        );
    }
}

/// A 200 KB request body works streamed and not (pingora's 64 KiB replay cliff avoided).
#[tokio::test(flavor = "multi_thread")]
async fn large_bodies_work_streaming_and_not() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let long: String = (0..35_000).map(|i| format!("w{i} ")).collect();
    assert!(long.len() > 200_000);
    for stream in [false, true] {
        let body = chat_body(&long, json!({"stream": stream}));
        let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        let dj = d.posts().last().unwrap().json();
        assert_eq!(
            dj["kv_transfer_params"]["prompt_token_ids"].as_array().unwrap().len(),
            fake_tokenize(&fake_render_chat(&body)).len()
        );
        assert_eq!(dj["messages"], body["messages"]);
    }
}

/// llm-d header mode: the header picks the prefiller (checked, then removed from both legs);
/// without it the request goes to the decode alone, unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn prefiller_header_mode() {
    let [p, d] = fakes(Default::default()).await;
    let conf = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"llmd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }}\n",
        d.host_port()
    );
    let proxy = TokenOnce::start(&conf).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, _) =
        post_json(&url, &chat_body("hdr", json!({})), &[("x-prefiller-host-port", &p.host_port())]).await;
    assert_eq!(status, 200);
    assert_eq!(p.posts().len(), 1);
    assert!(p.posts()[0].header("x-prefiller-host-port").is_none());
    assert!(d.posts()[0].header("x-prefiller-host-port").is_none());
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());

    let body = chat_body("no header", json!({}));
    let (status, _, _) = post_json(&url, &body, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(p.posts().len(), 1, "no prefill without the header");
    assert_eq!(d.posts()[1].json(), body);

    for (value, code, status) in [
        ("127.0.0.1:1,127.0.0.1:2", "invalid_prefiller_header", 400),
        ("not-a-port", "invalid_prefiller_header", 400),
        ("10.0.0.1:8000", "prefiller_not_allowed", 403),
    ] {
        let (got, _, text) = post_json(&url, &chat_body("bad", json!({})), &[("x-prefiller-host-port", value)]).await;
        assert_eq!(got, status, "{value}: {text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], code);
    }
}

/// A prefill that echoes fewer ids than the messages tokenize to (consistent with its
/// `usage.prompt_tokens`): the decode gets exactly those ids and answers for that many
/// prompt tokens, so it followed the ids, not the messages (the e2e tier does the same with
/// a tampering proxy in front of a real prefill).
#[tokio::test(flavor = "multi_thread")]
async fn decode_follows_the_relayed_ids_not_the_messages() {
    let short_prefill = FakeConfig { echo_only_first_ids: Some(3), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(short_prefill, FakeConfig::default(), "").await;
    let body = chat_body("a fairly long prompt with many words", json!({}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200);
    let full = fake_tokenize(&fake_render_chat(&body));
    assert!(full.len() > 3);
    assert_eq!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"], json!(full[..3]));
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["usage"]["prompt_tokens"], 3);
    assert_eq!(proxy.metric(r#"tokenonce_reused_prompt_tokens_total{route="pd"}"#).await, 3.0);
}

/// The SSE events of a streamed chat answer, as a decode engine writes them.
const BURST_EVENTS: [&str; 5] = [
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"One\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" two\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
];

/// A raw decode engine answering every POST with [`BURST_EVENTS`], each its own HTTP chunk:
/// the first `together` in one write, the rest in a second write 300 ms later.
async fn bursting_decode(together: usize) -> String {
    use tokio::io::AsyncWriteExt;
    let serve = move |mut sock: tokio::net::TcpStream| async move {
        // Bounded: one connection serves at most 10 requests.
        for _ in 0..10 {
            let Some(req) = fault_engine::read_request(&mut sock).await else { return };
            if req.method != "POST" {
                let _ = sock.write_all(fault_engine::json_answer("{\"version\":\"0.32.0\"}", false).as_bytes()).await;
                continue;
            }
            let chunk = |e: &str| format!("{:x}\r\n{e}\r\n", e.len());
            let mut first = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            );
            first.extend(BURST_EVENTS[..together].iter().map(|e| chunk(e)));
            let mut second: String = BURST_EVENTS[together..].iter().map(|e| chunk(e)).collect();
            second.push_str("0\r\n\r\n");
            if sock.write_all(first.as_bytes()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            if sock.write_all(second.as_bytes()).await.is_err() {
                return;
            }
        }
    };
    raw_engine(20, serve).await
}

/// The data of each HTTP chunk of a raw chunked response (head skipped), in order.
fn chunks_of(raw: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(raw);
    let (_, mut rest) = text.split_once("\r\n\r\n").unwrap();
    let mut chunks = Vec::new();
    // Bounded by the body's length: every pass consumes a chunk.
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size, 16).unwrap();
        if size == 0 {
            break;
        }
        chunks.push(after[..size].to_owned());
        rest = &after[size + 2..];
    }
    chunks
}

/// Posts a streamed chat request on a raw connection and reads the answer to its last chunk.
async fn raw_stream(proxy: &TokenOnce) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = chat_body("Count to two.", json!({"stream": true, "max_tokens": 4})).to_string();
    let mut sock = tokio::net::TcpStream::connect(proxy.url.trim_start_matches("http://")).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let read_all = async {
        while !got.ends_with(b"0\r\n\r\n") {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read_all).await.unwrap();
    got
}

/// Events that reach tokenonce in one read go to the client in one write (one HTTP chunk,
/// not one per event: a send and a client wake-up each), and events that come apart are not
/// held back to be joined: each burst is written when it arrives, with its exact bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_engine_events_is_written_in_one_piece_and_nothing_waits_for_more() {
    let [prefill] = fakes([FakeConfig::default()]).await;
    let decode = bursting_decode(3).await;
    let proxy = TokenOnce::start(&pools_config(&[prefill.host_port()], &[decode], "")).await;
    let raw = raw_stream(&proxy).await;
    let chunks = chunks_of(&raw);
    assert_eq!(chunks, [BURST_EVENTS[..3].concat(), BURST_EVENTS[3..].concat()], "{}", String::from_utf8_lossy(&raw));
}
