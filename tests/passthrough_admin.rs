//! Everything that is not orchestrated: byte-for-byte passthrough, the admin listener
//! (`/metrics`, `/healthz`, `/readyz`), config reloads (a good file applied, a bad one
//! refused, a stream in flight finished on the config it started with), and stopping (the
//! binary on SIGTERM, the in-process handle).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

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

/// GET /metrics on the client listener is the decode engine's, not tokenonce's: it matches no
/// route and passes to the engine, which is how the Kubernetes PodMonitor `vllm` scrapes an
/// engine listening on loopback only (conf/k8s/base/monitoring.yaml). tokenonce's own series
/// stay on the admin listener.
#[tokio::test(flavor = "multi_thread")]
async fn client_listener_metrics_are_the_decode_engines() {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    d.forget();
    let via = reqwest::get(format!("{}/metrics", proxy.url)).await.unwrap();
    let direct = reqwest::get(format!("http://{}/metrics", d.host_port())).await.unwrap();
    assert_eq!(via.status(), direct.status());
    let (via, direct) = (via.text().await.unwrap(), direct.text().await.unwrap());
    assert_eq!(via, direct, "the engine's answer, unchanged");
    assert!(!via.contains("tokenonce_build_info"), "{via}");
    // The health round's own reads of the engine's pressure aside.
    let scrapes = d
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path == "/metrics")
        .filter(|r| r.headers.get("x-request-id").is_none_or(|id| id != "tokenonce-health"))
        .count();
    assert_eq!(scrapes, 2, "both reached the engine: through tokenonce and directly");
    assert!(proxy.metrics().await.contains("tokenonce_build_info"), "tokenonce's own on the admin listener");
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
    let mut proxy = TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &pd_config(&p, &d, "")).await;
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
        TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &over_fault_engines(&p, &d1, "")).await
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

// ---------------------------------------------------------------------------------------------
// Reload without a shell: POST /admin/reload and the config file watch
// ---------------------------------------------------------------------------------------------

const ADMIN_TOKEN: &str = "s3cret-admin-token-0123";
const APPLIED: &str = r#"tokenonce_config_reloads_total{result="success"}"#;
const REJECTED: &str = r#"tokenonce_config_reloads_total{result="failure"}"#;
const LAST_OK: &str = "tokenonce_config_last_reload_success";

/// tokenonce in-process on `pd_config(p, d, "")` with an admin token; the token file's directory.
async fn with_admin_token(p: &FakeVllm, d: &FakeVllm) -> (TokenOnce, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN_TOKEN}\n")).unwrap();
    let settings =
        Settings { server_extra: format!("admin_token_file = \"{}\"\n", token_file.display()), ..Settings::default() };
    (TokenOnce::start_with(&pd_config(p, d, ""), &settings).await, dir)
}

