//! Fuzz target for vLLM's KV event messages (ZeroMQ frames, msgpack batches: `kv::wire`). Input
//! layout and oracle: `oracles::fuzz_kv_wire` in `tests/oracles/mod.rs` (also run by `tests/properties.rs`).
#![no_main]

#[path = "../../tests/oracles/mod.rs"]
mod oracles;

libfuzzer_sys::fuzz_target!(|data: &[u8]| oracles::fuzz_kv_wire(data));
