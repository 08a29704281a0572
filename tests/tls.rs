//! TLS on every hop, with certificates the tests make (rcgen): the client TLS listener beside
//! the plain one (and its certificate swapped by a reload), pools whose engines speak TLS (a
//! good chain, a wrong CA, a wrong name, mTLS with and without the client certificate) on
//! orchestrated legs and passthrough, and `tokenonce check` on the new keys.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::net::SocketAddr;
use std::path::Path;

use serde_json::{json, Value};
use support::tls::{Issued, Pki, TlsFront};
use support::*;

/// `[server.tls]` lines serving `id`.
fn server_tls(id: &Issued) -> String {
    format!(
        "\n[server.tls]\nlisten = \"127.0.0.1:0\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        id.cert.display(),
        id.key.display()
    )
}

/// A client that trusts only `ca` and finds `name` at `addr`.
fn https_client(ca: &Path, name: &str, addr: SocketAddr) -> reqwest::Client {
    let pem = std::fs::read(ca).unwrap();
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&pem).unwrap()])
        .resolve(name, addr)
        .tls_info(true)
        .build()
        .unwrap()
}

/// The DER of the first certificate in a PEM file.
fn der_of(pem_file: &Path) -> Vec<u8> {
    let pem = std::fs::read(pem_file).unwrap();
    pingora::tls::x509::X509::from_pem(&pem).unwrap().to_der().unwrap()
}

/// The client TLS listener serves the API (orchestrated) beside the plain listener, which
/// keeps working; a client that does not trust the CA is refused.
#[tokio::test(flavor = "multi_thread")]
async fn tls_listener_serves_beside_the_plain_one() {
    let pki = Pki::new("edge");
    let id = pki.issue("tokenonce", &["tokenonce.test"]);
    let [p, d] = fakes(Default::default()).await;
    let proxy = TokenOnce::start(&format!("{}{}", pd_config(&p, &d, ""), server_tls(&id))).await;
    let tls_addr = proxy.tls_addr.expect("a TLS listener");
    let https = https_client(&pki.ca_file(), "tokenonce.test", tls_addr);
    let url = format!("https://tokenonce.test:{}/v1/chat/completions", tls_addr.port());
    let resp = https.post(&url).json(&chat_body("over tls", json!({}))).send().await.unwrap();
    let peer = resp.extensions().get::<reqwest::tls::TlsInfo>().and_then(|i| i.peer_certificate().map(<[u8]>::to_vec));
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    // the answer itself (thinking on: the qwen3 reasoning parser puts it in `reasoning`)
    assert!(body["choices"][0]["message"]["reasoning"].is_string(), "{body}");
    assert_eq!(peer, Some(der_of(&id.cert)), "the configured certificate is served");
    assert_eq!(d.posts().len(), 1);
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array(), "reuse as over plain HTTP");

    let (status, _, _) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("plain", json!({})), &[]).await;
    assert_eq!(status, 200, "the plain listener still serves");
    let passthrough = https.get(format!("https://tokenonce.test:{}/v1/models", tls_addr.port())).send().await.unwrap();
    assert_eq!(passthrough.status(), 200, "passthrough over the TLS listener");

    let stranger = https_client(&Pki::new("other").ca_file(), "tokenonce.test", tls_addr);
    let refused = stranger.post(&url).json(&chat_body("x", json!({}))).send().await;
    assert!(refused.is_err_and(|e| e.is_connect()), "a client that does not trust the CA never gets an answer");
}

