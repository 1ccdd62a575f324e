//! Serving: gRPC (rate limit, health, reflection) and HTTP on listeners the caller binds, until
//! a shutdown future completes. Tests bind `127.0.0.1:0`; `main` binds the configured addresses.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::{Stream, StreamExt as _};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::codegen::http::{Request as HttpRequest, Response as HttpResponse};
use tonic::service::Routes;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::HealthReporter;

pub mod admin_api;
pub mod budget;
pub mod grpc;
pub mod http;
pub mod net;

use self::budget::RequestBytes;
use self::grpc::streams::{Served, StreamQueue};
use self::grpc::tls::{self, GrpcConn, ServerTls};
use self::grpc::{GrpcBody, GrpcService};
use self::http::HttpState;
use self::net::{ConnectionLimits, GuardedListener};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::proto::FILE_DESCRIPTOR_SET;
use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("HTTP server failed: {0}")]
    Http(#[from] std::io::Error),
    #[error("reflection service could not be built: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// How shutdown, readiness and the metrics listener behave.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// After the shutdown signal, keep serving (with readiness off) this long, so load balancers
    /// stop sending new requests before connections close.
    pub shutdown_delay: Duration,
    /// Then give in-flight calls at most this long to finish.
    pub shutdown_grace: Duration,
    /// How often gRPC health re-checks that the store answers.
    pub health_interval: Duration,
    /// Ready only once at least one domain is loaded.
    pub ready_needs_config: bool,
    /// Where the metrics-only listener (if any) serves `/metrics`.
    pub metrics_path: String,
    /// Connection cap and idle timeout, on every port.
    pub connections: ConnectionLimits,
    /// How often the gRPC port's TLS files are checked for a rotated certificate.
    pub tls_reload_interval: Duration,
    /// When set, not ready until it is true (the xDS source's first config).
    pub config_arrived: Option<Arc<AtomicBool>>,
    /// The most Rate Limit Quota Service streams at once (`--rlqs-max-streams`).
    pub quota_streams: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            shutdown_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(20),
            health_interval: Duration::from_secs(2),
            ready_needs_config: false,
            metrics_path: "/metrics".into(),
            connections: ConnectionLimits::default(),
            tls_reload_interval: Duration::from_secs(5),
            config_arrived: None,
            quota_streams: grpc::quota_streams::DEFAULT_MAX_STREAMS,
        }
    }
}

/// Everything the endpoints share.
#[derive(Clone)]
pub struct App {
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    pub options: ServerOptions,
}

/// The gRPC health service names slidegate reports: the two rate-limit services, the reference
/// server's `ratelimit`, and the empty name (the whole server).
const HEALTH_NAMES: [&str; 4] = [
    "envoy.service.ratelimit.v3.RateLimitService",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
    "ratelimit",
    "",
];

/// The sockets slidegate serves on, bound by the caller (tests bind `127.0.0.1:0`).
pub struct Listeners {
    pub grpc: TcpListener,
    pub http: TcpListener,
    /// A second place for `/metrics` only (the reference's `PROMETHEUS_ADDR`).
    pub metrics: Option<TcpListener>,
    /// TLS (and with a client CA, mutual TLS) on the gRPC port.
    pub grpc_tls: Option<Arc<ServerTls>>,
    /// The admin API (`--admin-addr`).
    pub admin: Option<AdminListener>,
}

impl Listeners {
    /// gRPC and HTTP, no separate metrics listener.
    pub fn new(grpc: TcpListener, http: TcpListener) -> Listeners {
        Listeners {
            grpc,
            http,
            metrics: None,
            grpc_tls: None,
            admin: None,
        }
    }
}

/// The admin API's listener and what admits a caller: tokens, mutual TLS, or both (at least
/// one; TLS without a client CA only encrypts).
pub struct AdminListener {
    pub listener: TcpListener,
    pub tokens: Option<Arc<admin_api::Tokens>>,
    pub tls: Option<Arc<ServerTls>>,
}

