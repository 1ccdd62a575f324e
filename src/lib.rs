//! slidegate: an Envoy external rate-limit server with exact rolling windows.
//!
//! Layers, top to bottom; a module imports only from the ones below it (`ARCHITECTURE.md`):
//! * [`server`]: everything that serves a socket. `server::run` serves the gRPC port
//!   ([`server::grpc`]: ShouldRateLimit, health, reflection, TLS) and the HTTP port
//!   ([`server::http`]: health, readiness, metrics, `POST /json`) on listeners the caller binds.
//! * [`xds`]: the xDS config client (Envoy Gateway): ADS, ACK/NACK, reconnects.
//! * [`config`]: the YAML format (reference-compatible plus extensions), loading, validation,
//!   hot reload.
//! * [`metrics`]: Prometheus metrics, fed by the limiter's observer.
//! * [`wire`]: protobuf messages to and from the limiter's types, for both ports.
//! * [`limiter`]: rules, matching, store keys and decisions; no transport, no Redis client.
//! * [`store`]: the store contract, the embedded store, and the Redis store, which decides inside
//!   one Lua function library (the parts in `lua/`, joined by `build.rs`).
//! * [`traces`]: OpenTelemetry traces: the caller's context, sampling, the OTLP export.
//! * [`tls`]: TLS files, and TLS as a client (Redis, xDS).
//!
//! The command line (flags, environment, assembly) is the binary's, in `src/cli.rs`.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

/// The version slidegate is built as.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit it is built from (`build.rs`), or `unknown`.
pub const COMMIT: &str = env!("SLIDEGATE_COMMIT");

pub mod config;
pub mod limiter;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod store;
pub mod tls;
pub mod traces;
pub mod wire;
pub mod xds;
