//! The config file as `tokenonce check` reads it: every problem of a file reported in one run
//! at its key and line:column (syntax, unknown keys, wrong types, unknown names, bounds, rules
//! across keys, files that do not load), defaults applied, and every shipped example valid.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::Duration;

use tokenonce::addr::is_host_port;
use tokenonce::config::{self, embedded_default, Config, MissingFiles, Mode, OnClientGone, Version};

/// Asserts a config was refused with problems at exactly `keys`, in order.
fn assert_problem_keys(err: &config::ConfigError, keys: &[&str]) {
    let got: Vec<&str> = err.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(got, keys, "{:#?}", err.problems);
}

#[test]
fn embedded_default_is_valid_and_as_documented() {
    let c = embedded_default().unwrap().config;
    assert_eq!(c.server.listen, "0.0.0.0:8000");
    assert_eq!(c.server.admin_listen, "127.0.0.1:9000");
    let pool = |name: &str| c.pools[name].endpoints.clone();
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
            // Files a deployment provides (a model folder such as `/models/...`) are skipped as
            // `tokenonce check --skip-missing-files` skips them; every file the repository
            // holds is still loaded and checked.
            let loaded = config::load_with(&path, MissingFiles::Skip)
                .unwrap_or_else(|e| panic!("{}: {:?}", path.display(), e.problems));
            for skipped in &loaded.resources.skipped {
                assert!(
                    skipped.path.starts_with("/models/"),
                    "{}: {} names `{}`, which is neither in the repository nor a deployment's model folder",
                    path.display(),
                    skipped.key,
                    skipped.path
                );
            }
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
    assert_problem_keys(
        &err,
        &[
            "server.listen",
            "pools.decode.endpoints",
            "pools.decode.balance",
            "routes[0].prefill",
            "routes[0].decode_pool",
            "routes[0].prefill_timeout_ms",
        ],
    );
    assert_eq!((err.problems[0].line, err.problems[0].column), (3, 10));
    assert_eq!(err.problems[1].line, 6);
}