/// A reload (SIGHUP's code path) reads the certificate files again: new handshakes get the
/// new certificate; a reload whose key does not fit keeps the old one.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_swaps_the_listener_certificate() {
    let pki = Pki::new("edge");
    let first = pki.issue("tokenonce", &["tokenonce.test"]);
    let [p, d] = fakes(Default::default()).await;
    let config = format!("{}{}", pd_config(&p, &d, ""), server_tls(&first));
    let proxy = TokenOnce::start(&config).await;
    let addr = proxy.tls_addr.unwrap();
    let served = || async {
        // A new client each time: a pooled connection would keep the old handshake.
        let client = https_client(&pki.ca_file(), "tokenonce.test", addr);
        let resp = client.get(format!("https://tokenonce.test:{}/v1/models", addr.port())).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.extensions().get::<reqwest::tls::TlsInfo>().unwrap().peer_certificate().unwrap().to_vec()
    };
    let before = served().await;
    assert_eq!(before, der_of(&first.cert));

    let second = pki.issue("renewed", &["tokenonce.test"]);
    std::fs::copy(&second.cert, &first.cert).unwrap();
    std::fs::copy(&second.key, &first.key).unwrap();
    proxy.reconfigure(&config);
    assert_eq!(proxy.metric("tokenonce_config_reloads_total{result=\"success\"}").await, 1.0);
    let after = served().await;
    assert_eq!(after, der_of(&second.cert), "the renewed certificate is served after the reload");
    assert_ne!(after, before);

    // A key that does not belong to the certificate: rejected, the running one stays.
    let third = pki.issue("third", &["tokenonce.test"]);
    std::fs::copy(&third.cert, &first.cert).unwrap();
    proxy.reconfigure(&config);
    assert_eq!(proxy.metric("tokenonce_config_reloads_total{result=\"failure\"}").await, 1.0);
    assert_eq!(served().await, der_of(&second.cert));
}

/// Prefill and decode engines behind TLS fronts; `pool_tls` is the `[pools.X.tls]` body
/// (the same for both pools). Returns the fakes, the fronts and tokenonce.
async fn tls_pools(
    pki: &Pki,
    client_ca: Option<&Path>,
    pool_tls: &str,
) -> (FakeVllm, FakeVllm, TlsFront, TlsFront, TokenOnce) {
    tls_pools_with(pki, client_ca, pool_tls, FakeConfig::default()).await
}

/// [`tls_pools`] with the prefill engine's own behaviour.
async fn tls_pools_with(
    pki: &Pki,
    client_ca: Option<&Path>,
    pool_tls: &str,
    prefill: FakeConfig,
) -> (FakeVllm, FakeVllm, TlsFront, TlsFront, TokenOnce) {
    let id = pki.issue("engine", &["engine.test"]);
    let p = FakeVllm::start(prefill).await;
    let d = FakeVllm::start(FakeConfig::default()).await;
    let pf = TlsFront::start(p.addr, &id, client_ca).await;
    let df = TlsFront::start(d.addr, &id, client_ca).await;
    let config = format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\n[pools.prefill.tls]\n{pool_tls}\n\n[pools.decode]\nendpoints = [\"{}\"]\n[pools.decode.tls]\n{pool_tls}\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n",
        pf.addr, df.addr
    );
    let proxy = TokenOnce::start(&config).await;
    (p, d, pf, df, proxy)
}

fn ca_line(ca: &Path, name: &str) -> String {
    format!("ca_file = \"{}\"\nserver_name = \"{name}\"\n", ca.display())
}

/// A good chain: both legs, passthrough and the health polls go over TLS; reuse works.
#[tokio::test(flavor = "multi_thread")]
async fn pools_over_tls_with_a_good_chain() {
    let pki = Pki::new("cluster");
    let (p, d, pf, df, proxy) = tls_pools(&pki, None, &ca_line(&pki.ca_file(), "engine.test")).await;
    proxy.wait_ready(200).await;
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("tls legs", json!({})), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts().len(), 1);
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());
    let series = r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#;
    proxy.assert_reaches(series, 1.0).await;
    let models = reqwest::get(format!("{}/v1/models", proxy.url)).await.unwrap();
    assert_eq!(models.status(), 200, "passthrough over TLS");
    assert!(pf.accepted() >= 1 && df.accepted() >= 1, "both engines were reached over TLS");
    assert_eq!(pf.refused() + df.refused(), 0);
}

