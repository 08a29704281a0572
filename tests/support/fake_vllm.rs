//! A fake vLLM OpenAI server for integration tests. It answers with the field order and
//! shapes of the recordings in `tests/fixtures/vllm/` (vLLM 0.32.0), "tokenizes" text with
//! a deterministic word hash, takes `kv_transfer_params.prompt_token_ids` on chat (>= 0.27)
//! and `prompt: [ids]` on completions the way vLLM does, and records every request it got.

use parking_lot::Mutex;
use std::collections::hash_map::DefaultHasher;
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use serde_json::Value;

mod apis;
pub use apis::fake_render_responses;

/// How the fake behaves; change it while running with [`FakeVllm::configure`].
#[derive(Clone, Debug)]
pub struct FakeConfig {
    /// What `GET /version` answers.
    pub version: String,
    /// Served model name.
    pub model: String,
    /// `max_model_len` in `GET /v1/models` (vLLM's answer for the e2e tier's model: 49152).
    pub max_model_len: u64,
    /// Answer prefills like a NIXL-connected engine (non-null `kv_transfer_params`).
    pub connector: bool,
    /// Exact raw `kv_transfer_params` to return on prefills (overrides `connector`).
    pub kv_params_raw: Option<String>,
    /// Report `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Answer `prompt_token_ids: null` even when asked.
    pub omit_prompt_ids: bool,
    /// Replace the echoed prompt ids with this raw JSON.
    pub corrupt_prompt_ids: Option<String>,
    /// Take only the first N prompt ids, as if the prompt were that short (echo and usage agree).
    pub echo_only_first_ids: Option<usize>,
    /// Tokenize a text prompt to these ids, as a real engine with a real tokenizer would
    /// (echo and usage agree); prompts sent as ids keep theirs.
    pub text_prompt_ids: Option<Vec<u64>>,
    /// Wait before answering.
    pub delay: Duration,
    /// Wait between SSE events.
    pub chunk_delay: Duration,
    /// Cut the response body into pieces of this many bytes.
    pub split_every: Option<usize>,
    /// Answer every POST with this status and body.
    pub fail_with: Option<(u16, String)>,
    /// Break the SSE stream (reset) after this many events.
    pub break_stream_after: Option<usize>,
    /// What `GET /health` answers.
    pub healthy: bool,
    /// Send only the first N bytes of an SSE stream, then break it (reset).
    pub cut_stream_at_byte: Option<usize>,
    /// Responses ids this engine has stored (a `previous_response_id` not here is a 404).
    pub stored_responses: Vec<String>,
    /// Store each Responses answer not sent with `store: false` under its id, as vLLM does
    /// with `VLLM_ENABLE_RESPONSES_API_STORE=1` (`GET /v1/responses/{id}` then finds it).
    pub store_responses: bool,
    /// Keep every request for [`FakeVllm::requests`] (off for long load runs: bounded memory).
    pub keep_requests: bool,
    /// Data-parallel ranks behind the port (vLLM's internal balancing): an
    /// `X-data-parallel-rank` at or past it is refused with vLLM's 400.
    pub dp_size: u32,
    /// The rank whose engine fails: its requests get a 503.
    pub failing_rank: Option<u32>,
    /// The server runs a tool parser (`--enable-auto-tool-choice --tool-call-parser`);
    /// without one, a chat `tool_choice` other than "none" is refused as vLLM refuses it.
    pub tool_parser: bool,
    /// A prefix cache that each chat and completions request is prefilled through (its time
    /// taken from the tokens it did not hold, its blocks published as KV events).
    pub kv_engine: Option<Arc<super::kv_engine::KvEngine>>,
    /// A request carrying a prefill's remote params (`kv_transfer_params.do_remote_prefill`)
    /// is pulled into `kv_engine` as a NIXL decode pulls it (blocks stored, no compute time),
    /// not prefilled through it; off, every request is prefilled.
    pub pull_remote_prefills: bool,
    /// What `GET /metrics` answers (none: the page recorded from vLLM 0.32,
    /// `tests/fixtures/engine_metrics/vllm-0.32-idle.txt`, its `engine="0"` series repeated for every
    /// rank); [`metrics_page`] writes one with chosen values.
    pub metrics_page: Option<String>,
}

/// The page vLLM 0.32 served, idle, after two chat requests (`GET /metrics`).
pub const RECORDED_METRICS: &str = include_str!("../fixtures/engine_metrics/vllm-0.32-idle.txt");

