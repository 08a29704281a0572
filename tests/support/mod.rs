//! Shared harness of the integration tests and `benches/`: a fake vLLM (`fake_vllm`), vLLM's
//! toy P/D proxy (`toy_proxy`), tokenonce itself (in this process via `server::start`, or the
//! real binary as a child process; both on listeners bound to port 0), and HTTP helpers.

#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

pub mod fake_vllm;
pub mod fault_engine;
pub mod kv_engine;
pub mod tls;
pub mod toy_proxy;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokenonce::server::{self, Listeners, Running, Signals, Stop};
use tokio::sync::oneshot;

pub use fake_vllm::{
    fake_render_chat, fake_render_messages, fake_render_responses, fake_tokenize, FakeConfig, FakeVllm,
};

/// How the harness runs tokenonce, besides the test's own config.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `upstream.health_interval_ms`: short, so readiness follows the fakes quickly.
    pub health_interval_ms: u64,
    /// Log filter (`TOKENONCE_LOG` syntax). In-process, the first instance of the test
    /// process sets it for all (one global subscriber), and `TOKENONCE_LOG` overrides it.
    pub log: String,
    /// More `[server]` lines (e.g. `admin_token_file = "..."`).
    pub server_extra: String,
    /// More `[upstream]` lines (e.g. `eject_after_failures = 2`).
    pub upstream_extra: String,
    /// `server.threads`.
    pub threads: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            health_interval_ms: 200,
            log: "info".into(),
            server_extra: String::new(),
            upstream_extra: String::new(),
            threads: 2,
        }
    }
}

/// A running tokenonce, in this process or as a child process; stopped on drop.
pub struct TokenOnce {
    // First field: dropped (server stopped) before the directory holding its config goes.
    run: Run,
    /// Client base URL.
    pub url: String,
    /// Admin base URL.
    pub admin: String,
    /// The TLS listener's address (in-process instances with `[server.tls]`).
    pub tls_addr: Option<SocketAddr>,
    config_path: PathBuf,
    server_section: String,
    _dir: tempfile::TempDir,
}

enum Run {
    InProcess(Running),
    Child { child: Child, log: PathBuf },
}

impl TokenOnce {
    /// Starts tokenonce in this process on `config` (TOML; a `[server]` section with
    /// `127.0.0.1:0` listeners and short shutdown timings, and `[upstream]`, are added) and
    /// waits until it answers (bounded: 15 s).
    pub async fn start(config: &str) -> Self {
        Self::start_with(config, &Settings::default()).await
    }

    /// [`Self::start`] with other [`Settings`].
    pub async fn start_with(config: &str, settings: &Settings) -> Self {
        init_test_logging(&settings.log);
        let (dir, config_path, server_section) = write_config(config, settings);
        // The file path, as the binary does, so reloads read the same file.
        let loaded = tokenonce::config::load(&config_path).unwrap_or_else(|e| {
            let problems: Vec<String> = e.problems.iter().map(ToString::to_string).collect();
            panic!("bad test config {}:\n{}", e.source_name, problems.join("\n"))
        });
        let server = &loaded.config.server;
        let tls_listen = server.tls.as_ref().map(|t| t.listen.clone());
        let running = Listeners::bind(&server.listen, &server.admin_listen)
            .and_then(|listeners| listeners.with_tls(tls_listen.as_deref()))
            .and_then(|listeners| server::start(loaded, Some(config_path.clone()), listeners, Signals::HandleOnly))
            .unwrap_or_else(|e| panic!("tokenonce did not start: {e}"));
        let me = Self {
            url: format!("http://{}", running.client_addr()),
            admin: format!("http://{}", running.admin_addr()),
            tls_addr: running.tls_addr(),
            run: Run::InProcess(running),
            config_path,
            server_section,
            _dir: dir,
        };
        me.wait_started().await;
        me
    }

    /// Starts the `tokenonce` binary cargo built for this test as a child process (see
    /// [`Self::spawn`]).
    pub async fn start_binary(config: &str) -> Self {
        Self::spawn(Path::new(env!("CARGO_BIN_EXE_tokenonce")), config, &Settings::default()).await
    }

