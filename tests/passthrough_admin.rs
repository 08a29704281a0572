//! Everything that is not orchestrated: byte-for-byte passthrough, the admin listener
//! (`/metrics`, `/healthz`, `/readyz`), config reloads (a good file applied, a bad one
//! refused, a stream in flight finished on the config it started with), and stopping (the
//! binary on SIGTERM, the in-process handle).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::fault_engine::{End, FaultEngine};
use support::*;

/// Other paths go to the decode pool unchanged, request and response.
#[tokio::test(flavor = "multi_thread")]
async fn other_paths_are_proxied_byte_for_byte() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let via = reqwest::get(format!("{}/v1/models", proxy.url)).await.unwrap().text().await.unwrap();
    let direct = reqwest::get(format!("http://{}/v1/models", d.host_port())).await.unwrap().text().await.unwrap();
    assert_eq!(via, direct);
    let raw = r#"{"model":"tiny-qwen3",  "prompt":"Hello there!", "n":1.0}"#;
    let (status, _, text) = post_raw(&format!("{}/tokenize", proxy.url), raw, &[("x-custom", "kept")]).await;
    assert_eq!(status, 200);
    assert!(text.ends_with(&format!("\"echo\":{raw}}}")), "{text}");
    let rec = d.posts().pop().unwrap();
    assert_eq!(rec.text(), raw);
    assert_eq!(rec.header("x-custom").as_deref(), Some("kept"));
    let health = reqwest::get(format!("{}/health", proxy.url)).await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(p.posts().is_empty(), "passthrough never touches the prefill");
}

/// A passthrough route on an API path forwards the body unchanged (no P/D).
#[tokio::test(flavor = "multi_thread")]
async fn passthrough_routes_skip_pd() {
    let [p, d] = fakes(Default::default()).await;
    let conf = format!(
        "{}\n[[routes]]\nname = \"direct\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n",
        pd_config(&p, &d, "").replace(
            "paths = [\"/v1/chat/completions\", \"/v1/completions\", \"/v1/responses\", \"/v1/messages\", \"/inference/v1/generate\"]",
            "paths = [\"/v1/chat/completions\"]\nmodel = \"qwen*\""
        )
    );
    let proxy = TokenOnce::start(&conf).await;
    let body = chat_body("direct", json!({}));
    let raw = serde_json::to_vec(&body).unwrap();
    let (status, _, _) = post_raw(&format!("{}/v1/chat/completions", proxy.url), raw.clone(), &[]).await;
    assert_eq!(status, 200);
    assert!(p.posts().is_empty());
    assert_eq!(d.posts()[0].body.as_ref(), raw.as_slice());
    let series = r#"tokenonce_requests_total{api="chat",mode="passthrough",outcome="success",route="direct"}"#;
    proxy.assert_reaches(series, 1.0).await;
}

/// /readyz follows the decode's /health; /healthz is always up; /metrics has the families.
#[tokio::test(flavor = "multi_thread")]
async fn readiness_follows_the_decode_health() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    proxy.wait_ready(200).await;
    d.configure(|c| c.healthy = false);
    proxy.wait_ready(503).await;
    assert_eq!(reqwest::get(format!("{}/healthz", proxy.admin)).await.unwrap().status(), 200);
    d.configure(|c| c.healthy = true);
    proxy.wait_ready(200).await;
    post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("m", json!({})), &[]).await;
    let metrics = proxy.metrics().await;
    for family in [
        "tokenonce_requests_total",
        "tokenonce_request_duration_seconds",
        "tokenonce_stage_duration_seconds",
        "tokenonce_token_reuse_total",
        "tokenonce_upstream_errors_total",
        "tokenonce_inflight_requests",
        "tokenonce_build_info",
    ] {
        assert!(metrics.contains(&format!("# TYPE {family} ")), "{family}");
    }
    for stage in ["prefill", "handoff", "decode_first_byte", "decode_total"] {
        let series = format!(r#"tokenonce_stage_duration_seconds_count{{route="pd",stage="{stage}"}}"#);
        assert_eq!(proxy.metric(&series).await, 1.0, "{stage}");
    }
    assert_eq!(proxy.metric("tokenonce_inflight_requests").await, 0.0);
}

