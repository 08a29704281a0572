//! The fault matrix: what the client, the counters and the engines see when an engine, the
//! client or the config misbehaves, with tokenonce between fault-injecting engines
//! (`tests/support/fault_engine.rs`, each a raw HTTP front on a fake vLLM) whose behaviour
//! each case selects, over the prefill leg, the decode leg, the client and the config. Every
//! case asserts what the book's failure tables (docs/failures.md) document: the client's
//! status and answer (error code), the metric deltas, what each engine read and which exchanges
//! tokenonce closed, and a generous time bound. Each row is a [`Case`]. Faults that take
//! several steps are tested with their behaviour: prefill failover and ejection in
//! `tests/failover.rs`, engine restarts in `tests/engine_facts.rs`, a reload in the middle of
//! a stream in `tests/passthrough_admin.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::fault_engine::{At, End, Fault, FaultEngine, Seen, ENGINE_503, GARBAGE};
use support::*;

/// The request a case sends.
#[derive(Clone, Copy, Debug)]
enum Api {
    Chat,
    ChatStream,
    Completions,
    CompletionsStream,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Self::Chat | Self::ChatStream => "/v1/chat/completions",
            Self::Completions | Self::CompletionsStream => "/v1/completions",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Chat | Self::ChatStream => "chat",
            Self::Completions | Self::CompletionsStream => "completions",
        }
    }

    fn body(self) -> Value {
        let stream = matches!(self, Self::ChatStream | Self::CompletionsStream);
        match self {
            Self::Chat | Self::ChatStream => chat_body("what does the fault matrix check", json!({"stream": stream})),
            Self::Completions | Self::CompletionsStream => json!({
                "model": "tiny-qwen3", "prompt": "the fault matrix checks every failure", "max_tokens": 5, "stream": stream
            }),
        }
    }
}

/// What the client does.
#[derive(Clone, Copy, Debug)]
enum Client {
    /// Reads the whole answer.
    Reads,
    /// Gives up (closes the connection) after this many ms without the answer head.
    LeavesAfterMs(u64),
    /// Reads the head and the first body chunk of a stream, then closes the connection.
    LeavesAfterFirstChunk,
    /// Sends the request on a small receive buffer, reads the head, then reads nothing (until
    /// tokenonce cuts it: bounded, 15 s).
    StopsReading,
}

