//! Runs tokenonce: wires a validated config into a pingora server (the client listener and
//! its TLS twin, the admin listener, the health poller, the SIGHUP reloader and the opt-in
//! config file watch, shutdown timings from the config)
//! on sockets the caller has already bound, and hands back a [`Running`] handle.
//!
//! The binary binds the configured addresses; tests and benches bind `127.0.0.1:0` and read
//! the ports the kernel chose from the handle, so no port is picked, released and re-bound.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::IntoRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use tokio::sync::watch;

use pingora::apps::ServerApp;
use pingora::listeners::tls::TlsSettings;
use pingora::proxy::http_proxy_service_with_name;
use pingora::server::configuration::ServerConf;
use pingora::server::{
    Fds, ListenFds, RunArgs, RuntimeOpts, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch,
    UnixShutdownSignalWatch,
};
use pingora::services::background::background_service;
use pingora::services::listening::Service as Listening;
use pingora::services::Service;

use crate::app::{App, SharedApp, Upkeep};
use crate::config::Loaded;
use crate::proxy::{Admin, Proxy};
use crate::reload::{ConfigWatch, Reloader};
use crate::tls::ListenerCert;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The state could not be built (metrics, routes).
    #[error(transparent)]
    App(#[from] crate::app::AppError),
    /// pingora refused its configuration.
    #[error("server configuration: {0}")]
    Conf(String),
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address as configured.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A bound socket could not be prepared (its address read, or made non-blocking).
    #[error("listening socket: {0}")]
    Socket(std::io::Error),
    /// The server thread could not be spawned.
    #[error("cannot spawn the server thread: {0}")]
    Thread(std::io::Error),
}

/// The server thread panicked instead of returning.
#[derive(Debug, thiserror::Error)]
#[error("the server thread panicked")]
pub struct Panicked;

/// The listening sockets tokenonce serves on, bound by the caller.
#[derive(Debug)]
pub struct Listeners {
    /// Client (OpenAI API) traffic.
    pub client: TcpListener,
    /// `/metrics`, `/healthz`, `/readyz`, `/drain`, `/admin/reload`.
    pub admin: TcpListener,
    /// Client traffic over TLS (`[server.tls]`), served beside the plain listener.
    pub tls: Option<TcpListener>,
}

impl Listeners {
    /// Binds both addresses (`ip:port`; port 0 lets the kernel choose a free port).
    ///
    /// # Errors
    /// [`StartError::Bind`] naming the address that failed.
    pub fn bind(client: &str, admin: &str) -> Result<Self, StartError> {
        let bind =
            |addr: &str| TcpListener::bind(addr).map_err(|source| StartError::Bind { addr: addr.to_owned(), source });
        Ok(Self { client: bind(client)?, admin: bind(admin)?, tls: None })
    }

    /// Also binds the TLS listener at `addr`, when there is one.
    ///
    /// # Errors
    /// [`StartError::Bind`] naming the address that failed.
    pub fn with_tls(mut self, addr: Option<&str>) -> Result<Self, StartError> {
        if let Some(addr) = addr {
            let socket =
                TcpListener::bind(addr).map_err(|source| StartError::Bind { addr: addr.to_owned(), source })?;
            self.tls = Some(socket);
        }
        Ok(self)
    }
}

/// What, besides the [`Running`] handle, stops or reloads the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signals {
    /// The process's signals, as the binary wants: SIGTERM (and SIGQUIT) graceful, SIGINT fast,
    /// SIGHUP reloads the config file.
    Process,
    /// Only the handle; no signal handler is installed. For tests and benches, where several
    /// servers share one process.
    HandleOnly,
}

/// How to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// As on SIGTERM: listeners close at once, in-flight requests get
    /// `grace_period_seconds`, then services get `graceful_shutdown_timeout_seconds`.
    Graceful,
    /// As on SIGINT: runtimes are stopped without waiting.
    Fast,
}

/// A running tokenonce. Dropping it stops the server fast and waits for it.
pub struct Running {
    client_addr: SocketAddr,
    admin_addr: SocketAddr,
    tls_addr: Option<SocketAddr>,
    stop: watch::Sender<Option<Stop>>,
    reloader: Reloader,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    /// Where the client listener accepts.
    pub fn client_addr(&self) -> SocketAddr {
        self.client_addr
    }

