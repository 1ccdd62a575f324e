//! The reference's defaults where they differ from slidegate's, taken when slidegate is started
//! as the reference: whole-second resets (its clients compare whole messages, in which a reset
//! is whole seconds) and connection ageing (24h, an hour's grace) when started with its config
//! variables or its binary name; its log level (`warn`, unless `RUST_LOG` says otherwise) when
//! started under its binary name. The config directory's and Redis's are with their variables
//! (`runtime_dir.rs`, `redis_url.rs`).

use std::time::Duration;

use super::{Env, xds_config};
use crate::cli::ServeArgs;

pub(super) fn apply(args: &mut ServeArgs, env: Env<'_>) {
    let Env {
        var,
        given,
        as_reference,
    } = env;
    let as_the_reference = as_reference
        || xds_config(var)
        || ["RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY"]
            .iter()
            .any(|n| var(n).is_some());
    let unset = |id: &str, name: &str| !given(id) && var(name).is_none();
    if as_the_reference {
        if !given("whole_second_resets") {
            args.whole_second_resets = true;
        }
        if unset("grpc_max_connection_age", "GRPC_MAX_CONNECTION_AGE") {
            args.grpc_max_connection_age = Some(Duration::from_secs(24 * 60 * 60));
        }
        if unset(
            "grpc_max_connection_age_grace",
            "GRPC_MAX_CONNECTION_AGE_GRACE",
        ) {
            args.grpc_max_connection_age_grace = Duration::from_secs(60 * 60);
        }
    }
    if as_reference && unset("log_level", "LOG_LEVEL") && var("RUST_LOG").is_none() {
        args.log_level = Some("warn".into());
    }
}