/// A `/metrics` page with vLLM 0.32's series for each rank: (waiting, running, KV usage), as
/// written (so a test may write what no engine should say: `"NaN"`, `"-1"`).
pub fn metrics_page(ranks: &[(&str, &str, &str)]) -> String {
    let mut page = String::from("# TYPE vllm:num_requests_waiting gauge\n");
    for (engine, (waiting, running, usage)) in ranks.iter().enumerate() {
        let labels = format!("engine=\"{engine}\",model_name=\"tiny-qwen3\"");
        page += &format!("vllm:num_requests_running{{{labels}}} {running}\n");
        page += &format!("vllm:num_requests_waiting{{{labels}}} {waiting}\n");
        page += &format!("vllm:kv_cache_usage_perc{{{labels}}} {usage}\n");
        page +=
            &format!("vllm:cache_config_info{{block_size=\"16\",engine=\"{engine}\",num_gpu_blocks=\"4096\"}} 1.0\n");
    }
    page
}

/// The recorded page with its `engine="0"` series repeated for ranks 1 to `dp_size - 1`.
fn recorded_metrics(dp_size: u32) -> String {
    let mut page = String::with_capacity(RECORDED_METRICS.len());
    for line in RECORDED_METRICS.lines() {
        page += line;
        page.push('\n');
        if line.contains("engine=\"0\"") {
            for rank in 1..dp_size {
                page += &line.replace("engine=\"0\"", &format!("engine=\"{rank}\""));
                page.push('\n');
            }
        }
    }
    page
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            version: "0.32.0".into(),
            model: "tiny-qwen3".into(),
            max_model_len: 49152,
            connector: false,
            kv_params_raw: None,
            cached_tokens: None,
            omit_prompt_ids: false,
            corrupt_prompt_ids: None,
            echo_only_first_ids: None,
            text_prompt_ids: None,
            delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            split_every: None,
            fail_with: None,
            break_stream_after: None,
            healthy: true,
            cut_stream_at_byte: None,
            stored_responses: Vec::new(),
            store_responses: false,
            keep_requests: true,
            dp_size: 1,
            failing_rank: None,
            tool_parser: true,
            kv_engine: None,
            pull_remote_prefills: false,
            metrics_page: None,
        }
    }
}

/// One request as the fake received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Headers.
    pub headers: HeaderMap,
    /// Raw body.
    pub body: Bytes,
}

impl Recorded {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header value.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
    }
}

#[derive(Default)]
struct Shared {
    config: Mutex<FakeConfig>,
    requests: Mutex<Vec<Recorded>>,
    cancelled: AtomicUsize,
    completed: AtomicUsize,
}

