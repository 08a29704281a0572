//! The docs cannot go stale: README's quick start is exactly what `tests/e2e/quickstart.sh`
//! runs (the e2e tier runs that file) and the vLLM command `start.sh` runs; every TOML example
//! loads; `docs/configuration.md` is generated from the code (`TOKENONCE_BLESS=1` rewrites it)
//! and every default it states is the one tokenonce applies.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "docs/reference.rs"]
mod reference;

use std::path::Path;
use std::process::Command;

use support::read_repo;
use tokenonce::config::Config;

#[test]
fn readme_quick_start_is_the_script_the_tier_runs() {
    let script = read_repo("tests/e2e/quickstart.sh");
    let block = script.split("# --- quick start ---\n").nth(1).unwrap().split("# --- end ---").next().unwrap();
    assert!(block.lines().count() >= 6, "{block}");
    let readme = read_repo("README.md");
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
    assert!(
        read_repo("README.md").contains(&format!("```bash\n{printed}```")),
        "README's vLLM command differs:\n{printed}"
    );
}

/// Every Markdown file of the book and README (`docs/*.md`).
fn markdown_files() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![String::from("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    files.sort();
    files
}

/// The ```toml blocks of a Markdown text.
fn toml_blocks(text: &str) -> Vec<String> {
    text.split("\n```toml\n").skip(1).map(|b| b.split("\n```").next().unwrap().to_owned() + "\n").collect()
}

/// Every TOML block in README and the book, and every `conf/*.toml`, is a whole config that
/// loads as `tokenonce check` loads it; the book does show some.
#[test]
fn every_toml_example_is_a_config_that_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut examples = Vec::new();
    for file in markdown_files() {
        for (i, block) in toml_blocks(&read_repo(&file)).into_iter().enumerate() {
            examples.push((format!("{file}, toml block {}", i + 1), block));
        }
    }
    assert!(examples.len() >= 2, "{:?}", examples.iter().map(|e| &e.0).collect::<Vec<_>>());
    for entry in std::fs::read_dir(root.join("conf")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            examples.push((path.display().to_string(), std::fs::read_to_string(&path).unwrap()));
        }
    }
    assert!(examples.iter().filter(|e| e.0.contains("conf/")).count() >= 4);
    for (name, text) in &examples {
        if let Err(e) = Config::from_toml(text, name) {
            let problems: Vec<String> = e.problems.iter().map(ToString::to_string).collect();
            panic!("{name} does not load:\n{}\n{text}", problems.join("\n"));
        }
    }
    assert!(toml_blocks("a\n```toml\nx = 1\n```\n").len() == 1, "the block finder finds blocks");
}

fn reference_sections() -> Vec<reference::Section> {
    reference::sections(&read_repo("src/config/file.rs"), &read_repo("src/config/values.rs"))
}

/// `docs/configuration.md` is what the code generates: a key added, removed or renamed in
/// `src/config/file.rs`, or a changed doc or default, fails here until the page is regenerated
/// with `TOKENONCE_BLESS=1 cargo test --test docs`.
#[test]
fn configuration_reference_is_generated_from_the_code() {
    let page = reference::render(&reference_sections(), &read_repo("conf/default.toml"));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    if std::env::var_os("TOKENONCE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &page).unwrap();
    }
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        written == page,
        "docs/configuration.md is not what src/config/file.rs generates; run `TOKENONCE_BLESS=1 cargo test --test docs` \
         and commit the result (first differing line: {:?})",
        written.lines().zip(page.lines()).enumerate().find(|(_, (a, b))| a != b).map_or(written.lines().count().min(page.lines().count()) + 1, |(i, _)| i + 1)
    );
}

/// The pools every probe config has.
const POOLS: &str =
    "[pools.prefill]\nendpoints = [\"127.0.0.1:8100\"]\n[pools.decode]\nendpoints = [\"127.0.0.1:8200\"]\n";
/// A route with its tables still open for keys.
const ROUTE: &str = "[[routes]]\nname = \"r\"\ndecode_pool = \"decode\"\n";

