//! Every wait is bounded and so is every buffer: engines that stall before their head,
//! mid-body and mid-stream, a client that stops reading, the KV release for a client gone
//! after its prefill, passthrough body limits and over-long SSE events. Each test asserts
//! what the client sees, what is counted, and a generous time bound.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw HTTP/1.1 engine on loopback: answers `GET`s (health, version) at once and every
/// `POST` with `answer` (a head and maybe part of a body), then holds the connection open
/// without a byte more for 20 s: a hung engine. Counts the POSTs it read.
struct StallingEngine {
    addr: String,
    posts: Arc<AtomicUsize>,
}

impl StallingEngine {
    async fn start(answer: &'static str) -> Self {
        let posts = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&posts);
        let addr = raw_engine(200, move |sock| serve(sock, answer, Arc::clone(&seen))).await;
        Self { addr, posts }
    }

    fn posts(&self) -> usize {
        self.posts.load(Ordering::SeqCst)
    }
}

async fn serve(mut sock: TcpStream, answer: &'static str, posts: Arc<AtomicUsize>) {
    let Some(req) = fault_engine::read_request(&mut sock).await else { return };
    if req.method != "POST" {
        let _ = sock.write_all(fault_engine::json_answer("{\"version\":\"0.32.0\"}", true).as_bytes()).await;
        return;
    }
    posts.fetch_add(1, Ordering::SeqCst);
    let _ = sock.write_all(answer.as_bytes()).await;
    tokio::time::sleep(Duration::from_secs(20)).await;
}

/// A 200 JSON head promising 100 bytes, then 7 of them.
const JSON_HEAD_THEN_STALL: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\":";

/// The same stall in a chunked JSON answer (no declared length, so it is not read whole first).
const CHUNKED_JSON_HEAD_THEN_STALL: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n6\r\n{\"id\":\r\n";

/// An orchestrate route `pd` over `prefill` and `decode` (`host:port`) with `extra` keys.
fn pd(prefill: &str, decode: &str, extra: &str) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{prefill}\"]\n\n[pools.decode]\nendpoints = [\"{decode}\"]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n{extra}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n"
    )
}

/// A passthrough route `pt` for `paths` to `addr`, and the unmatched default to it too.
fn passthrough(addr: &str, paths: &str, extra: &str) -> String {
    format!(
        "[pools.decode]\nendpoints = [\"{addr}\"]\n\n[[routes]]\nname = \"pt\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n{extra}\n[routes.match]\npaths = [{paths}]\n"
    )
}

const FAST: &str = "stream_idle_timeout_ms = 300\ndecode_first_byte_timeout_ms = 300\ndecode_whole_answer_timeout_ms = 300\nclient_write_timeout_ms = 300\n";

/// `data:` payloads of an SSE body.
fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
}

/// A decode stream that stalls after its first events ends, within the idle timeout, with
/// the events sent so far, then the error event `stream_idle_timeout` and `[DONE]`; counted
/// as a decode timeout at stage `stream_idle`.
#[tokio::test(flavor = "multi_thread")]
async fn stalled_decode_stream_ends_with_an_idle_error_event() {
    let decode = FakeConfig { chunk_delay: Duration::from_secs(10), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), decode, FAST).await;
    let started = Instant::now();
    let body = chat_body("stall please", json!({"stream": true}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status, 200);
    let data = sse_data(&text);
    assert!(data.len() >= 3, "{text}");
    assert!(data[0].contains("\"role\":\"assistant\""), "the first event went out: {text}");
    let error: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "stream_idle_timeout", "{text}");
    assert_eq!(data[data.len() - 1], "[DONE]");
    assert!(text.ends_with("\n\ndata: [DONE]\n\n"), "{text:?}");
    let series = r#"tokenonce_timeouts_total{route="pd",stage="stream_idle"}"#;
    proxy.assert_reaches(series, 1.0).await;
    assert_eq!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="timeout",stage="decode"}"#).await, 1.0);
}

