//! Safe retries against a fault-injecting raw engine: the keep-alive race (the engine closes
//! a pooled connection without reading the request) is re-sent once; a connection closed
//! after the request was read is not (the engine saw it once); the per-route retry budget
//! refuses retries past its bound and counts them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// What the raw engine does with the second request on a connection.
#[derive(Clone, Copy)]
enum Second {
    /// Close with a reset as soon as it arrives, reading none of it (the keep-alive race).
    ResetUnread,
    /// Read it whole, then close without answering.
    CloseAfterRead,
}

/// A raw HTTP/1.1 engine on loopback: answers the first request on each connection with
/// `{"ok":true}` and treats the second as `second` says; counts the requests it read whole,
/// by the value of their `x-request-id`.
struct RawEngine {
    addr: String,
    read_whole: Arc<parking_lot::Mutex<Vec<String>>>,
}

impl RawEngine {
    async fn start(second: Second) -> Self {
        let read_whole = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let seen = Arc::clone(&read_whole);
        let addr = raw_engine(50, move |sock| serve(sock, second, Arc::clone(&seen))).await;
        Self { addr, read_whole }
    }

    /// How many times a request with this `x-request-id` was read whole.
    fn seen(&self, request_id: &str) -> usize {
        self.read_whole.lock().iter().filter(|id| *id == request_id).count()
    }
}

async fn serve(mut sock: TcpStream, second: Second, seen: Arc<parking_lot::Mutex<Vec<String>>>) {
    let Some((method, id)) = fault_engine::read_request(&mut sock).await.map(|r| {
        let id = fault_engine::header(&r.head, "x-request-id").unwrap_or_default().to_owned();
        (r.method, id)
    }) else {
        return;
    };
    let body = "{\"ok\":true}";
    if method != "POST" {
        // Probes (`/health`, `/version`) on connections of their own, never pooled.
        let _ = sock.write_all(fault_engine::json_answer(body, true).as_bytes()).await;
        return;
    }
    seen.lock().push(id);
    let resp = fault_engine::json_answer(body, false);
    if sock.write_all(resp.as_bytes()).await.is_err() {
        return;
    }
    match second {
        Second::ResetUnread => {
            // Wait for the next request's first bytes (bounded), then reset, reading nothing.
            let _ = tokio::time::timeout(Duration::from_secs(10), sock.readable()).await;
            // A zero linger resets at once (it never blocks, the reason for the deprecation).
            #[allow(deprecated)]
            sock.set_linger(Some(Duration::ZERO)).unwrap();
        }
        Second::CloseAfterRead => {
            if let Some(r) = fault_engine::read_request(&mut sock).await {
                seen.lock().push(fault_engine::header(&r.head, "x-request-id").unwrap_or_default().to_owned());
            }
        }
    }
}

/// One health round at start, then none: the test's requests alone use the pool.
fn quiet() -> Settings {
    Settings { health_interval_ms: 60_000, ..Settings::default() }
}

/// A passthrough route for chat to `addr`, big bodies allowed, with `extra` route keys. It
/// matches on the body's model, so tokenonce reads the body and sends the leg itself.
fn config(addr: &str, extra: &str) -> String {
    format!(
        "[pools.decode]\nendpoints = [\"{addr}\"]\n\n[[routes]]\nname = \"pt\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\nmax_body_bytes = 67108864\n{extra}\n[routes.match]\npaths = [\"/v1/chat/completions\"]\nmodel = \"*\"\n"
    )
}

