//! The command line as an operator meets it: `--version` names the build (the same facts
//! `tokenonce_build_info` labels), `--help` covers every subcommand, signals and environment,
//! and `check` answers with its documented exit status.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::process::{Command, Output};

fn tokenonce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tokenonce")).args(args).output().unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn version_names_the_release_commit_compiler_and_profile() {
    let line = stdout(&tokenonce(&["--version"]));
    let want = format!("tokenonce {} (commit {}, rustc ", env!("CARGO_PKG_VERSION"), tokenonce::build::COMMIT);
    assert!(line.starts_with(&want), "{line}");
    assert!(line.trim_end().ends_with(" profile)"), "{line}");
    assert_eq!(stdout(&tokenonce(&["-V"])).trim(), format!("tokenonce {}", env!("CARGO_PKG_VERSION")));
    // A checkout builds with its commit (CI and the README's commands build from one).
    if std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".git").exists() {
        assert_ne!(tokenonce::build::COMMIT, "unknown");
        assert!(tokenonce::build::COMMIT.chars().all(|c| c.is_ascii_hexdigit()), "{}", tokenonce::build::COMMIT);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn build_info_labels_what_version_prints() {
    let proxy = support::TokenOnce::start("[pools.decode]\nendpoints = [\"127.0.0.1:1\"]\n").await;
    let series = format!(
        r#"tokenonce_build_info{{commit="{}",profile="{}",rustc="{}",version="{}"}}"#,
        tokenonce::build::COMMIT,
        tokenonce::build::PROFILE,
        tokenonce::build::RUSTC,
        tokenonce::build::VERSION
    );
    assert_eq!(proxy.metric(&series).await, 1.0, "{}", proxy.metrics().await);
    assert!(tokenonce::build::LONG_VERSION.contains(tokenonce::build::RUSTC));
}

#[test]
fn help_covers_every_command_signal_and_variable() {
    let help = stdout(&tokenonce(&["--help"]));
    for needle in [
        "check",
        "print-default",
        "drain",
        "--config <FILE>",
        "SIGHUP",
        "SIGTERM",
        "TOKENONCE_LOG",
        "Exit status",
        "/readyz",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}:\n{help}");
    }
    let check = stdout(&tokenonce(&["check", "--help"]));
    assert!(check.contains("<FILE>") && check.contains("exits 1") && check.contains("LINE:COL"), "{check}");
    let print = stdout(&tokenonce(&["print-default", "--help"]));
    assert!(print.contains("127.0.0.1:8100") && print.contains("127.0.0.1:8200"), "{print}");
}

