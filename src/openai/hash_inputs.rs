//! What of a chat or completions request enters vLLM's prefix-cache block hashes besides its
//! token ids (vLLM 0.32 `kv_cache_utils.py` `generate_block_hash_extra_keys`): the `model`,
//! which may name a LoRA adapter, and the `cache_salt`; or media and prompt embeddings, whose
//! hashes tokenonce cannot compute.

use super::{RawObject, RequestView};

/// A request's inputs to its block hashes beyond the ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashInputs {
    /// Text (or ids): hashed from the ids, the adapter `model` may name and the salt.
    Text {
        /// `model`, when a string (an adapter's name, or the base model's).
        model: Option<String>,
        /// `cache_salt`, when a string.
        cache_salt: Option<String>,
    },
    /// Images, audio or video (any content part that is not text): vLLM keys the blocks
    /// they cover by the media's own identifiers.
    Multimodal,
    /// A completions prompt given as embeddings (`prompt_embeds`): vLLM keys each block by
    /// a digest of its tensor bytes.
    PromptEmbeds,
}

impl HashInputs {
    /// What `obj` (read as `view`) adds to its hashes.
    pub fn of(view: &RequestView, obj: &RawObject<'_>) -> Self {
        if view.has_media {
            return HashInputs::Multimodal;
        }
        if obj.has_non_null("prompt_embeds") {
            return HashInputs::PromptEmbeds;
        }
        let cache_salt = obj.get_as::<String>("cache_salt").and_then(Result::ok);
        HashInputs::Text { model: view.model.clone(), cache_salt }
    }

    /// Inputs with no adapter and no salt (a prompt known by its ids alone).
    pub fn plain() -> Self {
        HashInputs::Text { model: None, cache_salt: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::Api;

    fn inputs(api: Api, body: &str) -> HashInputs {
        let obj = RawObject::parse(body).unwrap();
        HashInputs::of(&RequestView::parse(api, &obj).unwrap(), &obj)
    }

    #[test]
    fn text_requests_carry_their_model_and_salt() {
        let chat = r#"{"model":"sql","cache_salt":"t","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            inputs(Api::Chat, chat),
            HashInputs::Text { model: Some("sql".into()), cache_salt: Some("t".into()) }
        );
        let completion = r#"{"model":"base","prompt":"hi","cache_salt":null}"#;
        assert_eq!(
            inputs(Api::Completions, completion),
            HashInputs::Text { model: Some("base".into()), cache_salt: None }
        );
        let odd_salt = r#"{"model":"base","prompt":"hi","cache_salt":7}"#;
        assert_eq!(
            inputs(Api::Completions, odd_salt),
            HashInputs::Text { model: Some("base".into()), cache_salt: None }
        );
    }

    #[test]
    fn media_and_prompt_embeds_are_not_hashable_here() {
        let image = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert_eq!(inputs(Api::Chat, image), HashInputs::Multimodal);
        let audio = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"x"}}]}]}"#;
        assert_eq!(inputs(Api::Chat, audio), HashInputs::Multimodal);
        let embeds = r#"{"model":"m","prompt_embeds":"AAAA"}"#;
        assert_eq!(inputs(Api::Completions, embeds), HashInputs::PromptEmbeds);
        let text_parts = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}"#;
        assert!(matches!(inputs(Api::Chat, text_parts), HashInputs::Text { .. }));
    }
}