    /// Runs `binary` as a child process on `config` (completed as in [`Self::start`]); its
    /// stderr goes to a log file ([`Self::log_text`]). The binary binds `127.0.0.1:0` and the
    /// harness reads the chosen ports from its `tokenonce listening` line (bounded: 15 s),
    /// then waits until it answers (bounded: 15 s).
    pub async fn spawn(binary: &Path, config: &str, settings: &Settings) -> Self {
        let (dir, config_path, server_section) = write_config(config, settings);
        let log = dir.path().join("tokenonce.log");
        let mut command = Command::new(binary);
        command
            .arg("--config")
            .arg(&config_path)
            // The startup line names the listeners, so it is logged whatever level was asked for.
            .env("TOKENONCE_LOG", format!("{},tokenonce::server=info", settings.log))
            .env("NO_COLOR", "1");
        let (mut child, listening) = spawn_logged(command, &log, listening_line)
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let (client, admin) = match tokio::time::timeout(Duration::from_secs(15), listening).await {
            Ok(Ok(addrs)) => addrs,
            outcome => {
                let _ = child.kill();
                let _ = child.wait();
                let why = if outcome.is_err() { "did not report its listeners within 15 s" } else { "exited" };
                panic!("{} {why}:\n{}", binary.display(), std::fs::read_to_string(&log).unwrap_or_default());
            }
        };
        let me = Self {
            run: Run::Child { child, log },
            url: format!("http://{client}"),
            admin: format!("http://{admin}"),
            tls_addr: None,
            config_path,
            server_section,
            _dir: dir,
        };
        me.wait_started().await;
        me
    }

