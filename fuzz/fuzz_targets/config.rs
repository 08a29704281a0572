//! Fuzz target for the config parser (Config::from_toml). Input layout and oracle:
//! `oracles::fuzz_config` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_config(data));
