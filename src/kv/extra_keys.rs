//! What a request adds to its blocks' hashes besides the ids (vLLM's extra keys), owned: the
//! LoRA adapter its `model` names, resolved to the path the pool's engines loaded it from
//! ([`LoraPaths`], learned from their `GET /v1/models`), and its `cache_salt`.
//!
//! vLLM 0.32 (`kv_cache_utils.py` `_gen_lora_extra_hash_keys`) hashes an adapter by its served
//! name *and* the path it was loaded from (`LoRARequest.lora_path`, as given to
//! `--lora-modules` or `/v1/load_lora_adapter`, not resolved), never by its integer id. Its
//! `/v1/models` lists each adapter with `id` = that name, `root` = that path and `parent` = the
//! base model, so the engines say exactly what to hash; nothing is configured.

use parking_lot::RwLock;
use std::collections::HashMap;

use super::hash::{ExtraKeys, Lora};

/// The LoRA adapters a pool's engines serve, by endpoint: name → the path each loaded it
/// from. Written by the health round (each endpoint's `/v1/models`), read by the chain of each
/// request and by the KV events' hash check. Shared (`Arc`) by the pool and its events.
#[derive(Debug, Default)]
pub struct LoraPaths {
    by_endpoint: RwLock<HashMap<String, HashMap<String, String>>>,
}

impl LoraPaths {
    /// Records the adapters (name, path) the endpoint named `endpoint` lists now.
    pub fn learned(&self, endpoint: &str, adapters: impl IntoIterator<Item = (String, String)>) {
        let adapters: HashMap<String, String> = adapters.into_iter().collect();
        let mut by_endpoint = self.by_endpoint.write();
        if adapters.is_empty() {
            by_endpoint.remove(endpoint);
        } else {
            by_endpoint.insert(endpoint.to_owned(), adapters);
        }
    }

    /// Forgets what the endpoint named `endpoint` listed (it went away).
    pub fn forget(&self, endpoint: &str) {
        self.by_endpoint.write().remove(endpoint);
    }

    /// The path the endpoint named `endpoint` loaded adapter `name` from, if it lists it.
    pub fn path_on(&self, endpoint: &str, name: &str) -> Option<String> {
        self.by_endpoint.read().get(endpoint)?.get(name).cloned()
    }

    /// The path adapter `name` was loaded from by the pool's engines: the one most of the
    /// endpoints listing it give (ties: the smallest path), so one chain names the pool's
    /// blocks; `None` when no endpoint lists it.
    pub fn path(&self, name: &str) -> Option<String> {
        let by_endpoint = self.by_endpoint.read();
        let mut votes: HashMap<&str, usize> = HashMap::new();
        for path in by_endpoint.values().filter_map(|adapters| adapters.get(name)) {
            *votes.entry(path.as_str()).or_default() += 1;
        }
        let best = votes.into_iter().max_by(|(pa, a), (pb, b)| a.cmp(b).then_with(|| pb.cmp(pa)));
        best.map(|(path, _)| path.to_owned())
    }

    /// The extra keys of a request whose `model` is `model` and whose `cache_salt` is
    /// `cache_salt`: the adapter when `model` names one the engines list (a base model, or a
    /// name no engine lists, hashes without), the salt when not empty.
    pub fn keys(&self, model: Option<&str>, cache_salt: Option<&str>) -> RequestKeys {
        let lora = model.and_then(|name| Some((name.to_owned(), self.path(name)?)));
        RequestKeys { lora, cache_salt: cache_salt.filter(|s| !s.is_empty()).map(str::to_owned) }
    }
}

/// A request's extra keys, owned (see [`ExtraKeys`] for how they enter the hash).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestKeys {
    /// The adapter's name and path.
    pub lora: Option<(String, String)>,
    /// The non-empty `cache_salt`.
    pub cache_salt: Option<String>,
}

impl RequestKeys {
    /// The keys as the hasher takes them.
    pub fn as_extra(&self) -> ExtraKeys<'_> {
        ExtraKeys {
            lora: self.lora.as_ref().map(|(name, path)| Lora { name, path }),
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(n, p)| ((*n).to_owned(), (*p).to_owned())).collect()
    }

    #[test]
    fn an_adapter_resolves_to_the_path_its_engines_loaded_it_from() {
        let paths = LoraPaths::default();
        assert_eq!(paths.keys(Some("sql"), None), RequestKeys::default(), "nothing listed yet: no adapter");
        paths.learned("a:1", listed(&[("sql", "/loras/sql")]));
        let keys = paths.keys(Some("sql"), Some("tenant"));
        assert_eq!(keys.lora, Some(("sql".to_owned(), "/loras/sql".to_owned())));
        assert_eq!(keys.as_extra().cache_salt, Some("tenant"));
        assert_eq!(paths.keys(Some("base"), Some("")), RequestKeys::default(), "a base model; an empty salt is none");
        assert_eq!(paths.path_on("a:1", "sql").as_deref(), Some("/loras/sql"));
        assert_eq!(paths.path_on("b:1", "sql"), None);
        paths.forget("a:1");
        assert_eq!(paths.path("sql"), None);
    }

    #[test]
    fn endpoints_that_disagree_on_a_path_resolve_to_the_most_listed() {
        let paths = LoraPaths::default();
        paths.learned("a:1", listed(&[("sql", "/v2")]));
        paths.learned("b:1", listed(&[("sql", "/v1")]));
        assert_eq!(paths.path("sql").as_deref(), Some("/v1"), "a tie: the smallest path");
        paths.learned("c:1", listed(&[("sql", "/v2")]));
        assert_eq!(paths.path("sql").as_deref(), Some("/v2"));
        assert_eq!(paths.path_on("b:1", "sql").as_deref(), Some("/v1"), "each endpoint keeps its own");
        paths.learned("c:1", Vec::new());
        assert_eq!(paths.path("sql").as_deref(), Some("/v1"), "c lists none now");
    }
}