/// `POST /admin/reload` with `authorization` (none: no header): status and body.
async fn admin_reload(admin: &str, authorization: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().post(format!("{admin}/admin/reload"));
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// Whether the decode's `n`th request (from 0) carried the prefill's ids.
fn reused(d: &FakeVllm, n: usize) -> bool {
    d.posts()[n].json().get("kv_transfer_params").is_some()
}

/// POST /admin/reload with the admin token reloads the file as SIGHUP does (a route change is
/// visible on the next request) and answers `{"applied": true}`, naming the settings that
/// wait for a restart; without the token, with a wrong one, or with another method it is
/// refused and nothing is reloaded.
#[tokio::test(flavor = "multi_thread")]
async fn admin_reload_applies_a_good_file_and_needs_the_token() {
    let [p, d] = fakes(Default::default()).await;
    let (proxy, _token) = with_admin_token(&p, &d).await;
    let chat = format!("{}/v1/chat/completions", proxy.url);
    post_json(&chat, &chat_body("before", json!({})), &[]).await;
    assert!(reused(&d, 0));

    proxy.rewrite(&pd_config(&p, &d, "token_reuse = false"));
    for auth in [None, Some("Bearer wrong-token-0123456789"), Some(ADMIN_TOKEN)] {
        let (status, body) = admin_reload(&proxy.admin, auth).await;
        assert_eq!(status, 403, "{auth:?}: {body}");
        assert!(body.contains("admin_token_file"), "{body}");
    }
    let get = reqwest::Client::new()
        .get(format!("{}/admin/reload", proxy.admin))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 405);
    assert_eq!(get.headers()["allow"], "POST");
    assert_eq!(proxy.metric(APPLIED).await + proxy.metric(REJECTED).await, 0.0, "nothing was reloaded");
    post_json(&chat, &chat_body("still before", json!({})), &[]).await;
    assert!(reused(&d, 1), "the old config runs");

    let (status, body) = admin_reload(&proxy.admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer, json!({"applied": true, "restart_needed": []}));
    assert_eq!(proxy.metric(APPLIED).await, 1.0);
    assert_eq!(proxy.metric(LAST_OK).await, 1.0);
    post_json(&chat, &chat_body("after", json!({})), &[]).await;
    assert!(!reused(&d, 2), "reuse is off after the reload");

    // A setting fixed at start is applied at the next start only, and the answer says so.
    proxy.rewrite(&format!("[cache]\nttl_ms = 7000\n\n{}", pd_config(&p, &d, "token_reuse = false")));
    let (status, body) = admin_reload(&proxy.admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""restart_needed":["cache.ttl_ms"]"#), "{body}");
}

/// POST /admin/reload of a bad file: 422 with every problem as `tokenonce check` prints it, the
/// running config kept, counted, and the last-result gauge 0 until a good file is applied.
#[tokio::test(flavor = "multi_thread")]
async fn admin_reload_of_a_bad_file_keeps_the_running_config_and_lists_its_problems() {
    let [p, d] = fakes(Default::default()).await;
    let (proxy, _token) = with_admin_token(&p, &d).await;
    let before = proxy.metric("tokenonce_config_last_reload_timestamp_seconds").await;
    assert!(before > 1.0e9, "the start counts as the first load: {before}");
    assert_eq!(proxy.metric(LAST_OK).await, 1.0);

    let bad = pd_config(&p, &d, "token_reuse = false\nprefill_timeout_ms = \"soon\"")
        .replace(&format!("endpoints = [\"{}\"]", d.host_port()), "endpoints = [\"not a host\"]");
    proxy.rewrite(&bad);
    let (status, body) = admin_reload(&proxy.admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(status, 422, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["applied"], false);
    let problems: Vec<&str> = answer["problems"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert_eq!(problems.len(), 2, "{body}");
    assert!(problems.iter().any(|p| p.contains(": pools.decode.endpoints") && p.contains("not a host")), "{body}");
    assert!(problems.iter().any(|p| p.contains("prefill_timeout_ms") && p.contains("soon")), "{body}");
    assert!(problems.iter().all(|p| p.starts_with(&format!("{}:", proxy.config_path().display()))), "{body}");
    assert_eq!(proxy.metric(REJECTED).await, 1.0);
    assert_eq!(proxy.metric(LAST_OK).await, 0.0);
    assert!(proxy.metric("tokenonce_config_last_reload_timestamp_seconds").await >= before);

    let (status, _, _) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("kept", json!({})), &[]).await;
    assert_eq!(status, 200, "the previous config keeps serving");
    assert!(reused(&d, 0), "with its token_reuse");

    proxy.rewrite(&pd_config(&p, &d, ""));
    assert_eq!(admin_reload(&proxy.admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await.0, 200);
    assert_eq!(proxy.metric(LAST_OK).await, 1.0);
}

/// Without `server.admin_token_file` POST /admin/reload is off (403), as /drain is.
#[tokio::test(flavor = "multi_thread")]
async fn admin_reload_is_off_without_an_admin_token() {
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let (status, _) = admin_reload(&proxy.admin, Some("Bearer anything-at-all-0123")).await;
    assert_eq!(status, 403);
    assert_eq!(proxy.metric(APPLIED).await + proxy.metric(REJECTED).await, 0.0);
}

/// On a config that came from no file (the embedded default) a reload is refused with a
/// message that says so: POST /admin/reload answers 409, the handle's reload an error.
#[tokio::test(flavor = "multi_thread")]
async fn admin_reload_on_the_embedded_default_is_refused() {
    use tokenonce::server::{self, Listeners, Signals};
    let [p, d] = fakes(Default::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, ADMIN_TOKEN).unwrap();
    let text = format!("[server]\nadmin_token_file = \"{}\"\n\n{}", token_file.display(), pd_config(&p, &d, ""));
    let loaded = tokenonce::config::from_toml(&text, "<embedded default>").unwrap();
    let listeners = Listeners::bind("127.0.0.1:0", "127.0.0.1:0").unwrap();
    let running = server::start(loaded, None, listeners, Signals::HandleOnly).unwrap();
    let admin = format!("http://{}", running.admin_addr());
    let (status, body) = admin_reload(&admin, Some(&format!("Bearer {ADMIN_TOKEN}"))).await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("embedded default") && body.contains("--config FILE"), "{body}");
    let refused = running.try_reload().unwrap_err();
    assert!(matches!(refused, tokenonce::reload::Refused::NoFile), "{refused}");
}

/// A Kubernetes ConfigMap volume: `DIR/config.toml -> ..data/config.toml`, `..data -> ..TS`;
/// an update writes a new `..TS` directory and swaps `..data` to it with a rename.
struct ConfigMap {
    dir: tempfile::TempDir,
    versions: usize,
}

impl ConfigMap {
    /// The volume with its first version holding `text`.
    fn new(text: &str) -> Self {
        let mut map = Self { dir: tempfile::tempdir().unwrap(), versions: 0 };
        map.publish(text);
        map
    }

    /// The path tokenonce is given.
    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("config.toml")
    }

    /// A new version holding `text`, put in place as the kubelet does: a new timestamped
    /// directory, a temporary `..data_tmp` symlink to it renamed over `..data` (atomic), the
    /// old directory removed.
    fn publish(&mut self, text: &str) {
        let root = self.dir.path();
        self.versions += 1;
        let version = format!("..2026_12_03_10_00_{:02}.{}", self.versions, std::process::id());
        std::fs::create_dir(root.join(&version)).unwrap();
        std::fs::write(root.join(&version).join("config.toml"), text).unwrap();
        let old = std::fs::read_link(root.join("..data")).ok();
        std::os::unix::fs::symlink(&version, root.join("..data_tmp")).unwrap();
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
        if !root.join("config.toml").exists() {
            std::os::unix::fs::symlink("..data/config.toml", root.join("config.toml")).unwrap();
        }
        if let Some(old) = old {
            std::fs::remove_dir_all(root.join(old)).unwrap();
        }
    }
}

/// tokenonce in-process on the file `path`, as the binary runs it (the file watch included).
struct Watched {
    running: tokenonce::server::Running,
    url: String,
    admin: String,
}

impl Watched {
    fn start(path: &std::path::Path) -> Self {
        use tokenonce::server::{self, Listeners, Signals};
        let loaded = tokenonce::config::load(path).unwrap();
        let running = server::start(
            loaded,
            Some(path.to_path_buf()),
            Listeners::bind("127.0.0.1:0", "127.0.0.1:0").unwrap(),
            Signals::HandleOnly,
        )
        .unwrap();
        let (url, admin) = (format!("http://{}", running.client_addr()), format!("http://{}", running.admin_addr()));
        Self { running, url, admin }
    }

    async fn metric(&self, series: &str) -> f64 {
        support::metrics::sample(&support::metrics::scrape(&self.admin).await, series)
    }

    /// Waits (bounded: 5 s) until `series` reads `value`.
    async fn reaches(&self, series: &str, value: f64) {
        let got = support::metrics::reaches_within(&self.admin, series, value, Duration::from_secs(5)).await;
        assert_eq!(got, value, "{series}");
    }

    async fn chat(&self, user: &str) -> u16 {
        post_chat(&self.url, user, json!({}), &[]).await.0
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.running.stop(tokenonce::server::Stop::Fast);
    }
}

/// The `[server]` lines of a watched file: loopback on port 0, the watch every 100 ms.
const WATCHED: &str = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ngrace_period_seconds = 1\ngraceful_shutdown_timeout_seconds = 1\nconfig_watch_interval_ms = 100\n\n";

/// With `server.config_watch_interval_ms`, a ConfigMap update (the `..data` symlink swapped to
/// a new directory, which an inotify watch on the file misses) is reloaded as SIGHUP would,
/// and so is a rewrite of the file in place; an unchanged file is not reloaded again.
#[tokio::test(flavor = "multi_thread")]
async fn the_watch_follows_a_configmap_symlink_swap_and_a_rewrite_in_place() {
    let [p, d] = fakes(Default::default()).await;
    let mut map = ConfigMap::new(&format!("{WATCHED}{}", pd_config(&p, &d, "")));
    let proxy = Watched::start(&map.path());
    assert_eq!(proxy.chat("before").await, 200);
    assert!(reused(&d, 0));

    map.publish(&format!("{WATCHED}{}", pd_config(&p, &d, "token_reuse = false")));
    proxy.reaches(APPLIED, 1.0).await;
    assert_eq!(proxy.chat("after the swap").await, 200);
    assert!(!reused(&d, 1), "the swapped-in file runs");

    std::fs::write(map.path(), format!("{WATCHED}{}", pd_config(&p, &d, ""))).unwrap();
    proxy.reaches(APPLIED, 2.0).await;
    assert_eq!(proxy.chat("after the rewrite").await, 200);
    assert!(reused(&d, 2), "the rewritten file runs");

    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(proxy.metric(APPLIED).await, 2.0, "an unchanged file is not reloaded again");
    assert_eq!(proxy.metric(REJECTED).await, 0.0);
    assert_eq!(proxy.metric(LAST_OK).await, 1.0);
}

/// A bad file seen by the watch is rejected once (counted, the last-result gauge 0) and the
/// running config keeps serving; it is not tried again until the file changes, and a good
/// file then applies.
#[tokio::test(flavor = "multi_thread")]
async fn a_bad_file_via_the_watch_keeps_the_running_config_until_it_changes() {
    let [p, d] = fakes(Default::default()).await;
    let mut map = ConfigMap::new(&format!("{WATCHED}{}", pd_config(&p, &d, "")));
    let proxy = Watched::start(&map.path());

    map.publish(&format!("{WATCHED}[pools.decode]\nendpoints = [\"not a host\"]\n"));
    proxy.reaches(REJECTED, 1.0).await;
    assert_eq!(proxy.metric(LAST_OK).await, 0.0);
    assert_eq!(proxy.chat("kept").await, 200, "the previous config keeps serving");
    assert!(reused(&d, 0));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(proxy.metric(REJECTED).await, 1.0, "a bad file is tried once");

    map.publish(&format!("{WATCHED}{}", pd_config(&p, &d, "token_reuse = false")));
    proxy.reaches(APPLIED, 1.0).await;
    assert_eq!(proxy.metric(LAST_OK).await, 1.0);
    assert_eq!(proxy.chat("fixed").await, 200);
    assert!(!reused(&d, 1), "the good file runs");
}
