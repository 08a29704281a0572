//! Surviving a bad engine: a pool prefill that fails before any answer or answers 5xx moves
//! to another endpoint of its pool (bounded), a 4xx does not, and an endpoint failing
//! requests in a row is ejected from the pool's choice, then readmitted once it recovers;
//! an engine that never answers is ejected by its timeouts alike; with
//! `on_prefill_failure = "decode_alone"` a failed prefill leaves the decode to run alone.
//! Engines fail as fakes answering an error status, or behind a fault engine
//! (`tests/support/fault_engine.rs`) that closes, answers garbage or never answers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use serde_json::json;
use support::fault_engine::{End, Fault, FaultEngine, ENGINE_503, GARBAGE};
use support::*;

/// Two prefill fakes in one round-robin pool, one decode fake, route `pd`.
fn two_prefill_config(a: &FakeVllm, b: &FakeVllm, d: &FakeVllm, route_extra: &str) -> String {
    pools_config(&[a.host_port(), b.host_port()], &[d.host_port()], route_extra)
}

fn failing(status: u16) -> FakeConfig {
    FakeConfig { fail_with: Some((status, "{\"error\":\"engine\"}".into())), ..FakeConfig::default() }
}

/// Waits until every one of `engines` (`host:port`) passed a health poll of pool `prefill`.
async fn wait_healthy(proxy: &TokenOnce, engines: &[String]) {
    for e in engines {
        proxy.wait_health("prefill", e, true).await;
    }
}

/// Prefill `a` failing with 503 and `b` healthy in one pool (`eject_after_failures = 2`),
/// decode `d`, at `health_interval_ms`; `text` is the config it runs.
struct Ejecting {
    a: FakeVllm,
    proxy: TokenOnce,
    text: String,
    _engines: (FakeVllm, FakeVllm),
}

impl Ejecting {
    async fn start(health_interval_ms: u64) -> Self {
        let [a, b, d] = fakes([failing(503), FakeConfig::default(), FakeConfig::default()]).await;
        let settings =
            Settings { health_interval_ms, upstream_extra: "eject_after_failures = 2\n".into(), ..Settings::default() };
        let text = two_prefill_config(&a, &b, &d, "");
        let proxy = TokenOnce::start_with(&text, &settings).await;
        wait_healthy(&proxy, &[a.host_port(), b.host_port()]).await;
        Self { a, proxy, text, _engines: (b, d) }
    }

    /// Sends chats (bounded: 5 s) until `a` is ejected.
    async fn eject_a(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.proxy.metric(EJECTIONS).await < 1.0 {
            assert!(Instant::now() < deadline, "never ejected");
            assert_eq!(self.proxy.chat("Hello there!").await.0, 200);
        }
    }
}

const FAILOVERS: &str = r#"tokenonce_prefill_failovers_total{route="pd"}"#;
const EJECTIONS: &str = r#"tokenonce_upstream_ejections_total{pool="prefill"}"#;
const EJECTED: &str = r#"tokenonce_upstream_ejected{pool="prefill"}"#;

