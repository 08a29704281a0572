//! README's quick start cannot go stale: it shows exactly the lines `tests/e2e/quickstart.sh`
//! runs (the e2e tier runs that file), and exactly the vLLM command `start.sh` runs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;
use std::process::Command;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

#[test]
fn readme_quick_start_is_the_script_the_tier_runs() {
    let script = read("tests/e2e/quickstart.sh");
    let block = script.split("# --- quick start ---\n").nth(1).unwrap().split("# --- end ---").next().unwrap();
    assert!(block.lines().count() >= 6, "{block}");
    let readme = read("README.md");
    assert!(
        readme.contains(&format!("```bash\n{block}```")),
        "README's quick start differs from tests/e2e/quickstart.sh:\n{block}"
    );
}

#[test]
fn readme_shows_the_vllm_command_start_sh_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("tests/e2e/vllm/start.sh"))
        .args(["--print", "8100"])
        .env_remove("XDG_CACHE_HOME")
        .env_remove("TOKENONCE_VLLM_VENV")
        .env_remove("TOKENONCE_VLLM_MODEL_DIR")
        .env_remove("TOKENONCE_NIXL_DIR")
        .env_remove("TOKENONCE_NIXL_SIDE_PORT")
        .env_remove("VLLM_CPU_KVCACHE_SPACE")
        .env_remove("PYTHONPATH")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(printed.contains("NixlConnector") && printed.contains("--port 8100"), "{printed}");
    assert!(read("README.md").contains(&format!("```bash\n{printed}```")), "README's vLLM command differs:\n{printed}");
}
