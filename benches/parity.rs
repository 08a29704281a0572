//! Cost of the parity work at a ~37k-token prompt, with the real Qwen3 tokenizer the e2e tier
//! installs: the vocabulary gate on the request path (id validation with and without the
//! bound, one pass over the id JSON) and one parity check off the request path (read the
//! request's contents, decode the ids, search the contents in order).
//!
//! Run: `cargo bench --bench parity` (after `bash tests/e2e/vllm/setup.sh` installed the
//! model; `TOKENONCE_TOKENIZER=path` names another `tokenizer.json` or model folder; `--runs N`
//! rounds, default 50). Prints min / median / p99 per step, in ms. Timings are printed, never
//! asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use tokenonce::openai::{Api, PromptIds};
use tokenonce::parity::check::{check, expected_contents, Verdict};
use tokenonce::parity::Tokenizer;

/// The prompt size README quotes (Ray Serve's measurement point).
const TARGET_TOKENS: usize = 37_000;
const MESSAGES: usize = 58;
/// Bounds the whole run whatever `--runs` says.
const MAX_SECONDS: u64 = 120;

/// A Qwen3-style rendering of `MESSAGES` chat turns of prose, and the request body they come
/// from; grown until the rendering is about `TARGET_TOKENS` tokens.
fn prompt(tk: &tokenizers::Tokenizer) -> (Vec<u32>, Vec<u8>) {
    let sentence =
        "The decode engine reads the prompt ids the prefill echoed, so the prompt is rendered and tokenized once; ";
    let mut words = 40;
    loop {
        let mut messages = Vec::new();
        let mut rendered = String::new();
        for i in 0..MESSAGES {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let content: String = format!("turn {i}: {}", sentence.repeat(words / 10 + 1));
            rendered.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
            messages.push(serde_json::json!({"role": role, "content": content}));
        }
        rendered.push_str("<|im_start|>assistant\n");
        let ids = tk.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
        if ids.len() >= TARGET_TOKENS {
            let body = serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap();
            return (ids, body);
        }
        words = words * TARGET_TOKENS / ids.len().max(1) + 1;
    }
}

fn report(name: &str, mut times: Vec<Duration>) {
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let p99 = times[(times.len() * 99 / 100).min(times.len() - 1)];
    println!(
        "{name:<44} min {:>8.3}  median {:>8.3}  p99 {:>8.3} ms",
        ms(times[0]),
        ms(times[times.len() / 2]),
        ms(p99)
    );
}

fn main() {
    let path = common::tokenizer_path();
    if !path.exists() {
        println!("no tokenizer at {} (run tests/e2e/vllm/setup.sh or set TOKENONCE_TOKENIZER)", path.display());
        return;
    }
    let loaded = Instant::now();
    let ours = Tokenizer::load(&path).unwrap();
    println!(
        "tokenizer {} loaded in {:.0} ms, vocabulary bound {}",
        path.display(),
        loaded.elapsed().as_secs_f64() * 1e3,
        ours.vocab_bound()
    );
    let theirs = tokenizers::Tokenizer::from_file(ours.path()).unwrap();
    let (ids, body) = prompt(&theirs);
    let json = PromptIds::from_ids(&ids).as_json().to_owned();
    println!(
        "prompt: {} tokens, {} messages, id JSON {} KB, body {} KB",
        ids.len(),
        MESSAGES,
        json.len() / 1024,
        body.len() / 1024
    );

    let deadline = Instant::now() + Duration::from_secs(MAX_SECONDS);
    let n = common::runs(50);
    let (mut plain, mut bounded, mut contents, mut decode, mut search, mut whole) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..n {
        if Instant::now() > deadline {
            break;
        }
        let t = Instant::now();
        let a = PromptIds::parse(&json, Some(ids.len() as u64)).unwrap();
        plain.push(t.elapsed());
        let t = Instant::now();
        let b = PromptIds::parse_within(&json, Some(ids.len() as u64), Some(ours.vocab_bound())).unwrap();
        bounded.push(t.elapsed());
        assert_eq!(a, b);

        let t0 = Instant::now();
        let expected = expected_contents(Api::Chat, &body).unwrap();
        contents.push(t0.elapsed());
        let t = Instant::now();
        let text = ours.decode(&b.to_vec()).unwrap();
        decode.push(t.elapsed());
        let t = Instant::now();
        let verdict = check(&text, &expected, b.len(), Some(ids.len() as u64));
        search.push(t.elapsed());
        whole.push(t0.elapsed());
        assert_eq!(verdict, Verdict::Match);
    }
    println!("{} rounds", plain.len());
    report("request path: validate ids (no tokenizer)", plain);
    report("request path: validate ids + vocabulary bound", bounded);
    report("watch: read the request's contents", contents);
    report("watch: decode the ids (to_vec + decode)", decode);
    report("watch: search the contents in order", search);
    report("watch: one whole check", whole);
}
