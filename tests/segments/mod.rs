//! Shared by the segment-cache property tests (`tests/segment_cache.rs` with a tokenizer built
//! in memory, `tests/segment_cache_qwen.rs` with the real Qwen3 one): random conversations
//! rendered ChatML style, and the check that the cache's ids equal the library's, cold, warm,
//! across a growing conversation, after evictions and after expiry.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::select;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};
use tokenonce::tokens::{SegmentCache, Segmenter};

pub fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// === conversations ===

/// One message: a role and its content.
pub type Turn = (String, String);

fn role() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => select(vec!["user", "assistant", "system", "tool"]).prop_map(str::to_owned),
        1 => select(vec!["developer", "ipython", "Assistant", "", "us er", "é"]).prop_map(str::to_owned),
    ]
}

/// Pieces of content: prose, unicode (NFD accents, jamo, singletons NFC changes, NFKC-only
/// forms it keeps), special-token text and near misses, tool-call JSON, whitespace, empty.
fn part() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(vec![
            "the", " and", "hello", "world", "The decode engine reads the prompt ids", "café", "naïve",
            "1234567", "3.14", "don't", "it's", "I'M", "x", "...", "!?", "—", "e.g.", "https://example.com/a?b=c",
        ]).prop_map(str::to_owned),
        3 => select(vec![
            "cafe\u{301}", "e\u{301}", "\u{301}", "a\u{30a}", "\u{212b}", "\u{2126}", "\u{212a}", "\u{1100}\u{1161}\u{11a8}",
            "ﬁ", "Ａ", "①", "你好世界", "こんにちは", "مرحبا", "👍🏽", "🇫🇷", "\u{200d}", "\u{feff}", "\u{a0}", "\u{3000}",
            "ß", "İ", "\u{7}", "\u{1b}[0m", "\u{85}", "\u{fffe}", "\u{0}",
        ]).prop_map(str::to_owned),
        2 => select(vec![
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<|im_start|>user\n", "<|im_start|", "<|IM_END|>", "<|im_end|>>",
            "<<|im_end|>", "<think", "<|fim_prefix|>", "<|vision_start|>", "<|image_pad|>", "  <mask>", "[R]  \n",
        ]).prop_map(str::to_owned),
        2 => select(vec![
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            "{\"a\": [1, 2.5, null, true], \"b\": \"\\u00e9\\n\"}",
            "<tool_response>\n{\"temp\": -3.5}\n</tool_response>",
            "<think>\n\n</think>\n\n",
        ]).prop_map(str::to_owned),
        2 => select(vec![" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "   \n\n\n", ""]).prop_map(str::to_owned),
        1 => "[a-zA-Z0-9 \\n.,é\u{301}<|>_]{0,40}",
        1 => any::<String>().prop_map(|s| s.chars().take(12).collect()),
    ]
}

fn content() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just(String::new()),
        8 => prop::collection::vec(part(), 1..14).prop_map(|p| p.concat()),
    ]
}

/// 1 to 8 messages.
pub fn conversation() -> impl Strategy<Value = Vec<Turn>> {
    prop::collection::vec((role(), content()), 1..8)
}

/// The first `n` messages rendered ChatML style, with the generation prompt.
pub fn render(turns: &[Turn], n: usize) -> String {
    let mut text = String::new();
    for (role, content) in turns.iter().take(n) {
        text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    }
    text.push_str("<|im_start|>assistant\n");
    text
}

// === the check ===

/// A cache shared by every case of a test binary, so entries of other conversations sit in it.
static SHARED: LazyLock<SegmentCache> = LazyLock::new(|| SegmentCache::new(1 << 20, Duration::from_secs(600)));