/// SIGHUP reloads the file: a good one changes routing for new requests and is counted; a
/// bad one is rejected, counted, and the running config keeps serving. Drives the real binary
/// end to end (startup on port 0, its own signal handling); SIGTERM then stops it cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_good_configs_and_keeps_the_old_on_bad_ones() {
    let [p, d] = fakes(Default::default()).await;
    let mut proxy = TokenOnce::start_binary(&pd_config(&p, &d, "")).await;
    reload_scenario(&p, &d, &proxy).await;
    let exit = proxy.terminate().await;
    assert!(exit.success(), "{exit}: {}", proxy.log_text());
}

/// The same scenario in-process, through the handle's direct reload (what SIGHUP calls).
#[tokio::test(flavor = "multi_thread")]
async fn direct_reload_applies_good_configs_and_keeps_the_old_on_bad_ones() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    reload_scenario(&p, &d, &proxy).await;
}

/// Good reload, then a bad one; `proxy` runs `pd_config(p, d, "")`.
async fn reload_scenario(p: &FakeVllm, d: &FakeVllm, proxy: &TokenOnce) {
    let chat = format!("{}/v1/chat/completions", proxy.url);
    post_json(&chat, &chat_body("before", json!({})), &[]).await;
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());

    proxy.reconfigure(&pd_config(p, d, "token_reuse = false"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while proxy.metric(r#"tokenonce_config_reloads_total{result="success"}"#).await < 1.0 {
        assert!(std::time::Instant::now() < deadline, "no reload: {}", proxy.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    post_json(&chat, &chat_body("after", json!({})), &[]).await;
    assert!(d.posts()[1].json().get("kv_transfer_params").is_none(), "reuse is off after the reload");

    proxy.reconfigure("[pools.decode]\nendpoints = [\"not a host\"]\n");
    while proxy.metric(r#"tokenonce_config_reloads_total{result="failure"}"#).await < 1.0 {
        assert!(std::time::Instant::now() < deadline, "bad reload not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, _) = post_json(&chat, &chat_body("still", json!({})), &[]).await;
    assert_eq!(status, 200, "the previous config keeps serving");
    assert!(d.posts()[2].json().get("kv_transfer_params").is_none());
}

/// GET /drain (a preStop hook) with the admin token makes /readyz answer 503 while the
/// process keeps serving; `wait_seconds` holds the hook that long. Without the token, or with
/// a wrong one, /drain is refused and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn drain_fails_readiness_but_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "s3cret-admin-token-0123\n").unwrap();
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let settings =
        Settings { server_extra: format!("admin_token_file = \"{}\"\n", token_file.display()), ..Settings::default() };
    let proxy = TokenOnce::start_with(&pd_config(&p, &d, ""), &settings).await;
    proxy.wait_ready(200).await;
    let client = reqwest::Client::new();
    let drain = format!("{}/drain?wait_seconds=1", proxy.admin);
    for auth in [None, Some("Bearer wrong-token-0123456789"), Some("s3cret-admin-token-0123")] {
        let mut req = client.get(&drain);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        assert_eq!(req.send().await.unwrap().status(), 403, "{auth:?}");
    }
    assert_eq!(reqwest::get(format!("{}/readyz", proxy.admin)).await.unwrap().status(), 200, "nothing changed");

    let started = std::time::Instant::now();
    let resp = client.get(&drain).header("authorization", "Bearer s3cret-admin-token-0123").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(900), "the hook is held for wait_seconds");
    assert_eq!(reqwest::get(format!("{}/readyz", proxy.admin)).await.unwrap().status(), 503);
    assert_eq!(reqwest::get(format!("{}/healthz", proxy.admin)).await.unwrap().status(), 200);
    let (status, _, _) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("draining", json!({})), &[]).await;
    assert_eq!(status, 200, "in-flight and late requests are still served");
}

/// Without `server.admin_token_file`, state-changing admin endpoints are off.
#[tokio::test(flavor = "multi_thread")]
async fn drain_is_off_without_an_admin_token() {
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    proxy.wait_ready(200).await;
    let resp = reqwest::Client::new()
        .get(format!("{}/drain", proxy.admin))
        .header("authorization", "Bearer anything-at-all-0123")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(reqwest::get(format!("{}/readyz", proxy.admin)).await.unwrap().status(), 200);
}

/// The in-process handle (`server::start` on listeners the caller bound to port 0): a graceful
/// stop closes the client listener at once, lets a stream already in flight finish, and
/// `wait` returns after the grace period.
#[tokio::test(flavor = "multi_thread")]
async fn graceful_stop_closes_listeners_and_finishes_in_flight_streams() {
    use tokenonce::server::{self, Listeners, Signals, Stop};
    let p = FakeVllm::start(FakeConfig::default()).await;
    let d = FakeVllm::start(FakeConfig { chunk_delay: Duration::from_millis(100), ..FakeConfig::default() }).await;
    let text = format!(
        "[server]\ngrace_period_seconds = 1\ngraceful_shutdown_timeout_seconds = 1\n\n{}",
        pd_config(&p, &d, "")
    );
    let config = tokenonce::config::from_toml(&text, "test").unwrap();
    let running =
        server::start(config, None, Listeners::bind("127.0.0.1:0", "127.0.0.1:0").unwrap(), Signals::HandleOnly)
            .unwrap();
    let addr = running.client_addr();
    assert_ne!(addr.port(), 0);
    let mut stream = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&chat_body("in flight", json!({"stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut text = String::from_utf8(stream.chunk().await.unwrap().unwrap().to_vec()).unwrap();

    running.stop(Stop::Graceful);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(std::time::Instant::now() < deadline, "the client listener still accepts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while let Some(chunk) = stream.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let stopped = tokio::time::timeout(Duration::from_secs(10), tokio::task::spawn_blocking(move || running.wait()));
    stopped.await.expect("stopped within grace + timeout").unwrap().unwrap();
}

const RELOADED: &str = r#"tokenonce_config_reloads_total{result="success"}"#;

/// A config for route `pd` over prefill engine `prefill` and decode engine `decode`.
fn over_fault_engines(prefill: &FaultEngine, decode: &FaultEngine, route_extra: &str) -> String {
    pools_config(&[prefill.host_port()], &[decode.host_port()], route_extra)
}

/// A config reload while a stream is relayed: the stream finishes whole from the engine it
/// started on (no error, every event), the next request goes where the new config says. The
/// engines are fault engines (`tests/support/fault_engine.rs`) passing everything, which
/// tell how each exchange ended.
async fn reload_mid_stream(binary: bool) {
    let slow = FakeConfig { chunk_delay: Duration::from_millis(150), ..FakeConfig::default() };
    let [pf, df1, df2] = fakes([FakeConfig::default(), slow, FakeConfig::default()]).await;
    let (p, d1, d2) = (FaultEngine::start(&pf).await, FaultEngine::start(&df1).await, FaultEngine::start(&df2).await);
    let proxy = if binary {
        TokenOnce::start_binary(&over_fault_engines(&p, &d1, "")).await
    } else {
        TokenOnce::start(&over_fault_engines(&p, &d1, "")).await
    };
    let started = Instant::now();
    let body = chat_body("a long answer", json!({"stream": true, "max_tokens": 10}));
    let resp =
        reqwest::Client::new().post(format!("{}/v1/chat/completions", proxy.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    let first = futures_util::StreamExt::next(&mut stream).await.unwrap().unwrap();
    text.push_str(&String::from_utf8_lossy(&first));

    proxy.reconfigure(&over_fault_engines(&p, &d2, "token_reuse = false\n"));
    assert_eq!(proxy.metric_reaches(RELOADED, 1.0).await, 1.0, "{}", proxy.log_text());
    let rest = tokio::time::timeout(Duration::from_secs(10), async {
        let mut rest = String::new();
        while let Some(chunk) = futures_util::StreamExt::next(&mut stream).await {
            rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
        rest
    })
    .await
    .expect("the stream ends within 10 s");
    text.push_str(&rest);
    assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\""), "{text}");
    assert_eq!(whole_events(&text).len(), 11, "role delta and 10 tokens: {text}");
    assert_eq!(d1.ended(End::Answered), 1, "the stream ran to its end on the old decode");

    let body = chat_body("after the reload", json!({}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!((d1.posts().len(), d2.posts().len()), (1, 1), "new requests follow the new config");
    assert!(d2.posts()[0].json().get("kv_transfer_params").is_none(), "and its token_reuse = false");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// `Running::reload` (what SIGHUP calls) in the middle of a stream.
#[tokio::test(flavor = "multi_thread")]
async fn reload_mid_stream_keeps_the_stream() {
    reload_mid_stream(false).await;
}

/// SIGHUP to the tokenonce binary in the middle of a stream.
#[tokio::test(flavor = "multi_thread")]
async fn sighup_mid_stream_keeps_the_stream() {
    reload_mid_stream(true).await;
}
