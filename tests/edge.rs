//! The client edge under hostile HTTP: oversized heads, ambiguous framing (RFC 9112), bodies
//! that are not UTF-8 or nest too deep. Each is refused before any leg reaches an engine,
//! and one client request never becomes two upstream.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};
use support::{chat_body, pd_setup, post_raw, FakeConfig};

/// Writes `request` on a fresh connection and reads until the server closes it or 5 s pass.
fn raw_exchange(url: &str, request: &[u8]) -> String {
    let addr = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    for _ in 0..1000 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// [`raw_exchange`] off the test's runtime (its reads block).
async fn exchange(url: &str, request: impl Into<Vec<u8>>) -> String {
    let (url, request) = (url.to_owned(), request.into());
    tokio::task::spawn_blocking(move || raw_exchange(&url, &request)).await.unwrap()
}

fn status_of(response: &str) -> u16 {
    response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Too many header fields, or too many header bytes: 431 before any leg.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_heads_are_431() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let body = serde_json::to_vec(&chat_body("x", json!({}))).unwrap();
    let many: Vec<(String, String)> = (0..150).map(|i| (format!("x-h{i}"), "v".to_owned())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let big = "b".repeat(70 * 1024);
    for headers in [many, vec![("x-big", big.as_str())]] {
        let (status, _, text) = post_raw(&url, body.clone(), &headers).await;
        assert_eq!(status, 431, "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "headers_too_large");
    }
    let (status, _, _) = post_raw(&format!("{}/v1/models", proxy.url), Vec::new(), &[("x-big", &big)]).await;
    assert_eq!(status, 431, "passthrough requests too");
    // The health poller asks `/v1/models` itself; no client's request (with `x-big`) got there.
    assert!(p.posts().is_empty() && d.requests().iter().all(|r| !r.headers.contains_key("x-big")));
}

/// Content-Length next to chunked Transfer-Encoding: the chunked framing wins (RFC 9112
/// §6.3), the connection is closed after the answer, and bytes hidden behind the body never
/// become a second request upstream.
#[tokio::test(flavor = "multi_thread")]
async fn content_length_with_chunked_cannot_smuggle_a_request() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let body = serde_json::to_string(&chat_body("smuggle", json!({}))).unwrap();
    let smuggled = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n{smuggled}",
        body.len()
    );
    let response = exchange(&proxy.url, request).await;
    assert_eq!(status_of(&response), 200, "{response}");
    assert_eq!(response.matches("HTTP/1.1 ").count(), 1, "one answer, then the connection closes: {response}");
    assert_eq!(p.posts().len(), 1);
    assert_eq!(d.posts().len(), 1);
    assert!(d.posts().iter().chain(&p.posts()).all(|r| r.path == "/v1/chat/completions"));
}

/// A body that comes in several chunked pieces is put back together whole: both legs get the
/// client's messages byte for byte (the first piece alone is kept without a copy; a second one
/// starts the buffer).
#[tokio::test(flavor = "multi_thread")]
async fn a_body_in_several_pieces_reaches_both_legs_whole() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let body = serde_json::to_string(&chat_body(&"alpha bravo ".repeat(200), json!({}))).unwrap();
    let (a, rest) = body.split_at(7);
    let (b, c) = rest.split_at(rest.len() / 2);
    let chunks: String = [a, b, c].iter().map(|piece| format!("{:x}\r\n{piece}\r\n", piece.len())).collect();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunks}0\r\n\r\n"
    );
    let response = exchange(&proxy.url, request).await;
    assert_eq!(status_of(&response), 200, "{response}");
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    for leg in [p.posts(), d.posts()] {
        assert_eq!(leg.len(), 1);
        assert!(leg[0].text().contains(&serde_json::to_string(&sent["messages"]).unwrap()), "{}", leg[0].text());
    }
}

/// Two different Content-Length values: refused, nothing sent upstream.
#[tokio::test(flavor = "multi_thread")]
async fn conflicting_content_lengths_are_refused() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let request =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}".to_vec();
    let response = exchange(&proxy.url, request).await;
    let status = status_of(&response);
    assert!(status == 400 || (status == 0 && response.is_empty()), "refused or closed: {response}");
    assert!(p.posts().is_empty() && d.posts().is_empty());
}