    /// Until `/healthz` answers 200 and the client listener answers at all (bounded: 15 s).
    async fn wait_started(&self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = client.get(format!("{}/healthz", self.admin)).send().await {
                if r.status() == 200 && client.get(format!("{}/v1/x", self.url)).send().await.is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "tokenonce did not start:\n{}", self.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Rewrites the config file (same `[server]` section) and reloads it: in-process through
    /// the handle (the same code path as SIGHUP, without signalling the test process), a child
    /// process with SIGHUP. Either way the outcome shows in `config_reloads_total`.
    pub fn reconfigure(&self, config: &str) {
        self.rewrite(config);
        match &self.run {
            Run::InProcess(running) => {
                running.reload();
            }
            Run::Child { child, .. } => {
                let status = Command::new("kill").arg("-HUP").arg(child.id().to_string()).status().unwrap();
                assert!(status.success());
            }
        }
    }

    /// The config file it runs on.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Rewrites the config file (same `[server]` section) in place, without reloading it.
    pub fn rewrite(&self, config: &str) {
        std::fs::write(&self.config_path, format!("{}{config}", self.server_section)).unwrap();
    }

    /// Sends the child process SIGTERM and waits (bounded: 15 s) until it has exited; its
    /// exit status. Only for [`Self::spawn`]ed instances.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let Run::Child { child, .. } = &mut self.run else {
            panic!("terminate() signals a child process; in-process instances stop through their handle");
        };
        let status = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(exit) = child.try_wait().unwrap() {
                return exit;
            }
            assert!(Instant::now() < deadline, "tokenonce still running 15 s after SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What a child process logged so far. In-process instances log through the test
    /// process's subscriber into libtest's captured output of the test that started them
    /// (printed when it fails), so there is no separate text to return.
    pub fn log_text(&self) -> String {
        match &self.run {
            Run::InProcess(_) => "(in-process: tokenonce's log is in this test's captured output)".into(),
            Run::Child { log, .. } => std::fs::read_to_string(log).unwrap_or_default(),
        }
    }

    /// The child's process id (`None` in-process).
    pub fn pid(&self) -> Option<u32> {
        match &self.run {
            Run::InProcess(_) => None,
            Run::Child { child, .. } => Some(child.id()),
        }
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

    /// Waits until `series` reads `value` (bounded: 5 s) and returns what it read last.
    /// For series counted in pingora's `logging` phase, which runs after the client already
    /// has the whole answer.
    pub async fn metric_reaches(&self, series: &str, value: f64) -> f64 {
        self.metric_reaches_within(series, value, Duration::from_secs(5)).await
    }

    /// Asserts `series` reaches `value` (bounded: 5 s, as [`Self::metric_reaches`]).
    pub async fn assert_reaches(&self, series: &str, value: f64) {
        assert_eq!(self.metric_reaches(series, value).await, value, "{series}");
    }

    /// Reloads `config` the way SIGHUP does and waits (bounded: 5 s) until tokenonce counted
    /// one more successful reload.
    pub async fn reload(&self, config: &str) {
        const SUCCESS: &str = r#"tokenonce_config_reloads_total{result="success"}"#;
        let before = self.metric(SUCCESS).await;
        self.reconfigure(config);
        self.assert_reaches(SUCCESS, before + 1.0).await;
    }

    /// [`Self::metric_reaches`] bounded by `within`.
    pub async fn metric_reaches_within(&self, series: &str, value: f64, within: Duration) -> f64 {
        let deadline = Instant::now() + within;
        loop {
            let got = self.metric(series).await;
            if got == value || Instant::now() >= deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (bounded: 10 s) until the proxy reports `endpoint` (`host:port`) of `pool`
    /// healthy (or not), as its health polls see it.
    pub async fn wait_health(&self, pool: &str, endpoint: &str, healthy: bool) {
        let series = format!(r#"tokenonce_upstream_healthy{{endpoint="{endpoint}",pool="{pool}"}}"#);
        let want = f64::from(u8::from(healthy));
        assert_eq!(self.metric_reaches_within(&series, want, Duration::from_secs(10)).await, want, "{series}");
    }
}

impl Drop for TokenOnce {
    fn drop(&mut self) {
        match &mut self.run {
            // `Running`'s own drop then waits for the server thread.
            Run::InProcess(running) => running.stop(Stop::Fast),
            Run::Child { child, .. } => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The `[server]` and `[upstream]` sections the harness puts above a test's config.
fn server_section(settings: &Settings) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nthreads = {}\ngrace_period_seconds = 1\ngraceful_shutdown_timeout_seconds = 1\n{}\n[upstream]\nhealth_interval_ms = {}\n{}\n\n",
        settings.threads, settings.server_extra, settings.health_interval_ms, settings.upstream_extra
    )
}

/// Writes the completed config into a fresh directory: (directory, file, the added sections).
fn write_config(config: &str, settings: &Settings) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenonce.toml");
    let section = server_section(settings);
    std::fs::write(&path, format!("{section}{config}")).unwrap();
    (dir, path, section)
}

/// The `(client, admin)` addresses of tokenonce's `tokenonce listening listen=… admin=…` line.
fn listening_line(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    if !line.contains("tokenonce listening") {
        return None;
    }
    let field = |name: &str| {
        line.split_whitespace().find_map(|word| word.strip_prefix(name)).and_then(|v| v.parse::<SocketAddr>().ok())
    };
    Some((field("listen=")?, field("admin=")?))
}

/// Installs the test process's tracing subscriber once (tokenonce and pingora log through it).
/// It prints through libtest's capture: a test's output holds what the instances it started
/// logged, since their threads inherit the capture of the test thread that spawned them.
fn init_test_logging(filter: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("TOKENONCE_LOG")
            .or_else(|_| tracing_subscriber::EnvFilter::try_new(filter))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_test_writer().try_init();
    });
}

/// Spawns `command` (stdin and stdout null) with its stderr copied line by line into the file
/// `log`, by a thread that ends when the program closes its stderr (exits). Returns the child
/// and a channel that carries the first value `pick` finds in a line; it closes empty if
/// stderr ends first. Fails only if the program cannot be started.
pub fn spawn_logged<T: Send + 'static>(
    mut command: Command,
    log: &Path,
    pick: impl Fn(&str) -> Option<T> + Send + 'static,
) -> std::io::Result<(Child, oneshot::Receiver<T>)> {
    let mut file = std::fs::File::create(log)?;
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = oneshot::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        let mut line = Vec::new();
        // Bounded by the child's life: read_until returns 0 at EOF, when it has exited.
        while matches!(stderr.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let _ = file.write_all(&line);
            if tx.is_some() {
                if let Some(found) = pick(&String::from_utf8_lossy(&line)) {
                    let _ = tx.take().unwrap().send(found);
                }
            }
            line.clear();
        }
    });
    Ok((child, rx))
}

/// A loopback address that refuses connections while this value lives: the socket is bound,
/// so nothing else can take the port, but never listens, so every connect is answered with
/// a reset.
pub struct RefusedAddr {
    _socket: tokio::net::TcpSocket,
    /// The address.
    pub addr: SocketAddr,
}

impl RefusedAddr {
    /// Binds a fresh `127.0.0.1:0`.
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        Self { _socket: socket, addr }
    }
}

/// A raw engine on loopback: accepts up to `connections` connections and hands each to
/// `serve`. Returns its `host:port`.
pub async fn raw_engine<F, Fut>(connections: usize, serve: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        for _ in 0..connections {
            let Ok((sock, _)) = listener.accept().await else { return };
            tokio::spawn(serve(sock));
        }
    });
    addr
}

