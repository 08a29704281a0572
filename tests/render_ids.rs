//! The renderer's text, encoded with the model's real tokenizer, gives exactly vLLM's prompt
//! ids for every recorded case of tests/fixtures/render/cases.json. The tokenizer (~11 MB) is
//! not in the repo: the e2e tier (tests/e2e/run.sh) runs this target with
//! `TOKENONCE_RENDER_MODEL_DIR` set to the model folder setup.sh made; without it, it fails.
//! Not run by a plain `cargo test` (`test = false` in Cargo.toml); run it with
//! `TOKENONCE_RENDER_MODEL_DIR=… cargo test --test render_ids`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::PathBuf;

use serde_json::Value;
use tokenonce::render::{encode, render_chat, render_completion, ChatTemplate, LoadOptions};

const ENV: &str = "TOKENONCE_RENDER_MODEL_DIR";

fn model_dir() -> PathBuf {
    let dir = std::env::var_os(ENV)
        .unwrap_or_else(|| panic!("{ENV} is not set: point it at the model folder (tokenizer.json)"));
    let dir = PathBuf::from(dir);
    assert!(dir.join("tokenizer.json").is_file(), "{ENV}={}: no tokenizer.json there", dir.display());
    dir
}

/// Every case vLLM rendered: our text, encoded as vLLM encodes it, is vLLM's id list; and the
/// template loaded from the model folder itself renders as the committed copy does.
#[test]
fn rendered_text_encodes_to_vllms_ids_for_every_case() {
    let dir = model_dir();
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let from_folder = ChatTemplate::load(&dir, LoadOptions::default()).unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/render");
    let committed = ChatTemplate::load(&fixtures.join("qwen3"), LoadOptions::default()).unwrap();
    let special: Vec<(&str, &str)> =
        from_folder.special_tokens().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let path = format!("{}/tests/fixtures/render/cases.json", env!("CARGO_MANIFEST_DIR"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut checked = 0;
    let mut failures = Vec::new();
    for case in doc["cases"].as_array().unwrap() {
        if case["status"] != 200 || !case["expect_unsupported"].is_null() {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        let body = case["body"].as_str().unwrap().as_bytes();
        let want: Vec<u32> = serde_json::from_value(case["prompt_token_ids"].clone()).unwrap();
        let got = if let Some(file) = case["template"].as_str() {
            // sent with its own template as the request's chat_template
            let src = std::fs::read_to_string(fixtures.join(file)).unwrap();
            let own = ChatTemplate::from_source(&src, &special, LoadOptions::default()).unwrap();
            encode(&tokenizer, &render_chat(&own, body).unwrap().text, false).unwrap()
        } else if case["api"] == "chat" {
            let text = render_chat(&from_folder, body).unwrap().text;
            assert_eq!(
                text,
                render_chat(&committed, body).unwrap().text,
                "{name}: folder and committed template differ"
            );
            encode(&tokenizer, &text, false).unwrap()
        } else {
            let c = render_completion(body).unwrap();
            encode(&tokenizer, &c.text, c.add_special_tokens).unwrap()
        };
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
            failures.push(format!(
                "{name}: first difference at {at}: got {:?} want {:?}",
                got.get(at..),
                want.get(at..)
            ));
        }
        checked += 1;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 40, "only {checked} cases checked");
    println!("{checked} cases: ids equal vLLM's");
}