/// The bounds on waits and relayed events: positive timeouts, an SSE limit no smaller
/// than ordinary token events, a known client-gone policy; valid values are kept.
#[test]
fn stream_bounds_and_client_gone_policy_are_validated() {
    let route = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n[[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n";
    let bad = format!("{route}stream_idle_timeout_ms = 0\nclient_write_timeout_ms = -1\non_client_gone = \"keep\"\nrelease_timeout_ms = 0\nmax_sse_event_bytes = 1024\n");
    let err = Config::from_toml(&bad, "t.toml").unwrap_err();
    assert_problem_keys(
        &err,
        &[
            "routes[0].stream_idle_timeout_ms",
            "routes[0].client_write_timeout_ms",
            "routes[0].on_client_gone",
            "routes[0].release_timeout_ms",
            "routes[0].max_sse_event_bytes",
        ],
    );
    assert!(err.problems[2].message.contains("release, abandon"), "{:?}", err.problems[2]);
    let good = format!("{route}stream_idle_timeout_ms = 5\nclient_write_timeout_ms = 6\non_client_gone = \"abandon\"\nrelease_timeout_ms = 7\nmax_sse_event_bytes = 65536\n");
    let config = Config::from_toml(&good, "t.toml").unwrap();
    let o = &config.routes[0];
    assert_eq!(
        (o.stream_idle_timeout_ms, o.client_write_timeout_ms),
        (Duration::from_millis(5), Duration::from_millis(6))
    );
    assert_eq!((o.on_client_gone, o.release_timeout_ms), (OnClientGone::Abandon, Duration::from_millis(7)));
    assert_eq!(o.max_sse_event_bytes, 65536);
}

#[test]
fn syntax_and_unknown_keys_are_located() {
    let err = Config::from_toml("[server]\nlisten = \n", "t").unwrap_err();
    assert_eq!(err.problems[0].line, 2);
    let err = Config::from_toml("[server]\nlisten_addr = \"1\"\n", "t").unwrap_err();
    assert!(err.problems[0].message.contains("listen_addr"), "{:?}", err.problems);
    assert_eq!(err.problems[0].line, 2);
}

/// A missing required key, a wrong type, a bad enum value, a typo'd key, a bad log
/// filter and a dangling pool reference: all reported in one run, each at its place.
#[test]
fn one_run_reports_missing_keys_types_enums_and_unknown_keys() {
    let text = r#"bogus = 1

[server]
threads = "two"
log_level = "warning"
log_fromat = "json"

[pools.decode]
balance = "random"

[[routes]]
name = "r"
mode = "sideways"
prefill = { pool = "nowhere", extra = 1 }

[[routes]]
mode = "orchestrate"
decode_pool = "decode"
prefill = { pool = "decode" }
token_reuse = "yes"
[routes.match]
pathz = ["/x"]
"#;
    let err = Config::from_toml(text, "t.toml").unwrap_err();
    let got: Vec<(usize, usize, &str)> = err.problems.iter().map(|p| (p.line, p.column, p.key.as_str())).collect();
    assert_eq!(
        got,
        [
            (1, 1, "bogus"),
            (4, 11, "server.threads"),
            (5, 13, "server.log_level"),
            (6, 1, "server.log_fromat"),
            (8, 1, "pools.decode.endpoints"),
            (9, 11, "pools.decode.balance"),
            (11, 1, "routes[0].decode_pool"),
            (13, 8, "routes[0].mode"),
            (14, 20, "routes[0].prefill.pool"),
            (14, 31, "routes[0].prefill.extra"),
            (16, 1, "routes[1].name"),
            (20, 15, "routes[1].token_reuse"),
            (22, 1, "routes[1].match.pathz"),
        ],
        "{:#?}",
        err.problems
    );
    let message = |key: &str| &err.problems.iter().find(|p| p.key == key).unwrap().message;
    assert_eq!(message("pools.decode.endpoints"), "required key is missing");
    assert_eq!(message("routes[0].mode"), "`sideways` is not one of: orchestrate, relay, passthrough");
    assert_eq!(message("pools.decode.balance"), "`random` is not one of: round_robin, least_in_flight, cache_aware");
    assert_eq!(message("server.threads"), "must be a whole number, not \"two\"");
    assert_eq!(message("routes[1].token_reuse"), "must be true, false or a fraction between 0.0 and 1.0, not \"yes\"");
    assert_eq!(message("routes[1].match.pathz"), "unknown key `pathz`; did you mean `paths`?");
    assert_eq!(message("server.log_fromat"), "unknown key `log_fromat`; did you mean `log_format`?");
}

#[test]
fn work_stealing_is_a_switch_on_by_default() {
    const POOL: &str = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
    let with = |v: &str| Config::from_toml(&format!("{POOL}[server]\nwork_stealing = {v}\n"), "t");
    assert!(Config::from_toml(POOL, "t").unwrap().server.work_stealing);
    assert!(!with("false").unwrap().server.work_stealing);
    let err = with("\"off\"").unwrap_err();
    assert_eq!(
        (err.problems.len(), err.problems[0].key.as_str(), err.problems[0].line),
        (1, "server.work_stealing", 4)
    );
}

#[test]
fn log_level_is_a_tracing_filter_whose_bare_words_are_levels() {
    const POOL: &str = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
    let with = |level: &str| Config::from_toml(&format!("{POOL}[server]\nlog_level = {level:?}\n"), "t");
    for good in ["info", "warn,tokenonce=debug", "tokenonce::proxy=trace,pingora=error", "DEBUG", "off"] {
        assert!(with(good).is_ok(), "{good}: {:?}", with(good).unwrap_err().problems);
    }
    for bad in ["verbose", "warning", "tokenonce=loud", "=info", "", "info;debug"] {
        let err = with(bad).unwrap_err();
        assert_eq!(
            (err.problems.len(), err.problems[0].key.as_str(), err.problems[0].line),
            (1, "server.log_level", 4),
            "{bad}"
        );
    }
}

#[test]
fn a_tokenizer_that_does_not_load_and_a_share_past_one_are_problems_at_their_keys() {
    let text = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\ntokenizer = \"/no/such/tokenizer.json\"\n\n[[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\nparity_sample = 1.5\non_parity_mismatch = \"panic\"\n";
    let err = config::from_toml(text, "t").unwrap_err();
    let got: Vec<(&str, usize)> = err.problems.iter().map(|p| (p.key.as_str(), p.line)).collect();
    assert_eq!(
        got,
        [("pools.decode.tokenizer", 3), ("routes[0].parity_sample", 9), ("routes[0].on_parity_mismatch", 10)]
    );
    assert!(err.problems[0].message.contains("cannot load tokenizer"), "{:?}", err.problems);
    assert_eq!(err.problems[2].message, "`panic` is not one of: alert, disable_reuse");
}

#[test]
fn a_table_or_array_of_the_wrong_type_is_one_problem_at_its_key() {
    let err = Config::from_toml("[pools.decode]\nendpoints = \"127.0.0.1:1\"\n", "t").unwrap_err();
    assert_eq!(err.problems.len(), 1);
    assert_eq!((err.problems[0].key.as_str(), err.problems[0].line), ("pools.decode.endpoints", 2));
    assert_eq!(err.problems[0].message, "must be a list, not \"127.0.0.1:1\"");
}

/// The security keys: port-fenced allowlists, trusted peers, header-only keys on a pool
/// prefill, an admin token that cannot be read or is too short: all reported together.
#[test]
fn security_keys_are_validated_together() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, "abc\n").unwrap();
    let text = format!(
        r#"
[server]
admin_token_file = "{}"

[pools.decode]
endpoints = ["127.0.0.1:8200"]
[pools.prefill]
endpoints = ["127.0.0.1:8100"]

[[routes]]
name = "llmd"
mode = "orchestrate"
decode_pool = "decode"
client_kv_transfer_params = "keep"
prefill = {{ header = "x-prefiller-host-port", allow = ["10.0.0.0/8:8000", "h.svc:9-8", "h.svc:0"], trusted_sources = ["gateway"] }}

[[routes]]
name = "pooled"
mode = "orchestrate"
decode_pool = "decode"
prefill = {{ pool = "prefill", forward_credentials = true }}
"#,
        short.display()
    );
    let err = config::from_toml(&text, "t").unwrap_err();
    assert_problem_keys(
        &err,
        &[
            "server.admin_token_file",
            "routes[0].client_kv_transfer_params",
            "routes[0].prefill.allow",
            "routes[0].prefill.allow",
            "routes[0].prefill.trusted_sources",
            "routes[1].prefill.forward_credentials",
        ],
    );
    assert!(err.problems[1].message.contains("strip, reject"), "{:?}", err.problems[1]);
    let missing = config::from_toml(
        "[server]\nadmin_token_file = \"/nonexistent/token\"\n[pools.decode]\nendpoints = [\"127.0.0.1:1\"]\n",
        "t",
    );
    assert!(missing.unwrap_err().problems[0].message.contains("cannot read"));
}