/// The poller's `GET /version` and `GET /v1/models` go over the pool's TLS too: engines behind
/// TLS that serve different models (another context length) are seen to differ, and the route
/// exchanges no ids.
#[tokio::test(flavor = "multi_thread")]
async fn model_identity_is_learned_over_tls() {
    let pki = Pki::new("cluster");
    let other_model = FakeConfig { max_model_len: 32768, ..FakeConfig::default() };
    let (p, d, _pf, _df, proxy) =
        tls_pools_with(&pki, None, &ca_line(&pki.ca_file(), "engine.test"), other_model).await;
    proxy.wait_ready(200).await;
    let differ = r#"tokenonce_pool_models_differ{route="pd"}"#;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while proxy.metric(differ).await != 1.0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(proxy.metric(differ).await, 1.0, "the models were read over TLS");
    for (engine, name) in [(&p, "prefill"), (&d, "decode")] {
        let paths: Vec<String> = engine.requests().into_iter().filter(|r| r.method == "GET").map(|r| r.path).collect();
        assert!(paths.iter().any(|p| p == "/v1/models") && paths.iter().any(|p| p == "/version"), "{name}: {paths:?}");
    }
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("tls models", json!({})), &[]).await;
    assert_eq!(status, 200, "{text}");
    let series = r#"tokenonce_token_reuse_total{reason="model_mismatch",result="fallback",route="pd"}"#;
    proxy.assert_reaches(series, 1.0).await;
}

/// The typed 502 of a refused engine certificate: OpenAI-shaped, the stage and the cause,
/// no address; counted as `kind="tls"`, never re-sent.
async fn assert_tls_refused(proxy: &TokenOnce, front: &TlsFront, cause: &str) {
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &[]).await;
    assert_eq!(status, 502, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "prefill_unavailable", "{text}");
    assert_eq!(body["error"]["type"], "upstream_error", "{text}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(cause), "{message}");
    assert!(!text.contains("127.0.0.1") && !text.contains(&front.addr.port().to_string()), "{text}");
    let series = r#"tokenonce_upstream_errors_total{kind="tls",stage="prefill"}"#;
    assert!(proxy.metric(series).await >= 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_upstream_retries_total{stage="prefill"}"#).await, 0.0);
    let (status, _, text) = post_raw(&format!("{}/v1/models", proxy.url), "", &[]).await;
    assert_eq!(status, 502, "passthrough: {text}");
    assert!(text.contains("decode_unavailable") && !text.contains("127.0.0.1"), "{text}");
}

/// An engine certificate from another CA is not trusted.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_is_a_typed_502() {
    let pki = Pki::new("cluster");
    let other = Pki::new("other");
    let (p, _d, pf, _df, proxy) = tls_pools(&pki, None, &ca_line(&other.ca_file(), "engine.test")).await;
    assert_tls_refused(&proxy, &pf, "engine certificate not trusted").await;
    assert!(p.posts().is_empty(), "nothing reached the engine");
    proxy.wait_ready(503).await;
}

/// A certificate for another name is not trusted.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_name_is_a_typed_502() {
    let pki = Pki::new("cluster");
    let (p, _d, pf, _df, proxy) = tls_pools(&pki, None, &ca_line(&pki.ca_file(), "not-the-engine.test")).await;
    assert_tls_refused(&proxy, &pf, "engine certificate not trusted").await;
    assert!(p.posts().is_empty());
}

