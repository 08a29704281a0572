//! Config reload on SIGHUP: the file is read and validated again; a good one replaces the
//! state for new requests (in-flight ones keep theirs), a bad one is rejected with every
//! problem logged and the running config kept. Counted in `config_reloads_total{result}`.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::app::SharedApp;
use crate::config::{self, Config};
use crate::metrics::Reload;

/// Listens for SIGHUP and reloads `path`.
pub struct Reloader {
    /// The config file; `None` when running on the embedded default (nothing to reload).
    pub path: Option<PathBuf>,
    /// The state to replace.
    pub app: SharedApp,
}

impl Reloader {
    /// Reloads once; returns whether the new config was applied.
    pub fn reload_now(&self) -> bool {
        let current = self.app.load_full();
        let Some(path) = &self.path else {
            tracing::warn!("reload ignored: running on the embedded default config");
            current.metrics.reload(Reload::Failure);
            return false;
        };
        match config::load(path) {
            Ok(new) => {
                warn_fixed_settings(&current.config, &new.config);
                match current.reload(new) {
                    Ok(next) => {
                        self.app.store(Arc::new(next));
                        current.metrics.reload(Reload::Success);
                        tracing::info!(file = %path.display(), "config reloaded");
                        true
                    }
                    Err(e) => {
                        tracing::error!(file = %path.display(), error = %e, "config reload rejected");
                        current.metrics.reload(Reload::Failure);
                        false
                    }
                }
            }
            Err(e) => {
                for p in &e.problems {
                    tracing::error!(file = %e.source_name, problem = %p, "config reload rejected");
                }
                current.metrics.reload(Reload::Failure);
                false
            }
        }
    }
}

/// Says which settings of a reload keep their start values: listeners and threads, the
/// shutdown timings, the log filter and format, the connection and health-poll timings of
/// the upstream client, the cache bounds and `[tracing]` (the TLS listener's certificate is
/// not fixed: it is read again). Everything else takes effect for new requests.
fn warn_fixed_settings(old: &Config, new: &Config) {
    let fixed = fixed_settings_changed(old, new);
    if !fixed.is_empty() {
        tracing::warn!(
            settings = %fixed.join(", "),
            "config reloaded, but these settings change only on restart: they keep their start values until then"
        );
    }
}

/// The settings that differ between `old` and `new` and a reload cannot change, by key path.
fn fixed_settings_changed(old: &Config, new: &Config) -> Vec<&'static str> {
    let (a, b) = (&old.server, &new.server);
    let (ua, ub) = (&old.upstream, &new.upstream);
    let checks = [
        ("server.listen", a.listen != b.listen),
        ("server.admin_listen", a.admin_listen != b.admin_listen),
        ("server.threads", a.threads != b.threads),
        ("server.work_stealing", a.work_stealing != b.work_stealing),
        ("server.grace_period_seconds", a.grace_period_seconds != b.grace_period_seconds),
        (
            "server.graceful_shutdown_timeout_seconds",
            a.graceful_shutdown_timeout_seconds != b.graceful_shutdown_timeout_seconds,
        ),
        ("server.log_level", a.log_level != b.log_level),
        ("server.log_format", a.log_format != b.log_format),
        ("server.tls.listen", a.tls.as_ref().map(|t| &t.listen) != b.tls.as_ref().map(|t| &t.listen)),
        ("upstream.connect_timeout_ms", ua.connect_timeout_ms != ub.connect_timeout_ms),
        ("upstream.idle_timeout_ms", ua.idle_timeout_ms != ub.idle_timeout_ms),
        ("upstream.health_interval_ms", ua.health_interval_ms != ub.health_interval_ms),
        ("cache.capacity_bytes", old.cache.capacity_bytes != new.cache.capacity_bytes),
        ("cache.ttl_ms", old.cache.ttl_ms != new.cache.ttl_ms),
        ("tracing", old.tracing != new.tracing),
    ];
    checks.into_iter().filter(|(_, changed)| *changed).map(|(key, _)| key).collect()
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; reload disabled");
                return;
            }
        };
        loop {
            tokio::select! {
                got = hangup.recv() => {
                    if got.is_none() { return; }
                    self.reload_now();
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Config {
        Config::from_toml(text, "test.toml").unwrap_or_else(|e| panic!("{:?}", e.problems))
    }

    const BASE: &str = "[pools.decode]\nendpoints = [\"127.0.0.1:1\"]\n\n[[routes]]\nname = \"r\"\nmode = \"passthrough\"\ndecode_pool = \"decode\"\n[routes.match]\npaths = [\"/v1/chat/completions\"]\n";

    #[test]
    fn every_fixed_setting_a_reload_changes_is_named() {
        let old = parsed(BASE);
        assert!(fixed_settings_changed(&old, &parsed(BASE)).is_empty());
        let changed = format!(
            "[server]\nlisten = \"127.0.0.1:7\"\nthreads = 3\nlog_level = \"debug\"\n[upstream]\nconnect_timeout_ms = 7\nidle_timeout_ms = 7\nhealth_interval_ms = 7\n[cache]\nttl_ms = 7\n{BASE}"
        );
        assert_eq!(
            fixed_settings_changed(&old, &parsed(&changed)),
            [
                "server.listen",
                "server.threads",
                "server.log_level",
                "upstream.connect_timeout_ms",
                "upstream.idle_timeout_ms",
                "upstream.health_interval_ms",
                "cache.ttl_ms"
            ]
        );
    }

    #[test]
    fn settings_a_reload_applies_are_not_named() {
        let old = parsed(BASE);
        let changed = format!("[server]\nmax_header_count = 50\n[upstream]\neject_after_failures = 9\n{BASE}");
        assert!(fixed_settings_changed(&old, &parsed(&changed)).is_empty());
    }
}
