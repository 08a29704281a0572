//! Data-parallel ranks: a pool entry `host:port#FIRST-LAST` makes each rank of one vLLM
//! server an endpoint of its own, whose legs (prefill, decode, passthrough) carry
//! `X-data-parallel-rank`; balancing, health and ejection go per rank. The fakes refuse a
//! rank past their DP size as vLLM 0.32 does and record the rank each request named.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use serde_json::json;
use support::*;

/// Prefill `p` as two ranks, decode `d` as four, route `pd` for chat, passthrough for the rest.
fn ranked_config(p: &FakeVllm, d: &FakeVllm) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{}#0-1\"]\n\n[pools.decode]\nendpoints = [\"{}#0-3\"]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n\n[defaults]\npassthrough_pool = \"decode\"\n",
        p.host_port(),
        d.host_port()
    )
}

fn ranks_named(engine: &FakeVllm) -> Vec<Option<String>> {
    engine.posts().iter().map(|r| r.header("x-data-parallel-rank")).collect()
}

/// Round robin over ranks: every leg names its endpoint's rank (a client's own rank header
/// is replaced), each rank of each pool gets its share, and the answers are the engine's.
#[tokio::test(flavor = "multi_thread")]
async fn legs_name_the_rank_of_their_endpoint() {
    let p = FakeVllm::start(FakeConfig { dp_size: 2, connector: true, ..FakeConfig::default() }).await;
    let d = FakeVllm::start(FakeConfig { dp_size: 4, ..FakeConfig::default() }).await;
    let proxy = TokenOnce::start(&ranked_config(&p, &d)).await;
    for _ in 0..8 {
        let (status, text) = proxy.chat_with("Hello there!", json!({}), &[("x-data-parallel-rank", "7")]).await;
        assert_eq!(status, 200, "{text}");
    }
    let count = |ranks: &[Option<String>], r: &str| ranks.iter().filter(|x| x.as_deref() == Some(r)).count();
    let (pr, dr) = (ranks_named(&p), ranks_named(&d));
    assert_eq!((pr.len(), dr.len()), (8, 8));
    assert_eq!((count(&pr, "0"), count(&pr, "1")), (4, 4), "{pr:?}");
    for r in ["0", "1", "2", "3"] {
        assert_eq!(count(&dr, r), 2, "{dr:?}");
    }
    // The decode got the handoff of the prefill whatever ranks the two legs ran on.
    assert!(d.posts().iter().all(|r| r.json()["kv_transfer_params"]["remote_engine_id"] == "fake-engine"));
    // Passthrough (no API path) names a rank too.
    let (status, _, _) = post_raw(&format!("{}/tokenize", proxy.url), r#"{"prompt":"hi"}"#, &[]).await;
    assert_eq!(status, 200);
    let last = d.posts().last().unwrap().header("x-data-parallel-rank").unwrap();
    assert!(["0", "1", "2", "3"].contains(&last.as_str()), "{last}");
    // Each rank has its own health series.
    for r in 0..4 {
        let series = format!(r#"tokenonce_upstream_healthy{{endpoint="{}#{r}",pool="decode"}}"#, d.host_port());
        assert_eq!(proxy.metric_reaches(&series, 1.0).await, 1.0, "{series}");
    }
}

/// One rank failing (503) is ejected alone after `eject_after_failures` in a row; its
/// server's other ranks keep serving, so every later request succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_rank_is_ejected_alone() {
    let p = FakeVllm::start(FakeConfig { dp_size: 2, connector: true, ..FakeConfig::default() }).await;
    let d = FakeVllm::start(FakeConfig { dp_size: 4, failing_rank: Some(2), ..FakeConfig::default() }).await;
    // An ejection of a minute outlasts the test on a loaded machine (the default 5 s did not).
    let upstream_extra = "eject_after_failures = 2\neject_base_ms = \"60s\"\n".into();
    let settings = Settings { upstream_extra, ..Settings::default() };
    let proxy = TokenOnce::start_with(&ranked_config(&p, &d), &settings).await;
    let mut failed = 0;
    for _ in 0..8 {
        let (status, _) = proxy.chat("Hello there!").await;
        failed += usize::from(status != 200);
    }
    assert_eq!(failed, 2, "rank 2 fails twice, then is ejected");
    assert_eq!(proxy.metric(r#"tokenonce_upstream_ejected{pool="decode"}"#).await, 1.0);
    let before = d.posts().len();
    for _ in 0..12 {
        let (status, text) = proxy.chat("Hello there!").await;
        assert_eq!(status, 200, "{text}");
    }
    let ranks = ranks_named(&d).split_off(before);
    assert!(!ranks.contains(&Some("2".into())), "{ranks:?}");
    assert!(["0", "1", "3"].iter().all(|r| ranks.contains(&Some((*r).into()))), "{ranks:?}");
}

/// A rank past the server's data-parallel size: vLLM refuses it with a 400 naming the rank,
/// which reaches the client unchanged (a configuration error, not the engine failing).
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_past_the_servers_size_gets_vllms_400() {
    let p = FakeVllm::start(FakeConfig { dp_size: 2, connector: true, ..FakeConfig::default() }).await;
    let d = FakeVllm::start(FakeConfig { dp_size: 2, ..FakeConfig::default() }).await;
    let proxy = TokenOnce::start(&ranked_config(&p, &d)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut refused = None;
    while refused.is_none() && Instant::now() < deadline {
        let (status, text) = proxy.chat("Hello there!").await;
        if status == 400 {
            refused = Some(text);
        }
    }
    let text = refused.expect("ranks 2 and 3 are past a size of 2");
    assert!(text.contains("data_parallel_rank") && text.contains("out of range"), "{text}");
    assert!(!text.contains("127.0.0.1"), "{text}");
}

/// Entries with ranks are checked at load: a malformed or reversed range names the entry.
#[test]
fn rank_entries_are_checked_at_load() {
    for (entry, ok) in [
        ("127.0.0.1:8000#0-7", true),
        ("127.0.0.1:8000#3", true),
        ("127.0.0.1:8000#", false),
        ("127.0.0.1:8000#7-0", false),
        ("127.0.0.1:8000#0-300", false),
        ("127.0.0.1:8000#-1", false),
        ("127.0.0.1#2", false),
    ] {
        let text = format!(
            "[pools.decode]\nendpoints = [\"{entry}\"]\n[[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n"
        );
        let result = tokenonce::config::Config::from_toml(&text, "t.toml");
        assert_eq!(result.is_ok(), ok, "{entry}: {result:?}");
        if let Err(e) = result {
            let problems: Vec<String> = e.problems.iter().map(ToString::to_string).collect();
            assert!(problems.iter().any(|p| p.contains("pools.decode.endpoints") && p.contains(entry)), "{problems:?}");
        }
    }
}
