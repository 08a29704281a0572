//! Local ids against vLLM 0.32's own prompt ids, per model family: every case of
//! tests/fixtures/families/<family>.json (recorded by tests/e2e/families/record.py from vLLM's
//! render server on the folder tests/e2e/families/setup.py builds) goes through the function
//! local ids use (`LocalIds::ids`), and gives exactly vLLM's ids or its named unsupported
//! reason (then it is never sent token-in). The folders (real tokenizers, tens of MB) are not in
//! the repo: the e2e tier (tests/e2e/run.sh) runs this target with `TOKENONCE_FAMILIES_DIR`
//! set; without it, or with a family's folder missing, it fails. Not run by a plain
//! `cargo test` (`test = false` in Cargo.toml).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tokenonce::config::LocalIdsMode;
use tokenonce::local::{LocalIds, Policy};
use tokenonce::openai::Api;
use tokenonce::parity::Tokenizer;
use tokenonce::render::{ChatTemplate, LoadError, LoadOptions, Mistral, Tekken, TEKKEN_FILE};

const ENV: &str = "TOKENONCE_FAMILIES_DIR";

/// The recorded families (tests/fixtures/families/<family>.json).
const FAMILIES: [&str; 6] = ["llama3_1", "gemma3", "deepseek_v3", "phi3_5", "gptoss", "mistral"];

/// What tokenonce does with a recorded case vLLM answered with ids, where that is not to
/// render them exactly: (case, reason label). Every other answered case must be exact, and
/// every case listed here must still be unsupported for this reason (so this table, and the
/// one in docs/parity.md, stay true).
const UNSUPPORTED: &[(&str, &[(&str, &str)])] =
    &[("llama3_1", &[]), ("gemma3", &[]), ("deepseek_v3", &[]), ("phi3_5", &[]), ("gptoss", &[]), ("mistral", &[])];

/// vLLM's refusals that depend on the server's flags, not on the request (a tool choice
/// other than auto or none without `--tool-call-parser`, `online_renderer.py`): checked before
/// vLLM looks at forwarded ids, so the token-in form is refused in the same words (recorded:
/// tests/fixtures/vllm/tokenin_tool_choice_required_no_parser.json); tokenonce may render
/// them. (family, cases).
const REFUSED_TOKEN_IN_TOO: &[(&str, &[&str])] = &[
    // (its history's tool turns make Gemma's template raise first: not rendered here)
    ("gemma3", &["tool_choice_required", "tool_choice_named"]),
    ("phi3_5", &["tool_choice_required", "tool_choice_named", "tool_choice_named_in_history"]),
];

/// Families whose folder tokenonce refuses to render for (every request of such a pool goes
/// as text, and `local_ids` cannot be turned on for it), with the reason: none of the
/// recorded ones now.
const REFUSED_AT_LOAD: &[(&str, &str)] = &[];

fn folder(family: &str) -> PathBuf {
    let dir = std::env::var_os(ENV)
        .unwrap_or_else(|| panic!("{ENV} is not set: point it at the folders tests/e2e/families/setup.py builds"));
    let dir = PathBuf::from(dir).join(family);
    assert!(
        dir.join("SOURCES.json").is_file(),
        "{}: no model folder (run python3 tests/e2e/families/setup.py)",
        dir.display()
    );
    dir
}

fn fixture(family: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/families/{family}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(doc["vllm_version"], "0.32.0", "{}", path.display());
    doc
}

/// The family's folder holds the files its fixture was recorded from (same sha256s).
fn check_folder(family: &str, dir: &Path, doc: &Value) {
    let sources: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("SOURCES.json")).unwrap()).unwrap();
    for (file, sum) in doc["folder"].as_object().unwrap() {
        assert_eq!(&sources["files"][file]["sha256"], sum, "{family}: {file} is not the recorded one");
    }
}

/// Per family: exact, unsupported by reason, differing (case names).
#[derive(Default)]
struct Tally {
    exact: usize,
    unsupported: BTreeMap<String, Vec<String>>,
    wrong: Vec<String>,
}

