//! Wires a validated config into a pingora server: the client listener, the admin listener,
//! the health poller and the SIGHUP reloader, with shutdown timings from the config.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use pingora::proxy::http_proxy_service_with_name;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;

use crate::config::Config;
use crate::proxy::{Admin, Proxy};
use crate::reload::Reloader;
use crate::upstream::health::HealthPoller;
use crate::{App, SharedApp};

/// Why the server could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The state could not be built (metrics, routes).
    #[error(transparent)]
    App(#[from] crate::AppError),
    /// pingora refused its configuration.
    #[error("server configuration: {0}")]
    Conf(String),
}

/// A ready-to-run pingora server.
///
/// # Errors
/// [`BuildError`] when metrics or pingora's configuration fail.
pub fn build(config: Config, path: Option<PathBuf>) -> Result<Server, BuildError> {
    let mut conf = ServerConf::new().ok_or_else(|| BuildError::Conf("default ServerConf".into()))?;
    conf.threads = config.server().threads();
    conf.grace_period_seconds = Some(config.server().grace_period_seconds());
    conf.graceful_shutdown_timeout_seconds = Some(config.server().graceful_shutdown_timeout_seconds());
    conf.upgrade_sock = format!("/tmp/tokenonce-upgrade-{}.sock", std::process::id());
    conf.pid_file = format!("/tmp/tokenonce-{}.pid", std::process::id());
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let listen = config.server().listen().to_owned();
    let admin_listen = config.server().admin_listen().to_owned();
    let interval = config.upstream().health_interval();
    let app: SharedApp = Arc::new(ArcSwap::from_pointee(App::new(config)?));

    let poller = HealthPoller { app: Arc::clone(&app), interval, on_tick: Box::new(App::sweep_cache) };
    let reloader = Reloader { path, app: Arc::clone(&app) };

    let mut proxy = http_proxy_service_with_name(&server.configuration, Proxy { app: Arc::clone(&app) }, "tokenonce");
    proxy.add_tcp(&listen);
    let mut admin =
        http_proxy_service_with_name(&server.configuration, Admin { app: Arc::clone(&app) }, "tokenonce-admin");
    admin.threads = Some(1);
    admin.add_tcp(&admin_listen);

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(background_service("health", poller));
    server.add_service(background_service("reload", reloader));
    Ok(server)
}