/// Bodies tokenonce cannot read as one JSON object: non-UTF-8, or nested past serde_json's
/// recursion limit. A clear 400 and no leg.
#[tokio::test(flavor = "multi_thread")]
async fn non_utf8_and_over_deep_bodies_are_400_before_any_leg() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let mut latin1 = br#"{"model":"tiny-qwen3","messages":[{"role":"user","content":"caf"#.to_vec();
    latin1.extend_from_slice(b"\xe9\"}]}");
    let deep = format!(
        r#"{{"model":"tiny-qwen3","messages":[{{"role":"user","content":{}1{}}}]}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let deep_view =
        format!(r#"{{"model":"tiny-qwen3","messages":[{}"x"{}]}}"#, r#"{"content":["#.repeat(100), "]}".repeat(100));
    for body in [latin1, deep.into_bytes(), deep_view.into_bytes()] {
        let (status, _, text) = post_raw(&url, body, &[]).await;
        assert_eq!(status, 400, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "invalid_request", "{text}");
    }
    assert!(p.posts().is_empty() && d.posts().is_empty());
}

/// A body that stalls half-way (a slowloris client) is cut at `server.body_read_timeout_ms`
/// with a 408, and nothing reaches an engine.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_body_is_408_at_the_deadline() {
    let (p, d) =
        (support::FakeVllm::start(FakeConfig::default()).await, support::FakeVllm::start(FakeConfig::default()).await);
    let settings = support::Settings { server_extra: "body_read_timeout_ms = 300\n".into(), ..Default::default() };
    let proxy = support::TokenOnce::start_with(&support::pd_config(&p, &d, ""), &settings).await;
    let started = std::time::Instant::now();
    // 100 bytes announced, 10 sent, then silence (the connection stays open).
    let response = exchange(
        &proxy.url,
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\":"[..],
    )
    .await;
    assert_eq!(status_of(&response), 408, "{response}");
    assert!(response.contains("request_timeout"), "{response}");
    assert!(started.elapsed() < Duration::from_secs(4), "cut at the deadline, not by the client");
    assert!(p.posts().is_empty() && d.posts().is_empty());
}

/// Reads one answer (head, then a body framed by its length or chunked) from `s`, skipping
/// nothing: an interim `100` head is returned as it is. `None` if it does not come in 5 s.
fn read_answer(s: &mut TcpStream, pending: &mut Vec<u8>) -> Option<String> {
    let mut buf = [0u8; 8192];
    let complete = |raw: &[u8]| -> Option<usize> {
        let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
        if head.starts_with("http/1.1 1") {
            return Some(head_end);
        }
        let length =
            head.lines().find_map(|l| l.strip_prefix("content-length:")).map(|v| v.trim().parse::<usize>().unwrap());
        match length {
            Some(n) => (raw.len() >= head_end + n).then_some(head_end + n),
            None => raw[head_end..].windows(5).position(|w| w == b"0\r\n\r\n").map(|p| head_end + p + 5),
        }
    };
    for _ in 0..1000 {
        if let Some(end) = complete(pending) {
            let answer = String::from_utf8_lossy(&pending[..end]).into_owned();
            pending.drain(..end);
            return Some(answer);
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    }
    None
}

/// `Expect: 100-continue`: tokenonce answers `100 Continue` before the body is sent, on
/// every mode (it reads the body itself, or pingora streams it to the engine), then the
/// request is served and the connection stays open for the next one.
#[tokio::test(flavor = "multi_thread")]
async fn expect_100_continue_is_answered_on_every_mode() {
    let (p, d, _) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let orchestrate = support::pd_config(&p, &d, "");
    let relay = orchestrate.replace("mode = \"orchestrate\"", "mode = \"relay\"");
    let forward = orchestrate
        .replace("mode = \"orchestrate\"", "mode = \"passthrough\"")
        .replace("prefill = { pool = \"prefill\" }\n", "");
    let passthrough = format!("{forward}model = \"*\"\n");
    let body = serde_json::to_string(&chat_body("expect", json!({}))).unwrap();
    for (mode, config) in
        [("orchestrate", orchestrate), ("relay", relay), ("passthrough", passthrough), ("forward", forward)]
    {
        let proxy = support::TokenOnce::start(&config).await;
        let addr = proxy.url.trim_start_matches("http://").to_owned();
        let body = body.clone();
        let answers = tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let head = |expect: &str| {
                format!("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{expect}Content-Length: {}\r\n\r\n", body.len())
            };
            s.write_all(head("Expect: 100-continue\r\n").as_bytes()).unwrap();
            let mut pending = Vec::new();
            // Bounded wait for the interim answer; only then the body (as curl does).
            let interim = read_answer(&mut s, &mut pending);
            s.write_all(body.as_bytes()).unwrap();
            let first = read_answer(&mut s, &mut pending);
            s.write_all(format!("{}{body}", head("")).as_bytes()).unwrap();
            (interim, first, read_answer(&mut s, &mut pending))
        })
        .await
        .unwrap();
        let (interim, first, second) = answers;
        assert!(
            interim.as_deref().is_some_and(|h| h.starts_with("HTTP/1.1 100")),
            "{mode}: no 100 Continue: {interim:?}"
        );
        assert!(first.as_deref().is_some_and(|h| h.starts_with("HTTP/1.1 200")), "{mode}: {first:?}");
        assert!(second.as_deref().is_some_and(|h| h.starts_with("HTTP/1.1 200")), "{mode}: kept alive: {second:?}");
    }
    assert!(d.posts().iter().all(|r| r.header("expect").is_none()), "the engine never sees the Expect");
}

