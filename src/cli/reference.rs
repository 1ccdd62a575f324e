//! The reference server's environment (envoyproxy/ratelimit's `src/settings/settings.go`), so a
//! deployment that starts it with `REDIS_URL`, `RUNTIME_ROOT`, `USE_PROMETHEUS` and friends
//! starts slidegate unchanged. Each variable is honoured (mapped onto a flag that was not given),
//! warned about (named in a log line at start: slidegate has no use for it) or refused (start
//! fails with a message: honouring it wrongly would be worse). `docs/migrating.md` has the full table.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use super::value_parsers::parse_bool;
use super::{LogFormat, MetricNamesArg, ServeArgs, TracingProtocolArg};

/// Reads one environment variable (empty counts as unset, as in the reference).
pub type Var<'a> = &'a dyn Fn(&str) -> Option<String>;
/// Whether a flag's value came from the command line or its `SLIDEGATE_*` variable.
pub type Given<'a> = &'a dyn Fn(&str) -> bool;

/// Whether the environment says where the config is, so no arguments are needed.
pub fn configured(var: Var<'_>) -> bool {
    [
        "SLIDEGATE_CONFIG",
        "SLIDEGATE_XDS_SERVER",
        "RUNTIME_ROOT",
        "RUNTIME_SUBDIRECTORY",
    ]
    .iter()
    .any(|name| var(name).is_some())
        || xds_config(var)
}

/// `CONFIG_TYPE=GRPC_XDS_SOTW`: the config comes from an xDS server.
fn xds_config(var: Var<'_>) -> bool {
    var("CONFIG_TYPE").is_some_and(|k| k.eq_ignore_ascii_case("GRPC_XDS_SOTW"))
}

/// The reference's variables slidegate has no use for, and why.
const WARNED: &[(&str, &str)] = &[
    ("PROTO", "slidegate's gRPC listener is TCP"),
    (
        "DEBUG_HOST",
        "there is no debug port; /config on the HTTP port lists the rules",
    ),
    (
        "DEBUG_PORT",
        "there is no debug port; /config on the HTTP port lists the rules",
    ),
    (
        "USE_DOG_STATSD",
        "no statsd: scrape /metrics (USE_PROMETHEUS=true gives the reference's names)",
    ),
    ("USE_DOG_STATSD_MOGRIFIERS", "no statsd: scrape /metrics"),
    ("STATSD_HOST", "no statsd: scrape /metrics"),
    ("STATSD_PORT", "no statsd: scrape /metrics"),
    (
        "EXTRA_TAGS",
        "no statsd: add labels in the Prometheus scrape config",
    ),
    ("STATS_FLUSH_INTERVAL", "metrics are read at scrape time"),
    (
        "DISABLE_STATS",
        "metrics are always kept; nothing is sent anywhere",
    ),
    (
        "PROMETHEUS_MAPPER_YAML",
        "the names are fixed to the default mapping's",
    ),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "keys expire exactly when no window needs them",
    ),
    (
        "REDIS_PIPELINE_WINDOW",
        "calls are sent as they come, on a pool of connections",
    ),
    (
        "REDIS_PIPELINE_LIMIT",
        "calls are sent as they come, on a pool of connections",
    ),
    (
        "REDIS_PERSECOND",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_SOCKET_TYPE",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_TYPE",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_URL",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_POOL_SIZE",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_AUTH",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_TLS",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_WINDOW",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_LIMIT",
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "readiness always pings Redis",
    ),
    (
        "REDIS_TIMEOUT",
        "a decision's deadline is --redis-timeout (15 ms), below Envoy's 20 ms",
    ),
    (
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
        "calls share the pool's connections; none waits for one",
    ),
    (
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "calls to several slots always run in parallel",
    ),
    (
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "see --redis-connect-timeout",
    ),
    ("REDIS_STARTUP_MAX_INTERVAL", "see --redis-connect-timeout"),
    (
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
        "see --redis-connect-timeout",
    ),
    (
        "MEMCACHE_HOST_PORT",
        "the store is Redis or the embedded one",
    ),
    (
        "MEMCACHE_MAX_IDLE_CONNS",
        "the store is Redis or the embedded one",
    ),
    ("MEMCACHE_SRV", "the store is Redis or the embedded one"),
    (
        "MEMCACHE_SRV_REFRESH",
        "the store is Redis or the embedded one",
    ),
    ("MEMCACHE_TLS", "the store is Redis or the embedded one"),
    (
        "MEMCACHE_TLS_CLIENT_CERT",
        "the store is Redis or the embedded one",
    ),
    (
        "MEMCACHE_TLS_CLIENT_KEY",
        "the store is Redis or the embedded one",
    ),
    (
        "MEMCACHE_TLS_CACERT",
        "the store is Redis or the embedded one",
    ),
    (
        "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
        "the store is Redis or the embedded one",
    ),
];

/// What the mapping reads: the variables, which flags were given, and whether the binary runs
/// under the reference's name (then the reference's defaults apply too).
#[derive(Clone, Copy)]
struct Env<'a> {
    var: Var<'a>,
    given: Given<'a>,
    as_reference: bool,
}

