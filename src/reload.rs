//! Config reload on SIGHUP: the file is read and validated again; a good one replaces the
//! state for new requests (in-flight ones keep theirs), a bad one is rejected with every
//! problem logged and the running config kept. Counted in `config_reloads_total{result}`.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::{self, Config};
use crate::metrics::Reload;
use crate::SharedApp;

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
                warn_fixed_settings(&current.config, &new);
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

/// Listeners, threads and cache bounds are fixed at start (the TLS listener's certificate is
/// not: it is read again); say so when a reload changes them.
fn warn_fixed_settings(old: &Config, new: &Config) {
    if old.server().listen() != new.server().listen()
        || old.server().admin_listen() != new.server().admin_listen()
        || old.server().threads() != new.server().threads()
        || old.server().tls().map(|t| t.listen()) != new.server().tls().map(|t| t.listen())
    {
        tracing::warn!("listeners and threads change only on restart; the new values are ignored until then");
    }
    if old.cache().capacity_bytes() != new.cache().capacity_bytes() || old.cache().ttl() != new.cache().ttl() {
        tracing::warn!("cache bounds change only on restart");
    }
    if old.tracing() != new.tracing() {
        tracing::warn!("[tracing] changes only on restart");
    }
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
