//! Config reloads: the file is read and validated again; a good one replaces the state for new
//! requests (in-flight ones keep theirs), a bad one is rejected with every problem logged and
//! the running config kept. Three triggers, one path ([`Reloader::reload`]): SIGHUP (this
//! module's [`Reloader`] service), `POST /admin/reload` (the admin listener) and, opted into
//! with `server.config_watch_interval_ms`, a watch of the file ([`ConfigWatch`]). Each is
//! counted in `config_reloads_total{result}` and recorded in `config_last_reload_success` and
//! `config_last_reload_timestamp_seconds`.

use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::app::{AppError, SharedApp};
use crate::config::{self, Config, ConfigError};
use crate::metrics::Reload;

label_enum! {
    /// What asked for a reload (its log lines name it).
    Trigger {
        /// SIGHUP.
        Signal => "signal",
        /// `POST /admin/reload`.
        Admin => "admin",
        /// The file watch saw the file change.
        Watch => "watch",
        /// The in-process handle (`Running::reload`).
        Handle => "handle",
    }
}

/// A reload that was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The settings the new file changes that keep their start values until a restart.
    pub restart_needed: Vec<&'static str>,
}

/// Why a reload was refused; the running config stays.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Running on the embedded default: there is no file to read again.
    #[error("running on the embedded default config: there is no file to reload (start with --config FILE)")]
    NoFile,
    /// The file has problems (or cannot be read).
    #[error(transparent)]
    Problems(#[from] ConfigError),
    /// The file is valid but the state could not be built from it.
    #[error("the new config could not be put in place: {0}")]
    State(#[from] AppError),
}

/// Reloads the config file into the shared state; as a background service, on SIGHUP.
/// Clones share one lock, so reloads from several triggers run one at a time.
#[derive(Clone)]
pub struct Reloader {
    /// The config file; `None` when running on the embedded default (nothing to reload).
    path: Option<PathBuf>,
    /// The state to replace.
    app: SharedApp,
    /// Held for a whole reload: two at once could store the older file last.
    one_at_a_time: Arc<Mutex<()>>,
}

impl Reloader {
    /// A reloader of `path` (`None`: the embedded default) into `app`.
    pub fn new(path: Option<PathBuf>, app: SharedApp) -> Self {
        Self { path, app, one_at_a_time: Arc::default() }
    }

    /// The config file, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Reloads once; returns whether the new config was applied.
    pub fn reload_now(&self) -> bool {
        self.reload(Trigger::Handle).is_ok()
    }

    /// Reads the file again and applies it whole, or keeps the running config: every
    /// problem logged, the result counted. Blocks while the file and what it names load.
    ///
    /// # Errors
    /// [`Refused`]: why the running config was kept.
    pub fn reload(&self, trigger: Trigger) -> Result<Applied, Refused> {
        let _one = self.one_at_a_time.lock();
        let current = self.app.load_full();
        let outcome = self.apply(&current, trigger);
        current.metrics.reloads.record(if outcome.is_ok() { Reload::Success } else { Reload::Failure });
        outcome
    }

    fn apply(&self, current: &crate::app::App, trigger: Trigger) -> Result<Applied, Refused> {
        let Some(path) = &self.path else {
            tracing::warn!(%trigger, "reload refused: running on the embedded default config");
            return Err(Refused::NoFile);
        };
        let file = path.display();
        let new = config::load(path).inspect_err(|e| {
            for p in &e.problems {
                tracing::error!(%trigger, file = %e.source_name, problem = %p, "config reload rejected");
            }
        })?;
        let restart_needed = fixed_settings_changed(&current.config, &new.config);
        let next = current.reload(new).inspect_err(|e| {
            tracing::error!(%trigger, %file, error = %e, "config reload rejected");
        })?;
        self.app.store(Arc::new(next));
        tracing::info!(%trigger, %file, "config reloaded");
        if !restart_needed.is_empty() {
            tracing::warn!(
                settings = %restart_needed.join(", "),
                "config reloaded, but these settings change only on restart: they keep their start values until then"
            );
        }
        Ok(Applied { restart_needed })
    }
}

/// The settings that differ between `old` and `new` and a reload cannot change, by key path:
/// listeners and threads, the shutdown timings, the log filter and format, the file watch, the
/// connection and health-poll timings of the upstream client, the cache bounds and `[tracing]`
/// (the TLS listener's certificate is not fixed: it is read again).
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
        ("server.config_watch_interval_ms", a.config_watch_interval_ms != b.config_watch_interval_ms),
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
                    let _ = self.reload(Trigger::Signal);
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// The config file as the watch last read it: where its path led (every symlink followed) and
/// what it held.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    /// The path with every symlink resolved: in a Kubernetes ConfigMap volume
    /// `DIR/..2026_12_03_10_00_00.123/config.toml`, which changes with each update.
    target: PathBuf,
    /// The file's bytes (a config is a few KB).
    content: Vec<u8>,
}

impl Snapshot {
    /// Reads `path` now; `None` while it cannot be read (missing in the middle of an update).
    fn read(path: &Path) -> Option<Self> {
        let target = std::fs::canonicalize(path).ok()?;
        let content = std::fs::read(&target).ok()?;
        Some(Self { target, content })
    }
}