/// A chat request through `proxy` is answered within 5 s with a 504 `decode_timeout`, counted
/// at stage `first_byte` of `route`.
async fn chat_is_a_fast_decode_timeout(proxy: &TokenOnce, route: &str) {
    let started = Instant::now();
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("hi", json!({})), &[]).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("\"code\":\"decode_timeout\""), "{text}");
    let series = format!(r#"tokenonce_timeouts_total{{route="{route}",stage="first_byte"}}"#);
    proxy.assert_reaches(&series, 1.0).await;
}

/// A decode that sends no head within `decode_first_byte_timeout_ms` is a 504
/// `decode_timeout`, counted at stage `first_byte`.
#[tokio::test(flavor = "multi_thread")]
async fn decode_without_a_head_is_504() {
    let decode = FakeConfig { delay: Duration::from_secs(10), ..FakeConfig::default() };
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), decode, FAST).await;
    chat_is_a_fast_decode_timeout(&proxy, "pd").await;
}

/// A non-streamed decode answer of no declared length needs no rewrite, so its head goes out
/// at once and its body streams through; when the engine stalls mid-body the client
/// connection is cut (the body never ends: no silent truncation), counted at `stream_idle`.
#[tokio::test(flavor = "multi_thread")]
async fn non_sse_decode_stalled_mid_body_is_cut() {
    let prefill = FakeVllm::start(FakeConfig::default()).await;
    let decode = StallingEngine::start(CHUNKED_JSON_HEAD_THEN_STALL).await;
    let proxy = TokenOnce::start(&pd(&prefill.host_port(), &decode.addr, FAST)).await;
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .json(&chat_body("hi", json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "the head is relayed before the body");
    let body = resp.bytes().await;
    assert!(body.is_err(), "a cut body must not read as complete: {body:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(decode.posts(), 1);
    let series = r#"tokenonce_timeouts_total{route="pd",stage="stream_idle"}"#;
    proxy.assert_reaches(series, 1.0).await;
    let outcome = r#"tokenonce_requests_total{api="chat",mode="orchestrate",outcome="server_error",route="pd"}"#;
    proxy.assert_reaches(outcome, 1.0).await;
}

/// When the answer's `cached_tokens` must be rewritten it is buffered, so a stall mid-body
/// comes before the client got a byte: a typed 504 `stream_idle_timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn rewritten_decode_stalled_mid_body_is_504() {
    let prefill = FakeVllm::start(FakeConfig { cached_tokens: Some(3), ..FakeConfig::default() }).await;
    let decode = StallingEngine::start(JSON_HEAD_THEN_STALL).await;
    let proxy = TokenOnce::start(&pd(&prefill.host_port(), &decode.addr, FAST)).await;
    let started = Instant::now();
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("hi", json!({})), &[]).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status, 504, "{text}");
    let error: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "stream_idle_timeout", "{text}");
    assert_eq!(error["error"]["type"], "upstream_error");
    proxy.assert_reaches(r#"tokenonce_timeouts_total{route="pd",stage="stream_idle"}"#, 1.0).await;
}

/// A route whose streamed answers must start within 300 ms and whose non-streamed answers
/// (their head comes when generation is done) must come within `answer_ms`.
fn split_deadlines(answer_ms: u64) -> String {
    format!("decode_first_byte_timeout_ms = 300\ndecode_whole_answer_timeout_ms = {answer_ms}\n")
}

