//! The reference's variables that each set one flag: tables of (variable, flag, kind), and the
//! one function that applies a table. A variable that is set sets its flag unless the flag was
//! given (on the command line or as its `SLIDEGATE_*` variable). Each table is applied where the
//! condition above it holds; within a table the rows are read in order, so a later row for the
//! same flag wins and, of two malformed variables, the first is the one refused.

use std::path::PathBuf;
use std::time::Duration;

use super::{Env, Var};
use crate::cli::ServeArgs;
use crate::cli::value_parsers::{duration_arg, parse_bool};

/// One variable and the flag it sets.
pub(super) struct Row {
    /// The reference's variable.
    pub(super) var: &'static str,
    /// The id of the `ServeArgs` flag (its field's name).
    pub(super) flag: &'static str,
    pub(super) kind: Kind,
}

/// Writes a value read from a variable into its flag's field.
type Set<T> = fn(&mut ServeArgs, T);

/// How a variable's text is read, and the field its value goes to.
pub(super) enum Kind {
    /// As written.
    Text(Set<String>),
    /// A file's path, as written.
    Path(Set<PathBuf>),
    /// A boolean as the reference writes one (`1`, `true`, `yes`...). Read even where its flag
    /// was given, so a malformed one is refused either way.
    Bool(Set<bool>),
    /// A whole number above zero.
    Count(Set<usize>),
    /// The reference's cache size in bytes, as a number of slidegate's cache entries.
    CacheBytes(Set<usize>),
    /// A fraction from 0 to 1.
    Ratio(Set<f64>),
    /// A duration as slidegate's flags write one (`90s`, `1h30m`).
    Duration(Set<Duration>),
    /// `name<separator>value,...`; a malformed entry is skipped with a note, as the reference
    /// skips it.
    Pairs(char, Set<Vec<(String, String)>>),
    /// One of the flag's values, in any case; the text lists them for the refusal. The function
    /// sets the value named, or says there is none of that name.
    Choice(&'static str, fn(&mut ServeArgs, &str) -> bool),
    /// A log level as the reference writes one (`warning`, `fatal` and `panic` too).
    LogLevel(Set<String>),
}

/// A row whose flag id is the name of the `ServeArgs` field it writes, so the two cannot
/// differ. A `Choice` flag is a `clap::ValueEnum`, its values matched in any case.
macro_rules! row {
    ($var:literal, $flag:ident, Choice($values:literal)) => {
        Row {
            var: $var,
            flag: stringify!($flag),
            kind: Kind::Choice($values, |args, word| {
                clap::ValueEnum::from_str(word, true)
                    .map(|value| args.$flag = value)
                    .is_ok()
            }),
        }
    };
    ($var:literal, $flag:ident, $kind:ident $(($separator:literal))?) => {
        Row {
            var: $var,
            flag: stringify!($flag),
            kind: Kind::$kind($($separator,)? |args, value| args.$flag = value.into()),
        }
    };
}

/// With `GRPC_SERVER_USE_TLS=true` and both files (`grpc_server_tls.rs`). Envoy Gateway sets
/// `GRPC_SERVER_TLS_CA_CERT` for the client CA, which the reference does not read; slidegate
/// reads both names, the reference's winning.
pub(super) const GRPC_SERVER_TLS: &[Row] = &[
    row!("GRPC_SERVER_TLS_CERT", grpc_tls_cert, Path),
    row!("GRPC_SERVER_TLS_KEY", grpc_tls_key, Path),
    row!("GRPC_SERVER_TLS_CA_CERT", grpc_tls_client_ca, Path),
    row!("GRPC_CLIENT_TLS_CACERT", grpc_tls_client_ca, Path),
];

/// With `CONFIG_TYPE=GRPC_XDS_SOTW` (`config_over_xds.rs`).
pub(super) const CONFIG_OVER_XDS: &[Row] = &[
    row!("CONFIG_GRPC_XDS_NODE_ID", xds_node_id, Text),
    row!(
        "CONFIG_GRPC_XDS_NODE_METADATA",
        xds_node_metadata,
        Pairs('=')
    ),
    row!(
        "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        xds_headers,
        Pairs(':')
    ),
    row!("CONFIG_GRPC_XDS_SERVER_USE_TLS", xds_tls, Bool),
    row!("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", xds_tls_ca, Path),
    row!("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", xds_tls_cert, Path),
    row!("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", xds_tls_key, Path),
    row!("CONFIG_GRPC_XDS_SERVER_TLS_SAN", xds_tls_server_name, Text),
];

/// Always, before the Redis URL is assembled (`redis_url.rs`).
pub(super) const REDIS: &[Row] = &[
    row!("CACHE_KEY_PREFIX", redis_key_prefix, Text),
    row!("REDIS_POOL_SIZE", redis_pool_size, Count),
];

/// With a Redis URL assembled from `REDIS_URL` (`redis_url.rs`).
pub(super) const REDIS_TLS: &[Row] = &[
    row!("REDIS_TLS_CACERT", redis_tls_ca, Path),
    row!("REDIS_TLS_CLIENT_CERT", redis_tls_cert, Path),
    row!("REDIS_TLS_CLIENT_KEY", redis_tls_key, Path),
    row!(
        "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
        redis_tls_skip_hostname_verification,
        Bool
    ),
];

/// Always.
pub(super) const SETTINGS: &[Row] = &[
    row!("GRPC_MAX_CONNECTION_AGE", grpc_max_connection_age, Duration),
    row!(
        "GRPC_MAX_CONNECTION_AGE_GRACE",
        grpc_max_connection_age_grace,
        Duration
    ),
    row!("LOCAL_CACHE_SIZE_IN_BYTES", over_limit_cache, CacheBytes),
    row!("SHADOW_MODE", shadow_mode, Bool),
    row!("QUOTA_MODE", quota_mode, Bool),
    row!("RESPONSE_DYNAMIC_METADATA", dynamic_metadata, Bool),
    row!("MERGE_DOMAIN_CONFIG", merge_domain_config, Bool),
    row!(
        "FORCE_START_WITHOUT_INITIAL_CONFIG",
        force_start_without_initial_config,
        Bool
    ),
    row!(
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        ready_needs_config,
        Bool
    ),
    row!("LIMIT_RESPONSE_HEADERS_ENABLED", limit_headers, Bool),
    row!("NEAR_LIMIT_RATIO", near_limit_ratio, Ratio),
    row!("LOG_LEVEL", log_level, LogLevel),
    row!("LOG_FORMAT", log_format, Choice("text or json")),
    row!("TRACING_ENABLED", tracing, Bool),
    row!("TRACING_SERVICE_NAME", tracing_service_name, Text),
    row!("TRACING_SERVICE_NAMESPACE", tracing_service_namespace, Text),
    row!(
        "TRACING_SERVICE_INSTANCE_ID",
        tracing_service_instance_id,
        Text
    ),
    row!(
        "TRACING_EXPORTER_PROTOCOL",
        tracing_protocol,
        Choice("http or grpc")
    ),
];

/// With `USE_PROMETHEUS=true` (`use_prometheus.rs`).
pub(super) const WITH_PROMETHEUS: &[Row] = &[row!("PROMETHEUS_PATH", metrics_path, Text)];

/// Bytes per over-limit cache entry, to read `LOCAL_CACHE_SIZE_IN_BYTES` as a count.
const CACHE_ENTRY_BYTES: usize = 200;

/// Applies `rows` in order: each variable that is set, to its flag unless the flag was given.
pub(super) fn apply(
    rows: &[Row],
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    for row in rows {
        let Some(text) = (env.var)(row.var) else {
            continue;
        };
        if let Kind::Bool(_) = row.kind {
            parse_boolean(row.var, &text)?;
        }
        if !(env.given)(row.flag) {
            read(row, text, args, notes)?;
        }
    }
    Ok(())
}

/// Reads `text` as `row`'s kind into its field.
fn read(
    row: &Row,
    text: String,
    args: &mut ServeArgs,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let name = row.var;
    match row.kind {
        Kind::Text(set) => set(args, text),
        Kind::Path(set) => set(args, PathBuf::from(text)),
        Kind::Bool(set) => set(args, parse_boolean(name, &text)?),
        Kind::Count(set) => set(
            args,
            text.parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{name}={text:?} is not a positive number"))?,
        ),
        Kind::CacheBytes(set) => {
            let bytes: usize = text
                .parse()
                .map_err(|_| format!("{name}={text:?} is not a number"))?;
            set(args, bytes / CACHE_ENTRY_BYTES);
        }
        Kind::Ratio(set) => set(
            args,
            text.parse()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| format!("{name}={text:?} is not a ratio between 0 and 1"))?,
        ),
        Kind::Duration(set) => set(args, parse_duration(name, &text)?),
        Kind::Pairs(separator, set) => set(args, pairs(&text, separator, name, notes)),
        Kind::Choice(values, choose) => {
            if !choose(args, &text) {
                return Err(format!("{name}={text:?}: use {values}"));
            }
        }
        Kind::LogLevel(set) => set(args, log_level(name, &text)?.into()),
    }
    Ok(())
}