#[test]
fn an_admin_token_is_read_trimmed_and_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "  0123456789abcdef-token \n").unwrap();
    let text =
        format!("[server]\nadmin_token_file = \"{}\"\n[pools.decode]\nendpoints = [\"127.0.0.1:1\"]\n", file.display());
    let loaded = config::from_toml(&text, "t").unwrap();
    let token = loaded.resources.admin_token.as_ref().unwrap();
    assert!(token.matches("0123456789abcdef-token"));
    assert!(!token.matches("0123456789abcdef-tokeX") && !token.matches(""));
    assert!(!format!("{loaded:?}").contains("0123456789abcdef"), "Debug must not print the token");
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

/// `skip_below_tokens` decides an orchestrated pool prefill: with a header (which names the
/// prefiller per request) or on a relay route (whose orchestrator sends both legs) it is a
/// problem at its key; with a pool it is read, 512 when unset (a relay route's pool prefill
/// without the key loads: the default decides nothing there).
#[test]
fn skip_below_tokens_goes_with_an_orchestrated_pool_prefill() {
    let route = |mode: &str, prefill: &str| {
        format!(
            "[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\n[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n\
             [[routes]]\nname = \"r\"\nmode = \"{mode}\"\ndecode_pool = \"decode\"\nprefill = {prefill}\n"
        )
    };
    let header = r#"{ header = "x-prefiller-host-port", allow = ["127.0.0.1"], skip_below_tokens = 256 }"#;
    let err = Config::from_toml(&route("orchestrate", header), "t").unwrap_err();
    assert_problem_keys(&err, &["routes[0].prefill.skip_below_tokens"]);
    let pool = r#"{ pool = "prefill", skip_below_tokens = 256 }"#;
    let err = Config::from_toml(&route("relay", pool), "t").unwrap_err();
    assert_problem_keys(&err, &["routes[0].prefill.skip_below_tokens"]);
    let c = Config::from_toml(&route("orchestrate", pool), "t").unwrap();
    assert_eq!(c.routes[0].prefill.as_ref().unwrap().skip_below_tokens, 256);
    let c = Config::from_toml(&route("orchestrate", r#"{ pool = "prefill" }"#), "t").unwrap();
    assert_eq!(c.routes[0].prefill.as_ref().unwrap().skip_below_tokens, 512, "the default");
    assert!(Config::from_toml(&route("relay", r#"{ pool = "prefill" }"#), "t").is_ok());
    let off = r#"{ pool = "prefill", skip_below_tokens = 0 }"#;
    assert_eq!(
        Config::from_toml(&route("orchestrate", off), "t").unwrap().routes[0]
            .prefill
            .as_ref()
            .unwrap()
            .skip_below_tokens,
        0
    );
}

#[test]
fn versions_and_host_ports_parse() {
    assert_eq!(Version::parse("0.32.0"), Some(Version(0, 32, 0)));
    assert_eq!(Version::parse("0.27.0rc1.dev12+gabc"), Some(Version(0, 27, 0)));
    assert!(Version::parse("0.26.9") < Some(Version::CHAT_TOKEN_REUSE));
    assert_eq!(Version::parse("x"), None);
    assert!(is_host_port("10.0.0.5:8000"));
    assert!(is_host_port("prefill-0.svc:8000"));
    assert!(is_host_port("[::1]:8000"));
    for bad in ["10.0.0.5", "a:b", ":80", "a:0", "a b:80", "a:80,b:80", "h:99999"] {
        assert!(!is_host_port(bad), "{bad}");
    }
}

/// `upstream.eject_base_ms`: a positive duration of at most the longest ejection.
#[test]
fn the_first_ejection_length_is_bounded() {
    const POOL: &str = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
    let with = |v: &str| Config::from_toml(&format!("{POOL}[upstream]\neject_base_ms = {v}\n"), "t");
    assert_eq!(with("250").unwrap().upstream.eject_base_ms, Duration::from_millis(250));
    assert_eq!(with("\"2m\"").unwrap().upstream.eject_base_ms, Duration::from_secs(120));
    for bad in ["0", "120001", "\"5 s\"", "\"121s\""] {
        let err = with(bad).unwrap_err();
        let got: Vec<(&str, usize)> = err.problems.iter().map(|p| (p.key.as_str(), p.line)).collect();
        assert_eq!(got, [("upstream.eject_base_ms", 4)], "{bad}: {:?}", err.problems);
    }
}

const POOL: &str = "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";

/// The one problem of `text` followed by `POOL`, as `(line, column, key, message)`.
fn one_problem(text: &str) -> (usize, usize, String, String) {
    let err = Config::from_toml(&format!("{text}{POOL}"), "t").unwrap_err();
    assert_eq!(err.problems.len(), 1, "{text}: {:#?}", err.problems);
    let p = err.problems.into_iter().next().unwrap();
    (p.line, p.column, p.key, p.message)
}

/// Every duration key takes a string with a unit (ms, s, m, h, fractions, several in a row)
/// as well as an integer in the unit its name ends with.
#[test]
fn durations_are_strings_with_a_unit_or_integers_in_the_keys_unit() {
    let text = format!(
        "{POOL}[server]\nbody_read_timeout_ms = \"90s\"\ngrace_period_seconds = \"2m\"\ngraceful_shutdown_timeout_seconds = 7\n\
         [upstream]\nconnect_timeout_ms = \"500ms\"\nidle_timeout_ms = 3000\n[cache]\nttl_ms = \"1m\"\n\
         [[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\nprefill_timeout_ms = \"1.5s\"\n\
         stream_idle_timeout_ms = \"1m30s\"\ndecode_whole_answer_timeout_ms = \"1h\"\nrelease_timeout_ms = 250\n"
    );
    let c = Config::from_toml(&text, "t").unwrap();
    let (ms, secs) = (Duration::from_millis, Duration::from_secs);
    assert_eq!(c.server.body_read_timeout_ms, secs(90));
    assert_eq!((c.server.grace_period_seconds, c.server.graceful_shutdown_timeout_seconds), (120, 7));
    assert_eq!((c.upstream.connect_timeout_ms, c.upstream.idle_timeout_ms), (ms(500), ms(3000)));
    assert_eq!(c.cache.ttl_ms, secs(60));
    let r = &c.routes[0];
    assert_eq!((r.prefill_timeout_ms, r.stream_idle_timeout_ms), (ms(1500), secs(90)));
    assert_eq!((r.decode_whole_answer_timeout_ms, r.release_timeout_ms), (secs(3600), ms(250)));
}

/// A duration that is not one says how to write one, at its key and place.
#[test]
fn a_bad_duration_says_how_to_write_one() {
    for (text, want) in [
        (
            "[upstream]\nconnect_timeout_ms = \"30 s\"\n",
            "`30 s` is not a duration: write 500ms, 30s, 2m or a whole number of milliseconds",
        ),
        (
            "[upstream]\nconnect_timeout_ms = \"5sec\"\n",
            "`5sec` is not a duration: write 500ms, 30s, 2m or a whole number of milliseconds",
        ),
        ("[server]\ngrace_period_seconds = \"1.5s\"\n", "`1.5s` is not a whole number of seconds"),
        (
            "[server]\ngrace_period_seconds = \"soon\"\n",
            "`soon` is not a duration: write 30s, 2m, 1h or a whole number of seconds",
        ),
        ("[upstream]\nconnect_timeout_ms = -5\n", "must not be negative, not -5"),
        (
            "[upstream]\nconnect_timeout_ms = true\n",
            "must be a duration such as 500ms, 30s, 2m or a whole number of milliseconds, not true",
        ),
        (
            "[upstream]\nconnect_timeout_ms = 1.5\n",
            "must be a duration such as 500ms, 30s, 2m or a whole number of milliseconds, not 1.5",
        ),
    ] {
        let (line, column, key, message) = one_problem(text);
        let name = text.lines().nth(1).unwrap().split(' ').next().unwrap();
        assert_eq!((line, column), (2, name.len() + 4), "{text}");
        assert!(key.ends_with(name), "{text}: {key}");
        assert_eq!(message, want, "{text}");
    }
}

/// An unknown key names the key of its table it most likely meant, or lists them when none is
/// close; a misspelt choice names the choice.
#[test]
fn a_misspelt_key_or_choice_gets_a_suggestion() {
    assert_eq!(
        one_problem("[server]\ngrace_period_sec = 5\n"),
        (
            2,
            1,
            "server.grace_period_sec".into(),
            "unknown key `grace_period_sec`; did you mean `grace_period_seconds`?".into()
        )
    );
    assert_eq!(one_problem("[cache]\nttl = \"30s\"\n").3, "unknown key `ttl`; did you mean `ttl_ms`?");
    assert_eq!(
        one_problem("bogus = 1\n").3,
        "unknown key `bogus`; the keys here are: server, upstream, pools, defaults, routes, cache, tracing"
    );
    assert_eq!(
        one_problem("[upstream]\nhealth_interval = 100\n").3,
        "unknown key `health_interval`; did you mean `health_interval_ms`?"
    );
    let text = "[pools.p]\nendpoints = [\"127.0.0.1:1\"]\nbalance = \"least-in-flight\"\n";
    assert_eq!(
        one_problem(text),
        (
            3,
            11,
            "pools.p.balance".into(),
            "`least-in-flight` is not one of: round_robin, least_in_flight, cache_aware; did you mean `least_in_flight`?".into()
        )
    );
    assert_eq!(
        one_problem("[pools.p]\nendpoints = [\"127.0.0.1:1\"]\nbalance = \"random\"\n").3,
        "`random` is not one of: round_robin, least_in_flight, cache_aware"
    );
}

/// A value of the wrong type is named in the file's words (a whole number, a list, true or
/// false, a table), not serde's (`expected i64`, `a sequence`), with the value written.
#[test]
fn a_wrong_type_is_named_in_the_files_words() {
    for (text, key, want) in [
        ("[server]\nthreads = \"two\"\n", "server.threads", "must be a whole number, not \"two\""),
        ("[server]\nthreads = 2.5\n", "server.threads", "must be a whole number, not 2.5"),
        ("[server]\nthreads = -1\n", "server.threads", "must not be negative, not -1"),
        (
            "[upstream]\neject_after_failures = 5000000000\n",
            "upstream.eject_after_failures",
            "must be a whole number from 0 to 4294967295, not 5000000000",
        ),
        ("[server]\nwork_stealing = \"off\"\n", "server.work_stealing", "must be true or false, not \"off\""),
        ("[server]\nlisten = 8000\n", "server.listen", "must be a string, not 8000"),
        ("[server]\nlisten = [\"0.0.0.0:1\"]\n", "server.listen", "must be a string, not a list"),
        ("[pools.p]\nendpoints = \"127.0.0.1:1\"\n", "pools.p.endpoints", "must be a list, not \"127.0.0.1:1\""),
        ("[pools.p]\nendpoints = [1]\n", "pools.p.endpoints", "must be a string, not 1"),
        (
            "[pools.p]\nendpoints = [\"127.0.0.1:1\"]\nbalance = 1\n",
            "pools.p.balance",
            "must be one of: round_robin, least_in_flight, cache_aware, not 1",
        ),
        ("cache = 1\n", "cache", "must be a table, not 1"),
        (
            "[[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\nmatch = [\"/x\"]\n",
            "routes[0].match",
            "must be a table, not a list",
        ),
        (
            "[tracing]\nendpoint = \"http://c:4318/v1/traces\"\nsampling_ratio = \"all\"\n",
            "tracing.sampling_ratio",
            "must be a number, not \"all\"",
        ),
    ] {
        let (_, _, got_key, message) = one_problem(text);
        assert_eq!((got_key.as_str(), message.as_str()), (key, want), "{text}");
    }
}

/// A pool names its engines by `endpoints` or by a DNS name to `discover`, exactly one; the
/// name is a DNS name with a port (and ranks), looked up at a bounded interval, through a
/// `dns_server` that is an `ip:port`; a discovered pool with verified TLS needs `server_name`
/// (its endpoints are IP addresses).
#[test]
fn a_pool_discovers_its_endpoints_by_a_dns_name_or_lists_them_not_both() {
    let pool = |lines: &str| format!("{POOL}[pools.prefill]\n{lines}");
    let ok =
        Config::from_toml(&pool("discover = \"vllm-prefill:8000#0-7\"\ndiscover_interval_ms = \"2s\"\n"), "t").unwrap();
    let prefill = &ok.pools["prefill"];
    assert_eq!(
        (prefill.discover.as_deref(), prefill.discover_interval_ms),
        (Some("vllm-prefill:8000#0-7"), Duration::from_secs(2))
    );
    assert!(prefill.endpoints.is_empty());
    let default = Config::from_toml(&pool("discover = \"vllm-prefill:8000\"\n"), "t").unwrap();
    assert_eq!(default.pools["prefill"].discover_interval_ms, Duration::from_secs(5));
    for (lines, key, want) in [
        ("endpoints = [\"127.0.0.1:1\"]\ndiscover = \"vllm-prefill:8000\"\n", "pools.prefill.discover", "not both"),
        ("discover = \"vllm-prefill\"\n", "pools.prefill.discover", "is not name:port"),
        ("discover = \"10.0.0.1:8000\"\n", "pools.prefill.discover", "with a DNS name"),
        ("discover = \"vllm-prefill:8000#3-1\"\n", "pools.prefill.discover", "is not name:port"),
        (
            "discover = \"vllm-prefill:8000\"\ndiscover_interval_ms = 50\n",
            "pools.prefill.discover_interval_ms",
            "between 100 and",
        ),
        (
            "discover = \"vllm-prefill:8000\"\n[pools.prefill.tls]\nca_file = \"/x\"\n",
            "pools.prefill.tls.server_name",
            "discovered endpoints are IP addresses",
        ),
    ] {
        let err = Config::from_toml(&pool(lines), "t").unwrap_err();
        assert_eq!(err.problems.len(), 1, "{lines}: {:#?}", err.problems);
        assert_eq!(err.problems[0].key, key, "{lines}");
        assert!(err.problems[0].message.contains(want), "{lines}: {}", err.problems[0].message);
    }
    let (_, _, key, message) = one_problem("[upstream]\ndns_server = \"dns.local\"\n");
    assert_eq!((key.as_str(), message.as_str()), ("upstream.dns_server", "`dns.local` is not an ip:port address"));
    let with_server = Config::from_toml(&format!("[upstream]\ndns_server = \"127.0.0.1:5353\"\n{POOL}"), "t").unwrap();
    assert_eq!(with_server.upstream.dns_server.as_deref(), Some("127.0.0.1:5353"));
}

#[test]
fn kv_events_need_a_port_that_every_rank_can_offset_and_bounded_values() {
    let pools = |endpoint: &str, kv: &str| {
        format!("[pools.decode]\nendpoints = [\"{endpoint}\"]\n[pools.decode.kv_events]\n{kv}[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\n")
    };
    let err =
        Config::from_toml(&pools("127.0.0.1:8200", "block_size = 0\nmax_blocks = 0\nstale_after_ms = 0\n"), "t.toml")
            .unwrap_err();
    assert_problem_keys(
        &err,
        &[
            "pools.decode.kv_events.port",
            "pools.decode.kv_events.block_size",
            "pools.decode.kv_events.max_blocks",
            "pools.decode.kv_events.stale_after_ms",
        ],
    );
    assert!(err.problems[0].message.contains("required"), "{:?}", err.problems[0]);
    // vLLM publishes rank R on port + R: rank 7 past 65535 is refused, for the replay port too.
    let err =
        Config::from_toml(&pools("127.0.0.1:8200#0-7", "port = 65530\nreplay_port = 65529\n"), "t.toml").unwrap_err();
    assert_problem_keys(&err, &["pools.decode.kv_events.port", "pools.decode.kv_events.replay_port"]);
    assert!(err.problems[0].message.contains("rank 7"), "{:?}", err.problems[0]);
    let config =
        Config::from_toml(&pools("127.0.0.1:8200#0-7", "port = 5557\nstale_after_ms = \"2m\"\n"), "t.toml").unwrap();
    let kv = config.pools["decode"].kv_events.as_ref().unwrap();
    assert_eq!((kv.port, kv.replay_port, kv.hash_seed.as_str()), (5557, None, "vllm-none-hash"));
    assert_eq!((kv.block_size.get(), kv.stale_after_ms), (16, Duration::from_secs(120)));
    assert!(config.pools["prefill"].kv_events.is_none());
}

/// Engines sharing a host publish on ports of their own: `endpoint_ports` and
/// `endpoint_replay_ports` name a listed endpoint's `host:port` (its ranks offset the port as
/// they offset `port`); another address, or a port a rank would push past 65535, is refused.
#[test]
fn kv_events_ports_of_their_own_name_listed_endpoints() {
    let pools = |ports: &str| {
        format!(
            "[pools.prefill]\nendpoints = [\"127.0.0.1:8100\", \"127.0.0.1:8300#0-1\"]\n[pools.prefill.kv_events]\nport = 5557\n\
             replay_port = 5558\n{ports}[defaults]\npassthrough_pool = \"prefill\"\n"
        )
    };
    let config = Config::from_toml(
        &pools(
            "endpoint_ports = { \"127.0.0.1:8300\" = 5567 }\nendpoint_replay_ports = { \"127.0.0.1:8300\" = 5568 }\n",
        ),
        "t.toml",
    )
    .unwrap();
    let settings = config.pools["prefill"].kv_events.as_ref().unwrap().settings();
    assert_eq!(settings.endpoint_ports.get("127.0.0.1:8300"), Some(&5567));
    assert_eq!(settings.endpoint_replay_ports.get("127.0.0.1:8300"), Some(&5568));
    let err = Config::from_toml(
        &pools(
            "endpoint_ports = { \"127.0.0.1:8200\" = 5567 }\nendpoint_replay_ports = { \"127.0.0.1:8300\" = 65535 }\n",
        ),
        "t.toml",
    )
    .unwrap_err();
    assert_problem_keys(
        &err,
        &["pools.prefill.kv_events.endpoint_ports", "pools.prefill.kv_events.endpoint_replay_ports"],
    );
    assert!(err.problems[0].message.contains("not a host:port of the pool's `endpoints`"), "{:?}", err.problems[0]);
    assert!(err.problems[1].message.contains("rank 1"), "{:?}", err.problems[1]);
}

/// A cache-aware pool with KV events hashes its prompts as the engines do: its block size and
/// seed must be the events' (a chain hashed otherwise would never match what they report).
#[test]
fn a_cache_aware_pool_with_kv_events_hashes_as_the_events_say() {
    let config = |cache_aware: &str| {
        format!(
            "[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\n\
             balance = \"cache_aware\"\n[pools.prefill.kv_events]\nport = 5557\nblock_size = 32\nhash_seed = \"0\"\n\
             [pools.prefill.cache_aware]\n{cache_aware}"
        )
    };
    assert!(Config::from_toml(&config("block_size = 32\nhash_seed = \"0\"\n"), "t.toml").is_ok());
    let err = Config::from_toml(&config(""), "t.toml").unwrap_err();
    assert_problem_keys(&err, &["pools.prefill.cache_aware.block_size", "pools.prefill.cache_aware.hash_seed"]);
    assert_eq!(err.problems[0].message, "is 16 but kv_events.block_size is 32: both are the engines' --block-size");
    assert!(err.problems[1].message.contains("both are the engines' PYTHONHASHSEED"), "{:?}", err.problems[1]);
}

/// `kv_events.block_size` and `cache_aware.block_size` name one engine setting and take the
/// same sizes, 1 to 65536, each refused at its key; a cache-aware pool's pair is compared only
/// when both were read (a refused one is not named by its default).
#[test]
fn both_block_sizes_take_the_same_range() {
    let config = |balance: &str, kv: u32, cache_aware: u32| {
        format!(
            "{POOL}balance = \"{balance}\"\n[pools.decode.kv_events]\nport = 5557\nblock_size = {kv}\n\
             [pools.decode.cache_aware]\nblock_size = {cache_aware}\n"
        )
    };
    let big = Config::from_toml(&config("cache_aware", 8192, 8192), "t.toml").unwrap();
    assert_eq!(big.pools["decode"].cache_aware.block_size.get(), 8192);
    for bad in [0, 65537] {
        let err = Config::from_toml(&config("round_robin", bad, bad), "t.toml").unwrap_err();
        assert_problem_keys(&err, &["pools.decode.kv_events.block_size", "pools.decode.cache_aware.block_size"]);
        assert!(err.problems.iter().all(|p| p.message == "must be between 1 and 65536"), "{:#?}", err.problems);
        assert_eq!((err.problems[0].line, err.problems[0].column), (6, 14));
    }
    let err = Config::from_toml(&config("cache_aware", 0, 32), "t.toml").unwrap_err();
    assert_problem_keys(&err, &["pools.decode.kv_events.block_size"]);
}