/// Applies the reference's variables to the flags that were not given; returns the notes to
/// log at start (one per variable slidegate does not use), or why it cannot start.
pub fn apply(
    args: &mut ServeArgs,
    given: Given<'_>,
    var: Var<'_>,
    as_reference: bool,
) -> Result<Vec<String>, String> {
    refuse(var)?;
    let env = Env {
        var,
        given,
        as_reference,
    };
    let mut notes = Vec::new();
    listeners(args, env)?;
    grpc_tls(args, env, &mut notes)?;
    if xds_config(var) {
        xds(args, env, &mut notes)?;
    } else {
        config_dir(args, env, &mut notes)?;
    }
    redis(args, env, &mut notes)?;
    // Started as the reference is (its binary name, or its config variables): its clients
    // compare whole messages, in which a reset is whole seconds.
    let as_the_reference = as_reference
        || xds_config(var)
        || ["RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY"]
            .iter()
            .any(|n| var(n).is_some());
    if as_the_reference && !given("whole_second_resets") {
        args.whole_second_resets = true;
    }
    connection_age(args, env, as_the_reference)?;
    switches(args, env)?;
    logging(args, env)?;
    tracing(args, env)?;
    prometheus(args, env)?;
    for (name, why) in WARNED {
        if var(name).is_some() {
            notes.push(format!(
                "{name} is set but slidegate does not use it: {why}"
            ));
        }
    }
    if flag(var, "USE_STATSD")? == Some(true) {
        notes.push("USE_STATSD=true: slidegate sends no statsd; scrape /metrics (USE_PROMETHEUS=true gives the reference's names)".into());
    }
    if flag(var, "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")? == Some(false) {
        notes.push("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=false: slidegate never records a rejected request".into());
    }
    Ok(notes)
}

/// Settings that would silently change what the server is, were they ignored.
fn refuse(var: Var<'_>) -> Result<(), String> {
    if var("GRPC_UDS").is_some() {
        return Err("GRPC_UDS: slidegate listens on TCP only (GRPC_HOST, GRPC_PORT)".into());
    }
    if let Some(kind) = var("CONFIG_TYPE")
        .filter(|k| !k.eq_ignore_ascii_case("FILE") && !k.eq_ignore_ascii_case("GRPC_XDS_SOTW"))
    {
        return Err(format!("CONFIG_TYPE={kind}: use FILE or GRPC_XDS_SOTW"));
    }
    if let Some(backend) = var("BACKEND_TYPE").filter(|b| !b.eq_ignore_ascii_case("redis")) {
        return Err(format!(
            "BACKEND_TYPE={backend}: slidegate's stores are Redis and its embedded store"
        ));
    }
    Ok(())
}

/// A boolean variable, read as the reference reads it; `None` when unset.
fn flag(var: Var<'_>, name: &str) -> Result<Option<bool>, String> {
    var(name)
        .map(|value| {
            parse_bool(&value).ok_or_else(|| {
                format!("{name}={value:?} is not a boolean: use 1/0, true/false or yes/no")
            })
        })
        .transpose()
}

fn listeners(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if !given("http_addr")
        && let Some(addr) = address(var, "HOST", "PORT", 8080)?
    {
        args.http_addr = addr;
    }
    if !given("grpc_addr")
        && let Some(addr) = address(var, "GRPC_HOST", "GRPC_PORT", 8081)?
    {
        args.grpc_addr = addr;
    }
    Ok(())
}

