//! A tokenizer that knows where a text may be cut without changing its ids: at the added
//! tokens the `tokenizers` crate matches on the raw text (those with `normalized: false`),
//! found exactly as the crate finds them, and whether the tokenizer allows cutting at all,
//! decided once at load. Owns no cache (`cache.rs` does).
//!
//! Why the cut is exact (tokenizers 0.23.2, `tokenizer/added_vocabulary.rs` and
//! `tokenizer/mod.rs`, unchanged on upstream main): `encode` first splits the raw text at the
//! leftmost-longest, non-overlapping matches of the `normalized: false` added tokens
//! (`find_matches` over `split_trie`, spans widened by `lstrip`/`rstrip`); every later stage
//! (the normalizer, e.g. Qwen3's NFC, the `normalized: true` added tokens, the pre-tokenizer,
//! the model) runs on each piece between two matches on its own, and with
//! `add_special_tokens = false` the post-processor adds no ids. Encoding each piece as a text
//! of its own finds no added token inside it (a match inside would have been the leftmost),
//! so it gives the same ids. What breaks this, each a [`WholeReason`]: `single_word` tokens
//! (accepted or not by the characters around them, which a cut changes), the
//! `encode_special_tokens` switch (skipped matches still consume text), a `Metaspace`
//! pre-tokenizer with `prepend_scheme: first` (it prepends only at offset 0 of the original
//! text), truncation or padding (applied to the whole), BPE dropout (random), and an empty or
//! duplicated added token (where our matcher and the crate's may disagree; not worth
//! reproducing).

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use aho_corasick::{AhoCorasick, MatchKind};
use serde::Deserialize;

use super::TokensError;

/// Where a text may not be cut, so it is encoded whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WholeReason {
    /// An added token with `single_word: true` (named).
    SingleWord(String),
    /// The tokenizer encodes special-token text as text (`encode_special_tokens`).
    EncodeSpecialTokens,
    /// A `Metaspace` pre-tokenizer prepending only at the start of the text.
    MetaspacePrependFirst,
    /// Truncation is configured.
    Truncation,
    /// Padding is configured.
    Padding,
    /// The model drops merges at random (BPE dropout).
    Dropout,
    /// An added token with empty content, or two with the same content.
    OddAddedTokens,
}

/// How a [`Segmenter`] encodes a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Splitting {
    /// Cut at the `normalized: false` added tokens (how many there are; 0 means every text is
    /// one segment).
    AtAddedTokens(usize),
    /// Never cut: always encode the whole text.
    Whole(WholeReason),
}

/// One piece of a cut text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'t> {
    /// Text between added tokens (never empty), encoded on its own.
    Text(&'t str),
    /// An added token's id.
    Added(u32),
}

/// A `normalized: false` added token as the matcher needs it.
#[derive(Debug, Clone, Copy)]
struct SplitToken {
    id: u32,
    lstrip: bool,
    rstrip: bool,
}

/// The tokenizer, the matcher of its raw-text added tokens, and its fingerprint.
pub struct Segmenter {
    inner: tokenizers::Tokenizer,
    splitting: Splitting,
    /// Leftmost-longest matcher over the split tokens' contents (pattern i = `tokens[i]`);
    /// `None` when `splitting` is `Whole` or there is no split token.
    matcher: Option<AhoCorasick>,
    tokens: Vec<SplitToken>,
    fingerprint: u64,
    path: PathBuf,
}

impl std::fmt::Debug for Segmenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Segmenter({}, {:?}, {:016x})", self.path.display(), self.splitting, self.fingerprint)
    }
}

/// The parts of a serialized tokenizer the checks read; the rest is skipped.
#[derive(Deserialize)]
struct Shape {
    #[serde(default)]
    model: ModelShape,
}

#[derive(Deserialize, Default)]
struct ModelShape {
    #[serde(default)]
    dropout: Option<f64>,
}

