//! Local ids in shadow (`pools.NAME.local_ids = "shadow"`): tokenonce renders and tokenizes
//! each request whose prefill echoed its ids, off the request path, and counts whether its
//! ids equal the echo. The fake prefill's ids are its hash of each word; the pool's tokenizer
//! here gives some words the same ids (so those prompts match) and not others (a mismatch),
//! and the client's answers never change.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::json;
use support::*;

/// A prefill fake's pool with the model folder `model` and the local-ids `keys`, a decode
/// fake's pool, and route `pd` between them.
fn local_config(p: &FakeVllm, d: &FakeVllm, model: &std::path::Path, keys: &str) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\ntokenizer = {:?}\n{keys}[pools.decode]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
        p.host_port(),
        model.display().to_string(),
        d.host_port()
    )
}

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
    let config = |mode: &str| local_config(&p, &d, dir.path(), &format!("local_ids = \"{mode}\"\n"));
    let proxy = TokenOnce::start(&config("shadow")).await;
    let url = format!("{}/v1/completions", proxy.url);
    let body = |prompt: &str| json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    let (status, _, known) = post_json(&url, &body("alpha bravo alpha"), &[]).await;
    assert_eq!(status, 200, "{known}");
    proxy.assert_reaches(MATCH, 1.0).await;
    let (status, _, unknown) = post_json(&url, &body("alpha charlie"), &[]).await;
    assert_eq!(status, 200, "{unknown}");
    proxy.assert_reaches(MISMATCH, 1.0).await;
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
    let err = tokenonce::config::from_toml(&format!("{base}local_ids = \"always\"\n"), "t").unwrap_err();
    assert_eq!(err.problems[0].message, "`always` is not one of: off, shadow, on", "{:?}", err.problems);
}