/// Engines (each serving model `{route}-m`) answering after `delay`, behind the three ways a
/// decode leg is sent with the client's `stream` kept: orchestrated (`pd`), relayed
/// (`relay`), and a passthrough whose route needs the body (`pt`, a model glob).
async fn decode_routes(delay: Duration, keys: &str) -> (Vec<FakeVllm>, TokenOnce) {
    let fake = |model: &str, delay| FakeConfig { model: model.into(), delay, ..FakeConfig::default() };
    let prefill = FakeVllm::start(fake("pd-m", Duration::ZERO)).await;
    let mut config =
        format!("[pools.prefill]\nendpoints = [\"{}\"]\n[defaults]\npassthrough_pool = \"pt\"\n", prefill.host_port());
    let mut engines = vec![prefill];
    for (route, mode) in [("pd", "orchestrate"), ("relay", "relay"), ("pt", "passthrough")] {
        let engine = FakeVllm::start(fake(&format!("{route}-m"), delay)).await;
        let prefill = if mode == "orchestrate" { "prefill = { pool = \"prefill\" }\n" } else { "" };
        config = format!(
            "[pools.{route}]\nendpoints = [\"{}\"]\n{config}\n[[routes]]\nname = \"{route}\"\nmode = \"{mode}\"\ndecode_pool = \"{route}\"\n{prefill}{keys}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\nmodel = \"{route}-*\"\n",
            engine.host_port()
        );
        engines.push(engine);
    }
    (engines, TokenOnce::start(&config).await)
}

