//! Engines that restart, and the facts tokenonce keeps about them: a prefill or decode that
//! dies is a 502 while it is down and serves with reuse again once `/health` recovers; a
//! decode's vLLM version is re-learned when the endpoint turns healthy after being unhealthy
//! (a restart may bring another vLLM); a `/version` that fails is not asked again by every
//! request, and that pause ends when `/health` answers again; a burst of first requests
//! asks `/version` once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use serde_json::json;
use support::fault_engine::FaultEngine;
use support::*;

const APPLIED: &str = r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#;

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
    proxy.wait_health("decode", &d.host_port(), true).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, _) = post_json(&url, &chat_body("before", json!({})), &[]).await;
    assert_eq!(status, 200);
    let series = format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="pd"}}"#);
    assert_eq!(proxy.metric(&series).await, 1.0);

    d.configure(|c| c.healthy = false);
    proxy.wait_health("decode", &d.host_port(), false).await;
    d.configure(|c| {
        c.version = "0.32.0".into();
        c.healthy = true;
    });
    proxy.wait_health("decode", &d.host_port(), true).await;
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

/// A decode whose /version cannot be read: chat falls back (counted), and requests do not
/// each ask /version again.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_decode_version_falls_back_without_asking_every_time() {
    let (_p, d, proxy) =
        pd_setup(FakeConfig::default(), FakeConfig { version: String::new(), ..FakeConfig::default() }, "").await;
    for i in 0..5 {
        let (status, _, _) =
            post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body(&format!("v{i}"), json!({})), &[])
                .await;
        assert_eq!(status, 200);
    }
    assert!(d.posts().iter().all(|r| r.json().get("kv_transfer_params").is_none()));
    assert_eq!(proxy.metric(&reuse_series("pd", "fallback", "decode_version_unknown")).await, 5.0);
    let asked = d.requests().iter().filter(|r| r.path == "/version").count();
    assert!(asked <= 2, "/version asked {asked} times");
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
    proxy.assert_reaches(APPLIED, 64.0).await;
    let asks = d.requests().iter().filter(|r| r.path == "/version").count();
    assert_eq!(asks, 1, "the burst asked /version {asks} times");
}

/// Stops `engine` of `pool` like a dead engine: a chat meanwhile is a 502 with `code`, and
/// the pool's health polls see it down.
async fn goes_down(proxy: &TokenOnce, pool: &str, engine: &FaultEngine, code: &str) {
    engine.stop().await;
    let (status, text) = proxy.chat_with("scenario", json!({"stream": false}), &[]).await;
    assert_eq!(status, 502, "{text}");
    assert_openai_error(&text, code);
    proxy.wait_health(pool, &engine.host_port(), false).await;
}

/// Restarts `engine` of `pool` on its address and waits until the pool's health polls see it
/// up; returns when it restarted.
async fn comes_back(proxy: &TokenOnce, pool: &str, engine: &FaultEngine) -> Instant {
    engine.restart();
    let started = Instant::now();
    proxy.wait_health(pool, &engine.host_port(), true).await;
    started
}

/// The prefill engine dies (502 `prefill_unavailable`, counted) and comes back on the same
/// address: reuse is applied again within a bounded time.
#[tokio::test(flavor = "multi_thread")]
async fn prefill_restart_recovers_reuse() {
    let [pf, df] = fakes(Default::default()).await;
    let (p, d) = (FaultEngine::start(&pf).await, FaultEngine::start(&df).await);
    let proxy = TokenOnce::start(&pools_config(&[p.host_port()], &[d.host_port()], "")).await;
    assert_eq!(proxy.chat_with("scenario", json!({"stream": false}), &[]).await.0, 200);
    assert_eq!(proxy.metric(APPLIED).await, 1.0);

    goes_down(&proxy, "prefill", &p, "prefill_unavailable").await;
    assert_eq!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="connect",stage="prefill"}"#).await, 1.0);

    let started = comes_back(&proxy, "prefill", &p).await;
    let (status, text) = proxy.chat_with("scenario", json!({"stream": true}), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(proxy.metric(APPLIED).await, 2.0, "reuse again after the restart");
    assert!(started.elapsed() < Duration::from_secs(5), "recovered within {:?}", started.elapsed());
    assert_eq!(d.posts().len(), 2, "the decode never got the failed request");
}

/// The decode engine dies (502 `decode_unavailable`) and comes back on the same address as
/// another vLLM (0.26 → 0.32): the new version is learned and chat reuse, off before
/// (`decode_version_old`), is applied within a bounded time.
#[tokio::test(flavor = "multi_thread")]
async fn decode_restart_as_a_new_version_recovers_reuse() {
    let old = FakeConfig { version: "0.26.0".into(), ..FakeConfig::default() };
    let [pf, df] = fakes([FakeConfig::default(), old]).await;
    let (p, d) = (FaultEngine::start(&pf).await, FaultEngine::start(&df).await);
    let proxy = TokenOnce::start(&pools_config(&[p.host_port()], &[d.host_port()], "")).await;
    proxy.wait_health("decode", &d.host_port(), true).await;
    assert_eq!(proxy.chat_with("scenario", json!({"stream": false}), &[]).await.0, 200);
    let old_gate = r#"tokenonce_token_reuse_total{reason="decode_version_old",result="fallback",route="pd"}"#;
    assert_eq!(proxy.metric(old_gate).await, 1.0);

    goes_down(&proxy, "decode", &d, "decode_unavailable").await;

    df.configure(|c| c.version = "0.32.0".into());
    let started = comes_back(&proxy, "decode", &d).await;
    let (status, text) = proxy.chat_with("scenario", json!({"stream": false}), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(proxy.metric(APPLIED).await, 1.0, "the new gate");
    // The failed request was planned (and counted) under the old gate too, unless a health
    // poll saw the stop before its prefill ended: that forgets the version (as it should), and
    // the request counts as `decode_version_unknown` (a loaded machine makes that window
    // longer than a poll interval).
    let unknown = r#"tokenonce_token_reuse_total{reason="decode_version_unknown",result="fallback",route="pd"}"#;
    let (old_count, unknown_count) = (proxy.metric(old_gate).await, proxy.metric(unknown).await);
    assert!(
        (old_count, unknown_count) == (2.0, 0.0) || (old_count, unknown_count) == (1.0, 1.0),
        "old gate {old_count}, version unknown {unknown_count}"
    );
    assert!(started.elapsed() < Duration::from_secs(5), "recovered within {:?}", started.elapsed());
}
