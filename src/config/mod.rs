//! Configuration: the TOML file format (`file`), the validated model (`model`), and the
//! embedded default (`conf/default.toml`) that runs when no file is given.

pub mod file;
pub mod model;

pub use model::{
    AllowEntry, Balance, CacheSettings, Config, ConfigError, Mode, PoolSpec, PrefillSource, Problem, RelayHandoff,
    RouteMatch, RouteOptions, RouteSpec, Version,
};

/// The embedded default configuration text.
pub const DEFAULT_TOML: &str = include_str!("../../conf/default.toml");

/// The embedded default, validated.
///
/// # Errors
/// Only if the shipped default is broken (a test keeps it valid).
pub fn embedded_default() -> Result<Config, ConfigError> {
    Config::from_toml(DEFAULT_TOML, "<embedded default>")
}

/// Reads and validates a file.
///
/// # Errors
/// [`ConfigError`] with one problem when the file cannot be read, else every problem found.
pub fn load(path: &std::path::Path) -> Result<Config, ConfigError> {
    let name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Config::from_toml(&text, &name),
        Err(e) => Err(ConfigError {
            source_name: name,
            problems: vec![Problem { line: 0, column: 0, key: String::from("(file)"), message: e.to_string() }],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_is_valid_and_as_documented() {
        let c = embedded_default().unwrap();
        assert_eq!(c.server.listen, "0.0.0.0:8000");
        assert_eq!(c.server.admin_listen, "127.0.0.1:9000");
        let pool = |name: &str| c.pools.iter().find(|p| p.name == name).unwrap().endpoints.clone();
        assert_eq!(pool("prefill"), ["127.0.0.1:8100"]);
        assert_eq!(pool("decode"), ["127.0.0.1:8200"]);
        assert_eq!(c.routes[0].mode, Mode::Orchestrate);
    }

    #[test]
    fn every_shipped_example_is_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf");
        let mut checked = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                load(&path).unwrap_or_else(|e| panic!("{}: {:?}", path.display(), e.problems));
                checked += 1;
            }
        }
        assert!(checked >= 3, "expected the example configs, found {checked}");
    }

    #[test]
    fn every_problem_is_reported_with_its_place() {
        let text = r#"
[server]
listen = "nowhere"

[pools.decode]
endpoints = ["127.0.0.1:8200", "bad host"]
balance = "random"

[[routes]]
name = "r"
mode = "orchestrate"
decode_pool = "missing"
prefill_timeout_ms = 0
"#;
        let err = Config::from_toml(text, "t.toml").unwrap_err();
        let keys: Vec<&str> = err.problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "server.listen",
                "pools.decode.endpoints",
                "pools.decode.balance",
                "routes[0].prefill",
                "routes[0].decode_pool",
                "routes[0].prefill_timeout_ms"
            ],
            "{:#?}",
            err.problems
        );
        assert_eq!((err.problems[0].line, err.problems[0].column), (3, 10));
        assert_eq!(err.problems[1].line, 6);
    }

    #[test]
    fn syntax_and_unknown_keys_are_located() {
        let err = Config::from_toml("[server]\nlisten = \n", "t").unwrap_err();
        assert_eq!(err.problems[0].line, 2);
        let err = Config::from_toml("[server]\nlisten_addr = \"1\"\n", "t").unwrap_err();
        assert!(err.problems[0].message.contains("listen_addr"), "{:?}", err.problems);
        assert_eq!(err.problems[0].line, 2);
    }

    #[test]
    fn header_prefill_needs_an_allowlist() {
        let text = r#"
[pools.decode]
endpoints = ["127.0.0.1:8200"]
[[routes]]
name = "llmd"
mode = "orchestrate"
decode_pool = "decode"
prefill = { header = "x-prefiller-host-port" }
"#;
        let err = Config::from_toml(text, "t").unwrap_err();
        assert_eq!(err.problems[0].key, "routes[0].prefill.allow");
    }

    #[test]
    fn versions_and_host_ports_parse() {
        assert_eq!(Version::parse("0.32.0"), Some(Version(0, 32, 0)));
        assert_eq!(Version::parse("0.27.0rc1.dev12+gabc"), Some(Version(0, 27, 0)));
        assert!(Version::parse("0.26.9") < Some(Version::CHAT_TOKEN_REUSE));
        assert_eq!(Version::parse("x"), None);
        assert!(model::is_host_port("10.0.0.5:8000"));
        assert!(model::is_host_port("prefill-0.svc:8000"));
        assert!(model::is_host_port("[::1]:8000"));
        for bad in ["10.0.0.5", "a:b", ":80", "a:0", "a b:80", "a:80,b:80", "h:99999"] {
            assert!(!model::is_host_port(bad), "{bad}");
        }
    }
}
