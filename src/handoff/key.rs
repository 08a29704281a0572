//! Correlation keys between a relayed prefill and its decode, and the prompt fingerprint:
//! a hash over every request field that decides the rendered prompt, insensitive to JSON
//! key order and whitespace (orchestrators re-serialize bodies between the legs).

use std::hash::{Hash, Hasher};

use serde_json::Value;

use crate::openai::RawObject;

/// One way to find a cached entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CacheKey {
    /// The prefill engine's own request id (`kv_transfer_params.remote_request_id`).
    RemoteRequestId(String),
    /// The `X-Request-Id` header both legs carried.
    RequestId(String),
    /// The prompt fingerprint alone.
    Fingerprint(u64),
}

/// Fields that decide the prompt tokens (vLLM renders/tokenizes from exactly these).
pub const PROMPT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "tools",
    "tool_choice",
    "functions",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "truncate_prompt_tokens",
    "truncation_side",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "cache_salt",
    "suffix",
    // Responses: the prompt is `instructions` + `input` (+ the stored turns it names),
    // `reasoning` can switch thinking on in the template, `truncation` can cut it.
    "input",
    "instructions",
    "previous_response_id",
    "conversation",
    "reasoning",
    "truncation",
    // Messages: the system prompt is a top-level field, `thinking` steers the template.
    "system",
    "thinking",
];

fn hash_canonical(value: &Value, h: &mut impl Hasher) {
    match value {
        Value::Null => 0u8.hash(h),
        Value::Bool(b) => (1u8, b).hash(h),
        Value::Number(n) => (2u8, n.to_string()).hash(h),
        Value::String(s) => (3u8, s).hash(h),
        Value::Array(items) => {
            (4u8, items.len()).hash(h);
            for item in items {
                hash_canonical(item, h);
            }
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            (5u8, keys.len()).hash(h);
            for k in keys {
                k.hash(h);
                if let Some(v) = map.get(k) {
                    hash_canonical(v, h);
                }
            }
        }
    }
}

/// The prompt fingerprint of a request body (absent and `null` fields count the same).
pub fn prompt_fingerprint(obj: &RawObject<'_>) -> u64 {
    // SipHash with fixed keys: stable across processes, so two instances agree.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    for field in PROMPT_FIELDS {
        let Some(raw) = obj.get(field).filter(|r| r.trim() != "null") else { continue };
        field.hash(&mut h);
        match serde_json::from_str::<Value>(raw) {
            Ok(v) => hash_canonical(&v, &mut h),
            Err(_) => raw.hash(&mut h),
        }
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(text: &str) -> u64 {
        prompt_fingerprint(&RawObject::parse(text).unwrap())
    }

    #[test]
    fn responses_and_messages_prompts_differ_by_their_own_fields() {
        assert_ne!(fp(r#"{"model":"m","input":"a"}"#), fp(r#"{"model":"m","input":"b"}"#));
        assert_ne!(fp(r#"{"model":"m","input":"a","instructions":"x"}"#), fp(r#"{"model":"m","input":"a"}"#));
        assert_ne!(
            fp(r#"{"model":"m","messages":[],"system":"x"}"#),
            fp(r#"{"model":"m","messages":[],"system":"y"}"#)
        );
        assert_eq!(
            fp(r#"{"model":"m","input":"a","max_output_tokens":1,"store":false}"#),
            fp(r#"{"model":"m","input":"a","max_output_tokens":9}"#)
        );
    }

    #[test]
    fn order_whitespace_and_sampling_fields_do_not_matter() {
        let a = fp(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":false}"#);
        let b = fp(
            r#"{ "messages": [ {"content":"hi", "role":"user"} ], "model":"m", "max_tokens": 50, "temperature": 0.7 }"#,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn prompt_fields_do_matter() {
        let base = fp(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        assert_ne!(base, fp(r#"{"model":"m","messages":[{"role":"user","content":"hi!"}]}"#));
        assert_ne!(base, fp(r#"{"model":"m2","messages":[{"role":"user","content":"hi"}]}"#));
        assert_ne!(
            base,
            fp(
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}"#
            )
        );
        assert_ne!(base, fp(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[]}"#));
        assert_eq!(base, fp(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":null}"#));
    }
}