/// A client speaking HTTP/1.1 by hand on a socket with a 4 KB receive buffer, so it can stop
/// reading while tokenonce still has much to write.
pub struct SlowClient(tokio::net::TcpStream);

impl SlowClient {
    /// Connects to `url` (`http://host:port`) and POSTs `body` as JSON to `path`.
    pub async fn post(url: &str, path: &str, body: &serde_json::Value) -> Self {
        use tokio::io::AsyncWriteExt;
        let body = serde_json::to_vec(body).unwrap();
        let addr: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut client = socket.connect(addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        client.write_all(head.as_bytes()).await.unwrap();
        client.write_all(&body).await.unwrap();
        Self(client)
    }

    /// The first bytes of the answer (at most 64), read within `within`.
    pub async fn first_bytes(&mut self, within: Duration) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut first = [0u8; 64];
        let n = tokio::time::timeout(within, self.0.read(&mut first)).await.unwrap().unwrap();
        first[..n].to_vec()
    }

    /// Reads on, discarding, until the connection ends (true: tokenonce cut or closed it) or
    /// `within` passes (false).
    pub async fn drained(&mut self, within: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut sink = vec![0u8; 1 << 16];
        tokio::time::timeout(within, async {
            loop {
                match self.0.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }
}

/// Asserts a config was refused with problems at exactly `keys`, in order.
pub fn assert_problem_keys(err: &tokenonce::config::ConfigError, keys: &[&str]) {
    let got: Vec<&str> = err.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(got, keys, "{:#?}", err.problems);
}

/// A model folder: a word-level `tokenizer.json` that knows `alpha` and `bravo` by the fake
/// engine's ids (any other word is `<unk>`) and has ChatML's two markers as added tokens, and a
/// `tokenizer_config.json` with a ChatML chat template.
pub fn write_local_model(dir: &std::path::Path) {
    let mut vocab = serde_json::Map::new();
    for w in ["alpha", "bravo"] {
        vocab.insert(w.to_owned(), serde_json::json!(fake_tokenize(w)[0]));
    }
    vocab.insert("<unk>".into(), serde_json::json!(150_000));
    let added = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added(151_644, "<|im_start|>"), added(151_645, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::json!({"chat_template": template}).to_string())
        .unwrap();
}

/// A model folder of the Qwen3 family: its chat template as recorded, a word tokenizer with
/// its added tokens (no BOS added).
pub fn write_qwen3_model(dir: &Path) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/render/qwen3/tokenizer_config.json");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    let added: Vec<(u32, String)> = config["added_tokens_decoder"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(id, t)| (id.parse().unwrap(), t["content"].as_str().unwrap().to_owned()))
        .collect();
    std::fs::write(dir.join("tokenizer.json"), word_tokenizer(&added, None).to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A model folder of a Llama-3-like family: `bos_token` in the template, and a tokenizer
/// whose post-processor adds BOS to a completions prompt (so `""` has one id).
pub fn write_bos_family_model(dir: &Path) {
    let added = [
        (128_000, "<|begin_of_text|>"),
        (128_006, "<|start_header_id|>"),
        (128_007, "<|end_header_id|>"),
        (128_009, "<|eot_id|>"),
    ]
    .map(|(id, t)| (id, t.to_owned()));
    let tokenizer = word_tokenizer(&added, Some((128_000, "<|begin_of_text|>")));
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    let config =
        serde_json::json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A whitespace word tokenizer with `added` special tokens, adding `bos` to single inputs
/// when given.
pub fn word_tokenizer(added: &[(u32, String)], bos: Option<(u32, &str)>) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["Hello", "there!", "You", "are", "terse.", "Hi", "user", "system", "assistant"].iter().enumerate() {
        vocab.insert((*w).to_owned(), serde_json::json!(1000 + i));
    }
    vocab.insert("<unk>".into(), serde_json::json!(0));
    // Qwen3's vocabulary size (the bound legs' ids are checked against): the fake engine's
    // output ids are all below it.
    vocab.insert("<reserved>".into(), serde_json::json!(151_935));
    let added: Vec<serde_json::Value> = added
        .iter()
        .map(|(id, content)| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let post_processor = bos.map_or(serde_json::Value::Null, |(id, token)| {
        serde_json::json!({"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {token: {"id": token, "ids": [id], "tokens": [token]}}})
    });
    serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": post_processor, "decoder": null,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}})
}

/// A config with one prefill fake and one decode fake on route `pd`.
pub fn pd_config(prefill: &FakeVllm, decode: &FakeVllm, route_extra: &str) -> String {
    pools_config(&[prefill.host_port()], &[decode.host_port()], route_extra)
}

/// A config with pools `prefill` and `decode` of the endpoints (`host:port`) given, in that
/// order (round robin), on orchestrate route `pd` over every API path.
pub fn pools_config(prefills: &[String], decodes: &[String], route_extra: &str) -> String {
    let list = |e: &[String]| e.iter().map(|e| format!("\"{e}\"")).collect::<Vec<_>>().join(", ");
    format!(
        "[pools.prefill]\nendpoints = [{}]\n\n[pools.decode]\nendpoints = [{}]\n\n[[routes]]\nname = \"pd\"\nmode = \"orchestrate\"\ndecode_pool = \"decode\"\nprefill = {{ pool = \"prefill\" }}\n{route_extra}\n[routes.match]\npaths = [\"/v1/chat/completions\", \"/v1/completions\", \"/v1/responses\", \"/v1/messages\", \"/inference/v1/generate\"]\n",
        list(prefills),
        list(decodes)
    )
}

/// Starts one fake per config, in order.
pub async fn fakes<const N: usize>(configs: [FakeConfig; N]) -> [FakeVllm; N] {
    let mut started = Vec::with_capacity(N);
    for config in configs {
        started.push(FakeVllm::start(config).await);
    }
    let Ok(started) = started.try_into() else { unreachable!("one fake per config") };
    started
}

/// The series of `tokenonce_token_reuse_total` for `route`, `result` and `reason`.
pub fn reuse_series(route: &str, result: &str, reason: &str) -> String {
    format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="{result}",route="{route}"}}"#)
}

/// Asserts `text` is tokenonce's OpenAI-shaped error with `code` (a message and a type), naming
/// no internal address.
pub fn assert_openai_error(text: &str, code: &str) {
    let json: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    assert_eq!(json["error"]["code"], code, "{text}");
    assert!(json["error"]["message"].is_string() && json["error"]["type"].is_string(), "{text}");
    assert!(!text.contains("127.0.0.1"), "an internal address in {text}");
}

/// Starts a prefill fake, a decode fake and tokenonce (in-process) between them.
pub async fn pd_setup(prefill: FakeConfig, decode: FakeConfig, route_extra: &str) -> (FakeVllm, FakeVllm, TokenOnce) {
    let p = FakeVllm::start(prefill).await;
    let d = FakeVllm::start(decode).await;
    let proxy = TokenOnce::start(&pd_config(&p, &d, route_extra)).await;
    (p, d, proxy)
}

/// A plain chat request body.
pub fn chat_body(user: &str, extra: serde_json::Value) -> serde_json::Value {
    let body = serde_json::json!({
        "model": "tiny-qwen3",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}],
        "max_tokens": 5,
        "temperature": 0
    });
    with_extra(body, extra)
}

/// `body` with the members of `extra` added (replacing those of the same name).
pub fn with_extra(mut body: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// The JSON of every `data:` event but `[DONE]`; each must parse (no half event).
pub fn whole_events(text: &str) -> Vec<serde_json::Value> {
    text.split("\n\n")
        .filter(|e| !e.is_empty() && *e != "data: [DONE]")
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an event: {e:?} in {text}"));
            serde_json::from_str(data).unwrap_or_else(|_| panic!("half an event: {e:?} in {text}"))
        })
        .collect()
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

/// `n` deterministic lowercase words of 3–7 letters (about 6 bytes each with the space), for
/// prompts of a chosen size.
pub fn words(n: usize, seed: u64) -> String {
    let mut state = seed | 1;
    let mut text = String::with_capacity(n * 7);
    for i in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            text.push(' ');
        }
        for k in 0..3 + (state % 5) as usize {
            text.push(char::from(b'a' + ((state >> (8 + 5 * k)) % 26) as u8));
        }
    }
    text
}

/// A number for a bench table: 3 significant-ish places (`0.42`, `12.3`, `456`), `–` for NaN.
pub fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// [`fmt_num`] with its sign always shown (`+0.42`, `-1.10`).
pub fn fmt_signed(v: f64) -> String {
    if v >= 0.0 {
        format!("+{}", fmt_num(v))
    } else {
        fmt_num(v)
    }
}