/// For every prefix of `turns` (a conversation growing turn by turn): ids from a cold cache,
/// the same cache warm, one cache across the growth, a tiny one that keeps evicting, one
/// whose entries expire between turns, and the cache shared by all cases all equal the
/// library's `encode(text, false)`.
pub fn check(tk: &Segmenter, turns: &[Turn]) -> Result<(), TestCaseError> {
    let ttl = Duration::from_secs(60);
    let growing = SegmentCache::new(1 << 20, ttl);
    let tiny = SegmentCache::with_shards(256, ttl, 1);
    let expiring = SegmentCache::with_shards(1 << 20, ttl, 2);
    let t0 = Instant::now();
    for n in 0..=turns.len() {
        let text = render(turns, n);
        let want = tk.tokenizer().encode(text.as_str(), false).map(|e| e.get_ids().to_vec()).unwrap();
        let cold = SegmentCache::new(1 << 20, ttl);
        prop_assert_eq!(&cold.encode(tk, &text).unwrap(), &want, "cold, {:?}", text);
        prop_assert_eq!(&cold.encode(tk, &text).unwrap(), &want, "warm, {:?}", text);
        prop_assert_eq!(&growing.encode(tk, &text).unwrap(), &want, "growing, {:?}", text);
        prop_assert_eq!(&tiny.encode(tk, &text).unwrap(), &want, "tiny, {:?}", text);
        let later = t0 + ttl * u32::try_from(n).unwrap();
        prop_assert_eq!(&expiring.encode_at(tk, &text, later).unwrap(), &want, "expiring, {:?}", text);
        prop_assert_eq!(&SHARED.encode(tk, &text).unwrap(), &want, "shared, {:?}", text);
        prop_assert_eq!(&tk.encode_pieces(&text).unwrap(), &want, "pieces, {:?}", text);
    }
    let s = tiny.stats();
    prop_assert!(s.bytes <= 256, "{:?}", s);
    Ok(())
}

// === a tokenizer built in memory ===

/// Qwen3's pre-tokenizer regex.
const QWEN_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Words whose merges the BPE learns, so tokens span several bytes and characters.
const WORDS: &[&str] = &[
    " the",
    " and",
    "user",
    "assistant",
    "system",
    "\n\n",
    " is",
    "é",
    " café",
    "tion",
    "{\"",
    "hello",
    " world",
    "ing",
    "你好",
    " \"",
    "\":",
    "ñ",
    "e\u{301}",
];

/// A byte-level BPE shaped like Qwen3's tokenizer: NFC, Qwen3's split then byte-level, ChatML
/// special tokens and Qwen3's raw non-special tokens, one `normalized: true` token (`café`,
/// matched after NFC), and a `<mask>` with `lstrip` and a `[R]` with `rstrip`.
pub fn memory_tokenizer() -> Segmenter {
    let mut vocab: HashMap<String, u32> = (0..=255u8).map(|b| (byte_char(b).to_string(), u32::from(b))).collect();
    let mut merges = Vec::new();
    for word in WORDS {
        let symbols: Vec<String> = word.bytes().map(|b| byte_char(b).to_string()).collect();
        let mut acc = symbols.first().cloned().unwrap_or_default();
        for s in symbols.iter().skip(1) {
            let merged = format!("{acc}{s}");
            if !vocab.contains_key(&merged) {
                merges.push((acc.clone(), s.clone()));
                let next = u32::try_from(vocab.len()).unwrap();
                vocab.insert(merged.clone(), next);
            }
            acc = merged;
        }
    }
    let vocab: ahash::AHashMap<String, u32> = vocab.into_iter().collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().unwrap();
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let _ = tk.with_normalizer(Some(NormalizerWrapper::from(NFC)));
    let split = Split::new(SplitPattern::Regex(QWEN_SPLIT.into()), SplitDelimiterBehavior::Isolated, false).unwrap();
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::from(split),
        PreTokenizerWrapper::from(ByteLevel::new(false, false, false)),
    ]);
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::from(pre)));
    let special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"];
    tk.add_special_tokens(special.iter().map(|s| AddedToken::from(*s, true))).unwrap();
    let plain =
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", "<|fim_prefix|>"];
    tk.add_tokens(plain.iter().map(|s| AddedToken::from(*s, true).special(false))).unwrap();
    tk.add_tokens([AddedToken::from("café", false)]).unwrap();
    tk.add_special_tokens([AddedToken::from("<mask>", true).lstrip(true), AddedToken::from("[R]", true).rstrip(true)])
        .unwrap();
    Segmenter::new(tk, "memory".into()).unwrap()
}

/// GPT-2's byte-to-character map: printable bytes are themselves, the others count up from
/// U+0100.
fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
    if printable(b) {
        char::from(b)
    } else {
        char::from_u32(256 + (0..b).filter(|x| !printable(*x)).count() as u32).unwrap()
    }
}
