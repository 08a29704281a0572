//! A prompt's text cut into chained keys a cache-aware pick can match when its token ids are
//! not known: one per chat message, one per 128 bytes of a completions prompt.
//!
//! Each key hashes its piece's raw JSON bytes with the key before it (the first with the
//! request's `model` and `cache_salt`, which key vLLM's whole chain, and `tools`, which vLLM
//! renders before the first message), so two requests share a leading run of keys exactly when
//! they share that run of messages, byte for byte. A client that re-serializes earlier turns differently (other key order, other
//! escapes) shares none: the choice then goes by load. The keys live in their own index,
//! never compared with vLLM's block hashes.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::value::RawValue;

use super::{Api, RawObject};
use crate::kv::BlockHash;

/// Bytes of a completions prompt per key (about one block of 32 tokens of English).
pub const PROMPT_BYTES_PER_KEY: usize = 128;

/// The text keys of a chat or completions request (`None`: another API, or no prompt to cut).
pub fn text_keys(obj: &RawObject<'_>, api: Api) -> Option<Vec<BlockHash>> {
    let mut seed = DefaultHasher::new();
    obj.get("model").hash(&mut seed);
    obj.get("cache_salt").hash(&mut seed);
    match api {
        Api::Chat => {
            obj.get("tools").hash(&mut seed);
            let messages: Vec<&RawValue> = serde_json::from_str(obj.get("messages")?).ok()?;
            Some(chained(seed, messages.iter().map(|m| m.get().as_bytes())))
        }
        Api::Completions => {
            let prompt: &RawValue = serde_json::from_str(obj.get("prompt")?).ok()?;
            let bytes = prompt.get().as_bytes();
            Some(chained(seed, bytes.chunks_exact(PROMPT_BYTES_PER_KEY)))
        }
        _ => None,
    }
}

/// One key per piece, each hashing the key before it and the piece.
fn chained<'p>(seed: DefaultHasher, pieces: impl Iterator<Item = &'p [u8]>) -> Vec<BlockHash> {
    let mut parent = seed.finish();
    pieces
        .map(|piece| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            piece.hash(&mut h);
            parent = h.finish();
            let mut digest = [0u8; 32];
            if let Some(tail) = digest.get_mut(24..) {
                tail.copy_from_slice(&parent.to_be_bytes());
            }
            BlockHash(digest)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(body: &str, api: Api) -> Vec<BlockHash> {
        text_keys(&RawObject::parse(body).unwrap(), api).unwrap()
    }

    #[test]
    fn a_follow_up_turn_shares_the_keys_of_its_history() {
        let first = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let next = r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},{"role":"user","content":"more"}]}"#;
        let (a, b) = (keys(first, Api::Chat), keys(next, Api::Chat));
        assert_eq!((a.len(), b.len()), (1, 3));
        assert_eq!(a[0], b[0]);
        let other_model = keys(&first.replace("\"m\"", "\"n\""), Api::Chat);
        assert_ne!(other_model[0], a[0], "another model renders another prompt");
        let with_tools = keys(&first.replace("{\"model\"", "{\"tools\":[],\"model\""), Api::Chat);
        assert_ne!(with_tools[0], a[0], "tools are rendered before the first message");
        let salted = keys(&first.replace("{\"model\"", "{\"cache_salt\":\"t\",\"model\""), Api::Chat);
        assert_ne!(salted[0], a[0], "a salt keys the whole chain, as in vLLM");
    }

    #[test]
    fn a_completions_prompt_has_a_key_per_full_128_bytes() {
        let prompt = "x".repeat(300);
        let ks = keys(&format!(r#"{{"model":"m","prompt":"{prompt}"}}"#), Api::Completions);
        assert_eq!(ks.len(), 2, "the opening quote and 299 bytes: two full pieces");
        let longer = keys(&format!(r#"{{"model":"m","prompt":"{prompt}yyyyyyyyyy"}}"#), Api::Completions);
        assert_eq!(longer[..2], ks[..], "a longer prompt shares the leading keys");
        assert!(text_keys(&RawObject::parse(r#"{"input":"x"}"#).unwrap(), Api::Responses).is_none());
    }
}