/// What the watch knows between polls.
#[derive(Debug, Default)]
struct Polls {
    /// The file as last loaded (at the start, or by the last reload the watch made, applied or
    /// not: a bad file is tried once, and again only when it changes).
    loaded: Option<Snapshot>,
    /// A change seen once, reloaded when the next poll sees it unchanged (a file being
    /// written is not read half way).
    settling: Option<Snapshot>,
}

impl Polls {
    /// Takes in one poll's reading; true when the file should be reloaded now.
    fn saw(&mut self, now: Option<Snapshot>) -> bool {
        let Some(now) = now else { return false };
        if self.loaded.as_ref() == Some(&now) {
            self.settling = None;
            return false;
        }
        if self.settling.as_ref() == Some(&now) {
            self.loaded = self.settling.take();
            return true;
        }
        self.settling = Some(now);
        false
    }
}

/// The opt-in watch of the config file (`server.config_watch_interval_ms`): every interval it
/// reads the file through its path (following the symlinks again each time) and reloads, as
/// SIGHUP does, once a change has held for one more interval. Polling rather than inotify:
/// Kubernetes updates a ConfigMap volume by swapping the `..data` symlink to a new directory,
/// which an inotify watch on the file (or on what it resolved to) never sees; a poll of a
/// few KB every few seconds sees every kind of update (the swap, an in-place rewrite, a
/// rename over the file) and needs no dependency. A change of target alone (the ConfigMap's
/// other keys changed) reloads too, so files beside the config in the same volume are read
/// again.
pub struct ConfigWatch {
    reloader: Reloader,
    interval: Duration,
    /// The file as the start loaded it (read when the watch was made).
    started_with: Option<Snapshot>,
}

impl ConfigWatch {
    /// A watch of the reloader's file every `interval`, taking the file as it is now as the
    /// loaded one; `None` when there is no file.
    pub fn new(reloader: Reloader, interval: Duration) -> Option<Self> {
        let started_with = Snapshot::read(reloader.path()?);
        Some(Self { reloader, interval, started_with })
    }
}

#[async_trait]
impl BackgroundService for ConfigWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(path) = self.reloader.path().map(Path::to_path_buf) else { return };
        tracing::info!(file = %path.display(), interval_ms = self.interval.as_millis(), "watching the config file");
        let mut polls = Polls { loaded: self.started_with.clone(), settling: None };
        loop {
            tokio::select! {
                () = tokio::time::sleep(self.interval) => {}
                _ = shutdown.changed() => return,
            }
            let read = path.clone();
            let Ok(now) = tokio::task::spawn_blocking(move || Snapshot::read(&read)).await else { continue };
            if polls.saw(now) {
                let reloader = self.reloader.clone();
                // Logged and counted inside; a bad file waits for its next change.
                let _ = tokio::task::spawn_blocking(move || reloader.reload(Trigger::Watch)).await;
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
            "[server]\nlisten = \"127.0.0.1:7\"\nthreads = 3\nlog_level = \"debug\"\nconfig_watch_interval_ms = 500\n[upstream]\nconnect_timeout_ms = 7\nidle_timeout_ms = 7\nhealth_interval_ms = 7\n[cache]\nttl_ms = 7\n{BASE}"
        );
        assert_eq!(
            fixed_settings_changed(&old, &parsed(&changed)),
            [
                "server.listen",
                "server.threads",
                "server.log_level",
                "server.config_watch_interval_ms",
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

    fn snap(target: &str, content: &str) -> Option<Snapshot> {
        Some(Snapshot { target: target.into(), content: content.into() })
    }

    #[test]
    fn the_watch_reloads_a_change_once_it_has_held_for_a_poll() {
        let mut polls = Polls { loaded: snap("/c/..a/config.toml", "one"), settling: None };
        assert!(!polls.saw(snap("/c/..a/config.toml", "one")), "unchanged");
        assert!(!polls.saw(None), "unreadable for a moment: nothing");
        assert!(!polls.saw(snap("/c/..a/config.toml", "tw")), "a change is seen once first");
        assert!(!polls.saw(snap("/c/..a/config.toml", "two")), "still being written");
        assert!(polls.saw(snap("/c/..a/config.toml", "two")), "held for a poll: reloaded");
        assert!(!polls.saw(snap("/c/..a/config.toml", "two")), "and only once, applied or not");
        assert!(!polls.saw(snap("/c/..b/config.toml", "two")));
        assert!(polls.saw(snap("/c/..b/config.toml", "two")), "a new target alone reloads (files beside it)");
        assert!(!polls.saw(snap("/c/..c/config.toml", "three")));
        assert!(!polls.saw(snap("/c/..b/config.toml", "two")), "back to what is loaded: nothing pending");
        assert!(!polls.saw(snap("/c/..b/config.toml", "two")));
    }

    #[test]
    fn a_snapshot_follows_the_configmap_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("..2026_a")).unwrap();
        std::fs::write(root.join("..2026_a/config.toml"), "a").unwrap();
        std::os::unix::fs::symlink("..2026_a", root.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.toml", root.join("config.toml")).unwrap();
        let seen = Snapshot::read(&root.join("config.toml")).unwrap();
        assert!(seen.target.ends_with("..2026_a/config.toml"), "{}", seen.target.display());
        assert_eq!(seen.content, b"a");
        assert!(Snapshot::read(&root.join("missing.toml")).is_none());
    }
}
