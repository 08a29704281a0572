//! Route selection: the first rule whose path, model glob and headers all match wins.
//! Built once from the config; `select` is a pure function of the request's facts.

use http::HeaderMap;

use crate::config::{Config, RouteSpec};

/// The facts a route is chosen on.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// Request path (no query).
    pub path: &'a str,
    /// The body's `model`, when one was read.
    pub model: Option<&'a str>,
    /// Request headers.
    pub headers: &'a HeaderMap,
}

/// Ordered routes.
#[derive(Debug, Clone)]
pub struct RouteTable {
    routes: Vec<RouteSpec>,
}

impl RouteTable {
    /// The table of a validated config.
    pub fn new(config: &Config) -> Self {
        Self { routes: config.routes().to_vec() }
    }

    /// The routes in order.
    pub fn routes(&self) -> &[RouteSpec] {
        &self.routes
    }

    /// Index of the first route matching `facts`.
    pub fn select(&self, facts: &RequestFacts<'_>) -> Option<usize> {
        self.routes.iter().position(|r| matches(r, facts))
    }

    /// True when some route could match `path` once the model is known, i.e. the body
    /// must be read before choosing.
    pub fn needs_model(&self, path: &str) -> bool {
        self.routes.iter().any(|r| r.matcher().model().is_some() && path_matches(r, path))
    }
}

fn path_matches(route: &RouteSpec, path: &str) -> bool {
    route.matcher().paths().is_empty() || route.matcher().paths().iter().any(|p| p == path)
}

fn matches(route: &RouteSpec, facts: &RequestFacts<'_>) -> bool {
    let m = route.matcher();
    path_matches(route, facts.path)
        && m.model().is_none_or(|glob| facts.model.is_some_and(|model| glob.is_match(model)))
        && m.headers().iter().all(|(name, value)| {
            facts.headers.get(name.as_str()).and_then(|v| v.to_str().ok()).is_some_and(|v| v == value)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = r#"
[pools.decode]
endpoints = ["127.0.0.1:1"]
[pools.prefill]
endpoints = ["127.0.0.1:2"]
[[routes]]
name = "tenant-b"
mode = "passthrough"
decode_pool = "decode"
[routes.match]
paths = ["/v1/chat/completions"]
headers = { "x-tenant" = "b" }
[[routes]]
name = "qwen"
mode = "orchestrate"
decode_pool = "decode"
prefill = { pool = "prefill" }
[routes.match]
paths = ["/v1/chat/completions", "/v1/completions"]
model = "Qwen/*"
[[routes]]
name = "rest"
mode = "passthrough"
decode_pool = "decode"
"#;

    fn pick(path: &str, model: Option<&str>, headers: &[(&'static str, &'static str)]) -> Option<String> {
        let table = RouteTable::new(&Config::from_toml(CONF, "t").unwrap());
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, v.parse().unwrap());
        }
        table.select(&RequestFacts { path, model, headers: &map }).map(|i| table.routes()[i].name().to_owned())
    }

    #[test]
    fn first_match_wins_in_order() {
        assert_eq!(
            pick("/v1/chat/completions", Some("Qwen/Qwen3-8B"), &[("x-tenant", "b")]).as_deref(),
            Some("tenant-b")
        );
        assert_eq!(pick("/v1/chat/completions", Some("Qwen/Qwen3-8B"), &[("x-tenant", "a")]).as_deref(), Some("qwen"));
        assert_eq!(pick("/v1/completions", Some("Qwen/Qwen3-8B"), &[]).as_deref(), Some("qwen"));
    }

    #[test]
    fn model_glob_needs_a_model() {
        assert_eq!(pick("/v1/chat/completions", Some("llama"), &[]).as_deref(), Some("rest"));
        assert_eq!(pick("/v1/chat/completions", None, &[]).as_deref(), Some("rest"));
        assert_eq!(pick("/v1/models", None, &[]).as_deref(), Some("rest"));
    }

    #[test]
    fn needs_model_only_where_a_glob_applies() {
        let table = RouteTable::new(&Config::from_toml(CONF, "t").unwrap());
        assert!(table.needs_model("/v1/completions"));
        assert!(!table.needs_model("/v1/models"));
    }
}
