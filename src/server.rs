//! Serving: gRPC (rate limit, health, reflection) and HTTP on listeners the caller binds, until
//! a shutdown future completes. Tests bind `127.0.0.1:0`; `main` binds the configured addresses.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::http::{self, HttpState};
use crate::limiter::Limiter;
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

/// The gRPC health service names slidegate reports: the RLS service itself, the reference
/// server's `ratelimit`, and the empty name (the whole server).
const HEALTH_NAMES: [&str; 3] = [
    "envoy.service.ratelimit.v3.RateLimitService",
    "ratelimit",
    "",
];

/// Serves until `shutdown` completes, then stops accepting, lets in-flight calls finish and
/// returns. Readiness (HTTP `/readyz` and gRPC health) turns false first.
pub async fn run(
    grpc: TcpListener,
    http: TcpListener,
    limiter: Arc<Limiter>,
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

    // One shutdown signal fans out to both servers.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move |mut rx: watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means stop.
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let signal = {
        let ready = ready.clone();
        let health = health.clone();
        async move {
            shutdown.await;
            ready.store(false, Ordering::SeqCst);
            for name in HEALTH_NAMES {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
            tracing::info!("shutting down: readiness off, finishing in-flight calls");
            let _ = stop_tx.send(true);
        }
    };
    tokio::spawn(signal);

    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(RateLimitServiceServer::new(RateLimitGrpc::new(
            limiter.clone(),
        )))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(grpc).with_nodelay(Some(true)),
            stopped(stop_rx.clone()),
        );
    let http_server = axum::serve(
        http,
        http::router(HttpState {
            limiter,
            ready: ready.clone(),
        }),
    )
    .with_graceful_shutdown(stopped(stop_rx.clone()));

    for name in HEALTH_NAMES {
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    if !*stop_rx.borrow() {
        ready.store(true, Ordering::SeqCst);
    }
    let (grpc_result, http_result) = tokio::join!(grpc_server, http_server);
    grpc_result?;
    http_result?;
    Ok(())
}