/// `HOST`/`PORT`-style pairs; `None` when neither is set.
fn address(
    var: Var<'_>,
    host_name: &str,
    port_name: &str,
    default_port: u16,
) -> Result<Option<SocketAddr>, String> {
    let (host, port) = (var(host_name), var(port_name));
    if host.is_none() && port.is_none() {
        return Ok(None);
    }
    let ip = match host.as_deref() {
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Some("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some(text) => text
            .trim_matches(|c| c == '[' || c == ']')
            .parse()
            .map_err(|_| format!("{host_name}={text:?} is not an IP address"))?,
    };
    let port = match port.as_deref() {
        None => default_port,
        Some(text) => text
            .parse()
            .map_err(|_| format!("{port_name}={text:?} is not a port number"))?,
    };
    Ok(Some(SocketAddr::new(ip, port)))
}

/// Sets `field` from the variable `name` unless the flag `id` was given.
fn path_var(var: Var<'_>, given: Given<'_>, name: &str, id: &str, field: &mut Option<PathBuf>) {
    if let Some(path) = var(name)
        && !given(id)
    {
        *field = Some(PathBuf::from(path));
    }
}

/// `GRPC_SERVER_USE_TLS` with `GRPC_SERVER_TLS_CERT`/`_KEY`; mutual TLS with the reference's
/// `GRPC_CLIENT_TLS_CACERT` or Envoy Gateway's `GRPC_SERVER_TLS_CA_CERT` (the reference
/// ignores the latter; slidegate honours both, so Envoy Gateway's deployment gets the mutual
/// TLS it asks for), and `GRPC_CLIENT_TLS_SAN`.
fn grpc_tls(
    args: &mut ServeArgs,
    Env { var, given, .. }: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let names = [
        "GRPC_SERVER_TLS_CERT",
        "GRPC_SERVER_TLS_KEY",
        "GRPC_CLIENT_TLS_CACERT",
        "GRPC_SERVER_TLS_CA_CERT",
        "GRPC_CLIENT_TLS_SAN",
    ];
    if flag(var, "GRPC_SERVER_USE_TLS")? != Some(true) {
        for name in names.iter().filter(|n| var(n).is_some()) {
            notes.push(format!(
                "{name} is set but GRPC_SERVER_USE_TLS is not: the gRPC port is plaintext"
            ));
        }
        return Ok(());
    }
    if var("GRPC_SERVER_TLS_CERT").is_none() || var("GRPC_SERVER_TLS_KEY").is_none() {
        return Err(
            "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY".into(),
        );
    }
    path_var(
        var,
        given,
        "GRPC_SERVER_TLS_CERT",
        "grpc_tls_cert",
        &mut args.grpc_tls_cert,
    );
    path_var(
        var,
        given,
        "GRPC_SERVER_TLS_KEY",
        "grpc_tls_key",
        &mut args.grpc_tls_key,
    );
    path_var(
        var,
        given,
        "GRPC_SERVER_TLS_CA_CERT",
        "grpc_tls_client_ca",
        &mut args.grpc_tls_client_ca,
    );
    path_var(
        var,
        given,
        "GRPC_CLIENT_TLS_CACERT",
        "grpc_tls_client_ca",
        &mut args.grpc_tls_client_ca,
    );
    if let Some(san) = var("GRPC_CLIENT_TLS_SAN")
        && !given("grpc_tls_client_san")
    {
        if args.grpc_tls_client_ca.is_none() {
            return Err(
                "GRPC_CLIENT_TLS_SAN needs GRPC_CLIENT_TLS_CACERT (client certificates)".into(),
            );
        }
        args.grpc_tls_client_san = Some(san);
    }
    Ok(())
}

/// `CONFIG_TYPE=GRPC_XDS_SOTW` and the `CONFIG_GRPC_XDS_*` and `XDS_CLIENT_BACKOFF_*` settings.
fn xds(args: &mut ServeArgs, env: Env<'_>, notes: &mut Vec<String>) -> Result<(), String> {
    let Env { var, given, .. } = env;
    if given("config") {
        return Err(
            "CONFIG_TYPE=GRPC_XDS_SOTW and --config both say where the config is: choose one"
                .into(),
        );
    }
    if !given("xds_server") {
        args.xds_server =
            Some(var("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or_else(|| "localhost:18000".into()));
    }
    if let Some(id) = var("CONFIG_GRPC_XDS_NODE_ID")
        && !given("xds_node_id")
    {
        args.xds_node_id = id;
    }
    if let Some(list) = var("CONFIG_GRPC_XDS_NODE_METADATA")
        && !given("xds_node_metadata")
    {
        args.xds_node_metadata = pairs(&list, '=', "CONFIG_GRPC_XDS_NODE_METADATA", notes);
    }
    if let Some(list) = var("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS")
        && !given("xds_headers")
    {
        args.xds_headers = pairs(
            &list,
            ':',
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            notes,
        );
    }
    if let Some(tls) = flag(var, "CONFIG_GRPC_XDS_SERVER_USE_TLS")?
        && !given("xds_tls")
    {
        args.xds_tls = tls;
    }
    path_var(
        var,
        given,
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
        "xds_tls_ca",
        &mut args.xds_tls_ca,
    );
    path_var(
        var,
        given,
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
        "xds_tls_cert",
        &mut args.xds_tls_cert,
    );
    path_var(
        var,
        given,
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
        "xds_tls_key",
        &mut args.xds_tls_key,
    );
    if let Some(name) = var("CONFIG_GRPC_XDS_SERVER_TLS_SAN")
        && !given("xds_tls_server_name")
    {
        args.xds_tls_server_name = Some(name);
    }
    xds_backoff(args, env)
}

/// The reconnect delays: the first is `CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL` (else
/// `XDS_CLIENT_BACKOFF_INITIAL_INTERVAL`), doubling up to `XDS_CLIENT_BACKOFF_MAX_INTERVAL`,
/// randomised by `XDS_CLIENT_BACKOFF_RANDOM_FACTOR` unless `XDS_CLIENT_BACKOFF_JITTER=false`.
fn xds_backoff(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    let duration = |name: &str| -> Result<Option<std::time::Duration>, String> {
        var(name)
            .map(|text| {
                slidegate::config::duration::parse_ms(&text)
                    .map(std::time::Duration::from_millis)
                    .map_err(|e| format!("{name}={text:?}: {e}"))
            })
            .transpose()
    };
    let initial = match duration("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL")? {
        Some(d) => Some(d),
        None => duration("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL")?,
    };
    if let Some(initial) = initial
        && !given("xds_retry_initial")
    {
        args.xds_retry_initial = initial;
    }
    if let Some(max) = duration("XDS_CLIENT_BACKOFF_MAX_INTERVAL")?
        && !given("xds_retry_max")
    {
        args.xds_retry_max = max;
    }
    if !given("xds_retry_jitter") {
        if let Some(text) = var("XDS_CLIENT_BACKOFF_RANDOM_FACTOR") {
            args.xds_retry_jitter = text
                .parse::<f64>()
                .ok()
                .filter(|f| (0.0..=1.0).contains(f))
                .ok_or_else(|| {
                    format!("XDS_CLIENT_BACKOFF_RANDOM_FACTOR={text:?} is not between 0 and 1")
                })?;
        }
        if flag(var, "XDS_CLIENT_BACKOFF_JITTER")? == Some(false) {
            args.xds_retry_jitter = 0.0;
        }
    }
    Ok(())
}

/// `a<sep>1,b<sep>2`; malformed entries are skipped with a note, as the reference skips them.
fn pairs(list: &str, sep: char, name: &str, notes: &mut Vec<String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once(sep) {
            Some((k, v)) if !k.trim().is_empty() => out.push((k.trim().into(), v.trim().into())),
            _ => notes.push(format!("{name}: '{entry}' is not name{sep}value; skipped")),
        }
    }
    out
}

/// `$RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/$RUNTIME_APPDIRECTORY`, with the reference's defaults.
fn config_dir(args: &mut ServeArgs, env: Env<'_>, notes: &mut Vec<String>) -> Result<(), String> {
    let Env {
        var,
        given,
        as_reference,
    } = env;
    let runtime = [
        "RUNTIME_ROOT",
        "RUNTIME_SUBDIRECTORY",
        "RUNTIME_APPDIRECTORY",
    ];
    if given("config") || !(as_reference || runtime.iter().any(|n| var(n).is_some())) {
        return Ok(());
    }
    let root = var("RUNTIME_ROOT").unwrap_or_else(|| "/srv/runtime_data/current".into());
    let mut path = PathBuf::from(root);
    if let Some(sub) = var("RUNTIME_SUBDIRECTORY") {
        path.push(sub);
    }
    path.push(var("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".into()));
    args.config = Some(path);
    if flag(var, "RUNTIME_IGNOREDOTFILES")? == Some(false) {
        notes.push("RUNTIME_IGNOREDOTFILES=false: slidegate always skips dotfiles (which also skips a ConfigMap's ..data copies)".into());
    }
    // RUNTIME_WATCH_ROOT: slidegate watches the config directory itself, which sees both a file
    // changing and a symlink swap above it, so either value is honoured.
    flag(var, "RUNTIME_WATCH_ROOT")?;
    Ok(())
}

/// `REDIS_URL` (`host:port`, or a comma list for cluster and sentinel), `REDIS_TYPE`,
/// `REDIS_AUTH`, `REDIS_TLS`, `REDIS_SOCKET_TYPE`, `REDIS_POOL_SIZE`, as one Redis URL.
fn redis(args: &mut ServeArgs, env: Env<'_>, notes: &mut Vec<String>) -> Result<(), String> {
    let Env {
        var,
        given,
        as_reference,
    } = env;
    if !given("redis_key_prefix")
        && let Some(prefix) = var("CACHE_KEY_PREFIX")
    {
        args.redis_key_prefix = prefix;
    }
    if !given("redis_pool_size")
        && let Some(size) = var("REDIS_POOL_SIZE")
    {
        args.redis_pool_size = size
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("REDIS_POOL_SIZE={size:?} is not a positive number"))?;
    }
    if given("redis_url") {
        return Ok(());
    }
    let Some(url) = var("REDIS_URL") else {
        if as_reference {
            notes.push("REDIS_URL is not set: using the embedded store".into());
        }
        return Ok(());
    };
    let socket = var("REDIS_SOCKET_TYPE").map(|s| s.to_ascii_lowercase());
    if socket.as_deref() == Some("unix") || (socket.is_none() && url.starts_with('/')) {
        return Err("REDIS_SOCKET_TYPE=unix: slidegate reaches Redis over TCP only; set REDIS_SOCKET_TYPE=tcp and REDIS_URL=host:port".into());
    }
    if let Some(other) = socket.filter(|s| s != "tcp") {
        return Err(format!("REDIS_SOCKET_TYPE={other:?}: use tcp"));
    }
    let tls = flag(var, "REDIS_TLS")?.unwrap_or(false);
    redis_tls(args, env)?;
    let scheme = if tls { "rediss" } else { "redis" };
    let auth = var("REDIS_AUTH").map_or(String::new(), |auth| match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}@", encode(user), encode(password)),
        None => format!(":{}@", encode(&auth)),
    });
    let kind = var("REDIS_TYPE").map_or("single".into(), |t| t.to_ascii_lowercase());
    args.redis_url = Some(match kind.as_str() {
        "single" => format!("{scheme}://{auth}{url}"),
        "cluster" => format!("{scheme}-cluster://{auth}{url}"),
        "sentinel" => sentinel_url(scheme, &auth, &url, var("REDIS_SENTINEL_AUTH"))?,
        other => {
            return Err(format!(
                "REDIS_TYPE={other:?}: use single, cluster or sentinel"
            ));
        }
    });
    Ok(())
}

