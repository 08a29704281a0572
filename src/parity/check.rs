//! The parity check itself, pure: does the text the ids decode to carry the request's
//! contents, in order? Only what chat templates are known to keep is compared: each text
//! content with all whitespace removed (templates trim and re-space), an assistant turn only
//! after its last `</think>` (Qwen3 drops earlier turns' reasoning); tool definitions,
//! tool-call arguments and names are not compared (templates re-serialize them). Both sides
//! are compared in one Unicode normal form (NFKC): a tokenizer's normalizer may compose
//! accents a request sent decomposed.

use serde::Deserialize;
use serde_json::Value;
use unicode_normalization::UnicodeNormalization;

use crate::openai::Api;

/// Longest excerpt of a content or of the decoded text a mismatch reports.
const EXCERPT_CHARS: usize = 120;

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every compared content was found, in order, and the count agrees.
    Match,
    /// The ids do not carry the request.
    Mismatch(Mismatch),
    /// Nothing could be compared (why).
    Skipped(&'static str),
}

/// What differed first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Which compared content (0-based, in request order), or `None` for the count.
    pub content: Option<usize>,
    /// The expected content (or count), cut to an excerpt.
    pub expected: String,
    /// The decoded text from where the search stood, cut to an excerpt.
    pub found: String,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Value>,
}

/// The contents of a request body to look for, in order, whitespace removed; empty ones left
/// out.
///
/// # Errors
/// A reason to skip: the body does not parse, or carries no prompt of the expected shape.
pub fn expected_contents(api: Api, body: &[u8]) -> Result<Vec<String>, &'static str> {
    let body: Body = serde_json::from_slice(body).map_err(|_| "body does not parse")?;
    let mut out = Vec::new();
    match api {
        Api::Chat => {
            for message in body.messages.ok_or("no messages")? {
                let assistant = message.role.as_deref() == Some("assistant");
                for text in texts(message.content.as_ref()) {
                    let kept = if assistant { after_reasoning(text) } else { text };
                    out.push(squeeze(kept));
                }
            }
        }
        Api::Completions => match body.prompt {
            Some(Value::String(prompt)) => out.push(squeeze(&prompt)),
            Some(Value::Array(items)) if items.len() == 1 => match items.first() {
                Some(Value::String(prompt)) => out.push(squeeze(prompt)),
                _ => return Err("prompt is not text"),
            },
            _ => return Err("prompt is not text"),
        },
        // Not compared yet: how vLLM's templates render Responses `instructions`/`input` items
        // is not checked on real traffic, and a guess would read as mismatches. Messages never
        // reuse ids (`ids_not_echoed`).
        Api::Responses | Api::Messages | Api::Generate => return Err("API not compared"),
    }
    out.retain(|s| !s.is_empty());
    Ok(out)
}

/// A message's text pieces: a string content, or the `text` of each text part.
fn texts(content: Option<&Value>) -> Vec<&str> {
    match content {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => Vec::new(),
    }
}

/// An assistant content as reasoning templates keep it: what follows the last `</think>`.
fn after_reasoning(text: &str) -> &str {
    text.rsplit_once("</think>").map_or(text, |(_, after)| after)
}

/// `text` in Unicode compatibility composition (NFKC), without any whitespace.
///
/// A tokenizer's normalizer rewrites the text before it becomes ids (Qwen3's composes it,
/// NFC), so honest ids can decode to `Café` for a request that reads `Cafe\u{301}`. Both
/// sides are compared in NFKC, which is the same text whichever Unicode form (or none) the
/// pool's tokenizer applies; the tokenizer's own normalizer is not used, since some also
/// rewrite spaces (SentencePiece's `▁`) that its decoder turns back.
fn squeeze(text: &str) -> String {
    text.nfkc().filter(|c| !c.is_whitespace()).collect()
}

/// Checks `decoded` (the ids' text) against `expected` (from [`expected_contents`]) and the
/// id count against the prefill's `usage.prompt_tokens` when known.
pub fn check(decoded: &str, expected: &[String], ids: usize, prompt_tokens: Option<u64>) -> Verdict {
    if let Some(n) = prompt_tokens.filter(|n| *n != ids as u64) {
        return Verdict::Mismatch(Mismatch {
            content: None,
            expected: format!("{n} prompt tokens"),
            found: format!("{ids} ids"),
        });
    }
    if expected.is_empty() {
        return Verdict::Skipped("no text content");
    }
    let haystack = squeeze(decoded);
    let mut at = 0;
    for (i, content) in expected.iter().enumerate() {
        let rest = haystack.get(at..).unwrap_or("");
        match rest.find(content.as_str()) {
            Some(pos) => at += pos + content.len(),
            None => {
                return Verdict::Mismatch(Mismatch {
                    content: Some(i),
                    expected: excerpt(content),
                    found: excerpt(rest),
                })
            }
        }
    }
    Verdict::Match
}

