//! The pingora glue. `Proxy` is the client-facing service: `request_filter` reads API bodies
//! and runs the P/D exchange itself (pd.rs); every other request goes through pingora's
//! normal pipeline to a pool, byte for byte. `Admin` serves `/metrics`, `/healthz`, `/readyz`.
//!
//! Phases used: request_filter (route, orchestrate) → upstream_peer (passthrough only)
//! → fail_to_proxy (passthrough errors, OpenAI-shaped) → logging (metrics, access log).

pub mod pd;
pub mod relay;
pub mod respond;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;

use crate::config::{Mode, PrefillSource};
use crate::metrics::{Metrics, Outcome, Stage};
use crate::openai::{Api, ApiError, RawObject, RequestView};
use crate::routes::RequestFacts;
use crate::upstream::Picked;
use crate::{App, SharedApp};

/// Per-request state.
pub struct Ctx {
    /// The configuration snapshot this request runs on.
    pub app: Arc<App>,
    /// When the request head was seen.
    pub started: Instant,
    /// Index of the chosen route.
    pub route: Option<usize>,
    /// API of an OpenAI path.
    pub api: Option<Api>,
    /// `orchestrate` or `passthrough`.
    pub mode: Mode,
    /// Final status sent to the client.
    pub status: u16,
    /// How it ended (set by the handler; else derived in `logging`).
    pub outcome: Option<Outcome>,
    /// When the response header went out.
    pub first_byte: Option<Duration>,
    /// The stage in progress (labels upstream errors).
    pub stage: Option<Stage>,
    /// When the decode leg was sent.
    pub decode_sent_at: Option<Instant>,
    /// Request id used on both legs.
    pub request_id: Option<String>,
    /// Token reuse result or fallback reason, for the access log.
    pub reuse: Option<&'static str>,
    /// Pool of a pipeline passthrough.
    pub pass_pool: usize,
    /// Endpoint of a pipeline passthrough (held for in-flight counting).
    pub pass_endpoint: Option<Picked>,
    /// Whether `inflight_requests` was raised for this request.
    pub counted: bool,
    /// Prefill leg duration, for the access log.
    pub prefill_ms: Option<f64>,
    /// Decode time to response header, for the access log.
    pub decode_first_byte_ms: Option<f64>,
}

impl Ctx {
    /// Records the time to first byte once.
    pub fn mark_first_byte(&mut self) {
        self.first_byte.get_or_insert_with(|| self.started.elapsed());
    }

    /// Stage label for upstream error metrics.
    pub fn stage_label(&self) -> &'static str {
        match (self.mode, self.stage) {
            (Mode::Passthrough, _) | (_, None) => "passthrough",
            (_, Some(Stage::Prefill)) => "prefill",
            (_, Some(_)) => "decode",
        }
    }
}

/// The client-facing proxy.
pub struct Proxy {
    /// The current state; replaced whole on reload.
    pub app: SharedApp,
}

async fn read_body(session: &mut Session, limit: usize) -> std::result::Result<Bytes, ApiError> {
    if let Some(len) =
        session.req_header().headers.get("content-length").and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
    {
        if len > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
    }
    let mut body = BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(ApiError::BodyTooLarge { limit });
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body.freeze()),
            Err(e) => return Err(ApiError::invalid(format!("reading the body failed: {e}"), None)),
        }
    }
}

