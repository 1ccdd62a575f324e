//! `CONFIG_TYPE=GRPC_XDS_SOTW`: the config comes from an xDS server, `CONFIG_GRPC_XDS_SERVER_URL`
//! or the reference's `localhost:18000` (so `--config` beside it is refused), set up by the
//! `CONFIG_GRPC_XDS_*` rows of `table.rs`. The reconnect delays combine four variables: the
//! first is `CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL` (else
//! `XDS_CLIENT_BACKOFF_INITIAL_INTERVAL`), doubling up to `XDS_CLIENT_BACKOFF_MAX_INTERVAL`,
//! randomised by `XDS_CLIENT_BACKOFF_RANDOM_FACTOR` unless `XDS_CLIENT_BACKOFF_JITTER=false`.

use super::Env;
use super::table::{self, boolean, duration};
use crate::cli::ServeArgs;

pub(super) fn apply(
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
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
    table::apply(table::CONFIG_OVER_XDS, args, env, notes)?;
    backoff(args, env)
}

/// The reconnect delays. The durations are read even where their flags were given, so a
/// malformed one is refused either way.
fn backoff(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    let initial = match duration(var, "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL")? {
        Some(d) => Some(d),
        None => duration(var, "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL")?,
    };
    if let Some(initial) = initial
        && !given("xds_retry_initial")
    {
        args.xds_retry_initial = initial;
    }
    if let Some(max) = duration(var, "XDS_CLIENT_BACKOFF_MAX_INTERVAL")?
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
        if boolean(var, "XDS_CLIENT_BACKOFF_JITTER")? == Some(false) {
            args.xds_retry_jitter = 0.0;
        }
    }
    Ok(())
}
