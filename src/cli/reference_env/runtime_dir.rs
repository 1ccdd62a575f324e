//! The config directory when it is not from xDS: `$RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/
//! $RUNTIME_APPDIRECTORY`, with the reference's defaults (`/srv/runtime_data/current`, none,
//! `config`) where one is set or slidegate was started as the reference.

use std::path::PathBuf;

use super::Env;
use super::table::boolean;
use crate::cli::ServeArgs;

pub(super) fn apply(
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
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
    if boolean(var, "RUNTIME_IGNOREDOTFILES")? == Some(false) {
        notes.push("RUNTIME_IGNOREDOTFILES=false: slidegate always skips dotfiles (which also skips a ConfigMap's ..data copies)".into());
    }
    // RUNTIME_WATCH_ROOT: slidegate watches the config directory itself, which sees both a file
    // changing and a symlink swap above it, so either value is honoured.
    boolean(var, "RUNTIME_WATCH_ROOT")?;
    Ok(())
}