/// `REDIS_TLS_CACERT`, `REDIS_TLS_CLIENT_CERT`, `REDIS_TLS_CLIENT_KEY`,
/// `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`.
fn redis_tls(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    let files: [(&str, &str, &mut Option<PathBuf>); 3] = [
        ("REDIS_TLS_CACERT", "redis_tls_ca", &mut args.redis_tls_ca),
        (
            "REDIS_TLS_CLIENT_CERT",
            "redis_tls_cert",
            &mut args.redis_tls_cert,
        ),
        (
            "REDIS_TLS_CLIENT_KEY",
            "redis_tls_key",
            &mut args.redis_tls_key,
        ),
    ];
    for (name, id, field) in files {
        if let Some(path) = var(name)
            && !given(id)
        {
            *field = Some(PathBuf::from(path));
        }
    }
    if let Some(skip) = flag(var, "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")?
        && !given("redis_tls_skip_hostname_verification")
    {
        args.redis_tls_skip_hostname_verification = skip;
    }
    Ok(())
}

/// The reference writes a sentinel set-up as `<master name>,<sentinel>,<sentinel>...`;
/// `REDIS_AUTH` is the servers' password and `REDIS_SENTINEL_AUTH` the sentinels'.
fn sentinel_url(
    scheme: &str,
    auth: &str,
    list: &str,
    sentinel_auth: Option<String>,
) -> Result<String, String> {
    let mut parts = list.split(',').map(str::trim).filter(|p| !p.is_empty());
    let (Some(master), Some(first)) = (parts.next(), parts.next()) else {
        return Err(format!(
            "REDIS_URL={list:?}: with REDIS_TYPE=sentinel write <master name>,<sentinel host:port>,..."
        ));
    };
    let mut url = format!(
        "{scheme}-sentinel://{auth}{first}?sentinelServiceName={}",
        encode(master)
    );
    for node in parts {
        url.push_str("&node=");
        url.push_str(node);
    }
    if let Some(sentinel_auth) = sentinel_auth {
        let (user, password) = sentinel_auth
            .split_once(':')
            .map_or((None, sentinel_auth.as_str()), |(u, p)| (Some(u), p));
        if let Some(user) = user {
            url.push_str(&format!("&sentinelUsername={}", encode(user)));
        }
        url.push_str(&format!("&sentinelPassword={}", encode(password)));
    }
    Ok(url)
}

