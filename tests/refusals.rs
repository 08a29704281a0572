//! The requests vLLM 0.32 refuses when it reads them (its request models' validators, the chat
//! serving's tool-choice check), recorded from the tier's server as `refuse_*` (and their
//! token-in forms as `tokenin_*`) in tests/fixtures/vllm: through tokenonce, with local ids on
//! and every shape trusted, a client gets vLLM's own answer (status and body, byte for byte),
//! and no leg of such a request goes token-in, on an orchestrate route and a relay route, for
//! the Qwen3 template and for a family whose tokenizer adds BOS (where `""` has an id that
//! vLLM would take token-in).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};
use support::*;
use tokenonce::config::LocalIdsMode;
use tokenonce::local::{LocalIds, Policy};
use tokenonce::openai::Api;
use tokenonce::parity::Tokenizer;
use tokenonce::render::{ChatTemplate, LoadOptions};

/// One recorded exchange.
struct Recorded {
    name: String,
    path: String,
    request: Value,
    status: u16,
    response: String,
}

/// The recordings whose names start with `prefix`.
fn recorded(prefix: &str) -> Vec<Recorded> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm");
    let mut found: Vec<Recorded> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(prefix))
        .map(|p| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            assert_eq!(v["vllm_version"], "0.32.0", "{}", p.display());
            Recorded {
                name: v["name"].as_str().unwrap().to_owned(),
                path: v["path"].as_str().unwrap().to_owned(),
                request: serde_json::from_str(v["request_body"].as_str().unwrap()).unwrap(),
                status: u16::try_from(v["status"].as_u64().unwrap()).unwrap(),
                response: v["response_body"].as_str().unwrap().to_owned(),
            }
        })
        .collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found
}

/// Refusals of the chat serving that depend on the server's flags (no `--tool-call-parser`),
/// not on the request alone: tokenonce cannot know them, and need not: vLLM checks them before
/// it looks at forwarded ids, so the token-in form is refused in the same words (recorded:
/// `tokenin_tool_choice_required_no_parser`).
///
/// And a refusal by a validator of fields every leg keeps as sent (`top_logprobs` without
/// `logprobs`): vLLM's request model reads the whole body, token-in or not (as
/// `tokenin_tool_choice_unknown_tool` shows for another of its validators), so the prefill
/// refuses it in the same words either way; tokenonce renders it like any request.
const ANSWERED_ALIKE_TOKEN_IN: &[&str] =
    &["refuse_tool_choice_required_no_parser", "refuse_top_logprobs_without_logprobs"];

/// Like the recording server: no `--tool-call-parser`.
fn engine() -> FakeConfig {
    FakeConfig { tool_parser: false, connector: true, ..FakeConfig::default() }
}

/// The fake engine refuses every recorded request as vLLM did (status and body, byte for
/// byte), token-in forms included, and answers the token-in prompt vLLM answered.
#[tokio::test(flavor = "multi_thread")]
async fn the_fake_engine_refuses_as_vllm_did() {
    let fake = FakeVllm::start(engine()).await;
    let all: Vec<Recorded> = recorded("refuse_").into_iter().chain(recorded("tokenin_")).collect();
    assert!(all.len() >= 18, "{} recordings", all.len());
    for r in all {
        let (status, _, body) = post_json(&format!("http://{}{}", fake.host_port(), r.path), &r.request, &[]).await;
        assert_eq!(status, r.status, "{}: {body}", r.name);
        if r.status != 200 {
            assert_eq!(body, r.response, "{}", r.name);
        }
    }
}

/// The pool's renderer as tokenonce builds it from `dir`, to know the ids its checks expect.
fn renderer(dir: &Path) -> LocalIds {
    let template = ChatTemplate::load(dir, LoadOptions::default()).unwrap();
    let tokenizer = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
    let policy = Policy { mode: LocalIdsMode::Shadow, verify_after: 1, recheck: 0.0 };
    LocalIds::new("check", Arc::new(template), Arc::new(tokenizer), policy).unwrap()
}

/// A prefill pool on `model` with local ids on (one match trusts a shape, nothing rechecked),
/// a decode pool, an orchestrate route `pd` and a relay route `relay` (header-selected).
fn config(p: &FakeVllm, d: &FakeVllm, model: &Path) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\ntokenizer = {:?}\nlocal_ids = \"on\"\nlocal_ids_verify_after = 1\nlocal_ids_recheck = 0.0\n\
         [pools.decode]\nendpoints = [\"{}\"]\n\
         [[routes]]\nname = \"relay\"\nmode = \"relay\"\nprefill = {{ pool = \"prefill\" }}\ndecode_pool = \"decode\"\n\
         [routes.match]\nheaders = {{ \"x-relay\" = \"1\" }}\n\
         [[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n",
        p.host_port(),
        model.display().to_string(),
        d.host_port()
    )
}

