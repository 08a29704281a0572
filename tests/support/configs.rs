//! The common set-up: a P/D route over prefill and decode pools of fakes, the fakes started,
//! tokenonce between them; and a refused config's problem keys.

use crate::fake_vllm::{FakeConfig, FakeVllm};
use crate::harness::TokenOnce;

/// A config with one prefill fake and one decode fake on route `pd`.
pub fn pd_config(prefill: &FakeVllm, decode: &FakeVllm, route_extra: &str) -> String {
    pools_config(&[prefill.host_port()], &[decode.host_port()], route_extra)
}

/// A config with pools `prefill` and `decode` of the endpoints (`host:port`) given, in that
/// order (round robin), on orchestrate route `pd` over every API path.
pub fn pools_config(prefills: &[String], decodes: &[String], route_extra: &str) -> String {
    let list = |e: &[String]| e.iter().map(|e| format!("\"{e}\"")).collect::<Vec<_>>().join(", ");
    format!(
        "[pools.prefill]\nendpoints = [{}]\n\n[pools.decode]\nendpoints = [{}]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n{route_extra}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\", \"/v1/responses\", \"/v1/messages\", \"/inference/v1/generate\"]\n",
        list(prefills),
        list(decodes)
    )
}

/// Starts one fake per config, in order.
pub async fn fakes<const N: usize>(configs: [FakeConfig; N]) -> [FakeVllm; N] {
    let mut started = Vec::with_capacity(N);
    for config in configs {
        started.push(FakeVllm::start(config).await);
    }
    let Ok(started) = started.try_into() else { unreachable!("one fake per config") };
    started
}

/// Starts a prefill fake, a decode fake and tokenonce (in-process) between them.
pub async fn pd_setup(prefill: FakeConfig, decode: FakeConfig, route_extra: &str) -> (FakeVllm, FakeVllm, TokenOnce) {
    let p = FakeVllm::start(prefill).await;
    let d = FakeVllm::start(decode).await;
    let proxy = TokenOnce::start(&pd_config(&p, &d, route_extra)).await;
    (p, d, proxy)
}

/// Asserts a config was refused with problems at exactly `keys`, in order.
pub fn assert_problem_keys(err: &tokenonce::config::ConfigError, keys: &[&str]) {
    let got: Vec<&str> = err.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(got, keys, "{:#?}", err.problems);
}