impl Segmenter {
    /// Loads `path`: a `tokenizer.json`, or a folder holding one.
    ///
    /// # Errors
    /// [`TokensError::Load`] when the file cannot be read as a tokenizer,
    /// [`TokensError::Inspect`] when it cannot be serialized back for the checks.
    pub fn load(path: &Path) -> Result<Self, TokensError> {
        let file = if path.is_dir() { path.join(crate::parity::TOKENIZER_FILE) } else { path.to_path_buf() };
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| TokensError::Load { path: file.clone(), reason: e.to_string() })?;
        Self::new(inner, file)
    }

    /// Wraps a built tokenizer (`path` only names it), deciding once whether texts may be cut.
    ///
    /// # Errors
    /// [`TokensError::Inspect`] when it cannot be serialized (fingerprint and checks read the
    /// serialized form).
    pub fn new(inner: tokenizers::Tokenizer, path: PathBuf) -> Result<Self, TokensError> {
        let json = inner.to_string(false).map_err(|e| TokensError::Inspect(e.to_string()))?;
        let mut hasher = DefaultHasher::new();
        json.hash(&mut hasher);
        let fingerprint = hasher.finish();
        let shape: Shape = serde_json::from_str(&json).map_err(|e| TokensError::Inspect(e.to_string()))?;

        let added = inner.get_added_tokens_decoder();
        let mut raw: Vec<(u32, &tokenizers::AddedToken)> =
            added.iter().filter(|(_, t)| !t.normalized).map(|(id, t)| (*id, t)).collect();
        raw.sort_unstable_by_key(|(id, _)| *id);

        let pre_tokenizer =
            serde_json::to_value(inner.get_pre_tokenizer()).map_err(|e| TokensError::Inspect(e.to_string()))?;
        let mut contents = HashSet::new();
        let whole = if let Some((_, t)) = raw.iter().find(|(_, t)| t.single_word) {
            Some(WholeReason::SingleWord(t.content.clone()))
        } else if inner.get_encode_special_tokens() {
            Some(WholeReason::EncodeSpecialTokens)
        } else if prepends_first(&pre_tokenizer) {
            Some(WholeReason::MetaspacePrependFirst)
        } else if inner.get_truncation().is_some() {
            Some(WholeReason::Truncation)
        } else if inner.get_padding().is_some() {
            Some(WholeReason::Padding)
        } else if shape.model.dropout.is_some_and(|p| p > 0.0) {
            Some(WholeReason::Dropout)
        } else if raw.iter().any(|(_, t)| t.content.is_empty() || !contents.insert(t.content.as_str())) {
            Some(WholeReason::OddAddedTokens)
        } else {
            None
        };

        let (splitting, matcher, tokens) = match whole {
            Some(reason) => (Splitting::Whole(reason), None, Vec::new()),
            None if raw.is_empty() => (Splitting::AtAddedTokens(0), None, Vec::new()),
            None => {
                let matcher = AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(raw.iter().map(|(_, t)| t.content.as_str()))
                    .map_err(|e| TokensError::Inspect(format!("added-token matcher: {e}")))?;
                let tokens: Vec<SplitToken> =
                    raw.iter().map(|(id, t)| SplitToken { id: *id, lstrip: t.lstrip, rstrip: t.rstrip }).collect();
                (Splitting::AtAddedTokens(tokens.len()), Some(matcher), tokens)
            }
        };
        Ok(Self { inner, splitting, matcher, tokens, fingerprint, path })
    }

    /// Whether and where texts are cut.
    pub fn splitting(&self) -> &Splitting {
        &self.splitting
    }

    /// A hash of the whole serialized tokenizer: equal for the same file loaded twice (a
    /// reload), different for another tokenizer. Cache keys include it.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapped tokenizer.
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// `text` cut at its added tokens, in order, exactly where `encode` cuts it; `None` when
    /// this tokenizer (or, rarely, this text: a token starting inside the spaces an `rstrip`
    /// token swallowed) must be encoded whole.
    pub fn split<'t>(&self, text: &'t str) -> Option<Vec<Piece<'t>>> {
        if let Splitting::Whole(_) = self.splitting {
            return None;
        }
        let Some(matcher) = &self.matcher else {
            return Some(if text.is_empty() { Vec::new() } else { vec![Piece::Text(text)] });
        };
        let mut pieces = Vec::new();
        // Mirrors `AddedVocabulary::find_matches`: `start_offset` is where the last token's
        // span (widened by its strips) ended.
        let mut start_offset = 0;
        for found in matcher.try_find_iter(text).ok()? {
            let token = self.tokens.get(found.pattern().as_usize())?;
            let (mut start, mut stop) = (found.start(), found.end());
            if token.lstrip {
                // The crate's `\s*$` on the text before: where its trailing spaces begin.
                let before = text.get(..start)?;
                start = before.trim_end_matches(char::is_whitespace).len().max(start_offset);
            }
            if token.rstrip {
                // The crate's `^\s*` on the text after: how many spaces it starts with.
                let after = text.get(stop..)?;
                stop += after.len() - after.trim_start_matches(char::is_whitespace).len();
            }
            if start < start_offset {
                return None;
            }
            if start_offset < start {
                pieces.push(Piece::Text(text.get(start_offset..start)?));
            }
            pieces.push(Piece::Added(token.id));
            start_offset = stop;
        }
        if start_offset < text.len() {
            pieces.push(Piece::Text(text.get(start_offset..)?));
        }
        Some(pieces)
    }

    /// The ids of `text` encoded whole: `encode(text, add_special_tokens = false)` (without
    /// offsets, which do not change ids).
    ///
    /// # Errors
    /// The tokenizer's complaint.
    pub fn encode_whole(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokensError::Encode(e.to_string()))
    }

    /// The ids of `text` cut with [`split`](Self::split), each piece encoded on its own (no
    /// cache): equal to [`encode_whole`](Self::encode_whole).
    ///
    /// # Errors
    /// The tokenizer's complaint.
    pub fn encode_pieces(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        let Some(pieces) = self.split(text) else { return self.encode_whole(text) };
        let mut ids = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Added(id) => ids.push(id),
                Piece::Text(t) => ids.extend(self.encode_whole(t)?),
            }
        }
        Ok(ids)
    }
}

