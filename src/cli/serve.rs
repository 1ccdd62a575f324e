//! Serving: logging, the store, the limiter, metrics and reload, assembled from the arguments,
//! then `slidegate::server::run` until SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use slidegate::config::{self, LoadOptions, Loaded};
use slidegate::limiter::{
    Clock, FailurePolicy, LimitHeaderNames, Limiter, LimiterOptions, RequestBounds, SystemClock,
};
use slidegate::metrics::{MetricNames, Metrics};
use slidegate::server::grpc::tls::{ServerTls, ServerTlsFiles};
use slidegate::server::net::ConnectionLimits;
use slidegate::server::{App, Listeners, ServerOptions};
use slidegate::store::redis::redact;
use slidegate::store::{
    ClockSource, LogFormat as RedisLogFormat, MemoryStore, RedisOptions, RedisStore, Store,
};
use slidegate::tls::TlsFiles;
use slidegate::xds::{XdsOptions, XdsTls};

use slidegate::traces::{Protocol, TraceOptions, Tracing};

use super::{
    ClockArg, FailureArg, LogFormat, LogFormatArg, MetricNamesArg, ServeArgs, TracingProtocolArg,
};

/// Logging as `--log-level` (or `RUST_LOG`) says; a level or filter that means nothing is an
/// error (it would otherwise turn every log off, store errors included). With `traces`, the
/// spans of slidegate's own code also go to OpenTelemetry, whatever the log's level.
fn init_logging(args: &ServeArgs, traces: Option<&Tracing>) -> Result<(), String> {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::prelude::*;
    let filter = match (&args.log_level, std::env::var("RUST_LOG").ok()) {
        (Some(level), _) => super::log_filter(level, "--log-level")?,
        (None, Some(filter)) if !filter.trim().is_empty() => {
            super::log_filter(&filter, "RUST_LOG")?
        }
        (None, _) => "info".to_string(),
    };
    let filter = EnvFilter::try_new(&filter).map_err(|e| format!("log filter {filter:?}: {e}"))?;
    // Colours only on a terminal: escape codes in a container's log file are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let Some(traces) = traces else {
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(std::io::stderr);
        match args.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
        return Ok(());
    };
    // Each layer filtered on its own: the log keeps its level, and OpenTelemetry gets
    // slidegate's spans (never its events, which stay in the log), made only while a sampled
    // call runs.
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let log = match args.log_format {
        LogFormat::Text => log.boxed(),
        LogFormat::Json => log.json().boxed(),
    };
    // The spans carry what slidegate puts on them, not the code's place or thread.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(traces.tracer())
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(
            tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
                ours(meta) && slidegate::traces::sampled_here()
            })
            // Our spans are at debug level: no library's trace-level callsite is woken.
            .with_max_level_hint(tracing::level_filters::LevelFilter::DEBUG)
            // Asked at each span, not once per callsite: whether a call is sampled varies.
            .with_callsite_filter(|meta| {
                if ours(meta) {
                    tracing::subscriber::Interest::sometimes()
                } else {
                    tracing::subscriber::Interest::never()
                }
            }),
        );
    let log_spans = filter
        .max_level_hint()
        .is_none_or(|level| level >= tracing::level_filters::LevelFilter::DEBUG);
    slidegate::traces::set_log_spans(log_spans);
    tracing_subscriber::registry()
        .with(log.with_filter(filter))
        .with(spans)
        .init();
    Ok(())
}

/// slidegate's own spans, which go to OpenTelemetry.
fn ours(meta: &tracing::Metadata<'_>) -> bool {
    meta.is_span() && meta.target().starts_with("slidegate")
}

