//! Model folders the tests write: word-level tokenizers with a chat template of the ChatML,
//! Qwen3 or Llama-3 kind, for local ids and rendering without a real model.

use std::path::Path;

use crate::fake_vllm::fake_tokenize;
use crate::files::repo;

/// A model folder: a word-level `tokenizer.json` that knows `alpha` and `bravo` by the fake
/// engine's ids (any other word is `<unk>`) and has ChatML's two markers as added tokens, and a
/// `tokenizer_config.json` with a ChatML chat template.
pub fn write_local_model(dir: &std::path::Path) {
    let mut vocab = serde_json::Map::new();
    for w in ["alpha", "bravo"] {
        vocab.insert(w.to_owned(), serde_json::json!(fake_tokenize(w)[0]));
    }
    vocab.insert("<unk>".into(), serde_json::json!(150_000));
    let added = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(151_644, "<|im_start|>"), added(151_645, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::json!({"chat_template": template}).to_string())
        .unwrap();
}

/// A model folder of the Qwen3 family: its chat template as recorded, a word tokenizer with
/// its added tokens (no BOS added).
pub fn write_qwen3_model(dir: &Path) {
    let config = repo("tests/fixtures/render/qwen3/tokenizer_config.json");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    let added: Vec<(u32, String)> = config["added_tokens_decoder"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, t)| (id.parse().unwrap(), t["content"].as_str().unwrap().to_owned()))
        .collect();
    std::fs::write(dir.join("tokenizer.json"), word_tokenizer(&added, None).to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A model folder of a Llama-3-like family: `bos_token` in the template, and a tokenizer
/// whose post-processor adds BOS to a completions prompt (so `""` has one id).
pub fn write_bos_family_model(dir: &Path) {
    let added = [
        (128_000, "<|begin_of_text|>"),
        (128_006, "<|start_header_id|>"),
        (128_007, "<|end_header_id|>"),
        (128_009, "<|eot_id|>"),
    ]
    .map(|(id, t)| (id, t.to_owned()));
    let tokenizer = word_tokenizer(&added, Some((128_000, "<|begin_of_text|>")));
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    let config =
        serde_json::json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A whitespace word tokenizer with `added` special tokens, adding `bos` to single inputs
/// when given.
fn word_tokenizer(added: &[(u32, String)], bos: Option<(u32, &str)>) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["Hello", "there!", "You", "are", "terse.", "Hi", "user", "system", "assistant"].iter().enumerate() {
        vocab.insert((*w).to_owned(), serde_json::json!(1000 + i));
    }
    vocab.insert("<unk>".into(), serde_json::json!(0));
    // Qwen3's vocabulary size (the bound legs' ids are checked against): the fake engine's
    // output ids are all below it.
    vocab.insert("<reserved>".into(), serde_json::json!(151_935));
    let added: Vec<serde_json::Value> = added
        .iter()
        .map(|(id, content)| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let post_processor = bos.map_or(serde_json::Value::Null, |(id, token)| {
        serde_json::json!({"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {token: {"id": token, "ids": [id], "tokens": [token]}}})
    });
    serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": post_processor, "decoder": null,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}})
}
