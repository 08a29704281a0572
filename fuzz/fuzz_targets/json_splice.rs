//! Fuzz target for the raw-object JSON splicer (RawObject). Input layout and oracle:
//! `oracles::fuzz_raw_object` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_raw_object(data));
