//! Wires a validated config into a pingora server: the client listener, the admin listener
//! and the health poller, with shutdown timings from the config.

use std::sync::Arc;

use pingora::proxy::http_proxy_service_with_name;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;

use crate::config::Config;
use crate::proxy::{Admin, Proxy};
use crate::upstream::health::HealthPoller;
use crate::App;

/// Why the server could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Metrics registration failed.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// pingora refused its configuration.
    #[error("server configuration: {0}")]
    Conf(String),
}

/// A ready-to-run pingora server.
///
/// # Errors
/// [`BuildError`] when metrics or pingora's configuration fail.
pub fn build(config: Config) -> Result<Server, BuildError> {
    let mut conf = ServerConf::new().ok_or_else(|| BuildError::Conf("default ServerConf".into()))?;
    conf.threads = config.server.threads;
    conf.grace_period_seconds = Some(config.server.grace_period_seconds);
    conf.graceful_shutdown_timeout_seconds = Some(config.server.graceful_shutdown_timeout_seconds);
    conf.upgrade_sock = format!("/tmp/tokenonce-upgrade-{}.sock", std::process::id());
    conf.pid_file = format!("/tmp/tokenonce-{}.pid", std::process::id());
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let listen = config.server.listen.clone();
    let admin_listen = config.server.admin_listen.clone();
    let interval = config.upstream.health_interval;
    let app = Arc::new(App::new(config)?);

    let mut decode_pools: Vec<usize> = app.routes.routes().iter().map(|r| r.decode_pool).collect();
    decode_pools.push(app.passthrough_pool);
    decode_pools.sort_unstable();
    decode_pools.dedup();
    let poller = HealthPoller {
        pools: app.pools.clone(),
        decode_pools,
        client: Arc::clone(&app.client),
        metrics: app.metrics.clone(),
        interval,
        on_tick: {
            let app = Arc::clone(&app);
            Box::new(move || crate::proxy::relay::sweep_cache(&app))
        },
    };

    let mut proxy = http_proxy_service_with_name(&server.configuration, Proxy { app: Arc::clone(&app) }, "tokenonce");
    proxy.add_tcp(&listen);
    let mut admin =
        http_proxy_service_with_name(&server.configuration, Admin { app: Arc::clone(&app) }, "tokenonce-admin");
    admin.threads = Some(1);
    admin.add_tcp(&admin_listen);
    let health = background_service("health", poller);

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(health);
    Ok(server)
}