/// Serves until SIGTERM; `notes` are what reading the reference's variables had to say.
pub fn serve(args: ServeArgs, notes: Vec<String>) -> ExitCode {
    // tokio's defaults, its LIFO slot included: a task woken by the running one (a lone call's
    // Redis client, then its connection) runs next on the same worker without waking an idle
    // one. Under load a connection still writes its streams' answers together, as it runs them
    // itself (`slidegate::server::grpc::streams`).
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    // Without --worker-threads tokio starts one worker per CPU this process may use.
    if let Some(threads) = args.worker_threads {
        builder.worker_threads(threads.get());
    }
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The exporter is built, and its task started, on the runtime.
    let traces = if args.tracing {
        match runtime.block_on(async { slidegate::traces::start(&trace_options(&args)) }) {
            Ok(traces) => Some(traces),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    if let Err(message) = init_logging(&args, traces.as_ref()) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    for note in &notes {
        tracing::warn!("{note}");
    }
    if traces.is_some() {
        tracing::info!(
            protocol = ?args.tracing_protocol,
            endpoint = args.tracing_endpoint.as_deref().unwrap_or("(OTEL_EXPORTER_OTLP_ENDPOINT or the default)"),
            sampling_rate = args.tracing_sampling_rate,
            "OpenTelemetry traces on"
        );
    }
    let served = runtime.block_on(serve_async(args));
    if let Some(traces) = &traces {
        runtime.block_on(traces.flush(Duration::from_secs(2)));
    }
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}

fn trace_options(args: &ServeArgs) -> TraceOptions {
    TraceOptions {
        protocol: match args.tracing_protocol {
            TracingProtocolArg::Grpc => Protocol::Grpc,
            TracingProtocolArg::Http => Protocol::Http,
        },
        endpoint: args.tracing_endpoint.clone(),
        sampling_rate: args.tracing_sampling_rate,
        parent_based: !args.tracing_ignore_parent,
        service_name: args.tracing_service_name.clone(),
        service_namespace: args.tracing_service_namespace.clone(),
        service_instance_id: args.tracing_service_instance_id.clone(),
        queue: args.tracing_queue_size,
    }
}

async fn serve_async(args: ServeArgs) -> Result<(), String> {
    let load_options = LoadOptions {
        merge_domains: args.merge_domain_config,
        // Readiness that needs a domain turns a config without one into not ready, as the
        // reference goes unhealthy, rather than into a refusal.
        allow_no_domains: args.allow_empty_config || args.ready_needs_config,
    };
    let initial = match (&args.config, &args.xds_server) {
        (_, Some(_)) => Loaded::default(),
        (Some(path), None) => initial_config(path, load_options, &args)?,
        (None, None) => {
            return Err(
                "--config (or SLIDEGATE_CONFIG, or the reference's RUNTIME_ROOT) or --xds-server (CONFIG_TYPE=GRPC_XDS_SOTW) is required".into(),
            );
        }
    };
    let grpc_tls = grpc_tls(&args)?;
    let clock = Arc::new(SystemClock);
    let store = open_store(&args, clock.clone()).await?;
    let metrics = Arc::new(Metrics::with_names(match args.metric_names {
        MetricNamesArg::Slidegate => MetricNames::Slidegate,
        MetricNamesArg::Reference => MetricNames::Reference,
    }));
    metrics.config_loaded(initial.fingerprint != 0);
    let mut limiter = Limiter::new(initial.limits, store, clock, limiter_options(&args))
        .with_observer(metrics.clone());
    // From xDS without FORCE_START_WITHOUT_INITIAL_CONFIG: neither ready nor answering before
    // the first config, as the reference does not serve before it.
    let config_arrived = Arc::new(AtomicBool::new(false));
    let awaiting = args.xds_server.is_some() && !args.force_start_without_initial_config;
    if awaiting {
        limiter = limiter.awaiting_first_config(config_arrived.clone());
    }
    let limiter = Arc::new(limiter);
    let source = config_source(
        &args,
        load_options,
        initial.fingerprint,
        &limiter,
        &metrics,
        config_arrived.clone(),
    )?;
    let mut listeners = bind(&args).await?;
    listeners.grpc_tls = grpc_tls;
    tracing::info!(grpc = %args.grpc_addr, http = %args.http_addr, store = limiter.store().name(), tls = listeners.grpc_tls.is_some(), "serving");
    let app = App {
        limiter,
        metrics,
        options: ServerOptions {
            shutdown_delay: args.shutdown_delay,
            shutdown_grace: args.shutdown_grace,
            ready_needs_config: args.ready_needs_config,
            metrics_path: args.metrics_path.clone(),
            connections: ConnectionLimits {
                max_connections: args.max_connections,
                idle_timeout: args.idle_timeout,
                max_streams: args.max_concurrent_streams,
                body_timeout: args.body_timeout,
                max_buffered_per_connection: args.max_buffered_per_connection,
                max_buffered: args.max_buffered,
                max_connection_age: args.grpc_max_connection_age,
                max_connection_age_grace: args.grpc_max_connection_age_grace,
            },
            tls_reload_interval: args.tls_reload_interval,
            quota_streams: args.rlqs_max_streams,
            config_arrived: awaiting.then_some(config_arrived),
            ..ServerOptions::default()
        },
    };
    let result = slidegate::server::run(listeners, app, shutdown_signal()).await;
    drop(source);
    result.map_err(|e| e.to_string())
}

/// What keeps the config current; dropping it stops it (hence the field nothing reads).
enum ConfigSource {
    Files(#[allow(dead_code)] Option<config::watch::ConfigWatch>),
    Xds(#[allow(dead_code)] slidegate::xds::XdsClient),
}

fn config_source(
    args: &ServeArgs,
    load_options: LoadOptions,
    fingerprint: u64,
    limiter: &Arc<Limiter>,
    metrics: &Arc<Metrics>,
    config_arrived: Arc<AtomicBool>,
) -> Result<ConfigSource, String> {
    if let Some(server) = &args.xds_server {
        let options = xds_options(args, server, load_options);
        tracing::info!(server = %server, node = %args.xds_node_id, tls = options.tls.is_some(), "config from xDS");
        return Ok(ConfigSource::Xds(slidegate::xds::spawn(
            options,
            limiter.clone(),
            metrics.clone(),
            config_arrived,
        )));
    }
    let Some(config_path) = &args.config else {
        return Ok(ConfigSource::Files(None));
    };
    let watch = config::watch::spawn(
        config_path.clone(),
        load_options,
        limiter.clone(),
        metrics.clone(),
        fingerprint,
        args.reload_debounce,
        !args.no_watch,
    );
    match watch {
        Ok(watch) => Ok(ConfigSource::Files(Some(watch))),
        Err(e) if args.force_start_without_initial_config => {
            tracing::warn!(
                "cannot watch {}: {e}; serving without reload",
                config_path.display()
            );
            Ok(ConfigSource::Files(None))
        }
        Err(e) => Err(format!("cannot watch {}: {e}", config_path.display())),
    }
}

fn xds_options(args: &ServeArgs, server: &str, load: LoadOptions) -> XdsOptions {
    let tls = args.xds_tls.then(|| XdsTls {
        files: TlsFiles {
            ca: args.xds_tls_ca.clone(),
            cert: args.xds_tls_cert.clone(),
            key: args.xds_tls_key.clone(),
            skip_hostname_verification: false,
        },
        server_name: args.xds_tls_server_name.clone(),
    });
    XdsOptions {
        server: server.to_string(),
        node_id: args.xds_node_id.clone(),
        node_metadata: args.xds_node_metadata.clone(),
        headers: args.xds_headers.clone(),
        tls,
        connect_timeout: Duration::from_secs(5),
        retry_initial: args.xds_retry_initial,
        retry_max: args.xds_retry_max,
        jitter: args.xds_retry_jitter,
        load: LoadOptions {
            // The server's set is the whole truth: an empty one means no limits.
            allow_no_domains: true,
            ..load
        },
    }
}

/// The gRPC port's TLS, if configured; files that do not load stop the start.
fn grpc_tls(args: &ServeArgs) -> Result<Option<Arc<ServerTls>>, String> {
    let (Some(cert), Some(key)) = (&args.grpc_tls_cert, &args.grpc_tls_key) else {
        return Ok(None);
    };
    let files = ServerTlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: args.grpc_tls_client_ca.clone(),
        client_san: args.grpc_tls_client_san.clone(),
    };
    let tls = ServerTls::load(files).map_err(|e| format!("gRPC TLS: {e}"))?;
    Ok(Some(Arc::new(tls)))
}

/// The config at start. With `--force-start-without-initial-config`, a missing or invalid one
/// serves no limits (and fingerprint 0, so the first valid config the watch sees is swapped
/// in). One that defines no domain stops the start unless forced, or unless readiness waits
/// for a domain (`--ready-needs-config`): then the server starts not ready, and is ready once a
/// domain loads.
fn initial_config(
    path: &std::path::Path,
    options: LoadOptions,
    args: &ServeArgs,
) -> Result<Loaded, String> {
    let force_start = args.force_start_without_initial_config;
    match config::load_path_with(path, options) {
        Ok(loaded)
            if loaded.limits.domains.is_empty() && !force_start && !args.ready_needs_config =>
        {
            Err(super::no_domain(path))
        }
        Ok(loaded) => {
            if loaded.limits.domains.is_empty() && args.ready_needs_config {
                tracing::warn!(config = %path.display(), "no domain defined yet: not ready until one loads (--ready-needs-config)");
            }
            for warning in &loaded.warnings {
                tracing::warn!("{warning}");
            }
            tracing::info!(
                config = %path.display(),
                files = loaded.files.len(),
                domains = loaded.limits.domains.len(),
                "config loaded"
            );
            Ok(loaded)
        }
        Err(errors) if force_start => {
            tracing::warn!(config = %path.display(), "no valid config yet; answering OK without limits until one loads:\n{errors}");
            Ok(Loaded::default())
        }
        Err(errors) => Err(format!("config rejected:\n{errors}")),
    }
}

/// How often the embedded store drops idle logs when no request touches them.
const MEMORY_SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The embedded store, or Redis when `--redis` names one.
async fn open_store(args: &ServeArgs, clock: Arc<SystemClock>) -> Result<Arc<dyn Store>, String> {
    let Some(url) = &args.redis_url else {
        return Ok(Arc::new(
            MemoryStore::bounded(args.memory_max_keys)
                .with_sweeper(MEMORY_SWEEP_EVERY, move || clock.now_ms()),
        ));
    };
    let url = &slidegate::store::redis::normalize_url(url)?;
    let options = RedisOptions {
        url: url.clone(),
        pool_size: args.redis_pool_size,
        timeout: args.redis_timeout,
        queue_timeout: args.redis_queue_timeout,
        connect_timeout: args.redis_connect_timeout,
        clock: match args.clock {
            ClockArg::Server => ClockSource::Server,
            ClockArg::Redis => ClockSource::Redis,
        },
        tls: TlsFiles {
            ca: args.redis_tls_ca.clone(),
            cert: args.redis_tls_cert.clone(),
            key: args.redis_tls_key.clone(),
            skip_hostname_verification: args.redis_tls_skip_hostname_verification,
        },
        key_prefix: args.redis_key_prefix.clone(),
        wait_replicas: args.redis_wait_replicas,
        log_format: match args.redis_log_format {
            LogFormatArg::Compact => RedisLogFormat::Compact,
            LogFormatArg::SortedSet => RedisLogFormat::SortedSet,
        },
    };
    let store = RedisStore::connect(options)
        .await
        .map_err(|e| format!("cannot use Redis at {}: {e}", redact(url)))?;
    tracing::info!(redis = %redact(url), store = store.name(), "using Redis");
    Ok(Arc::new(store))
}

fn limiter_options(args: &ServeArgs) -> LimiterOptions {
    LimiterOptions {
        over_limit_cache: args.over_limit_cache,
        log_descriptor_values: args.log_descriptor_values,
        span_descriptor_values: args.tracing_descriptor_values,
        // A reset taken by one replica reaches the others' caches within a second.
        over_limit_cache_hold_ms: args.admin_addr.map(|_| 1_000),
        near_limit_ratio: args.near_limit_ratio,
        failure_policy: match args.store_failure {
            FailureArg::Error => FailurePolicy::Error,
            FailureArg::Allow => FailurePolicy::Allow,
            FailureArg::Deny => FailurePolicy::Deny,
        },
        global_shadow_mode: args.shadow_mode,
        response_headers: args.response_headers,
        dynamic_metadata: args.dynamic_metadata,
        whole_second_resets: args.whole_second_resets,
        global_quota_mode: args.quota_mode,
        debit_domains: args.debit_domains.clone(),
        bounds: RequestBounds {
            descriptors: args.max_descriptors,
            entries: args.max_entries,
            key_bytes: args.max_key_bytes,
            value_bytes: args.max_value_bytes,
            hits: args.max_hits,
            override_window_ms: u64::try_from(args.max_override_window.as_millis())
                .unwrap_or(u64::MAX),
        },
        limit_headers: args.limit_headers.then(|| {
            let name = |n: usize, default: String| {
                args.limit_header_names.get(n).cloned().unwrap_or(default)
            };
            let defaults = LimitHeaderNames::default();
            LimitHeaderNames {
                limit: name(0, defaults.limit),
                remaining: name(1, defaults.remaining),
                reset: name(2, defaults.reset),
            }
        }),
        quota_ttl: slidegate::limiter::assignments::QUOTA_TTL,
    }
}

async fn bind(args: &ServeArgs) -> Result<Listeners, String> {
    let grpc = tokio::net::TcpListener::bind(args.grpc_addr)
        .await
        .map_err(|e| format!("cannot listen on {} (gRPC): {e}", args.grpc_addr))?;
    let http = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| format!("cannot listen on {} (HTTP): {e}", args.http_addr))?;
    let metrics = match args.metrics_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr} (metrics): {e}"))?,
        ),
        None => None,
    };
    let admin = match args.admin_addr {
        Some(addr) => Some(admin_listener(args, addr).await?),
        None => None,
    };
    Ok(Listeners {
        grpc,
        http,
        metrics,
        grpc_tls: None,
        admin,
    })
}