fn run(family: &str) -> Tally {
    let dir = folder(family);
    let doc = fixture(family);
    check_folder(family, &dir, &doc);
    let expected: BTreeMap<&str, &str> =
        UNSUPPORTED.iter().find(|(f, _)| *f == family).map(|(_, c)| c.iter().copied().collect()).unwrap_or_default();
    let refused_token_in_too: Vec<&str> =
        REFUSED_TOKEN_IN_TOO.iter().find(|(f, _)| *f == family).map(|(_, c)| c.to_vec()).unwrap_or_default();
    let mut tally = Tally::default();
    // vLLM writes its server's date into Harmony's system message (`datetime.now()`),
    // tokenonce the date of the request: the renderer gets the recording's date, as
    // `VLLM_SYSTEM_START_DATE` pins vLLM's.
    let options = match family {
        "gptoss" => {
            let recorded_on = doc["recorded_on"].as_str().expect("record.py writes the recording's date");
            LoadOptions { system_start_date: Some(recorded_on.into()), ..LoadOptions::default() }
        }
        _ => LoadOptions::default(),
    };
    let local = match load(family, &dir, options) {
        Ok(local) => Some(local),
        Err(LoadError::Unsupported(reason)) => {
            let want = REFUSED_AT_LOAD.iter().find(|(f, _)| *f == family).map(|(_, r)| *r);
            assert_eq!(Some(reason.label()), want, "{family}: the folder is refused for local rendering");
            // the whole pool goes as text: every case counts under the load's reason
            let cases = doc["cases"].as_array().unwrap();
            let names = cases.iter().map(|c| c["name"].as_str().unwrap().to_owned()).collect();
            tally.unsupported.insert(reason.label().to_owned(), names);
            return tally;
        }
        Err(e) => panic!("{family}: the folder does not load: {e}"),
    };
    let local = local.unwrap();
    assert!(!REFUSED_AT_LOAD.iter().any(|(f, _)| *f == family), "{family}: loads, but is listed as refused");
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let body = case["body"].as_str().unwrap().as_bytes();
        // a case without `api` is a chat request (record.py)
        let api = if case["api"] == "completions" { Api::Completions } else { Api::Chat };
        let ours = local.ids(api, body);
        match (case["status"].as_u64(), ours) {
            (Some(200), Ok((ids, _))) => {
                let want: Vec<u32> = serde_json::from_value(case["prompt_token_ids"].clone()).unwrap();
                if ids == want && !expected.contains_key(name) {
                    tally.exact += 1;
                } else if ids == want {
                    tally.wrong.push(format!("{name}: exact now, but listed as {:?}", expected[name]));
                } else {
                    let at = ids.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(ids.len().min(want.len()));
                    let local_text = local_decode(&dir, ids.get(at..).unwrap_or_default());
                    let vllm_text = local_decode(&dir, want.get(at..).unwrap_or_default());
                    tally.wrong.push(format!(
                        "{name}: first difference at id {at}:\n    here: {local_text:?}\n    vLLM: {vllm_text:?}"
                    ));
                }
            }
            (Some(200), Err(reason)) if expected.get(name) == Some(&reason) => {
                tally.unsupported.entry(reason.to_owned()).or_default().push(name.to_owned());
            }
            (Some(200), Err(reason)) => tally.wrong.push(format!(
                "{name}: unsupported here ({reason}) but not listed (expected {:?})",
                expected.get(name)
            )),
            // vLLM refused it: tokenonce must not produce ids (it would send them token-in)
            (_, Err(reason)) => tally.unsupported.entry(reason.to_owned()).or_default().push(name.to_owned()),
            (_, Ok(_)) if refused_token_in_too.contains(&name) => {
                tally.unsupported.entry("refused_token_in_too".to_owned()).or_default().push(name.to_owned());
            }
            (status, Ok(_)) => tally.wrong.push(format!(
                "{name}: vLLM refused it ({status:?}: {}) but tokenonce renders it",
                case["error"].as_str().unwrap_or_default().chars().take(160).collect::<String>()
            )),
        }
    }
    let refused = tally.unsupported.get("refused_token_in_too").cloned().unwrap_or_default();
    for name in refused_token_in_too.iter().filter(|n| !refused.iter().any(|r| r == *n)) {
        tally.wrong.push(format!("{name}: listed as refused by vLLM token-in too, but vLLM answered it"));
    }
    tally
}

