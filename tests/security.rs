//! Untrusted clients on orchestrate routes: the P/D handoff belongs to tokenonce, so a
//! client's own `kv_transfer_params` (and the same keys inside `vllm_xargs`) never reach
//! either engine, whatever the prefill answers and whatever the route's reuse setting.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use support::{chat_body, pd_setup, post_json, FakeConfig, FakeVllm, TokenOnce};

/// What a hostile client puts in its body: ids of its choosing (skipping the chat template
/// and its system prompt) and a KV pull from a host of its choosing.
fn hostile_kv() -> Value {
    json!({"prompt_token_ids": [1, 2, 3], "remote_host": "10.9.9.9", "remote_port": 1, "remote_engine_id": "evil",
           "do_remote_prefill": true})
}

fn assert_no_client_handoff(engine: &str, body: &Value) {
    let kv = &body["kv_transfer_params"];
    assert!(kv.get("remote_host").is_none_or(Value::is_null), "{engine} got the client's remote_host: {body}");
    assert!(kv.get("remote_engine_id").is_none_or(|v| v != "evil"), "{engine} got the client's engine id: {body}");
    assert_ne!(kv.get("prompt_token_ids"), Some(&json!([1, 2, 3])), "{engine} got the client's ids: {body}");
    assert!(body.get("ec_transfer_params").is_none(), "{engine}: {body}");
    assert!(body["vllm_xargs"].get("kv_transfer_params").is_none(), "{engine}: {body}");
}

/// Chat and completions, reuse on and off, a prefill that answers no KV params of its own:
/// neither leg carries the client's handoff; the decode's ids are the prefill's.
#[tokio::test(flavor = "multi_thread")]
async fn client_kv_transfer_params_never_reach_an_engine() {
    for route_extra in ["", "token_reuse = false"] {
        let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), route_extra).await;
        let chat = chat_body(
            "hello there",
            json!({"kv_transfer_params": hostile_kv(), "ec_transfer_params": {"x": 1},
                   "vllm_xargs": {"kv_transfer_params": hostile_kv(), "session_id": "s1"}}),
        );
        let cmpl = json!({"model": "tiny-qwen3", "prompt": "complete this", "max_tokens": 3,
                          "kv_transfer_params": hostile_kv()});
        for (path, body) in [("/v1/chat/completions", &chat), ("/v1/completions", &cmpl)] {
            let (status, _, text) = post_json(&format!("{}{path}", proxy.url), body, &[]).await;
            assert_eq!(status, 200, "{route_extra} {path}: {text}");
        }
        let (prefills, decodes) = (p.posts(), d.posts());
        assert_eq!((prefills.len(), decodes.len()), (2, 2), "{route_extra}");
        for r in prefills.iter().chain(&decodes) {
            assert_no_client_handoff(&r.path, &r.json());
        }
        assert_eq!(decodes[0].json()["vllm_xargs"]["session_id"], "s1", "other xargs are the client's own");
        if route_extra.is_empty() {
            let ids = &decodes[0].json()["kv_transfer_params"]["prompt_token_ids"];
            assert!(ids.as_array().is_some_and(|a| a.len() > 3), "the prefill's ids, not the client's: {ids}");
        }
    }
}

/// A header-mode route without the header sends the request to the decode alone: still
/// without the client's handoff.
#[tokio::test(flavor = "multi_thread")]
async fn decode_only_requests_lose_the_client_handoff_too() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let conf = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"llmd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }}\n",
        d.host_port()
    );
    let proxy = TokenOnce::start(&conf).await;
    let body = chat_body("alone", json!({"kv_transfer_params": hostile_kv()}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    let sent = d.posts()[0].json();
    assert!(sent.get("kv_transfer_params").is_none(), "{sent}");
    assert_eq!(sent["messages"], body["messages"]);
}

fn header_route(decode: &FakeVllm) -> String {
    format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"llmd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\", \"nowhere.invalid\"] }}\n",
        decode.host_port()
    )
}

/// A prefiller named by a request header gets no client credentials; the decode (a
/// configured pool) still does.
#[tokio::test(flavor = "multi_thread")]
async fn credentials_stay_away_from_header_named_prefillers() {
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let proxy = TokenOnce::start(&header_route(&d)).await;
    let headers = [
        ("x-prefiller-host-port", p.host_port()),
        ("authorization", "Bearer sk-secret".to_owned()),
        ("cookie", "session=1".to_owned()),
        ("x-api-key", "k".to_owned()),
    ];
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &headers).await;
    assert_eq!(status, 200, "{text}");
    let prefill = &p.posts()[0];
    for h in ["authorization", "cookie", "x-api-key", "x-prefiller-host-port"] {
        assert_eq!(prefill.header(h), None, "{h} went to the named prefiller");
    }
    assert_eq!(d.posts()[0].header("authorization").as_deref(), Some("Bearer sk-secret"));
    assert_eq!(d.posts()[0].header("x-prefiller-host-port"), None);
}

/// Whatever keeps a named prefiller from answering (refused port, unknown host), the client
/// reads the same words: tokenonce is no port scanner.
#[tokio::test(flavor = "multi_thread")]
async fn unreachable_named_prefillers_all_read_alike() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let proxy = TokenOnce::start(&header_route(&d)).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port() // dropped here: nothing listens, so connects are refused
    };
    let mut messages = Vec::new();
    for target in [format!("127.0.0.1:{closed}"), "nowhere.invalid:8000".to_owned()] {
        let (status, _, text) = post_json(
            &format!("{}/v1/chat/completions", proxy.url),
            &chat_body("x", json!({})),
            &[("x-prefiller-host-port", &target)],
        )
        .await;
        assert_eq!(status, 502, "{target}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "prefill_unavailable");
        messages.push(v["error"]["message"].clone());
    }
    assert_eq!(messages[0], messages[1]);
    assert_eq!(messages[0], "prefill engine unavailable: cannot connect");
    assert!(d.posts().is_empty());
}