/// Percent-encodes everything but unreserved characters, for the user info of a URL.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Boolean modes and the header names.
/// Bytes per over-limit cache entry, to read `LOCAL_CACHE_SIZE_IN_BYTES` as a count.
const CACHE_ENTRY_BYTES: usize = 200;

/// `LOCAL_CACHE_SIZE_IN_BYTES`: the reference's over-limit cache, off by default there. Set,
/// it bounds slidegate's (exact, on by default) cache; `0` turns it off.
fn local_cache(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if let Some(bytes) = var("LOCAL_CACHE_SIZE_IN_BYTES")
        && !given("over_limit_cache")
    {
        let bytes: usize = bytes
            .parse()
            .map_err(|_| format!("LOCAL_CACHE_SIZE_IN_BYTES={bytes:?} is not a number"))?;
        args.over_limit_cache = bytes / CACHE_ENTRY_BYTES;
    }
    Ok(())
}

fn switches(args: &mut ServeArgs, env: Env<'_>) -> Result<(), String> {
    local_cache(args, env)?;
    let Env { var, given, .. } = env;
    let booleans: [(&str, &str, &mut bool); 7] = [
        ("SHADOW_MODE", "shadow_mode", &mut args.shadow_mode),
        ("QUOTA_MODE", "quota_mode", &mut args.quota_mode),
        (
            "RESPONSE_DYNAMIC_METADATA",
            "dynamic_metadata",
            &mut args.dynamic_metadata,
        ),
        (
            "MERGE_DOMAIN_CONFIG",
            "merge_domain_config",
            &mut args.merge_domain_config,
        ),
        (
            "FORCE_START_WITHOUT_INITIAL_CONFIG",
            "force_start_without_initial_config",
            &mut args.force_start_without_initial_config,
        ),
        (
            "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
            "ready_needs_config",
            &mut args.ready_needs_config,
        ),
        (
            "LIMIT_RESPONSE_HEADERS_ENABLED",
            "limit_headers",
            &mut args.limit_headers,
        ),
    ];
    for (name, id, field) in booleans {
        if let Some(value) = flag(var, name)?
            && !given(id)
        {
            *field = value;
        }
    }
    if !given("limit_header_names") {
        let names = [
            "LIMIT_LIMIT_HEADER",
            "LIMIT_REMAINING_HEADER",
            "LIMIT_RESET_HEADER",
        ];
        for (slot, name) in args.limit_header_names.iter_mut().zip(names) {
            if let Some(value) = var(name) {
                *slot = value;
            }
        }
    }
    if !given("near_limit_ratio")
        && let Some(text) = var("NEAR_LIMIT_RATIO")
    {
        args.near_limit_ratio = text
            .parse()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| format!("NEAR_LIMIT_RATIO={text:?} is not a ratio between 0 and 1"))?;
    }
    Ok(())
}

/// `GRPC_MAX_CONNECTION_AGE` and `GRPC_MAX_CONNECTION_AGE_GRACE`, with the reference's defaults
/// (24h and 1h) when started as the reference.
fn connection_age(
    args: &mut ServeArgs,
    Env { var, given, .. }: Env<'_>,
    as_the_reference: bool,
) -> Result<(), String> {
    let read = |name: &str, default: &str| -> Result<Option<std::time::Duration>, String> {
        let Some(text) = var(name).or_else(|| as_the_reference.then(|| default.to_string())) else {
            return Ok(None);
        };
        super::value_parsers::duration_arg(&text)
            .map(Some)
            .map_err(|e| format!("{name}={text:?}: {e}"))
    };
    if !given("grpc_max_connection_age") {
        args.grpc_max_connection_age = read("GRPC_MAX_CONNECTION_AGE", "24h")?;
    }
    if !given("grpc_max_connection_age_grace")
        && let Some(grace) = read("GRPC_MAX_CONNECTION_AGE_GRACE", "1h")?
    {
        args.grpc_max_connection_age_grace = grace;
    }
    Ok(())
}

