//! tokenonce under test: started in this process (`server::start`) or as a child process,
//! both on listeners bound to port 0, with a config completed by the harness; reloads,
//! termination, readiness, and its metrics read through `crate::metrics`.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokenonce::server::{self, Listeners, Running, Signals, Stop};
use tokio::sync::oneshot;

use crate::client::post_chat;
use crate::metrics;

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

    /// Starts `binary`, the `tokenonce` binary cargo built for the test, as a child process
    /// (see [`Self::spawn`]). Cargo names it to tokenonce's own tests only, so they pass it:
    /// `env!("CARGO_BIN_EXE_tokenonce")`.
    pub async fn start_binary(binary: &str, config: &str) -> Self {
        Self::spawn(Path::new(binary), config, &Settings::default()).await
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
        metrics::scrape(&self.admin).await
    }

    /// POSTs a plain chat ([`crate::chat_body`] of `user`) to the client listener: status and
    /// body.
    pub async fn chat(&self, user: &str) -> (u16, String) {
        self.chat_with(user, json!({}), &[]).await
    }

    /// [`Self::chat`] with the members of `extra` in the body and `headers`.
    pub async fn chat_with(&self, user: &str, extra: Value, headers: &[(&str, &str)]) -> (u16, String) {
        post_chat(&self.url, user, extra, headers).await
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
        metrics::sample(&self.metrics().await, series)
    }

    /// The sum of every sample of `family`.
    pub async fn family_sum(&self, family: &str) -> f64 {
        metrics::family_sum(&self.metrics().await, family)
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
        metrics::reaches_within(&self.admin, series, value, within).await
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