/// Chat prompts are tokenized segment by segment through the pool's cache: a follow-up turn
/// that repeats the conversation finds its earlier segments (`segment_cache_lookups_total`
/// hits), and each chat request is checked under its shape.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_up_turn_reuses_the_segments_of_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let config = local_config(&p, &d, dir.path(), "local_ids = \"shadow\"\n");
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
    proxy.assert_reaches(&checked("chat"), 1.0).await;
    proxy.assert_reaches(&checked("chat_multi_turn"), 1.0).await;
    let hits = proxy.metric(r#"tokenonce_segment_cache_lookups_total{pool="prefill",result="hit"}"#).await;
    let misses = proxy.metric(r#"tokenonce_segment_cache_lookups_total{pool="prefill",result="miss"}"#).await;
    assert!(hits >= 2.0, "the follow-up found the first turn's segments: {hits} hits, {misses} misses");
    assert!(proxy.metric(r#"tokenonce_segment_cache_bytes{pool="prefill"}"#).await > 0.0);
}

/// `local_ids = "on"` (trusted after 2 matches in a row, every other trusted request
/// rechecked): completions of words the tokenizer knows match twice, the shape is trusted and
/// the next prefill goes token-in (`prompt` as tokenonce's ids, no echo asked) with the decode
/// given the same ids; the recheck after it, of a word the tokenizer does not know, differs,
/// and the shape goes back to text.
#[tokio::test(flavor = "multi_thread")]
async fn on_sends_trusted_shapes_token_in_and_a_mismatch_ends_the_trust() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let config =
        local_config(&p, &d, dir.path(), "local_ids = \"on\"\nlocal_ids_verify_after = 2\nlocal_ids_recheck = 0.5\n");
    let proxy = TokenOnce::start(&config).await;
    let url = format!("{}/v1/completions", proxy.url);
    let send = |prompt: &'static str| {
        let url = url.clone();
        async move {
            let body = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
            let (status, _, text) = post_json(&url, &body, &[]).await;
            assert_eq!(status, 200, "{prompt}: {text}");
        }
    };
    let trusted = r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#;
    let last_prefill = || p.posts().last().unwrap().json();
    send("alpha bravo alpha").await;
    proxy.assert_reaches(MATCH, 1.0).await;
    assert_eq!(proxy.metric(trusted).await, 0.0, "one match is not enough");
    send("bravo alpha").await;
    proxy.assert_reaches(MATCH, 2.0).await;
    proxy.assert_reaches(trusted, 1.0).await;
    assert_eq!(last_prefill()["return_token_ids"], true, "before trust, the prefill echoes");

    send("alpha alpha").await;
    let ids: Vec<u64> = ["alpha", "alpha"].iter().map(|w| fake_tokenize(w)[0]).collect();
    assert_eq!(last_prefill()["prompt"], json!(ids), "the prefill got tokenonce's ids");
    assert!(last_prefill().get("return_token_ids").is_none(), "and was asked no echo");
    assert_eq!(d.posts().last().unwrap().json()["prompt"], json!(ids), "the decode got the same ids");
    let token_in = r#"tokenonce_local_ids_token_in_total{pool="prefill",shape="completions"}"#;
    proxy.assert_reaches(token_in, 1.0).await;
    let applied = r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#;
    assert_eq!(proxy.metric_reaches(applied, 3.0).await, 3.0, "three decodes reused ids");

    // A reload of the unchanged file keeps the trust (and the next request is a recheck).
    proxy.reload(&config).await;
    assert_eq!(proxy.metric(trusted).await, 1.0, "the reload kept the shape's trust");

    send("alpha charlie").await;
    assert_eq!(last_prefill()["prompt"], "alpha charlie", "the recheck goes as text");
    proxy.assert_reaches(MISMATCH, 1.0).await;
    assert_eq!(proxy.metric_reaches(trusted, 0.0).await, 0.0, "a mismatch ends the trust");
    send("alpha bravo").await;
    assert_eq!(last_prefill()["return_token_ids"], true, "untrusted again: text with the echo");
    assert_eq!(proxy.metric(token_in).await, 1.0);
}

/// An empty completions prompt of a trusted shape is not rendered: vLLM refuses an empty
/// prompt when it reads the request, so it goes to the prefill as text (for the engine to
/// refuse in its own words), never as `prompt: []` (tests/refusals.rs: also where `""` has
/// a BOS id).
#[tokio::test(flavor = "multi_thread")]
async fn an_empty_prompt_of_a_trusted_shape_goes_as_text() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let keys = "local_ids = \"on\"\nlocal_ids_verify_after = 1\nlocal_ids_recheck = 0.0\n";
    let proxy = TokenOnce::start(&local_config(&p, &d, dir.path(), keys)).await;
    let url = format!("{}/v1/completions", proxy.url);
    let body = |prompt: &str| json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3});
    let (status, _, text) = post_json(&url, &body("alpha bravo"), &[]).await;
    assert_eq!(status, 200, "{text}");
    proxy.assert_reaches(r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#, 1.0).await;
    post_json(&url, &body("bravo alpha"), &[]).await;
    let token_in = r#"tokenonce_local_ids_token_in_total{pool="prefill",shape="completions"}"#;
    proxy.assert_reaches(token_in, 1.0).await;

    post_json(&url, &body(""), &[]).await;
    let prefill = p.posts().last().unwrap().json();
    assert_eq!(prefill["prompt"], "", "the empty prompt went as text");
    assert_eq!(prefill["return_token_ids"], true, "with the echo, as any text prefill");
    assert_eq!(proxy.metric(token_in).await, 1.0, "not token-in");
}

/// A trusted shape stays trusted over a reload of the unchanged pool, and starts over when
/// the reload changes the model folder's template or the pool's local-ids policy.
#[tokio::test(flavor = "multi_thread")]
async fn trust_survives_a_reload_of_the_unchanged_pool_only() {
    let dir = tempfile::tempdir().unwrap();
    write_local_model(dir.path());
    let (p, d) = (FakeVllm::start(FakeConfig::default()).await, FakeVllm::start(FakeConfig::default()).await);
    let config = |after: u32| {
        local_config(
            &p,
            &d,
            dir.path(),
            &format!("local_ids = \"on\"\nlocal_ids_verify_after = {after}\nlocal_ids_recheck = 0.0\n"),
        )
    };
    let proxy = TokenOnce::start(&config(1)).await;
    let url = format!("{}/v1/completions", proxy.url);
    let body = json!({"model": "tiny-qwen3", "prompt": "alpha bravo", "max_tokens": 3});
    assert_eq!(post_json(&url, &body, &[]).await.0, 200);
    let trusted = r#"tokenonce_local_ids_trusted{pool="prefill",shape="completions"}"#;
    proxy.assert_reaches(trusted, 1.0).await;
    proxy.reload(&config(1)).await;
    assert_eq!(proxy.metric(trusted).await, 1.0, "unchanged: still trusted");
    // Another template of the same length in the model folder: a new renderer, no trust.
    let tokenizer_config = dir.path().join("tokenizer_config.json");
    let text = std::fs::read_to_string(&tokenizer_config).unwrap();
    let edited = text.replace("\\n{{ m.content }}", " {{ m.content }}");
    assert!(edited != text && edited.len() + 1 == text.len(), "the template's newline became a space");
    std::fs::write(&tokenizer_config, edited).unwrap();
    proxy.reload(&config(1)).await;
    assert_eq!(proxy.metric(trusted).await, 0.0, "another template: the shape earns its trust again");
    assert_eq!(post_json(&url, &body, &[]).await.0, 200);
    proxy.assert_reaches(trusted, 1.0).await;
    proxy.reload(&config(5)).await;
    assert_eq!(proxy.metric(trusted).await, 0.0, "another policy: the shape earns its trust again");
}

