//! Fuzz target for the leg client's HTTP/1.1 response-head parser and body reader. Input
//! layout and oracle: `oracles::fuzz_h1` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_h1(data));
