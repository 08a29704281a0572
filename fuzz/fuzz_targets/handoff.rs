//! Fuzz target for the prefill-answer handoff extraction and the response rewrites. Input layout and oracle:
//! `oracles::fuzz_handoff` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_handoff(data));
