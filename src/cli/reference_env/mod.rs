//! The reference server's environment (envoyproxy/ratelimit's `src/settings/settings.go`), so a
//! deployment that starts it with `REDIS_URL`, `RUNTIME_ROOT`, `USE_PROMETHEUS` and friends
//! starts slidegate unchanged. Each variable is honoured (mapped onto a flag that was not given),
//! warned about (named in a log line at start: slidegate has no use for it) or refused (start
//! fails with a message: honouring it wrongly would be worse). `docs/migrating.md` has the full
//! table.
//!
//! The variables that each set one flag are rows of `table.rs`; those slidegate does not honour
//! are in `unsupported.rs`; the rest combine several variables into a flag, or one into several,
//! a file each. [`apply`] reads them all in one order, so of two malformed variables the same
//! one is always refused.

use super::ServeArgs;

mod config_over_xds;
mod grpc_server_tls;
mod limit_header_names;
mod listeners;
mod redis_url;
mod reference_defaults;
mod runtime_dir;
mod table;
mod tracing_service;
mod unsupported;
mod use_prometheus;

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
    unsupported::refuse(var)?;
    let env = Env {
        var,
        given,
        as_reference,
    };
    let mut notes = Vec::new();
    listeners::apply(args, env)?;
    grpc_server_tls::apply(args, env, &mut notes)?;
    if xds_config(var) {
        config_over_xds::apply(args, env, &mut notes)?;
    } else {
        runtime_dir::apply(args, env, &mut notes)?;
    }
    table::apply(table::REDIS, args, env, &mut notes)?;
    redis_url::apply(args, env, &mut notes)?;
    table::apply(table::SETTINGS, args, env, &mut notes)?;
    tracing_service::apply(args, env)?;
    reference_defaults::apply(args, env);
    limit_header_names::apply(args, env);
    use_prometheus::apply(args, env, &mut notes)?;
    unsupported::warn(var, &mut notes)?;
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use clap::parser::ValueSource;
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::cli::{Cli, MetricNamesArg, TracingProtocolArg};

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
        // Every id asked of `given` must be a flag: a misspelt one would never count as given.
        let command = Cli::command();
        let given = |id: &str| {
            assert!(
                command.get_arguments().any(|a| a.get_id() == id),
                "{id} is not a flag"
            );
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
