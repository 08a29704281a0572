//! Shared integration-test harness: a fake vLLM (`fake_vllm`), the real `tokenonce` binary
//! started on free loopback ports with a given config, and small HTTP helpers.

#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

pub mod fake_vllm;
pub mod toy_proxy;

use std::io::Write;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use fake_vllm::{fake_render_chat, fake_tokenize, FakeConfig, FakeVllm};

/// A free loopback port (bound then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running tokenonce process; killed on drop.
pub struct TokenOnce {
    child: Child,
    /// Client base URL.
    pub url: String,
    /// Admin base URL.
    pub admin: String,
    _dir: tempfile::TempDir,
    log: std::path::PathBuf,
    config_path: std::path::PathBuf,
    server_section: String,
}

impl TokenOnce {
    /// Starts tokenonce on `config` (TOML; `[server]` listen/admin lines are added) and waits
    /// until `/healthz` answers (bounded: 15 s).
    pub async fn start(config: &str) -> Self {
        let port = free_port();
        let admin_port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenonce.toml");
        let server_section = format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\nthreads = 2\ngrace_period_seconds = 1\ngraceful_shutdown_timeout_seconds = 1\n\n[upstream]\nhealth_interval_ms = 200\n\n"
        );
        let text = format!("{server_section}{config}");
        std::fs::File::create(&path).unwrap().write_all(text.as_bytes()).unwrap();
        let log = dir.path().join("tokenonce.log");
        let child = Command::new(env!("CARGO_BIN_EXE_tokenonce"))
            .arg("--config")
            .arg(&path)
            .env("TOKENONCE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let me = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin_port}"),
            _dir: dir,
            log,
            config_path: path,
            server_section,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = client.get(format!("{}/healthz", me.admin)).send().await {
                if r.status() == 200 && client.get(format!("{}/v1/x", me.url)).send().await.is_ok() {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "tokenonce did not start:\n{}", me.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        me
    }

    /// Rewrites the config file (same listeners) and sends SIGHUP.
    pub fn reconfigure(&self, config: &str) {
        std::fs::write(&self.config_path, format!("{}{config}", self.server_section)).unwrap();
        let status = Command::new("kill").arg("-HUP").arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success());
    }

    /// What the process logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Scrapes `/metrics`.
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.admin)).await.unwrap().text().await.unwrap()
    }

    /// Waits until `/readyz` answers `status` (bounded: 10 s).
    pub async fn wait_ready(&self, status: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = reqwest::get(format!("{}/readyz", self.admin)).await.map(|r| r.status().as_u16()).unwrap_or(0);
            if got == status {
                return;
            }
            assert!(Instant::now() < deadline, "readyz stayed {got}, wanted {status}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of one sample line `name{labels} value` (labels as written, in order).
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

impl Drop for TokenOnce {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A config with one prefill fake and one decode fake on route `pd`.
pub fn pd_config(prefill: &FakeVllm, decode: &FakeVllm, route_extra: &str) -> String {
    format!(
        "[pools.prefill]\nendpoints = [\"{}\"]\n\n[pools.decode]\nendpoints = [\"{}\"]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n{route_extra}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\n",
        prefill.host_port(),
        decode.host_port()
    )
}

/// Starts a prefill fake, a decode fake and tokenonce between them.
pub async fn pd_setup(prefill: FakeConfig, decode: FakeConfig, route_extra: &str) -> (FakeVllm, FakeVllm, TokenOnce) {
    let p = FakeVllm::start(prefill).await;
    let d = FakeVllm::start(decode).await;
    let proxy = TokenOnce::start(&pd_config(&p, &d, route_extra)).await;
    (p, d, proxy)
}

/// A plain chat request body.
pub fn chat_body(user: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": "tiny-qwen3",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}],
        "max_tokens": 5,
        "temperature": 0
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// POSTs raw bytes; returns status, headers and body.
pub async fn post_raw(
    url: &str,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = reqwest::Client::new().post(url).header("content-type", "application/json").body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

/// POSTs JSON.
pub async fn post_json(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    post_raw(url, serde_json::to_vec(body).unwrap(), headers).await
}