impl Proxy {
    /// Handles a POST to an OpenAI path: reads the body, picks the route, runs it.
    async fn handle_api(&self, session: &mut Session, ctx: &mut Ctx, api: Api) {
        let app = Arc::clone(&ctx.app);
        let app = &*app;
        let path = session.req_header().uri.path().to_owned();
        let path_and_query = session.req_header().uri.path_and_query().map_or(path.clone(), |p| p.as_str().to_owned());
        let headers = session.req_header().headers.clone();
        session.as_downstream_mut().set_abort_on_close(true);

        let body = match read_body(session, app.max_body_bytes).await {
            Ok(b) => b,
            Err(e) => {
                // Do not try to reuse a connection whose body was not read to the end.
                session.set_keepalive(None);
                return respond::write_error(session, ctx, &e).await;
            }
        };
        let parsed = RawObject::parse_bytes(&body);
        let view = parsed.as_ref().ok().map(|obj| RequestView::parse(api, obj));
        let model = view.as_ref().and_then(|v| v.as_ref().ok()).and_then(|v| v.model.as_deref());
        let facts = RequestFacts { path: &path, model, headers: &headers };
        let route_index = app.routes.select(&facts);
        ctx.route = route_index;
        let route = route_index.and_then(|i| app.routes.routes().get(i));
        let drop_header = route.and_then(|r| match r.prefill() {
            Some(PrefillSource::Header { name, .. }) => Some(name.as_str()),
            _ => None,
        });
        let req = pd::Incoming { path_and_query: &path_and_query, headers: &headers, body: &body, drop_header };

        let Some(route) = route.filter(|r| r.mode() != Mode::Passthrough) else {
            // Passthrough with a body already read: forward it unchanged ourselves.
            ctx.mode = Mode::Passthrough;
            let pool = route.map_or(app.passthrough_pool, |r| r.decode_pool());
            let Some(endpoint) = app.pools.get(pool).and_then(|p| p.pick()) else {
                return respond::write_error(session, ctx, &ApiError::DecodeUnavailable("empty pool".into())).await;
            };
            let name = app.route_label(ctx.route).to_owned();
            return pd::forward(app, session, ctx, endpoint, &req, &name).await;
        };
        ctx.mode = route.mode();
        if body.len() > route.options().max_body_bytes() {
            return respond::write_error(
                session,
                ctx,
                &ApiError::BodyTooLarge { limit: route.options().max_body_bytes() },
            )
            .await;
        }
        let obj = match parsed {
            Ok(obj) => obj,
            Err(e) => {
                return respond::write_error(
                    session,
                    ctx,
                    &ApiError::invalid(format!("body is not a JSON object: {e}"), None),
                )
                .await
            }
        };
        let view = match view {
            Some(Ok(v)) => v,
            Some(Err(e)) => return respond::write_error(session, ctx, &e).await,
            None => {
                return respond::write_error(session, ctx, &ApiError::invalid("body is not a JSON object", None)).await
            }
        };
        match route.mode() {
            Mode::Relay => relay::handle(app, session, ctx, route, &obj, &view, &req).await,
            _ => pd::orchestrate(app, session, ctx, route, &obj, &view, &req).await,
        }
    }
}

#[async_trait]
impl ProxyHttp for Proxy {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        // One config snapshot per request: a reload never changes a request in flight.
        let app = self.app.load_full();
        Ctx {
            started: Instant::now(),
            route: None,
            api: None,
            mode: Mode::Passthrough,
            status: 0,
            outcome: None,
            first_byte: None,
            stage: None,
            decode_sent_at: None,
            request_id: None,
            reuse: None,
            pass_pool: app.passthrough_pool,
            app,
            pass_endpoint: None,
            counted: false,
            prefill_ms: None,
            decode_first_byte_ms: None,
        }
    }

    /// Routes the request; orchestrated API calls are answered here (`Ok(true)`).
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let app = Arc::clone(&ctx.app);
        ctx.started = Instant::now();
        ctx.counted = true;
        app.metrics.inflight.inc();
        let header = session.req_header();
        ctx.request_id = Some(
            header
                .headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned),
        );
        let api = (header.method == http::Method::POST).then(|| Api::from_path(header.uri.path())).flatten();
        if let Some(api) = api {
            ctx.api = Some(api);
            let path = header.uri.path();
            let decided_without_body = if app.routes.needs_model(path) {
                None
            } else {
                let facts = RequestFacts { path, model: None, headers: &header.headers };
                Some(app.routes.select(&facts))
            };
            let pipeline_route = match decided_without_body {
                Some(None) => Some(None),
                Some(Some(i)) if app.routes.routes().get(i).is_some_and(|r| r.mode() == Mode::Passthrough) => {
                    Some(Some(i))
                }
                _ => None,
            };
            if pipeline_route.is_none() {
                self.handle_api(session, ctx, api).await;
                return Ok(true);
            }
            ctx.route = pipeline_route.flatten();
        } else {
            let facts = RequestFacts { path: header.uri.path(), model: None, headers: &header.headers };
            ctx.route = app.routes.select(&facts);
        }
        ctx.mode = Mode::Passthrough;
        ctx.pass_pool =
            ctx.route.and_then(|i| app.routes.routes().get(i)).map_or(app.passthrough_pool, |r| r.decode_pool());
        Ok(false)
    }

    /// Passthrough only: an endpoint of the route's pool.
    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let app = Arc::clone(&ctx.app);
        let picked = app
            .pools
            .get(ctx.pass_pool)
            .and_then(|p| p.pick())
            .ok_or_else(|| Error::explain(ErrorType::HTTPStatus(502), "passthrough pool is empty"))?;
        let peer =
            app.client.peer(picked.addr()).await.map_err(|e| Error::explain(ErrorType::ConnectError, e.to_string()))?;
        ctx.pass_endpoint = Some(picked);
        Ok(Box::new(peer))
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.status = upstream.status.as_u16();
        ctx.mark_first_byte();
        Ok(())
    }

    /// Passthrough failures answer OpenAI-shaped errors instead of pingora's bare pages.
    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let app = Arc::clone(&ctx.app);
        let err = match e.etype() {
            ErrorType::ConnectTimedout
            | ErrorType::ConnectRefused
            | ErrorType::ConnectError
            | ErrorType::ConnectNoRoute => {
                app.metrics.upstream_errors.with_label_values(&["passthrough", "connect"]).inc();
                Some(ApiError::DecodeUnavailable(e.to_string()))
            }
            _ if matches!(e.esource(), ErrorSource::Upstream) => {
                app.metrics.upstream_errors.with_label_values(&["passthrough", "io"]).inc();
                Some(ApiError::DecodeUnavailable(e.to_string()))
            }
            _ if matches!(e.esource(), ErrorSource::Downstream) => None,
            _ => Some(ApiError::Internal(e.to_string())),
        };
        let code = match err {
            Some(err) if session.response_written().is_none() => {
                respond::write_error(session, ctx, &err).await;
                err.status()
            }
            Some(err) => err.status(),
            None => {
                ctx.outcome = Some(Outcome::ClientClosed);
                0
            }
        };
        FailToProxy { error_code: code, can_reuse_downstream: false }
    }

    /// Counts the request once, whatever path it took.
    async fn logging(&self, session: &mut Session, _e: Option<&Error>, ctx: &mut Ctx) {
        let app = Arc::clone(&ctx.app);
        if ctx.counted {
            app.metrics.inflight.dec();
        }
        let status =
            if ctx.status != 0 { ctx.status } else { session.response_written().map_or(0, |h| h.status.as_u16()) };
        let outcome =
            ctx.outcome.unwrap_or_else(
                || {
                    if status == 0 {
                        Outcome::ClientClosed
                    } else {
                        Outcome::from_status(status)
                    }
                },
            );
        let route = app.route_label(ctx.route);
        let api = ctx.api.map_or("other", Api::as_str);
        let mode = ctx.mode.as_str();
        let m: &Metrics = &app.metrics;
        m.requests.with_label_values(&[route, api, mode, outcome.as_str()]).inc();
        let elapsed = ctx.started.elapsed();
        m.request_duration.with_label_values(&[route, api, mode]).observe(elapsed.as_secs_f64());
        if let Some(ttfb) = ctx.first_byte {
            m.time_to_first_byte.with_label_values(&[route, api, mode]).observe(ttfb.as_secs_f64());
        }
        tracing::info!(
            request_id = ctx.request_id.as_deref().unwrap_or("-"),
            route,
            api,
            mode,
            status,
            outcome = outcome.as_str(),
            reuse = ctx.reuse.unwrap_or("-"),
            prefill_ms = ctx.prefill_ms.unwrap_or(0.0),
            decode_first_byte_ms = ctx.decode_first_byte_ms.unwrap_or(0.0),
            ttfb_ms = ctx.first_byte.map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            total_ms = elapsed.as_secs_f64() * 1000.0,
            "request"
        );
    }
}

