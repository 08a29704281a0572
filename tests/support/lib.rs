//! Shared harness of the integration tests and `benches/`: a fake vLLM (`fake_vllm`), vLLM's
//! toy P/D proxy (`toy_proxy`), tokenonce itself (`harness`: in this process via
//! `server::start`, or the real binary as a child process; both on listeners bound to port 0),
//! and helpers by concern. A crate of its own (`tests/support/Cargo.toml`), known to tokenonce's
//! tests and benches as `support`; the items they use most are re-exported here.

pub mod bench;
pub mod client;
pub mod configs;
pub mod fake_vllm;
pub mod fault_engine;
pub mod files;
pub mod harness;
pub mod kv_engine;
pub mod metrics;
pub mod models;
pub mod sockets;
pub mod tls;
pub mod toy_proxy;
pub mod wait;

pub use bench::{fmt_num, fmt_signed, words};
pub use client::{assert_openai_error, chat_body, post_chat, post_json, post_raw, whole_events, with_extra};
pub use configs::{assert_problem_keys, fakes, pd_config, pd_setup, pools_config};
pub use fake_vllm::{fake_render_chat, fake_render_responses, fake_tokenize, metrics_page, FakeConfig, FakeVllm};
pub use files::{path_str, read_repo, repo};
pub use harness::{spawn_logged, Settings, TokenOnce};
pub use metrics::reuse_series;
pub use models::{write_bos_family_model, write_local_model, write_qwen3_model};
pub use sockets::{raw_engine, RefusedAddr, SlowClient};
pub use wait::until;
