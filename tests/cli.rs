//! The command line as an operator meets it: `--version` names the build (the same facts
//! `tokenonce_build_info` labels), `--help` covers every subcommand, signals and environment,
//! and `check` answers with its documented exit status.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

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
    for needle in
        ["check", "print-default", "--config <FILE>", "SIGHUP", "SIGTERM", "TOKENONCE_LOG", "Exit status", "/readyz"]
    {
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
