//! Relay mode: an orchestrator like vLLM's toy proxy sends both legs through tokenonce,
//! which asks the prefill for ids, keeps them (cache or stateless) and turns the decode
//! token-in; the cache stays bounded and never crosses ids.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::toy_proxy::ToyProxy;
use support::*;

fn relay_config(prefill: &FakeVllm, decode: &FakeVllm, extra: &str, cache: &str) -> String {
    format!(
        "{cache}\n[pools.prefill]\nendpoints = [\"{}\"]\n\n[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"relay\"\nmode = \"relay\"\nprefill = {{ pool = \"prefill\" }}\ndecode_pool = \"decode\"\n{extra}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n",
        prefill.host_port(),
        decode.host_port()
    )
}

/// A prefill engine answering like a NIXL-connected one (non-null `kv_transfer_params`).
fn connector() -> FakeConfig {
    FakeConfig { connector: true, ..FakeConfig::default() }
}

/// The prefill leg an orchestrator sends for a chat (one token, `do_remote_decode`).
fn prefill_leg(stream: bool) -> Value {
    let handoff = json!({"do_remote_decode": true, "do_remote_prefill": false});
    chat_body("p", json!({"max_tokens": 1, "stream": stream, "kv_transfer_params": handoff}))
}

/// A prefill fake (`prefill`), a default decode fake and tokenonce between them on relay route
/// `relay` with the route keys `extra`.
async fn relay_setup(prefill: FakeConfig, extra: &str) -> (FakeVllm, FakeVllm, TokenOnce) {
    let [prefill, decode] = fakes([prefill, FakeConfig::default()]).await;
    let proxy = TokenOnce::start(&relay_config(&prefill, &decode, extra, "")).await;
    (prefill, decode, proxy)
}