/// The admin API's listener, with its tokens and TLS. It takes a caller only with a
/// credential: a token file, a client CA, or both.
async fn admin_listener(
    args: &ServeArgs,
    addr: std::net::SocketAddr,
) -> Result<slidegate::server::AdminListener, String> {
    if args.admin_token_file.is_none() && args.admin_tls_client_ca.is_none() {
        return Err(format!(
            "--admin-addr {addr}: the admin API needs a credential: --admin-token-file FILE (bearer tokens), or --admin-tls-cert, --admin-tls-key and --admin-tls-client-ca (mutual TLS), or both"
        ));
    }
    let tokens = match &args.admin_token_file {
        Some(path) => Some(Arc::new(slidegate::server::admin_api::Tokens::load(path)?)),
        None => None,
    };
    let tls = match (&args.admin_tls_cert, &args.admin_tls_key) {
        (Some(cert), Some(key)) => {
            let files = ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.admin_tls_client_ca.clone(),
                client_san: args.admin_tls_client_san.clone(),
            };
            let tls = ServerTls::load_for_http(files).map_err(|e| format!("admin TLS: {e}"))?;
            Some(Arc::new(tls))
        }
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (--admin-addr): {e}"))?;
    tracing::info!(
        addr = %addr,
        tokens = tokens.is_some(),
        tls = tls.is_some(),
        client_certificates = args.admin_tls_client_ca.is_some(),
        "admin API on"
    );
    Ok(slidegate::server::AdminListener {
        listener,
        tokens,
        tls,
    })
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
