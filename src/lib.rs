//! slidegate: an Envoy external rate-limit server with exact rolling windows.
//!
//! Layout:
//! * [`config`]: the YAML format (reference-compatible plus extensions), loading, validation.
//! * [`limiter`]: rules, matching, store keys and decisions; no transport, no Redis client.
//! * [`store`]: the store contract (what a store is asked and answers), the embedded store, and
//!   the Redis store, which decides inside one Lua script (`lua/slidegate.lua`).
//! * [`metrics`]: Prometheus metrics, fed by the limiter's observer.
//! * [`service`]: the gRPC `RateLimitService`, and the one place errors become gRPC statuses.
//! * [`http`]: health, readiness and `POST /json`.
//! * [`server`]: `run`, which serves everything on given listeners until shutdown.
//! * [`cells`]: `--thread-per-core`, one single-threaded runtime per worker.
//! * [`wire`]: protobuf messages to and from the limiter's types, for both transports.
//! * [`net`]: accepting connections: a cap, idle timeouts, the HTTP port's serve loop.
//! * [`tls`]: TLS as a client (Redis, xDS) and on the gRPC port (mTLS, certificate reload).
//! * [`xds`]: the xDS config client (Envoy Gateway): ADS, ACK/NACK, reconnects.
//!
//! The command line (flags, environment, assembly) is the binary's, in `src/cli.rs`.
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod cells;
pub mod config;
pub mod http;
pub mod limiter;
pub mod metrics;
pub mod net;
pub mod proto;
pub mod server;
pub mod service;
pub mod store;
pub mod streams;
pub mod tls;
pub mod wire;
pub mod xds;
