//! Fuzz target for the prefill and decode rewrites (prefill_body, decode_body, kv_params_with_ids). Input layout and oracle:
//! `oracles::fuzz_rewrites` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_rewrites(data));