/// `LOG_LEVEL` (the reference's default is WARN) and `LOG_FORMAT`.
/// The reference's `TRACING_*` settings (its `settings.go`): off unless `TRACING_ENABLED`,
/// service name `RateLimit` when it starts slidegate, HTTP unless `TRACING_EXPORTER_PROTOCOL`
/// says `grpc`, every trace sampled unless `TRACING_SAMPLING_RATE` says less. The collector comes
/// from `OTEL_EXPORTER_OTLP_ENDPOINT`, which the exporter reads itself.
fn tracing(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if let Some(on) = flag(var, "TRACING_ENABLED")?
        && !given("tracing")
    {
        args.tracing = on;
    }
    let names: [(&str, &str, &mut Option<String>); 3] = [
        (
            "TRACING_SERVICE_NAME",
            "tracing_service_name",
            &mut args.tracing_service_name,
        ),
        (
            "TRACING_SERVICE_NAMESPACE",
            "tracing_service_namespace",
            &mut args.tracing_service_namespace,
        ),
        (
            "TRACING_SERVICE_INSTANCE_ID",
            "tracing_service_instance_id",
            &mut args.tracing_service_instance_id,
        ),
    ];
    for (name, id, field) in names {
        if let Some(value) = var(name)
            && !given(id)
        {
            *field = Some(value);
        }
    }
    if args.tracing && args.tracing_service_name.is_none() && var("TRACING_ENABLED").is_some() {
        args.tracing_service_name = Some("RateLimit".into());
    }
    if let Some(protocol) = var("TRACING_EXPORTER_PROTOCOL")
        && !given("tracing_protocol")
    {
        args.tracing_protocol = match protocol.to_ascii_lowercase().as_str() {
            "http" => TracingProtocolArg::Http,
            "grpc" => TracingProtocolArg::Grpc,
            _ => {
                return Err(format!(
                    "TRACING_EXPORTER_PROTOCOL={protocol:?}: use http or grpc"
                ));
            }
        };
    }
    if let Some(rate) = var("TRACING_SAMPLING_RATE")
        && !given("tracing_sampling_rate")
    {
        args.tracing_sampling_rate = match rate.trim().parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => r,
            _ => {
                return Err(format!(
                    "TRACING_SAMPLING_RATE={rate:?}: use a ratio between 0 and 1 (1 samples every trace)"
                ));
            }
        };
    }
    Ok(())
}

fn logging(args: &mut ServeArgs, env: Env<'_>) -> Result<(), String> {
    let Env {
        var,
        given,
        as_reference,
    } = env;
    if !given("log_level") {
        let level = var("LOG_LEVEL")
            .or_else(|| (as_reference && var("RUST_LOG").is_none()).then(|| "warn".to_string()));
        if let Some(level) = level {
            let filter = match level.to_ascii_lowercase().as_str() {
                "trace" => "trace",
                "debug" => "debug",
                "info" => "info",
                "warn" | "warning" => "warn",
                "error" | "fatal" | "panic" => "error",
                _ => {
                    return Err(format!(
                        "LOG_LEVEL={level:?}: use debug, info, warn or error"
                    ));
                }
            };
            args.log_level = Some(filter.into());
        }
    }
    if !given("log_format")
        && let Some(format) = var("LOG_FORMAT")
    {
        args.log_format = match format.to_ascii_lowercase().as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            _ => return Err(format!("LOG_FORMAT={format:?}: use text or json")),
        };
    }
    Ok(())
}