/// Each route's chat request, streamed or not, as `(status, body)`.
async fn chat_on(proxy: &TokenOnce, route: &str, stream: bool) -> (u16, String) {
    let body = chat_body("hi", json!({"model": format!("{route}-m"), "stream": stream}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    (status, text)
}

/// A non-streamed decode (orchestrated, relayed, passthrough) that answers after the
/// first-byte deadline but within the whole-answer deadline is answered: vLLM sends such a
/// head only when generation is done, so the first-byte deadline does not apply to it.
#[tokio::test(flavor = "multi_thread")]
async fn non_streamed_answer_past_the_first_byte_deadline_is_served() {
    let (_engines, proxy) = decode_routes(Duration::from_millis(900), &split_deadlines(20_000)).await;
    for route in ["pd", "relay", "pt"] {
        let (status, text) = chat_on(&proxy, route, false).await;
        assert_eq!(status, 200, "{route}: {text}");
        assert!(text.contains("\"choices\""), "{route}: {text}");
        let series = format!(r#"tokenonce_timeouts_total{{route="{route}",stage="first_byte"}}"#);
        assert_eq!(proxy.metric(&series).await, 0.0, "{route}");
    }
}

/// Past the whole-answer deadline a non-streamed decode is a 504 `decode_timeout` (counted at
/// `first_byte`, the head that did not come); a streamed one is still bounded by the
/// first-byte deadline, however long the whole-answer deadline.
#[tokio::test(flavor = "multi_thread")]
async fn whole_answer_and_first_byte_deadlines_each_bound_their_answers() {
    let (_engines, whole) = decode_routes(Duration::from_secs(10), &split_deadlines(400)).await;
    let (_slow, streamed) = decode_routes(Duration::from_secs(10), &split_deadlines(60_000)).await;
    for route in ["pd", "relay", "pt"] {
        for (proxy, stream) in [(&whole, false), (&streamed, true)] {
            let started = Instant::now();
            let (status, text) = chat_on(proxy, route, stream).await;
            assert!(started.elapsed() < Duration::from_secs(5), "{route} stream={stream}: {:?}", started.elapsed());
            assert_eq!(status, 504, "{route} stream={stream}: {text}");
            assert!(text.contains("\"code\":\"decode_timeout\""), "{route}: {text}");
            let series = format!(r#"tokenonce_timeouts_total{{route="{route}",stage="first_byte"}}"#);
            assert_eq!(proxy.metric_reaches(&series, 1.0).await, 1.0, "{route} stream={stream}");
        }
    }
}

/// A passthrough route chosen from the head alone (no model glob) still reads an API body,
/// so a non-streamed answer gets the whole-answer deadline there too: served after the
/// first-byte and idle deadlines (300 ms each) passed; past the whole-answer deadline, 504.
#[tokio::test(flavor = "multi_thread")]
async fn a_plain_passthrough_route_gives_non_streamed_answers_the_whole_answer_deadline() {
    let engine = FakeVllm::start(FakeConfig { delay: Duration::from_millis(900), ..FakeConfig::default() }).await;
    let keys = format!("stream_idle_timeout_ms = 300\n{}", split_deadlines(20_000));
    let proxy = TokenOnce::start(&passthrough(&engine.host_port(), "\"/v1/chat/completions\"", &keys)).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, text) = post_json(&url, &chat_body("hi", json!({"stream": false})), &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(proxy.metric(r#"tokenonce_timeouts_total{route="pt",stage="first_byte"}"#).await, 0.0);
    let (status, _, text) = post_json(&url, &chat_body("hi", json!({"stream": true})), &[]).await;
    assert_eq!(status, 504, "streamed: the first-byte deadline: {text}");

    let short = format!("stream_idle_timeout_ms = 300\n{}", split_deadlines(500));
    let bounded = TokenOnce::start(&passthrough(&engine.host_port(), "\"/v1/chat/completions\"", &short)).await;
    let url = format!("{}/v1/chat/completions", bounded.url);
    let (status, _, text) = post_json(&url, &chat_body("hi", json!({})), &[]).await;
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("\"code\":\"decode_timeout\""), "{text}");
}

/// Passthrough through pingora's pipeline (a path no API handler takes): an engine with no
/// head is a 504; one that stalls mid-body has its client connection cut. Both counted.
#[tokio::test(flavor = "multi_thread")]
async fn passthrough_pipeline_stalls_are_bounded() {
    let silent = StallingEngine::start("").await;
    let proxy = TokenOnce::start(&passthrough(&silent.addr, "\"/tokenize\"", FAST)).await;
    let started = Instant::now();
    let (status, _, text) = post_raw(&format!("{}/tokenize", proxy.url), "{\"prompt\":\"hi\"}", &[]).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("\"code\":\"decode_timeout\""), "{text}");
    proxy.assert_reaches(r#"tokenonce_timeouts_total{route="pt",stage="first_byte"}"#, 1.0).await;

    let stalling = StallingEngine::start(JSON_HEAD_THEN_STALL).await;
    let proxy = TokenOnce::start(&passthrough(&stalling.addr, "\"/tokenize\"", FAST)).await;
    let started = Instant::now();
    let resp = reqwest::Client::new().post(format!("{}/tokenize", proxy.url)).body("{}").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.bytes().await.is_err(), "the cut body must not read as complete");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    proxy.assert_reaches(r#"tokenonce_timeouts_total{route="pt",stage="stream_idle"}"#, 1.0).await;
    assert_eq!(proxy.metric(r#"tokenonce_upstream_errors_total{kind="timeout",stage="passthrough"}"#).await, 1.0);
}

/// Relay decodes (and decode-only header requests) were unbounded before their head: now
/// the route's first-byte timeout holds there too.
#[tokio::test(flavor = "multi_thread")]
async fn relay_decode_without_a_head_is_504() {
    let engine = FakeVllm::start(FakeConfig { delay: Duration::from_secs(10), ..FakeConfig::default() }).await;
    let config = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"relay\"\nmode = \"relay\"\ndecode_pool = \"decode\"\n{FAST}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        engine.host_port()
    );
    let proxy = TokenOnce::start(&config).await;
    chat_is_a_fast_decode_timeout(&proxy, "relay").await;
}

/// A header-named prefiller that never answers is bounded by the route's prefill timeout.
#[tokio::test(flavor = "multi_thread")]
async fn hung_header_prefiller_is_504() {
    let prefiller = StallingEngine::start("").await;
    let decode = FakeVllm::start(FakeConfig::default()).await;
    let config = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"hdr\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ header = \"x-prefiller-host-port\", allow = [\"127.0.0.0/8\"] }}\nprefill_timeout_ms = 300\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        decode.host_port()
    );
    let proxy = TokenOnce::start(&config).await;
    let started = Instant::now();
    let headers = [("x-prefiller-host-port", prefiller.addr.as_str())];
    let (status, _, text) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("hi", json!({})), &headers).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(status, 504, "{text}");
    assert!(text.contains("\"code\":\"prefill_timeout\""), "{text}");
    assert_eq!(prefiller.posts(), 1);
    assert!(decode.posts().is_empty());
    proxy.assert_reaches(r#"tokenonce_timeouts_total{route="hdr",stage="prefill"}"#, 1.0).await;
}

/// A client that stops reading a long stream: once tokenonce's writes wait past
/// `client_write_timeout_ms` the client connection is cut and the decode's stream closed
/// (the engine sees it cancelled), counted at `client_write`.
#[tokio::test(flavor = "multi_thread")]
async fn client_that_stops_reading_is_cut_and_the_decode_closed() {
    // The fake renders its whole answer before the head: give it time for that.
    let keys = "decode_first_byte_timeout_ms = 30000\nclient_write_timeout_ms = 300\n";
    let (_p, decode, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), keys).await;
    // ~200k events, ~50 MB: far more than the socket buffers between us hold.
    let body = chat_body("long answer", json!({"stream": true, "max_tokens": 200_000}));
    let mut client = SlowClient::post(&proxy.url, "/v1/chat/completions", &body).await;
    let first = client.first_bytes(Duration::from_secs(10)).await;
    assert!(first.starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&first));
    // The client reads nothing more.
    let series = r#"tokenonce_timeouts_total{route="pd",stage="client_write"}"#;
    let deadline = Instant::now() + Duration::from_secs(15);
    while proxy.metric(series).await < 1.0 {
        assert!(Instant::now() < deadline, "no client write timeout within 15 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while decode.cancelled() < 1 {
        assert!(Instant::now() < deadline, "the decode stream was not closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The connection is cut: reading on drains what was buffered, then ends (bounded).
    assert!(client.drained(Duration::from_secs(10)).await, "the client connection stayed open");
    let outcome = r#"tokenonce_requests_total{api="chat",mode="orchestrate",outcome="client_closed",route="pd"}"#;
    proxy.assert_reaches(outcome, 1.0).await;
}

/// A chat body that streams, sent by a client that gives up after 300 ms.
async fn post_and_leave(url: &str, body: &serde_json::Value) {
    let client = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    let sent = client.post(url).json(body).send().await;
    assert!(sent.is_err(), "the client was meant to give up first: {sent:?}");
}

/// Waits (bounded: 5 s) until `engine` has received `n` POSTs.
async fn posts_reach(engine: &FakeVllm, n: usize) -> Vec<support::fake_vllm::Recorded> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine.posts().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.posts()
}

/// A decode endpoint that takes no connection until [`Door::open`]: its accept queue (backlog
/// 0) is held full by a connection of its own, so a connect to it hangs (the kernel drops the
/// SYN; the client sends it again after 1 s). Opened, every connection, those that retried
/// meanwhile too, is piped to the engine. A decode leg sent to it while closed is provably
/// never delivered.
struct Door {
    addr: String,
    opener: Arc<tokio::sync::Notify>,
}

impl Door {
    async fn closed_before(engine: &FakeVllm) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let filler = TcpStream::connect(addr).await.unwrap();
        let opener = Arc::new(tokio::sync::Notify::new());
        let (target, wait) = (engine.host_port(), Arc::clone(&opener));
        tokio::spawn(async move {
            // Bounded: a test opens it within seconds, and is over well within a minute.
            let _ = tokio::time::timeout(Duration::from_secs(20), wait.notified()).await;
            drop(filler);
            let until = Instant::now() + Duration::from_secs(60);
            while let Ok(Ok((mut inbound, _))) =
                tokio::time::timeout(until.saturating_duration_since(Instant::now()), listener.accept()).await
            {
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self { addr: addr.to_string(), opener }
    }

    fn open(&self) {
        self.opener.notify_one();
    }
}

/// tokenonce between a prefill fake with a KV connector and `decode_addr`.
async fn pd_via(decode_addr: &str, route_extra: &str) -> (FakeVllm, TokenOnce) {
    let p = FakeVllm::start(FakeConfig { connector: true, ..FakeConfig::default() }).await;
    let config = format!(
        "[defaults]\npassthrough_pool = \"prefill\"\n\n[pools.prefill]\nendpoints = [\"{}\"]\n\n[pools.decode]\nendpoints = [\"{decode_addr}\"]\nvllm_version = \"0.32.0\"\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n{route_extra}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        p.host_port()
    );
    (p, TokenOnce::start(&config).await)
}

/// KV release: the client leaves after a prefill that returned `kv_transfer_params`, before the
/// decode leg reached the engine (its connect hangs): the decode never had the request, so
/// tokenonce sends it for one token, not streamed, with the prefill's kv params (the decode
/// pulls the KV blocks and the prefill frees them), reads and discards the answer, and counts
/// it as `released`.
#[tokio::test(flavor = "multi_thread")]
async fn client_gone_before_the_decode_got_its_request_releases_the_kv_blocks() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let door = Door::closed_before(&d).await;
    let (p, proxy) = pd_via(&door.addr, "").await;
    let body = chat_body(
        "leave early",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 9, "min_tokens": 2}),
    );
    post_and_leave(&format!("{}/v1/chat/completions", proxy.url), &body).await;
    door.open();
    let posts = posts_reach(&d, 1).await;
    assert_eq!(posts.len(), 1, "the release alone: the decode leg never got through");
    let release = posts[0].json();
    assert_eq!(release["max_tokens"], 1);
    assert_eq!(release["max_completion_tokens"], 1);
    assert_eq!(release["stream"], false);
    assert!(release.get("stream_options").is_none() && release.get("min_tokens").is_none(), "{release}");
    let prefill_kv = p.posts()[0].json();
    assert_eq!(prefill_kv["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(release["kv_transfer_params"]["remote_engine_id"], "fake-engine", "the prefill's handoff");
    assert!(release["kv_transfer_params"]["prompt_token_ids"].is_array(), "token-in, like the decode");
    assert_eq!(release["messages"], body["messages"]);
    let released = r#"tokenonce_kv_releases_total{result="released",route="pd"}"#;
    proxy.assert_reaches(released, 1.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(d.posts().len(), 1, "one release, no more");
}

/// With `on_client_gone = "abandon"` nothing is sent in the same case; counted as `abandoned`.
#[tokio::test(flavor = "multi_thread")]
async fn client_gone_with_abandon_sends_no_release() {
    let d = FakeVllm::start(FakeConfig::default()).await;
    let door = Door::closed_before(&d).await;
    let (_p, proxy) = pd_via(&door.addr, "on_client_gone = \"abandon\"\n").await;
    post_and_leave(&format!("{}/v1/chat/completions", proxy.url), &chat_body("leave", json!({"stream": true}))).await;
    door.open();
    let abandoned = r#"tokenonce_kv_releases_total{result="abandoned",route="pd"}"#;
    proxy.assert_reaches(abandoned, 1.0).await;
    // Past the door's opening: a release would have arrived by now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(d.posts().len(), 0, "nothing reached the decode");
    assert_eq!(proxy.metric(r#"tokenonce_kv_releases_total{result="released",route="pd"}"#).await, 0.0);
}

/// The client leaves after the decode got its request whole, before it answered (here it
/// takes 1 s): the decode owns the blocks (it pulls them, or frees them on the prefill when
/// aborted first), and a second decode with the same handoff would read them again after the
/// prefill freed them. No release, under either policy; counted as `left_to_decode`.
#[tokio::test(flavor = "multi_thread")]
async fn client_gone_after_the_decode_got_its_request_sends_no_release() {
    for policy in ["", "on_client_gone = \"abandon\"\n"] {
        let prefill = FakeConfig { connector: true, ..FakeConfig::default() };
        let decode = FakeConfig { delay: Duration::from_secs(1), ..FakeConfig::default() };
        let (_p, d, proxy) = pd_setup(prefill, decode, policy).await;
        post_and_leave(&format!("{}/v1/chat/completions", proxy.url), &chat_body("leave", json!({"stream": false})))
            .await;
        let left = r#"tokenonce_kv_releases_total{result="left_to_decode",route="pd"}"#;
        assert_eq!(proxy.metric_reaches(left, 1.0).await, 1.0, "{policy}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(d.posts().len(), 1, "the decode the client left, nothing after it ({policy})");
        for result in ["released", "abandoned"] {
            let series = format!("tokenonce_kv_releases_total{{result=\"{result}\",route=\"pd\"}}");
            assert_eq!(proxy.metric(&series).await, 0.0, "{policy} {result}");
        }
    }
}

/// A decode that already streams has pulled the KV blocks: a client leaving then gets no
/// release. A prefill without `kv_transfer_params` (no KV connector) holds nothing either.
#[tokio::test(flavor = "multi_thread")]
async fn no_release_once_the_decode_streams_or_without_kv_params() {
    let prefill = FakeConfig { connector: true, ..FakeConfig::default() };
    let decode = FakeConfig { chunk_delay: Duration::from_secs(2), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(prefill, decode, "").await;
    let mut resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .json(&chat_body("stream then leave", json!({"stream": true})))
        .send()
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), resp.chunk()).await.unwrap().unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    drop(resp);
    let closed = r#"tokenonce_requests_total{api="chat",mode="orchestrate",outcome="client_closed",route="pd"}"#;
    proxy.assert_reaches(closed, 1.0).await;
    assert_eq!(d.posts().len(), 1);
    for result in ["released", "failed", "timeout", "abandoned"] {
        let series = format!("tokenonce_kv_releases_total{{result=\"{result}\",route=\"pd\"}}");
        assert_eq!(proxy.metric(&series).await, 0.0, "{result}");
    }

    let decode = FakeConfig { delay: Duration::from_secs(1), ..FakeConfig::default() };
    let (_p, d, proxy) = pd_setup(FakeConfig::default(), decode, "").await;
    post_and_leave(&format!("{}/v1/chat/completions", proxy.url), &chat_body("no kv", json!({"stream": true}))).await;
    proxy.assert_reaches(closed, 1.0).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(d.posts().len(), 1, "kv_transfer_params null: nothing to release");
}

/// A release leg that does not finish within `release_timeout_ms` is given up and counted.
#[tokio::test(flavor = "multi_thread")]
async fn release_that_hangs_is_bounded() {
    let d = FakeVllm::start(FakeConfig { delay: Duration::from_secs(10), ..FakeConfig::default() }).await;
    let door = Door::closed_before(&d).await;
    let (_p, proxy) = pd_via(&door.addr, "release_timeout_ms = 1500\n").await;
    let started = Instant::now();
    post_and_leave(&format!("{}/v1/chat/completions", proxy.url), &chat_body("hang", json!({"stream": true}))).await;
    door.open();
    let timed_out = r#"tokenonce_kv_releases_total{result="timeout",route="pd"}"#;
    proxy.assert_reaches(timed_out, 1.0).await;
    assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
    assert_eq!(proxy.metric(r#"tokenonce_timeouts_total{route="pd",stage="release"}"#).await, 1.0);
    assert_eq!(posts_reach(&d, 1).await.len(), 1, "the release reached the decode, which held it");
}

/// Bounded memory: a passthrough route honours `max_body_bytes` on pingora's pipeline: a declared
/// `Content-Length` over it is refused before any engine is asked, a chunked body that grows
/// past it is cut off; both 413 `body_too_large`, OpenAI-shaped.
#[tokio::test(flavor = "multi_thread")]
async fn passthrough_route_honours_max_body_bytes() {
    let engine = FakeVllm::start(FakeConfig::default()).await;
    let proxy = TokenOnce::start(&passthrough(&engine.host_port(), "\"/tokenize\"", "max_body_bytes = 1000\n")).await;
    let url = format!("{}/tokenize", proxy.url);
    let (status, _, text) = post_raw(&url, "{\"prompt\":\"small\"}", &[]).await;
    assert_eq!(status, 200, "{text}");
    let (status, _, text) = post_raw(&url, "x".repeat(5000), &[]).await;
    assert_eq!(status, 413, "{text}");
    let error: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "body_too_large");
    assert_eq!(engine.posts().len(), 1, "a declared length over the limit never reaches the engine");

    // Chunked: no length up front; 10 pieces of 400 bytes pass the limit at the third.
    let pieces: Vec<Result<Vec<u8>, std::io::Error>> = (0..10).map(|_| Ok(vec![b'y'; 400])).collect();
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(pieces));
    let resp = reqwest::Client::new().post(&url).body(body).send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("\"code\":\"body_too_large\""), "{text}");
}

/// Bounded memory: the SSE decoder's buffer is capped: an event longer than `max_sse_event_bytes`
/// (here the first chat event, which echoes ~100 KB of prompt ids) is never sent; the stream
/// ends with the error event `stream_event_too_large` and `[DONE]`, counted as `too_large`.
#[tokio::test(flavor = "multi_thread")]
async fn over_long_sse_event_ends_the_stream_with_an_error_event() {
    let (_p, _d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "max_sse_event_bytes = 65536\n").await;
    let words: Vec<String> = (0..15_000).map(|i| format!("w{i}")).collect();
    let body = chat_body(&words.join(" "), json!({"stream": true, "return_token_ids": true}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
    assert_eq!(status, 200);
    let data = sse_data(&text);
    assert_eq!(data.len(), 2, "only the error event and [DONE]: {}", &text[..text.len().min(300)]);
    let error: serde_json::Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(error["error"]["code"], "stream_event_too_large", "{text}");
    assert_eq!(data[1], "[DONE]");
    let series = r#"tokenonce_upstream_errors_total{kind="too_large",stage="decode"}"#;
    proxy.assert_reaches(series, 1.0).await;
}

/// Black-holed endpoints (they accept and never answer) in a pool: one health round polls
/// every endpoint at once, so each hung poll has its connection before the first one gives
/// up at its 1 s probe timeout, and k of them delay a round by one timeout, not k. Asserted
/// on the order of what the endpoints saw, not on a clock.
#[tokio::test(flavor = "multi_thread")]
async fn health_polls_of_hung_endpoints_run_at_once() {
    const HOLES: usize = 4;
    // What the black holes saw, in order: (which, true: a connection came, false: it closed).
    let seen: Arc<parking_lot::Mutex<Vec<(usize, bool)>>> = Arc::default();
    let mut addrs = Vec::new();
    for i in 0..HOLES {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap().to_string());
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            for _ in 0..64 {
                let Ok((mut sock, _)) = listener.accept().await else { return };
                seen.lock().push((i, true));
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let hold = tokio::time::timeout(Duration::from_secs(20), async {
                        while sock.read(&mut buf).await.is_ok_and(|n| n > 0) {}
                    });
                    let _ = hold.await;
                    seen.lock().push((i, false));
                });
            }
        });
    }
    let d = FakeVllm::start(FakeConfig::default()).await;
    let endpoints: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
    let config = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[pools.holes]\nendpoints = [{}]\n\n[[routes]]\nname = \"holes\"\nmode = \"passthrough\"\ndecode_pool = \"holes\"\n[routes.match]\npaths = [\"/v1/chat/completions\"]\nheaders = {{ \"x-tenant\" = \"holes\" }}\n",
        d.host_port(),
        endpoints.join(", ")
    );
    let _proxy = TokenOnce::start(&config).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.lock().iter().filter(|(_, came)| !came).count() < HOLES {
        assert!(Instant::now() < deadline, "the polls never gave up: {:?}", seen.lock());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.lock().clone();
    let first_round: Vec<(usize, bool)> = seen.iter().copied().take(HOLES).collect();
    let mut came: Vec<usize> = first_round.iter().filter(|(_, c)| *c).map(|(i, _)| *i).collect();
    came.sort_unstable();
    assert_eq!(
        came,
        (0..HOLES).collect::<Vec<_>>(),
        "every hung endpoint was polled before any poll gave up: {seen:?}"
    );
}
