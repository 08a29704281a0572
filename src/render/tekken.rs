//! Mistral's tekken tokenizer (`tekken.json`) as mistral-common 1.13 builds it: tiktoken's
//! byte-level BPE over the first `default_vocab_size - default_num_special_tokens` ranks, with
//! the file's pattern, and every id offset by the number of special tokens, which take ids
//! 0.. (the file's list, or mistral-common's built-in one for files up to v7 without one).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use base64::Engine;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tiktoken_rs::CoreBPE;

/// The file name a Mistral model folder holds its tokenizer in.
pub const TEKKEN_FILE: &str = "tekken.json";

/// The special tokens mistral-common assumes for files up to v7 that list none, by rank
/// (`Tekkenizer.DEPRECATED_SPECIAL_TOKENS`).
const DEPRECATED_SPECIAL_TOKENS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// Why a `tekken.json` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TekkenError {
    /// The file cannot be read.
    #[error("cannot read `{path}`: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not the JSON mistral-common reads.
    #[error("`{path}` is not a tekken tokenizer: {reason}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// The parts of `tekken.json` the tokenizer reads.
#[derive(Deserialize)]
struct TekkenFile {
    config: TekkenConfig,
    vocab: Vec<VocabEntry>,
    special_tokens: Option<Vec<SpecialEntry>>,
}

#[derive(Deserialize)]
struct TekkenConfig {
    pattern: String,
    default_vocab_size: usize,
    default_num_special_tokens: usize,
    version: String,
}

#[derive(Deserialize)]
struct VocabEntry {
    rank: u32,
    token_bytes: String,
}

#[derive(Deserialize)]
struct SpecialEntry {
    rank: u32,
    token_str: String,
}

/// A loaded tekken tokenizer.
pub struct Tekken {
    bpe: CoreBPE,
    /// Ids below this are special tokens; a BPE rank r is id r + this.
    num_special: u32,
    /// Special token strings by id.
    special: HashMap<String, u32>,
    /// The file's `config.version` ("v3", "v7", ...).
    version: String,
    /// One past the largest id.
    vocab_bound: u32,
    /// The sha256 of the file (a reload keeps an unchanged tokenizer).
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for Tekken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tekken({}, {} ids)", self.version, self.vocab_bound)
    }
}

impl Tekken {
    /// Loads `path` (a `tekken.json`).
    ///
    /// # Errors
    /// [`TekkenError`]: unreadable, or not a tekken file mistral-common would load.
    pub fn load(path: &Path) -> Result<Self, TekkenError> {
        let shown = path.display().to_string();
        let text = std::fs::read(path).map_err(|source| TekkenError::Read { path: shown.clone(), source })?;
        let format = |reason: String| TekkenError::Format { path: shown.clone(), reason };
        let file: TekkenFile = serde_json::from_slice(&text).map_err(|e| format(e.to_string()))?;
        Self::from_file(file, Sha256::digest(&text).into()).map_err(format)
    }

    fn from_file(file: TekkenFile, fingerprint: [u8; 32]) -> Result<Self, String> {
        let config = file.config;
        let specials: Vec<(u32, String)> = match file.special_tokens {
            Some(list) => list.into_iter().map(|s| (s.rank, s.token_str)).collect(),
            // mistral-common refuses a file past v7 without its list
            None if matches!(config.version.as_str(), "v1" | "v2" | "v3" | "v7") => {
                (0u32..).zip(DEPRECATED_SPECIAL_TOKENS.iter().map(|s| (*s).to_owned())).collect()
            }
            None => return Err(format!("version {} lists no special tokens", config.version)),
        };
        let num_special = config.default_num_special_tokens;
        if specials.len() > num_special {
            return Err(format!("{} special tokens, more than {num_special}", specials.len()));
        }
        let inner = config
            .default_vocab_size
            .checked_sub(num_special)
            .filter(|inner| *inner <= file.vocab.len())
            .ok_or_else(|| format!("vocab size {} does not fit the vocabulary", config.default_vocab_size))?;
        let mut encoder = HashMap::with_capacity(inner);
        let engine = base64::engine::general_purpose::STANDARD;
        for (i, entry) in file.vocab.iter().take(inner).enumerate() {
            if usize::try_from(entry.rank).ok() != Some(i) {
                return Err(format!("vocabulary entry {i} has rank {}", entry.rank));
            }
            let bytes = engine.decode(&entry.token_bytes).map_err(|e| format!("rank {}: {e}", entry.rank))?;
            if encoder.insert(bytes, entry.rank).is_some() {
                return Err(format!("rank {} repeats a token", entry.rank));
            }
        }
        // tiktoken-rs takes its own hash maps (rustc-hash's)
        let bpe = CoreBPE::new(encoder.into_iter().collect(), std::iter::empty().collect(), &config.pattern)
            .map_err(|e| e.to_string())?;
        let to_u32 = |n: usize| u32::try_from(n).map_err(|_| format!("{n} does not fit an id"));
        let special = specials.into_iter().map(|(rank, s)| (s, rank)).collect();
        Ok(Self {
            bpe,
            num_special: to_u32(num_special)?,
            special,
            version: config.version,
            vocab_bound: to_u32(config.default_vocab_size)?,
            fingerprint,
        })
    }

