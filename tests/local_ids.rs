//! Local ids in shadow (`pools.NAME.local_ids = "shadow"`): tokenonce renders and tokenizes
//! each request whose prefill echoed its ids, off the request path, and counts whether its
//! ids equal the echo. The fake prefill's ids are its hash of each word; the pool's tokenizer
//! here gives some words the same ids (so those prompts match) and not others (a mismatch),
//! and the client's answers never change.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use serde_json::json;
use support::*;

const MATCH: &str = r#"tokenonce_local_ids_checks_total{pool="prefill",result="match",shape="completions"}"#;
const MISMATCH: &str = r#"tokenonce_local_ids_checks_total{pool="prefill",result="mismatch",shape="completions"}"#;

/// Completions through an orchestrate route whose prefill pool has `local_ids = "shadow"`: a
/// prompt of words the tokenizer knows by the engine's ids matches, one with another word
/// does not; both answers are the engines' as without shadow; nothing is checked when the
/// pool has it off.
#[tokio::test(flavor = "multi_thread")]
async fn shadow_counts_matches_and_mismatches_and_changes_no_answer() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let config = |mode: &str| {
        format!(
            "[pools.prefill]\nendpoints = [\"{}\"]\ntokenizer = {:?}\nlocal_ids = \"{mode}\"\n[pools.decode]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
            p.host_port(),
            dir.path().display().to_string(),
            d.host_port()
        )
    };
    let proxy = TokenOnce::start(&config("shadow")).await;
    let url = format!("{}/v1/completions", proxy.url);
    let body = |prompt: &str| json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    let (status, _, known) = post_json(&url, &body("alpha bravo alpha"), &[]).await;
    assert_eq!(status, 200, "{known}");
    assert_eq!(proxy.metric_reaches(MATCH, 1.0).await, 1.0);
    let (status, _, unknown) = post_json(&url, &body("alpha charlie"), &[]).await;
    assert_eq!(status, 200, "{unknown}");
    assert_eq!(proxy.metric_reaches(MISMATCH, 1.0).await, 1.0);
    assert_eq!(proxy.metric(MATCH).await, 1.0);

    // The same requests without shadow: the same answers, nothing checked.
    let off = TokenOnce::start(&config("off")).await;
    let off_url = format!("{}/v1/completions", off.url);
    let text = |t: &str| serde_json::from_str::<serde_json::Value>(t).unwrap()["choices"][0]["text"].clone();
    assert_eq!(text(&post_json(&off_url, &body("alpha bravo alpha"), &[]).await.2), text(&known));
    assert_eq!(text(&post_json(&off_url, &body("alpha charlie"), &[]).await.2), text(&unknown));
    assert!(!off.metrics().await.contains("tokenonce_local_ids_checks_total{"), "no check with local_ids off");
}

/// `local_ids` needs the pool's tokenizer, and a folder whose template does not load is a
/// problem at the key.
#[test]
fn shadow_needs_a_tokenizer_and_a_template_that_loads() {
    let base = "[pools.decode]\nendpoints = [\"127.0.0.1:1\"]\n";
    let err = tokenonce::config::from_toml(&format!("{base}local_ids = \"shadow\"\n"), "t").unwrap_err();
    assert_eq!(err.problems[0].key, "pools.decode.local_ids", "{:?}", err.problems);
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    std::fs::write(dir.path().join("tokenizer_config.json"), "{\"chat_template\": \"{% if %}\"}").unwrap();
    let text = format!("{base}tokenizer = {:?}\nlocal_ids = \"shadow\"\n", dir.path().display().to_string());
    let err = tokenonce::config::from_toml(&text, "t").unwrap_err();
    assert_eq!(err.problems[0].key, "pools.decode.local_ids", "{:?}", err.problems);
    assert!(err.problems[0].message.contains("cannot render locally"), "{:?}", err.problems);
    let err = tokenonce::config::from_toml(&format!("{base}local_ids = \"on\"\n"), "t").unwrap_err();
    assert!(err.problems[0].message.contains("off, shadow"), "{:?}", err.problems);
}

/// Chat prompts are tokenized segment by segment through the pool's cache: a follow-up turn
/// that repeats the conversation finds its earlier segments (`segment_cache_lookups_total`
/// hits), and each chat request is checked under its shape.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_up_turn_reuses_the_segments_of_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let config = format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\ntokenizer = {:?}\nlocal_ids = \"shadow\"\n[pools.decode]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
        p.host_port(),
        dir.path().display().to_string(),
        d.host_port()
    );
    let proxy = TokenOnce::start(&config).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let first = json!([{"role": "user", "content": "alpha bravo"}]);
    let follow_up = json!([{"role": "user", "content": "alpha bravo"}, {"role": "assistant", "content": "bravo"},
                            {"role": "user", "content": "alpha"}]);
    for messages in [first, follow_up] {
        let body = json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 3});
        let (status, _, text) = post_json(&url, &body, &[]).await;
        assert_eq!(status, 200, "{text}");
    }
    let checked = |shape: &str| {
        format!(r#"tokenonce_local_ids_checks_total{{pool="prefill",result="mismatch",shape="{shape}"}}"#)
    };
    // The fake engine renders its own way, so these differ; each is checked under its shape.
    assert_eq!(proxy.metric_reaches(&checked("chat"), 1.0).await, 1.0);
    assert_eq!(proxy.metric_reaches(&checked("chat_multi_turn"), 1.0).await, 1.0);
    let hits = proxy.metric(r#"tokenonce_segment_cache_lookups_total{pool="prefill",result="hit"}"#).await;
    let misses = proxy.metric(r#"tokenonce_segment_cache_lookups_total{pool="prefill",result="miss"}"#).await;
    assert!(hits >= 2.0, "the follow-up found the first turn's segments: {hits} hits, {misses} misses");
    assert!(proxy.metric(r#"tokenonce_segment_cache_bytes{pool="prefill"}"#).await > 0.0);
}