/// History drift, on a family that drops reasoning from history: Qwen3's template renders an
/// assistant turn with its `<think>` part while it is the latest turn (as it was generated),
/// and without it once a user turn follows. A checked follow-up turn counts the tokens of the
/// earlier conversation it renders otherwise, from the `<think>` on; under a template that
/// repeats its history (the plain ChatML one) the same kind of turn counts as `same`.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_up_turn_counts_the_history_its_template_renders_otherwise() {
    let messages = json!([
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "<think>\nYou are terse.\n</think>\n\nHi"},
        {"role": "user", "content": "Hello there!"},
    ]);
    let body = json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 3});
    let series = |name: &str| format!("tokenonce_prompt_history_{name}{{pool=\"prefill\"}}");
    let turns = |result: &str| format!(r#"tokenonce_prompt_history_turns_total{{pool="prefill",result="{result}"}}"#);

    for (family, write) in [("qwen3", write_qwen3_model as fn(&std::path::Path)), ("chatml", write_local_model)] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path());
        let template = tokenonce::render::ChatTemplate::load(dir.path(), Default::default()).unwrap();
        let tokenizer = tokenonce::parity::Tokenizer::load(&dir.path().join("tokenizer.json")).unwrap();
        let policy =
            tokenonce::local::Policy { mode: tokenonce::config::LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
        let local = tokenonce::local::LocalIds::new("t", template.into(), tokenizer.into(), policy).unwrap();
        let (now, shape) = local.ids(tokenonce::openai::Api::Chat, &serde_json::to_vec(&body).unwrap()).unwrap();
        assert_eq!(shape, "chat_multi_turn");
        // The prefill engine tokenizes as tokenonce does, so the check matches.
        let p = FakeVllm::start(FakeConfig {
            text_prompt_ids: Some(now.iter().map(|&i| u64::from(i)).collect()),
            ..FakeConfig::default()
        })
        .await;
        let d = FakeVllm::start(FakeConfig::default()).await;
        let proxy = TokenOnce::start(&local_config(&p, &d, dir.path(), "local_ids = \"shadow\"\n")).await;
        assert_eq!(proxy.metric(&turns("drift")).await, 0.0, "{family}: shown from the first scrape");
        let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
        assert_eq!(status, 200, "{text}");
        let matched = r#"tokenonce_local_ids_checks_total{pool="prefill",result="match",shape="chat_multi_turn"}"#;
        proxy.assert_reaches(matched, 1.0).await;
        if family == "chatml" {
            proxy.assert_reaches(&turns("same"), 1.0).await;
            assert_eq!(proxy.metric(&series("drift_tokens_total")).await, 0.0);
            continue;
        }
        proxy.assert_reaches(&turns("drift"), 1.0).await;
        let at = proxy.metric(&series("drift_start_tokens_total")).await as usize;
        let changed = proxy.metric(&series("drift_tokens_total")).await as usize;
        // Up to the assistant turn's header both agree; there the generated form has its
        // reasoning, which the follow-up dropped.
        let vocab = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let text_now = vocab.decode(&now[..at], false).unwrap();
        assert!(text_now.ends_with("<|im_start|> assistant"), "drift starts after the assistant header: {text_now:?}");
        assert_eq!(vocab.decode(&now[at..at + 1], false).unwrap(), "Hi", "the follow-up goes on without the reasoning");
        // The conversation as generated: from `at` on, its reasoning, answer and end of turn.
        let previous = tokenonce::local::drift::previous_turn(&serde_json::to_vec(&body).unwrap()).unwrap();
        let (then, _) = local.ids(tokenonce::openai::Api::Chat, &previous).unwrap();
        assert_eq!(then[..at], now[..at]);
        assert_eq!(then.len(), at + changed, "every token of it from the first difference");
        let generated = vocab.decode(&then[at..], false).unwrap();
        assert_eq!(generated, "<think> You are terse. </think> Hi <|im_end|>", "{changed} tokens");
    }
}
