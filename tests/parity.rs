//! Proving the ids belong to the request, against fake engines and a real (small) tokenizer
//! built with the `tokenizers` crate to match the fake's word hashing: right ids match,
//! another request's ids and ids read with another tokenizer are mismatches (counted; under
//! `disable_reuse` the route goes text until samples match again), ids past the vocabulary
//! never reach the decode, and pools serving different models never exchange ids.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use support::*;
use tokenizers::Tokenizer;

/// Every word the tests' prompts render to (the fake's template included).
const WORDS: &[&str] = &[
    "<|im_start|>system",
    "You",
    "are",
    "terse.",
    "<|im_end|>",
    "<|im_start|>user",
    "<|im_start|>assistant",
    "alpha",
    "bravo",
    "charlie",
    "delta",
];

/// Words a request sends (the fake hashes them as sent) and the text the ids decode to:
/// what an NFC normalizer (Qwen3's) makes of decomposed accents, and one already composed.
const NORMALIZED: &[(&str, &str)] =
    &[("Cafe\u{301}", "Caf\u{e9}"), ("bru\u{302}le\u{301}e", "br\u{fb}l\u{e9}e"), ("cr\u{e8}me", "cr\u{e8}me")];

/// A word-level tokenizer giving each word the fake engine's id for it (`shift` 0), or
/// other ids (`shift` > 0: "another tokenizer"), written as `tokenizer.json` in `dir` in the
/// library's own format (loaded back with it here, and by tokenonce).
fn write_tokenizer(dir: &Path, shift: u64) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    for (i, w) in WORDS.iter().enumerate() {
        let fake = fake_tokenize(w)[0];
        let id = if shift == 0 { fake } else { (fake + shift + i as u64) % 150_000 };
        vocab.insert((*w).to_owned(), json!(id));
    }
    for (sent, read) in NORMALIZED {
        vocab.insert((*read).to_owned(), json!(fake_tokenize(sent)[0]));
    }
    vocab.insert("<unk>".into(), json!(150_000));
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, file.to_string()).unwrap();
    let tk = Tokenizer::from_file(&path).unwrap();
    let alpha = vocab_id(&tk, "alpha");
    assert_eq!(tk.encode("alpha", false).unwrap().get_ids(), [alpha], "the library reads the file back");
    assert_eq!(alpha as u64 == fake_tokenize("alpha")[0], shift == 0);
    path
}

fn vocab_id(tk: &Tokenizer, word: &str) -> u32 {
    tk.token_to_id(word).unwrap()
}

fn config(p: &FakeVllm, d: &FakeVllm, tokenizer: &Path, route_extra: &str) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\n\n[pools.decode]\nendpoints = [\"{}\"]\ntokenizer = {:?}\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\nparity_sample = 1.0\n{route_extra}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        p.host_port(),
        d.host_port(),
        tokenizer.display().to_string()
    )
}

async fn chat(proxy: &TokenOnce, user: &str) -> Value {
    let (status, text) = proxy.chat(user).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn checks(result: &str) -> String {
    format!(r#"tokenonce_parity_checks_total{{result="{result}",route="pd"}}"#)
}

fn reuse(reason: &str) -> String {
    if reason == "none" {
        r#"tokenonce_token_reuse_total{reason="none",result="applied",route="pd"}"#.to_owned()
    } else {
        format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="pd"}}"#)
    }
}

/// A running set-up: fake prefill `p` and decode `d`, tokenonce on a route whose pools have
/// the test tokenizer (word ids shifted by `shift`), and the folder holding it.
struct Stack {
    _dir: tempfile::TempDir,
    p: FakeVllm,
    d: FakeVllm,
    proxy: TokenOnce,
    /// The config it runs (for a reload of the same file).
    text: String,
}

async fn stack(shift: u64, prefill: FakeConfig, route_extra: &str) -> Stack {
    stack_with(shift, prefill, route_extra, &Settings::default()).await
}

async fn stack_with(shift: u64, prefill: FakeConfig, route_extra: &str, settings: &Settings) -> Stack {
    let dir = tempfile::tempdir().unwrap();
    let tk = write_tokenizer(dir.path(), shift);
    let p = FakeVllm::start(prefill).await;
    let d = FakeVllm::start(FakeConfig::default()).await;
    let text = config(&p, &d, &tk, route_extra);
    let proxy = TokenOnce::start_with(&text, settings).await;
    proxy.wait_ready(200).await;
    Stack { _dir: dir, p, d, proxy, text }
}

const REUSE_OFF: &str = r#"tokenonce_parity_reuse_off{route="pd"}"#;
const MODELS_DIFFER: &str = r#"tokenonce_pool_models_differ{route="pd"}"#;