/// The `wait_seconds` of a `/drain` query, capped at 300 s.
fn drain_wait(query: Option<&str>) -> Duration {
    let secs = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("wait_seconds="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Duration::from_secs(secs.min(300))
}

/// The admin listener: `/metrics`, `/healthz`, `/readyz`, `/drain`; 404 otherwise.
pub struct Admin {
    /// The current state.
    pub app: SharedApp,
}

#[async_trait]
impl ProxyHttp for Admin {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        let app = self.app.load_full();
        let (status, content_type, body): (u16, &str, Vec<u8>) = match session.req_header().uri.path() {
            "/metrics" => {
                relay::sweep_cache(&app);
                (200, "text/plain; version=0.0.4", Metrics::render(&app.registry))
            }
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if app.draining.load(Ordering::Relaxed) => (503, "text/plain", b"draining\n".to_vec()),
            "/readyz" if app.metrics.ready.get() == 1 => (200, "text/plain", b"ready\n".to_vec()),
            "/drain" => {
                // For a preStop hook: fail readiness now, then hold the hook for `wait_seconds`
                // (at most 300) so SIGTERM, which closes the listeners, comes after load
                // balancers have seen the pod go unready.
                app.draining.store(true, Ordering::Relaxed);
                let wait = drain_wait(session.req_header().uri.query());
                tracing::info!(wait_seconds = wait.as_secs(), "draining: /readyz now answers 503");
                tokio::time::sleep(wait).await;
                (200, "text/plain", b"draining\n".to_vec())
            }
            "/readyz" => (503, "text/plain", b"decode upstream not answering /health\n".to_vec()),
            _ => (404, "text/plain", b"not found\n".to_vec()),
        };
        let mut head = ResponseHeader::build(status, Some(2))?;
        head.insert_header("content-type", content_type)?;
        head.insert_header("content-length", body.len().to_string())?;
        session.write_response_header(Box::new(head), false).await?;
        session.write_response_body(Some(Bytes::from(body)), true).await?;
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::HTTPStatus(404), "admin listener proxies nothing"))
    }
}
