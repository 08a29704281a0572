//! A pool's tokenizer (a Hugging Face `tokenizer.json`, or a Mistral folder's `tekken.json`),
//! loaded once per config load: its vocabulary bound gates relayed ids, its decoder feeds the
//! parity watch.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::render::{Tekken, TEKKEN_FILE};

/// The file name looked for when `tokenizer` names a model folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A loaded tokenizer and the bound every id must stay below.
pub struct Tokenizer {
    inner: Library,
    /// One past the largest id of the vocabulary, added tokens included.
    vocab_bound: u32,
    path: PathBuf,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokenizer({}, {} ids)", self.path.display(), self.vocab_bound)
    }
}

/// The library a tokenizer runs on.
enum Library {
    /// Hugging Face `tokenizers`.
    Hf(Box<tokenizers::Tokenizer>),
    /// Mistral's tekken (vLLM's Mistral tokenizer mode).
    Tekken(Arc<Tekken>),
}

impl Tokenizer {
    /// Loads `path`: a `tokenizer.json`, or a folder holding one (a model folder), else the
    /// folder's `tekken.json` (a Mistral model folder).
    ///
    /// # Errors
    /// A sentence saying why (missing file, not a tokenizer, empty vocabulary).
    pub fn load(path: &Path) -> Result<Self, String> {
        let tekken = path.join(TEKKEN_FILE);
        if path.is_dir() && !path.join(TOKENIZER_FILE).exists() && tekken.is_file() {
            let loaded = Tekken::load(&tekken).map_err(|e| format!("cannot load tokenizer: {e}"))?;
            let vocab_bound = loaded.vocab_bound();
            return Ok(Self { inner: Library::Tekken(Arc::new(loaded)), vocab_bound, path: tekken });
        }
        let file = if path.is_dir() { path.join(TOKENIZER_FILE) } else { path.to_path_buf() };
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| format!("cannot load tokenizer `{}`: {e}", file.display()))?;
        Self::from_tokenizer(inner, file)
    }

    /// Wraps an already built tokenizer (tests build small ones in memory).
    ///
    /// # Errors
    /// When its vocabulary is empty.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer, path: PathBuf) -> Result<Self, String> {
        let largest = inner.get_vocab(true).into_values().max();
        let vocab_bound = largest
            .and_then(|id| id.checked_add(1))
            .ok_or_else(|| format!("tokenizer `{}` has an empty vocabulary", path.display()))?;
        Ok(Self { inner: Library::Hf(Box::new(inner)), vocab_bound, path })
    }

    /// One past the largest id (ids at or above it are out of the vocabulary).
    pub fn vocab_bound(&self) -> u32 {
        self.vocab_bound
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The text of `ids`, special tokens kept (the chat template's markers stay visible).
    ///
    /// # Errors
    /// The decoder's complaint; for tekken always: mistral-common moves the system prompt
    /// to the last user turn and writes tool JSON again, so the parity watch's contents in
    /// order would read as mismatches (its checks of such a pool are skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match &self.inner {
            Library::Hf(inner) => inner.decode(ids, false).map_err(|e| e.to_string()),
            Library::Tekken(_) => Err("Mistral prompts are not compared by content".to_owned()),
        }
    }

    /// The Hugging Face tokenizer (local ids encode chat templates' text with it); `None`
    /// for tekken.
    pub fn library(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.inner {
            Library::Hf(inner) => Some(inner),
            Library::Tekken(_) => None,
        }
    }

    /// The tekken tokenizer of a Mistral folder.
    pub fn tekken(&self) -> Option<&Arc<Tekken>> {
        match &self.inner {
            Library::Tekken(tekken) => Some(tekken),
            Library::Hf(_) => None,
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A small word-level tokenizer built in memory with the real library.

    use std::collections::HashMap;

    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper};

    /// A tokenizer over `words` (ids in order), `<unk>` last, plus `special` added tokens.
    pub fn word_tokenizer(words: &[&str], special: &[&str]) -> super::Tokenizer {
        let mut vocab: HashMap<String, u32> =
            words.iter().enumerate().map(|(i, w)| ((*w).to_owned(), i as u32)).collect();
        vocab.insert("<unk>".into(), words.len() as u32);
        let model = WordLevel::builder().vocab(vocab.into_iter().collect()).unk_token("<unk>".into()).build();
        let Ok(model) = model else { unreachable!("a word-level vocab with its unk token builds") };
        let mut tk = tokenizers::Tokenizer::new(model);
        tk.with_pre_tokenizer(Some(PreTokenizerWrapper::from(WhitespaceSplit)));
        tk.with_decoder(Some(DecoderWrapper::from(tokenizers::decoders::wordpiece::WordPiece::default())));
        let added: Vec<AddedToken> = special.iter().map(|s| AddedToken::from((*s).to_owned(), true)).collect();
        let _ = tk.add_special_tokens(added);
        match super::Tokenizer::from_tokenizer(tk, "memory".into()) {
            Ok(t) => t,
            Err(e) => unreachable!("{e}"),
        }
    }

    /// Ids of `text` under `tk` (special tokens recognized).
    pub fn encode(tk: &super::Tokenizer, text: &str) -> Vec<u32> {
        let encoded = tk.library().map(|inner| inner.encode(text, false));
        encoded.and_then(Result::ok).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{encode, word_tokenizer};
    use super::*;

    #[test]
    fn the_bound_counts_added_tokens_and_decode_keeps_them() {
        let tk = word_tokenizer(&["hello", "world"], &["<|im_start|>", "<|im_end|>"]);
        // hello, world, <unk>, then the two added tokens.
        assert_eq!(tk.vocab_bound(), 5);
        let ids = encode(&tk, "<|im_start|> hello world <|im_end|>");
        assert_eq!(ids, vec![3, 0, 1, 4]);
        let text = tk.decode(&ids).unwrap();
        assert!(text.contains("<|im_start|>") && text.contains("hello world"), "{text}");
    }

    #[test]
    fn loads_a_file_or_a_model_folder_and_says_why_not() {
        let tk = word_tokenizer(&["a"], &[]);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(TOKENIZER_FILE);
        tk.library().unwrap().save(&file, false).unwrap();
        assert_eq!(Tokenizer::load(&file).unwrap().vocab_bound(), 2);
        assert_eq!(Tokenizer::load(dir.path()).unwrap().vocab_bound(), 2);
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        assert!(Tokenizer::load(&bad).unwrap_err().contains("cannot load tokenizer"));
        assert!(Tokenizer::load(&dir.path().join("missing")).is_err());
    }
}
