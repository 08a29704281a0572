//! Logging and OpenTelemetry tracing. The log subscriber always runs; with `[tracing]` an OTLP
//! layer is added that exports only this module's spans: one per request (continuing the
//! client's W3C `traceparent`/`tracestate`) with children for the prefill leg, the handoff and
//! the decode leg (and its first byte), each leg sending its own `traceparent` to its engine.
//! Without `[tracing]` no layer is installed and no span is made ([`RequestTrace`] is empty).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{span_processor_with_async_runtime::BatchSpanProcessor, BatchConfigBuilder};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use serde::Deserialize;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{Config, LogFormat, OtlpProtocol, Tracing};
use crate::metrics::{Leg, SpanExport};

/// Target of the exported spans (the log layer never sees it).
pub const TARGET: &str = "tokenonce::otel";

/// How long finished spans wait before they are sent in one batch.
const EXPORT_DELAY: Duration = Duration::from_millis(1000);

/// True once the OTLP layer is installed.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// True when spans are exported (`[tracing]` was configured at start).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The running exporter; [`Telemetry::shutdown`] sends what is still buffered.
pub struct Telemetry {
    provider: SdkTracerProvider,
    /// Runs the batch exporter (pingora's runtimes come and go with its services).
    _runtime: tokio::runtime::Runtime,
}

impl Telemetry {
    /// Flushes and stops the exporter (bounded by the exporter's own timeout).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("tokenonce: trace export shutdown: {e}");
        }
    }
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
#[error("tracing: {0}")]
pub struct TelemetryError(String);

/// Installs the log subscriber (filter: `TOKENONCE_LOG`, else `server.log_level`) and, with
/// `[tracing]`, the OTLP layer; the returned handle must be shut down at exit.
///
/// # Errors
/// [`TelemetryError`] when the exporter cannot be built.
pub fn init(config: &Config) -> Result<Option<Telemetry>, TelemetryError> {
    let filter = std::env::var("TOKENONCE_LOG").unwrap_or_else(|_| config.server.log_level.clone());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info"));
    // The exported spans are not log lines.
    let filter = filter.add_directive(format!("{TARGET}=off").parse().map_err(|e| TelemetryError(format!("{e}")))?);
    let log = match config.server.log_format {
        LogFormat::Json => {
            tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).with_filter(filter).boxed()
        }
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(colour_logs())
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let Some(settings) = config.tracing.as_ref() else {
        tracing_subscriber::registry().with(log).init();
        return Ok(None);
    };
    let (telemetry, tracer) = exporter(settings)?;
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO));
    tracing_subscriber::registry().with(log).with(otel).init();
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some(telemetry))
}

/// Text logs are coloured only on a terminal, and never under `NO_COLOR`: a file or a pipe
/// (a log collector, `2> tokenonce.log`) would otherwise keep the ANSI escapes as text.
fn colour_logs() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The OTLP exporter and tracer of `settings`, batching on a runtime of their own.
fn exporter(settings: &Tracing) -> Result<(Telemetry, opentelemetry_sdk::trace::Tracer), TelemetryError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tokenonce-otel")
        .enable_all()
        .build()
        .map_err(|e| TelemetryError(format!("runtime: {e}")))?;
    // The exporter and the batch task are made inside the runtime they run on.
    let _entered = runtime.enter();
    let built = match settings.protocol {
        OtlpProtocol::Http => SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(&settings.endpoint)
            .build(),
        OtlpProtocol::Grpc => SpanExporter::builder().with_tonic().with_endpoint(&settings.endpoint).build(),
    };
    let exporter = Counted(built.map_err(|e| TelemetryError(format!("exporter: {e}")))?);
    let batch = BatchConfigBuilder::default().with_scheduled_delay(EXPORT_DELAY).build();
    let processor =
        BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).with_batch_config(batch).build();
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(settings.sampling_ratio)));
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler)
        .with_resource(Resource::builder().with_service_name(settings.service_name.clone()).build())
        .build();
    let tracer = provider.tracer("tokenonce");
    drop(_entered);
    Ok((Telemetry { provider, _runtime: runtime }, tracer))
}