/// A raw engine on loopback that counts the POSTs it reads and holds each one's answer (a
/// small JSON completion) until `release` is sent; `GET`s (health) are answered at once.
struct GatedEngine {
    addr: String,
    posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: tokio::sync::watch::Sender<bool>,
}

impl GatedEngine {
    async fn start() -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let posts = std::sync::Arc::new(AtomicUsize::new(0));
        let (release, gate) = tokio::sync::watch::channel(false);
        let seen = std::sync::Arc::clone(&posts);
        tokio::spawn(async move {
            for _ in 0..500 {
                let Ok((mut sock, _)) = listener.accept().await else { return };
                let (seen, mut gate) = (std::sync::Arc::clone(&seen), gate.clone());
                tokio::spawn(async move {
                    let Some(req) = support::fault_engine::read_request(&mut sock).await else { return };
                    let body = if req.method == "POST" {
                        seen.fetch_add(1, Ordering::SeqCst);
                        let _ = tokio::time::timeout(Duration::from_secs(20), gate.wait_for(|open| *open)).await;
                        r#"{"id":"x","object":"chat.completion","choices":[]}"#
                    } else {
                        "{}"
                    };
                    let _ = sock.write_all(support::fault_engine::json_answer(body, true).as_bytes()).await;
                });
            }
        });
        Self { addr, posts, release }
    }

    fn posts(&self) -> usize {
        self.posts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// With `server.max_in_flight = 2` and two requests held by the engine, a third is refused
/// at once with 503 `overloaded` and `Retry-After`, reaching no engine, and counted; the
/// admin listener still answers; once the two are answered a new request is served.
#[tokio::test(flavor = "multi_thread")]
async fn requests_past_max_in_flight_are_503_before_any_leg() {
    let engine = GatedEngine::start().await;
    let config = format!(
        "[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"pt\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n",
        engine.addr
    );
    let settings = support::Settings { server_extra: "max_in_flight = 2\n".into(), ..Default::default() };
    let proxy = support::TokenOnce::start_with(&config, &settings).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let body = serde_json::to_vec(&chat_body("hi", json!({}))).unwrap();
    let held: Vec<_> = (0..2).map(|_| tokio::spawn(post_raw_owned(url.clone(), body.clone()))).collect();
    for _ in 0..200 {
        if engine.posts() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(engine.posts(), 2, "both held requests reached the engine");

    let (status, headers, text) = post_raw(&url, body.clone(), &[]).await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "overloaded", "{text}");
    assert!(error["error"]["message"].is_string() && error["error"].as_object().unwrap().contains_key("param"));
    assert_eq!(proxy.metric(r#"tokenonce_admission_rejected_total{listener="plain"}"#).await, 1.0);
    assert_eq!(proxy.metric("tokenonce_inflight_requests").await, 2.0);
    assert_eq!(proxy.metric("tokenonce_admission_max_in_flight").await, 2.0);
    assert_eq!(engine.posts(), 2, "the refused request reached no engine");

    engine.release.send(true).unwrap();
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    let (status, _, text) = post_raw(&url, body, &[]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(engine.posts(), 3);
    assert_eq!(proxy.metric(r#"tokenonce_admission_rejected_total{listener="plain"}"#).await, 1.0);
}

/// [`post_raw`] on owned arguments (for `tokio::spawn`), returning the status.
async fn post_raw_owned(url: String, body: Vec<u8>) -> u16 {
    post_raw(&url, body, &[]).await.0
}