/// The ids the fake echoes for a chat with user content `user`.
fn ids_of(user: &str) -> String {
    let body = chat_body(user, json!({}));
    serde_json::to_string(&fake_tokenize(&fake_render_chat(&body))).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_right_ids_match_and_another_requests_ids_are_a_mismatch() {
    let Stack { p, proxy, .. } = &stack(0, FakeConfig::default(), "").await;
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&checks("match"), 1.0).await;
    // A prefill answering another request's ids (same count, so the gate passes them).
    p.configure(|c| c.corrupt_prompt_ids = Some(ids_of("bravo")));
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&checks("mismatch"), 1.0).await;
    // `alert` (the default): counted and logged, reuse stays on.
    assert_eq!(proxy.metric(&reuse("none")).await, 2.0);
    assert_eq!(proxy.metric(r#"tokenonce_parity_reuse_off{route="pd"}"#).await, 0.0);
    assert_eq!(proxy.metric(&checks("dropped")).await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn ids_past_the_vocabulary_never_reach_the_decode() {
    let Stack { p, d, proxy, .. } = &stack(0, FakeConfig::default(), "").await;
    // Right count, valid integers, one id at the vocabulary bound (`<unk>` is 150000).
    let mut ids: Vec<u64> = serde_json::from_str(&ids_of("alpha")).unwrap();
    ids[2] = 150_001;
    p.configure(|c| c.corrupt_prompt_ids = Some(serde_json::to_string(&ids).unwrap()));
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&reuse("ids_out_of_vocab"), 1.0).await;
    let decode = d.posts().pop().unwrap().json();
    assert!(decode["kv_transfer_params"].get("prompt_token_ids").is_none_or(Value::is_null), "{decode}");
    assert_eq!(proxy.metric(&checks("mismatch")).await + proxy.metric(&checks("match")).await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn ids_read_with_another_tokenizer_are_a_mismatch() {
    let Stack { proxy, .. } = &stack(7, FakeConfig::default(), "").await;
    chat(proxy, "charlie").await;
    proxy.assert_reaches(&checks("mismatch"), 1.0).await;
    assert_eq!(proxy.metric(&checks("match")).await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn disable_reuse_turns_reuse_off_on_a_mismatch_and_on_again_when_samples_match() {
    let extra = "on_parity_mismatch = \"disable_reuse\"\nparity_cooldown_ms = 300\n";
    let Stack { p, d, proxy, .. } = &stack(0, FakeConfig::default(), extra).await;
    p.configure(|c| c.corrupt_prompt_ids = Some(ids_of("bravo")));
    chat(proxy, "charlie").await;
    proxy.assert_reaches(&checks("mismatch"), 1.0).await;
    proxy.assert_reaches(r#"tokenonce_parity_reuse_off{route="pd"}"#, 1.0).await;
    // Reuse is off: the decode goes text, the prefill's ids are still checked.
    chat(proxy, "charlie").await;
    proxy.assert_reaches(&reuse("parity_reuse_off"), 1.0).await;
    proxy.assert_reaches(&checks("mismatch"), 2.0).await;
    let decode = d.posts().pop().unwrap().json();
    assert!(decode["kv_transfer_params"].get("prompt_token_ids").is_none_or(Value::is_null), "{decode}");
    assert_eq!(proxy.metric(r#"tokenonce_parity_reuse_disabled_total{route="pd"}"#).await, 1.0, "once");

    // The prefill is fixed; after the cool-down a matching check turns reuse back on.
    p.configure(|c| c.corrupt_prompt_ids = None);
    tokio::time::sleep(Duration::from_millis(400)).await;
    chat(proxy, "delta").await;
    proxy.assert_reaches(&checks("match"), 1.0).await;
    proxy.assert_reaches(r#"tokenonce_parity_reuse_off{route="pd"}"#, 0.0).await;
    chat(proxy, "delta").await;
    // The first request went token-in before its check ran (the watch is off the request
    // path); the two after the mismatch went text; the last token-in again.
    proxy.assert_reaches(&reuse("none"), 2.0).await;
    assert_eq!(proxy.metric(&reuse("parity_reuse_off")).await, 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn pools_serving_different_models_never_exchange_ids() {
    // Same name, another context length: another model build (or config) behind the name.
    let Stack { p, proxy, .. } = &stack(0, FakeConfig { max_model_len: 32768, ..FakeConfig::default() }, "").await;
    assert_eq!(proxy.metric_reaches_within(MODELS_DIFFER, 1.0, Duration::from_secs(10)).await, 1.0);
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&reuse("model_mismatch"), 1.0).await;
    let prefill = p.posts().pop().unwrap().json();
    assert!(prefill.get("return_token_ids").is_none(), "ids are not even asked for: {prefill}");
    // The prefill restarts serving the decode's model (a rollout finished): ids flow again.
    let healthy = format!(r#"tokenonce_upstream_healthy{{endpoint="{}",pool="prefill"}}"#, p.host_port());
    p.configure(|c| c.healthy = false);
    proxy.assert_reaches(&healthy, 0.0).await;
    p.configure(|c| {
        c.max_model_len = 49152;
        c.healthy = true;
    });
    assert_eq!(proxy.metric_reaches_within(MODELS_DIFFER, 0.0, Duration::from_secs(10)).await, 0.0);
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&reuse("none"), 1.0).await;
}

/// The parity hold is the route's state: a reload of the unchanged file (the SIGHUP path,
/// which rebuilds the watch with its tokenizer read again) keeps reuse off and the gauge at
/// 1, and a matching sample inside the cool-down does not end it.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_keeps_the_parity_hold() {
    let extra = "on_parity_mismatch = \"disable_reuse\"\nparity_cooldown_ms = 600000\n";
    let Stack { p, d, proxy, text, .. } = &stack(0, FakeConfig::default(), extra).await;
    p.configure(|c| c.corrupt_prompt_ids = Some(ids_of("bravo")));
    chat(proxy, "charlie").await;
    proxy.assert_reaches(&checks("mismatch"), 1.0).await;
    proxy.assert_reaches(REUSE_OFF, 1.0).await;
    p.configure(|c| c.corrupt_prompt_ids = None);
    proxy.reload(text).await;
    assert_eq!(proxy.metric(REUSE_OFF).await, 1.0, "the gauge reports the hold");
    chat(proxy, "charlie").await;
    proxy.assert_reaches(&reuse("parity_reuse_off"), 1.0).await;
    assert_eq!(proxy.metric(&reuse("none")).await, 1.0, "only the request before the mismatch went token-in");
    let decode = d.posts().pop().unwrap().json();
    assert!(decode["kv_transfer_params"].get("prompt_token_ids").is_none_or(Value::is_null), "{decode}");
    proxy.assert_reaches(&checks("match"), 1.0).await;
    assert_eq!(proxy.metric(REUSE_OFF).await, 1.0, "a match inside the cool-down keeps the hold");
}

/// Model identity is the route's state: right after a reload of the unchanged file, before
/// any health round could learn it again (one round at start, the next a minute later),
/// pools serving different models still exchange no ids and the gauge still reads 1.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_keeps_the_model_mismatch() {
    let quiet = Settings { health_interval_ms: 60_000, ..Settings::default() };
    let prefill = FakeConfig { max_model_len: 32768, ..FakeConfig::default() };
    let Stack { proxy, text, .. } = &stack_with(0, prefill, "", &quiet).await;
    proxy.assert_reaches(MODELS_DIFFER, 1.0).await;
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&reuse("model_mismatch"), 1.0).await;
    proxy.reload(text).await;
    assert_eq!(proxy.metric(MODELS_DIFFER).await, 1.0, "the gauge reports the state");
    chat(proxy, "alpha").await;
    proxy.assert_reaches(&reuse("model_mismatch"), 2.0).await;
    assert_eq!(proxy.metric(&reuse("none")).await, 0.0, "no ids crossed models");
}

/// The tokenizer is part of the loaded config: replacing its file and reloading (the SIGHUP
/// path) makes the watch read ids with the new one.
#[tokio::test(flavor = "multi_thread")]
async fn a_replaced_tokenizer_file_is_read_again_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let wrong = write_tokenizer(dir.path(), 7);
    let [p, d] = fakes(Default::default()).await;
    let text = config(&p, &d, &wrong, "");
    let proxy = TokenOnce::start(&text).await;
    proxy.wait_ready(200).await;
    chat(&proxy, "charlie").await;
    proxy.assert_reaches(&checks("mismatch"), 1.0).await;
    // The right tokenizer at the same path, then a reload of the unchanged config.
    assert_eq!(write_tokenizer(dir.path(), 0), wrong);
    proxy.reload(&text).await;
    proxy.wait_ready(200).await;
    chat(&proxy, "charlie").await;
    proxy.assert_reaches(&checks("match"), 1.0).await;
    assert_eq!(proxy.metric(&checks("mismatch")).await, 1.0);
}

/// Honest ids of a request whose accents came decomposed (macOS input, Vietnamese, Korean)
/// decode composed, as the tokenizer's normalizer made them: decomposed, composed and mixed
/// text all match, and under `disable_reuse` reuse stays on.
#[tokio::test(flavor = "multi_thread")]
async fn decomposed_composed_and_mixed_accents_match() {
    let extra = "on_parity_mismatch = \"disable_reuse\"\n";
    let Stack { proxy, .. } = &stack(0, FakeConfig::default(), extra).await;
    let texts =
        ["alpha Cafe\u{301} bru\u{302}le\u{301}e", "cr\u{e8}me bravo", "Cafe\u{301} cr\u{e8}me bru\u{302}le\u{301}e"];
    for (n, text) in texts.iter().enumerate() {
        chat(proxy, text).await;
        let done = (n + 1) as f64;
        let seen = proxy.metric_reaches(&checks("match"), done).await + proxy.metric(&checks("mismatch")).await;
        assert!(seen >= done, "check {n} not run");
    }
    assert_eq!(proxy.metric(&checks("mismatch")).await, 0.0, "honest ids read as a mismatch");
    assert_eq!(proxy.metric(&checks("match")).await, 3.0);
    assert_eq!(proxy.metric(REUSE_OFF).await, 0.0);
    assert_eq!(proxy.metric(&reuse("none")).await, 3.0);
}
