//! Fuzz target for the request view (RequestView::parse). Input layout and oracle:
//! `oracles::fuzz_request_view` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_request_view(data));