/// The keep-alive race: the engine resets a pooled connection as the next request arrives,
/// having read none of it; the request (20 MB, so the reset lands while it is being
/// written) is re-sent once on a fresh connection, and the engine reads it exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn keep_alive_race_is_retried_once() {
    let engine = RawEngine::start(Second::ResetUnread).await;
    let proxy = TokenOnce::start_with(&config(&engine.addr, ""), &quiet()).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    // 20 MB: more than a loopback connection holds in flight when the peer reads nothing (our
    // send buffer, at most net.ipv4.tcp_wmem's 4 MB, plus its untuned receive buffer), so the
    // reset always meets a write. Built first: on a loaded machine building it took longer
    // than the pool's 4 s idle limit, and the pooled connection was gone before it was sent.
    let big = chat_body(&"x".repeat(20 << 20), json!({}));
    let (status, _, text) = post_json(&url, &chat_body("small", json!({})), &[("x-request-id", "first")]).await;
    assert_eq!((status, text.as_str()), (200, "{\"ok\":true}"));
    let (status, _, text) = post_json(&url, &big, &[("x-request-id", "big")]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text, "{\"ok\":true}");
    assert_eq!(engine.seen("big"), 1);
    assert_eq!(proxy.metric(r#"tokenonce_upstream_retries_total{stage="passthrough"}"#).await, 1.0);
}

/// A pooled connection the engine closes after reading the whole request (before answering)
/// is not re-sent: the engine may have started it. The client gets 502, and the engine saw
/// the request exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn close_after_the_request_was_read_is_not_retried() {
    let engine = RawEngine::start(Second::CloseAfterRead).await;
    let proxy = TokenOnce::start_with(&config(&engine.addr, ""), &quiet()).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, _) = post_json(&url, &chat_body("one", json!({})), &[("x-request-id", "one")]).await;
    assert_eq!(status, 200);
    let (status, _, text) = post_json(&url, &chat_body("two", json!({})), &[("x-request-id", "two")]).await;
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("decode_unavailable"), "{text}");
    assert_eq!(engine.seen("two"), 1, "the engine got the request once");
    assert_eq!(proxy.metric(r#"tokenonce_upstream_retries_total{stage="passthrough"}"#).await, 0.0);
}

/// A retry budget of 50 % with no per-second floor: every second leg earns one retry.
const HALF_NO_FLOOR: &str = "retry_budget_percent = 50\nretry_budget_min_per_second = 0\n";

/// The budget: at 50 % and no per-second floor, every second leg earns one retry. Four
/// requests to an engine that refuses connections: two retries, two refusals, counted.
#[tokio::test(flavor = "multi_thread")]
async fn retry_budget_refuses_retries_past_its_bound() {
    let refused = RefusedAddr::new();
    let proxy = TokenOnce::start(&config(&refused.addr.to_string(), HALF_NO_FLOOR)).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    for i in 0..4 {
        let (status, _, text) = post_json(&url, &chat_body(&format!("r{i}"), json!({})), &[]).await;
        assert_eq!(status, 502, "{text}");
    }
    assert_eq!(proxy.metric(r#"tokenonce_upstream_retries_total{stage="passthrough"}"#).await, 2.0);
    assert_eq!(proxy.metric(r#"tokenonce_retry_budget_exhausted_total{route="pt"}"#).await, 2.0);
    assert_eq!(proxy.metric(r#"tokenonce_retry_budget_exhausted_total{route="default"}"#).await, 0.0);
}

/// The budget is the route's state: a reload of the unchanged file keeps it. At 50 % and no
/// floor, the refused first leg left half a retry; after the reload the second leg's half
/// makes a whole one, so it is re-sent (a budget started again would refuse it too).
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_keeps_the_retry_budget() {
    let refused = RefusedAddr::new();
    let text = config(&refused.addr.to_string(), HALF_NO_FLOOR);
    let proxy = TokenOnce::start(&text).await;
    let url = format!("{}/v1/chat/completions", proxy.url);
    let (status, _, body) = post_json(&url, &chat_body("r0", json!({})), &[]).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(proxy.metric(r#"tokenonce_retry_budget_exhausted_total{route="pt"}"#).await, 1.0);
    proxy.reload(&text).await;
    let (status, _, body) = post_json(&url, &chat_body("r1", json!({})), &[]).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(proxy.metric(r#"tokenonce_upstream_retries_total{stage="passthrough"}"#).await, 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_retry_budget_exhausted_total{route="pt"}"#).await, 1.0);
}