#[test]
fn check_exits_0_on_a_good_file_and_1_with_each_problem_on_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, stdout(&tokenonce(&["print-default"]))).unwrap();
    let out = tokenonce(&["check", good.to_str().unwrap()]);
    assert!(stdout(&out).contains(": ok (2 pools, 1 routes)"), "{out:?}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten = \"nowhere\"\nthreads = -1\n").unwrap();
    let out = tokenonce(&["check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("bad.toml:2:") && err.contains("server.listen"), "{err}");
    assert!(err.contains("bad.toml:3:") && err.contains("server.threads"), "{err}");
}

/// `tokenonce check` accepts the shipped configs and lists every problem of a bad one.
#[test]
fn check_command_reports_problems_with_locations() {
    for file in ["conf/default.toml", "conf/pd-pools.toml", "conf/llmd-header.toml"] {
        let out = tokenonce(&["check", file]);
        assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // The cache-aware example names a model folder of the machine it documents.
    let out = tokenonce(&["check", "--skip-missing-files", "conf/kv-aware.toml"]);
    let text = stdout(&out);
    assert!(text.contains(": ok (2 pools, 1 routes)"), "conf/kv-aware.toml: {out:?}");
    assert!(text.contains("skipped pools.prefill.tokenizer `/models/Qwen3-0.6B`"), "{text}");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[pools.decode]\nendpoints = [\"nohost\"]\n\n[[routes]]\nname = \"r\"\nmode = \"sideways\"\ndecode_pool = \"nope\"\n").unwrap();
    let out = tokenonce(&["check", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3 problem(s)"), "{err}");
    assert!(err.contains("bad.toml:2:14: pools.decode.endpoints"), "{err}");
    assert!(err.contains(":6:8: routes[0].mode"), "{err}");
    assert!(err.contains(":7:15: routes[0].decode_pool"), "{err}");
}

/// The shipped Kubernetes configs name files only their pod has (the admin token Secret, the
/// model volume): `check --skip-missing-files` passes on each and lists what it skipped;
/// without the flag each missing file is a problem at its key naming the path.
#[test]
fn check_skips_a_pods_missing_files_only_when_asked() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut shipped = vec![root.join("conf/k8s/base/tokenonce.toml")];
    for overlay in std::fs::read_dir(root.join("conf/k8s/overlays")).unwrap() {
        let file = overlay.unwrap().path().join("tokenonce.toml");
        if file.exists() {
            shipped.push(file);
        }
    }
    assert!(shipped.len() >= 2, "the base and the overlays' configs: {shipped:?}");
    for file in &shipped {
        let name = file.to_str().unwrap();
        let out = tokenonce(&["check", "--skip-missing-files", name]);
        let text = stdout(&out);
        assert!(text.contains(": ok ("), "{name}: {text}");
        assert!(text.contains("skipped server.admin_token_file `/etc/tokenonce-admin/token`"), "{name}: {text}");

        let out = tokenonce(&["check", name]);
        assert_eq!(out.status.code(), Some(1), "{name}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("server.admin_token_file: cannot read `/etc/tokenonce-admin/token`"), "{name}: {err}");
    }
    // The base turns local ids on with the model folder from the shared volume.
    let text = stdout(&tokenonce(&["check", "--skip-missing-files", shipped[0].to_str().unwrap()]));
    assert!(text.contains("skipped pools.prefill.tokenizer `/model`"), "{text}");
}

/// A file that is there is still loaded and checked with `--skip-missing-files`: a token too
/// short to protect anything fails as without the flag.
#[test]
fn check_skip_missing_files_still_checks_the_files_that_exist() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "short\n").unwrap();
    let file = dir.path().join("tokenonce.toml");
    let config = format!(
        "[server]\nadmin_token_file = \"{}\"\n\n[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\ntokenizer = \"{}\"\n",
        token.display(),
        dir.path().join("no-such-model").display()
    );
    std::fs::write(&file, config).unwrap();
    let out = tokenonce(&["check", "--skip-missing-files", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("1 problem(s)") && err.contains("server.admin_token_file"), "{err}");
    assert!(err.contains("at least 16 printable characters"), "{err}");
}

/// `tokenonce drain` (the decode pod's preStop hook, in an image without a shell) reads the
/// admin token from the file the config names and calls /drain on the config's admin listener:
/// /readyz fails afterwards. A token the server does not hold, an unreadable token file and a
/// listener that is not there each exit 1 saying why, and drain nothing.
#[tokio::test(flavor = "multi_thread")]
async fn drain_command_sends_the_token_from_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "s3cret-admin-token-0123\n").unwrap();
    let settings = support::Settings {
        server_extra: format!("admin_token_file = \"{}\"\n", token_file.display()),
        ..support::Settings::default()
    };
    let engine = support::FakeVllm::start(support::FakeConfig::default()).await;
    let config = format!("[pools.decode]\nendpoints = [\"{}\"]\n", engine.host_port());
    let proxy = support::TokenOnce::start_with(&config, &settings).await;
    proxy.wait_ready(200).await;
    let admin = proxy.admin.trim_start_matches("http://").to_owned();
    let readyz = format!("{}/readyz", proxy.admin);

    // The pod's config as the hook reads it: the admin listener on all interfaces (called on
    // loopback) and the token file.
    let port = admin.rsplit_once(':').unwrap().1;
    let pod_config = dir.path().join("pod.toml");
    let text = std::fs::read_to_string(proxy.config_path()).unwrap();
    let text = text.replace("admin_listen = \"127.0.0.1:0\"", &format!("admin_listen = \"0.0.0.0:{port}\""));
    assert!(text.contains(&format!("0.0.0.0:{port}")), "{text}");
    std::fs::write(&pod_config, text).unwrap();
    let pod_config = pod_config.to_str().unwrap().to_owned();

    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            tokenonce(&args)
        })
    };
    let other_token = dir.path().join("other-token");
    std::fs::write(&other_token, "another-admin-token-4567\n").unwrap();
    let refused = support::RefusedAddr::new();
    let refused_addr = refused.addr.to_string();
    let failing = [
        (vec!["--admin-token-file", other_token.to_str().unwrap()], "answered 403"),
        (vec!["--admin-token-file", "/nonexistent/token"], "cannot read `/nonexistent/token`"),
        (vec!["--admin", refused_addr.as_str()], "Connection refused"),
    ];
    for (extra, why) in failing {
        let mut args: Vec<String> =
            ["--config", &pod_config, "drain", "--wait-seconds", "0"].map(String::from).to_vec();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let out = run(args.clone()).await.unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!err.contains("s3cret-admin-token-0123"), "the token is never printed: {err}");
        assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 200, "{args:?} drained nothing");
    }

    let args = ["--config", &pod_config, "drain", "--wait-seconds", "1"].map(String::from).to_vec();
    let out = run(args).await.unwrap();
    let text = stdout(&out);
    assert!(text.contains(&format!("127.0.0.1:{port} answered 200")), "{text}");
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 503, "drained: /readyz fails");
}
