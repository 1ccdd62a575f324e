//! The binary's command line and environment: every flag has an environment twin
//! (`SLIDEGATE_*`). It assembles the library's parts (config, store, limiter, metrics, reload)
//! and hands them to `slidegate::server::run`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};

use slidegate::config;
use std::time::Duration;

use slidegate::limiter::{Clock, FailurePolicy, Limiter, LimiterOptions, SystemClock};
use slidegate::metrics::Metrics;
use slidegate::server::{App, Listeners, ServerOptions};
use slidegate::store::redis::redact;
use slidegate::store::{ClockSource, MemoryStore, RedisOptions, RedisStore, Store};

#[derive(Debug, Parser)]
#[command(
    name = "slidegate",
    version,
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
    /// Validate a config file or directory; print every error and exit non-zero if any.
    Check {
        #[arg(long, env = "SLIDEGATE_CONFIG")]
        config: PathBuf,
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
    /// HTTP listen address (/healthz, /readyz, POST /json).
    #[arg(long, env = "SLIDEGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Redis URL; without it slidegate runs on its embedded in-process store.
    #[arg(long = "redis", env = "SLIDEGATE_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Redis connections in the pool.
    #[arg(long, env = "SLIDEGATE_REDIS_POOL_SIZE", default_value_t = 4)]
    pub redis_pool_size: usize,
    /// Deadline for one Redis decision (all slots): well under Envoy's 20 ms filter timeout.
    #[arg(long, env = "SLIDEGATE_REDIS_TIMEOUT", default_value = "15ms", value_parser = duration_arg)]
    pub redis_timeout: Duration,
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
    #[arg(long, env = "SLIDEGATE_NO_WATCH")]
    pub no_watch: bool,
    /// Quiet time after a config change before reloading.
    #[arg(long, env = "SLIDEGATE_RELOAD_DEBOUNCE", default_value = "250ms", value_parser = duration_arg)]
    pub reload_debounce: Duration,
    /// After SIGTERM, keep serving with readiness off this long before closing listeners.
    #[arg(long, env = "SLIDEGATE_SHUTDOWN_DELAY", default_value = "0s", value_parser = duration_or_zero_arg)]
    pub shutdown_delay: Duration,
    /// Then wait at most this long for in-flight calls before exiting.
    #[arg(long, env = "SLIDEGATE_SHUTDOWN_GRACE", default_value = "20s", value_parser = duration_arg)]
    pub shutdown_grace: Duration,
    /// Answer OK overall for every request (statuses still say what would happen).
    #[arg(long, env = "SLIDEGATE_SHADOW_MODE")]
    pub shadow_mode: bool,
    /// Add RateLimit-Policy, RateLimit and Retry-After to responses.
    #[arg(long, env = "SLIDEGATE_RESPONSE_HEADERS")]
    pub response_headers: bool,
    /// Fill the response's dynamic_metadata with the request and matched rules' metadata.
    #[arg(long, env = "SLIDEGATE_DYNAMIC_METADATA")]
    pub dynamic_metadata: bool,
    /// Log output format.
    #[arg(long, env = "SLIDEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter (tracing's EnvFilter syntax); RUST_LOG is used when this is absent.
    #[arg(long, env = "SLIDEGATE_LOG_LEVEL")]
    pub log_level: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClockArg {
    Server,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailureArg {
    Error,
    Allow,
    Deny,
}

fn duration_arg(text: &str) -> Result<Duration, String> {
    config::duration::parse_ms(text).map(Duration::from_millis)
}

fn duration_or_zero_arg(text: &str) -> Result<Duration, String> {
    // Zero is no duration in config, but "no delay" here: `0`, or 0 with a known unit.
    let zero_unit = text.trim().strip_prefix('0');
    if zero_unit.is_some_and(|unit| ["", "ms", "s", "m", "h", "d", "w"].contains(&unit)) {
        return Ok(Duration::ZERO);
    }
    duration_arg(text)
}

fn ratio_arg(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("'{text}' is not a ratio between 0 and 1")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The binary's entry point.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check { config }) => check(&config),
        None => serve(cli.serve),
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match config::load_path(path) {
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

fn init_logging(args: &ServeArgs) {
    use tracing_subscriber::EnvFilter;
    let filter = match &args.log_level {
        Some(level) => EnvFilter::new(level),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    // Colours only on a terminal: escape codes in a container's log file are noise.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    init_logging(&args);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve_async(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}

async fn serve_async(args: ServeArgs) -> Result<(), String> {
    let Some(config_path) = &args.config else {
        return Err(
            "--config (or SLIDEGATE_CONFIG) is required: a YAML file or a directory".into(),
        );
    };
    let loaded = config::load_path(config_path).map_err(|e| format!("config rejected:\n{e}"))?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        config = %config_path.display(),
        files = loaded.files.len(),
        domains = loaded.limits.domains.len(),
        "config loaded"
    );
    let clock = Arc::new(SystemClock);
    let store = open_store(&args, clock.clone()).await?;
    let metrics = Arc::new(Metrics::new());
    metrics.config_loaded(true);
    let limiter = Arc::new(
        Limiter::new(loaded.limits, store, clock, limiter_options(&args))
            .with_observer(metrics.clone()),
    );
    let _watch = config::watch::spawn(
        config_path.clone(),
        limiter.clone(),
        metrics.clone(),
        loaded.fingerprint,
        args.reload_debounce,
        !args.no_watch,
    )
    .map_err(|e| format!("cannot watch {}: {e}", config_path.display()))?;
    let listeners = bind(&args).await?;
    tracing::info!(grpc = %args.grpc_addr, http = %args.http_addr, store = limiter.store_name(), "serving");
    let app = App {
        limiter,
        metrics,
        options: ServerOptions {
            shutdown_delay: args.shutdown_delay,
            shutdown_grace: args.shutdown_grace,
            ..ServerOptions::default()
        },
    };
    slidegate::server::run(listeners, app, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

/// How often the embedded store drops idle logs when no request touches them.
const MEMORY_SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The embedded store, or Redis when `--redis` names one.
async fn open_store(args: &ServeArgs, clock: Arc<SystemClock>) -> Result<Arc<dyn Store>, String> {
    let Some(url) = &args.redis_url else {
        return Ok(Arc::new(MemoryStore::with_sweeper(
            MEMORY_SWEEP_EVERY,
            move || clock.now_ms(),
        )));
    };
    let options = RedisOptions {
        url: url.clone(),
        pool_size: args.redis_pool_size,
        timeout: args.redis_timeout,
        connect_timeout: args.redis_connect_timeout,
        clock: match args.clock {
            ClockArg::Server => ClockSource::Server,
            ClockArg::Redis => ClockSource::Redis,
        },
    };
    let store = RedisStore::connect(options)
        .await
        .map_err(|e| format!("cannot use Redis at {}: {e}", redact(url)))?;
    tracing::info!(redis = %redact(url), store = store.name(), "connected to Redis");
    Ok(Arc::new(store))
}

fn limiter_options(args: &ServeArgs) -> LimiterOptions {
    LimiterOptions {
        near_limit_ratio: args.near_limit_ratio,
        failure_policy: match args.store_failure {
            FailureArg::Error => FailurePolicy::Error,
            FailureArg::Allow => FailurePolicy::Allow,
            FailureArg::Deny => FailurePolicy::Deny,
        },
        global_shadow_mode: args.shadow_mode,
        response_headers: args.response_headers,
        dynamic_metadata: args.dynamic_metadata,
    }
}

async fn bind(args: &ServeArgs) -> Result<Listeners, String> {
    let grpc = tokio::net::TcpListener::bind(args.grpc_addr)
        .await
        .map_err(|e| format!("cannot listen on {} (gRPC): {e}", args.grpc_addr))?;
    let http = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| format!("cannot listen on {} (HTTP): {e}", args.http_addr))?;
    Ok(Listeners { grpc, http })
}

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_delay_takes_only_known_units() {
        for zero in ["0", "0s", "0ms", " 0m "] {
            assert_eq!(duration_or_zero_arg(zero), Ok(Duration::ZERO), "{zero:?}");
        }
        assert_eq!(
            duration_or_zero_arg("1500ms"),
            Ok(Duration::from_millis(1500))
        );
        for bad in ["0parsec", "0x", "parsec", ""] {
            assert!(duration_or_zero_arg(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
