//! OpenTelemetry traces: the tokenonce binary with `[tracing]` exports over OTLP/HTTP to a
//! receiver in this test that decodes the requests with the published protobuf definitions
//! (`opentelemetry-proto`, prost). Checked: the client's trace is continued, the spans' parentage
//! (request → prefill, handoff, decode → decode first byte), their attributes, that each engine
//! got its own leg's `traceparent` in the same trace, and the error code of a failed request.
//! Without `[tracing]` a client's `traceparent` reaches the engines untouched.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode, Span};
use prost::Message;
use serde_json::{json, Value};
use support::*;

/// Spans received, with the `service.name` of their resource.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

/// An OTLP/HTTP receiver on 127.0.0.1 (`POST /v1/traces`, protobuf).
async fn receiver() -> (String, Received) {
    let received = Received::default();
    let store = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let store = store.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("a valid OTLP ExportTraceServiceRequest");
                for resource in request.resource_spans {
                    let service = resource
                        .resource
                        .as_ref()
                        .and_then(|r| attr(&r.attributes, "service.name"))
                        .unwrap_or_default();
                    for scope in resource.scope_spans {
                        for span in scope.spans {
                            store.0.lock().push((service.clone(), span));
                        }
                    }
                }
                let answer = ExportTraceServiceResponse::default().encode_to_vec();
                ([("content-type", "application/x-protobuf")], answer)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, received)
}