/// Engines that require a client certificate: served with `cert_file`/`key_file`, refused
/// (502, the handshake counted as refused at the engine) without.
#[tokio::test(flavor = "multi_thread")]
async fn mtls_needs_the_client_certificate() {
    let pki = Pki::new("cluster");
    let client = pki.issue("tokenonce-client", &["tokenonce.client"]);
    let with_cert = format!(
        "{}cert_file = \"{}\"\nkey_file = \"{}\"\n",
        ca_line(&pki.ca_file(), "engine.test"),
        client.cert.display(),
        client.key.display()
    );
    let (_p, d, pf, _df, proxy) = tls_pools(&pki, Some(&pki.ca_file()), &with_cert).await;
    proxy.wait_ready(200).await;
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("mtls", json!({})), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(d.posts().len(), 1);
    assert_eq!(pf.refused(), 0);
    drop(proxy);

    let (p, _d, pf, _df, proxy) = tls_pools(&pki, Some(&pki.ca_file()), &ca_line(&pki.ca_file(), "engine.test")).await;
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &[]).await;
    assert_eq!(status, 502, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "prefill_unavailable", "{text}");
    assert!(!text.contains("127.0.0.1"), "{text}");
    assert!(pf.refused() >= 1, "the engine refused the handshake without a client certificate");
    assert!(p.posts().is_empty());
}

/// `tokenonce check` reports every bad TLS key with its place.
#[test]
fn check_reports_bad_tls_keys() {
    let pki = Pki::new("cluster");
    let id = pki.issue("engine", &["engine.test"]);
    let other = pki.issue("other", &["other.test"]);
    let text = format!(
        r#"
[server.tls]
listen = "127.0.0.1:8443"
cert_file = "{cert}"
key_file = "{other_key}"

[pools.decode]
endpoints = ["127.0.0.1:8200"]
[pools.decode.tls]
ca_file = "/nonexistent/ca.pem"

[pools.prefill]
endpoints = ["prefill.test:8100"]
[pools.prefill.tls]
cert_file = "{cert}"
"#,
        cert = id.cert.display(),
        other_key = other.key.display()
    );
    let err = tokenonce::config::from_toml(&text, "t.toml").unwrap_err();
    let got: Vec<(String, String)> = err.problems.iter().map(|p| (p.key.clone(), p.message.clone())).collect();
    let has = |key: &str, words: &str| got.iter().any(|(k, m)| k == key && m.contains(words));
    assert!(has("server.tls.cert_file", "does not belong"), "{got:#?}");
    assert!(has("pools.decode.tls.ca_file", "cannot read `/nonexistent/ca.pem`"), "{got:#?}");
    assert!(has("pools.prefill.tls.cert_file", "go together"), "{got:#?}");
    assert!(has("pools.decode.tls.server_name", "IP address"), "{got:#?}");
    assert!(err.problems.iter().all(|p| p.line > 0), "each at its place: {got:#?}");

    let missing = "[server.tls]\nlisten = \"127.0.0.1:8443\"\n[pools.decode]\nendpoints = [\"e:1\"]\n";
    let err = tokenonce::config::from_toml(missing, "t.toml").unwrap_err();
    assert_problem_keys(&err, &["server.tls.cert_file", "server.tls.key_file"]);
}

/// The `tokenonce check` command itself (what an operator runs) fails on files that do not
/// exist behind the TLS keys and on a sampling ratio out of range, naming each key at its line.
#[test]
fn check_command_reports_missing_files_and_a_ratio_out_of_range() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        r#"[server.tls]
listen = "127.0.0.1:8443"
cert_file = "/nonexistent/server.pem"
key_file = "/nonexistent/server.key"

[pools.decode]
endpoints = ["engine.test:8200"]
[pools.decode.tls]
ca_file = "/nonexistent/ca.pem"
cert_file = "/nonexistent/client.pem"
key_file = "/nonexistent/client.key"

[tracing]
endpoint = "http://127.0.0.1:4318/v1/traces"
sampling_ratio = -0.5
"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenonce")).arg("check").arg(&file).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for (line, key, words) in [
        (3, "server.tls.cert_file", "/nonexistent/server.pem"),
        (4, "server.tls.key_file", "/nonexistent/server.key"),
        (9, "pools.decode.tls.ca_file", "cannot read `/nonexistent/ca.pem`"),
        (10, "pools.decode.tls.cert_file", "/nonexistent/client.pem"),
        (11, "pools.decode.tls.key_file", "/nonexistent/client.key"),
        (15, "tracing.sampling_ratio", "-0.5 is not between 0.0 and 1.0"),
    ] {
        let found =
            err.lines().any(|l| l.contains(&format!("bad.toml:{line}:")) && l.contains(key) && l.contains(words));
        assert!(found, "no `{key}` problem at line {line} mentioning {words:?} in:\n{err}");
    }
}