fn excerpt(text: &str) -> String {
    text.chars().take(EXCERPT_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(messages: &str) -> Vec<String> {
        expected_contents(Api::Chat, format!(r#"{{"model":"m","messages":{messages}}}"#).as_bytes()).unwrap()
    }

    #[test]
    fn contents_in_order_whitespace_and_earlier_reasoning_left_out() {
        let got = chat(
            r#"[{"role":"system","content":"Be  brief.\n"},
               {"role":"user","content":[{"type":"text","text":"hi there"},{"type":"image_url","image_url":{"url":"x"}}]},
               {"role":"assistant","content":"<think>\nplan\n</think>\n\nHello!"},
               {"role":"assistant","content":null,"tool_calls":[]},
               {"role":"tool","content":"  "},
               {"role":"user","content":"more"}]"#,
        );
        assert_eq!(got, vec!["Bebrief.", "hithere", "Hello!", "more"]);
    }

    #[test]
    fn completions_take_a_text_prompt_only() {
        assert_eq!(expected_contents(Api::Completions, br#"{"prompt":"a b"}"#).unwrap(), vec!["ab"]);
        assert_eq!(expected_contents(Api::Completions, br#"{"prompt":["a b"]}"#).unwrap(), vec!["ab"]);
        assert!(expected_contents(Api::Completions, br#"{"prompt":[1,2]}"#).is_err());
        assert!(expected_contents(Api::Chat, b"{}").is_err());
        assert!(expected_contents(Api::Chat, b"[").is_err());
        // Responses and Messages bodies are skipped, not guessed at.
        assert_eq!(expected_contents(Api::Responses, br#"{"input":"a b"}"#), Err("API not compared"));
        assert_eq!(expected_contents(Api::Messages, br#"{"messages":[]}"#), Err("API not compared"));
    }

    #[test]
    fn finds_contents_in_order_and_reports_the_first_missing_one() {
        let decoded = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n";
        let want = vec!["Bebrief.".to_owned(), "hithere".to_owned()];
        assert_eq!(check(decoded, &want, 9, Some(9)), Verdict::Match);
        assert_eq!(check(decoded, &want, 9, None), Verdict::Match);
        let reversed = vec!["hithere".to_owned(), "Bebrief.".to_owned()];
        let Verdict::Mismatch(m) = check(decoded, &reversed, 9, None) else { panic!("order must matter") };
        assert_eq!(m.content, Some(1));
        assert_eq!(m.expected, "Bebrief.");
        assert!(m.found.starts_with("<|im_end|>"), "{}", m.found);
        let other = vec!["What is 2+2?".to_owned()];
        assert!(matches!(check(decoded, &other, 9, None), Verdict::Mismatch(Mismatch { content: Some(0), .. })));
    }

    #[test]
    fn a_count_that_disagrees_is_a_mismatch_and_nothing_to_compare_is_skipped() {
        let Verdict::Mismatch(m) = check("x", &["x".to_owned()], 3, Some(4)) else { panic!("count") };
        assert_eq!((m.content, m.expected.as_str(), m.found.as_str()), (None, "4 prompt tokens", "3 ids"));
        assert_eq!(check("x", &[], 1, Some(1)), Verdict::Skipped("no text content"));
    }

    #[test]
    fn decomposed_composed_and_mixed_accents_compare_equal() {
        // What Qwen3's NFC normalizer makes of a decomposed request: the ids read composed.
        let decoded = "<|im_start|>user\nCaf\u{e9} cr\u{e8}me br\u{fb}l\u{e9}e<|im_end|>\n";
        for text in [
            "Cafe\u{301} cre\u{300}me bru\u{302}le\u{301}e",
            "Caf\u{e9} cr\u{e8}me br\u{fb}l\u{e9}e",
            "Cafe\u{301} cr\u{e8}me bru\u{302}l\u{e9}e",
        ] {
            let want = chat(&serde_json::json!([{"role": "user", "content": text}]).to_string());
            assert_eq!(check(decoded, &want, 9, None), Verdict::Match, "{text:?}");
        }
        // Decoded text in another form (a tokenizer with no normalizer) matches too, and a
        // different letter is still a mismatch.
        let want = chat(r#"[{"role":"user","content":"Caf\u00e9"}]"#);
        assert_eq!(check("Cafe\u{301}", &want, 1, None), Verdict::Match);
        assert!(matches!(check("Cafe\u{300}", &want, 1, None), Verdict::Mismatch(_)));
    }

    #[test]
    fn excerpts_are_bounded_on_char_boundaries() {
        let long = "é".repeat(500);
        let Verdict::Mismatch(m) = check(&long, &["zz".to_owned()], 1, None) else { panic!("mismatch") };
        assert_eq!(m.found.chars().count(), EXCERPT_CHARS);
    }
}
