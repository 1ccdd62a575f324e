//! The binary's command line and environment. Every flag has a `SLIDEGATE_*` twin, and the
//! reference server's own variables (`REDIS_URL`, `RUNTIME_ROOT`, `USE_PROMETHEUS`, ...) work too
//! ([`reference_env`]); flags and `SLIDEGATE_*` win over them. [`serve`] assembles the library's
//! parts and hands them to `slidegate::server::run`.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use slidegate::config;
use slidegate::limiter::RequestBounds;
use slidegate::server::net::ConnectionLimits;

mod admin_client;
mod reference_env;
mod serve;
mod value_parsers;

use value_parsers::{
    bytes_arg, duration_arg, duration_or_zero_arg, pair_arg, parse_bool, ratio_arg, threads_arg,
};

#[derive(Debug, Parser)]
#[command(
    name = "slidegate",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("SLIDEGATE_COMMIT"), ")"),
    about = "Envoy external rate-limit server with exact rolling windows"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Inspect or reset descriptors through a running server's admin API (--admin-addr).
    Admin {
        #[command(subcommand)]
        action: admin_client::AdminAction,
    },
    /// Validate a config file or directory; print every error and exit non-zero if any.
    Check {
        /// The file or directory (or use --config).
        path: Option<PathBuf>,
        #[arg(long = "config", env = "SLIDEGATE_CONFIG")]
        config: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// A YAML file, or a directory of *.yaml / *.yml files (dotfiles ignored).
    #[arg(long, env = "SLIDEGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// gRPC listen address (RateLimitService, health, reflection).
    #[arg(long, env = "SLIDEGATE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,
    /// HTTP listen address (/healthz, /readyz, /healthcheck, /metrics, POST /json).
    #[arg(long, env = "SLIDEGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Also serve the metrics alone on this address (the reference's PROMETHEUS_ADDR).
    #[arg(long, env = "SLIDEGATE_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on --metrics-addr.
    #[arg(long, env = "SLIDEGATE_METRICS_PATH", default_value = "/metrics")]
    pub metrics_path: String,
    /// Serve the admin API (POST /admin/v1/inspect and /admin/v1/reset) on this address; needs
    /// --admin-token-file or --admin-tls-client-ca (or both). Bind it to loopback or a private
    /// network.
    #[arg(long, env = "SLIDEGATE_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// The admin API's bearer tokens, one per line (`NAME TOKEN` or `TOKEN`, at least 16
    /// characters); read again when the file changes.
    #[arg(long, env = "SLIDEGATE_ADMIN_TOKEN_FILE", requires = "admin_addr")]
    pub admin_token_file: Option<PathBuf>,
    /// PEM certificate chain for TLS on the admin listener (with --admin-tls-key).
    #[arg(long, env = "SLIDEGATE_ADMIN_TLS_CERT", requires_all = ["admin_tls_key", "admin_addr"])]
    pub admin_tls_cert: Option<PathBuf>,
    /// PEM private key of --admin-tls-cert.
    #[arg(long, env = "SLIDEGATE_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,
    /// PEM CAs whose client certificates the admin listener requires (mutual TLS): a caller
    /// with one is admitted, and named in the log by its certificate.
    #[arg(
        long,
        env = "SLIDEGATE_ADMIN_TLS_CLIENT_CA",
        requires = "admin_tls_cert"
    )]
    pub admin_tls_client_ca: Option<PathBuf>,
    /// With --admin-tls-client-ca: the client certificate must be valid for this name.
    #[arg(
        long,
        env = "SLIDEGATE_ADMIN_TLS_CLIENT_SAN",
        requires = "admin_tls_client_ca"
    )]
    pub admin_tls_client_san: Option<String>,
    /// Metric names and format: slidegate's (OpenMetrics) or the reference server's.
    #[arg(long, env = "SLIDEGATE_METRIC_NAMES", value_enum, default_value_t = MetricNamesArg::Slidegate)]
    pub metric_names: MetricNamesArg,
    /// The embedded store's bound: descriptors holding state at once (about 300 bytes each).
    /// A request that would add one more is a store failure, answered by the failure policy.
    #[arg(long, env = "SLIDEGATE_MEMORY_MAX_KEYS", default_value_t = slidegate::store::memory::DEFAULT_MAX_KEYS)]
    pub memory_max_keys: usize,
    /// Redis URL; without it slidegate runs on its embedded in-process store.
    #[arg(long = "redis", env = "SLIDEGATE_REDIS_URL")]
    pub redis_url: Option<String>,
    /// PEM CA certificates that sign Redis' certificate (rediss://), instead of the system's.
    #[arg(long, env = "SLIDEGATE_REDIS_TLS_CA")]
    pub redis_tls_ca: Option<PathBuf>,
    /// PEM client certificate chain for Redis that requires one (with --redis-tls-key).
    #[arg(long, env = "SLIDEGATE_REDIS_TLS_CERT")]
    pub redis_tls_cert: Option<PathBuf>,
    /// PEM private key of --redis-tls-cert.
    #[arg(long, env = "SLIDEGATE_REDIS_TLS_KEY")]
    pub redis_tls_key: Option<PathBuf>,
    /// Accept a Redis certificate signed for another name (the chain is still verified).
    #[arg(long, env = "SLIDEGATE_REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub redis_tls_skip_hostname_verification: bool,
    /// Answer a call only once this many replicas hold its writes (Redis WAIT), so a failover
    /// loses no admitted hit; fewer in time: the failure policy answers.
    #[arg(long, env = "SLIDEGATE_REDIS_WAIT_REPLICAS", default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// How a sliding_log is kept in Redis: compact (one string, about 4 bytes a hit; rules whose
    /// log can pass 1,000 entries keep a sorted set) or sorted-set (the format before it, for a
    /// rolling upgrade; docs/redis.md#the-compact-log).
    #[arg(long, env = "SLIDEGATE_REDIS_LOG_FORMAT", value_enum, default_value_t = LogFormatArg::Compact)]
    pub redis_log_format: LogFormatArg,
    /// Put before every Redis key, so installations sharing one Redis keep apart.
    #[arg(long, env = "SLIDEGATE_REDIS_KEY_PREFIX", default_value = "")]
    pub redis_key_prefix: String,
    /// Redis connections in the pool.
    #[arg(long, env = "SLIDEGATE_REDIS_POOL_SIZE", default_value_t = 4)]
    pub redis_pool_size: usize,
    /// How long a call sent to Redis is waited for before the failure policy answers its
    /// decisions: well under Envoy's 20 ms filter timeout.
    #[arg(long, env = "SLIDEGATE_REDIS_TIMEOUT", default_value = "15ms", value_parser = duration_arg)]
    pub redis_timeout: Duration,
    /// How long a decision whose caller sent no deadline may wait for its turn to call Redis
    /// (every call to it out) before the failure policy answers it.
    #[arg(long, env = "SLIDEGATE_REDIS_QUEUE_TIMEOUT", default_value = "1s", value_parser = duration_arg)]
    pub redis_queue_timeout: Duration,
    /// Deadline for connecting to Redis at start.
    #[arg(long, env = "SLIDEGATE_REDIS_CONNECT_TIMEOUT", default_value = "2s", value_parser = duration_arg)]
    pub redis_connect_timeout: Duration,
    /// Where "now" comes from with Redis: this server's clock, or Redis TIME inside the script.
    #[arg(long, env = "SLIDEGATE_CLOCK", value_enum, default_value_t = ClockArg::Server)]
    pub clock: ClockArg,
    /// What to answer when the store fails: a gRPC UNAVAILABLE error (Envoy's failure_mode_deny
    /// decides), OK (allow) or OVER_LIMIT (deny).
    #[arg(long, env = "SLIDEGATE_STORE_FAILURE", value_enum, default_value_t = FailureArg::Error)]
    pub store_failure: FailureArg,
    /// Fraction of a limit above which admitted hits count as near_limit in metrics.
    #[arg(long, env = "SLIDEGATE_NEAR_LIMIT_RATIO", default_value_t = 0.8, value_parser = ratio_arg)]
    pub near_limit_ratio: f64,
    /// Do not watch the config for changes (SIGHUP still reloads).
    #[arg(long, env = "SLIDEGATE_NO_WATCH", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub no_watch: bool,
    /// Quiet time after a config change before reloading (at most four of them after the first change).
    #[arg(long, env = "SLIDEGATE_RELOAD_DEBOUNCE", default_value = "250ms", value_parser = duration_arg)]
    pub reload_debounce: Duration,
    /// Several files may define one domain; their descriptors are merged.
    #[arg(long, env = "SLIDEGATE_MERGE_DOMAIN_CONFIG", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub merge_domain_config: bool,
    /// Accept a reload that leaves no domain at all (refused by default while domains are
    /// loaded: a directory emptied by mistake would remove every limit).
    #[arg(long, env = "SLIDEGATE_ALLOW_EMPTY_CONFIG", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub allow_empty_config: bool,
    /// Start even when the config is missing, invalid or empty: answer OK without limits until a valid
    /// config arrives.
    #[arg(long, env = "SLIDEGATE_FORCE_START", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub force_start_without_initial_config: bool,
    /// Report not ready (/readyz, /healthcheck) until at least one domain is loaded.
    #[arg(long, env = "SLIDEGATE_READY_NEEDS_CONFIG", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub ready_needs_config: bool,
    /// Connections open at once, per port; more wait in the kernel's backlog.
    #[arg(long, env = "SLIDEGATE_MAX_CONNECTIONS", default_value_t = ConnectionLimits::default().max_connections)]
    pub max_connections: usize,
    /// Rate Limit Quota Service streams open at once (one per Envoy and domain); past it a new
    /// stream is refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "SLIDEGATE_RLQS_MAX_STREAMS", default_value_t = slidegate::server::grpc::quota_streams::DEFAULT_MAX_STREAMS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub rlqs_max_streams: usize,
    /// A connection nothing is read from for this long is closed (HTTP/2 peers are pinged at
    /// a third of it, so live ones stay); also the time a client has to send request headers.
    #[arg(long, env = "SLIDEGATE_IDLE_TIMEOUT", default_value = "25s", value_parser = duration_arg)]
    pub idle_timeout: Duration,
    /// Streams open at once on one HTTP/2 connection; Envoy opens another connection when one
    /// is full.
    #[arg(long, env = "SLIDEGATE_MAX_CONCURRENT_STREAMS", default_value_t = ConnectionLimits::default().max_streams, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_streams: u32,
    /// Ask a gRPC connection this old to finish (GOAWAY; within 10% either way), so clients
    /// reconnect and spread over replicas added since; unset, connections are kept.
    #[arg(long, env = "SLIDEGATE_GRPC_MAX_CONNECTION_AGE", value_parser = duration_arg)]
    pub grpc_max_connection_age: Option<Duration>,
    /// Then close it this long after, if calls still hold it.
    #[arg(long, env = "SLIDEGATE_GRPC_MAX_CONNECTION_AGE_GRACE", default_value = "1h", value_parser = duration_arg)]
    pub grpc_max_connection_age_grace: Duration,
    /// How long a request's body may take to arrive whole, on both ports.
    #[arg(long, env = "SLIDEGATE_BODY_TIMEOUT", default_value = "10s", value_parser = duration_arg)]
    pub body_timeout: Duration,
    /// Request bytes held at once for one connection's bodies still arriving (e.g. 8MiB).
    #[arg(long, env = "SLIDEGATE_MAX_BUFFERED_PER_CONNECTION", default_value = "8MiB", value_parser = bytes_arg)]
    pub max_buffered_per_connection: usize,
    /// Request bytes held at once over the whole server (e.g. 64MiB).
    #[arg(long, env = "SLIDEGATE_MAX_BUFFERED", default_value = "64MiB", value_parser = bytes_arg)]
    pub max_buffered: usize,
    /// After SIGTERM, keep serving with readiness off this long before closing listeners.
    #[arg(long, env = "SLIDEGATE_SHUTDOWN_DELAY", default_value = "0s", value_parser = duration_or_zero_arg)]
    pub shutdown_delay: Duration,
    /// Then wait at most this long for in-flight calls before exiting.
    #[arg(long, env = "SLIDEGATE_SHUTDOWN_GRACE", default_value = "20s", value_parser = duration_arg)]
    pub shutdown_grace: Duration,
    /// Threads that serve calls; by default one per CPU this process may use (its CPU affinity
    /// and cgroup quota, e.g. a Kubernetes CPU limit, count).
    #[arg(long, env = "SLIDEGATE_WORKER_THREADS", value_parser = threads_arg)]
    pub worker_threads: Option<std::num::NonZeroUsize>,
    /// Answer OK overall for every request (statuses still say what would happen).
    #[arg(long, env = "SLIDEGATE_SHADOW_MODE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub shadow_mode: bool,
    /// Treat every rule as quota_mode.
    #[arg(long, env = "SLIDEGATE_QUOTA_MODE", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub quota_mode: bool,
    /// Add RateLimit-Policy, RateLimit and Retry-After to responses.
    #[arg(long, env = "SLIDEGATE_RESPONSE_HEADERS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub response_headers: bool,
    /// Add the reference server's RateLimit-Limit, -Remaining and -Reset headers.
    #[arg(long, env = "SLIDEGATE_LIMIT_HEADERS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub limit_headers: bool,
    /// Names of those three headers: limit, remaining, reset.
    #[arg(
        long,
        env = "SLIDEGATE_LIMIT_HEADER_NAMES",
        value_delimiter = ',',
        num_args = 3,
        default_value = "RateLimit-Limit,RateLimit-Remaining,RateLimit-Reset"
    )]
    pub limit_header_names: Vec<String>,
    /// Domains whose rules all take debits (usage recorded even when it crosses the limit),
    /// for configs that cannot say `debit: true` themselves (e.g. from xDS); `*` for all.
    #[arg(long, env = "SLIDEGATE_DEBIT_DOMAINS", value_delimiter = ',')]
    pub debit_domains: Vec<String>,
    /// Most descriptors in one request.
    #[arg(long, env = "SLIDEGATE_MAX_DESCRIPTORS", default_value_t = RequestBounds::default().descriptors)]
    pub max_descriptors: usize,
    /// Most entries in one descriptor.
    #[arg(long, env = "SLIDEGATE_MAX_ENTRIES", default_value_t = RequestBounds::default().entries)]
    pub max_entries: usize,
    /// Most bytes in an entry key.
    #[arg(long, env = "SLIDEGATE_MAX_KEY_BYTES", default_value_t = RequestBounds::default().key_bytes)]
    pub max_key_bytes: usize,
    /// Most bytes in an entry value.
    #[arg(long, env = "SLIDEGATE_MAX_VALUE_BYTES", default_value_t = RequestBounds::default().value_bytes)]
    pub max_value_bytes: usize,
    /// Most hits of one descriptor, and of one request's descriptors together.
    #[arg(long, env = "SLIDEGATE_MAX_HITS", default_value_t = RequestBounds::default().hits)]
    pub max_hits: u64,
    /// Longest window a request's limit override may ask for.
    #[arg(long, env = "SLIDEGATE_MAX_OVERRIDE_WINDOW", default_value = "365d", value_parser = duration_arg)]
    pub max_override_window: Duration,
    /// Descriptors the exact over-limit cache holds at most: a descriptor the store found over
    /// is answered without the store until its reset (0: off).
    #[arg(long, env = "SLIDEGATE_OVER_LIMIT_CACHE", default_value_t = slidegate::limiter::DEFAULT_OVER_LIMIT_CACHE)]
    pub over_limit_cache: usize,
    /// Fill the response's dynamic_metadata with the request and matched rules' metadata.
    #[arg(long, env = "SLIDEGATE_DYNAMIC_METADATA", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub dynamic_metadata: bool,
    /// Send duration_until_reset in whole seconds, rounded up, as the reference does (on when
    /// started with the reference's environment).
    #[arg(long, env = "SLIDEGATE_WHOLE_SECOND_RESETS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub whole_second_resets: bool,
    /// TLS on the gRPC port: the PEM certificate chain (with --grpc-tls-key).
    #[arg(long, env = "SLIDEGATE_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// The PEM private key of --grpc-tls-cert.
    #[arg(long, env = "SLIDEGATE_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate signed by one of these PEM CAs.
    #[arg(long, env = "SLIDEGATE_GRPC_TLS_CLIENT_CA", requires = "grpc_tls_cert")]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// Mutual TLS: the client certificate must also be valid for this DNS name or IP.
    #[arg(
        long,
        env = "SLIDEGATE_GRPC_TLS_CLIENT_SAN",
        requires = "grpc_tls_client_ca"
    )]
    pub grpc_tls_client_san: Option<String>,
    /// How often the gRPC TLS files are checked for a new certificate (secret rotation).
    #[arg(long, env = "SLIDEGATE_TLS_RELOAD_INTERVAL", default_value = "5s", value_parser = duration_arg)]
    pub tls_reload_interval: Duration,
    /// Take the config from this xDS management server (host:port) instead of files: ADS,
    /// state of the world, RateLimitConfig resources (Envoy Gateway's way).
    #[arg(long, env = "SLIDEGATE_XDS_SERVER", conflicts_with = "config")]
    pub xds_server: Option<String>,
    /// The node id slidegate subscribes as.
    #[arg(long, env = "SLIDEGATE_XDS_NODE_ID", default_value = "default")]
    pub xds_node_id: String,
    /// Node metadata, `key=value,...`.
    #[arg(long, env = "SLIDEGATE_XDS_NODE_METADATA", value_delimiter = ',', value_parser = pair_arg::<'='>)]
    pub xds_node_metadata: Vec<(String, String)>,
    /// Extra gRPC metadata on the xDS stream, `name:value,...`.
    #[arg(long, env = "SLIDEGATE_XDS_HEADERS", value_delimiter = ',', value_parser = pair_arg::<':'>)]
    pub xds_headers: Vec<(String, String)>,
    /// TLS to the xDS server (the system's CAs unless --xds-tls-ca).
    #[arg(long, env = "SLIDEGATE_XDS_TLS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub xds_tls: bool,
    /// PEM CAs that sign the xDS server's certificate.
    #[arg(long, env = "SLIDEGATE_XDS_TLS_CA")]
    pub xds_tls_ca: Option<PathBuf>,
    /// PEM client certificate for an xDS server that requires one (with --xds-tls-key).
    #[arg(long, env = "SLIDEGATE_XDS_TLS_CERT")]
    pub xds_tls_cert: Option<PathBuf>,
    /// PEM private key of --xds-tls-cert.
    #[arg(long, env = "SLIDEGATE_XDS_TLS_KEY")]
    pub xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry (default: the host of --xds-server).
    #[arg(long, env = "SLIDEGATE_XDS_TLS_SERVER_NAME")]
    pub xds_tls_server_name: Option<String>,
    /// First delay before reconnecting to the xDS server; it doubles after each failure.
    #[arg(long, env = "SLIDEGATE_XDS_RETRY_INITIAL", default_value = "3s", value_parser = duration_arg)]
    pub xds_retry_initial: Duration,
    /// Longest delay between reconnects.
    #[arg(long, env = "SLIDEGATE_XDS_RETRY_MAX", default_value = "60s", value_parser = duration_arg)]
    pub xds_retry_max: Duration,
    /// Each delay is randomised by this fraction either way.
    #[arg(long, env = "SLIDEGATE_XDS_RETRY_JITTER", default_value_t = 0.5, value_parser = ratio_arg)]
    pub xds_retry_jitter: f64,
    /// Export OpenTelemetry traces over OTLP: a span per ShouldRateLimit call and per store
    /// call, joined to the caller's trace (W3C traceparent or B3 headers).
    #[arg(long, env = "SLIDEGATE_TRACING", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub tracing: bool,
    /// OTLP over gRPC or HTTP/protobuf.
    #[arg(long, env = "SLIDEGATE_TRACING_PROTOCOL", value_enum, default_value_t = TracingProtocolArg::Http)]
    pub tracing_protocol: TracingProtocolArg,
    /// The collector's URL, http://HOST:PORT (default: OTEL_EXPORTER_OTLP_ENDPOINT, else
    /// localhost:4318 for HTTP, 4317 for gRPC).
    #[arg(long, env = "SLIDEGATE_TRACING_ENDPOINT")]
    pub tracing_endpoint: Option<String>,
    /// The fraction of traces started here that are sampled, 0 to 1.
    #[arg(long, env = "SLIDEGATE_TRACING_SAMPLING_RATE", default_value_t = 1.0, value_parser = ratio_arg)]
    pub tracing_sampling_rate: f64,
    /// Sample by the rate alone, not following the caller's sampled flag.
    #[arg(long, env = "SLIDEGATE_TRACING_IGNORE_PARENT", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub tracing_ignore_parent: bool,
    /// service.name of the spans (default: OTEL_SERVICE_NAME, else slidegate).
    #[arg(long, env = "SLIDEGATE_TRACING_SERVICE_NAME")]
    pub tracing_service_name: Option<String>,
    /// service.namespace of the spans.
    #[arg(long, env = "SLIDEGATE_TRACING_SERVICE_NAMESPACE")]
    pub tracing_service_namespace: Option<String>,
    /// service.instance.id of the spans (default: a random id per start).
    #[arg(long, env = "SLIDEGATE_TRACING_SERVICE_INSTANCE_ID")]
    pub tracing_service_instance_id: Option<String>,
    /// Finished spans waiting for export at most; past it they are dropped and counted
    /// (slidegate_tracing_spans_dropped_total).
    #[arg(long, env = "SLIDEGATE_TRACING_QUEUE_SIZE", default_value_t = 2048)]
    pub tracing_queue_size: usize,
    /// Put descriptor entries with their values on the spans (they can be user ids).
    #[arg(long, env = "SLIDEGATE_TRACING_DESCRIPTOR_VALUES", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub tracing_descriptor_values: bool,
    /// Log output format.
    #[arg(long, env = "SLIDEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter (tracing's EnvFilter syntax); RUST_LOG is used when this is absent.
    #[arg(long, env = "SLIDEGATE_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// The decision log (target slidegate::decision) shows descriptor values as they came,
    /// where it otherwise shows a hash of each (they can be user ids).
    #[arg(long, env = "SLIDEGATE_LOG_DESCRIPTOR_VALUES", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    pub log_descriptor_values: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClockArg {
    Server,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormatArg {
    Compact,
    SortedSet,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailureArg {
    Error,
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetricNamesArg {
    Slidegate,
    Reference,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TracingProtocolArg {
    Grpc,
    Http,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// A log level as the reference and most tools write one, or a tracing filter.
pub fn log_filter(text: &str, source: &str) -> Result<String, String> {
    let level = text.trim().to_ascii_lowercase();
    let level = match level.as_str() {
        "warning" => "warn",
        "fatal" | "panic" => "error",
        other => other,
    };
    match level {
        // slidegate's own logs at that level; the libraries under it (HTTP/2 frames, the Redis
        // client's internals) stay at warn, where their news is for an operator.
        "debug" | "trace" => Ok(format!("warn,slidegate={level}")),
        "info" | "warn" | "error" | "off" => Ok(level.to_string()),
        _ if text.contains('=') || text.contains("::") || text.contains(',') => {
            tracing_subscriber::EnvFilter::try_new(text)
                .map(|_| text.to_string())
                .map_err(|e| format!("{source}={text:?}: not a log filter ({e}); write error, warn, info, debug or trace, or a filter such as slidegate=debug,fred=info"))
        }
        _ => Err(format!(
            "{source}={text:?}: not a log level; write error, warn, info, debug or trace, or a filter such as slidegate=debug,fred=info"
        )),
    }
}

/// The binary's entry point. Exit codes: 0 done, 1 failed, 2 usage.
pub fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    // Started as `ratelimit` (the reference's binary name, as Envoy Gateway starts its
    // container), slidegate takes the reference's defaults too.
    let as_reference = argv
        .first()
        .and_then(|p| std::path::Path::new(p).file_name())
        .is_some_and(|n| n == "ratelimit");
    if argv.len() == 1 && !as_reference && !reference_env::configured(&var) {
        let _ = Cli::command().write_long_help(&mut std::io::stderr());
        return ExitCode::from(2);
    }
    if let Err(message) = check_boolean_variables(&var) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    let matches = match Cli::command().try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Some(Command::Admin { action }) => admin_client::run(&action),
        Some(Command::Check { path, config }) => match path.or(config) {
            Some(path) => check(&path, &cli.serve),
            None => {
                eprintln!("error: check needs a file or directory: slidegate check DIR");
                ExitCode::from(2)
            }
        },
        None => {
            let given = |id: &str| {
                matches!(
                    matches.value_source(id),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
            };
            let mut args = cli.serve;
            match reference_env::apply(&mut args, &given, &var, as_reference) {
                Ok(notes) => serve::serve(args, notes),
                Err(message) => {
                    eprintln!("error: {message}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// Every `SLIDEGATE_*` boolean must read as one; the error names the variable, not the flag.
fn check_boolean_variables(var: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    let command = Cli::command();
    for arg in command.get_arguments() {
        let (Some(name), ArgAction::SetTrue) = (arg.get_env(), arg.get_action()) else {
            continue;
        };
        let name = name.to_string_lossy();
        if let Some(value) = var(&name)
            && parse_bool(&value).is_none()
        {
            return Err(format!(
                "{name}={value:?} is not a boolean: use 1/0, true/false or yes/no"
            ));
        }
    }
    Ok(())
}

/// The error for a config that defines no domain (an empty directory, one without `*.yaml`
/// files, a file with none): a server started on it would limit nothing.
pub fn no_domain(path: &std::path::Path) -> String {
    format!(
        "{}: no domain defined (no `*.yaml`/`*.yml` file with a `domain:`), so nothing would be limited; \
         point --config (or RUNTIME_ROOT/RUNTIME_SUBDIRECTORY) at the rules, start not ready until a \
         domain loads with --ready-needs-config (HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED=true), or \
         start anyway with --force-start-without-initial-config (FORCE_START_WITHOUT_INITIAL_CONFIG=true)",
        path.display()
    )
}

fn check(path: &std::path::Path, args: &ServeArgs) -> ExitCode {
    let options = config::LoadOptions {
        merge_domains: args.merge_domain_config,
        allow_no_domains: true,
    };
    match config::load_path_with(path, options) {
        Ok(loaded) if loaded.limits.domains.is_empty() => {
            eprintln!("{}", no_domain(path));
            eprintln!("{}: 1 error(s)", path.display());
            ExitCode::FAILURE
        }
        Ok(loaded) => {
            let rules = loaded.limits.rules();
            print!("{}", loaded.limits.describe());
            for warning in &loaded.warnings {
                eprintln!("warning: {warning}");
            }
            println!(
                "{}: {} file(s), {} rule(s), OK",
                path.display(),
                loaded.files.len(),
                rules.len()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            eprintln!("{}: {} error(s)", path.display(), errors.0.len());
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels_mean_slidegates_own_and_the_rest_are_refused() {
        assert_eq!(
            log_filter("debug", "--log-level"),
            Ok("warn,slidegate=debug".into())
        );
        assert_eq!(log_filter("WARNING", "LOG_LEVEL"), Ok("warn".into()));
        assert_eq!(log_filter("info", "RUST_LOG"), Ok("info".into()));
        assert_eq!(
            log_filter("slidegate=debug,fred=info", "RUST_LOG"),
            Ok("slidegate=debug,fred=info".into())
        );
        assert_eq!(
            log_filter("verbose", "--log-level"),
            Err("--log-level=\"verbose\": not a log level; write error, warn, info, debug or trace, or a filter such as slidegate=debug,fred=info".into())
        );
        assert!(log_filter("slidegate=loud", "RUST_LOG").is_err());
        assert_eq!(
            threads_arg("0"),
            Err(
                "'0' is not a thread count: give 1 or more, or leave the flag out for one per CPU"
                    .into()
            )
        );
        assert_eq!(threads_arg("3").map(std::num::NonZeroUsize::get), Ok(3));
    }

    #[test]
    fn booleans_read_as_the_reference_writes_them() {
        for yes in ["1", "true", "TRUE", "t", "yes", "on"] {
            assert_eq!(parse_bool(yes), Some(true), "{yes}");
        }
        for no in ["0", "false", "F", "no", "off"] {
            assert_eq!(parse_bool(no), Some(false), "{no}");
        }
        assert_eq!(parse_bool("maybe"), None);
        let var = |name: &str| (name == "SLIDEGATE_NO_WATCH").then(|| "maybe".to_string());
        let error = check_boolean_variables(&var).expect_err("refused");
        assert!(error.starts_with("SLIDEGATE_NO_WATCH=\"maybe\""), "{error}");
        let var = |name: &str| (name == "SLIDEGATE_NO_WATCH").then(|| "1".to_string());
        assert!(check_boolean_variables(&var).is_ok());
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
