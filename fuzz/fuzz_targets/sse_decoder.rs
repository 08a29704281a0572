//! Fuzz target for the SSE decoder and the SSE rewriter. Input layout and oracle:
//! `oracles::fuzz_sse` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_sse(data));