/// `[pools.NAME]` with one endpoint `addr` behind TLS trusting `ca` for `engine.test`.
fn tls_pool(name: &str, addr: SocketAddr, ca: &Path) -> String {
    format!("[pools.{name}]\nendpoints = [\"{addr}\"]\n[pools.{name}.tls]\n{}\n", ca_line(ca, "engine.test"))
}

/// A passthrough chat to `proxy`, with `x-tenant: tenant` when given.
async fn tenant_chat(proxy: &TokenOnce, tenant: Option<&str>) -> (u16, String) {
    let headers: Vec<(&str, &str)> = tenant.map(|t| ("x-tenant", t)).into_iter().collect();
    proxy.chat_with("trust", json!({}), &headers).await
}

/// Asserts a passthrough answer is the typed 502 of an untrusted engine certificate.
fn assert_untrusted(status: u16, text: &str, front: &TlsFront) {
    assert_eq!(status, 502, "{text}");
    let body: Value = serde_json::from_str(text).unwrap();
    assert_eq!(body["error"]["code"], "decode_unavailable", "{text}");
    assert!(body["error"]["message"].as_str().unwrap().contains("engine certificate not trusted"), "{text}");
    assert!(!text.contains("127.0.0.1") && !text.contains(&front.addr.port().to_string()), "{text}");
}

const TLS_ERRORS: &str = r#"tokenonce_upstream_errors_total{kind="tls",stage="passthrough"}"#;