/// The shapes the refused requests would have, each trusted by one request that matched its
/// check: the prefill engine echoes the ids tokenonce computes for it.
async fn trust_every_shape(proxy: &TokenOnce, p: &FakeVllm, local: &LocalIds) {
    let system =
        [json!({"role": "system", "content": "You are terse."}), json!({"role": "user", "content": "Hello there!"})];
    let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
    let continued = json!([system[0], system[1], {"role": "assistant", "content": "Hi"}]);
    let shapes = [
        ("chat_system", Api::Chat, json!({"model": "tiny-qwen3", "messages": system, "max_tokens": 3})),
        (
            "chat_tools",
            Api::Chat,
            json!({"model": "tiny-qwen3", "messages": system, "tools": [tool], "tool_choice": "none", "max_tokens": 3}),
        ),
        (
            "chat_continue",
            Api::Chat,
            json!({"model": "tiny-qwen3", "messages": continued, "continue_final_message": true, "add_generation_prompt": false, "max_tokens": 3}),
        ),
        ("completions", Api::Completions, json!({"model": "tiny-qwen3", "prompt": "Hello there!", "max_tokens": 3})),
    ];
    for (shape, api, body) in shapes {
        let (ids, got) = local.ids(api, &serde_json::to_vec(&body).unwrap()).unwrap();
        assert_eq!(got, shape, "{body}");
        p.configure(|c| c.text_prompt_ids = Some(ids.iter().map(|&i| u64::from(i)).collect()));
        let path = if api == Api::Chat { "/v1/chat/completions" } else { "/v1/completions" };
        let (status, _, text) = post_json(&format!("{}{path}", proxy.url), &body, &[]).await;
        assert_eq!(status, 200, "{shape}: {text}");
        proxy.assert_reaches(&format!("tokenonce_local_ids_trusted{{pool=\"prefill\",shape=\"{shape}\"}}"), 1.0).await;
    }
    p.configure(|c| c.text_prompt_ids = None);
}

/// Whether a leg the engines got carried prompt ids (token-in): chat in
/// `kv_transfer_params.prompt_token_ids`, completions as a list `prompt`.
fn token_in(leg: &Value) -> bool {
    !leg["kv_transfer_params"]["prompt_token_ids"].is_null() || leg["prompt"].is_array()
}

/// Every leg the engines got since `since` (prefill, decode).
fn legs(p: &FakeVllm, d: &FakeVllm, since: (usize, usize)) -> Vec<Value> {
    let new = |f: &FakeVllm, from: usize| f.posts().into_iter().skip(from).map(|r| r.json()).collect::<Vec<_>>();
    new(p, since.0).into_iter().chain(new(d, since.1)).collect()
}

/// Through the orchestrate route with every shape trusted, and through the relay route (its
/// prefill leg, then its decode leg), each recorded refusal gets vLLM's own status and body,
/// and no leg tokenonce sends for it carries ids.
async fn refusals_through_tokenonce(model: &Path) {
    let local = renderer(model);
    let (p, d) = (FakeVllm::start(engine()).await, FakeVllm::start(engine()).await);
    let proxy = TokenOnce::start(&config(&p, &d, model)).await;
    trust_every_shape(&proxy, &p, &local).await;
    let token_ins = || async {
        let text = proxy.metrics().await;
        let counted = text.lines().filter(|l| l.starts_with("tokenonce_local_ids_token_in_total{"));
        counted.filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum::<f64>()
    };
    let before = token_ins().await;

    let refused = recorded("refuse_");
    assert!(
        refused.iter().any(|r| r.path == "/v1/completions") && refused.iter().any(|r| r.path == "/v1/chat/completions")
    );
    for r in &refused {
        let since = (p.posts().len(), d.posts().len());
        let (status, _, body) = post_json(&format!("{}{}", proxy.url, r.path), &r.request, &[]).await;
        assert_eq!((status, body.as_str()), (r.status, r.response.as_str()), "orchestrated {}", r.name);
        let sent = legs(&p, &d, since);
        assert!(!sent.is_empty(), "{}: the engine answered", r.name);
        if !ANSWERED_ALIKE_TOKEN_IN.contains(&r.name.as_str()) {
            assert!(!sent.iter().any(token_in), "orchestrated {}: no leg token-in: {sent:?}", r.name);
        }

        // Relay: the orchestrator's prefill leg, then its decode leg, each answered by vLLM.
        let since = (p.posts().len(), d.posts().len());
        let relay = [("x-relay", "1"), ("x-request-id", r.name.as_str())];
        let mut prefill_leg = r.request.clone();
        prefill_leg["max_tokens"] = json!(1);
        prefill_leg["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
        let mut decode_leg = r.request.clone();
        decode_leg["kv_transfer_params"] =
            json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_request_id": r.name});
        for leg in [prefill_leg, decode_leg] {
            let (status, _, body) = post_json(&format!("{}{}", proxy.url, r.path), &leg, &relay).await;
            assert_eq!((status, body.as_str()), (r.status, r.response.as_str()), "relayed {}: {leg}", r.name);
        }
        let sent = legs(&p, &d, since);
        assert_eq!(sent.len(), 2, "{}: one leg each", r.name);
        assert!(!sent.iter().any(token_in), "relayed {}: no leg token-in: {sent:?}", r.name);
    }
    #[expect(clippy::cast_precision_loss, reason = "a handful")]
    let alike = ANSWERED_ALIKE_TOKEN_IN.len() as f64;
    assert_eq!(token_ins().await, before + alike, "only the refusals answered alike went token-in");
}

/// The Qwen3 family (its recorded chat template).
#[tokio::test(flavor = "multi_thread")]
async fn vllms_refusals_are_its_answers_and_never_token_in_for_qwen3() {
    let dir = tempfile::tempdir().unwrap();
    write_qwen3_model(dir.path());
    refusals_through_tokenonce(dir.path()).await;
}

/// A family whose tokenizer adds BOS: an empty completions prompt has one id there (which
/// vLLM would answer token-in, `tokenin_completions_bos_only`), and is still refused as text.
#[tokio::test(flavor = "multi_thread")]
async fn vllms_refusals_are_its_answers_and_never_token_in_for_a_bos_family() {
    let dir = tempfile::tempdir().unwrap();
    write_bos_family_model(dir.path());
    let tokenizer = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer.encode("", true).unwrap().get_ids(), [128_000], "\"\" has an id in this family");
    refusals_through_tokenonce(dir.path()).await;
}
