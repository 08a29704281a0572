//! Fuzz target for the reader of an engine's /metrics (upstream::engine_load::read). Input
//! layout and oracle: `oracles::fuzz_engine_metrics` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_engine_metrics(data));