/// Configs that end inside the table of `section` (a reference section path), so a key line
/// appended belongs to it; several where a key is meant for one kind of route or prefill.
fn probes(section: &str) -> Vec<String> {
    let pool_prefill = "prefill = { pool = \"prefill\" }\n";
    match section {
        "routes" => ["orchestrate", "relay", "passthrough"]
            .iter()
            .map(|mode| format!("{POOLS}{ROUTE}{pool_prefill}mode = \"{mode}\"\n"))
            .collect(),
        "routes.match" => vec![format!("{POOLS}{ROUTE}{pool_prefill}mode = \"orchestrate\"\n[routes.match]\n")],
        "routes.prefill" => vec![
            format!("{POOLS}{ROUTE}mode = \"orchestrate\"\n[routes.prefill]\npool = \"prefill\"\n"),
            format!(
                "{POOLS}{ROUTE}mode = \"orchestrate\"\n[routes.prefill]\nheader = \"x-prefiller-host-port\"\nallow = [\"127.0.0.1\"]\n"
            ),
        ],
        "routes.prefill.allow" => vec![format!(
            "{POOLS}{ROUTE}mode = \"orchestrate\"\n[routes.prefill]\nheader = \"x-prefiller-host-port\"\n[[routes.prefill.allow]]\n"
        )],
        "routes.prefill.allow.tls" => vec![format!(
            "{POOLS}{ROUTE}mode = \"orchestrate\"\n[routes.prefill]\nheader = \"x-prefiller-host-port\"\n[[routes.prefill.allow]]\nmatch = \"prefill.test:8443\"\n[routes.prefill.allow.tls]\n"
        )],
        "pools.NAME" => vec![POOLS.to_owned()],
        "pools.NAME.tls" => vec![format!("{POOLS}[pools.decode.tls]\nserver_name = \"engine.test\"\n")],
        "pools.NAME.kv_events" => vec![format!("{POOLS}[pools.decode.kv_events]\nport = 5557\n")],
        "pools.NAME.cache_aware" => vec![format!("{POOLS}[pools.decode.cache_aware]\n")],
        "tracing" => vec![format!("{POOLS}[tracing]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\n")],
        table => vec![format!("{POOLS}[{table}]\n")],
    }
}

/// The loaded config, as Debug shows all of it, or the problems.
fn load(text: &str) -> Result<String, String> {
    Config::from_toml(text, "probe")
        .map(|c| format!("{c:?}"))
        .map_err(|e| e.problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
}

/// Another value of the default's type: it must change the loaded config or be refused, which
/// shows the comparison below can see the key at all.
fn other_value(default: &str) -> String {
    match default {
        "true" => "false".into(),
        "false" => "true".into(),
        s if s.starts_with('"') => format!("{}x\"", s.trim_end_matches('"')),
        s if s.contains('.') => {
            let v: f64 = s.parse().unwrap();
            format!("{:?}", if v >= 0.5 { v / 2.0 } else { v * 2.0 })
        }
        s => (s.parse::<i64>().unwrap() + 1).to_string(),
    }
}

/// Every default the reference states is the default tokenonce applies: writing `key = DEFAULT`
/// loads the same config as leaving the key out, while another value changes it (or is
/// refused), in a config where the key belongs.
#[test]
fn every_documented_default_is_the_loaded_default() {
    let mut checked = 0;
    for section in reference_sections() {
        for key in &section.keys {
            let Some(default) = &key.default else { continue };
            let name = key.path.rsplit('.').next().unwrap();
            let mut tried = Vec::new();
            let holds = probes(&section.path).iter().any(|base| {
                let omitted = load(base);
                let explicit = load(&format!("{base}{name} = {default}\n"));
                let other = load(&format!("{base}{name} = {}\n", other_value(default)));
                let holds = omitted.is_ok() && explicit == omitted && other != omitted;
                tried.push(format!(
                    "{base}{name} = {default}\n  omitted: {omitted:?}\n  explicit: {explicit:?}\n  other: {other:?}"
                ));
                holds
            });
            assert!(
                holds,
                "`{}`: the documented default `{default}` is not what loads:\n{}",
                key.path,
                tried.join("\n")
            );
            checked += 1;
        }
    }
    assert!(checked >= 40, "{checked} defaults checked");
}

/// A value of a key's type, for the probe below.
fn sample(kind: &str) -> &'static str {
    match kind {
        "string" => "\"x\"",
        "integer" => "1",
        "float" | "boolean or float" => "0.5",
        "boolean" => "true",
        k if k.starts_with("array") => "[\"x\"]",
        _ => "{ x = \"x\" }",
    }
}

/// Every key the reference names is one the parser takes where the reference puts it (a
/// rename in serde that the generator missed would read as an unknown key here), and the
/// reference covers every table.
#[test]
fn every_documented_key_is_a_key_the_parser_knows() {
    let sections = reference_sections();
    let paths: Vec<&str> = sections.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "server",
            "server.tls",
            "upstream",
            "pools.NAME",
            "pools.NAME.tls",
            "pools.NAME.cache_aware",
            "pools.NAME.kv_events",
            "defaults",
            "routes",
            "routes.match",
            "routes.prefill",
            "routes.prefill.allow",
            "routes.prefill.allow.tls",
            "cache",
            "tracing"
        ]
    );
    let unknown = load(&format!("{POOLS}[server]\nno_such_key = 1\n")).unwrap_err();
    assert!(unknown.contains("unknown key"), "{unknown}");
    for section in &sections {
        for key in &section.keys {
            let name = key.path.rsplit('.').next().unwrap();
            for base in probes(&section.path) {
                let problems = load(&format!("{base}{name} = {}\n", sample(&key.kind))).err().unwrap_or_default();
                assert!(!problems.contains("unknown key"), "{}: {problems}", key.path);
            }
        }
    }
}

