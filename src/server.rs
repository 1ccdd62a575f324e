//! Serving: gRPC (rate limit, health, reflection) and HTTP on listeners the caller binds, until
//! a shutdown future completes. Tests bind `127.0.0.1:0`; `main` binds the configured addresses.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::http::{self, HttpState};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::proto::FILE_DESCRIPTOR_SET;
use crate::proto::rate_limit_service_server::RateLimitServiceServer;
use crate::service::RateLimitGrpc;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP server failed: {0}")]
    Http(#[from] std::io::Error),
    #[error("reflection service could not be built: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// How shutdown behaves.
#[derive(Clone, Copy, Debug)]
pub struct ServerOptions {
    /// After the shutdown signal, keep serving (with readiness off) this long, so load balancers
    /// stop sending new requests before connections close.
    pub shutdown_delay: Duration,
    /// Then give in-flight calls at most this long to finish.
    pub shutdown_grace: Duration,
    /// How often gRPC health re-checks that the store answers.
    pub health_interval: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            shutdown_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(20),
            health_interval: Duration::from_secs(2),
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

/// The gRPC health service names slidegate reports: the RLS service itself, the reference
/// server's `ratelimit`, and the empty name (the whole server).
const HEALTH_NAMES: [&str; 3] = [
    "envoy.service.ratelimit.v3.RateLimitService",
    "ratelimit",
    "",
];

/// Serves until `shutdown` completes. Then readiness (HTTP `/readyz`, gRPC health) turns false,
/// serving goes on for `shutdown_delay`, new connections stop, and in-flight calls get up to
/// `shutdown_grace` to finish before this returns.
pub async fn run(
    grpc: TcpListener,
    http: TcpListener,
    app: App,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let ready = Arc::new(AtomicBool::new(false));
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    // `draining` turns true on the shutdown signal; `stop` after the delay.
    let (draining_tx, draining) = watch::channel(false);
    let (stop_tx, stop) = watch::channel(false);
    let wait_for = |mut rx: watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means go.
        let _ = rx.wait_for(|set| *set).await;
    };
    {
        let ready = ready.clone();
        let health = health.clone();
        let delay = app.options.shutdown_delay;
        tokio::spawn(async move {
            shutdown.await;
            ready.store(false, Ordering::SeqCst);
            let _ = draining_tx.send(true);
            for name in HEALTH_NAMES {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
            tracing::info!(delay = ?delay, "shutting down: readiness off");
            tokio::time::sleep(delay).await;
            tracing::info!("no new connections; finishing in-flight calls");
            let _ = stop_tx.send(true);
        });
    }

    // Idle state in the embedded store goes even when no request touches it.
    {
        let limiter = app.limiter.clone();
        let mut draining = draining.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(10)) => limiter.sweep_store(),
                    _ = draining.wait_for(|d| *d) => return,
                }
            }
        });
    }

    // gRPC health follows the store: SERVING only while it answers.
    {
        let health = health.clone();
        let limiter = app.limiter.clone();
        let interval = app.options.health_interval;
        let mut draining = draining.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let status = if limiter.store_ready().await {
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
        });
    }

    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(RateLimitServiceServer::new(RateLimitGrpc::new(
            app.limiter.clone(),
            app.metrics.clone(),
        )))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(grpc).with_nodelay(Some(true)),
            wait_for(stop.clone()),
        );
    let http_server = axum::serve(
        http,
        http::router(HttpState {
            limiter: app.limiter.clone(),
            metrics: app.metrics.clone(),
            ready: ready.clone(),
        }),
    )
    .with_graceful_shutdown(wait_for(stop.clone()));

    if !*draining.borrow() {
        ready.store(true, Ordering::SeqCst);
    }
    let servers = async { tokio::join!(grpc_server, http_server) };
    let grace = app.options.shutdown_grace;
    let deadline = async move {
        wait_for(stop).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        (grpc_result, http_result) = servers => {
            grpc_result?;
            http_result?;
        }
        _ = deadline => {
            tracing::warn!(grace = ?grace, "shutdown grace period over; exiting with calls still in flight");
        }
    }
    Ok(())
}
