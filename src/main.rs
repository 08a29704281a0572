//! The `tokenonce` binary: parse the CLI, load and validate the config, set up logging (and
//! trace export), bind the configured addresses, hand over to the server until a signal stops it.
//! `tokenonce check FILE` only validates; `tokenonce drain` calls this pod's `/drain` (a preStop
//! hook).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokenonce::config::{self, ConfigError, MissingFiles};
use tokenonce::server::{self, Listeners, Signals};

#[derive(Parser)]
#[command(
    name = "tokenonce",
    version,
    long_version = tokenonce::build::LONG_VERSION,
    about = "P/D sidecar for vLLM that tokenizes each prompt once",
    long_about = "P/D sidecar for vLLM that tokenizes each prompt once.\n\n\
        With no subcommand, tokenonce serves: clients on server.listen (OpenAI and Anthropic \
        APIs, proxied to the prefill and decode pools of the matching route), the admin \
        listener on server.admin_listen (/metrics, /healthz, /readyz, /drain, POST /admin/reload).",
    after_long_help = "Signals:\n  \
        SIGHUP   re-read --config; a valid file applies to new requests, an invalid one is \
        rejected with every problem logged (settings fixed at start are named in a warning); \
        POST /admin/reload and server.config_watch_interval_ms reload the same way\n  \
        SIGTERM  graceful shutdown within server.grace_period_seconds and \
        server.graceful_shutdown_timeout_seconds\n\n\
        Environment:\n  \
        TOKENONCE_LOG  log filter (tracing's EnvFilter syntax, e.g. info,tokenonce=debug); \
        overrides server.log_level\n\n\
        Exit status: 0 after a clean shutdown, 1 when the config is invalid or a listener \
        cannot be bound.\n\n\
        Run `tokenonce print-default` for the embedded config, `tokenonce check FILE` to \
        validate one, `tokenonce --config FILE drain --wait-seconds N` in a preStop hook."
)]
struct Cli {
    /// TOML config file (default: the embedded default, see `print-default`). Re-read on SIGHUP,
    /// `POST /admin/reload`, or a change when `server.config_watch_interval_ms` is set.
    #[arg(long, short, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config file and print every problem with its line and column.
    ///
    /// Also loads what the file names (TLS certificates and keys, tokenizers), as a start
    /// would. Prints `FILE: ok (N pools, M routes)` and exits 0, or one line per problem as
    /// `FILE:LINE:COL: KEY: MESSAGE` on stderr and exits 1. Starts nothing.
    Check {
        /// The config file to check.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Skip the files the config names that do not exist (a pod's Secret and model volume,
        /// checked outside the pod), and list them after `ok`. Files that exist are still
        /// loaded and checked.
        #[arg(long)]
        skip_missing_files: bool,
    },
    /// Drain this tokenonce: GET /drain on its admin listener with the admin token, then wait.
    ///
    /// For a preStop hook in an image without a shell: /readyz answers 503 at once, and the
    /// command returns when /drain does, after --wait-seconds. The admin listener and token
    /// file are those of --config (server.admin_listen, 0.0.0.0 called as 127.0.0.1, and
    /// server.admin_token_file) unless given. Exits 0 on 200, 1 otherwise (a refused token, no
    /// listener).
    Drain {
        /// Seconds /drain holds before answering (its wait_seconds; at most 300).
        #[arg(long, value_name = "N", default_value_t = 0)]
        wait_seconds: u64,
        /// The admin token file (default: server.admin_token_file of --config).
        #[arg(long, value_name = "FILE")]
        admin_token_file: Option<String>,
        /// The admin listener as host:port (default: server.admin_listen of --config).
        #[arg(long, value_name = "ADDR")]
        admin: Option<String>,
    },
    /// Print the embedded default config (what runs without --config) to stdout.
    ///
    /// Its pools are 127.0.0.1:8100 (prefill) and 127.0.0.1:8200 (decode); a starting point
    /// for a file of your own.
    PrintDefault,
}

fn report(err: &ConfigError) {
    eprintln!("{}: {} problem(s)", err.source_name, err.problems.len());
    for p in &err.problems {
        eprintln!("{}:{p}", err.source_name);
    }
}

/// `tokenonce drain`: the admin listener and token from the flags or the config's `[server]`.
fn drain(config: Option<&std::path::Path>, wait_seconds: u64, admin: Option<&str>, token: Option<&str>) -> ExitCode {
    // The config's settings only: the tokenizers and certificates it names are not loaded.
    let parsed = match config {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| ConfigError {
                source_name: path.display().to_string(),
                problems: vec![config::Problem { line: 0, column: 0, key: "(file)".into(), message: e.to_string() }],
            })
            .and_then(|text| config::Config::from_toml(&text, &path.display().to_string())),
        None => config::Config::from_toml(config::DEFAULT_TOML, "<embedded default>"),
    };
    let parsed = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            report(&e);
            return ExitCode::FAILURE;
        }
    };
    let drained = tokenonce::drain::Target::new(&parsed, admin, token).and_then(|target| {
        let body = target.drain(wait_seconds)?;
        Ok((target.addr, body))
    });
    match drained {
        Ok((addr, body)) => {
            println!("tokenonce drain: {addr} answered 200 ({body}) after holding up to {wait_seconds} s");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tokenonce drain: {e}");
            ExitCode::FAILURE
        }
    }
}

/// mimalloc: glibc's malloc serves the ~0.2–0.5 MB bodies of a long prompt from fresh mmaps,
/// so each such request paid page faults and zeroing for its buffers; mimalloc keeps and
/// reuses those pages (what it saved: docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check { file, skip_missing_files }) => {
            let missing = if skip_missing_files { MissingFiles::Skip } else { MissingFiles::Problem };
            return match config::load_with(&file, missing) {
                Ok(loaded) => {
                    let c = &loaded.config;
                    println!("{}: ok ({} pools, {} routes)", file.display(), c.pools.len(), c.routes.len());
                    for skipped in &loaded.resources.skipped {
                        println!("{}: skipped {} `{}`: no such file here", file.display(), skipped.key, skipped.path);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    report(&e);
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::Drain { wait_seconds, admin_token_file, admin }) => {
            return drain(cli.config.as_deref(), wait_seconds, admin.as_deref(), admin_token_file.as_deref());
        }
        Some(Command::PrintDefault) => {
            print!("{}", config::DEFAULT_TOML);
            return ExitCode::SUCCESS;
        }
        None => {}
    }
    let loaded = match &cli.config {
        Some(path) => config::load(path),
        None => config::embedded_default(),
    };
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(e) => {
            report(&e);
            return ExitCode::FAILURE;
        }
    };
    let telemetry = match tokenonce::telemetry::init(&loaded.config) {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("tokenonce: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = &loaded.config.server;
    tracing::info!(listen = %server.listen, admin = %server.admin_listen, routes = loaded.config.routes.len(), "tokenonce starting");
    let tls_listen = server.tls.as_ref().map(|t| t.listen.clone());
    let started = Listeners::bind(&server.listen, &server.admin_listen)
        .and_then(|listeners| listeners.with_tls(tls_listen.as_deref()))
        .and_then(|listeners| server::start(loaded, cli.config.clone(), listeners, Signals::Process));
    let running = match started {
        Ok(running) => running,
        Err(e) => {
            eprintln!("tokenonce: {e}");
            return ExitCode::FAILURE;
        }
    };
    let waited = running.wait();
    // Spans still buffered are sent before the process ends.
    telemetry.into_iter().for_each(tokenonce::telemetry::Telemetry::shutdown);
    match waited {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokenonce: {e}");
            ExitCode::FAILURE
        }
    }
}