/// Two pools name one engine address: `decode` trusts the engine's CA, `stranger` another.
/// After `decode` used the engine (its requests and health polls leave idle connections), a
/// request on `stranger` is still refused (the idle connections were verified under another
/// CA and are never handed to it), counted `tls`, and `stranger`'s health polls see it
/// unhealthy.
#[tokio::test(flavor = "multi_thread")]
async fn pools_on_one_engine_with_other_cas_never_share_connections() {
    let (pki, other) = (Pki::new("cluster"), Pki::new("other"));
    let id = pki.issue("engine", &["engine.test"]);
    let engine = FakeVllm::start(FakeConfig::default()).await;
    let front = TlsFront::start(engine.addr, &id, None).await;
    let config = format!(
        "{}{}\n[[routes]]\nname = \"b\"\nmode = \"passthrough\"\ndecode_pool = \"stranger\"\n[routes.match]\npaths = [\"/v1/chat/completions\"]\nheaders = {{ \"x-tenant\" = \"b\" }}\n",
        tls_pool("decode", front.addr, &pki.ca_file()),
        tls_pool("stranger", front.addr, &other.ca_file())
    );
    let proxy = TokenOnce::start(&config).await;
    let healthy = |pool: &str| format!(r#"tokenonce_upstream_healthy{{endpoint="{}",pool="{pool}"}}"#, front.addr);
    proxy.assert_reaches(&healthy("decode"), 1.0).await;
    for _ in 0..2 {
        let (status, text) = tenant_chat(&proxy, None).await;
        assert_eq!(status, 200, "the trusting pool is served: {text}");
    }
    let served = engine.posts().len();
    let (status, text) = tenant_chat(&proxy, Some("b")).await;
    assert_untrusted(status, &text, &front);
    assert_eq!(engine.posts().len(), served, "nothing reached the engine from the other pool");
    assert_eq!(proxy.metric(TLS_ERRORS).await, 1.0);
    assert_eq!(proxy.family_sum("tokenonce_upstream_retries_total").await, 0.0, "never re-sent");

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    // The polls of `decode` keep leaving idle connections to the same address.
    while front.refused() < 3 {
        assert!(std::time::Instant::now() < deadline, "the stranger pool's polls never made their own handshakes");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(proxy.metric(&healthy("decode")).await, 1.0);
    assert_eq!(proxy.metric(&healthy("stranger")).await, 0.0, "the other pool's polls do not trust the engine");
}

/// A reload (SIGHUP's code path) that changes a pool's `ca_file` to a CA that did not sign
/// the engine's certificate: the next request is refused, not sent on a connection verified
/// under the old CA; changing it back serves again.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_changes_the_ca_never_reuses_old_connections() {
    let (pki, other) = (Pki::new("cluster"), Pki::new("other"));
    let id = pki.issue("engine", &["engine.test"]);
    let engine = FakeVllm::start(FakeConfig::default()).await;
    let front = TlsFront::start(engine.addr, &id, None).await;
    let trusting = tls_pool("decode", front.addr, &pki.ca_file());
    let proxy = TokenOnce::start(&trusting).await;
    proxy.wait_ready(200).await;
    let (status, text) = tenant_chat(&proxy, None).await;
    assert_eq!(status, 200, "{text}");

    proxy.reconfigure(&tls_pool("decode", front.addr, &other.ca_file()));
    assert_eq!(proxy.metric(r#"tokenonce_config_reloads_total{result="success"}"#).await, 1.0);
    let served = engine.posts().len();
    let (status, text) = tenant_chat(&proxy, None).await;
    assert_untrusted(status, &text, &front);
    assert_eq!(engine.posts().len(), served, "the old connection was not used");
    assert_eq!(proxy.metric(TLS_ERRORS).await, 1.0);

    proxy.reconfigure(&trusting);
    assert_eq!(proxy.metric(r#"tokenonce_config_reloads_total{result="success"}"#).await, 2.0);
    let (status, text) = tenant_chat(&proxy, None).await;
    assert_eq!(status, 200, "{text}");
}

/// An engine requiring a client certificate that the pool does not send, under TLS 1.2 (the
/// engine refuses inside the handshake) and TLS 1.3 (the client's handshake is done; the
/// refusal is an alert on the first read): each request is a 502 counted `kind="tls"`,
/// never re-sent, and nothing reaches the engine.
#[tokio::test(flavor = "multi_thread")]
async fn an_mtls_refusal_is_tls_and_never_resent_under_tls_1_2_and_1_3() {
    use pingora::tls::ssl::SslVersion;
    let pki = Pki::new("cluster");
    let id = pki.issue("engine", &["engine.test"]);
    for version in [SslVersion::TLS1_2, SslVersion::TLS1_3] {
        let engine = FakeVllm::start(FakeConfig::default()).await;
        let front = TlsFront::start_on(engine.addr, &id, Some(&pki.ca_file()), Some(version)).await;
        let proxy = TokenOnce::start(&tls_pool("decode", front.addr, &pki.ca_file())).await;
        // The harness's start-up probe went there too.
        let before = (proxy.metric(TLS_ERRORS).await, front.refused());
        for _ in 0..3 {
            let (status, text) = tenant_chat(&proxy, None).await;
            assert_eq!(status, 502, "{version:?}: {text}");
            let body: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(body["error"]["code"], "decode_unavailable", "{version:?}: {text}");
            assert!(!text.contains("127.0.0.1"), "{text}");
        }
        assert_eq!(proxy.metric(TLS_ERRORS).await - before.0, 3.0, "{version:?}: {}", proxy.metrics().await);
        assert_eq!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="io",stage="passthrough"}"#).await, 0.0);
        assert_eq!(proxy.family_sum("tokenonce_upstream_retries_total").await, 0.0, "{version:?}: never re-sent");
        assert!(engine.posts().is_empty(), "{version:?}");
        assert!(front.refused() - before.1 >= 3, "{version:?}: the engine refused each handshake");
        drop(proxy);

        // Orchestrated legs go through tokenonce's own client: the same.
        let config = format!(
            "{}{}\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
            tls_pool("prefill", front.addr, &pki.ca_file()),
            tls_pool("decode", front.addr, &pki.ca_file())
        );
        let proxy = TokenOnce::start(&config).await;
        for _ in 0..3 {
            let (status, text) = tenant_chat(&proxy, None).await;
            assert_eq!(status, 502, "{version:?}: {text}");
            assert!(text.contains("prefill_unavailable") && !text.contains("127.0.0.1"), "{version:?}: {text}");
        }
        let prefill_tls = r#"tokenonce_upstream_errors_total{kind="tls",stage="prefill"}"#;
        assert_eq!(proxy.metric(prefill_tls).await, 3.0, "{version:?}: {}", proxy.metrics().await);
        assert_eq!(proxy.family_sum("tokenonce_upstream_retries_total").await, 0.0, "{version:?}: never re-sent");
        assert!(engine.posts().is_empty(), "{version:?}");
    }
}

/// llm-d's shape with TLS to the prefiller: a plain decode pool and a route whose
/// `x-prefiller-host-port` may name `front` (its allowlist entry dials TLS with `entry_tls`, an
/// inline table's body) or, by a later plain entry, any other loopback port.
async fn header_route(front: &TlsFront, entry_tls: &str) -> (FakeVllm, TokenOnce) {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let config = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"llmd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\n[routes.prefill]\nheader = \"x-prefiller-host-port\"\nallow = [\n  {{ match = \"{}\", tls = {{ {entry_tls} }} }},\n  \"127.0.0.0/8\",\n]\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        d.addr, front.addr
    );
    (d, TokenOnce::start(&config).await)
}

/// An allowlist entry's `tls` body trusting `ca` for `engine.test`.
fn entry_tls(ca: &Path) -> String {
    format!("ca_file = \"{}\", server_name = \"engine.test\"", ca.display())
}

/// A chat naming `prefiller` in the header.
async fn named_chat(proxy: &TokenOnce, prefiller: &str) -> (u16, String) {
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, text) =
        post_json(&url, &chat_body("named", json!({})), &[("x-prefiller-host-port", prefiller)]).await;
    (status, text)
}

/// The header names a prefiller whose allowlist entry has TLS: its prefill goes over TLS and
/// the decode reuses its ids; a prefiller permitted by a plain entry is still dialled plain.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_named_prefiller_gets_its_entrys_tls_and_a_plain_entry_stays_plain() {
    let pki = Pki::new("cluster");
    let p = FakeVllm::start(FakeConfig::default()).await;
    let pf = TlsFront::start(p.addr, &pki.issue("engine", &["engine.test"]), None).await;
    let (d, proxy) = header_route(&pf, &entry_tls(&pki.ca_file())).await;
    proxy.wait_ready(200).await;
    let (status, text) = named_chat(&proxy, &pf.addr.to_string()).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts().len(), 1, "the prefill reached the engine");
    assert!(pf.accepted() >= 1 && pf.refused() == 0, "over TLS");
    assert!(d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].is_array());
    let applied = r#"tokenonce_token_reuse_total{reason="none",result="applied",route="llmd"}"#;
    proxy.assert_reaches(applied, 1.0).await;

    let plain = FakeVllm::start(FakeConfig::default()).await;
    let (status, text) = named_chat(&proxy, &plain.host_port()).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(plain.posts().len(), 1, "a plain engine answered: dialled in plain HTTP");
    proxy.assert_reaches(applied, 2.0).await;
}