/// Stops a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves once the flag it watches is set (or its sender is gone, which also means go).
async fn wait_for(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

/// Serves until `shutdown` completes. Then readiness (HTTP `/readyz`, gRPC health) turns false,
/// serving goes on for `shutdown_delay`, new connections stop, and in-flight calls get up to
/// `shutdown_grace` to finish before this returns.
pub async fn run(
    listeners: Listeners,
    app: App,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let ready = Arc::new(AtomicBool::new(false));
    let (health, health_service) = tonic_health::server::health_reporter();
    // `draining` turns true on the shutdown signal; `stop` after the delay.
    let (draining_tx, draining) = watch::channel(false);
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(drain_on_shutdown(
        shutdown,
        ready.clone(),
        health.clone(),
        app.options.shutdown_delay,
        draining_tx,
        stop_tx,
    ));
    start_health(&app, health, draining.clone()).await;

    let limits = app.options.connections;
    let bytes = RequestBytes::new(limits.max_buffered, limits.max_buffered_per_connection);
    // Aborted when `run` returns.
    let _tls_reloader = listeners
        .grpc_tls
        .clone()
        .map(|tls| AbortOnDrop(tls.spawn_reloader(app.options.tls_reload_interval)));
    let grpc_listener = GuardedListener::new(listeners.grpc, limits);
    let connections = tls::incoming(grpc_listener, listeners.grpc_tls, limits.header_timeout());
    let service = grpc_service(&app, health_service, &bytes, limits.body_timeout)?;
    let grpc_server = serve_grpc(
        connections,
        move || service.for_connection(),
        limits,
        wait_for(stop.clone()),
    );
    let http_state = HttpState {
        limiter: app.limiter.clone(),
        metrics: app.metrics.clone(),
        ready: ready.clone(),
        ready_needs_config: app.options.ready_needs_config,
        config_arrived: app.options.config_arrived.clone(),
        bytes: bytes.clone(),
        body_timeout: limits.body_timeout,
    };
    let http_server = net::serve_http(
        GuardedListener::new(listeners.http, limits),
        http::router(http_state),
        wait_for(stop.clone()),
    );
    if let Some(listener) = listeners.metrics {
        spawn_metrics_listener(listener, &app, wait_for(stop.clone()));
    }
    if let Some(admin) = listeners.admin {
        spawn_admin_listener(admin, &app, &bytes, wait_for(stop.clone()));
    }

    if !*draining.borrow() {
        ready.store(true, Ordering::SeqCst);
    }
    let servers = async {
        tokio::join!(grpc_server, http_server);
    };
    finish_within_grace(servers, stop, app.options.shutdown_grace).await
}

/// gRPC health: NOT_SERVING under every name from the moment the port accepts (never
/// NOT_FOUND), then following readiness until draining starts.
async fn start_health(app: &App, health: HealthReporter, draining: watch::Receiver<bool>) {
    for name in HEALTH_NAMES {
        health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    let configured = {
        let (limiter, needs_config) = (app.limiter.clone(), app.options.ready_needs_config);
        let arrived = app.options.config_arrived.clone();
        move || config_ready(&limiter, needs_config, arrived.as_deref())
    };
    tokio::spawn(follow_store_health(
        health,
        app.limiter.clone(),
        app.options.health_interval,
        draining,
        configured,
    ));
}

/// Whether the config readiness asks for is there: the xDS source's first config (`arrived`,
/// where there is one), and a domain where one is required (`--ready-needs-config`).
fn config_ready(limiter: &Limiter, needs_config: bool, arrived: Option<&AtomicBool>) -> bool {
    let arrived = arrived.is_none_or(|a| a.load(Ordering::SeqCst));
    arrived && (!needs_config || !limiter.limits().domains.is_empty())
}

/// The metrics alone on their own listener (the reference's `PROMETHEUS_ADDR`), until `stop`.
fn spawn_metrics_listener(
    listener: TcpListener,
    app: &App,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let router = http::metrics_router(
        app.limiter.clone(),
        app.metrics.clone(),
        &app.options.metrics_path,
    );
    tokio::spawn(net::serve_http(
        GuardedListener::new(listener, app.options.connections),
        router,
        stop,
    ));
}

/// The admin API on its own listener, until `stop`; with TLS, each connection's router knows
/// the client certificate's name.
fn spawn_admin_listener(
    admin: AdminListener,
    app: &App,
    bytes: &RequestBytes,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let limits = app.options.connections;
    let state = admin_api::AdminState {
        limiter: app.limiter.clone(),
        metrics: app.metrics.clone(),
        tokens: admin.tokens,
        bytes: bytes.clone(),
        body_timeout: limits.body_timeout,
    };
    let router = admin_api::router(state);
    let listener = GuardedListener::new(admin.listener, limits);
    match admin.tls {
        None => {
            tokio::spawn(net::serve_http(listener, router, stop));
        }
        Some(tls) => {
            let reloader = AbortOnDrop(tls.clone().spawn_reloader(app.options.tls_reload_interval));
            let connections = tls::incoming(listener, Some(tls), limits.header_timeout());
            let router_for = move |conn: &GrpcConn| {
                router
                    .clone()
                    .layer(axum::Extension(admin_api::Peer(tls::peer_name(conn))))
            };
            tokio::spawn(async move {
                net::serve_http_on(connections, limits, router_for, stop).await;
                drop(reloader);
            });
        }
    }
}

/// Waits for the servers to finish, or, once `stop` is set, at most `grace` for their
/// in-flight calls.
async fn finish_within_grace(
    servers: impl Future<Output = ()>,
    stop: watch::Receiver<bool>,
    grace: Duration,
) -> Result<(), ServerError> {
    let deadline = async move {
        wait_for(stop).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        () = servers => {}
        () = deadline => {
            tracing::warn!(grace = ?grace, "shutdown grace period over; exiting with calls still in flight");
        }
    }
    Ok(())
}

/// The gRPC services: rate limit (answered ahead of the router by `grpc::direct`, see
/// [`GrpcService`]), the rate limit quota service (`grpc::quota`), health, and reflection (v1
/// and v1alpha, so every grpcurl finds the services without proto files).
fn grpc_service(
    app: &App,
    health_service: HealthServer<impl tonic_health::pb::health_server::Health>,
    bytes: &RequestBytes,
    body_timeout: Duration,
) -> Result<GrpcService<Routes>, ServerError> {
    // Each version also registers the other's descriptors, so both list the same five services
    // whichever one a client (old or new grpcurl) asks.
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let quota =
        grpc::quota_streams::QuotaService::new(app.limiter.clone(), app.options.quota_streams);
    let routes = Routes::new(health_service)
        .add_service(RateLimitQuotaServiceServer::new(quota))
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .prepare();
    Ok(GrpcService::new(app.limiter.clone(), routes).with_bounds(bytes.connection(), body_timeout))
}

/// The HTTP/2 receive window of each gRPC stream.
const STREAM_WINDOW: u32 = 256 * 1024;

/// The HTTP/2 side of a gRPC connection: hyper's server, with keep-alive pings and a cap on
/// open streams as `limits` say, its streams handed to `queue` (see [`grpc::streams`]).
fn grpc_builder(
    limits: ConnectionLimits,
    queue: StreamQueue,
) -> hyper::server::conn::http2::Builder<StreamQueue> {
    let mut builder = hyper::server::conn::http2::Builder::new(queue);
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.keep_alive())
        .keep_alive_timeout(limits.keep_alive())
        // Envoy's pool honours the cap by opening another connection once one is full; a
        // client without a cap could hold any number of streams' state. hyper's other
        // defaults stay, among them its cap on streams a peer makes the server reset (1,024).
        .max_concurrent_streams(limits.max_streams)
        // What a stream's peer may send ahead of the call reading it. hyper's 1 MiB let a
        // connection of large messages have several MiB per stream waiting in the server
        // (tests/bounds.rs); Envoy's calls are a few hundred bytes.
        .initial_stream_window_size(STREAM_WINDOW)
        // No `date` header: gRPC does not use it (grpc-go's and gRPC core's servers send none),
        // and every response would encode it.
        .auto_date_header(false);
    builder
}

/// Serves HTTP/2 (only: gRPC has no HTTP/1) on each connection until `shutdown`; then takes no
/// more connections, asks the open ones to finish (`GOAWAY`) and returns once they have. hyper
/// serves the connections directly, without tonic's server around it (see [`GrpcService`] for
/// what that saves).
async fn serve_grpc<S>(
    mut connections: Pin<Box<dyn Stream<Item = std::io::Result<GrpcConn>> + Send>>,
    service: impl Fn() -> S,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) where
    S: hyper::service::Service<
            HttpRequest<hyper::body::Incoming>,
            Response = HttpResponse<GrpcBody>,
            Error = Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
{
    // Each connection's task holds a sender: once all have ended, `ended` yields nothing.
    let (alive, mut ended) = tokio::sync::mpsc::channel::<()>(1);
    let (drain, draining) = watch::channel(false);
    tokio::pin!(shutdown);
    // Ends on shutdown, dropping the incoming stream (the TLS acceptor behind it stops with it).
    loop {
        tokio::select! {
            accepted = connections.next() => match accepted {
                Some(Ok(io)) => {
                    let queue = StreamQueue::new();
                    let connection =
                        grpc_builder(limits, queue.clone()).serve_connection(TokioIo::new(io), service());
                    let served = Served::new(connection, &queue);
                    let (alive, draining) = (alive.clone(), draining.clone());
                    tokio::spawn(async move {
                        serve_one(served, limits, draining).await;
                        drop(alive);
                    });
                }
                Some(Err(e)) => tracing::debug!("gRPC connection not accepted: {e}"),
                None => break,
            },
            () = &mut shutdown => break,
        }
    }
    let _ = drain.send(true);
    drop(alive);
    let _ = ended.recv().await;
}

/// Serves one connection until it ends. It is asked to finish (`GOAWAY`: no new streams, the
/// open ones complete) on shutdown (`draining`), or once it is `--grpc-max-connection-age` old
/// (within 10% either way, so connections opened together do not all leave together: clients
/// such as Envoy then open new connections, which reach replicas added since), and closed
/// `--grpc-max-connection-age-grace` after that if calls still hold it.
async fn serve_one<I, S>(
    mut served: Served<hyper::server::conn::http2::Connection<I, S, StreamQueue>>,
    limits: ConnectionLimits,
    mut draining: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = GrpcBody> + Send,
    S::Future: Send + 'static,
{
    let far = tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86_400);
    let aged = limits
        .max_connection_age
        .map_or(far, |age| tokio::time::Instant::now() + jittered(age));
    let mut close_at = far;
    let mut asked = false;
    loop {
        tokio::select! {
            ended = &mut served => {
                if let Err(e) = ended {
                    tracing::debug!("gRPC connection ended: {e}");
                }
                return;
            }
            _ = draining.wait_for(|d| *d), if !asked => {
                served.connection().graceful_shutdown();
                asked = true;
            }
            () = tokio::time::sleep_until(aged), if !asked => {
                served.connection().graceful_shutdown();
                asked = true;
                close_at = tokio::time::Instant::now() + limits.max_connection_age_grace;
            }
            () = tokio::time::sleep_until(close_at) => {
                tracing::debug!("gRPC connection closed: past its age and grace");
                return;
            }
        }
    }
}

/// `age`, 10% shorter or longer at random.
fn jittered(age: Duration) -> Duration {
    use std::hash::BuildHasher as _;
    let random = std::collections::hash_map::RandomState::new().hash_one(0u8);
    // A fraction in [0.9, 1.1): 2,000 steps of 0.01%.
    let permille = 900 + random % 200;
    age.mul_f64(permille as f64 / 1000.0)
}

/// On the shutdown signal: readiness and health off at once, then after `delay` stop taking
/// connections.
async fn drain_on_shutdown(
    shutdown: impl Future<Output = ()>,
    ready: Arc<AtomicBool>,
    health: HealthReporter,
    delay: Duration,
    draining: watch::Sender<bool>,
    stop: watch::Sender<bool>,
) {
    shutdown.await;
    ready.store(false, Ordering::SeqCst);
    let _ = draining.send(true);
    for name in HEALTH_NAMES {
        health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    tracing::info!(delay = ?delay, "shutting down: readiness off");
    tokio::time::sleep(delay).await;
    tracing::info!("no new connections; finishing in-flight calls");
    let _ = stop.send(true);
}

/// gRPC health follows readiness: SERVING only while the store answers and a config is
/// loaded where one is required (`configured`: `--ready-needs-config`, the reference's
/// `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`, and the xDS source's first config), until
/// draining starts.
async fn follow_store_health(
    health: HealthReporter,
    limiter: Arc<Limiter>,
    interval: Duration,
    mut draining: watch::Receiver<bool>,
    configured: impl Fn() -> bool,
) {
    let mut last = Some(ServingStatus::NotServing);
    loop {
        let status = if configured() && limiter.store().ready().await {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        if *draining.borrow() {
            return;
        }
        if last != Some(status) {
            for name in HEALTH_NAMES {
                health.set_service_status(name, status).await;
            }
            last = Some(status);
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = draining.wait_for(|d| *d) => return,
        }
    }
}