/// Whether a serialized pre-tokenizer (or one in its sequence) is a `Metaspace` prepending
/// only at the start of the original text.
fn prepends_first(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(map) => {
            let metaspace_first = map.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                && map.get("prepend_scheme").and_then(|p| p.as_str()) == Some("first");
            metaspace_first || map.values().any(prepends_first)
        }
        serde_json::Value::Array(items) => items.iter().any(prepends_first),
        _ => false,
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Small tokenizers built in memory with the real library: a byte-level BPE like Qwen3's
    //! (NFC normalizer, Qwen3's split regex, ChatML special tokens) and variants.

    use std::collections::HashMap;

    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::unicode::NFC;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

    /// Qwen3's pre-tokenizer regex.
    pub const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Words whose merges the BPE learns (so multi-byte tokens occur).
    const WORDS: &[&str] = &[" the", " and", "user", "assistant", "system", "\n\n", " is", "é", " café", "tion", "{\""];

    /// A byte-level BPE over all 256 bytes plus merges spelling `WORDS`, with NFC, Qwen3's
    /// split, ChatML special tokens, Qwen3's non-special raw tokens and one
    /// `normalized: true` token (`café`, matched after NFC).
    pub fn chatml_bpe() -> tokenizers::Tokenizer {
        let mut tk = bare_bpe();
        let special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        let _ = tk.add_special_tokens(special.iter().map(|s| AddedToken::from(*s, true)));
        let plain = ["<tool_call>", "</tool_call>", "<think>", "</think>"];
        let _ = tk.add_tokens(plain.iter().map(|s| AddedToken::from(*s, true).special(false)));
        let _ = tk.add_tokens([AddedToken::from("café", false)]);
        tk
    }

    /// The byte-level BPE with NFC and Qwen3's split, no added tokens.
    pub fn bare_bpe() -> tokenizers::Tokenizer {
        let mut vocab: HashMap<String, u32> = (0..=255u8).map(|b| (byte_char(b).to_string(), u32::from(b))).collect();
        let mut merges = Vec::new();
        for word in WORDS {
            let symbols = byte_level(word);
            let mut acc = symbols.first().cloned().unwrap_or_default();
            for s in symbols.iter().skip(1) {
                let merged = format!("{acc}{s}");
                if !vocab.contains_key(&merged) {
                    merges.push((acc.clone(), s.clone()));
                    let next = vocab.len() as u32;
                    vocab.insert(merged.clone(), next);
                }
                acc = merged;
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab.into_iter().collect::<ahash::AHashMap<_, _>>(), merges)
            .build()
            .unwrap();
        let mut tk = tokenizers::Tokenizer::new(bpe);
        let _ = tk.with_normalizer(Some(NormalizerWrapper::from(NFC)));
        let split =
            Split::new(SplitPattern::Regex(QWEN_SPLIT.into()), SplitDelimiterBehavior::Isolated, false).unwrap();
        let pre = Sequence::new(vec![
            PreTokenizerWrapper::from(split),
            PreTokenizerWrapper::from(ByteLevel::new(false, false, false)),
        ]);
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::from(pre)));
        tk.with_decoder(Some(ByteLevel::default()));
        tk
    }

    /// `word` in the byte-level alphabet, one symbol per byte.
    fn byte_level(word: &str) -> Vec<String> {
        word.bytes().map(|b| byte_char(b).to_string()).collect()
    }

    /// GPT-2's byte-to-character map: printable bytes are themselves, the others count up
    /// from U+0100.
    fn byte_char(b: u8) -> char {
        let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
        if printable(b) {
            char::from(b)
        } else {
            char::from_u32(256 + (0..b).filter(|x| !printable(*x)).count() as u32).unwrap()
        }
    }

    /// Ids of `text` by the library itself (the reference every test compares with).
    pub fn reference(tk: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        tk.encode(text, false).unwrap().get_ids().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::{AddedToken, PaddingParams, PreTokenizerWrapper, TruncationParams};

    use super::testing::{bare_bpe, chatml_bpe, reference};
    use super::*;

    fn seg(tk: tokenizers::Tokenizer) -> Segmenter {
        Segmenter::new(tk, "memory".into()).unwrap()
    }

    #[test]
    fn a_chatml_prompt_is_cut_at_its_raw_added_tokens_and_gives_the_whole_texts_ids() {
        let s = seg(chatml_bpe());
        assert_eq!(s.splitting(), &Splitting::AtAddedTokens(7), "café is normalized: not a cut");
        let text = "<|im_start|>user\nthe cafe\u{301} <think>x</think><|im_end|>\n<|im_start|>assistant\n";
        let pieces = s.split(text).unwrap();
        let im_start = s.tokenizer().token_to_id("<|im_start|>").unwrap();
        assert_eq!(pieces.first(), Some(&Piece::Added(im_start)));
        assert_eq!(pieces.get(1), Some(&Piece::Text("user\nthe cafe\u{301} ")));
        assert_eq!(pieces.iter().filter(|p| matches!(p, Piece::Text(_))).count(), 4);
        assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text));
        let cafe = s.tokenizer().token_to_id("café").unwrap();
        assert!(reference(s.tokenizer(), text).contains(&cafe), "NFC made `café` and it matched");
    }

    #[test]
    fn combining_marks_right_after_a_token_stay_apart_as_the_library_keeps_them() {
        let s = seg(chatml_bpe());
        for text in ["<|im_end|>\u{301}e", "e<|im_start|>\u{301}", "\u{301}", "a\u{301}<think>\u{301}</think>", ""] {
            assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text), "{text:?}");
        }
    }

    #[test]
    fn longest_match_wins_and_near_misses_stay_text() {
        let mut tk = chatml_bpe();
        let _ = tk.add_special_tokens([AddedToken::from("<|im", true)]);
        let s = seg(tk);
        for text in ["<|im_start|><|im<|im_end", "<|IM_START|> <|im_start| <|im_start|>>", "<<|im_end|>|>"] {
            assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text), "{text:?}");
        }
    }

    #[test]
    fn lstrip_and_rstrip_widen_the_cut_as_the_library_does() {
        let mut tk = chatml_bpe();
        let _ = tk.add_special_tokens([
            AddedToken::from("<mask>", true).lstrip(true),
            AddedToken::from("[R]", true).rstrip(true),
            AddedToken::from("<both>", true).lstrip(true).rstrip(true),
            AddedToken::from(" sp", true),
        ]);
        let s = seg(tk);
        assert!(matches!(s.splitting(), Splitting::AtAddedTokens(_)));
        for text in [
            "a  <mask> b",
            "[R]  \n x",
            " \t<both>\u{a0} y",
            "x [R]   <mask>",
            "[R] <both>  [R]",
            "[R]  sp",
            "<mask>",
            "  <mask>",
            "[R]",
        ] {
            assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text), "{text:?}");
        }
        assert_eq!(s.split("[R]  sp"), None, "` sp` starts in the spaces `[R]` swallowed: whole");
    }

    #[test]
    fn what_breaks_the_cut_is_found_at_load_and_the_text_is_encoded_whole() {
        let mut single = chatml_bpe();
        let _ = single.add_tokens([AddedToken::from("tok", false).single_word(true).normalized(false)]);
        assert_eq!(seg(single).splitting(), &Splitting::Whole(WholeReason::SingleWord("tok".into())));

        let mut special_as_text = chatml_bpe();
        special_as_text.set_encode_special_tokens(true);
        assert_eq!(seg(special_as_text).splitting(), &Splitting::Whole(WholeReason::EncodeSpecialTokens));

        let mut metaspace = chatml_bpe();
        metaspace.with_pre_tokenizer(Some(PreTokenizerWrapper::from(Metaspace::new('▁', PrependScheme::First, true))));
        let s = seg(metaspace);
        assert_eq!(s.splitting(), &Splitting::Whole(WholeReason::MetaspacePrependFirst));
        let text = "a<|im_start|>b c";
        assert_eq!(s.split(text), None);
        assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text));

        let mut truncated = chatml_bpe();
        let _ = truncated.with_truncation(Some(TruncationParams { max_length: 4, ..Default::default() }));
        assert_eq!(seg(truncated).splitting(), &Splitting::Whole(WholeReason::Truncation));

        let mut padded = chatml_bpe();
        padded.with_padding(Some(PaddingParams::default()));
        assert_eq!(seg(padded).splitting(), &Splitting::Whole(WholeReason::Padding));

        let json = chatml_bpe().to_string(false).unwrap().replace("\"dropout\":null", "\"dropout\":0.1");
        let dropout: tokenizers::Tokenizer = json.parse().unwrap();
        assert_eq!(seg(dropout).splitting(), &Splitting::Whole(WholeReason::Dropout));
    }

    #[test]
    fn a_metaspace_that_prepends_always_cuts_fine() {
        let mut tk = chatml_bpe();
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::from(Metaspace::new('▁', PrependScheme::Always, true))));
        let s = seg(tk);
        assert!(matches!(s.splitting(), Splitting::AtAddedTokens(_)));
        let text = "a b<|im_start|>c d<|im_end|> e";
        assert_eq!(s.encode_pieces(text).unwrap(), reference(s.tokenizer(), text));
    }

    #[test]
    fn no_added_tokens_means_one_segment() {
        let s = seg(bare_bpe());
        assert_eq!(s.splitting(), &Splitting::AtAddedTokens(0));
        assert_eq!(s.split("a b"), Some(vec![Piece::Text("a b")]));
        assert_eq!(s.split(""), Some(vec![]));
    }

    #[test]
    fn the_fingerprint_tells_tokenizers_apart_and_survives_a_reload() {
        let a = seg(chatml_bpe());
        assert_eq!(a.fingerprint(), seg(chatml_bpe()).fingerprint());
        assert_ne!(a.fingerprint(), seg(bare_bpe()).fingerprint());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokenizer.json");
        a.tokenizer().save(&file, false).unwrap();
        let loaded = Segmenter::load(dir.path()).unwrap();
        assert_eq!(loaded.fingerprint(), a.fingerprint());
        assert!(matches!(Segmenter::load(&dir.path().join("missing.json")), Err(TokensError::Load { .. })));
    }
}
