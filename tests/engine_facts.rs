//! Engine facts stay fresh: a decode's vLLM version is re-learned when the endpoint turns
//! healthy after being unhealthy (a restart may bring another vLLM), and the pause after a
//! failed `/version` ends when `/health` answers again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::*;

const APPLIED: &str = r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#;

/// Waits (bounded: 5 s, polling) until the proxy reports the decode endpoint `healthy`.
async fn wait_health(proxy: &TokenOnce, decode: &FakeVllm, healthy: bool) {
    let series = format!(r#"tokenonce_upstream_healthy{{endpoint="{}",pool="decode"}}"#, decode.host_port());
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.metric(&series).await != f64::from(u8::from(healthy)) {
        assert!(Instant::now() < deadline, "decode never reported healthy = {healthy}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends chat requests until one reuses the prefill's ids; bounded (3 s, which is less than
/// the 30 s pause after a failed `/version`, and 15 health intervals). Returns how long it took.
async fn until_reuse_applied(proxy: &TokenOnce) -> Duration {
    let started = Instant::now();
    let before = proxy.metric(APPLIED).await;
    for i in 0..150 {
        let url = format!("{}/v1/chat/completions", proxy.url);
        let (status, _, text) = post_json(&url, &chat_body(&format!("again {i}"), json!({})), &[]).await;
        assert_eq!(status, 200, "{text}");
        if proxy.metric(APPLIED).await > before {
            return started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(3), "reuse not applied again after {i} requests");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("reuse not applied again");
}

/// A decode that first makes chat fall back for `reason` is restarted on the same address
/// (unhealthy, then healthy as 0.32 with a working `/version`): reuse is applied again within
/// a bounded time, and no more of those fallbacks are counted.
async fn reuse_recovers_after_a_restart(first: FakeConfig, reason: &str) {
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), first, "").await;
    wait_health(&proxy, &d, true).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, _) = post_json(&url, &chat_body("before", json!({})), &[]).await;
    assert_eq!(status, 200);
    let series = format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="pd"}}"#);
    assert_eq!(proxy.metric(&series).await, 1.0);

    d.configure(|c| c.healthy = false);
    wait_health(&proxy, &d, false).await;
    d.configure(|c| {
        c.version = "0.32.0".into();
        c.healthy = true;
    });
    wait_health(&proxy, &d, true).await;
    until_reuse_applied(&proxy).await;
    assert_eq!(proxy.metric(&series).await, 1.0, "no more {reason} fallbacks");
}

/// A decode on vLLM 0.26 (chat reuse falls back, `decode_version_old`) restarted as 0.32 gets
/// the new gate: the version is re-learned when the endpoint turns healthy.
#[tokio::test(flavor = "multi_thread")]
async fn restarted_decode_with_a_new_version_gets_the_new_gate() {
    reuse_recovers_after_a_restart(
        FakeConfig { version: "0.26.0".into(), ..FakeConfig::default() },
        "decode_version_old",
    )
    .await;
}

/// A decode whose `/version` fails at first (`decode_version_unknown`, and `/version` paused
/// for 30 s) answers it once healthy again: the pause ends with the recovery, well before 30 s.
#[tokio::test(flavor = "multi_thread")]
async fn version_pause_ends_when_health_recovers() {
    reuse_recovers_after_a_restart(
        FakeConfig { version: String::new(), ..FakeConfig::default() },
        "decode_version_unknown",
    )
    .await;
}

/// A burst of concurrent first requests, with no version learned yet (the decode fails
/// `/health`, so the poller does not ask), asks the decode's `/version` once, not once per
/// request, and every request gets the gate that one answer gives.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_first_requests_asks_version_once() {
    let decode = FakeConfig { healthy: false, ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post_json(&url, &chat_body(&format!("burst {i}"), json!({})), &[]).await })
        })
        .collect();
    for task in tasks {
        let (status, _, text) = tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap();
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(proxy.metric_reaches(APPLIED, 64.0).await, 64.0);
    let asks = d.requests().iter().filter(|r| r.path == "/version").count();
    assert_eq!(asks, 1, "the burst asked /version {asks} times");
}
