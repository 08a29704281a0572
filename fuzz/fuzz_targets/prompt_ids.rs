//! Fuzz target for the prompt-id validator (PromptIds::parse). Input layout and oracle:
//! `oracles::fuzz_prompt_ids` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_prompt_ids(data));