/// A named prefiller's own error comes back as it sent it, up to 64 KiB; a larger one is
/// replaced by tokenonce's error.
#[tokio::test(flavor = "multi_thread")]
async fn error_bodies_from_named_prefillers_are_capped() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let proxy = TokenOnce::start(&header_route(&d)).await;
    let small = r#"{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}"#;
    let big = format!(r#"{{"error":{{"message":"{}"}}}}"#, "x".repeat(70 * 1024));
    for (status, body, want_status) in [(400, small.to_owned(), 400), (503, big, 502)] {
        let p = FakeVllm::start(FakeConfig { fail_with: Some((status, body.clone())), ..FakeConfig::default() }).await;
        let (got, _, text) = post_json(
            &format!("{}/v1/chat/completions", proxy.url),
            &chat_body("x", json!({})),
            &[("x-prefiller-host-port", &p.host_port())],
        )
        .await;
        assert_eq!(got, want_status, "{text}");
        if want_status == 400 {
            assert_eq!(text, small);
        } else {
            assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "prefill_bad_response");
            assert!(text.len() < 1024);
        }
    }
    assert!(d.posts().is_empty());
}

/// `client_kv_transfer_params = "reject"`: a client's handoff fields are a 400 naming the
/// field, before any leg.
#[tokio::test(flavor = "multi_thread")]
async fn a_route_can_refuse_client_handoff_fields() {
    let (p, d, proxy) =
        pd_setup(FakeConfig::default(), FakeConfig::default(), "client_kv_transfer_params = \"reject\"").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, text) = post_json(&url, &chat_body("x", json!({"kv_transfer_params": hostile_kv()})), &[]).await;
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["error"]["code"].as_str(), v["error"]["param"].as_str()),
        (Some("invalid_request"), Some("kv_transfer_params"))
    );
    assert!(p.posts().is_empty() && d.posts().is_empty());
    let (status, _, _) = post_json(&url, &chat_body("clean", json!({})), &[]).await;
    assert_eq!(status, 200, "requests without them are served");
}

fn header_route_with(decode: &FakeVllm, extra: &str) -> String {
    header_route(decode).replace("\"nowhere.invalid\"] }", &format!("\"nowhere.invalid\"]{extra} }}"))
}

/// `trusted_sources`: the header is believed only from those peers (the gateway); from any
/// other peer it is a 403 and no leg is sent. A request without the header is served.
#[tokio::test(flavor = "multi_thread")]
async fn the_prefiller_header_needs_a_trusted_peer() {
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let url_of = |proxy: &TokenOnce| format!("{}/v1/chat/completions", proxy.url);
    let named = [("x-prefiller-host-port", p.host_port())];
    let named: Vec<(&str, &str)> = named.iter().map(|(k, v)| (*k, v.as_str())).collect();

    let untrusting = TokenOnce::start(&header_route_with(&d, ", trusted_sources = [\"10.0.0.0/8\"]")).await;
    let (status, _, text) = post_json(&url_of(&untrusting), &chat_body("x", json!({})), &named).await;
    assert_eq!(status, 403, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "prefiller_header_untrusted");
    assert!(p.posts().is_empty() && d.posts().is_empty());
    let (status, _, _) = post_json(&url_of(&untrusting), &chat_body("no header", json!({})), &[]).await;
    assert_eq!(status, 200, "decode-only needs no trust");

    let trusting = TokenOnce::start(&header_route_with(&d, ", trusted_sources = [\"127.0.0.0/8\"]")).await;
    let (status, _, text) = post_json(&url_of(&trusting), &chat_body("x", json!({})), &named).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts().len(), 1);
}

/// `forward_credentials = true` sends the client's credentials to the named prefiller too.
#[tokio::test(flavor = "multi_thread")]
async fn a_route_can_forward_credentials_to_named_prefillers() {
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let proxy = TokenOnce::start(&header_route_with(&d, ", forward_credentials = true")).await;
    let headers = [("x-prefiller-host-port", p.host_port()), ("authorization", "Bearer sk-1".to_owned())];
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &headers).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts()[0].header("authorization").as_deref(), Some("Bearer sk-1"));
}

/// Allowlist ports: an allowed host on another port is refused (no scanning of the
/// prefill hosts' other services through tokenonce).
#[tokio::test(flavor = "multi_thread")]
async fn allowlist_ports_are_enforced_end_to_end() {
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let port = p.host_port().rsplit_once(':').unwrap().1.to_owned();
    let conf = header_route(&d).replace("[\"127.0.0.0/8\", \"nowhere.invalid\"]", &format!("[\"127.0.0.0/8:{port}\"]"));
    let proxy = TokenOnce::start(&conf).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, _) =
        post_json(&url, &chat_body("x", json!({})), &[("x-prefiller-host-port", &p.host_port())]).await;
    assert_eq!(status, 200);
    let (status, _, text) =
        post_json(&url, &chat_body("x", json!({})), &[("x-prefiller-host-port", "127.0.0.1:22")]).await;
    assert_eq!(status, 403, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "prefiller_not_allowed");
}