/// `USE_PROMETHEUS`: the reference's metric names on `PROMETHEUS_ADDR` + `PROMETHEUS_PATH`.
fn prometheus(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if flag(var, "USE_PROMETHEUS")? != Some(true) {
        return Ok(());
    }
    if !given("metric_names") {
        args.metric_names = MetricNamesArg::Reference;
    }
    if !given("metrics_addr") {
        let text = var("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("PROMETHEUS_ADDR={text:?}: write host:port or :port"))?;
        let host = (!host.is_empty()).then(|| host.to_string());
        let port = Some(port.to_string());
        let lookup = move |name: &str| {
            if name == "H" {
                host.clone()
            } else {
                port.clone()
            }
        };
        args.metrics_addr = address(&lookup, "H", "P", 9090)
            .map_err(|_| format!("PROMETHEUS_ADDR={text:?}: write host:port or :port"))?;
    }
    if !given("metrics_path")
        && let Some(path) = var("PROMETHEUS_PATH")
    {
        args.metrics_path = path;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::parser::ValueSource;
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::cli::Cli;

    /// Parses `argv` and applies `env` as `main` does, returning the arguments and the notes.
    fn run(argv: &[&str], env: &[(&str, &str)]) -> Result<(ServeArgs, Vec<String>), String> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let var = |name: &str| env.get(name).cloned().filter(|v| !v.is_empty());
        let mut all = vec!["slidegate"];
        all.extend_from_slice(argv);
        let matches = Cli::command()
            .try_get_matches_from(all)
            .map_err(|e| e.to_string())?;
        let mut args = Cli::from_arg_matches(&matches)
            .map_err(|e| e.to_string())?
            .serve;
        let given = |id: &str| {
            matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        let notes = apply(&mut args, &given, &var, false)?;
        Ok((args, notes))
    }

    #[test]
    fn the_references_tracing_settings_map_onto_the_flags() {
        let (args, notes) = run(
            &[],
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "GRPC"),
                ("TRACING_SAMPLING_RATE", "0.25"),
                ("TRACING_SERVICE_NAMESPACE", "edge"),
                ("TRACING_SERVICE_INSTANCE_ID", "pod-7"),
            ],
        )
        .expect("valid");
        assert!(args.tracing);
        assert_eq!(args.tracing_protocol, TracingProtocolArg::Grpc);
        assert!((args.tracing_sampling_rate - 0.25).abs() < f64::EPSILON);
        assert_eq!(args.tracing_service_name.as_deref(), Some("RateLimit"));
        assert_eq!(args.tracing_service_namespace.as_deref(), Some("edge"));
        assert_eq!(args.tracing_service_instance_id.as_deref(), Some("pod-7"));
        assert!(notes.iter().all(|n| !n.contains("TRACING")), "{notes:?}");
        let (args, _) = run(
            &["--tracing-service-name", "mine"],
            &[("TRACING_ENABLED", "1")],
        )
        .expect("valid");
        assert_eq!(
            args.tracing_service_name.as_deref(),
            Some("mine"),
            "the flag wins"
        );
        let (args, _) = run(&[], &[]).expect("valid");
        assert!(!args.tracing, "off by default, as the reference");
        let bad = run(&[], &[("TRACING_EXPORTER_PROTOCOL", "zipkin")]).expect_err("refused");
        assert!(
            bad.contains("TRACING_EXPORTER_PROTOCOL") && bad.contains("http or grpc"),
            "{bad}"
        );
        let bad = run(&[], &[("TRACING_SAMPLING_RATE", "2")]).expect_err("refused");
        assert!(bad.contains("between 0 and 1"), "{bad}");
    }

    #[test]
    fn listeners_runtime_and_redis_map_onto_the_flags() {
        let (args, notes) = run(
            &[],
            &[
                ("PORT", "9000"),
                ("GRPC_HOST", "127.0.0.1"),
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis:6379"),
                ("REDIS_AUTH", "user:p@ss"),
                ("REDIS_TLS", "1"),
                ("USE_PROMETHEUS", "true"),
                ("MERGE_DOMAIN_CONFIG", "yes"),
                ("REDIS_PERSECOND", "true"),
                ("CACHE_KEY_PREFIX", "team-a:"),
                ("GRPC_MAX_CONNECTION_AGE", "1h30m"),
            ],
        )
        .expect("accepted");
        assert_eq!(args.redis_key_prefix, "team-a:");
        assert_eq!(
            args.grpc_max_connection_age,
            Some(std::time::Duration::from_secs(5400))
        );
        assert_eq!(
            args.grpc_max_connection_age_grace,
            std::time::Duration::from_secs(3600),
            "the reference's default grace"
        );
        assert_eq!(args.http_addr.to_string(), "0.0.0.0:9000");
        assert_eq!(args.grpc_addr.to_string(), "127.0.0.1:8081");
        assert_eq!(args.config, Some(PathBuf::from("/data/ratelimit/config")));
        assert_eq!(
            args.redis_url.as_deref(),
            Some("rediss://user:p%40ss@redis:6379")
        );
        assert_eq!(args.metric_names, MetricNamesArg::Reference);
        assert_eq!(
            args.metrics_addr.map(|a| a.to_string()),
            Some("0.0.0.0:9090".into())
        );
        assert!(args.merge_domain_config);
        assert!(
            args.whole_second_resets,
            "resets in the reference's whole seconds"
        );
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("REDIS_PERSECOND is set"), "{notes:?}");
    }

    #[test]
    fn cluster_and_sentinel_lists() {
        let url = |kind: &str, list: &str| {
            run(
                &[],
                &[
                    ("REDIS_TYPE", kind),
                    ("REDIS_URL", list),
                    ("REDIS_SENTINEL_AUTH", "sp"),
                ],
            )
            .map(|(args, _)| args.redis_url)
        };
        assert_eq!(
            url("cluster", "a:1,b:2"),
            Ok(Some("redis-cluster://a:1,b:2".to_string()))
        );
        assert_eq!(
            url("SENTINEL", "mymaster,s1:26379,s2:26379"),
            Ok(Some(
                "redis-sentinel://s1:26379?sentinelServiceName=mymaster&node=s2:26379&sentinelPassword=sp"
                    .to_string()
            ))
        );
        assert!(url("sentinel", "mymaster").is_err(), "no sentinel listed");
        assert!(url("ring", "a:1").is_err());
    }

    #[test]
    fn flags_and_slidegate_variables_win() {
        let (args, _) = run(
            &[
                "--http-addr",
                "127.0.0.1:1",
                "--redis",
                "redis://flag:1",
                "--config",
                "/etc/x",
            ],
            &[
                ("PORT", "9000"),
                ("REDIS_URL", "env:2"),
                ("RUNTIME_ROOT", "/data"),
            ],
        )
        .expect("accepted");
        assert_eq!(args.http_addr.to_string(), "127.0.0.1:1");
        assert_eq!(args.redis_url.as_deref(), Some("redis://flag:1"));
        assert_eq!(args.config, Some(PathBuf::from("/etc/x")));
    }

    #[test]
    fn what_would_be_wrong_if_ignored_is_refused() {
        for (env, expected) in [
            (
                vec![("REDIS_URL", "/var/run/r.sock")],
                "REDIS_SOCKET_TYPE=unix",
            ),
            (
                vec![("REDIS_SOCKET_TYPE", "unix"), ("REDIS_URL", "r:1")],
                "REDIS_SOCKET_TYPE=unix",
            ),
            (vec![("BACKEND_TYPE", "memcache")], "BACKEND_TYPE=memcache"),
            (vec![("CONFIG_TYPE", "CONSUL")], "CONFIG_TYPE=CONSUL"),
            (
                vec![("GRPC_SERVER_USE_TLS", "true")],
                "needs GRPC_SERVER_TLS_CERT",
            ),
            (
                vec![
                    ("GRPC_SERVER_USE_TLS", "true"),
                    ("GRPC_SERVER_TLS_CERT", "/c"),
                    ("GRPC_SERVER_TLS_KEY", "/k"),
                    ("GRPC_CLIENT_TLS_SAN", "envoy"),
                ],
                "GRPC_CLIENT_TLS_SAN needs",
            ),
            (
                vec![
                    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                    ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "2"),
                ],
                "XDS_CLIENT_BACKOFF_RANDOM_FACTOR",
            ),
            (vec![("GRPC_UDS", "/tmp/s")], "GRPC_UDS"),
            (vec![("PORT", "http")], "PORT=\"http\""),
            (vec![("LOG_LEVEL", "loud")], "LOG_LEVEL=\"loud\""),
            (vec![("NEAR_LIMIT_RATIO", "2")], "NEAR_LIMIT_RATIO"),
        ] {
            let error = run(&[], &env).expect_err("refused");
            assert!(error.contains(expected), "{env:?}: {error}");
        }
    }

    /// What Envoy Gateway's rate-limit Deployment sets (internal/infrastructure/kubernetes/
    /// ratelimit), which must give xDS over mutual TLS and a mutual-TLS gRPC port.
    #[test]
    fn envoy_gateways_environment_gives_xds_and_mutual_tls() {
        let (args, notes) = run(
            &[],
            &[
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
                ("RUNTIME_WATCH_ROOT", "false"),
                ("LOG_LEVEL", "info"),
                ("USE_STATSD", "false"),
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
                ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
                ("GRPC_SERVER_USE_TLS", "true"),
                ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
                ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
                ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
                ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
                ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis.redis.svc:6379"),
            ],
        )
        .expect("starts");
        assert_eq!(args.config, None, "RUNTIME_ROOT is not the config with xDS");
        assert_eq!(args.xds_server.as_deref(), Some("envoy-gateway:18001"));
        assert_eq!(args.xds_node_id, "envoy-ratelimit");
        assert!(args.xds_tls);
        assert_eq!(args.xds_tls_ca, Some(PathBuf::from("/certs/ca.crt")));
        assert_eq!(args.xds_tls_cert, Some(PathBuf::from("/certs/tls.crt")));
        assert_eq!(args.xds_tls_key, Some(PathBuf::from("/certs/tls.key")));
        assert_eq!(args.grpc_tls_cert, Some(PathBuf::from("/certs/tls.crt")));
        assert_eq!(args.grpc_tls_key, Some(PathBuf::from("/certs/tls.key")));
        assert_eq!(
            args.grpc_tls_client_ca,
            Some(PathBuf::from("/certs/ca.crt"))
        );
        assert!(args.force_start_without_initial_config);
        assert_eq!(
            args.redis_url.as_deref(),
            Some("redis://redis.redis.svc:6379")
        );
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn xds_settings_map_onto_the_flags() {
        let (args, notes) = run(
            &[],
            &[
                ("CONFIG_TYPE", "grpc_xds_sotw"),
                ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,bad,team=rl"),
                (
                    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                    "authorization:Bearer x",
                ),
                ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds.example"),
                ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "500ms"),
                ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "5s"),
                ("XDS_CLIENT_BACKOFF_JITTER", "false"),
                ("GRPC_SERVER_TLS_KEY", "/k"),
            ],
        )
        .expect("starts");
        assert_eq!(args.xds_server.as_deref(), Some("localhost:18000"));
        assert_eq!(args.xds_node_id, "default");
        assert_eq!(
            args.xds_node_metadata,
            vec![("zone".into(), "a".into()), ("team".into(), "rl".into())]
        );
        assert_eq!(
            args.xds_headers,
            vec![("authorization".into(), "Bearer x".into())]
        );
        assert!(!args.xds_tls);
        assert_eq!(args.xds_tls_server_name.as_deref(), Some("xds.example"));
        assert_eq!(
            args.xds_retry_initial,
            std::time::Duration::from_millis(500)
        );
        assert_eq!(args.xds_retry_max, std::time::Duration::from_secs(5));
        assert_eq!(args.xds_retry_jitter, 0.0);
        assert_eq!(args.grpc_tls_key, None);
        assert!(notes.iter().any(|n| n.contains("'bad'")), "{notes:?}");
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("GRPC_SERVER_TLS_KEY is set but GRPC_SERVER_USE_TLS")),
            "{notes:?}"
        );
        // The reference's mutual-TLS name and the SAN check.
        let (args, _) = run(
            &["--xds-server", "x:1"],
            &[
                ("GRPC_SERVER_USE_TLS", "1"),
                ("GRPC_SERVER_TLS_CERT", "/c"),
                ("GRPC_SERVER_TLS_KEY", "/k"),
                ("GRPC_CLIENT_TLS_CACERT", "/ca"),
                ("GRPC_CLIENT_TLS_SAN", "envoy"),
            ],
        )
        .expect("starts");
        assert_eq!(args.grpc_tls_client_ca, Some(PathBuf::from("/ca")));
        assert_eq!(args.grpc_tls_client_san.as_deref(), Some("envoy"));
        assert_eq!(args.xds_server.as_deref(), Some("x:1"));
    }
}