/// The family's local ids as a pool on its folder gets them (in shadow): Mistral's renderer
/// for a Mistral folder, else its chat template and tokenizer.
fn load(family: &str, dir: &Path, options: LoadOptions) -> Result<LocalIds, LoadError> {
    let policy = Policy { mode: LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
    // a Mistral folder's pool tokenizer is its tekken.json, which the renderer shares
    let pool_tokenizer = Tokenizer::load(dir).ok();
    let tekken = pool_tokenizer.as_ref().and_then(Tokenizer::tekken);
    match Mistral::for_folder(dir, &options, tekken) {
        Some(mistral) => mistral.map(|m| LocalIds::mistral(family, Arc::new(m), policy)),
        None => ChatTemplate::load(dir, options).map(|template| {
            let tokenizer = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
            LocalIds::new(family, Arc::new(template), Arc::new(tokenizer), policy).unwrap()
        }),
    }
}

fn local_decode(dir: &Path, ids: &[u32]) -> String {
    let ids = &ids[..ids.len().min(24)];
    if dir.join(TEKKEN_FILE).is_file() {
        return Tekken::load(&dir.join(TEKKEN_FILE)).unwrap().decode_lossy(ids);
    }
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    tokenizer.decode(ids, false).unwrap_or_default()
}

fn check(family: &str) {
    let tally = run(family);
    let reasons: Vec<String> = tally
        .unsupported
        .iter()
        .map(|(reason, names)| format!("{reason} {}: {}", names.len(), names.join(", ")))
        .collect();
    println!(
        "{family}: {} exact, {} unsupported ({}), {} differing",
        tally.exact,
        tally.unsupported.values().map(Vec::len).sum::<usize>(),
        reasons.join("; "),
        tally.wrong.len()
    );
    assert!(tally.wrong.is_empty(), "{family}: {} cases differ:\n{}", tally.wrong.len(), tally.wrong.join("\n"));
}

/// Llama 3.1 (its tool-calling template): every recorded case exact or unsupported as listed.
#[test]
fn llama3_1_ids_equal_vllms() {
    check("llama3_1");
}

/// Gemma 3: every recorded case exact or unsupported as listed.
#[test]
fn gemma3_ids_equal_vllms() {
    check("gemma3");
}

/// DeepSeek V3: every recorded case exact or unsupported as listed.
#[test]
fn deepseek_v3_ids_equal_vllms() {
    check("deepseek_v3");
}

/// Phi-3.5's template and added tokens (that swallow the whitespace after them) on a
/// sentencepiece BPE of its kind (not Phi's own vocabulary, see setup.py): every recorded case
/// exact or unsupported as listed.
#[test]
fn phi3_5_ids_equal_vllms() {
    check("phi3_5");
}

/// Mistral Nemo's tekken (v3) in vLLM's default Mistral mode, rendered as mistral-common
/// encodes it: every recorded case exact, or refused where vLLM refuses it.
#[test]
fn mistral_ids_equal_vllms() {
    check("mistral");
}

/// gpt-oss (vLLM renders Harmony through openai-harmony, as tokenonce does with the same
/// crate): every recorded case exact or unsupported as listed, vLLM's refusals never rendered.
#[test]
fn gptoss_ids_equal_vllms() {
    check("gptoss");
}

/// A gpt-oss folder without its Harmony vocabulary (`o200k_base.tiktoken`) is a load error
/// naming the file: openai-harmony would otherwise download it.
#[test]
fn gptoss_without_its_vocabulary_is_a_load_error() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(folder("gptoss").join(file), dir.path().join(file)).unwrap();
    }
    let err = ChatTemplate::load(dir.path(), LoadOptions::default()).unwrap_err();
    assert!(matches!(err, LoadError::Io { .. }) && err.to_string().contains("o200k_base.tiktoken"), "{err}");
}

/// A pool on each renderable family's folder loads with `local_ids = "shadow"` (Gemma 3's
/// `extra_special_tokens` included, gpt-oss's, Mistral's folder with only its `tekken.json`).
#[test]
fn family_pools_load_with_local_ids_or_are_refused_by_name() {
    let pool = |family: &str| {
        let dir = folder(family).display().to_string();
        format!("[pools.{family}]\nendpoints = [\"127.0.0.1:1\"]\ntokenizer = {dir:?}\nlocal_ids = \"shadow\"\n")
    };
    let decode = "[pools.decode]\nendpoints = [\"127.0.0.1:2\"]\n";
    let renderable: String = FAMILIES.iter().map(|f| pool(f)).collect();
    if let Err(e) = tokenonce::config::from_toml(&format!("{decode}{renderable}"), "families") {
        panic!("{:?}", e.problems);
    }
}

/// vLLM's request-time refusals (recorded on the tier's Qwen3 as tests/fixtures/vllm/refuse_*)
/// are refused by name for every family tokenonce renders, never rendered, so never sent
/// token-in: the decision is the request's, not the family's (an empty completions prompt
/// too, which Llama 3.1's tokenizer would give a BOS id). Left out: the refusals tokenonce
/// sends as they are (tests/refusals.rs says why).
#[test]
fn vllms_request_refusals_are_refused_for_every_family() {
    const SENT_AS_THEY_ARE: &[&str] = &[
        "refuse_tool_choice_required_no_parser",
        "refuse_top_logprobs_without_logprobs",
        "refuse_completions_stream_options_without_stream",
        "refuse_completions_prompt_logprobs_with_stream",
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm");
    let mut refusals: Vec<(String, Api, String)> = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap()).unwrap();
        let name = doc["name"].as_str().unwrap();
        if name.starts_with("refuse_") && !SENT_AS_THEY_ARE.contains(&name) {
            let api = if doc["path"] == "/v1/completions" { Api::Completions } else { Api::Chat };
            refusals.push((name.to_owned(), api, doc["request_body"].as_str().unwrap().to_owned()));
        }
    }
    assert!(refusals.len() >= 10, "{} refusals", refusals.len());
    let mut wrong = Vec::new();
    for family in FAMILIES {
        let local = load(family, &folder(family), LoadOptions::default()).unwrap();
        for (name, api, body) in &refusals {
            let got = local.ids(*api, body.as_bytes()).map(|_| ());
            if got != Err("vllm_rejects") {
                wrong.push(format!("{family}: {name}: {got:?}"));
            }
        }
    }
    assert!(wrong.is_empty(), "not refused as vLLM refuses them:\n{}", wrong.join("\n"));
}
