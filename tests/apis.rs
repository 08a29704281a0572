//! `/v1/responses`, `/v1/messages` and `/inference/v1/generate` under P/D against fake
//! engines that behave like the vLLM 0.32 recordings, and the fractional `token_reuse` canary.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use support::*;

fn responses_body(extra: Value) -> Value {
    let body = json!({
        "model": "tiny-qwen3",
        "input": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}],
        "max_output_tokens": 5,
        "temperature": 0
    });
    with_extra(body, extra)
}

fn messages_body(extra: Value) -> Value {
    let body = json!({
        "model": "tiny-qwen3",
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Hello there!"}],
        "max_tokens": 5,
        "temperature": 0
    });
    with_extra(body, extra)
}

fn generate_body(extra: Value) -> Value {
    let body = json!({
        "model": "tiny-qwen3",
        "token_ids": [151644, 8948, 198, 2610, 525, 50537, 13],
        "sampling_params": {"max_tokens": 5, "min_tokens": 2, "temperature": 0}
    });
    with_extra(body, extra)
}

/// Generate, JSON and streamed: the prefill leg has `sampling_params.max_tokens` 1 (its
/// `min_tokens` gone), `stream: false` and the remote-decode `kv_transfer_params`; the decode
/// gets the client's body with the prefill's handoff; the client gets what the decode
/// answers to a direct call; no ids to reuse (`prompt_is_tokens`).
#[tokio::test(flavor = "multi_thread")]
async fn generate_runs_both_legs_with_the_handoff() {
    let prefill = FakeConfig { connector: true, ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(prefill, FakeConfig::default(), "").await;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let extra = if stream { json!({"stream": true, "stream_options": {"include_usage": true}}) } else { json!({}) };
        let body = generate_body(extra);
        let (status, headers, text) =
            post_json(&format!("{}/inference/v1/generate", proxy.url), &body, &[("x-request-id", "g1")]).await;
        assert_eq!(status, 200, "{text}");
        let ctype = headers.get("content-type").unwrap().to_str().unwrap().to_owned();
        assert_eq!(ctype.starts_with("text/event-stream"), stream, "{ctype}");
        let (_, _, direct) =
            post_json(&format!("http://{}/inference/v1/generate", d.host_port()), &body, &[("x-request-id", "g1")])
                .await;
        assert_eq!(text, direct);
        let pj = p.posts()[i].json();
        assert_eq!(pj["sampling_params"], json!({"max_tokens": 1, "temperature": 0}));
        assert_eq!((pj["stream"].clone(), pj.get("stream_options")), (json!(false), None));
        assert_eq!(pj["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(pj["token_ids"], body["token_ids"]);
        let dj = d.posts()[2 * i].json();
        assert_eq!(dj["kv_transfer_params"]["remote_engine_id"], "fake-engine");
        assert_eq!(dj["sampling_params"], body["sampling_params"]);
        assert_eq!(dj["stream"], body.get("stream").cloned().unwrap_or(Value::Null));
    }
    let reason = r#"tokenonce_token_reuse_total{reason="prompt_is_tokens",result="fallback",route="pd"}"#;
    proxy.assert_reaches(reason, 2.0).await;
    let requests = r#"tokenonce_requests_total{api="generate",mode="orchestrate",outcome="success",route="pd"}"#;
    proxy.assert_reaches(requests, 2.0).await;
}

/// Generate bodies vLLM would refuse are refused before any leg, in OpenAI's shape with the
/// field named; an engine started without `--enable-scale-out` answers 403 and that answer
/// reaches the client (the prefill's, so the decode never runs).
#[tokio::test(flavor = "multi_thread")]
async fn generate_errors_name_the_field_or_the_engine_flag() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let url = format!("{}/inference/v1/generate", proxy.url);
    for (body, param) in [
        (json!({"model": "tiny-qwen3", "sampling_params": {}}), "token_ids"),
        (json!({"model": "tiny-qwen3", "token_ids": [1, 2]}), "sampling_params"),
        (json!({"token_ids": [1, 2], "sampling_params": 5}), "sampling_params"),
    ] {
        let (status, _, text) = post_json(&url, &body, &[]).await;
        assert_eq!(status, 400, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (v["error"]["type"].as_str(), v["error"]["param"].as_str()),
            (Some("invalid_request_error"), Some(param))
        );
    }
    assert!(p.posts().is_empty() && d.posts().is_empty());
    // vLLM 0.32's answer on a server without the scale-out endpoints.
    let disabled = r#"{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.","type":"PermissionDeniedError","param":null,"code":403}}"#;
    p.configure(|c| c.fail_with = Some((403, disabled.into())));
    let (status, _, text) = post_json(&url, &generate_body(json!({})), &[]).await;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("--enable-scale-out") && !text.contains("127.0.0.1"), "{text}");
    assert!(d.posts().is_empty(), "no decode after a refused prefill");
}

