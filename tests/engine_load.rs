//! The engines' own pressure, read from their `/metrics` on the health round: each endpoint's
//! (each rank's) waiting, running and KV-cache use read and exported per endpoint; a page that
//! cannot be true (garbage, NaN, absurd counts) rejected and counted, never shown, never a
//! crash; a read that grows too old forgotten and counted stale; a pool that turns the reads
//! off (`engine_metrics_interval_ms = 0`) never asked.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use support::*;

/// The P/D config of `prefills` and `decode`, the prefill pool reading `/metrics` every
/// `prefill_every` ms and the decode pool every `decode_every` ms (0: never).
fn config(prefills: &[String], decode: &FakeVllm, prefill_every: u64, decode_every: u64) -> String {
    pools_config(prefills, &[decode.host_port()], "").replacen(
        "\n[pools.decode]\n",
        &format!(
            "engine_metrics_interval_ms = {prefill_every}\n\n[pools.decode]\nengine_metrics_interval_ms = {decode_every}\n"
        ),
        1,
    )
}

fn series(family: &str, pool: &str, endpoint: &str) -> String {
    format!(r#"tokenonce_{family}{{endpoint="{endpoint}",pool="{pool}"}}"#)
}

fn reads(pool: &str, endpoint: &str, result: &str) -> String {
    format!(r#"tokenonce_engine_metrics_reads_total{{endpoint="{endpoint}",pool="{pool}",result="{result}"}}"#)
}

/// Waits (bounded: 5 s) until `series` is at least `value`.
async fn until_at_least(proxy: &TokenOnce, series: &str, value: f64) {
    let started = Instant::now();
    loop {
        let now = proxy.metric(series).await;
        if now >= value {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "{series} stays at {now}, below {value}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `/metrics` asks an engine got from tokenonce's health round.
fn asks(engine: &FakeVllm) -> usize {
    engine.requests().iter().filter(|r| r.method == "GET" && r.path == "/metrics").count()
}

/// Two prefill endpoints, one a server with two data-parallel ranks listed as `#0-1`: each
/// endpoint's gauges show its own engine's values (a rank its own `engine` label's), the
/// recorded vLLM page reads as idle, and each read is counted ok.
#[tokio::test(flavor = "multi_thread")]
async fn each_endpoint_and_rank_shows_its_own_engines_pressure() {
    let [a, b, d] = fakes([
        FakeConfig { metrics_page: Some(metrics_page(&[("3", "2", "0.5")])), ..FakeConfig::default() },
        FakeConfig {
            dp_size: 2,
            metrics_page: Some(metrics_page(&[("0", "1", "0.125"), ("7", "4", "0.75")])),
            ..FakeConfig::default()
        },
        FakeConfig::default(),
    ])
    .await;
    let (b0, b1) = (format!("{}#0", b.host_port()), format!("{}#1", b.host_port()));
    let prefills = [a.host_port(), format!("{}#0-1", b.host_port())];
    let proxy = TokenOnce::start(&config(&prefills, &d, 200, 200)).await;

    let want = [(a.host_port(), 3.0, 2.0, 0.5), (b0.clone(), 0.0, 1.0, 0.125), (b1.clone(), 7.0, 4.0, 0.75)];
    for (endpoint, waiting, running, usage) in want {
        proxy.assert_reaches(&series("engine_requests_waiting", "prefill", &endpoint), waiting).await;
        proxy.assert_reaches(&series("engine_requests_running", "prefill", &endpoint), running).await;
        proxy.assert_reaches(&series("engine_kv_cache_usage", "prefill", &endpoint), usage).await;
        until_at_least(&proxy, &reads("prefill", &endpoint, "ok"), 1.0).await;
    }
    // The decode serves the page recorded from vLLM 0.32: an idle engine.
    let decode = d.host_port();
    until_at_least(&proxy, &reads("decode", &decode, "ok"), 1.0).await;
    assert_eq!(proxy.metric(&series("engine_requests_waiting", "decode", &decode)).await, 0.0);
    assert_eq!(proxy.metric(&reads("decode", &decode, "rejected")).await, 0.0);
}

/// Engines that publish garbage, NaN, a negative queue, an absurd count or a usage above 1:
/// every read is rejected and counted, no gauge of theirs is shown, and requests are served.
#[tokio::test(flavor = "multi_thread")]
async fn lying_engines_are_rejected_counted_and_never_shown() {
    let pages = [
        "<html>not metrics at all</html>".to_owned(),
        metrics_page(&[("NaN", "1", "0.5")]),
        metrics_page(&[("-1", "1", "0.5")]),
        metrics_page(&[("1e12", "1", "0.5")]),
        metrics_page(&[("1", "1", "1.5")]),
    ];
    let mut liars = Vec::new();
    for page in pages {
        liars.push(FakeVllm::start(FakeConfig { metrics_page: Some(page), ..FakeConfig::default() }).await);
    }
    let d = FakeVllm::start(FakeConfig::default()).await;
    let prefills: Vec<String> = liars.iter().map(FakeVllm::host_port).collect();
    let proxy = TokenOnce::start(&config(&prefills, &d, 200, 200)).await;
    for endpoint in &prefills {
        until_at_least(&proxy, &reads("prefill", endpoint, "rejected"), 2.0).await;
        assert_eq!(proxy.metric(&reads("prefill", endpoint, "ok")).await, 0.0, "{endpoint}");
    }
    let text = proxy.metrics().await;
    for family in ["engine_requests_waiting", "engine_requests_running", "engine_kv_cache_usage"] {
        for endpoint in &prefills {
            assert!(!text.contains(&series(family, "prefill", endpoint)), "{family} of {endpoint} shown:\n{text}");
        }
    }
    let (status, body) = proxy.chat("still served").await;
    assert_eq!(status, 200, "{body}");
}

/// An engine whose page turns to garbage after a good read: the good read is kept while it is
/// believed, then forgotten and counted stale once (its gauges go), while the rejected reads
/// go on being counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_too_old_to_believe_is_forgotten_and_counted_stale() {
    let [p, d] = fakes([
        FakeConfig { metrics_page: Some(metrics_page(&[("5", "1", "0.5")])), ..FakeConfig::default() },
        FakeConfig::default(),
    ])
    .await;
    let proxy = TokenOnce::start(&config(&[p.host_port()], &d, 200, 200)).await;
    let endpoint = p.host_port();
    let waiting = series("engine_requests_waiting", "prefill", &endpoint);
    proxy.assert_reaches(&waiting, 5.0).await;
    p.configure(|c| c.metrics_page = Some("vllm:num_requests_waiting{engine=\"0\"} NaN\n".into()));
    // Believed for three reads (600 ms here), then forgotten.
    proxy.assert_reaches(&reads("prefill", &endpoint, "stale"), 1.0).await;
    assert!(!proxy.metrics().await.contains(&waiting), "a stale read is not shown");
    until_at_least(&proxy, &reads("prefill", &endpoint, "rejected"), 4.0).await;
    assert_eq!(proxy.metric(&reads("prefill", &endpoint, "stale")).await, 1.0, "counted once");
}

/// A pool with `engine_metrics_interval_ms = 0` never asks its engines' `/metrics`; a reload
/// that turns a pool's reads off stops its asks and takes its gauges away.
#[tokio::test(flavor = "multi_thread")]
async fn turning_the_reads_off_stops_the_asks() {
    let [p, d] = fakes([FakeConfig::default(), FakeConfig::default()]).await;
    let proxy = TokenOnce::start(&config(&[p.host_port()], &d, 200, 0)).await;
    until_at_least(&proxy, &reads("prefill", &p.host_port(), "ok"), 2.0).await;
    proxy.wait_health("decode", &d.host_port(), true).await;
    assert_eq!(asks(&d), 0, "decode: reads off");

    let waiting = series("engine_requests_waiting", "prefill", &p.host_port());
    assert!(proxy.metrics().await.contains(&waiting), "read before the reload");

    proxy.reload(&config(&[p.host_port()], &d, 0, 0)).await;
    // A round in flight when the reload landed may still ask once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = asks(&p);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(asks(&p), before, "no ask after the reload turned the reads off");
    assert!(!proxy.metrics().await.contains(&waiting), "no gauge of an earlier read left");
    assert_eq!(asks(&d), 0);
}

/// A pool following KV events without `max_blocks` sizes its index from what its engines say
/// they hold: 1.25 x the sum of their `num_gpu_blocks` (two engines of 400,000: 1,000,000);
/// a pool that sets `max_blocks` keeps it.
#[tokio::test(flavor = "multi_thread")]
async fn the_events_index_is_sized_from_the_engines_blocks() {
    let page = metrics_page(&[("0", "0", "0.1")]).replace("num_gpu_blocks=\"4096\"", "num_gpu_blocks=\"400000\"");
    let engine = || FakeConfig { metrics_page: Some(page.clone()), ..FakeConfig::default() };
    let [a, b, d] = fakes([engine(), engine(), FakeConfig::default()]).await;
    let bound = r#"tokenonce_kv_index_max_blocks{pool="prefill"}"#;
    for (max_blocks, want) in [("", 1_000_000.0), ("max_blocks = 300000\n", 300_000.0)] {
        let text = config(&[a.host_port(), b.host_port()], &d, 200, 0)
            + &format!("\n[pools.prefill.kv_events]\nport = 5557\n{max_blocks}");
        let proxy = TokenOnce::start(&text).await;
        until_at_least(&proxy, &reads("prefill", &b.host_port(), "ok"), 2.0).await;
        proxy.assert_reaches(bound, want).await;
    }
}