/// A string (or integer, as text) attribute.
fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    let value = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()?;
    match value {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        AnyValue::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `tokenonce_trace_spans_total{result}` once it is at least `least` (waiting at most 15 s:
/// batches leave every second).
async fn spans_counted(proxy: &TokenOnce, result: &str, least: f64) -> f64 {
    let series = format!(r#"tokenonce_trace_spans_total{{result="{result}"}}"#);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = proxy.metric(&series).await;
        if got >= least || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Received {
    /// Waits (bounded: 15 s) until a span named `name` of trace `trace` arrived; all of that trace.
    async fn trace_with(&self, trace: &str, name: &str) -> Vec<(String, Span)> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let spans: Vec<(String, Span)> =
                self.0.lock().iter().filter(|(_, s)| hex(&s.trace_id) == trace).cloned().collect();
            if spans.iter().any(|(_, s)| s.name == name) {
                return spans;
            }
            assert!(Instant::now() < deadline, "no `{name}` span of trace {trace} within 15 s; got {spans:#?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn named<'a>(spans: &'a [(String, Span)], name: &str) -> &'a Span {
    &spans.iter().find(|(_, s)| s.name == name).unwrap_or_else(|| panic!("no span {name}: {spans:#?}")).1
}

/// The `(trace id, parent span id)` of a `traceparent` header.
fn traceparent_ids(header: &str) -> (String, String) {
    let parts: Vec<&str> = header.split('-').collect();
    assert_eq!(parts.len(), 4, "{header}");
    (parts[1].to_owned(), parts[2].to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn spans_continue_the_client_trace_across_both_legs() {
    let (url, received) = receiver().await;
    let [p, d] = fakes(Default::default()).await;
    let config = format!(
        "{}\n[tracing]\nendpoint = \"{url}\"\nprotocol = \"http\"\nsampling_ratio = 1.0\nservice_name = \"tokenonce-test\"\n",
        pd_config(&p, &d, "")
    );
    let proxy = TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &config).await;
    let (trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let traceparent = format!("00-{trace}-{client_span}-01");
    let headers = [("traceparent", traceparent.as_str()), ("tracestate", "vendor=kept")];
    let body = chat_body("traced", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &headers).await;
    assert_eq!(status, 200, "{text}");

    let spans = received.trace_with(trace, "POST /v1/chat/completions").await;
    let spans = if spans.len() < 5 { received.trace_with(trace, "decode").await } else { spans };
    let request = named(&spans, "POST /v1/chat/completions");
    assert_eq!(hex(&request.parent_span_id), client_span, "the client's span is the parent");
    // What the collector took is counted.
    assert!(spans_counted(&proxy, "exported", spans.len() as f64).await >= spans.len() as f64);
    assert_eq!(proxy.metric(r#"tokenonce_trace_spans_total{result="failed"}"#).await, 0.0);
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert!(spans.iter().all(|(service, _)| service == "tokenonce-test"));
    let (prefill, handoff, decode) = (named(&spans, "prefill"), named(&spans, "handoff"), named(&spans, "decode"));
    let first_byte = named(&spans, "decode first byte");
    for child in [prefill, handoff, decode] {
        assert_eq!(child.parent_span_id, request.span_id, "{} is a child of the request", child.name);
    }
    assert_eq!(first_byte.parent_span_id, decode.span_id);
    assert_eq!((prefill.kind, decode.kind), (SpanKind::Client as i32, SpanKind::Client as i32));
    assert_eq!(attr(&prefill.attributes, "tokenonce.failed_over"), None, "nothing failed over");
    assert!(prefill.end_time_unix_nano <= handoff.start_time_unix_nano, "handoff after the prefill");
    assert!(handoff.end_time_unix_nano <= decode.start_time_unix_nano, "decode after the handoff");
    assert!(first_byte.end_time_unix_nano <= decode.end_time_unix_nano);
    assert!(decode.end_time_unix_nano <= request.end_time_unix_nano);

    let a = |key: &str| attr(&request.attributes, key);
    assert_eq!(a("tokenonce.route").as_deref(), Some("pd"));
    assert_eq!(a("tokenonce.api").as_deref(), Some("chat"));
    assert_eq!(a("tokenonce.mode").as_deref(), Some("orchestrate"));
    assert_eq!(a("tokenonce.reuse.result").as_deref(), Some("applied"));
    assert_eq!(a("tokenonce.reuse.reason").as_deref(), Some("none"));
    // The prefill decision, which and why (the default threshold, but no local ids to send
    // the decode token-in).
    assert_eq!(a("tokenonce.prefill.decision").as_deref(), Some("prefill"));
    assert_eq!(a("tokenonce.prefill.reason").as_deref(), Some("no_local_ids"));
    assert_eq!(a("http.response.status_code").as_deref(), Some("200"));
    let prompt_ids = d.posts()[0].json()["kv_transfer_params"]["prompt_token_ids"].as_array().unwrap().len();
    assert_eq!(a("tokenonce.reused_prompt_tokens"), Some(prompt_ids.to_string()));
    assert_eq!(a("gen_ai.usage.input_tokens"), Some(prompt_ids.to_string()), "from the decode's usage");
    assert_eq!(a("gen_ai.usage.output_tokens").as_deref(), Some("5"), "max_tokens of chat_body");
    assert_eq!(a("error.type"), None);

    // Each engine got its own leg's span as parent, in the client's trace.
    let seen = |fake: &FakeVllm| traceparent_ids(&fake.posts()[0].header("traceparent").expect("a traceparent"));
    assert_eq!(seen(&p), (trace.to_owned(), hex(&prefill.span_id)));
    assert_eq!(seen(&d), (trace.to_owned(), hex(&decode.span_id)));
    assert_eq!(p.posts()[0].header("tracestate").as_deref(), Some("vendor=kept"));

    // A refused request: the error code the client got is on its span.
    let traceparent = format!("00-{}-{client_span}-01", "5bf92f3577b34da6a3ce929d0e0e4736");
    let (status, _, text) =
        post_raw(&format!("{}/v1/chat/completions", proxy.url), "{not json", &[("traceparent", traceparent.as_str())])
            .await;
    assert_eq!(status, 400);
    let code = serde_json::from_str::<Value>(&text).unwrap()["error"]["code"].as_str().unwrap().to_owned();
    let spans = received.trace_with("5bf92f3577b34da6a3ce929d0e0e4736", "POST /v1/chat/completions").await;
    let failed = named(&spans, "POST /v1/chat/completions");
    assert_eq!(attr(&failed.attributes, "error.type"), Some(code));
    assert_eq!(failed.status.as_ref().map(|s| s.code), Some(StatusCode::Error as i32));
    assert_eq!(attr(&failed.attributes, "http.response.status_code").as_deref(), Some("400"));
}

/// A request without `traceparent` starts a trace here (sampling ratio 1.0), and the engines
/// join it.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_context_starts_a_trace() {
    let (url, received) = receiver().await;
    let [p, d] = fakes(Default::default()).await;
    let config = format!("{}\n[tracing]\nendpoint = \"{url}\"\n", pd_config(&p, &d, ""));
    let proxy = TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &config).await;
    let (status, _, _) = post_json(
        &format!("{}/v1/completions", proxy.url),
        &json!({"model": "tiny-qwen3", "prompt": "hi", "max_tokens": 3}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let (trace, parent) = traceparent_ids(&d.posts()[0].header("traceparent").unwrap());
    let spans = received.trace_with(&trace, "decode").await;
    let request = named(&spans, "POST /v1/completions");
    assert!(request.parent_span_id.is_empty(), "a root span");
    assert_eq!(hex(&named(&spans, "decode").span_id), parent);
    assert!(spans.iter().all(|(service, _)| service == "tokenonce"), "the default service name");
    assert_eq!(attr(&request.attributes, "tokenonce.api").as_deref(), Some("completions"));
    // A non-streamed answer relayed through still gives its token counts.
    assert_eq!(attr(&request.attributes, "gen_ai.usage.output_tokens").as_deref(), Some("3"), "max_tokens");
    assert!(attr(&request.attributes, "gen_ai.usage.input_tokens").is_some());
}

/// Tracing off (no `[tracing]`): tokenonce makes no span and a client's trace context reaches
/// both engines as the client sent it.
#[tokio::test(flavor = "multi_thread")]
async fn without_tracing_the_client_context_passes_untouched() {
    let (p, d, proxy) = pd_setup(FakeConfig::default(), FakeConfig::default(), "").await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let headers = [("traceparent", traceparent), ("tracestate", "a=b")];
    let (status, _, _) =
        post_json(&format!("{}/v1/chat/completions", proxy.url), &chat_body("x", json!({})), &headers).await;
    assert_eq!(status, 200);
    for fake in [&p, &d] {
        assert_eq!(fake.posts()[0].header("traceparent").as_deref(), Some(traceparent));
        assert_eq!(fake.posts()[0].header("tracestate").as_deref(), Some("a=b"));
    }
    assert!(!tokenonce::telemetry::enabled());
}

/// `tokenonce check` reports bad `[tracing]` keys, each at its place.
#[test]
fn check_reports_bad_tracing_keys() {
    let text = "[pools.decode]\nendpoints = [\"e:1\"]\n\n[tracing]\nendpoint = \"https://127.0.0.1:4318/v1/traces\"\nprotocol = \"udp\"\nsampling_ratio = 1.5\nservice_name = \" \"\n";
    let err = tokenonce::config::Config::from_toml(text, "t.toml").unwrap_err();
    assert_problem_keys(
        &err,
        &["tracing.endpoint", "tracing.protocol", "tracing.sampling_ratio", "tracing.service_name"],
    );
    assert!(err.problems[2].message.contains("between 0.0 and 1.0"), "{:?}", err.problems[2]);
    assert!(err.problems.iter().all(|p| p.line > 0));
    let missing =
        tokenonce::config::Config::from_toml("[pools.decode]\nendpoints = [\"e:1\"]\n[tracing]\n", "t").unwrap_err();
    assert_eq!(missing.problems[0].key, "tracing.endpoint");
    let ok = "[pools.decode]\nendpoints = [\"e:1\"]\n[tracing]\nendpoint = \"http://127.0.0.1:4317\"\nprotocol = \"grpc\"\nsampling_ratio = 0\n";
    let config = tokenonce::config::Config::from_toml(ok, "t").unwrap();
    let tracing = config.tracing.unwrap();
    assert_eq!((tracing.sampling_ratio, tracing.service_name.as_str()), (0.0, "tokenonce"));
}

/// A collector that is down costs the spans, never a request.
#[tokio::test(flavor = "multi_thread")]
async fn a_collector_that_is_down_fails_no_request() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let [p, d] = fakes(Default::default()).await;
    let config = format!("{}\n[tracing]\nendpoint = \"http://{closed}/v1/traces\"\n", pd_config(&p, &d, ""));
    let proxy = TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &config).await;
    for i in 0..3 {
        let body = chat_body(&format!("no collector {i}"), json!({}));
        let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &[]).await;
        assert_eq!(status, 200, "{text}");
    }
    assert!(d.posts().iter().all(|r| r.header("traceparent").is_some()), "legs still carry their context");
    // The lost spans are counted, so a dashboard shows the collector is down.
    assert!(spans_counted(&proxy, "failed", 1.0).await >= 1.0);
    assert_eq!(proxy.metric(r#"tokenonce_trace_spans_total{result="exported"}"#).await, 0.0);
}

/// The leg client marks a prefill that failed over on the prefill's span (a prefill that did
/// not is unmarked: the first test), and the endpoint that finally took it got that span's
/// context: two prefill engines in one pool, one answering 503, two traced requests (round
/// robin sends at least one of them to the failing engine first).
#[tokio::test(flavor = "multi_thread")]
async fn a_prefill_failover_is_marked_on_its_span() {
    let (url, received) = receiver().await;
    let failing = FakeConfig { fail_with: Some((503, "{\"error\":\"engine\"}".into())), ..FakeConfig::default() };
    let [a, b, d] = fakes([failing, FakeConfig::default(), FakeConfig::default()]).await;
    let pools = pools_config(&[a.host_port(), b.host_port()], &[d.host_port()], "");
    let proxy =
        TokenOnce::start_binary(env!("CARGO_BIN_EXE_tokenonce"), &format!("{pools}[tracing]\nendpoint = \"{url}\"\n"))
            .await;
    for e in [&a, &b] {
        proxy.wait_health("prefill", &e.host_port(), true).await;
    }
    let traces = ["6bf92f3577b34da6a3ce929d0e0e4736", "7bf92f3577b34da6a3ce929d0e0e4736"];
    let mut failed_over = Vec::new();
    for trace in traces {
        let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
        let body = chat_body("fail over", json!({}));
        let headers = [("traceparent", traceparent.as_str())];
        let (status, _, text) = post_json(&format!("{}/v1/chat/completions", proxy.url), &body, &headers).await;
        assert_eq!(status, 200, "{text}");
        let spans = received.trace_with(trace, "decode").await;
        let prefill = named(&spans, "prefill");
        failed_over.push(attr(&prefill.attributes, "tokenonce.failed_over").is_some_and(|v| v == "true"));
        let last = b.posts().last().unwrap().header("traceparent").unwrap();
        assert_eq!(
            traceparent_ids(&last),
            (trace.to_owned(), hex(&prefill.span_id)),
            "b got the prefill span's context"
        );
    }
    assert!(!a.posts().is_empty(), "round robin sends a request to the failing engine first");
    let marked = failed_over.iter().filter(|f| **f).count();
    assert_eq!(marked, a.posts().len(), "every request that met the failing engine, and no other: {failed_over:?}");
}