/// Drops the fields that legitimately differ between two runs (ids, fingerprint).
fn normalize(text: &str) -> String {
    text.split("\n\n")
        .map(|event| {
            let data = event.trim_start_matches("data: ");
            match serde_json::from_str::<Value>(data) {
                Ok(mut v) => {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("id");
                    }
                    v.to_string()
                }
                Err(_) => event.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The toy proxy pointed at tokenonce (for both legs) gets, with a NIXL-like prefill, the
/// same answers as pointed at the engines directly; the decode went token-in, found by the
/// prefill's remote_request_id, and the orchestrator never saw the echoed ids.
#[tokio::test(flavor = "multi_thread")]
async fn toy_proxy_through_tokenonce_reuses_ids() {
    let (prefill, decode, proxy) = relay_setup(connector(), "").await;
    let via = ToyProxy::start(&proxy.url, &proxy.url).await;
    let direct =
        ToyProxy::start(&format!("http://{}", prefill.host_port()), &format!("http://{}", decode.host_port())).await;

    for (path, body) in [
        ("/v1/chat/completions", chat_body("relay me", json!({"min_tokens": 1}))),
        (
            "/v1/chat/completions",
            chat_body("relay me streaming", json!({"stream": true, "stream_options": {"include_usage": true}})),
        ),
        ("/v1/completions", json!({"model": "tiny-qwen3", "prompt": "complete these words", "max_tokens": 4})),
    ] {
        let (s1, _, through) = post_json(&format!("{}{path}", via.url()), &body, &[]).await;
        let decode_leg = decode.posts().pop().unwrap().json();
        let (s2, _, plain) = post_json(&format!("{}{path}", direct.url()), &body, &[]).await;
        assert_eq!((s1, s2), (200, 200));
        assert_eq!(normalize(&through), normalize(&plain), "{path}");
        let expected = if path.contains("chat") {
            fake_tokenize(&fake_render_chat(&body))
        } else {
            fake_tokenize("complete these words")
        };
        if path.contains("chat") {
            assert_eq!(decode_leg["kv_transfer_params"]["prompt_token_ids"], json!(expected));
            assert_eq!(decode_leg["kv_transfer_params"]["remote_engine_id"], "fake-engine", "prefill kv params kept");
        } else {
            assert_eq!(decode_leg["prompt"], json!(expected));
        }
    }
    assert_eq!(proxy.metric(&reuse_series("relay", "applied", "none")).await, 3.0);
    assert_eq!(proxy.metric(r#"tokenonce_cache_lookups_total{result="hit"}"#).await, 3.0);
    assert_eq!(proxy.metric("tokenonce_cache_entries").await, 0.0, "entries are removed when used");
    // The prefill legs through tokenonce (3 of the 6 the engine saw) asked for ids; the
    // orchestrator's answers equal the direct ones above, so they did not carry them.
    assert_eq!(prefill.posts().iter().filter(|r| r.json()["return_token_ids"] == true).count(), 3);
}

/// A prefill through a relay route answers exactly what the engine answers without
/// return_token_ids (same bytes), while the engine was asked for them.
#[tokio::test(flavor = "multi_thread")]
async fn relayed_prefill_response_is_unchanged_for_the_orchestrator() {
    let (prefill, _decode, proxy) = relay_setup(connector(), "").await;
    let body = prefill_leg(false);
    let (_, _, via) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[("x-request-id", "fixed")]).await;
    let (_, _, direct) =
        post_json(&format!("http://{}/v1/chat/completions", prefill.host_port()), &body, &[("x-request-id", "fixed")])
            .await;
    assert_eq!(via, direct);
    assert_eq!(prefill.posts()[0].json()["return_token_ids"], true);
    // When the orchestrator asked for ids itself, it gets them.
    let mut asked = body.clone();
    asked["return_token_ids"] = json!(true);
    let (_, _, via) = post_json(&format!("{}/v1/chat/completions", proxy.url), &asked, &[]).await;
    assert!(serde_json::from_str::<Value>(&via).unwrap()["prompt_token_ids"].is_array());
}

/// A prefill leg tokenonce forwards as is (streamed: it asks no ids) is timed as a prefill,
/// not as a decode: `stage_duration{stage="decode_total"}` counts decode legs only.
#[tokio::test(flavor = "multi_thread")]
async fn a_prefill_forwarded_as_is_is_no_decode_in_the_stage_timings() {
    let (prefill, _decode, proxy) = relay_setup(connector(), "").await;
    let body = prefill_leg(true);
    let (status, _, _) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(prefill.posts().len(), 1);
    assert!(prefill.posts()[0].json().get("return_token_ids").is_none(), "forwarded as is");
    assert_eq!(
        proxy.metric(r#"tokenonce_stage_duration_seconds_count{route="relay",stage="decode_total"}"#).await,
        0.0
    );
    assert_eq!(
        proxy.metric(r#"tokenonce_requests_total{api="chat",mode="relay",outcome="success",route="relay"}"#).await,
        1.0
    );
}

/// Without a KV connector the prefill returns no kv params and the toy proxy copies none:
/// the decode is found by X-Request-Id.
#[tokio::test(flavor = "multi_thread")]
async fn decode_without_kv_params_is_found_by_request_id() {
    let (_prefill, decode, proxy) = relay_setup(FakeConfig::default(), "").await;
    let toy = ToyProxy::start(&proxy.url, &proxy.url).await;
    let body = chat_body("no connector", json!({}));
    let (status, _, _) = post_json(&format!("{}/v1/chat/completions", toy.url()), &body, &[]).await;
    assert_eq!(status, 200);
    let leg = decode.posts()[0].json();
    assert_eq!(leg["kv_transfer_params"]["prompt_token_ids"], json!(fake_tokenize(&fake_render_chat(&body))));
}

/// A decode-looking request whose key finds nothing is sent unchanged and counted.
#[tokio::test(flavor = "multi_thread")]
async fn unmatched_decode_falls_back_and_is_counted() {
    let (_prefill, decode, proxy) = relay_setup(FakeConfig::default(), "").await;
    let raw = r#"{"model":"tiny-qwen3","messages":[{"role":"user","content":"orphan"}],"max_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_request_id":"nobody","remote_port":5600,"f":1.0}}"#;
    let (status, _, _) = post_raw(&format!("{}/v1/chat/completions", proxy.url), raw, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(decode.posts()[0].text(), raw, "forwarded byte for byte");
    assert_eq!(proxy.metric(&reuse_series("relay", "fallback", "cache_miss")).await, 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_cache_lookups_total{result="miss"}"#).await, 1.0);
    // A plain request (neither leg) passes through uncounted.
    let plain = r#"{"model":"tiny-qwen3","messages":[{"role":"user","content":"plain"}]}"#;
    post_raw(&format!("{}/v1/chat/completions", proxy.url), plain, &[]).await;
    assert_eq!(decode.posts()[1].text(), plain);
    assert_eq!(proxy.metric(&reuse_series("relay", "fallback", "cache_miss")).await, 1.0);
}

/// Stateless handoff across two instances: the prefill instance returns the ids inside
/// kv_transfer_params, the toy proxy copies them, the decode instance sends them on (chat)
/// or turns them into the prompt (completions). No cache is used.
#[tokio::test(flavor = "multi_thread")]
async fn stateless_handoff_across_two_instances() {
    let prefill = FakeVllm::start(connector()).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let conf = relay_config(&prefill, &decode, "relay_handoff = \"stateless\"", "");
    let a = TokenOnce::start(&conf).await;
    let b = TokenOnce::start(&conf).await;
    let toy = ToyProxy::start(&a.url, &b.url).await;
    let body = chat_body("two instances", json!({}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", toy.url()), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    let leg = decode.posts()[0].json();
    assert_eq!(leg["kv_transfer_params"]["prompt_token_ids"], json!(fake_tokenize(&fake_render_chat(&body))));
    assert_eq!(leg["kv_transfer_params"]["remote_engine_id"], "fake-engine");
    let (status, _, _) = post_json(
        &format!("{}/v1/completions", toy.url()),
        &json!({"model":"tiny-qwen3","prompt":"two words","max_tokens":2}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let leg = decode.posts()[1].json();
    assert_eq!(leg["prompt"], json!(fake_tokenize("two words")));
    assert!(leg["kv_transfer_params"].get("prompt_token_ids").is_none());
    assert_eq!(a.metric("tokenonce_cache_entries").await + b.metric("tokenonce_cache_entries").await, 0.0);
    assert_eq!(b.metric(&reuse_series("relay", "applied", "none")).await, 2.0);
}

/// Malformed ids arriving in a decode's kv_transfer_params are removed, never forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_relayed_ids_are_stripped() {
    let (_prefill, decode, proxy) = relay_setup(FakeConfig::default(), "relay_handoff = \"stateless\"").await;
    let raw = r#"{"model":"tiny-qwen3","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[1,-2]}}"#;
    let (status, _, _) = post_raw(&format!("{}/v1/chat/completions", proxy.url), raw, &[]).await;
    assert_eq!(status, 200);
    assert!(decode.posts()[0].json()["kv_transfer_params"].get("prompt_token_ids").is_none());
    assert_eq!(proxy.metric(&reuse_series("relay", "fallback", "ids_malformed")).await, 1.0);
}

/// 256 concurrent requests through the toy proxy: every decode carries its own ids.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_relays_never_cross_ids() {
    let (_prefill, decode, proxy) = relay_setup(connector(), "").await;
    let toy = ToyProxy::start(&proxy.url, &proxy.url).await;
    let client = reqwest::Client::new();
    // One request first, so the decode's version is known before the burst: this test is
    // about ids never crossing, and on a loaded machine the burst's one `/version` ask can
    // pass its 1 s deadline (those requests then fall back, correctly, but carry no ids).
    let warm = client.post(format!("{}/v1/chat/completions", toy.url())).json(&chat_body("warm up", json!({})));
    assert_eq!(warm.send().await.unwrap().status().as_u16(), 200);
    let mut tasks = Vec::new();
    for i in 0..256 {
        let (client, url) = (client.clone(), format!("{}/v1/chat/completions", toy.url()));
        tasks.push(tokio::spawn(async move {
            let body = chat_body(&format!("relay prompt {i} words {}", i * 13), json!({"stream": i % 3 == 0}));
            let resp = client.post(url).json(&body).send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }));
    }
    for t in tasks {
        let (status, text) = tokio::time::timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
        assert_eq!(status, 200, "{text}");
    }
    let posts = decode.posts();
    assert_eq!(posts.len(), 257);
    for r in posts {
        let j = r.json();
        assert_eq!(j["kv_transfer_params"]["prompt_token_ids"], json!(fake_tokenize(&fake_render_chat(&j))));
    }
    proxy.assert_reaches(&reuse_series("relay", "applied", "none"), 257.0).await;
}

/// A flood of prefills with no decodes never takes the cache past its capacity, evicts the
/// oldest, and expired entries are gone after the TTL.
#[tokio::test(flavor = "multi_thread")]
async fn prefill_flood_stays_bounded_and_expires() {
    let [prefill, decode] = fakes(Default::default()).await;
    let capacity = 4096;
    let cache = format!("[cache]\ncapacity_bytes = {capacity}\nttl_ms = 1500\n");
    let proxy = TokenOnce::start(&relay_config(&prefill, &decode, "", &cache)).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let client = reqwest::Client::new();
    for batch in 0..4 {
        let mut tasks = Vec::new();
        for i in 0..50 {
            let words: String = (0..40).map(|w| format!("b{batch}i{i}w{w} ")).collect();
            let body = chat_body(&words, json!({"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}));
            let (client, url) = (client.clone(), url.clone());
            tasks.push(tokio::spawn(
                async move { client.post(url).json(&body).send().await.unwrap().status().as_u16() },
            ));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        let bytes = proxy.metric("tokenonce_cache_bytes").await;
        assert!(bytes > 0.0 && bytes <= capacity as f64, "batch {batch}: {bytes} bytes cached");
    }
    assert!(proxy.metric(r#"tokenonce_cache_evictions_total{reason="capacity"}"#).await > 0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric("tokenonce_cache_entries").await > 0.0 {
        assert!(Instant::now() < deadline, "entries did not expire");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(proxy.metric("tokenonce_cache_bytes").await, 0.0);
    assert!(proxy.metric(r#"tokenonce_cache_evictions_total{reason="ttl"}"#).await > 0.0);
}

/// Generate legs through a relay route pass byte for byte (their prompt is ids already, so
/// there is nothing to reuse): the prefill leg reaches the prefill pool, the decode leg with
/// the prefill's handoff the decode pool, and each answer is the engine's own.
#[tokio::test(flavor = "multi_thread")]
async fn generate_legs_pass_through_a_relay_route_unchanged() {
    let prefill = FakeVllm::start(connector()).await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let conf = relay_config(&prefill, &decode, "", "")
        .replace("\"/v1/completions\"]", "\"/v1/completions\", \"/inference/v1/generate\"]");
    let proxy = TokenOnce::start(&conf).await;
    let url = format!("{}/inference/v1/generate", proxy.url);
    let leg = r#"{"model":"tiny-qwen3","token_ids":[1,2,3],"sampling_params":{"max_tokens":1,"temperature":0.50},"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}"#;
    let (status, _, answer) = post_raw(&url, leg, &[("x-request-id", "g")]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(&prefill.posts()[0].body[..], leg.as_bytes());
    let kv = serde_json::from_str::<Value>(&answer).unwrap()["kv_transfer_params"].clone();
    assert_eq!(kv["remote_engine_id"], "fake-engine");
    let decode_leg = format!(
        r#"{{"model":"tiny-qwen3","token_ids":[1,2,3],"sampling_params":{{"max_tokens":5}},"stream":true,"kv_transfer_params":{kv}}}"#
    );
    let (status, _, streamed) = post_raw(&url, decode_leg.clone(), &[("x-request-id", "g")]).await;
    assert_eq!(status, 200, "{streamed}");
    assert_eq!(&decode.posts()[0].body[..], decode_leg.as_bytes());
    let direct_url = format!("http://{}/inference/v1/generate", decode.host_port());
    let (_, _, direct) = post_raw(&direct_url, decode_leg, &[("x-request-id", "g")]).await;
    assert_eq!(streamed, direct);
}