/// One prefill engine answers 503 to everything: every request still succeeds, each one
/// that met the bad engine first failed over to the good one, and the decode ran once each.
#[tokio::test(flavor = "multi_thread")]
async fn a_5xx_prefill_fails_over_to_another_endpoint() {
    let [a, b, d] = fakes([failing(503), FakeConfig::default(), FakeConfig::default()]).await;
    let proxy = TokenOnce::start(&two_prefill_config(&a, &b, &d, "")).await;
    wait_healthy(&proxy, &[a.host_port(), b.host_port()]).await;
    for _ in 0..4 {
        let (status, text) = proxy.chat("Hello there!").await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(b.posts().len(), 4);
    assert_eq!(d.posts().len(), 4);
    assert!(!a.posts().is_empty(), "round robin sends some requests to the bad engine first");
    assert_eq!(proxy.metric(FAILOVERS).await, a.posts().len() as f64);
    assert_eq!(
        proxy.metric(r#"tokenonce_upstream_errors_total{kind="status_5xx",stage="prefill"}"#).await,
        a.posts().len() as f64
    );
}

/// A refused connection is a failure before any answer: it fails over too. (The good engine
/// fails `/health`, so neither is preferred and round robin does send to the refused one.)
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_prefill_fails_over() {
    let refused = RefusedAddr::new();
    let unhealthy = FakeConfig { healthy: false, ..FakeConfig::default() };
    let (b, d) = (FakeVllm::start(unhealthy).await, FakeVllm::start(FakeConfig::default()).await);
    let config = pools_config(&[refused.addr.to_string(), b.host_port()], &[d.host_port()], "");
    let proxy = TokenOnce::start(&config).await;
    for _ in 0..2 {
        let (status, text) = proxy.chat("Hello there!").await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(b.posts().len(), 2);
    assert!(proxy.metric(FAILOVERS).await >= 1.0);
}

/// A prefill 4xx is the client's: returned as is, never sent to another endpoint.
#[tokio::test(flavor = "multi_thread")]
async fn a_4xx_prefill_is_not_failed_over() {
    let [a, b, d] = fakes([failing(400), FakeConfig::default(), FakeConfig::default()]).await;
    let proxy = TokenOnce::start(&two_prefill_config(&a, &b, &d, "")).await;
    wait_healthy(&proxy, &[a.host_port(), b.host_port()]).await;
    let mut statuses = vec![proxy.chat("Hello there!").await.0, proxy.chat("Hello there!").await.0];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 400]);
    assert_eq!((a.posts().len(), b.posts().len(), d.posts().len()), (1, 1, 1));
    assert_eq!(proxy.metric(FAILOVERS).await, 0.0);
}

/// Both engines fail: attempts are bounded (`prefill_attempts = 2`: each request tries each
/// engine once) and the client gets the last 5xx unchanged; the decode is never sent.
#[tokio::test(flavor = "multi_thread")]
async fn failover_is_bounded_and_returns_the_last_answer() {
    let [a, b, d] = fakes([failing(503), failing(500), FakeConfig::default()]).await;
    let settings = Settings { upstream_extra: "eject_after_failures = 0\n".into(), ..Settings::default() };
    let proxy = TokenOnce::start_with(&two_prefill_config(&a, &b, &d, "prefill_attempts = 2\n"), &settings).await;
    for _ in 0..3 {
        let (status, _) = proxy.chat("Hello there!").await;
        assert!(status == 500 || status == 503, "{status}");
    }
    assert_eq!(a.posts().len() + b.posts().len(), 6);
    assert_eq!(d.posts().len(), 0);
    assert_eq!(proxy.metric(FAILOVERS).await, 3.0);
    assert_eq!(proxy.metric(EJECTIONS).await, 0.0, "0 never ejects");
}

/// The first prefill endpoint, behind a fault engine, fails with `fault` (its `/health` stays
/// good): the request fails over to the second and succeeds; counted once; the decode ran once.
async fn failover_to_the_second_prefill(fault: Fault) {
    let [pf1, pf2, df] = fakes(Default::default()).await;
    let (p1, p2, d) =
        (FaultEngine::with(&pf1, fault).await, FaultEngine::start(&pf2).await, FaultEngine::start(&df).await);
    let settings = Settings { upstream_extra: "eject_after_failures = 0\n".into(), ..Settings::default() };
    let proxy =
        TokenOnce::start_with(&pools_config(&[p1.host_port(), p2.host_port()], &[d.host_port()], ""), &settings).await;
    wait_healthy(&proxy, &[p1.host_port(), p2.host_port()]).await;
    let started = Instant::now();
    for _ in 0..3 {
        let (status, text) = proxy.chat("Hello there!").await;
        assert_eq!(status, 200, "{text}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(p2.posts().len(), 3, "the second endpoint served every request");
    assert!(!p1.posts().is_empty(), "round robin sends some to the failing one first");
    assert_eq!(proxy.metric(FAILOVERS).await, p1.posts().len() as f64, "each of those failed over once");
    assert_eq!(d.posts().len(), 3);
    assert_eq!(proxy.metric(&reuse_series("pd", "applied", "none")).await, 3.0);
}

/// Failover on a 503 with a body.
#[tokio::test(flavor = "multi_thread")]
async fn failover_on_a_prefill_5xx() {
    failover_to_the_second_prefill(Fault::Status(503, ENGINE_503)).await;
}

/// Failover on a prefill that read the request and closed (no answer).
#[tokio::test(flavor = "multi_thread")]
async fn failover_on_a_prefill_closing_without_an_answer() {
    failover_to_the_second_prefill(Fault::CloseAfterRead).await;
}

/// Failover on a prefill answering non-HTTP bytes.
#[tokio::test(flavor = "multi_thread")]
async fn failover_on_a_prefill_answering_garbage() {
    failover_to_the_second_prefill(Fault::Garbage(GARBAGE)).await;
}

/// An engine failing two requests in a row (`eject_after_failures = 2`) is ejected: no
/// request reaches it while the other serves, though its `/health` stays 200. When it
/// recovers it is tried again once the 5 s backoff ended, succeeds, and the gauge falls.
#[tokio::test(flavor = "multi_thread")]
async fn consecutive_failures_eject_an_endpoint_until_it_recovers() {
    let [a, b, d] = fakes([failing(503), FakeConfig::default(), FakeConfig::default()]).await;
    let settings = Settings { upstream_extra: "eject_after_failures = 2\n".into(), ..Settings::default() };
    let proxy = TokenOnce::start_with(&two_prefill_config(&a, &b, &d, ""), &settings).await;
    wait_healthy(&proxy, &[a.host_port(), b.host_port()]).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.metric(EJECTIONS).await < 1.0 {
        assert!(Instant::now() < deadline, "never ejected");
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    let seen = a.posts().len();
    assert_eq!(seen, 2);
    assert_eq!(proxy.metric(EJECTED).await, 1.0);
    for _ in 0..6 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert_eq!(a.posts().len(), seen, "an ejected endpoint gets no request");

    a.configure(|c| c.fail_with = None);
    let deadline = Instant::now() + Duration::from_secs(15);
    while a.posts().len() == seen {
        assert!(Instant::now() < deadline, "never readmitted");
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let failovers = proxy.metric(FAILOVERS).await;
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert_eq!(proxy.metric(FAILOVERS).await, failovers, "readmitted and serving: no more failovers");
    assert_eq!(proxy.metric_reaches_within(EJECTED, 0.0, Duration::from_secs(5)).await, 0.0, "gauge stuck");
    assert_eq!(proxy.metric(EJECTIONS).await, 1.0);
}

/// A prefill endpoint failing requests in a row (`eject_after_failures = 2`) is ejected while
/// its `/health` stays good: it gets no request while ejected; once it recovers it is
/// readmitted after the 5 s backoff and serves again; ejections counted, gauge back to 0.
#[tokio::test(flavor = "multi_thread")]
async fn ejection_and_readmission() {
    let [pf1, pf2, df] = fakes(Default::default()).await;
    let bad = FaultEngine::with(&pf1, Fault::CloseAfterRead).await;
    let (good, d) = (FaultEngine::start(&pf2).await, FaultEngine::start(&df).await);
    let settings = Settings { upstream_extra: "eject_after_failures = 2\n".into(), ..Settings::default() };
    let proxy =
        TokenOnce::start_with(&pools_config(&[bad.host_port(), good.host_port()], &[d.host_port()], ""), &settings)
            .await;
    wait_healthy(&proxy, &[bad.host_port(), good.host_port()]).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.metric(EJECTIONS).await < 1.0 {
        assert!(Instant::now() < deadline, "never ejected");
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    // The backoff runs from the ejection (seen just after it happened), not from the recovery
    // below: on a loaded machine the requests in between can take most of it.
    let ejected_at = Instant::now();
    assert_eq!(bad.posts().len(), 2);
    assert_eq!(proxy.metric(EJECTED).await, 1.0);
    for _ in 0..6 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert_eq!(bad.posts().len(), 2, "an ejected endpoint gets no request");

    bad.set(Fault::Pass);
    let recovered = Instant::now();
    while bad.ended(End::Answered) == 0 {
        assert!(recovered.elapsed() < Duration::from_secs(15), "never readmitted");
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ejected_at.elapsed() >= Duration::from_secs(3), "not readmitted before its 5 s backoff");
    let served = bad.posts().len();
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert!(bad.posts().len() > served, "readmitted: it serves its share again");
    assert_eq!(proxy.metric_reaches_within(EJECTED, 0.0, Duration::from_secs(5)).await, 0.0, "gauge stuck");
    assert_eq!(proxy.metric(EJECTIONS).await, 1.0);
}

/// `upstream_ejected` reads the pool's state when scraped: 1 right after an ejection and 0
/// once the backoff ended (the endpoint readmitted), with no health round in between (the
/// interval is 10 min here).
#[tokio::test(flavor = "multi_thread")]
async fn the_ejected_gauge_is_the_pools_state_between_health_rounds() {
    let setup = Ejecting::start(600_000).await;
    let proxy = &setup.proxy;
    assert_eq!(proxy.metric(EJECTED).await, 0.0);
    setup.eject_a().await;
    assert_eq!(proxy.metric(EJECTED).await, 1.0);
    // The backoff is 5 s: the endpoint is readmitted by itself, and the gauge says so.
    let readmitted = proxy.metric_reaches_within(EJECTED, 0.0, Duration::from_secs(10)).await;
    assert_eq!(readmitted, 0.0, "the gauge still reads an ejection that ended");
    assert_eq!(proxy.metric(EJECTIONS).await, 1.0);
}

/// Ejections are the pool's state: a reload of the unchanged file keeps the ejected endpoint
/// out (it gets no request) and the gauge at 1.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_keeps_an_ejection() {
    let setup = Ejecting::start(Settings::default().health_interval_ms).await;
    setup.eject_a().await;
    let (proxy, seen) = (&setup.proxy, setup.a.posts().len());
    proxy.reload(&setup.text).await;
    assert_eq!(proxy.metric(EJECTED).await, 1.0);
    for _ in 0..4 {
        assert_eq!(proxy.chat("Hello there!").await.0, 200);
    }
    assert_eq!(setup.a.posts().len(), seen, "still ejected after the reload");
}

/// A reload removes the gauges of what it took away: the health of an endpoint no longer in
/// its pool, the pool-identity gauge of a route no longer configured (their alerts would
/// otherwise fire forever on values nothing updates); what stays keeps reporting.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_removes_the_gauges_of_what_it_took_away() {
    let [a, b, d] = fakes(Default::default()).await;
    let proxy = TokenOnce::start(&two_prefill_config(&a, &b, &d, "")).await;
    wait_healthy(&proxy, &[a.host_port(), b.host_port()]).await;
    let healthy =
        |e: &FakeVllm| format!(r#"tokenonce_upstream_healthy{{endpoint="{}",pool="prefill"}}"#, e.host_port());
    let text = proxy.metrics().await;
    assert!(text.contains(&healthy(&a)) && text.contains(r#"tokenonce_pool_models_differ{route="pd"}"#), "{text}");
    // Endpoint `a` leaves the pool, route `pd` becomes `pd2`.
    let only_b = pools_config(&[b.host_port()], &[d.host_port()], "").replacen("name = \"pd\"", "name = \"pd2\"", 1);
    proxy.reload(&only_b).await;
    let text = proxy.metrics().await;
    assert!(!text.contains(&healthy(&a)), "a removed endpoint's health stays: {text}");
    assert!(text.contains(&healthy(&b)), "{text}");
    assert!(!text.contains(r#"tokenonce_pool_models_differ{route="pd"}"#), "a removed route's gauge stays: {text}");
    assert!(!text.contains(r#"tokenonce_parity_reuse_off{route="pd"}"#), "{text}");
    assert!(text.contains(r#"tokenonce_pool_models_differ{route="pd2"} 0"#), "{text}");
}

const PREFILL_FAILED: &str = r#"tokenonce_token_reuse_total{reason="prefill_failed",result="fallback",route="pd"}"#;

/// `on_prefill_failure = "decode_alone"`: a prefill answering 503 (and, in a second engine
/// setup, one refusing connections) leads to the decode running the client's request
/// itself: the client's body, no kv params; counted as a `prefill_failed` fallback.
#[tokio::test(flavor = "multi_thread")]
async fn decode_alone_serves_a_request_whose_prefill_failed() {
    let (p, d, proxy) = pd_setup(failing(503), FakeConfig::default(), "on_prefill_failure = \"decode_alone\"\n").await;
    let body = chat_body("Hello there!", json!({}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.posts().len(), 1);
    let decode = d.posts()[0].json();
    assert!(decode.get("kv_transfer_params").is_none(), "{decode}");
    assert_eq!(decode, body, "the client's body as sent");
    assert_eq!(proxy.metric(PREFILL_FAILED).await, 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="status_5xx",stage="prefill"}"#).await, 1.0);

    let refused = RefusedAddr::new();
    let d2 = FakeVllm::start(FakeConfig::default()).await;
    let config = pd_config(&d2, &d2, "on_prefill_failure = \"decode_alone\"\n").replacen(
        &d2.host_port(),
        &refused.addr.to_string(),
        1,
    );
    let proxy = TokenOnce::start(&config).await;
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(d2.posts().len(), 1);
    assert_eq!(proxy.metric(PREFILL_FAILED).await, 1.0);
}

/// A prefill 4xx is the client's even with `decode_alone`: returned as is, no decode.
#[tokio::test(flavor = "multi_thread")]
async fn decode_alone_never_follows_a_prefill_4xx() {
    let (p, d, proxy) = pd_setup(failing(400), FakeConfig::default(), "on_prefill_failure = \"decode_alone\"\n").await;
    let (status, text) = proxy.chat("Hello there!").await;
    assert_eq!((status, text.as_str()), (400, "{\"error\":\"engine\"}"));
    assert_eq!((p.posts().len(), d.posts().len()), (1, 0));
    assert_eq!(proxy.metric(PREFILL_FAILED).await, 0.0);
}

/// The default (`error`): a prefill 503 goes back to the client, the decode is never sent.
#[tokio::test(flavor = "multi_thread")]
async fn by_default_a_failed_prefill_is_answered() {
    let (_p, d, proxy) = pd_setup(failing(503), FakeConfig::default(), "").await;
    assert_eq!(proxy.chat("Hello there!").await.0, 503);
    assert_eq!(d.posts().len(), 0);
    assert_eq!(proxy.metric(PREFILL_FAILED).await, 0.0);
}

/// An engine that accepts and reads every prefill but never answers (its `/health` stays
/// 200): each request meeting it runs out of `prefill_timeout_ms` (504, no failover), and
/// those timeouts count as failures, so after `eject_after_failures = 2` of them it is
/// ejected and every request goes to the other engine.
#[tokio::test(flavor = "multi_thread")]
async fn an_engine_that_never_answers_is_ejected_after_its_timeouts() {
    let [a, b, d] = fakes(Default::default()).await;
    let hung = FaultEngine::with(&a, Fault::HangBeforeHead).await;
    let config = pools_config(&[hung.host_port(), b.host_port()], &[d.host_port()], "prefill_timeout_ms = 300\n");
    let settings = Settings { upstream_extra: "eject_after_failures = 2\n".into(), ..Settings::default() };
    let proxy = TokenOnce::start_with(&config, &settings).await;
    wait_healthy(&proxy, &[hung.host_port(), b.host_port()]).await; // its health polls pass
    let mut timed_out = 0;
    for _ in 0..12 {
        if proxy.metric(EJECTIONS).await >= 1.0 {
            break;
        }
        let (status, text) = proxy.chat("Hello there!").await;
        match status {
            200 => {}
            504 => timed_out += 1,
            _ => panic!("{status}: {text}"),
        }
    }
    assert_eq!(proxy.metric(EJECTIONS).await, 1.0, "never ejected after {timed_out} timeouts");
    assert_eq!(timed_out, 2, "ejected at the second timeout");
    assert_eq!(hung.posts().len(), 2);
    assert_eq!(proxy.metric(EJECTED).await, 1.0);
    for _ in 0..4 {
        let (status, text) = proxy.chat("Hello there!").await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(hung.posts().len(), 2, "an ejected endpoint gets no request");
}