/// A header-named prefiller whose certificate the entry's CA did not sign: the typed 502,
/// without the address, and nothing reaches the engine.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_named_prefiller_with_an_untrusted_certificate_is_a_typed_502() {
    let (pki, other) = (Pki::new("cluster"), Pki::new("other"));
    let p = FakeVllm::start(FakeConfig::default()).await;
    let pf = TlsFront::start(p.addr, &pki.issue("engine", &["engine.test"]), None).await;
    let (d, proxy) = header_route(&pf, &entry_tls(&other.ca_file())).await;
    proxy.wait_ready(200).await;
    let (status, text) = named_chat(&proxy, &pf.addr.to_string()).await;
    assert_eq!(status, 502, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "prefill_unavailable", "{text}");
    assert_eq!(body["error"]["type"], "upstream_error", "{text}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("cannot connect"), "reads like any named prefiller's connect failure: {message}");
    assert!(!text.contains("127.0.0.1") && !text.contains(&pf.addr.port().to_string()), "{text}");
    assert!(p.posts().is_empty() && d.posts().is_empty(), "nothing reached an engine");
    let series = r#"tokenonce_upstream_errors_total{kind="tls",stage="prefill"}"#;
    assert!(proxy.metric(series).await >= 1.0);
}

/// A prefiller that requires a client certificate gets the one its entry names.
#[tokio::test(flavor = "multi_thread")]
async fn a_header_named_prefiller_gets_the_entrys_client_certificate() {
    let pki = Pki::new("cluster");
    let client = pki.issue("tokenonce-client", &["tokenonce.client"]);
    let p = FakeVllm::start(FakeConfig::default()).await;
    let pf = TlsFront::start(p.addr, &pki.issue("engine", &["engine.test"]), Some(&pki.ca_file())).await;
    let with_cert = format!(
        "{}, cert_file = \"{}\", key_file = \"{}\"",
        entry_tls(&pki.ca_file()),
        client.cert.display(),
        client.key.display()
    );
    let (_d, proxy) = header_route(&pf, &with_cert).await;
    proxy.wait_ready(200).await;
    let (status, text) = named_chat(&proxy, &pf.addr.to_string()).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts().len(), 1);
    assert_eq!(pf.refused(), 0, "the handshake carried the client certificate");
}

