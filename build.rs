//! Build facts for `tokenonce --version` and the `tokenonce_build_info` metric: the git commit
//! the binary was built from (`unknown` outside a checkout, or `TOKENONCE_BUILD_COMMIT` when
//! set, e.g. by an image build without `.git`), the compiler and the cargo profile.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=TOKENONCE_BUILD_COMMIT");
    let commit = std::env::var("TOKENONCE_BUILD_COMMIT").ok().filter(|c| !c.is_empty()).or_else(|| {
        // A new commit or checkout moves HEAD's log: build again to pick up the new id.
        if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
            println!("cargo:rerun-if-changed={dir}/HEAD");
            println!("cargo:rerun-if-changed={dir}/logs/HEAD");
        }
        git(&["rev-parse", "--short=12", "HEAD"])
    });
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TOKENONCE_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
    println!("cargo:rustc-env=TOKENONCE_RUSTC={rustc_version}");
    println!("cargo:rustc-env=TOKENONCE_PROFILE={}", std::env::var("PROFILE").unwrap_or_else(|_| "unknown".into()));
}
