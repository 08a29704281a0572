//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and what needs the configured admin
//! token: `/drain` (a preStop hook) and `POST /admin/reload` (a reload without a shell); 404
//! otherwise. It never proxies.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::prelude::*;
use pingora::proxy::{ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;

use crate::app::{App, SharedApp};
use crate::reload::{Refused, Reloader, Trigger};

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
fn authorized(app: &App, head: &RequestHeader) -> bool {
    let Some(token) = app.resources.admin_token.as_ref() else { return false };
    head.headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|presented| token.matches(presented.trim()))
}

/// An answer of the admin listener: status, content type, body.
type Answer = (u16, &'static str, Vec<u8>);

/// `POST /admin/reload`: reloads as SIGHUP does and says what became of it, as JSON: 200
/// `{"applied": true, "restart_needed": [keys]}`; 422 with the file's problems (each
/// `file:line:col: key: message`, as `tokenonce check` prints them) and 409 on the embedded
/// default, the running config kept; 500 if the state could not be built.
async fn reload(reloader: &Reloader) -> Answer {
    let reloader = reloader.clone();
    let outcome = tokio::task::spawn_blocking(move || reloader.reload(Trigger::Admin)).await;
    let (status, body) = match outcome {
        Ok(Ok(applied)) => (200, serde_json::json!({"applied": true, "restart_needed": applied.restart_needed})),
        Ok(Err(Refused::Problems(e))) => {
            let problems: Vec<String> = e.problems.iter().map(|p| format!("{}:{p}", e.source_name)).collect();
            (422, serde_json::json!({"applied": false, "error": e.to_string(), "problems": problems}))
        }
        Ok(Err(e @ Refused::NoFile)) => (409, serde_json::json!({"applied": false, "error": e.to_string()})),
        Ok(Err(e @ Refused::State(_))) => (500, serde_json::json!({"applied": false, "error": e.to_string()})),
        Err(e) => (500, serde_json::json!({"applied": false, "error": format!("the reload did not finish: {e}")})),
    };
    let mut body = body.to_string().into_bytes();
    body.push(b'\n');
    (status, "application/json", body)
}

/// The admin listener: `/metrics`, `/healthz`, `/readyz`, `/drain`, `/admin/reload`; 404
/// otherwise.
pub struct Admin {
    /// The current state.
    pub app: SharedApp,
    /// What `POST /admin/reload` calls (SIGHUP's reload).
    pub reloader: Reloader,
}

#[async_trait]
impl ProxyHttp for Admin {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        let app = self.app.load_full();
        let head = session.req_header();
        let (status, content_type, body): Answer = match head.uri.path() {
            "/metrics" => {
                app.refresh_gauges();
                (200, "text/plain; version=0.0.4", crate::metrics::render(&app.registry))
            }
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if app.draining.load(Ordering::Relaxed) => (503, "text/plain", b"draining\n".to_vec()),
            "/readyz" if app.metrics.upstream.ready().get() == 1 => (200, "text/plain", b"ready\n".to_vec()),
            "/admin/reload" if head.method != http::Method::POST => {
                (405, "text/plain", b"method not allowed: POST /admin/reload\n".to_vec())
            }
            "/admin/reload" if !authorized(&app, head) => {
                tracing::warn!("/admin/reload refused: no or wrong admin token");
                (
                    403,
                    "text/plain",
                    b"forbidden: /admin/reload needs Authorization: Bearer <server.admin_token_file>\n".to_vec(),
                )
            }
            "/admin/reload" => reload(&self.reloader).await,
            "/drain" if !authorized(&app, head) => {
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
                let wait = drain_wait(head.uri.query());
                tracing::info!(wait_seconds = wait.as_secs(), "draining: /readyz now answers 503");
                tokio::time::sleep(wait).await;
                (200, "text/plain", b"draining\n".to_vec())
            }
            "/readyz" => (503, "text/plain", b"decode upstream not answering /health\n".to_vec()),
            _ => (404, "text/plain", b"not found\n".to_vec()),
        };
        let mut head = ResponseHeader::build(status, Some(3))?;
        head.insert_header("content-type", content_type)?;
        head.insert_header("content-length", body.len().to_string())?;
        if status == 405 {
            head.insert_header("allow", "POST")?;
        }
        session.write_response_header(Box::new(head), false).await?;
        session.write_response_body(Some(Bytes::from(body)), true).await?;
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Err(Error::explain(ErrorType::HTTPStatus(404), "admin listener proxies nothing"))
    }
}