/// The keys the reference marks *Fixed at start* (in the key's meaning, or its table's) are
/// exactly those a reload reports as needing a restart (`src/reload.rs`
/// `fixed_settings_changed`, where `tracing` stands for the whole table).
#[test]
fn keys_fixed_at_start_are_the_ones_a_reload_names() {
    let reload = read_repo("src/reload.rs");
    let body = reload.split("fn fixed_settings_changed").nth(1).unwrap().split("\n}\n").next().unwrap();
    let mut named: Vec<String> = body.split('"').skip(1).step_by(2).map(str::to_owned).collect();
    let mut marked: Vec<String> = Vec::new();
    for section in reference_sections() {
        if section.intro.contains("Fixed at start") && section.path == "tracing" {
            marked.push(section.path.clone());
            continue;
        }
        for key in section.keys {
            if key.meaning.contains("Fixed at start") || section.intro.contains("Fixed at start") {
                marked.push(key.path);
            }
        }
    }
    named.sort();
    marked.sort();
    assert!(named.len() >= 10, "{named:?}");
    assert_eq!(marked, named, "keys marked `Fixed at start` vs src/reload.rs");
}

/// The fallback table (docs/concepts.md) has a row for every reason tokenonce counts, and no
/// other.
#[test]
fn fallback_table_lists_every_reason() {
    let concepts = read_repo("docs/concepts.md");
    let table = concepts.split("\n## When tokenonce falls back to the text decode\n").nth(1).unwrap();
    let table = table.split("\n## ").next().unwrap();
    let mut rows: Vec<&str> = table.lines().filter_map(|l| l.strip_prefix("| `")?.split('`').next()).collect();
    let mut reasons: Vec<&str> = tokenonce::openai::FallbackReason::ALL.iter().map(|r| r.as_str()).collect();
    rows.sort_unstable();
    reasons.sort_unstable();
    assert!(reasons.len() > 10, "{reasons:?}");
    assert_eq!(rows, reasons, "docs/concepts.md fallback table vs openai::FallbackReason");
}

/// ARCHITECTURE.md's map of rooms names every file of `src/` (a file `room/x.rs` in its room's
/// lines, a nested folder by its name), and lib.rs's module map every module of the crate
/// root: a room added without its line fails here.
#[test]
fn every_room_and_file_is_on_the_maps() {
    let architecture = read_repo("ARCHITECTURE.md");
    let block = architecture.split("\n## The rooms").nth(1).unwrap().split("```").nth(1).unwrap();
    // A room's entry starts at a line with one leading space; deeper lines continue it.
    let mut rooms: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        match line.strip_prefix(' ').filter(|rest| !rest.starts_with(' ')) {
            Some(rest) => rooms.push((rest.split_whitespace().next().unwrap_or("").to_owned(), line.to_owned())),
            None => {
                if let Some((_, text)) = rooms.last_mut() {
                    text.push_str(line);
                }
            }
        }
    }
    assert!(rooms.len() > 15, "{rooms:?}");
    let src = support::repo("src");
    let mut missing = Vec::new();
    let mut files = vec![src.clone()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let rel = path.strip_prefix(&src).unwrap().to_str().unwrap().to_owned();
        let parts: Vec<&str> = rel.split('/').collect();
        let file = *parts.last().unwrap();
        let named = match parts.as_slice() {
            _ if file == "mod.rs" || file == "tests.rs" => true,
            [_] => block.contains(file),
            // A room is a folder, or a file with a folder of submodules beside it (`app.rs`).
            [room, ..] => rooms.iter().any(|(name, text)| {
                (name == &format!("{room}/") || name == &format!("{room}.rs"))
                    && (text.contains(file) || (parts.len() > 2 && text.contains(&format!("{}/", parts[1]))))
            }),
            [] => true,
        };
        if !named {
            missing.push(rel);
        }
    }
    missing.sort();
    assert!(missing.is_empty(), "files of src/ not on ARCHITECTURE.md's map of rooms: {missing:?}");

    let lib = read_repo("src/lib.rs");
    let map: String = lib.lines().filter(|l| l.starts_with("//!")).collect();
    let modules: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim_start_matches("pub ").strip_prefix("mod ")?.strip_suffix(';'))
        .chain(lib.lines().filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(" {")))
        .collect();
    assert!(modules.len() > 15, "{modules:?}");
    let unmapped: Vec<&&str> = modules.iter().filter(|m| !map.contains(&format!("`{m}`"))).collect();
    assert!(unmapped.is_empty(), "modules missing from lib.rs's module map: {unmapped:?}");
}