/// An exporter whose batches are counted in `tokenonce_trace_spans_total{result}`: a
/// collector that is down loses spans silently otherwise (requests never wait for it).
#[derive(Debug)]
struct Counted<E>(E);

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<opentelemetry_sdk::trace::SpanData>) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.0.export(batch).await;
        let outcome = if result.is_ok() { SpanExport::Exported } else { SpanExport::Failed };
        if let Ok(counter) = crate::metrics::trace_spans() {
            counter.with_label_values(&[outcome.as_str()]).inc_by(spans);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// Reads W3C trace context from request headers.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The spans of one request; every span is `Span::none()` when tracing is off.
#[derive(Debug)]
pub struct RequestTrace {
    request: Span,
    prefill: Span,
    decode: Span,
    first_byte: Span,
}

impl Default for RequestTrace {
    fn default() -> Self {
        Self { request: Span::none(), prefill: Span::none(), decode: Span::none(), first_byte: Span::none() }
    }
}

impl RequestTrace {
    /// The request's span, child of the client's trace context when its headers carry one.
    pub fn start(method: &str, path: &str, headers: &http::HeaderMap) -> Self {
        if !enabled() {
            return Self::default();
        }
        let request = tracing::info_span!(target: TARGET, "request", otel.name = %format!("{method} {path}"), otel.kind = "server");
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        // Only fails when the span is disabled or already started; neither is the case here.
        let _ = request.set_parent(parent);
        request.set_attribute("http.request.method", method.to_owned());
        request.set_attribute("url.path", path.to_owned());
        Self { request, ..Self::default() }
    }

    /// Whether this request is traced (tracing on).
    pub fn is_on(&self) -> bool {
        !self.request.is_none()
    }

    /// Sets an attribute of the request span.
    pub fn attribute(&self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        if !self.request.is_none() {
            self.request.set_attribute(key, value);
        }
    }

    /// Sets an attribute of `leg`'s span (the request's when the leg has none).
    pub fn leg_attribute(&self, leg: Leg, key: &'static str, value: impl Into<opentelemetry::Value>) {
        let span = self.leg_span(leg);
        if !span.is_none() {
            span.set_attribute(key, value);
        }
    }

    /// `leg`'s span while it runs, else the request's (a leg without one: passthrough).
    fn leg_span(&self, leg: Leg) -> &Span {
        match leg {
            Leg::Prefill if !self.prefill.is_none() => &self.prefill,
            Leg::Decode if !self.decode.is_none() => &self.decode,
            _ => &self.request,
        }
    }

    /// A leg is being sent: its span starts (the decode's with a first-byte child).
    pub fn leg_started(&mut self, leg: Leg) {
        if self.request.is_none() {
            return;
        }
        let span = |name: &'static str, parent: &Span| match name {
            "prefill" => tracing::info_span!(target: TARGET, parent: parent, "prefill", otel.kind = "client"),
            "decode" => tracing::info_span!(target: TARGET, parent: parent, "decode", otel.kind = "client"),
            _ => tracing::info_span!(target: TARGET, parent: parent, "decode first byte"),
        };
        match leg {
            Leg::Prefill => self.prefill = span("prefill", &self.request),
            Leg::Decode | Leg::Passthrough => {
                self.decode = span("decode", &self.request);
                self.first_byte = span("first_byte", &self.decode);
            }
        }
    }

    /// The decode's response head arrived.
    pub fn first_byte(&mut self) {
        self.first_byte = Span::none();
    }

    /// A leg's span ends.
    pub fn leg_done(&mut self, leg: Leg) {
        match leg {
            Leg::Prefill => self.prefill = Span::none(),
            Leg::Decode | Leg::Passthrough => {
                self.first_byte = Span::none();
                self.decode = Span::none();
            }
        }
    }

    /// The handoff's span (between the legs); it ends when dropped.
    pub fn handoff(&self) -> Span {
        if self.request.is_none() {
            return Span::none();
        }
        tracing::info_span!(target: TARGET, parent: &self.request, "handoff")
    }

    /// The span of a KV release (the one-token decode sent after the client left); it ends
    /// when dropped.
    pub fn release(&self) -> Span {
        if self.request.is_none() {
            return Span::none();
        }
        tracing::info_span!(target: TARGET, parent: &self.request, "kv release", otel.kind = "client")
    }

    /// The `traceparent` (and `tracestate`) a leg sends: its own span's context, or the
    /// request's for a leg without one (passthrough). Empty when tracing is off.
    pub fn headers_for(&self, leg: Leg) -> Vec<(String, String)> {
        let span = self.leg_span(leg);
        if span.is_none() {
            return Vec::new();
        }
        let mut carrier: HashMap<String, String> = HashMap::new();
        TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
        carrier.into_iter().collect()
    }

    /// Records the error code the client got (and marks the request span failed).
    pub fn error(&self, code: &'static str) {
        if !self.request.is_none() {
            self.request.set_attribute("error.type", code);
            self.request.set_status(Status::error(code));
        }
    }

    /// Records the token counts an engine answer reports in its `usage` (the last one seen wins).
    pub fn usage(&self, body: &[u8]) {
        if self.request.is_none() {
            return;
        }
        if let Some(usage) = usage_in(body) {
            if let Some(n) = usage.prompt_tokens {
                self.attribute("gen_ai.usage.input_tokens", i64::try_from(n).unwrap_or(i64::MAX));
            }
            if let Some(n) = usage.completion_tokens {
                self.attribute("gen_ai.usage.output_tokens", i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    /// Ends every span, children first, after recording the final status.
    pub fn finish(&mut self, status: u16) {
        self.leg_done(Leg::Prefill);
        self.leg_done(Leg::Decode);
        if status != 0 {
            self.attribute("http.response.status_code", i64::from(status));
        }
        self.request = Span::none();
    }
}

/// Token counts of an answer.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

/// The last `usage` in `body`: a JSON answer, or complete SSE events (`data: {...}`).
pub fn usage_in(body: &[u8]) -> Option<Usage> {
    #[derive(Deserialize)]
    struct WithUsage {
        usage: Option<Usage>,
    }
    let finder = memchr::memmem::Finder::new(b"\"usage\"");
    finder.find(body)?;
    if let Ok(WithUsage { usage: Some(u) }) = serde_json::from_slice::<WithUsage>(body) {
        return Some(u);
    }
    body.split(|&b| b == b'\n')
        .rev()
        .filter_map(|line| line.strip_prefix(b"data:"))
        .filter(|data| finder.find(data).is_some())
        .find_map(|data| serde_json::from_slice::<WithUsage>(data.trim_ascii()).ok()?.usage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_json_and_from_sse_events() {
        let json = br#"{"id":"x","usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#;
        assert_eq!(usage_in(json), Some(Usage { prompt_tokens: Some(7), completion_tokens: Some(3) }));
        let sse = b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_in(sse), Some(Usage { prompt_tokens: Some(4), completion_tokens: Some(2) }));
        assert_eq!(usage_in(b"data: {\"choices\":[]}\n\n"), None);
        assert_eq!(usage_in(br#"{"usage":null}"#), None);
    }

    #[test]
    fn an_empty_trace_costs_nothing_and_sends_no_headers() {
        let mut trace = RequestTrace::start("POST", "/v1/chat/completions", &http::HeaderMap::new());
        trace.leg_started(Leg::Prefill);
        assert!(trace.headers_for(Leg::Prefill).is_empty(), "tracing is off in unit tests");
        trace.finish(200);
    }
}