/// A running fake server.
#[derive(Clone)]
pub struct FakeVllm {
    /// Its address.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

/// Deterministic stand-in for a tokenizer: one id per whitespace-separated word.
pub fn fake_tokenize(text: &str) -> Vec<u64> {
    text.split_whitespace()
        .map(|w| {
            let mut h = DefaultHasher::new();
            w.hash(&mut h);
            h.finish() % 150_000
        })
        .collect()
}

/// The prompt ids a chat or completions request is prefilled with, as [`completion`] finds them,
/// and whether it asks for a remote prefill's KV (a P/D decode leg: the prefill's
/// `kv_transfer_params` with `do_remote_prefill`, as vLLM's NixlConnector reads it); none for
/// another path or a body that is not JSON.
fn engine_prompt_ids(path: &str, body: &[u8]) -> Option<(Vec<u32>, bool)> {
    let body: Value = serde_json::from_slice(body).ok()?;
    let remote_prefill = body["kv_transfer_params"]["do_remote_prefill"].as_bool() == Some(true);
    let ids = match (path, &body["prompt"]) {
        ("/v1/chat/completions", _) => match body["kv_transfer_params"].get("prompt_token_ids") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
            _ => fake_tokenize(&fake_render_chat(&body)),
        },
        ("/v1/completions", Value::String(s)) => fake_tokenize(s),
        ("/v1/completions", Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
        _ => return None,
    };
    Some((ids.into_iter().map(|i| i as u32).collect(), remote_prefill))
}

/// The text the fake "renders" a chat request to before tokenizing (template stand-in).
pub fn fake_render_chat(body: &Value) -> String {
    let mut text = String::new();
    if let Some(tools) = body.get("tools") {
        text.push_str(&format!("<tools> {tools} </tools> "));
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        let content = match &m["content"] {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        text.push_str(&format!(
            "<|im_start|>{} {} {} <|im_end|> ",
            m["role"].as_str().unwrap_or("?"),
            content,
            m.get("tool_calls").map(|t| t.to_string()).unwrap_or_default()
        ));
    }
    if let Some(k) = body.get("chat_template_kwargs") {
        text.push_str(&format!("<kwargs> {k} "));
    }
    text.push_str("<|im_start|>assistant");
    text
}

fn output_ids(prompt: &[u64], n: usize) -> Vec<u64> {
    let seed: u64 = prompt.iter().fold(17u64, |a, &b| a.wrapping_mul(31).wrapping_add(b));
    (0..n as u64).map(|i| (seed.wrapping_add(i * 7919)) % 150_000).collect()
}

fn token_text(id: u64) -> String {
    format!("t{id} ")
}

fn error_body(status: u16, kind: &str, message: &str, param: Option<&str>) -> (u16, String) {
    // vLLM's field order: message, type, param, code.
    let param = param.map_or("null".to_owned(), |p| serde_json::to_string(p).unwrap());
    let message = serde_json::to_string(message).unwrap();
    (status, format!("{{\"error\":{{\"message\":{message},\"type\":\"{kind}\",\"param\":{param},\"code\":{status}}}}}"))
}

/// vLLM's `VLLMValidationError` as its server answers it: the parameter named in the message
/// and in `param`.
fn validation_error(message: &str, param: Option<&str>) -> (u16, String) {
    let message = match param {
        Some(p) => format!("{message} (parameter={p})"),
        None => message.to_owned(),
    };
    error_body(400, "BadRequestError", &message, param)
}

/// Python's truth value of a JSON value, as vLLM's validators test `data.get(key)`.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// What vLLM 0.32 refuses when it reads a chat or completions request, before any rendering
/// (the request models' validators, and the chat serving's tool-choice check), in its words
/// (recorded: `refuse_*`, `tokenin_*`). The validators read the body as sent, so a token-in
/// chat body is refused as its text form is.
fn refusal(config: &FakeConfig, body: &Value, chat: bool) -> Option<(u16, String)> {
    if truthy(body.get("stream_options")) && !truthy(body.get("stream")) {
        return Some(validation_error(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    let logprob = |key: &str| body.get(key).and_then(Value::as_f64).filter(|&v| v > 0.0 || v == -1.0);
    if logprob("prompt_logprobs").is_some() && truthy(body.get("stream")) {
        return Some(validation_error(
            "`prompt_logprobs` are not available when `stream=True`.",
            Some("prompt_logprobs"),
        ));
    }
    if !chat {
        let empty = matches!(body.get("prompt"), None | Some(Value::Null)) || body["prompt"] == "";
        return empty.then(|| {
            validation_error("Either prompt or prompt_embeds must be provided and non-empty.", Some("prompt"))
        });
    }
    if logprob("top_logprobs").is_some() && !truthy(body.get("logprobs")) {
        return Some(validation_error(
            "when using `top_logprobs`, `logprobs` must be set to true.",
            Some("top_logprobs"),
        ));
    }
    if let Some(refused) = tool_usage_refusal(body) {
        return Some(refused);
    }
    if truthy(body.get("continue_final_message")) && truthy(body.get("add_generation_prompt")) {
        return Some(validation_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            None,
        ));
    }
    // The serving's check without a tool parser (an absent choice with tools is "auto").
    let choice = body.get("tool_choice").cloned().unwrap_or_else(|| {
        if truthy(body.get("tools")) {
            Value::from("auto")
        } else {
            Value::Null
        }
    });
    if config.tool_parser || choice.is_null() || choice == "none" {
        return None;
    }
    let message = match (&choice, choice["function"]["name"].as_str()) {
        (Value::String(s), _) if s == "auto" => {
            "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set".to_owned()
        }
        (_, Some(name)) => format!("tool_choice=function \"{name}\" requires --tool-call-parser to be set"),
        (other, None) => format!("tool_choice={other} requires --tool-call-parser to be set"),
    };
    Some(validation_error(&message, None))
}

/// vLLM's `check_tool_usage` on a chat body.
fn tool_usage_refusal(body: &Value) -> Option<(u16, String)> {
    let tools = body.get("tools");
    if tools.and_then(Value::as_array).is_some_and(Vec::is_empty) {
        return Some(validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            Some("tools"),
        ));
    }
    let choice = body.get("tool_choice")?;
    if choice.is_null() || choice == "none" {
        return None;
    }
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Some(validation_error("When using `tool_choice`, `tools` must be set.", Some("tool_choice")));
    };
    let usage = "Correct usage: `{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}`";
    match choice {
        Value::String(s) if s == "auto" || s == "required" => None,
        Value::Object(named) => {
            let Some(function) = named.get("function").and_then(Value::as_object) else {
                return Some(validation_error(
                    &format!(
                        "Invalid value for `function`: `{}` in `tool_choice`! {usage}",
                        named.get("function").map_or("None".into(), Value::to_string)
                    ),
                    Some("tool_choice.function"),
                ));
            };
            let Some(name) = function.get("name") else {
                return Some(validation_error(
                    &format!("Expected field `name` in `function` in `tool_choice`! {usage}"),
                    Some("tool_choice.function.name"),
                ));
            };
            let name = name.as_str().filter(|n| !n.is_empty());
            let Some(name) = name else {
                let shown = function["name"].as_str().map_or_else(|| function["name"].to_string(), str::to_owned);
                return Some(validation_error(
                    &format!("Invalid `name` in `function`: `{shown}` in `tool_choice`! {usage}"),
                    Some("tool_choice.function.name"),
                ));
            };
            let named_tool = |t: &Value| t["function"]["name"] == name;
            (!tools.as_array().is_some_and(|t| t.iter().any(named_tool))).then(|| {
                validation_error(
                    "The tool specified in `tool_choice` does not match any of the specified `tools`",
                    Some("tool_choice"),
                )
            })
        }
        other => {
            let shown = other.as_str().map_or_else(|| other.to_string(), str::to_owned);
            Some(validation_error(
                &format!("Invalid value for `tool_choice`: {shown}! Only named tools, \"none\", \"auto\" or \"required\" are supported."),
                Some("tool_choice"),
            ))
        }
    }
}

fn ids_json(ids: &[u64]) -> String {
    serde_json::to_string(ids).unwrap()
}

/// The accept backlog uvicorn (so vLLM) listens with.
const UVICORN_BACKLOG: u32 = 2048;

impl FakeVllm {
    /// Starts a fake on an ephemeral loopback port.
    pub async fn start(config: FakeConfig) -> Self {
        Self::start_at("127.0.0.1:0".parse().unwrap(), config).await.unwrap()
    }

    /// Starts a fake on `at` (a loopback address; port 0: any free one), as engines of one
    /// DNS name serve one port on their own addresses; `None` when `at` is taken.
    pub async fn start_at(at: std::net::SocketAddr, config: FakeConfig) -> Option<Self> {
        let shared = Arc::new(Shared { config: Mutex::new(config), ..Default::default() });
        // Uvicorn's accept backlog (2048, what vLLM listens with), not mio's 128: a burst of
        // connects (a proxy whose pooled connections idled out, at 256 clients) overflowed 128
        // and waited out a 1 s SYN retransmission.
        let socket =
            if at.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }.ok()?;
        socket.set_reuseaddr(true).ok()?;
        socket.bind(at).ok()?;
        let listener = socket.listen(UVICORN_BACKLOG).ok()?;
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().fallback(handle).with_state(Arc::clone(&shared));
        tokio::spawn(async move {
            // TCP_NODELAY, like uvicorn: otherwise small SSE writes wait on delayed ACKs (~40 ms).
            use axum::serve::ListenerExt;
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let _ = axum::serve(listener, app).await;
        });
        Some(Self { addr, shared })
    }

    /// `host:port`.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Changes the behaviour.
    pub fn configure(&self, f: impl FnOnce(&mut FakeConfig)) {
        f(&mut self.shared.config.lock());
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().clone()
    }

    /// Drops the requests recorded so far (long benches would otherwise keep every body).
    pub fn forget(&self) {
        self.shared.requests.lock().clear();
    }

    /// POST requests received so far.
    pub fn posts(&self) -> Vec<Recorded> {
        self.requests().into_iter().filter(|r| r.method == "POST").collect()
    }

    /// Streams whose consumer went away before the end.
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    /// POST handlers that ran to the end (including streams fully sent).
    pub fn completed(&self) -> usize {
        self.shared.completed.load(Ordering::SeqCst)
    }
}

/// Counts a handler or stream that was dropped before finishing.
struct CancelGuard {
    shared: Arc<Shared>,
    done: bool,
}

impl CancelGuard {
    /// Marks the work complete and counts it.
    fn finish(mut self) {
        self.done = true;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.done {
            self.shared.completed.fetch_add(1, Ordering::SeqCst);
        } else {
            self.shared.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn respond(status: u16, content_type: &str, body: Body) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap())
        .header("content-type", content_type)
        .body(body)
        .unwrap()
}

fn split_body(text: String, split: Option<usize>) -> Body {
    match split {
        None => Body::from(text),
        Some(n) => {
            let pieces: Vec<Result<Bytes, Infallible>> =
                text.into_bytes().chunks(n.max(1)).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
            Body::from_stream(futures_util::stream::iter(pieces))
        }
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path_and_query().map_or(uri.path().to_owned(), |p| p.as_str().to_owned());
    let config = shared.config.lock().clone();
    if config.keep_requests {
        shared.requests.lock().push(Recorded {
            method: method.to_string(),
            path,
            headers: headers.clone(),
            body: body.clone(),
        });
    }
    let mut guard = CancelGuard { shared: Arc::clone(&shared), done: false };
    if method == Method::GET {
        guard.done = true;
        return match uri.path() {
            "/health" if config.healthy => respond(200, "application/json", Body::empty()),
            "/health" => respond(503, "application/json", Body::empty()),
            "/version" if config.version.is_empty() => respond(404, "application/json", Body::from("{\"detail\":\"Not Found\"}")),
            "/version" => respond(200, "application/json", Body::from(format!("{{\"version\":\"{}\"}}", config.version))),
            p if p.starts_with("/v1/responses/") => {
                let id = p.trim_start_matches("/v1/responses/");
                if config.stored_responses.iter().any(|s| s == id) {
                    respond(200, "application/json", Body::from(format!("{{\"id\":\"{id}\",\"object\":\"response\",\"status\":\"completed\"}}")))
                } else {
                    respond(404, "application/json", Body::from(format!("{{\"error\":{{\"message\":\"Response with id '{id}' not found.\",\"type\":\"invalid_request_error\",\"param\":\"response_id\",\"code\":404}}}}")))
                }
            }
            "/metrics" => {
                let live = config.kv_engine.as_ref().map(|e| e.metrics_page());
                let page = config.metrics_page.clone().or(live).unwrap_or_else(|| recorded_metrics(config.dp_size));
                respond(200, "text/plain; version=0.0.4; charset=utf-8", Body::from(page))
            }
            "/v1/models" => respond(
                200,
                "application/json",
                Body::from(format!(
                    "{{\"object\":\"list\",\"data\":[{{\"id\":\"{m}\",\"object\":\"model\",\"created\":1796062677,\"owned_by\":\"vllm\",\"root\":\"/models/{m}\",\"parent\":null,\"max_model_len\":{len},\"permission\":[{{\"id\":\"modelperm-0\",\"object\":\"model_permission\",\"created\":1796062677,\"allow_create_engine\":false,\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\",\"group\":null,\"is_blocking\":false}}]}}]}}",
                    m = config.model,
                    len = config.max_model_len
                )),
            ),
            _ => respond(404, "application/json", Body::from("{\"detail\":\"Not Found\"}")),
        };
    }
    if !config.delay.is_zero() {
        tokio::time::sleep(config.delay).await;
    }
    if let Some((status, body)) = &config.fail_with {
        guard.done = true;
        return respond(*status, "application/json", Body::from(body.clone()));
    }
    // vLLM 0.32 reads the rank header as an int (anything else is ignored) and refuses a rank
    // past its data-parallel size (`input_processor.py`).
    let rank = headers.get("x-data-parallel-rank").and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    if let Some(rank) = rank.filter(|&r| r >= config.dp_size) {
        guard.done = true;
        let message = format!("data_parallel_rank {rank} is out of range [0, {}).", config.dp_size);
        let (status, body) = error_body(400, "BadRequestError", &message, None);
        return respond(status, "application/json", Body::from(body));
    }
    if rank.is_some() && rank == config.failing_rank {
        guard.done = true;
        let (status, body) = error_body(503, "ServiceUnavailableError", "engine dead", None);
        return respond(status, "application/json", Body::from(body));
    }
    if let Some(engine) = &config.kv_engine {
        if let Some((ids, remote_prefill)) = engine_prompt_ids(uri.path(), &body) {
            if config.pull_remote_prefills && remote_prefill {
                engine.pull(&ids);
            } else {
                engine.prefill(&ids).await;
            }
        }
    }
    let result = match uri.path() {
        "/v1/chat/completions" => completion(&config, &headers, &body, true),
        "/v1/completions" => completion(&config, &headers, &body, false),
        "/v1/responses" | "/v1/messages" => match serde_json::from_slice::<Value>(&body) {
            Err(_) => Err(error_body(400, "Bad Request", "JSON decode error", Some("body"))),
            Ok(v) if uri.path() == "/v1/responses" => {
                let reply = apis::responses(&config, &headers, &v);
                if reply.is_ok() && config.store_responses && v["store"].as_bool() != Some(false) {
                    shared.config.lock().stored_responses.push(apis::response_id(&headers, &v));
                }
                reply
            }
            Ok(v) => apis::messages(&config, &headers, &v),
        },
        "/inference/v1/generate" => match serde_json::from_slice::<Value>(&body) {
            Err(_) => Err(error_body(400, "Bad Request", "JSON decode error", Some("body"))),
            Ok(v) => apis::generate(&config, &headers, &v),
        },
        "/tokenize" => Ok(Reply::Json(format!(
            "{{\"count\":3,\"max_model_len\":49152,\"tokens\":[9707,1052,0],\"token_strs\":null,\"echo\":{}}}",
            String::from_utf8_lossy(&body)
        ))),
        _ => Err(error_body(404, "NotFoundError", "Not Found", None)),
    };
    match result {
        Err((status, body)) => {
            guard.done = true;
            respond(status, "application/json", Body::from(body))
        }
        Ok(Reply::Json(text)) => {
            guard.done = true;
            respond(200, "application/json", split_body(text, config.split_every))
        }
        Ok(Reply::Sse(events)) => {
            let chunk_delay = config.chunk_delay;
            // A cut stream is one piece of its first N bytes, then the break.
            let break_after = config.cut_stream_at_byte.map_or(config.break_stream_after, |_| Some(1));
            let stream = async_stream(events, chunk_delay, break_after, guard);
            respond(200, "text/event-stream; charset=utf-8", Body::from_stream(stream))
        }
    }
}

fn async_stream(
    events: Vec<String>,
    chunk_delay: Duration,
    break_after: Option<usize>,
    guard: CancelGuard,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold((events.into_iter().enumerate(), guard), move |(mut it, guard)| async move {
        let (i, event) = match it.next() {
            Some(next) => next,
            None => {
                guard.finish();
                return None;
            }
        };
        if break_after == Some(i) {
            // An engine dies after what it wrote went out: give hyper time to flush it.
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Some((Err(std::io::Error::other("injected stream break")), (it, guard)));
        }
        if !chunk_delay.is_zero() && i > 0 {
            tokio::time::sleep(chunk_delay).await;
        }
        Some((Ok(Bytes::from(event)), (it, guard)))
    })
}

enum Reply {
    Json(String),
    Sse(Vec<String>),
}

fn completion(config: &FakeConfig, headers: &HeaderMap, raw: &[u8], chat: bool) -> Result<Reply, (u16, String)> {
    if headers.get("content-type").and_then(|v| v.to_str().ok()).is_none_or(|c| !c.starts_with("application/json")) {
        return Err(error_body(
            400,
            "Bad Request",
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            None,
        ));
    }
    let body: Value = serde_json::from_slice(raw).map_err(|_| {
        error_body(
            400,
            "Bad Request",
            "1 validation error:\n  {'type': 'json_invalid', 'msg': 'JSON decode error'}",
            Some("body"),
        )
    })?;
    if let Some(model) = body.get("model").and_then(Value::as_str) {
        if model != config.model {
            return Err(error_body(
                404,
                "NotFoundError",
                &format!("The model `{model}` does not exist. Valid aliases: {}.", config.model),
                Some("model"),
            ));
        }
    }
    let stream = body["stream"].as_bool().unwrap_or(false);
    if let Some(refused) = refusal(config, &body, chat) {
        return Err(refused);
    }
    let max_tokens =
        body["max_completion_tokens"].as_u64().or(body["max_tokens"].as_u64()).unwrap_or(if chat { 8 } else { 16 });
    if let Some(min) = body["min_tokens"].as_u64() {
        if min > max_tokens {
            return Err(error_body(
                400,
                "BadRequestError",
                &format!("min_tokens must be less than or equal to max_tokens={max_tokens}, got {min}."),
                None,
            ));
        }
    }
    let version_ok = config.version.as_str() >= "0.27.0" || config.version.starts_with("0.3");
    let reused = if chat && version_ok { body["kv_transfer_params"].get("prompt_token_ids").cloned() } else { None };
    let prompt_ids: Vec<u64> = if let Some(ids) = reused {
        let arr = ids.as_array().ok_or_else(|| {
            error_body(
                400,
                "BadRequestError",
                "prompt_token_ids must be a list",
                Some("kv_transfer_params.prompt_token_ids"),
            )
        })?;
        if arr.is_empty() {
            return Err(error_body(
                400,
                "BadRequestError",
                "prompt_token_ids must not be empty",
                Some("kv_transfer_params.prompt_token_ids"),
            ));
        }
        arr.iter().map(|v| v.as_u64().filter(|&i| i < 151_936)).collect::<Option<Vec<u64>>>().ok_or_else(|| {
            error_body(
                400,
                "BadRequestError",
                "Token id out of vocabulary",
                Some("kv_transfer_params.prompt_token_ids"),
            )
        })?
    } else if let Some(ids) = config.text_prompt_ids.clone().filter(|_| chat || body["prompt"].is_string()) {
        ids
    } else if chat {
        fake_tokenize(&fake_render_chat(&body))
    } else {
        match &body["prompt"] {
            Value::String(s) => fake_tokenize(s),
            Value::Array(a) if a.is_empty() => {
                return Err(error_body(400, "BadRequestError", "You must pass at least one prompt", None))
            }
            Value::Array(a) if a.iter().all(Value::is_u64) => a.iter().filter_map(Value::as_u64).collect(),
            Value::Array(a) => a.first().and_then(Value::as_str).map(fake_tokenize).unwrap_or_default(),
            _ => return Err(error_body(400, "BadRequestError", "You must pass at least one prompt", None)),
        }
    };
    let prompt_ids = match config.echo_only_first_ids {
        Some(n) => prompt_ids.into_iter().take(n).collect(),
        None => prompt_ids,
    };
    if prompt_ids.iter().any(|&i| i >= 151_936) {
        return Err(error_body(400, "BadRequestError", "Token id is out of vocabulary", None));
    }
    let out = output_ids(&prompt_ids, max_tokens as usize);
    let want_ids = body["return_token_ids"].as_bool().unwrap_or(false);
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("0000");
    let id = if chat { format!("chatcmpl-{rid}") } else { format!("cmpl-{rid}") };
    let model = &config.model;
    let created = 1796062677u64;
    let n_prompt = prompt_ids.len();
    let prompt_json = if config.omit_prompt_ids || !want_ids {
        "null".to_owned()
    } else {
        config.corrupt_prompt_ids.clone().unwrap_or_else(|| ids_json(&prompt_ids))
    };
    let remote_decode = body["kv_transfer_params"]["do_remote_decode"].as_bool() == Some(true);
    let kv = if !remote_decode {
        "null".to_owned()
    } else if let Some(raw) = &config.kv_params_raw {
        raw.clone()
    } else if config.connector {
        nixl_kv_params(&id, n_prompt)
    } else {
        "null".to_owned()
    };
    let details = config.cached_tokens.map_or("null".to_owned(), |c| format!("{{\"cached_tokens\":{c}}}"));
    let text: String = out.iter().map(|&t| token_text(t)).collect();
    let total = n_prompt + out.len();
    let out_ids = if want_ids { ids_json(&out) } else { "null".into() };
    let fingerprint = format!("vllm-{}-91c5f304", config.version);
    // vLLM's qwen3 reasoning parser (the tier's servers run it): with thinking on (the
    // template's default) the whole output is reasoning, never closed by `</think>`.
    let thinking = chat && body["chat_template_kwargs"]["enable_thinking"].as_bool() != Some(false);
    let reasoning_details = match (chat, thinking) {
        (false, _) => "null".to_owned(),
        (true, true) => format!("{{\"reasoning_tokens\":{}}}", out.len()),
        (true, false) => "{\"reasoning_tokens\":0}".to_owned(),
    };
    let delta_key = if thinking { "reasoning" } else { "content" };
    if !stream {
        let text_json = serde_json::to_string(&text).unwrap();
        let (content_json, reasoning_json) =
            if thinking { ("null".to_owned(), text_json.clone()) } else { (text_json.clone(), "null".to_owned()) };
        let usage = format!("{{\"prompt_tokens\":{n_prompt},\"total_tokens\":{total},\"completion_tokens\":{},\"prompt_tokens_details\":{details},\"completion_tokens_details\":{reasoning_details}}}", out.len());
        return Ok(Reply::Json(if chat {
            format!("{{\"id\":\"{id}\",\"object\":\"chat.completion\",\"created\":{created},\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":{content_json},\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"reasoning\":{reasoning_json}}},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":{out_ids},\"routed_experts\":null}}],\"service_tier\":null,\"system_fingerprint\":\"{fingerprint}\",\"usage\":{usage},\"prompt_logprobs\":null,\"prompt_token_ids\":{prompt_json},\"prompt_text\":null,\"kv_transfer_params\":{kv},\"ec_transfer_params\":null,\"metrics\":null}}")
        } else {
            format!("{{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"text\":{text_json},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":{out_ids},\"prompt_logprobs\":null,\"prompt_token_ids\":{prompt_json},\"routed_experts\":null}}],\"service_tier\":null,\"system_fingerprint\":\"{fingerprint}\",\"usage\":{usage},\"kv_transfer_params\":{kv},\"ec_transfer_params\":null,\"metrics\":null}}")
        }));
    }
    let include_usage = body["stream_options"]["include_usage"].as_bool().unwrap_or(false);
    let mut events = Vec::new();
    let last = out.len().saturating_sub(1);
    if chat {
        events.push(format!("data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"prompt_token_ids\":{prompt_json},\"prompt_text\":null}}\n\n"));
    }
    for (i, &t) in out.iter().enumerate() {
        let tj = serde_json::to_string(&token_text(t)).unwrap();
        let tid = if want_ids { format!(",\"token_ids\":[{t}]") } else { ",\"token_ids\":null".to_owned() };
        let finish = if i == last { "\"length\",\"stop_reason\":null" } else { "null" };
        if chat {
            events.push(format!("data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"delta\":{{\"{delta_key}\":{tj}}},\"logprobs\":null,\"finish_reason\":{finish}{tid}}}]}}\n\n"));
        } else {
            let p = if i == 0 { prompt_json.clone() } else { "null".into() };
            let fin = if i == last { "\"length\"" } else { "null" };
            events.push(format!("data: {{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"text\":{tj},\"logprobs\":null,\"finish_reason\":{fin},\"stop_reason\":null,\"prompt_token_ids\":{p}{tid}}}]}}\n\n"));
        }
    }
    if include_usage {
        let obj = if chat { "chat.completion.chunk" } else { "text_completion" };
        let det = config
            .cached_tokens
            .map_or(String::new(), |c| format!(",\"prompt_tokens_details\":{{\"cached_tokens\":{c}}}"));
        let reasoning =
            if chat { format!(",\"completion_tokens_details\":{reasoning_details}") } else { String::new() };
        events.push(format!("data: {{\"id\":\"{id}\",\"object\":\"{obj}\",\"created\":{created},\"model\":\"{model}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{n_prompt},\"total_tokens\":{total},\"completion_tokens\":{}{det}{reasoning}}},\"system_fingerprint\":\"{fingerprint}\"}}\n\n", out.len()));
    }
    events.push("data: [DONE]\n\n".to_owned());
    if let Some(n) = config.split_every {
        // Re-cut the whole stream into n-byte pieces so events split mid-JSON and mid-"\n\n".
        let joined: String = events.concat();
        let bytes = joined.into_bytes();
        events = bytes.chunks(n.max(1)).map(|c| String::from_utf8_lossy(c).into_owned()).collect();
        // from_utf8_lossy on cuts inside multi-byte chars would corrupt; the fake only emits ASCII.
    }
    if let Some(cut) = config.cut_stream_at_byte {
        let joined = events.concat().into_bytes();
        // The second piece is never sent: the break comes in its place.
        events = vec![String::from_utf8_lossy(&joined[..cut.min(joined.len())]).into_owned(), String::new()];
    }
    Ok(Reply::Sse(events))
}

/// A prefill's `kv_transfer_params` as vLLM 0.32's NixlConnector (CPU, pull) returns them
/// (recorded: `chat_prefill_nixl`): one list of block ids per KV-cache group, one block per 128
/// prompt tokens, and the request id suffixed the way vLLM suffixes it.
fn nixl_kv_params(id: &str, n_prompt: usize) -> String {
    let blocks: Vec<String> = (1..=n_prompt.div_ceil(128).max(1)).map(|b| b.to_string()).collect();
    format!(
        "{{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_block_ids\":[[{}]],\"remote_engine_id\":\"fake-engine\",\"remote_request_id\":\"{id}-abcd1234\",\"remote_host\":\"127.0.0.1\",\"remote_port\":5600,\"tp_size\":1,\"dcp_size\":1,\"pp_size\":1,\"remote_num_tokens\":{n_prompt},\"remote_blocks_expiry_time\":null,\"transfer_mode\":\"pull\",\"remote_prefill_cached_tokens\":0}}",
        blocks.join(",")
    )
}