    /// The ids of `text` as plain text (special-token strings in it are text too), as
    /// `Tekkenizer.encode(text, bos=False, eos=False)`.
    ///
    /// # Errors
    /// When the pattern's regex engine gives up on the text (tiktoken would fail as well).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        // tiktoken-rs panics where the regex engine errors (its backtrack limit)
        let ranks = catch_unwind(AssertUnwindSafe(|| self.bpe.encode_ordinary(text)))
            .map_err(|_| "the tokenizer's pattern failed on the text".to_owned())?;
        Ok(ranks.into_iter().map(|rank| rank + self.num_special).collect())
    }

    /// The text of `ids`, special tokens by name, bytes that are not UTF-8 replaced (for
    /// logs and test reports).
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        let mut text = Vec::new();
        for id in ids {
            match id.checked_sub(self.num_special) {
                Some(rank) => text.extend(self.bpe.decode_bytes(&[rank]).unwrap_or_default()),
                None => {
                    let name = self.special.iter().find(|(_, v)| **v == *id).map(|(k, _)| k.as_str());
                    text.extend(name.unwrap_or("<special>").as_bytes());
                }
            }
        }
        String::from_utf8_lossy(&text).into_owned()
    }

    /// The id of the special token `name` (`<s>`, `[INST]`, ...).
    pub fn special(&self, name: &str) -> Option<u32> {
        self.special.get(name).copied()
    }

    /// The file's tokenizer version (`v3`, `v7`, `v11`, `v13`, ...).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// One past the largest id.
    pub fn vocab_bound(&self) -> u32 {
        self.vocab_bound
    }

    /// The sha256 of the file it was loaded from.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with a byte-level vocabulary of the 256 bytes and one merge ("ab").
    fn tiny(special_tokens: Option<&str>, version: &str) -> Result<Tekken, String> {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut vocab: Vec<String> = (0u8..=255)
            .map(|b| format!("{{\"rank\":{b},\"token_bytes\":\"{}\",\"token_str\":null}}", engine.encode([b])))
            .collect();
        vocab.push(format!("{{\"rank\":256,\"token_bytes\":\"{}\",\"token_str\":\"ab\"}}", engine.encode(b"ab")));
        let specials = special_tokens.map(|s| format!(",\"special_tokens\":{s}")).unwrap_or_default();
        let text = format!(
            "{{\"config\":{{\"pattern\":\"[a-z]+|[^a-z]\",\"num_vocab_tokens\":257,\"default_vocab_size\":287,\
             \"default_num_special_tokens\":30,\"version\":\"{version}\"}},\"vocab\":[{}]{specials}}}",
            vocab.join(",")
        );
        Tekken::from_file(serde_json::from_str(&text).unwrap(), [0; 32])
    }

    /// Ranks are offset by the special-token count, merges apply, and special-token text
    /// stays text.
    #[test]
    fn ids_are_bpe_ranks_after_the_special_tokens() {
        let tk = tiny(None, "v3").unwrap();
        assert_eq!(tk.encode("ab").unwrap(), vec![286]);
        assert_eq!(tk.encode("ba").unwrap(), vec![30 + u32::from(b'b'), 30 + u32::from(b'a')]);
        assert_eq!(tk.encode("<s>").unwrap().len(), 3);
        assert_eq!(tk.special("[INST]"), Some(3));
        assert_eq!(tk.vocab_bound(), 287);
    }

    /// A file's own special-token list wins; past v7 it is required.
    #[test]
    fn special_tokens_come_from_the_file_or_the_v7_defaults() {
        let listed = tiny(Some("[{\"rank\":0,\"token_str\":\"<s>\",\"is_control\":true}]"), "v13").unwrap();
        assert_eq!(listed.special("<s>"), Some(0));
        assert_eq!(listed.special("[INST]"), None);
        assert!(tiny(None, "v13").is_err());
    }
}
