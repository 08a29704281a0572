//! A test orchestrator that behaves like vLLM's `toy_proxy_server.py`
//! (tests/v1/kv_connector/nixl_integration): for each chat/completions request it sends a
//! prefill (kv_transfer_params do_remote_decode, stream false, max_tokens 1, ...) with a fresh
//! uuid X-Request-Id, copies the prefill response's non-empty kv_transfer_params into the
//! original request, sends that to the decode with the same X-Request-Id, and streams the
//! decode's bytes back with status 200 and media type application/json. A failed prefill
//! is a 500.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::Uri;
use axum::response::Response;
use serde_json::{json, Value};

struct Toy {
    prefill: String,
    decode: String,
    client: reqwest::Client,
}

/// A running toy orchestrator.
pub struct ToyProxy {
    /// Its address.
    pub addr: SocketAddr,
}

impl ToyProxy {
    /// Starts it with one prefill and one decode base URL (`http://host:port`).
    pub async fn start(prefill: &str, decode: &str) -> Self {
        let toy =
            Arc::new(Toy { prefill: prefill.to_owned(), decode: decode.to_owned(), client: reqwest::Client::new() });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new()
            .route("/v1/completions", axum::routing::post(handle))
            .route("/v1/chat/completions", axum::routing::post(handle))
            .with_state(toy);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr }
    }

    /// Base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Toy {
    /// POSTs `body` to `base` + `api` with the toy proxy's headers (a `None` bearer token and
    /// the request id both legs share).
    async fn send(&self, base: &str, api: &str, request_id: &str, body: &Value) -> reqwest::Result<reqwest::Response> {
        let url = format!("{base}{api}");
        let req = self.client.post(url).header("Authorization", "Bearer None").header("X-Request-Id", request_id);
        req.json(body).send().await
    }
}

async fn handle(State(toy): State<Arc<Toy>>, uri: Uri, body: Bytes) -> Response {
    let mut req_data: Value = serde_json::from_slice(&body).unwrap();
    let request_id = uuid::Uuid::new_v4().to_string();
    let api = uri.path().to_owned();

    // send_request_to_service: on a copy.
    let mut p = req_data.clone();
    let o = p.as_object_mut().unwrap();
    o.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    o.insert("stream".into(), json!(false));
    o.insert("max_tokens".into(), json!(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), json!(1));
    }
    o.remove("stream_options");
    o.remove("min_tokens");
    o.remove("min_completion_tokens");
    let resp = match toy.send(&toy.prefill, &api, &request_id, &p).await {
        Ok(r) if r.status().is_success() => r,
        _ => return Response::builder().status(500).body(Body::from("Internal Server Error")).unwrap(),
    };
    let response_json: Value = resp.json().await.unwrap_or(Value::Null);
    let kv = response_json.get("kv_transfer_params").cloned().unwrap_or(Value::Null);
    let non_empty = match &kv {
        Value::Object(m) => !m.is_empty(),
        Value::Null => false,
        _ => true,
    };
    if non_empty {
        req_data.as_object_mut().unwrap().insert("kv_transfer_params".into(), kv);
    }

    // stream_service_response
    let resp = toy.send(&toy.decode, &api, &request_id, &req_data).await.unwrap();
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from_stream(resp.bytes_stream()))
        .unwrap()
}