/// What the client must get.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// A completion: JSON with choices; streamed, events ending in `[DONE]` and no error.
    Completion,
    /// tokenonce's JSON error with this code.
    Error(&'static str),
    /// Exactly these bytes (an engine's answer relayed unchanged).
    Exactly(&'static str),
    /// A stream: whole events (each valid JSON), then an error event with this code, then `[DONE]`.
    StreamThenError(&'static str),
    /// The head went out, then the connection was cut without ending the body.
    CutAfterHead,
    /// Nothing: the client left.
    Nothing,
}

/// A counter that must rise by one.
#[derive(Clone, Copy, Debug)]
enum Count {
    /// `upstream_errors_total{stage, kind}`.
    Err(&'static str, &'static str),
    /// `requests_total{outcome}` of the case's API and route.
    Outcome(&'static str),
    /// `token_reuse_total{result="fallback", reason}`.
    Fallback(&'static str),
    /// `token_reuse_total{result="applied"}`: the decode was sent the ids and answered 2xx.
    Applied,
    /// `token_reuse_total{result="decode_failed"}`: the decode was sent the ids and gave no
    /// 2xx answer head.
    DecodeFailed,
    /// `upstream_retries_total{stage}`.
    Retry(&'static str),
    /// `timeouts_total{stage}` of the case's route.
    Timeout(&'static str),
    /// `kv_releases_total{result}` of the case's route.
    Release(&'static str),
}

impl Count {
    fn series(self, case: &Case) -> String {
        let route = case.route_name();
        match self {
            Self::Err(stage, kind) => format!(r#"tokenonce_upstream_errors_total{{kind="{kind}",stage="{stage}"}}"#),
            Self::Outcome(outcome) => format!(
                r#"tokenonce_requests_total{{api="{}",mode="{}",outcome="{outcome}",route="{route}"}}"#,
                case.api.label(),
                case.mode.label()
            ),
            Self::Fallback(reason) => {
                format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="fallback",route="{route}"}}"#)
            }
            Self::Applied => {
                format!(r#"tokenonce_token_reuse_total{{reason="none",result="applied",route="{route}"}}"#)
            }
            Self::DecodeFailed => {
                format!(r#"tokenonce_token_reuse_total{{reason="none",result="decode_failed",route="{route}"}}"#)
            }
            Self::Retry(stage) => format!(r#"tokenonce_upstream_retries_total{{stage="{stage}"}}"#),
            Self::Timeout(stage) => format!(r#"tokenonce_timeouts_total{{route="{route}",stage="{stage}"}}"#),
            Self::Release(result) => format!(r#"tokenonce_kv_releases_total{{result="{result}",route="{route}"}}"#),
        }
    }
}

/// An engine of a case: up with a fault on every POST, or down (connects refused).
#[derive(Clone, Copy, Debug)]
enum Engine {
    Up(Fault),
    /// The first POST meets the first fault, every later one the second.
    UpThen(Fault, Fault),
    Down,
}

/// The route a case runs on.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Orchestrate, prefill pool `prefill`.
    Orchestrate,
    /// Orchestrate, the prefiller named per request in `x-prefiller-host-port`.
    Header,
    /// Relay, the request a prefill leg (`kv_transfer_params.do_remote_decode: true`).
    RelayPrefill,
    /// Relay, a request that is no prefill leg and carries no handoff: sent to the decode as is.
    RelayDecode,
    /// Passthrough (the body read, the leg sent by tokenonce).
    Passthrough,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Self::Orchestrate | Self::Header => "orchestrate",
            Self::RelayPrefill | Self::RelayDecode => "relay",
            Self::Passthrough => "passthrough",
        }
    }
}

/// One row of the matrix.
#[derive(Clone, Copy, Debug)]
struct Case {
    mode: Mode,
    prefill: Engine,
    decode: Engine,
    /// Changes the fake behind the prefill engine.
    prefill_fake: fn(&mut FakeConfig),
    /// Changes the fake behind the decode engine.
    decode_fake: fn(&mut FakeConfig),
    /// `max_tokens` of the request.
    max_tokens: u64,
    /// More checks of what the engines read: (prefill, decode).
    engines_saw: fn(&[Seen], &[Seen]),
    /// More keys of the route.
    route: &'static str,
    api: Api,
    client: Client,
    /// The status the client gets (0: none, it left).
    status: u16,
    answer: Answer,
    /// Counters that rise by one each; `upstream_errors_total` as a whole rises by exactly
    /// the `Err` entries.
    counted: &'static [Count],
    /// POSTs each engine read whole: (prefill, decode).
    saw: (usize, usize),
    /// Exchanges tokenonce closed while the engine held or relayed them: (prefill, decode).
    closed: (usize, usize),
    /// Whether the decode's body carried the prefill's ids (checked when it got one).
    reused: Option<bool>,
    /// The whole case, request to answer, within this.
    within_ms: u64,
}

fn unchanged(_: &mut FakeConfig) {}

/// A JSON answer sent in 16-byte pieces without a declared length (chunked), so it is
/// streamed through to the client rather than read whole first.
fn chunked_answer(c: &mut FakeConfig) {
    c.split_every = Some(16);
}

/// The happy path: both engines pass, a chat request is answered with reuse applied.
const OK: Case = Case {
    mode: Mode::Orchestrate,
    prefill: Engine::Up(Fault::Pass),
    decode: Engine::Up(Fault::Pass),
    prefill_fake: unchanged,
    decode_fake: unchanged,
    max_tokens: 5,
    engines_saw: |_, _| {},
    route: "",
    api: Api::Chat,
    client: Client::Reads,
    status: 200,
    answer: Answer::Completion,
    counted: &[Count::Applied, Count::Outcome("success")],
    saw: (1, 1),
    closed: (0, 0),
    reused: Some(true),
    within_ms: 10_000,
};

/// Short deadlines, so timeouts are quick to meet.
const SHORT_PREFILL: &str = "prefill_timeout_ms = 500\n";
const SHORT_DECODE: &str = "decode_first_byte_timeout_ms = 500\ndecode_whole_answer_timeout_ms = 500\n";
const DECODE_ALONE: &str = "on_prefill_failure = \"decode_alone\"\n";
const SHORT_IDLE: &str = "stream_idle_timeout_ms = 500\n";

impl Case {
    fn route_name(&self) -> &'static str {
        match self.mode {
            Mode::Orchestrate | Mode::Header => "pd",
            Mode::RelayPrefill | Mode::RelayDecode => "relay",
            Mode::Passthrough => "pt",
        }
    }

    fn config(&self, prefill: &str, decode: &str) -> String {
        let (mode, prefill_key) = match self.mode {
            Mode::Orchestrate => ("orchestrate", "prefill = { pool = \"prefill\" }\n"),
            Mode::Header => {
                ("orchestrate", "prefill = { header = \"x-prefiller-host-port\", allow = [\"127.0.0.1\"] }\n")
            }
            Mode::RelayPrefill | Mode::RelayDecode => ("relay", "prefill = { pool = \"prefill\" }\n"),
            Mode::Passthrough => ("passthrough", ""),
        };
        let model = match self.mode {
            // A model match makes tokenonce read the body and send the leg itself.
            Mode::Passthrough => "model = \"*\"\n",
            Mode::Orchestrate | Mode::Header | Mode::RelayPrefill | Mode::RelayDecode => "",
        };
        format!(
            "[pools.prefill]\nendpoints = [\"{prefill}\"]\n\n[pools.decode]\nendpoints = [\"{decode}\"]\n\n[[routes]]\nname = \"{}\"\nmode = \"{mode}\"\ndecode_pool = \"decode\"\n{prefill_key}{}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n{model}",
            self.route_name(),
            self.route
        )
    }
}

/// Starts a fault engine in front of `fake` as `engine` says.
async fn engine(fake: &FakeVllm, engine: Engine) -> FaultEngine {
    match engine {
        Engine::Up(fault) => FaultEngine::with(fake, fault).await,
        Engine::UpThen(first, then) => {
            let e = FaultEngine::with(fake, then).await;
            e.then(first);
            e
        }
        Engine::Down => {
            let e = FaultEngine::start(fake).await;
            e.stop().await;
            e
        }
    }
}

/// Sends the case's request as its client behaves: status (0 when it left) and body.
async fn send(case: &Case, url: &str, headers: &[(&str, &str)], decode: &FaultEngine) -> (u16, Result<String, String>) {
    let (api, mode, client) = (case.api, case.mode, case.client);
    let mut body = api.body();
    body["max_tokens"] = json!(case.max_tokens);
    if let Mode::RelayPrefill = mode {
        // What an orchestrator sends as the prefill leg.
        body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
        body["max_tokens"] = json!(1);
    }
    match client {
        Client::Reads => {
            let mut req = reqwest::Client::new().post(format!("{url}{}", api.path())).json(&body);
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.map_err(|e| format!("{e:?}")))
        }
        Client::StopsReading => stop_reading(url, api.path(), &body, decode).await,
        Client::LeavesAfterMs(ms) => {
            let http = reqwest::Client::builder().timeout(Duration::from_millis(ms)).build().unwrap();
            let sent = http.post(format!("{url}{}", api.path())).json(&body).send().await;
            assert!(sent.as_ref().is_err_and(reqwest::Error::is_timeout), "the client meant to give up: {sent:?}");
            (0, Ok(String::new()))
        }
        Client::LeavesAfterFirstChunk => {
            let resp = reqwest::Client::new().post(format!("{url}{}", api.path())).json(&body).send().await.unwrap();
            let status = resp.status().as_u16();
            let mut stream = resp.bytes_stream();
            let first = tokio::time::timeout(Duration::from_secs(10), futures_util::StreamExt::next(&mut stream))
                .await
                .expect("a first chunk within 10 s");
            assert!(first.is_some_and(|c| c.is_ok()), "a first chunk");
            (status, Ok(String::new()))
        }
    }
}

/// [`Client::StopsReading`]: the status, and `Err` once tokenonce cut the connection (read
/// on after the decode engine saw its connection closed).
async fn stop_reading(url: &str, path: &str, body: &Value, decode: &FaultEngine) -> (u16, Result<String, String>) {
    let mut client = SlowClient::post(url, path, body).await;
    let first = client.first_bytes(Duration::from_secs(15)).await;
    let status = std::str::from_utf8(&first).ok().and_then(|h| h.get(9..12)?.parse().ok()).unwrap_or(0);
    // Read nothing until tokenonce closed the decode (bounded), then drain: a cut connection ends.
    let deadline = Instant::now() + Duration::from_secs(30);
    while decode.ended(End::ClosedByPeer) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cut = client.drained(Duration::from_secs(15)).await;
    (status, if cut { Err("cut".into()) } else { Ok("still open".into()) })
}

/// Checks the client's answer: whole unless the case expects a cut.
fn check_answer(answer: Answer, api: Api, got: &Result<String, String>) {
    let text = match (answer, got) {
        (Answer::CutAfterHead, Err(_)) => return,
        (Answer::CutAfterHead, Ok(text)) => panic!("the body ended whole: {text}"),
        (_, Err(e)) => panic!("the body did not end: {e}"),
        (_, Ok(text)) => text.as_str(),
    };
    match answer {
        Answer::CutAfterHead => {}
        Answer::Nothing => {}
        Answer::Exactly(want) => assert_eq!(text, want),
        Answer::Error(code) => assert_openai_error(text, code),
        Answer::Completion if matches!(api, Api::ChatStream | Api::CompletionsStream) => {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            assert!(!text.contains("\"error\""), "{text}");
            assert!(whole_events(text).len() >= 2, "{text}");
        }
        Answer::Completion => {
            let json: Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
            assert!(json["choices"].as_array().is_some_and(|c| !c.is_empty()), "{text}");
        }
        Answer::StreamThenError(code) => {
            let events = whole_events(text);
            assert!(text.ends_with("\n\ndata: [DONE]\n\n"), "{text}");
            let (last, before) = events.split_last().unwrap();
            assert_eq!(last["error"]["code"], code, "{text}");
            assert!(!before.is_empty(), "events before the break: {text}");
            assert!(before.iter().all(|e| e.get("error").is_none()), "{text}");
        }
    }
}

/// The sum of every `upstream_errors_total` sample.
async fn upstream_errors(proxy: &TokenOnce) -> f64 {
    proxy.family_sum("tokenonce_upstream_errors_total").await
}

/// Waits (bounded: 5 s) until `got()` equals `want`, then asserts it.
async fn settles<T: PartialEq + std::fmt::Debug>(what: &str, want: T, got: impl Fn() -> T) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while got() != want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(got(), want, "{what}");
}

/// Runs one row of the matrix.
async fn run(case: Case) {
    let mut prefill_config = FakeConfig::default();
    (case.prefill_fake)(&mut prefill_config);
    let mut decode_config = FakeConfig::default();
    (case.decode_fake)(&mut decode_config);
    let (pf, df) = (FakeVllm::start(prefill_config).await, FakeVllm::start(decode_config).await);
    let (p, d) = (engine(&pf, case.prefill).await, engine(&df, case.decode).await);
    let proxy = TokenOnce::start(&case.config(&p.host_port(), &d.host_port())).await;
    let series: Vec<String> = case.counted.iter().map(|c| c.series(&case)).collect();
    let mut before = Vec::new();
    for s in &series {
        before.push(proxy.metric(s).await);
    }
    let errors_before = upstream_errors(&proxy).await;
    let reuse_before = proxy.family_sum("tokenonce_token_reuse_total").await;

    let started = Instant::now();
    let prefiller = p.host_port();
    let headers: &[(&str, &str)] = match case.mode {
        Mode::Header => &[("x-prefiller-host-port", prefiller.as_str())],
        Mode::Orchestrate | Mode::RelayPrefill | Mode::RelayDecode | Mode::Passthrough => &[],
    };
    let (status, text) = send(&case, &proxy.url, headers, &d).await;
    let took = started.elapsed();
    assert_eq!(status, case.status, "{text:?}");
    check_answer(case.answer, case.api, &text);
    assert!(took < Duration::from_millis(case.within_ms), "took {took:?}, bound {} ms", case.within_ms);

    settles("POSTs the prefill engine read", case.saw.0, || p.posts().len()).await;
    settles("POSTs the decode engine read", case.saw.1, || d.posts().len()).await;
    settles("prefill exchanges tokenonce closed", case.closed.0, || p.ended(End::ClosedByPeer)).await;
    settles("decode exchanges tokenonce closed", case.closed.1, || d.ended(End::ClosedByPeer)).await;
    if let (Some(reused), Some(decode)) = (case.reused, d.posts().first()) {
        let body = decode.json();
        let carried = match case.api {
            Api::Chat | Api::ChatStream => body["kv_transfer_params"]["prompt_token_ids"].is_array(),
            Api::Completions | Api::CompletionsStream => body["prompt"].is_array(),
        };
        assert_eq!(carried, reused, "decode body: {body}");
    }
    (case.engines_saw)(&p.posts(), &d.posts());
    for (i, s) in series.iter().enumerate() {
        let want = before[i] + series.iter().filter(|o| *o == s).count() as f64;
        assert_eq!(proxy.metric_reaches(s, want).await, want, "{s}");
    }
    let errors = case.counted.iter().filter(|c| matches!(c, Count::Err(..))).count() as f64;
    assert_eq!(upstream_errors(&proxy).await - errors_before, errors, "upstream_errors_total overall");
    // Each decode's reuse is counted once, with its outcome: none that the row does not name.
    let reuse = case.counted.iter().filter(|c| matches!(c, Applied | DecodeFailed | Fallback(_))).count() as f64;
    let reuse_now = proxy.family_sum("tokenonce_token_reuse_total").await;
    assert_eq!(reuse_now - reuse_before, reuse, "token_reuse_total overall");
}

/// One `#[tokio::test]` per row.
macro_rules! matrix {
    ($($(#[doc = $doc:literal])* $name:ident: $case:expr;)+) => {
        $(
            $(#[doc = $doc])*
            #[tokio::test(flavor = "multi_thread")]
            async fn $name() {
                run($case).await;
            }
        )+
    };
}

use Count::{Applied, DecodeFailed, Err as UpErr, Fallback, Outcome, Release, Retry, Timeout};

matrix! {
    // ---- baselines: the fault engines relay the fakes unchanged ----
    /// Both engines healthy: chat answered with reuse.
    baseline_chat: OK;
    /// Both healthy, completions streamed: ids as the decode's prompt.
    baseline_completions_stream: Case { api: Api::CompletionsStream, ..OK };

    // ---- prefill ----
    /// Prefill down: the connect is retried once (the engine never got it), then 502.
    prefill_down: Case {
        prefill: Engine::Down, status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "connect"), Retry("prefill"), Outcome("server_error")], saw: (0, 0), ..OK
    };
    /// Prefill accepts and never answers: 504 at `prefill_timeout_ms`, its connection closed.
    prefill_hangs_before_headers: Case {
        prefill: Engine::Up(Fault::HangBeforeHead), route: SHORT_PREFILL, status: 504,
        answer: Answer::Error("prefill_timeout"),
        counted: &[UpErr("prefill", "timeout"), Timeout("prefill"), Outcome("server_error")],
        saw: (1, 0), closed: (1, 0), within_ms: 5_000, ..OK
    };
    /// Prefill sends its head and part of the body, then nothing: the whole-leg deadline holds.
    prefill_hangs_mid_body: Case {
        prefill: Engine::Up(Fault::Stall(At::body(40))), route: SHORT_PREFILL, status: 504,
        answer: Answer::Error("prefill_timeout"),
        counted: &[UpErr("prefill", "timeout"), Timeout("prefill"), Outcome("server_error")],
        saw: (1, 0), closed: (1, 0), within_ms: 5_000, ..OK
    };
    /// Prefill answers 503 with a body: relayed unchanged, no decode.
    prefill_5xx_with_body: Case {
        prefill: Engine::Up(Fault::Status(503, ENGINE_503)), status: 503, answer: Answer::Exactly(ENGINE_503),
        counted: &[UpErr("prefill", "status_5xx"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Prefill answers 500 with an empty body: relayed as is (empty), no decode.
    prefill_5xx_without_body: Case {
        prefill: Engine::Up(Fault::Status(500, "")), status: 500, answer: Answer::Exactly(""),
        counted: &[UpErr("prefill", "status_5xx"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Prefill answers bytes that are not HTTP: 502, not re-sent (it read the request).
    prefill_garbage: Case {
        prefill: Engine::Up(Fault::Garbage(GARBAGE)), status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "io"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Prefill answers 200 with a body that is not JSON: 502 `prefill_bad_response`.
    prefill_non_json_200: Case {
        prefill: Engine::Up(Fault::Status(200, "<html>upstream says hi</html>")), status: 502,
        answer: Answer::Error("prefill_bad_response"), counted: &[UpErr("prefill", "bad_response"), Outcome("server_error")],
        saw: (1, 0), ..OK
    };
    /// Prefill closes mid-body: 502, the leg not re-sent.
    prefill_cut_mid_body: Case {
        prefill: Engine::Up(Fault::Cut(At::body(40))), status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "io"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Prefill reads the request and closes without a byte: 502, not re-sent (it may run it).
    prefill_closes_after_reading: Case {
        prefill: Engine::Up(Fault::CloseAfterRead), status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "io"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Prefill answers 400: the client's error, relayed, never failed over, no decode.
    prefill_4xx: Case {
        prefill: Engine::Up(Fault::Status(400, "{\"error\":\"bad\"}")), status: 400,
        answer: Answer::Exactly("{\"error\":\"bad\"}"), counted: &[Outcome("client_error")], saw: (1, 0), ..OK
    };
    /// Prefill echoes no ids: text decode, `ids_missing`.
    prefill_ids_missing: Case {
        prefill_fake: |c| c.omit_prompt_ids = true, counted: &[Fallback("ids_missing"), Outcome("success")],
        reused: Some(false), ..OK
    };
    /// Prefill echoes ids that are not integers: text decode, `ids_malformed`.
    prefill_ids_malformed: Case {
        prefill_fake: |c| c.corrupt_prompt_ids = Some("[1,2,\"three\",-4]".into()),
        counted: &[Fallback("ids_malformed"), Outcome("success")], reused: Some(false), ..OK
    };
    /// Prefill echoes 2 M ids for a short prompt (count ≠ `usage.prompt_tokens`): refused
    /// in bounded time, text decode, `ids_malformed`; the 2 M ids never reach the decode.
    prefill_ids_2m_long: Case {
        prefill_fake: |c| c.corrupt_prompt_ids = Some(format!("[{}]", vec!["151"; 2_000_000].join(","))),
        counted: &[Fallback("ids_malformed"), Outcome("success")], reused: Some(false), within_ms: 20_000, ..OK
    };
    /// Completions, ids malformed: text decode (the client's prompt string).
    prefill_ids_malformed_completions: Case {
        api: Api::Completions, prefill_fake: |c| c.corrupt_prompt_ids = Some("[1.5]".into()),
        counted: &[Fallback("ids_malformed"), Outcome("success")], reused: Some(false), ..OK
    };
    /// `decode_alone`: prefill down, the decode serves the client's request alone.
    prefill_down_decode_alone: Case {
        prefill: Engine::Down, route: DECODE_ALONE,
        counted: &[UpErr("prefill", "connect"), Retry("prefill"), Fallback("prefill_failed"), Outcome("success")],
        saw: (0, 1), reused: Some(false), ..OK
    };
    /// `decode_alone`: prefill hangs, at `prefill_timeout_ms` the decode serves alone.
    prefill_hangs_decode_alone: Case {
        prefill: Engine::Up(Fault::HangBeforeHead), route: "prefill_timeout_ms = 500\non_prefill_failure = \"decode_alone\"\n",
        counted: &[UpErr("prefill", "timeout"), Fallback("prefill_failed"), Outcome("success")],
        saw: (1, 1), closed: (1, 0), reused: Some(false), within_ms: 5_000, ..OK
    };
    /// `decode_alone`: prefill answers garbage, the decode serves alone (streamed).
    prefill_garbage_decode_alone: Case {
        prefill: Engine::Up(Fault::Garbage(GARBAGE)), route: DECODE_ALONE, api: Api::ChatStream,
        counted: &[UpErr("prefill", "io"), Fallback("prefill_failed"), Outcome("success")],
        saw: (1, 1), reused: Some(false), ..OK
    };
    /// `decode_alone` never follows a 4xx: the client's error stays the answer.
    prefill_4xx_decode_alone: Case {
        prefill: Engine::Up(Fault::Status(400, "{\"error\":\"bad\"}")), route: DECODE_ALONE, status: 400,
        answer: Answer::Exactly("{\"error\":\"bad\"}"), counted: &[Outcome("client_error")], saw: (1, 0), ..OK
    };

    // ---- decode ----
    /// Decode down: retried once (never got it), then 502 after a good prefill.
    decode_down: Case {
        decode: Engine::Down, status: 502, answer: Answer::Error("decode_unavailable"),
        counted: &[Fallback("decode_version_unknown"), UpErr("decode", "connect"), Retry("decode"), Outcome("server_error")], saw: (1, 0), ..OK
    };
    /// Decode never sends a head: 504 at `decode_first_byte_timeout_ms`, its connection closed.
    decode_hangs_before_headers: Case {
        decode: Engine::Up(Fault::HangBeforeHead), route: SHORT_DECODE, status: 504,
        answer: Answer::Error("decode_timeout"),
        counted: &[DecodeFailed, UpErr("decode", "timeout"), Timeout("first_byte"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// Streamed decode never sends a head: the same 504.
    decode_stream_hangs_before_headers: Case {
        decode: Engine::Up(Fault::HangBeforeHead), route: SHORT_DECODE, api: Api::ChatStream, status: 504,
        answer: Answer::Error("decode_timeout"),
        counted: &[DecodeFailed, UpErr("decode", "timeout"), Timeout("first_byte"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// Decode answers 503 with a body: the engine's answer relayed unchanged.
    decode_5xx_with_body: Case {
        decode: Engine::Up(Fault::Status(503, ENGINE_503)), status: 503, answer: Answer::Exactly(ENGINE_503),
        counted: &[DecodeFailed, Outcome("server_error")], ..OK
    };
    /// Decode answers 502 with no body: relayed as is.
    decode_5xx_without_body: Case {
        decode: Engine::Up(Fault::Status(502, "")), status: 502, answer: Answer::Exactly(""),
        counted: &[DecodeFailed, Outcome("server_error")], ..OK
    };
    /// Decode answers bytes that are not HTTP: 502, not re-sent.
    decode_garbage: Case {
        decode: Engine::Up(Fault::Garbage(GARBAGE)), status: 502, answer: Answer::Error("decode_unavailable"),
        counted: &[DecodeFailed, UpErr("decode", "io"), Outcome("server_error")], ..OK
    };
    /// Decode answers 200 that is not JSON: the decode's answer is the client's, relayed as is.
    decode_non_json_200: Case {
        decode: Engine::Up(Fault::Status(200, "not json at all")), answer: Answer::Exactly("not json at all"),
        counted: &[Applied, Outcome("success")], ..OK
    };
    /// Decode closes mid-body (not streamed, no declared length): the body needs no rewrite
    /// and streams through, so the head went out; the client connection is cut without ending
    /// the body.
    decode_cut_mid_body: Case {
        decode_fake: chunked_answer, decode: Engine::Up(Fault::Cut(At::body(40))), answer: Answer::CutAfterHead,
        counted: &[Applied, UpErr("decode", "stream_broken"), Outcome("server_error")], ..OK
    };
    /// The same cut of a small answer with a declared length, read whole before it is written
    /// (nothing sent yet): 502.
    decode_cut_mid_small_body: Case {
        decode: Engine::Up(Fault::Cut(At::body(40))), status: 502, answer: Answer::Error("decode_unavailable"),
        counted: &[Applied, UpErr("decode", "io"), Outcome("server_error")], ..OK
    };
    /// The same cut of an answer buffered for the `cached_tokens` rewrite (nothing sent yet): 502.
    decode_cut_mid_body_rewritten: Case {
        prefill_fake: |c| c.cached_tokens = Some(3), decode: Engine::Up(Fault::Cut(At::body(40))), status: 502,
        answer: Answer::Error("decode_unavailable"), counted: &[Applied, UpErr("decode", "io"), Outcome("server_error")],
        ..OK
    };
    /// Decode sends its head and part of a JSON body of no declared length, then nothing: at
    /// `stream_idle_timeout_ms`
    /// the client connection is cut (the body never ends), the decode closed.
    decode_hangs_mid_body: Case {
        decode_fake: chunked_answer, decode: Engine::Up(Fault::Stall(At::body(40))), route: SHORT_IDLE,
        answer: Answer::CutAfterHead,
        counted: &[Applied, UpErr("decode", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// The same hang of a small answer with a declared length: 504 `stream_idle_timeout`.
    decode_hangs_mid_small_body: Case {
        decode: Engine::Up(Fault::Stall(At::body(40))), route: SHORT_IDLE, status: 504,
        answer: Answer::Error("stream_idle_timeout"),
        counted: &[Applied, UpErr("decode", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// The same hang of an answer buffered for the `cached_tokens` rewrite: 504 `stream_idle_timeout`.
    decode_hangs_mid_body_rewritten: Case {
        prefill_fake: |c| c.cached_tokens = Some(3), decode: Engine::Up(Fault::Stall(At::body(40))), route: SHORT_IDLE,
        status: 504, answer: Answer::Error("stream_idle_timeout"),
        counted: &[Applied, UpErr("decode", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// Chat stream stalled after two events: at `stream_idle_timeout_ms` the events so far,
    /// the error event `stream_idle_timeout`, `[DONE]`; the decode closed.
    decode_stalls_mid_stream: Case {
        decode: Engine::Up(Fault::Stall(At::event(3, 0))), route: SHORT_IDLE, api: Api::ChatStream,
        answer: Answer::StreamThenError("stream_idle_timeout"),
        counted: &[Applied, UpErr("decode", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// Completions stream stalled in the middle of its second event: the half event is dropped.
    decode_stalls_mid_stream_completions: Case {
        decode: Engine::Up(Fault::Stall(At::event(2, 30))), route: SHORT_IDLE, api: Api::CompletionsStream,
        answer: Answer::StreamThenError("stream_idle_timeout"),
        counted: &[Applied, UpErr("decode", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// Decode reads the request and closes: 502, not re-sent (a decode must not run twice).
    decode_closes_after_reading: Case {
        decode: Engine::Up(Fault::CloseAfterRead), status: 502, answer: Answer::Error("decode_unavailable"),
        counted: &[DecodeFailed, UpErr("decode", "io"), Outcome("server_error")], ..OK
    };
    /// Chat stream cut in the middle of its third event: the two whole events, the error
    /// event, `[DONE]`.
    decode_cut_mid_sse_event: Case {
        decode: Engine::Up(Fault::Cut(At::event(3, 10))), api: Api::ChatStream,
        answer: Answer::StreamThenError("decode_stream_failed"),
        counted: &[Applied, UpErr("decode", "stream_broken"), Outcome("server_error")], ..OK
    };
    /// Completions stream cut in the middle of its second event.
    decode_cut_mid_sse_event_completions: Case {
        decode: Engine::Up(Fault::Cut(At::event(2, 25))), api: Api::CompletionsStream,
        answer: Answer::StreamThenError("decode_stream_failed"),
        counted: &[Applied, UpErr("decode", "stream_broken"), Outcome("server_error")], ..OK
    };
    /// Chat stream cut right after an event's blank line: no event lost, then the error.
    decode_cut_between_sse_events: Case {
        decode: Engine::Up(Fault::Cut(At::event(3, 0))), api: Api::ChatStream,
        answer: Answer::StreamThenError("decode_stream_failed"),
        counted: &[Applied, UpErr("decode", "stream_broken"), Outcome("server_error")], ..OK
    };

    // ---- relay routes: a request that is no leg, sent to the decode as is ----
    /// Relay decode that never sends a head: 504 at the route's first-byte timeout.
    relay_decode_hangs_before_headers: Case {
        mode: Mode::RelayDecode, decode: Engine::Up(Fault::HangBeforeHead), route: SHORT_DECODE, status: 504,
        answer: Answer::Error("decode_timeout"),
        counted: &[UpErr("decode", "timeout"), Timeout("first_byte"), Outcome("server_error")],
        saw: (0, 1), closed: (0, 1), reused: None, within_ms: 5_000, ..OK
    };

    // ---- client ----
    /// The client leaves while the prefill runs: the prefill connection is closed, no decode.
    client_gone_during_prefill: Case {
        prefill: Engine::Up(Fault::HangBeforeHead), client: Client::LeavesAfterMs(300), status: 0,
        answer: Answer::Nothing, counted: &[Outcome("client_closed")], saw: (1, 0), closed: (1, 0), reused: None,
        within_ms: 5_000, ..OK
    };
    /// The client leaves after the handoff, while the decode has not answered: the decode
    /// connection is closed (vLLM aborts it).
    client_gone_during_handoff: Case {
        decode: Engine::Up(Fault::HangBeforeHead), client: Client::LeavesAfterMs(300), status: 0,
        answer: Answer::Nothing, counted: &[DecodeFailed, Outcome("client_closed")], closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// The client leaves after a prefill that handed over KV (`kv_transfer_params`), the
    /// decode holding its request unanswered: the decode is closed and owns the blocks (vLLM
    /// pulls them, or frees them on the prefill when aborted first), so no release is sent
    /// (a second decode would read freed blocks); counted `left_to_decode`. The release of a
    /// decode never delivered is in `timeouts.rs` (`client_gone_before_the_decode_got_its_request_*`).
    client_gone_after_the_decode_got_its_request: Case {
        prefill_fake: |c| c.connector = true, decode: Engine::UpThen(Fault::HangBeforeHead, Fault::Pass),
        client: Client::LeavesAfterMs(300), status: 0, answer: Answer::Nothing,
        counted: &[DecodeFailed, Release("left_to_decode"), Outcome("client_closed")], saw: (1, 1), closed: (0, 1),
        within_ms: 5_000, ..OK
    };
    /// The same with `on_client_gone = "abandon"`: nothing more is sent either.
    client_gone_after_the_decode_got_its_request_abandon: Case {
        prefill_fake: |c| c.connector = true, decode: Engine::Up(Fault::HangBeforeHead),
        route: "on_client_gone = \"abandon\"\n", client: Client::LeavesAfterMs(300), status: 0, answer: Answer::Nothing,
        counted: &[DecodeFailed, Release("left_to_decode"), Outcome("client_closed")], closed: (0, 1), within_ms: 5_000, ..OK
    };
    /// A client that stops reading a long stream: once a write to it waits
    /// `client_write_timeout_ms` its connection is cut and the decode closed.
    client_stops_reading: Case {
        api: Api::ChatStream, max_tokens: 200_000, client: Client::StopsReading,
        route: "decode_first_byte_timeout_ms = 30000\nclient_write_timeout_ms = 300\n", answer: Answer::CutAfterHead,
        counted: &[Applied, Timeout("client_write"), Outcome("client_closed")], closed: (0, 1), within_ms: 60_000, ..OK
    };
    /// The client leaves mid-stream (the decode stalled after two events): decode closed.
    client_gone_during_stream: Case {
        decode: Engine::Up(Fault::Stall(At::event(3, 0))), api: Api::ChatStream, client: Client::LeavesAfterFirstChunk,
        answer: Answer::Nothing, counted: &[Applied, Outcome("client_closed")], closed: (0, 1), within_ms: 5_000, ..OK
    };

    // ---- prefillers named by a request header ----
    /// A header-named prefiller that is down: one attempt (no pool to fail over in), 502
    /// reading `cannot connect` whatever the cause.
    header_prefiller_down: Case {
        mode: Mode::Header, prefill: Engine::Down, status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "connect"), Retry("prefill"), Outcome("server_error")], saw: (0, 0), ..OK
    };
    /// A header-named prefiller that hangs: bounded by the route's `prefill_timeout_ms`.
    header_prefiller_hangs: Case {
        mode: Mode::Header, prefill: Engine::Up(Fault::HangBeforeHead), route: SHORT_PREFILL, status: 504,
        answer: Answer::Error("prefill_timeout"),
        counted: &[UpErr("prefill", "timeout"), Timeout("prefill"), Outcome("server_error")],
        saw: (1, 0), closed: (1, 0), within_ms: 5_000, ..OK
    };
    /// A header-named prefiller answering garbage: 502.
    header_prefiller_garbage: Case {
        mode: Mode::Header, prefill: Engine::Up(Fault::Garbage(GARBAGE)), status: 502,
        answer: Answer::Error("prefill_unavailable"), counted: &[UpErr("prefill", "io"), Outcome("server_error")],
        saw: (1, 0), ..OK
    };
    /// A header-named prefiller answering 5xx: relayed unchanged, no decode.
    header_prefiller_5xx: Case {
        mode: Mode::Header, prefill: Engine::Up(Fault::Status(503, ENGINE_503)), status: 503,
        answer: Answer::Exactly(ENGINE_503), counted: &[UpErr("prefill", "status_5xx"), Outcome("server_error")],
        saw: (1, 0), ..OK
    };

    // ---- relay routes: the orchestrator's prefill leg ----
    /// Relay prefill leg, both engines fine: the prefill's answer, the decode not involved.
    relay_prefill_baseline: Case {
        mode: Mode::RelayPrefill, counted: &[Outcome("success")], saw: (1, 0), reused: None, ..OK
    };
    /// Relay prefill engine down: re-sent once, then 502 to the orchestrator.
    relay_prefill_down: Case {
        mode: Mode::RelayPrefill, prefill: Engine::Down, status: 502, answer: Answer::Error("prefill_unavailable"),
        counted: &[UpErr("prefill", "connect"), Retry("prefill"), Outcome("server_error")], saw: (0, 0), reused: None, ..OK
    };
    /// Relay prefill engine that hangs: 504 at the route's `prefill_timeout_ms`.
    relay_prefill_hangs: Case {
        mode: Mode::RelayPrefill, prefill: Engine::Up(Fault::HangBeforeHead), route: SHORT_PREFILL, status: 504,
        answer: Answer::Error("prefill_timeout"),
        counted: &[UpErr("prefill", "timeout"), Timeout("prefill"), Outcome("server_error")],
        saw: (1, 0), closed: (1, 0), reused: None, within_ms: 5_000, ..OK
    };
    /// Relay prefill engine answering garbage: 502.
    relay_prefill_garbage: Case {
        mode: Mode::RelayPrefill, prefill: Engine::Up(Fault::Garbage(GARBAGE)), status: 502,
        answer: Answer::Error("prefill_unavailable"), counted: &[UpErr("prefill", "io"), Outcome("server_error")],
        saw: (1, 0), reused: None, ..OK
    };

    // ---- passthrough routes ----
    /// Passthrough engine that never sends a head: 504 at the first-byte timeout.
    passthrough_hangs_before_headers: Case {
        mode: Mode::Passthrough, decode: Engine::Up(Fault::HangBeforeHead), route: SHORT_DECODE, status: 504,
        answer: Answer::Error("decode_timeout"),
        counted: &[UpErr("passthrough", "timeout"), Timeout("first_byte"), Outcome("server_error")],
        saw: (0, 1), closed: (0, 1), reused: None, within_ms: 5_000, ..OK
    };
    /// Passthrough stream stalled mid-event: the whole events, then `stream_idle_timeout`.
    passthrough_stalls_mid_stream: Case {
        mode: Mode::Passthrough, decode: Engine::Up(Fault::Stall(At::event(3, 10))), route: SHORT_IDLE,
        api: Api::ChatStream, answer: Answer::StreamThenError("stream_idle_timeout"),
        counted: &[UpErr("passthrough", "timeout"), Timeout("stream_idle"), Outcome("server_error")],
        saw: (0, 1), closed: (0, 1), reused: None, within_ms: 5_000, ..OK
    };
    /// Passthrough engine down: retried once, then 502.
    passthrough_down: Case {
        mode: Mode::Passthrough, decode: Engine::Down, status: 502, answer: Answer::Error("decode_unavailable"),
        counted: &[UpErr("passthrough", "connect"), Retry("passthrough"), Outcome("server_error")], saw: (0, 0),
        reused: None, ..OK
    };
    /// Passthrough engine answers 503: relayed unchanged.
    passthrough_5xx: Case {
        mode: Mode::Passthrough, decode: Engine::Up(Fault::Status(503, ENGINE_503)), status: 503,
        answer: Answer::Exactly(ENGINE_503), counted: &[Outcome("server_error")], saw: (0, 1), reused: None, ..OK
    };
    /// Passthrough engine answers garbage: 502.
    passthrough_garbage: Case {
        mode: Mode::Passthrough, decode: Engine::Up(Fault::Garbage(GARBAGE)), status: 502,
        answer: Answer::Error("decode_unavailable"), counted: &[UpErr("passthrough", "io"), Outcome("server_error")],
        saw: (0, 1), reused: None, ..OK
    };
    /// Passthrough stream cut mid-event: whole events, then the error event.
    passthrough_cut_mid_sse_event: Case {
        mode: Mode::Passthrough, decode: Engine::Up(Fault::Cut(At::event(3, 10))), api: Api::ChatStream,
        answer: Answer::StreamThenError("decode_stream_failed"),
        counted: &[UpErr("passthrough", "stream_broken"), Outcome("server_error")], saw: (0, 1), reused: None, ..OK
    };
}

/// The book's failure tables (docs/failures.md, "The failure tables") and this matrix agree:
/// every case a row names is a test of this crate's suites, and every case of this file (but
/// the baselines) is named by a row.
#[test]
fn failure_tables_name_every_case() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let chapter = std::fs::read_to_string(root.join("docs/failures.md")).unwrap();
    let table = chapter.split("\n## The failure tables\n").nth(1).unwrap().split("\n## ").next().unwrap();
    let named: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .filter_map(|l| l.trim_end_matches('|').rsplit('|').next())
        .flat_map(|cell| cell.split('`').skip(1).step_by(2))
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
        .collect();
    assert!(named.len() > 60, "the tables name the cases: {named:?}");
    // The integration tests, and the unit tests under src/ (a row may name one, e.g. of reload.rs).
    let mut tests = String::new();
    let mut dirs = vec![root.join("tests"), root.join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() && dir.ends_with("src") || path.is_dir() && path.starts_with(root.join("src")) {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                tests.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    for name in &named {
        let test_fn = [format!("#[test]\nfn {name}("), format!("#[test]\n    fn {name}("), format!("async fn {name}(")];
        let defined = test_fn.iter().any(|f| tests.contains(f.as_str())) || tests.contains(&format!("\n    {name}: "));
        assert!(defined, "docs/failures.md names case {name}, which no test defines");
    }
    let own = std::fs::read_to_string(root.join("tests/faults.rs")).unwrap();
    let ident = |n: &&str| n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    let rows =
        own.lines().filter_map(|l| l.strip_prefix("    ")?.split_once(": Case")).map(|(name, _)| name).filter(ident);
    let scenarios = own.lines().filter_map(|l| l.strip_prefix("async fn ")?.split_once("()")).map(|(name, _)| name);
    let tested: Vec<&str> = own
        .lines()
        .zip(own.lines().skip(1))
        .filter(|(attr, _)| attr.starts_with("#[tokio::test"))
        .filter_map(|(_, f)| f.strip_prefix("async fn ")?.split_once('(').map(|(n, _)| n))
        .collect();
    // Baselines are no fault: they show the engines pass the fakes' answers unchanged.
    for name in rows.chain(scenarios.filter(|n| tested.contains(n))).filter(|n| !n.contains("baseline")) {
        assert!(named.contains(&name), "case {name} has no row in docs/failures.md's failure tables");
    }
}