/// `tokenonce check` on an allowlist entry's `tls`: a file that does not load at its key, an
/// IP network verified without a server name, a table without `match`.
#[test]
fn check_reports_bad_allowlist_tls_at_its_key() {
    let text = r#"
[pools.decode]
endpoints = ["decode.test:8200"]

[[routes]]
name = "llmd"
mode = "orchestrate"
decode_pool = "decode"
[routes.prefill]
header = "x-prefiller-host-port"
allow = [
  "10.0.0.0/8:8000",
  { match = "prefill.test:8443", tls = { ca_file = "/nonexistent/ca.pem" } },
  { match = "10.1.0.0/16:8443", tls = {} },
  { tls = {} },
]
"#;
    let err = tokenonce::config::from_toml(text, "t.toml").unwrap_err();
    let got: Vec<(String, String)> = err.problems.iter().map(|p| (p.key.clone(), p.message.clone())).collect();
    let has = |key: &str, words: &str| got.iter().any(|(k, m)| k == key && m.contains(words));
    assert!(has("routes[0].prefill.allow[1].tls.ca_file", "cannot read `/nonexistent/ca.pem`"), "{got:#?}");
    assert!(has("routes[0].prefill.allow[2].tls.server_name", "IP addresses"), "{got:#?}");
    assert!(has("routes[0].prefill.allow[3].match", "required"), "{got:#?}");
    assert_eq!(got.len(), 3, "{got:#?}");
    assert!(err.problems.iter().all(|p| p.line > 0), "each at its place: {got:#?}");
}

/// The TLS entry `conf/llmd-header.toml` shows commented out is one `tokenonce check`
/// accepts once its CA file exists, and it dials TLS.
#[test]
fn the_llmd_header_examples_tls_entry_loads() {
    let pki = Pki::new("cluster");
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/llmd-header.toml")).unwrap();
    let example = shipped.lines().find(|l| l.trim_start().starts_with("# { match =")).expect("a commented TLS entry");
    let entry =
        example.replacen("# ", "", 1).replace("/etc/tokenonce/prefill-ca.pem", &pki.ca_file().display().to_string());
    let text = shipped.replace(example, &entry);
    let loaded = tokenonce::config::from_toml(&text, "llmd-header.toml").unwrap();
    let tls = &loaded.resources.allow_tls["llmd-pd"];
    assert!(tls[0].is_some() && tls[1..].iter().all(Option::is_none), "{tls:?}");
}