/// A boolean variable, read as the reference reads it; `None` when unset.
pub(super) fn boolean(var: Var<'_>, name: &str) -> Result<Option<bool>, String> {
    var(name).map(|text| parse_boolean(name, &text)).transpose()
}

fn parse_boolean(name: &str, text: &str) -> Result<bool, String> {
    parse_bool(text)
        .ok_or_else(|| format!("{name}={text:?} is not a boolean: use 1/0, true/false or yes/no"))
}

/// A duration variable; `None` when unset.
pub(super) fn duration(var: Var<'_>, name: &str) -> Result<Option<Duration>, String> {
    var(name)
        .map(|text| parse_duration(name, &text))
        .transpose()
}

fn parse_duration(name: &str, text: &str) -> Result<Duration, String> {
    duration_arg(text).map_err(|e| format!("{name}={text:?}: {e}"))
}

/// The filter a level means.
fn log_level(name: &str, text: &str) -> Result<&'static str, String> {
    Ok(match text.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        _ => return Err(format!("{name}={text:?}: use debug, info, warn or error")),
    })
}

/// `a<separator>1,b<separator>2`; malformed entries are skipped with a note.
fn pairs(
    list: &str,
    separator: char,
    name: &str,
    notes: &mut Vec<String>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once(separator) {
            Some((k, v)) if !k.trim().is_empty() => out.push((k.trim().into(), v.trim().into())),
            _ => notes.push(format!(
                "{name}: '{entry}' is not name{separator}value; skipped"
            )),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use clap::{Args, Command};

    use super::*;

    const TABLES: [&[Row]; 6] = [
        GRPC_SERVER_TLS,
        CONFIG_OVER_XDS,
        REDIS,
        REDIS_TLS,
        SETTINGS,
        WITH_PROMETHEUS,
    ];

    fn serve_args() -> ServeArgs {
        let command = ServeArgs::augment_args(Command::new("slidegate"));
        let matches = command
            .try_get_matches_from(["slidegate"])
            .expect("defaults");
        <ServeArgs as clap::FromArgMatches>::from_arg_matches(&matches).expect("defaults")
    }

    /// The fields of `args` by name, with their values as `{:#?}` writes them.
    fn fields(args: &ServeArgs) -> BTreeMap<String, String> {
        let mut fields = BTreeMap::new();
        let mut name = String::new();
        for line in format!("{args:#?}").lines().skip(1) {
            match line.strip_prefix("    ").and_then(|l| l.split_once(": ")) {
                Some((field, value)) if !field.starts_with(' ') => {
                    name = field.to_string();
                    fields.insert(name.clone(), value.to_string());
                }
                _ => fields.entry(name.clone()).or_default().push_str(line),
            }
        }
        fields
    }

    /// A text the row's kind reads as a value other than its flag's default.
    fn sample(row: &Row) -> String {
        match row.kind {
            Kind::Text(_) | Kind::Path(_) => "/other".into(),
            Kind::Bool(_) => "true".into(),
            Kind::Count(_) => "7".into(),
            Kind::CacheBytes(_) => "2000".into(),
            Kind::Ratio(_) => "0.25".into(),
            Kind::Duration(_) => "7s".into(),
            Kind::Pairs(separator, _) => format!("a{separator}b"),
            Kind::Choice(values, _) => values.rsplit(' ').next().unwrap_or(values).into(),
            Kind::LogLevel(_) => "debug".into(),
        }
    }

    #[test]
    fn every_flag_a_row_names_is_a_flag_of_serve_args() {
        let command = ServeArgs::augment_args(Command::new("slidegate"));
        let flags: BTreeSet<&str> = command
            .get_arguments()
            .map(|a| a.get_id().as_str())
            .collect();
        let mut variables = BTreeSet::new();
        for row in TABLES.iter().flat_map(|rows| rows.iter()) {
            assert!(
                flags.contains(row.flag),
                "{}: no flag {}",
                row.var,
                row.flag
            );
            assert!(variables.insert(row.var), "{} has two rows", row.var);
        }
    }

    #[test]
    fn a_row_sets_its_flag_alone_unless_the_flag_was_given() {
        let default = serve_args();
        for row in TABLES.iter().flat_map(|rows| rows.iter()) {
            let text = sample(row);
            let var = |name: &str| (name == row.var).then(|| text.clone());
            for given_flag in [false, true] {
                let given = |id: &str| given_flag && id == row.flag;
                let env = Env {
                    var: &var,
                    given: &given,
                    as_reference: false,
                };
                let mut args = default.clone();
                let mut notes = Vec::new();
                apply(std::slice::from_ref(row), &mut args, env, &mut notes)
                    .unwrap_or_else(|e| panic!("{}={text}: {e}", row.var));
                assert!(notes.is_empty(), "{}: {notes:?}", row.var);
                let (before, after) = (fields(&default), fields(&args));
                let changed: Vec<&String> = after
                    .keys()
                    .filter(|f| before.get(*f) != after.get(*f))
                    .collect();
                let expected: &[&str] = if given_flag { &[] } else { &[row.flag] };
                assert_eq!(changed, expected, "{}={text}", row.var);
            }
        }
    }
}
