//! The admin listener: `/metrics`, `/healthz`, `/readyz` and `/drain` (a preStop hook, which
//! needs the configured admin token); 404 otherwise. It never proxies.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;

use crate::app::{App, SharedApp};
use crate::metrics::Metrics;

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

/// True when the request carries the configured admin token as `Authorization: Bearer`;
/// with no token configured, state-changing endpoints are off.
fn drain_authorized(app: &App, head: &RequestHeader) -> bool {
    let Some(token) = app.resources.admin_token.as_ref() else { return false };
    head.headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|presented| token.matches(presented.trim()))
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
                app.refresh_gauges();
                (200, "text/plain; version=0.0.4", Metrics::render(&app.registry))
            }
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if app.draining.load(Ordering::Relaxed) => (503, "text/plain", b"draining\n".to_vec()),
            "/readyz" if app.metrics.ready().get() == 1 => (200, "text/plain", b"ready\n".to_vec()),
            "/drain" if !drain_authorized(&app, session.req_header()) => {
                tracing::warn!("/drain refused: no or wrong admin token");
                (
                    403,
                    "text/plain",
                    b"forbidden: /drain needs Authorization: Bearer <server.admin_token_file>\n".to_vec(),
                )
            }
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
