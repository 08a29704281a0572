//! The renderer against real vLLM 0.32.0: every recorded case of tests/fixtures/render/cases.json
//! (re-recorded by tests/e2e/record_render.py) renders to exactly vLLM's prompt text with the
//! Qwen3 template committed in tests/fixtures/render/qwen3, or gives its fallback reason.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;

use serde_json::Value;
use tokenonce::render::{render_chat, render_completion, ChatTemplate, LoadOptions};

const QWEN3_TOKENS: [(&str, &str); 2] = [("eos_token", "<|im_end|>"), ("pad_token", "<|endoftext|>")];

/// The committed cases, or (for a local check of another template, see record_render.py
/// --template) the file `TOKENONCE_RENDER_CASES` names.
fn cases_path() -> (String, bool) {
    match std::env::var("TOKENONCE_RENDER_CASES") {
        Ok(path) => (path, false),
        Err(_) => (format!("{}/tests/fixtures/render/cases.json", env!("CARGO_MANIFEST_DIR")), true),
    }
}

fn cases() -> Vec<Value> {
    let (path, _) = cases_path();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(doc["vllm_version"], "0.32.0");
    doc["cases"].as_array().unwrap().clone()
}

fn qwen3() -> ChatTemplate {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/render/qwen3");
    ChatTemplate::load(&folder, LoadOptions::default()).unwrap()
}

/// Every case vLLM rendered is rendered to the same text; every refused or unsupported one
/// gives the reason recorded with it.
#[test]
fn every_recorded_case_renders_as_vllm_or_says_why_not() {
    let qwen3 = qwen3();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/render");
    let mut exact = 0;
    let mut unsupported = 0;
    let mut failures = Vec::new();
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let body = case["body"].as_str().unwrap().as_bytes();
        // A case with its own template was sent with it as the request's chat_template; it
        // renders with the Qwen3 tokenizer's special tokens.
        let own;
        let template = match case["template"].as_str() {
            Some(file) => {
                let text = std::fs::read_to_string(fixtures.join(file)).unwrap();
                own = ChatTemplate::from_source(&text, &QWEN3_TOKENS, LoadOptions::default()).unwrap();
                &own
            }
            None => &qwen3,
        };
        let result = match case["api"].as_str().unwrap() {
            "chat" => render_chat(template, body).map(|r| r.text),
            _ => render_completion(body).map(|r| r.text),
        };
        match (case["expect_unsupported"].as_str(), result) {
            (Some(want), Err(reason)) if want == "*" || reason.label() == want => unsupported += 1,
            (None, Ok(text)) if Some(text.as_str()) == case["prompt_text"].as_str() => exact += 1,
            (want, got) => failures.push(format!(
                "{name}: want {:?}, got {got:?}",
                want.map(str::to_owned).or_else(|| case["prompt_text"].as_str().map(str::to_owned))
            )),
        }
    }
    assert!(failures.is_empty(), "{} failing:\n{}", failures.len(), failures.join("\n\n"));
    if cases_path().1 {
        assert!(exact >= 70, "only {exact} exact cases");
        assert!(unsupported >= 10, "only {unsupported} unsupported cases");
    }
    println!("{exact} exact, {unsupported} unsupported as expected");
}

/// The recorded cases vLLM refused are all ones tokenonce refuses to render.
#[test]
fn every_case_vllm_refused_is_unsupported_here() {
    for case in cases() {
        if case["status"] != 200 {
            assert!(case["expect_unsupported"].is_string(), "{}", case["name"]);
        }
    }
}

/// The committed Qwen3 folder loads with transformers' special tokens (no bos, no unk).
#[test]
fn the_qwen3_folder_loads_with_its_special_tokens() {
    let t = qwen3();
    let tokens: Vec<(&str, &str)> = t.special_tokens().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(tokens, QWEN3_TOKENS);
}

/// Small probe templates render as transformers' jinja2 renders them (recorded by
/// tests/e2e/record_jinja_probes.py): the same text, or an error where jinja2 raises. A probe
/// minijinja cannot render (an error here, text in jinja2) is a fallback, not a wrong prompt;
/// those are listed in `FALLS_BACK` so a new one is noticed.
#[test]
fn jinja_probes_render_as_jinja2_does() {
    // jinja2 renders these; the renderer refuses them (the request falls back).
    const FALLS_BACK: [&str; 8] = [
        "[{{ 'x' | int }}]",
        "[{{ 'abc'.rsplit('b') }}]",
        "[{{ 'abc'.index('c') }}]",
        "[{{ '%s and %s' % ('a', 'b') }}]",
        "[{{ '%d' % 3 }}]",
        "[{{ 'a b' | wordcount }}]",
        "[{{ 'abc' | center(7) }}]",
        "[{{ 'a-b'.partition('-') }}]",
    ];
    // Known differences: jinja2 refuses `1 < 'a'` (TypeError, a 400 from vLLM) where minijinja
    // compares; Python's str.title() keeps a titlecase letter (ǅ) that Rust uppercases.
    const KNOWN: [&str; 2] = ["[{{ 1 < 'a' }}]", "[{{ 'ǅ'.title() }}]"];
    let path = format!("{}/tests/fixtures/render/jinja_probes.json", env!("CARGO_MANIFEST_DIR"));
    let probes: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let body = br#"{"messages": [{"role": "user", "content": "u"}]}"#;
    let mut wrong = Vec::new();
    for p in &probes {
        let src = p["template"].as_str().unwrap();
        let got = ChatTemplate::from_source(src, &QWEN3_TOKENS, LoadOptions::default())
            .map_err(|e| e.to_string())
            .and_then(|t| render_chat(&t, body).map(|r| r.text).map_err(|e| e.to_string()));
        match (p["text"].as_str(), &got) {
            (Some(want), Ok(text)) if want == text => {}
            (None, Err(_)) => {}
            (Some(_), Err(_)) if FALLS_BACK.contains(&src) => {}
            _ if KNOWN.contains(&src) => {}
            (want, got) => wrong.push(format!("{src:?}: jinja2 {:?}, here {got:?}", want.ok_or(&p["error"]))),
        }
    }
    assert!(wrong.is_empty(), "{} of {} probes differ:\n{}", wrong.len(), probes.len(), wrong.join("\n"));
}