    /// Where the admin listener accepts.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Where the TLS client listener accepts, if there is one.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// Reads the config file again and applies it, exactly as SIGHUP does; returns whether it
    /// was applied (a bad file is rejected, logged and counted, and the running config kept).
    pub fn reload(&self) -> bool {
        self.reloader.reload_now()
    }

    /// [`Self::reload`], with what became of it.
    ///
    /// # Errors
    /// [`Refused`](crate::reload::Refused): why the running config was kept.
    pub fn try_reload(&self) -> Result<crate::reload::Applied, crate::reload::Refused> {
        self.reloader.reload(crate::reload::Trigger::Handle)
    }

    /// Asks the server to stop; returns at once (the first request wins).
    pub fn stop(&self, how: Stop) {
        self.stop.send_if_modified(|current| {
            let first = current.is_none();
            current.get_or_insert(how);
            first
        });
    }

    /// Waits until the server has stopped (after [`Self::stop`] or, with
    /// [`Signals::Process`], a signal).
    ///
    /// # Errors
    /// [`Panicked`] when the server thread panicked.
    pub fn wait(mut self) -> Result<(), Panicked> {
        self.join()
    }

    fn join(&mut self) -> Result<(), Panicked> {
        match self.thread.take() {
            Some(thread) => thread.join().map_err(|_| Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop(Stop::Fast);
            let _ = self.join();
        }
    }
}

/// Starts tokenonce on `listeners` and returns once the server thread runs; the sockets
/// already accept (the kernel queues connections until pingora's accept loops start).
/// `path` is the config file that reloads read (`None`: the embedded default, not reloadable).
///
/// # Errors
/// [`StartError`] when metrics, pingora's configuration, the sockets or the thread fail.
pub fn start(
    loaded: Loaded,
    path: Option<PathBuf>,
    listeners: Listeners,
    signals: Signals,
) -> Result<Running, StartError> {
    let client_addr = listeners.client.local_addr().map_err(StartError::Socket)?;
    let admin_addr = listeners.admin.local_addr().map_err(StartError::Socket)?;
    let tls_addr = listeners.tls.as_ref().map(TcpListener::local_addr).transpose().map_err(StartError::Socket)?;
    for socket in [Some(&listeners.client), Some(&listeners.admin), listeners.tls.as_ref()].into_iter().flatten() {
        // pingora's accept loop runs on tokio, which needs non-blocking sockets.
        socket.set_nonblocking(true).map_err(StartError::Socket)?;
    }

    let mut conf = ServerConf::new().ok_or_else(|| StartError::Conf("default ServerConf".into()))?;
    let settings = &loaded.config.server;
    conf.threads = settings.threads;
    conf.work_stealing = settings.work_stealing;
    conf.grace_period_seconds = Some(settings.grace_period_seconds);
    conf.graceful_shutdown_timeout_seconds = Some(settings.graceful_shutdown_timeout_seconds);
    conf.upgrade_sock = format!("/tmp/tokenonce-upgrade-{}.sock", std::process::id());
    conf.pid_file = format!("/tmp/tokenonce-{}.pid", std::process::id());
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let interval = loaded.config.upstream.health_interval_ms;
    let watch_interval = settings.config_watch_interval_ms;
    let app: SharedApp = Arc::new(ArcSwap::from_pointee(App::new(loaded)?));
    let reloader = Reloader::new(path, Arc::clone(&app));

    let proxy = http_proxy_service_with_name(&server.configuration, Proxy { app: Arc::clone(&app) }, "tokenonce");
    let mut admin = http_proxy_service_with_name(
        &server.configuration,
        Admin { app: Arc::clone(&app), reloader: reloader.clone() },
        "tokenonce-admin",
    );
    admin.threads = Some(1);
    let mut client = PreBound::new(proxy, listeners.client, client_addr);
    if let (Some(socket), Some(addr)) = (listeners.tls, tls_addr) {
        let current = Arc::clone(&app);
        let callbacks =
            Box::new(ListenerCert { current: Box::new(move || current.load().resources.server_identity.clone()) });
        let settings = TlsSettings::with_callbacks(callbacks).map_err(|e| StartError::Conf(e.to_string()))?;
        client.add_tls(socket, addr, settings);
    }
    server.add_service(client);
    server.add_service(PreBound::new(admin, listeners.admin, admin_addr));
    server.add_service(background_service("health", Upkeep { app: Arc::clone(&app), interval }));
    if signals == Signals::Process {
        server.add_service(background_service("reload", reloader.clone()));
    }
    if !watch_interval.is_zero() {
        match ConfigWatch::new(reloader.clone(), watch_interval) {
            Some(watch) => {
                server.add_service(background_service("config watch", watch));
            }
            None => tracing::warn!("server.config_watch_interval_ms ignored: running on the embedded default config"),
        }
    }

    let (stop, requested) = watch::channel(None);
    let watch = StopWatch { requested, process_signals: signals == Signals::Process };
    let thread = std::thread::Builder::new()
        .name("tokenonce-server".into())
        .spawn(move || server.run(RunArgs { shutdown_signal: Box::new(watch) }))
        .map_err(StartError::Thread)?;
    let tls = tls_addr.map_or_else(String::new, |a| a.to_string());
    tracing::info!(listen = %client_addr, admin = %admin_addr, tls = %tls, "tokenonce listening");
    Ok(Running { client_addr, admin_addr, tls_addr, stop, reloader, thread: Some(thread) })
}

/// Tells pingora's main loop to shut down: on a [`Running::stop`] request (or when the
/// handle is gone), and with [`Signals::Process`] also on SIGTERM/SIGINT/SIGQUIT.
struct StopWatch {
    requested: watch::Receiver<Option<Stop>>,
    process_signals: bool,
}

#[async_trait]
impl ShutdownSignalWatch for StopWatch {
    async fn recv(&self) -> ShutdownSignal {
        let mut requested = self.requested.clone();
        let by_handle = async move {
            match requested.wait_for(Option::is_some).await.map(|stop| *stop) {
                Ok(Some(Stop::Graceful)) => ShutdownSignal::GracefulTerminate,
                // A fast stop, or the handle dropped without asking: nobody can stop us later.
                Ok(_) | Err(_) => ShutdownSignal::FastShutdown,
            }
        };
        if self.process_signals {
            tokio::select! {
                signal = by_handle => signal,
                signal = UnixShutdownSignalWatch.recv() => signal,
            }
        } else {
            by_handle.await
        }
    }
}

/// A pingora listening service that serves on a socket bound before it starts.
///
/// pingora 0.9.1 has no public "serve on this socket" call: a listening service binds the
/// address string it was given, unless the listen-fd table handed to `start_service` already
/// holds a socket under that string (the zero-downtime-upgrade path, where the table carries
/// sockets inherited from the old process; `pingora-core` `listeners/l4.rs`
/// `ListenerEndpointBuilder::listen`). So the inner service is given the socket's actual
/// address and started with a table of its own holding that socket, which pingora then adopts
/// (`listen()` again with its backlog) instead of binding. Consequence: the server's own table
/// stays empty, so a SIGQUIT upgrade has no sockets to hand over (tokenonce never runs with
/// pingora's `--upgrade`) and simply shuts down gracefully.
struct PreBound<A> {
    service: Listening<A>,
    /// Each socket under its address; kept (and closed on drop) until the service starts and
    /// pingora takes them over.
    sockets: Vec<(String, TcpListener)>,
}

impl<A> PreBound<A> {
    fn new(mut service: Listening<A>, socket: TcpListener, addr: SocketAddr) -> Self {
        let addr = addr.to_string();
        service.add_tcp(&addr);
        Self { service, sockets: vec![(addr, socket)] }
    }

    /// One more endpoint of the same service, speaking TLS.
    fn add_tls(&mut self, socket: TcpListener, addr: SocketAddr, settings: TlsSettings) {
        let addr = addr.to_string();
        self.service.add_tls_with_settings(&addr, None, settings);
        self.sockets.push((addr, socket));
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> Service for PreBound<A> {
    async fn start_service(
        &mut self,
        _server_fds: Option<ListenFds>,
        shutdown: ShutdownWatch,
        listeners_per_fd: usize,
    ) {
        let table: ListenFds = Arc::new(Fds::new().into());
        for (addr, socket) in self.sockets.drain(..) {
            // Ownership of the descriptor passes to pingora, which closes it when the service stops.
            table.lock().add(addr, socket.into_raw_fd());
        }
        Service::start_service(&mut self.service, Some(table), shutdown, listeners_per_fd).await;
    }

    fn name(&self) -> &str {
        self.service.name()
    }

    fn threads(&self) -> Option<usize> {
        self.service.threads()
    }

    fn runtime_opts_override(&self, global: &RuntimeOpts) -> Option<RuntimeOpts> {
        self.service.runtime_opts_override(global)
    }

    fn listen_addresses(&self) -> Option<Vec<String>> {
        self.service.listen_addresses()
    }
}
