//! slidegate: an Envoy external rate-limit server with exact rolling windows.
//!
//! Layout:
//! * [`config`]: the YAML format (reference-compatible plus extensions), loading, validation.
//! * [`limiter`]: rules, matching, store keys and decisions; no transport, no Redis client.
//! * [`store`]: the embedded store and the store trait.
//! * [`service`]: the gRPC `RateLimitService`, and the one place errors become gRPC statuses.
//! * [`http`]: health, readiness and `POST /json`.
//! * [`server`]: `run`, which serves everything on given listeners until shutdown.
//! * [`cli`]: flags and environment variables; `main.rs` only calls it.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod cli;
pub mod config;
pub mod http;
pub mod limiter;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod service;
pub mod store;
