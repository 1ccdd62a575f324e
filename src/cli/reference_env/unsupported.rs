//! The reference's variables slidegate does not honour: refused where ignoring them would change
//! what the server is (the start stops with the reason), warned about where slidegate has no
//! use for them (a note logged at start, with what slidegate does instead).

use super::Var;
use super::table::boolean;

/// (variable, the values slidegate accepts, why the rest are refused). A variable that accepts
/// no value is refused whenever it is set. Values are matched in any case.
const REFUSED: &[(&str, &[&str], &str)] = &[
    (
        "GRPC_UDS",
        &[],
        "slidegate listens on TCP only (GRPC_HOST, GRPC_PORT)",
    ),
    (
        "CONFIG_TYPE",
        &["FILE", "GRPC_XDS_SOTW"],
        "use FILE or GRPC_XDS_SOTW",
    ),
    (
        "BACKEND_TYPE",
        &["redis"],
        "slidegate's stores are Redis and its embedded store",
    ),
];

/// (variables, what slidegate does instead): a note for each variable that is set.
const WARNED: &[(&[&str], &str)] = &[
    (&["PROTO"], "slidegate's gRPC listener is TCP"),
    (
        &["DEBUG_HOST", "DEBUG_PORT"],
        "there is no debug port; /config on the HTTP port lists the rules",
    ),
    (
        &["USE_DOG_STATSD"],
        "no statsd: scrape /metrics (USE_PROMETHEUS=true gives the reference's names)",
    ),
    (
        &["USE_DOG_STATSD_MOGRIFIERS", "STATSD_HOST", "STATSD_PORT"],
        "no statsd: scrape /metrics",
    ),
    (
        &["EXTRA_TAGS"],
        "no statsd: add labels in the Prometheus scrape config",
    ),
    (&["STATS_FLUSH_INTERVAL"], "metrics are read at scrape time"),
    (
        &["DISABLE_STATS"],
        "metrics are always kept; nothing is sent anywhere",
    ),
    (
        &["PROMETHEUS_MAPPER_YAML"],
        "the names are fixed to the default mapping's",
    ),
    (
        &["EXPIRATION_JITTER_MAX_SECONDS"],
        "keys expire exactly when no window needs them",
    ),
    (
        &["REDIS_PIPELINE_WINDOW", "REDIS_PIPELINE_LIMIT"],
        "calls are sent as they come, on a pool of connections",
    ),
    (
        &[
            "REDIS_PERSECOND",
            "REDIS_PERSECOND_SOCKET_TYPE",
            "REDIS_PERSECOND_TYPE",
            "REDIS_PERSECOND_URL",
            "REDIS_PERSECOND_POOL_SIZE",
            "REDIS_PERSECOND_AUTH",
            "REDIS_PERSECOND_TLS",
            "REDIS_PERSECOND_PIPELINE_WINDOW",
            "REDIS_PERSECOND_PIPELINE_LIMIT",
        ],
        "every window lives in the one Redis (REDIS_URL)",
    ),
    (
        &["REDIS_HEALTH_CHECK_ACTIVE_CONNECTION"],
        "readiness always pings Redis",
    ),
    (
        &["REDIS_TIMEOUT"],
        "a decision's deadline is --redis-timeout (15 ms), below Envoy's 20 ms",
    ),
    (
        &["REDIS_POOL_ON_EMPTY_BEHAVIOR"],
        "calls share the pool's connections; none waits for one",
    ),
    (
        &["REDIS_CLUSTER_PIPELINE_PARALLELISM"],
        "calls to several slots always run in parallel",
    ),
    (
        &[
            "REDIS_STARTUP_INITIAL_INTERVAL",
            "REDIS_STARTUP_MAX_INTERVAL",
            "REDIS_STARTUP_MAX_ELAPSED_TIME",
        ],
        "see --redis-connect-timeout",
    ),
    (
        &[
            "MEMCACHE_HOST_PORT",
            "MEMCACHE_MAX_IDLE_CONNS",
            "MEMCACHE_SRV",
            "MEMCACHE_SRV_REFRESH",
            "MEMCACHE_TLS",
            "MEMCACHE_TLS_CLIENT_CERT",
            "MEMCACHE_TLS_CLIENT_KEY",
            "MEMCACHE_TLS_CACERT",
            "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
        ],
        "the store is Redis or the embedded one",
    ),
];

/// (boolean variable, the value warned about, what slidegate does instead).
const WARNED_WHEN: &[(&str, bool, &str)] = &[
    (
        "USE_STATSD",
        true,
        "slidegate sends no statsd; scrape /metrics (USE_PROMETHEUS=true gives the reference's names)",
    ),
    (
        "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
        false,
        "slidegate never records a rejected request",
    ),
];

/// The first refused variable that is set, as the reason the start stops.
pub(super) fn refuse(var: Var<'_>) -> Result<(), String> {
    for (name, accepted, why) in REFUSED {
        let Some(value) = var(name) else {
            continue;
        };
        if accepted.is_empty() {
            return Err(format!("{name}: {why}"));
        }
        if !accepted.iter().any(|a| a.eq_ignore_ascii_case(&value)) {
            return Err(format!("{name}={value}: {why}"));
        }
    }
    Ok(())
}

/// A note for each warned variable that is set.
pub(super) fn warn(var: Var<'_>, notes: &mut Vec<String>) -> Result<(), String> {
    for (names, why) in WARNED {
        for name in names.iter().filter(|n| var(n).is_some()) {
            notes.push(format!(
                "{name} is set but slidegate does not use it: {why}"
            ));
        }
    }
    for (name, warned, why) in WARNED_WHEN {
        if boolean(var, name)? == Some(*warned) {
            notes.push(format!("{name}={warned}: {why}"));
        }
    }
    Ok(())
}