/// Responses, JSON: the prefill leg is `max_output_tokens` 1, `store: false`, not streamed,
/// asked for its ids with `enable_response_messages`; the decode gets them in
/// `kv_transfer_params.prompt_token_ids` plus the prefill's kv params, and the client gets
/// the decode's answer (no raw messages it did not ask for) with the prefill's cached count.
#[tokio::test(flavor = "multi_thread")]
async fn responses_reuse_the_prefill_ids() {
    let prefill = FakeConfig { connector: true, cached_tokens: Some(3), ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(prefill, FakeConfig::default(), "").await;
    let body = responses_body(json!({}));
    let (status, _, text) = post_json(&format!("{}/v1/responses", proxy.url), &body, &[("x-request-id", "r1")]).await;
    assert_eq!(status, 200, "{text}");

    let pj = p.posts()[0].json();
    assert_eq!(
        (pj["max_output_tokens"].clone(), pj["stream"].clone(), pj["store"].clone()),
        (json!(1), json!(false), json!(false))
    );
    assert_eq!(pj["enable_response_messages"], true);
    assert!(pj.get("return_token_ids").is_none());
    assert_eq!(pj["kv_transfer_params"]["do_remote_decode"], true);

    let dj = d.posts()[0].json();
    let ids = fake_tokenize(&fake_render_responses(&body));
    assert_eq!(dj["kv_transfer_params"]["prompt_token_ids"], json!(ids));
    assert_eq!(dj["kv_transfer_params"]["remote_engine_id"], "fake-engine");
    assert_eq!(dj["max_output_tokens"], 5);
    assert!(dj.get("enable_response_messages").is_none() && dj.get("store").is_none());

    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["input_tokens"], ids.len());
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 3);
    assert!(v["input_messages"].is_null());
    // The same answer as the plain request straight to the decode, but for the cached count.
    let (_, _, direct) =
        post_json(&format!("http://{}/v1/responses", d.host_port()), &body, &[("x-request-id", "r1")]).await;
    let mut direct: Value = serde_json::from_str(&direct).unwrap();
    direct["usage"]["input_tokens_details"]["cached_tokens"] = json!(3);
    assert_eq!(v, direct);
    proxy.assert_reaches(&reuse_series("pd", "applied", "none"), 1.0).await;
    assert_eq!(proxy.metric(r#"tokenonce_reused_prompt_tokens_total{route="pd"}"#).await, ids.len() as f64);
    proxy
        .assert_reaches(
            r#"tokenonce_requests_total{api="responses",mode="orchestrate",outcome="success",route="pd"}"#,
            1.0,
        )
        .await;
}

/// Responses, streamed and cut every 11 bytes: the typed events arrive as the decode sent
/// them, only `response.completed`'s usage gets the prefill's cached count.
#[tokio::test(flavor = "multi_thread")]
async fn responses_stream_is_relayed_with_the_cached_count_in_completed() {
    let prefill = FakeConfig { cached_tokens: Some(2), ..FakeConfig::default() };
    let decode = FakeConfig { split_every: Some(11), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(prefill, decode, "").await;
    let body = responses_body(json!({"stream": true}));
    let (status, headers, text) =
        post_json(&format!("{}/v1/responses", proxy.url), &body, &[("x-request-id", "s1")]).await;
    assert_eq!(status, 200, "{text}");
    assert!(headers.get("content-type").unwrap().to_str().unwrap().starts_with("text/event-stream"));
    let (_, _, direct) =
        post_json(&format!("http://{}/v1/responses", d.host_port()), &body, &[("x-request-id", "s1")]).await;
    let ours: Vec<&str> = text.split("\n\n").collect();
    let theirs: Vec<&str> = direct.split("\n\n").collect();
    assert_eq!(ours.len(), theirs.len());
    for (a, b) in ours.iter().zip(&theirs) {
        if b.starts_with("event: response.completed") {
            assert!(a.starts_with("event: response.completed\ndata: "), "{a}");
            let data: Value = serde_json::from_str(a.split_once("data: ").unwrap().1).unwrap();
            assert_eq!(data["response"]["usage"]["input_tokens_details"]["cached_tokens"], 2);
        } else {
            assert_eq!(a, b, "events other than response.completed keep their bytes");
        }
    }
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());
}

/// A Responses request that names an earlier answer goes to the decode alone: the prefill
/// engine never stored it (it would answer 404); counted as `stateful`.
#[tokio::test(flavor = "multi_thread")]
async fn stateful_responses_skip_the_prefill() {
    let decode = FakeConfig { stored_responses: vec!["resp_1".into()], ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let body = responses_body(json!({"previous_response_id": "resp_1"}));
    let (status, _, text) = post_json(&format!("{}/v1/responses", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(p.posts().is_empty(), "no prefill leg");
    assert_eq!(d.posts()[0].json(), body);
    proxy.assert_reaches(&reuse_series("pd", "fallback", "stateful"), 1.0).await;
    // What a prefill leg would have met: the prefill engine does not know the id.
    let (status, _, _) = post_json(&format!("http://{}/v1/responses", p.host_port()), &body, &[]).await;
    assert_eq!(status, 404);
}

/// A Responses prefill that echoes ids of the wrong count: the text decode, `ids_malformed`.
#[tokio::test(flavor = "multi_thread")]
async fn responses_with_bad_echoed_ids_fall_back() {
    let prefill = FakeConfig { corrupt_prompt_ids: Some("[1,2]".into()), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(prefill, FakeConfig::default(), "").await;
    let (status, _, text) = post_json(&format!("{}/v1/responses", proxy.url), &responses_body(json!({})), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert!(d.posts()[0].json()["kv_transfer_params"].get("prompt_token_ids").is_none());
    proxy.assert_reaches(&reuse_series("pd", "fallback", "ids_malformed"), 1.0).await;
}

/// Messages: both legs run (prefill `max_tokens` 1 with the KV handoff), nothing asked of the
/// prefill it cannot give, the decode renders the messages itself: `ids_not_echoed`. The
/// stream is relayed byte for byte.
#[tokio::test(flavor = "multi_thread")]
async fn messages_run_both_legs_without_ids() {
    let prefill = FakeConfig { connector: true, ..FakeConfig::default() };
    let (p, d, proxy) = pd_setup(prefill, FakeConfig::default(), "").await;
    for stream in [false, true] {
        let body = messages_body(json!({"stream": stream}));
        let (status, _, text) =
            post_json(&format!("{}/v1/messages", proxy.url), &body, &[("x-request-id", "m1")]).await;
        assert_eq!(status, 200, "{text}");
        let (_, _, direct) =
            post_json(&format!("http://{}/v1/messages", d.host_port()), &body, &[("x-request-id", "m1")]).await;
        assert_eq!(text, direct);
    }
    let pj = p.posts()[0].json();
    assert_eq!((pj["max_tokens"].clone(), pj["stream"].clone()), (json!(1), json!(false)));
    assert!(pj.get("return_token_ids").is_none() && pj.get("enable_response_messages").is_none());
    let dj = d.posts()[0].json();
    assert_eq!(dj["kv_transfer_params"]["remote_engine_id"], "fake-engine");
    assert!(dj["kv_transfer_params"].get("prompt_token_ids").is_none());
    assert_eq!(dj["max_tokens"], 5);
    proxy.assert_reaches(&reuse_series("pd", "fallback", "ids_not_echoed"), 2.0).await;
}

/// `token_reuse = 0.5`: request ids inside the share reuse, the others take the text decode
/// counted as `canary`; which is which follows the request id (the same id twice, the same
/// answer), so applied + canary add up to the requests sent and match the plan's own hash.
#[tokio::test(flavor = "multi_thread")]
async fn canary_share_is_visible_in_the_reuse_metrics() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "token_reuse = 0.5").await;
    let share = tokenonce::config::ReuseShare::from_fraction(0.5).unwrap();
    let ids: Vec<String> = (0..40).map(|i| format!("canary-{i}")).collect();
    let url = format!("{}/v1/chat/completions", proxy.url);
    for id in ids.iter().chain(ids.iter().take(5)) {
        let (status, _, text) = post_json(&url, &chat_body("hi there", json!({})), &[("x-request-id", id)]).await;
        assert_eq!(status, 200, "{text}");
    }
    let admitted: Vec<bool> = ids.iter().chain(ids.iter().take(5)).map(|id| share.admits(id)).collect();
    let inside = admitted.iter().filter(|a| **a).count() as f64;
    assert!(inside > 0.0 && inside < 45.0, "a 0.5 share of 40 ids admits some and not all");
    for (post, want) in d.posts().iter().zip(&admitted) {
        let reused = post.json()["kv_transfer_params"].get("prompt_token_ids").is_some();
        assert_eq!(reused, *want, "{}", post.header("x-request-id").unwrap());
    }
    assert_eq!(
        proxy.metric_reaches(r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#, inside).await,
        inside
    );
    assert_eq!(
        proxy
            .metric_reaches(
                r#"tokenonce_token_reuse_total{reason="canary",result="fallback",route="pd"}"#,
                45.0 - inside
            )
            .await,
        45.0 - inside
    );
}

/// `tokenonce check` refuses a share outside 0.0–1.0 and names the key.
#[test]
fn check_refuses_a_share_out_of_range() {
    for (value, ok) in
        [("1.5", false), ("-0.1", false), ("2", false), ("0.25", true), ("0", true), ("1", true), ("false", true)]
    {
        let text = format!(
            "[pools.prefill]\nendpoints = [\"127.0.0.1:1\"]\n[pools.decode]\nendpoints = [\"127.0.0.1:2\"]\n[[routes]]\nname = \"r\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\ntoken_reuse = {value}\n"
        );
        match tokenonce::config::Config::from_toml(&text, "t.toml") {
            Ok(_) => assert!(ok, "{value} accepted"),
            Err(e) => {
                assert!(!ok, "{value} refused: {e:?}");
                let p = e.problems.iter().find(|p| p.key == "routes[0].token_reuse").unwrap();
                assert!(p.message.contains("between 0.0 and 1.0"), "{}", p.message);
                assert_eq!(p.line, 10);
            }
        }
    }
}

/// tokenonce's own errors on `/v1/messages` are Anthropic's `{"type":"error","error":{"type",
/// "message"}}` with the right status (a body it refuses, one over `max_body_bytes`, a decode
/// it cannot reach, streamed or not), and an engine's own error body is relayed unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn messages_errors_from_tokenonce_are_anthropic_shaped() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "max_body_bytes = 100000").await;
    let url = format!("{}/v1/messages", proxy.url);
    let anthropic = |status: u16, text: &str, kind: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        assert_eq!(v["type"], "error", "{status}: {text}");
        assert_eq!(v["error"]["type"], kind, "{status}: {text}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{text}");
        assert!(!text.contains("127.0.0.1"), "{text}");
    };
    let (status, _, text) = post_raw(&url, r#"{"model":"tiny-qwen3","messages":["#, &[]).await;
    assert_eq!(status, 400);
    anthropic(status, &text, "invalid_request_error");
    let big = messages_body(json!({"messages": [{"role": "user", "content": "word ".repeat(30_000)}]}));
    let (status, _, text) = post_json(&url, &big, &[]).await;
    assert_eq!(status, 413);
    anthropic(status, &text, "request_too_large");
    // The engine's own error (vLLM writes Anthropic's shape there too) passes unchanged.
    let (status, _, text) = post_json(&url, &messages_body(json!({"max_tokens": null})), &[]).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("max_tokens is required"), "{text}");

    // A decode pool whose engine refuses connections.
    let refused = RefusedAddr::new();
    let conf = pd_config(&d, &d, "").replace(
        &format!("[pools.decode]\nendpoints = [\"{}\"]", d.host_port()),
        &format!("[pools.decode]\nendpoints = [\"{}\"]", refused.addr),
    );
    let proxy = TokenOnce::start(&conf).await;
    let url = format!("{}/v1/messages", proxy.url);
    for stream in [false, true] {
        let (status, _, text) = post_json(&url, &messages_body(json!({"stream": stream})), &[]).await;
        assert_eq!(status, 502, "{text}");
        anthropic(status, &text, "api_error");
        assert!(text.contains("decode engine unavailable"), "{text}");
    }
}

/// A Messages stream that breaks mid-way ends with Anthropic's `event: error` (no `[DONE]`,
/// which Anthropic streams never carry) after the whole events before it.
#[tokio::test(flavor = "multi_thread")]
async fn a_broken_messages_stream_ends_with_an_anthropic_error_event() {
    let decode = FakeConfig { break_stream_after: Some(3), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let body = messages_body(json!({"stream": true}));
    let (status, _, text) = post_json(&format!("{}/v1/messages", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[..3].iter().all(|e| !e.contains("error")), "{text}");
    let last = events[3].strip_prefix("event: error\ndata: ").unwrap_or_else(|| panic!("{text}"));
    let v: Value = serde_json::from_str(last).unwrap();
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "api_error", "message": "decode engine stream failed: connection closed"}})
    );
    assert!(!text.contains("[DONE]") && text.ends_with("}\n\n"), "{text}");
}

/// tokenonce's own errors on `/v1/responses` are OpenAI's (the Responses API's own format);
/// a Responses stream that breaks ends with the typed `event: error` of the Responses API,
/// `{"type":"error","code","message","param","sequence_number"}`, numbered after the last
/// event passed, without `[DONE]`.
#[tokio::test(flavor = "multi_thread")]
async fn responses_errors_take_the_responses_format() {
    let decode = FakeConfig { break_stream_after: Some(3), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let url = format!("{}/v1/responses", proxy.url);
    let (status, _, text) = post_raw(&url, r#"{"model":"tiny-qwen3","input":["#, &[]).await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["error"]["code"].as_str(), v["error"]["type"].as_str()),
        (Some("invalid_request"), Some("invalid_request_error"))
    );

    let (status, _, text) = post_json(&url, &responses_body(json!({"stream": true})), &[]).await;
    assert_eq!(status, 200, "{text}");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 4, "{text}");
    assert!(events[2].contains("\"sequence_number\":2"), "{text}");
    let last = events[3].strip_prefix("event: error\ndata: ").unwrap_or_else(|| panic!("{text}"));
    let v: Value = serde_json::from_str(last).unwrap();
    assert_eq!(
        v,
        json!({"type": "error", "code": "decode_stream_failed", "message": "decode engine stream failed: connection closed", "param": null, "sequence_number": 3})
    );
    assert!(!text.contains("[DONE]"), "{text}");
}

/// Stateful Responses over two decode endpoints that store their answers: each answer's
/// follow-up (`previous_response_id`) and its retrieval (`GET /v1/responses/{id}`) reach the
/// endpoint that stored it, never the other (which would answer 404); an id tokenonce does
/// not know is balanced and counted `unknown`.
#[tokio::test(flavor = "multi_thread")]
async fn stateful_responses_reach_the_decode_that_stored_them() {
    let store = FakeConfig { store_responses: true, ..FakeConfig::default() };
    let (p, d1, d2) = (
        FakeVllm::start(FakeConfig::default()).await,
        FakeVllm::start(store.clone()).await,
        FakeVllm::start(store).await,
    );
    let config = format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\n[pools.decode]\nendpoints = [\"{}\", \"{}\"]\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
        p.host_port(),
        d1.host_port(),
        d2.host_port()
    );
    let proxy = TokenOnce::start(&config).await;
    let url = format!("{}/v1/responses", proxy.url);
    let mut homes = Vec::new();
    for turn in 0..4 {
        let (status, _, text) = post_json(&url, &responses_body(json!({})), &[]).await;
        assert_eq!(status, 200, "{text}");
        let id = serde_json::from_str::<Value>(&text).unwrap()["id"].as_str().unwrap().to_owned();
        let stored_on = |d: &FakeVllm| d.posts().last().is_some_and(|r| r.json()["request_id"] == id.as_str());
        let home = if stored_on(&d1) { 1 } else { 2 };
        assert!(stored_on(&d1) != stored_on(&d2), "turn {turn}: one decode answered {id}");
        homes.push((id, home));
    }
    assert!(homes.iter().any(|h| h.1 == 1) && homes.iter().any(|h| h.1 == 2), "both decodes stored answers: {homes:?}");
    for (id, home) in &homes {
        let (before1, before2) = (d1.posts().len(), d2.posts().len());
        let (status, _, text) = post_json(&url, &responses_body(json!({"previous_response_id": id})), &[]).await;
        assert_eq!(status, 200, "{id}: {text}");
        let grew = (d1.posts().len() - before1, d2.posts().len() - before2);
        assert_eq!(grew, if *home == 1 { (1, 0) } else { (0, 1) }, "{id} went to its home, decode {home}");
        let got = reqwest::get(format!("{url}/{id}")).await.unwrap();
        assert_eq!(got.status().as_u16(), 200, "GET {id}: {:?}", got.text().await);
    }
    // 4 follow-ups and 4 retrievals, each at home.
    let home = r#"tokenonce_response_followups_total{result="home"}"#;
    proxy.assert_reaches(home, 8.0).await;
    let (status, _, _) = post_json(&url, &responses_body(json!({"previous_response_id": "resp_nobody"})), &[]).await;
    assert_eq!(status, 404, "no decode stored it: the engine's own 404, relayed");
    let unknown = r#"tokenonce_response_followups_total{result="unknown"}"#;
    proxy.assert_reaches(unknown, 1.0).await;
    assert!(proxy.metric("tokenonce_response_homes").await >= 4.0);
}
