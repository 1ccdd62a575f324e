//! Hot reload: watch the config file or directory and swap in a new config when it changes.
//!
//! The directory is watched, not the files: editors that save by rename and Kubernetes ConfigMaps
//! (which swap a `..data` symlink) change the directory's entries, not the file that was open.
//! Events are debounced; then everything is loaded and validated first, and only a complete,
//! valid config replaces the old one (atomically, see `Limiter::replace_limits`). On any error
//! the old config keeps serving and the error is logged with file and line and counted.
//! `SIGHUP` forces a reload.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::compile::LoadOptions;
use super::files::load_path_with;
use crate::limiter::Limiter;
use crate::metrics::Metrics;

/// Keeps the watch alive (the watcher lives in the task); dropping it stops reloading.
pub struct ConfigWatch {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConfigWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What reloads found, for tests and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reload {
    Applied,
    Unchanged,
    Rejected,
}

/// Loads `path` and, if it differs from what `current` fingerprints, swaps it in.
pub async fn reload(
    path: &Path,
    options: LoadOptions,
    limiter: &Limiter,
    metrics: &Metrics,
    current: &mut u64,
) -> Reload {
    let owned = path.to_path_buf();
    let loaded = match tokio::task::spawn_blocking(move || load_path_with(&owned, options)).await {
        Ok(loaded) => loaded,
        Err(e) => {
            tracing::error!("config reload task failed: {e}");
            return Reload::Rejected;
        }
    };
    match loaded {
        Ok(loaded) if loaded.fingerprint == *current => Reload::Unchanged,
        Ok(loaded)
            if loaded.limits.domains.is_empty()
                && !options.allow_no_domains
                && !limiter.limits().domains.is_empty() =>
        {
            metrics.config_loaded(false);
            tracing::error!(config = %path.display(), "config rejected, the previous config keeps serving: it has no domain, which would remove every limit (--allow-empty-config allows it)");
            Reload::Rejected
        }
        Ok(loaded) => {
            *current = loaded.fingerprint;
            for warning in &loaded.warnings {
                tracing::warn!("{warning}");
            }
            let domains = loaded.limits.domains.len();
            limiter.replace_limits(loaded.limits);
            metrics.config_loaded(true);
            tracing::info!(config = %path.display(), files = loaded.files.len(), domains, "config reloaded");
            Reload::Applied
        }
        Err(errors) => {
            metrics.config_loaded(false);
            tracing::error!(config = %path.display(), "config rejected, the previous config keeps serving:\n{errors}");
            Reload::Rejected
        }
    }
}

/// Starts reloading on SIGHUP and, with `watch_files`, on changes. `fingerprint` identifies the
/// config already serving.
pub fn spawn(
    path: PathBuf,
    options: LoadOptions,
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
    fingerprint: u64,
    debounce: Duration,
    watch_files: bool,
) -> Result<ConfigWatch, notify::Error> {
    let (tx, mut rx) = mpsc::channel::<()>(1);
    // The watcher reports changes under absolute paths: a relative config path (the reference's
    // own tests use `RUNTIME_ROOT=runtime/current`) would match none of them.
    let path = std::path::absolute(&path).unwrap_or(path);
    let dir = if path.is_dir() {
        path.clone()
    } else {
        path.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let mut watcher = if watch_files {
        Some(watch_dir(&dir, tx.clone())?)
    } else {
        None
    };

    let task = tokio::spawn(async move {
        // Holding a sender keeps `recv` pending (not closed) when no file watcher holds one.
        let _keep_open = tx.clone();
        let mut current = fingerprint;
        let mut hangup = sighup();
        loop {
            tokio::select! {
                Some(()) = rx.recv() => settle(&mut rx, debounce).await,
                _ = next_hangup(&mut hangup) => {
                    tracing::info!("SIGHUP: reloading config");
                }
            }
            if let Some(watching) = watcher.as_mut() {
                // The directory may have been replaced (deleted and made again, or renamed
                // over): watch whatever is at its path now.
                let _ = watching.watch(&dir, RecursiveMode::NonRecursive);
            }
            reload(&path, options, &limiter, &metrics, &mut current).await;
        }
    });
    Ok(ConfigWatch { task })
}

/// How many `debounce`s a reload waits at most after the first change for the directory to
/// be quiet.
const SETTLE_AT_MOST: u32 = 4;

/// Waits until the directory has been quiet for `debounce`, or `SETTLE_AT_MOST` of them have
/// passed since the first change: a file beside the config that changes all the time (a log
/// written there, say) would otherwise hold every reload back for as long as it does. The
/// reload that follows finds the config as it was (the same fingerprint) unless it changed.
async fn settle(changes: &mut mpsc::Receiver<()>, debounce: Duration) {
    let give_up = tokio::time::Instant::now() + debounce * SETTLE_AT_MOST;
    loop {
        let quiet_until = (tokio::time::Instant::now() + debounce).min(give_up);
        match tokio::time::timeout_at(quiet_until, changes.recv()).await {
            Ok(Some(())) if tokio::time::Instant::now() < give_up => {}
            _ => return,
        }
    }
}

/// Watches `dir` and, for the day it is replaced, its parent (events about `dir` itself only):
/// any change sends on `events`.
fn watch_dir(dir: &Path, events: mpsc::Sender<()>) -> Result<ConfigWatcher, notify::Error> {
    let inside = dir.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let about_dir = event.paths.iter().any(|p| p.starts_with(&inside));
        if about_dir && !event.kind.is_access() {
            // A full channel already has a reload pending.
            let _ = events.try_send(());
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Best effort: a parent that cannot be watched only loses the replaced-directory case.
        let _ = watcher.watch(parent, RecursiveMode::NonRecursive);
    }
    Ok(watcher)
}

type ConfigWatcher = notify::RecommendedWatcher;

#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = Option<()>;

#[cfg(unix)]
fn sighup() -> Hangup {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot listen for SIGHUP: {e}");
            None
        }
    }
}

#[cfg(not(unix))]
fn sighup() -> Hangup {
    None
}

async fn next_hangup(hangup: &mut Hangup) {
    #[cfg(unix)]
    if let Some(signal) = hangup
        && signal.recv().await.is_some()
    {
        return;
    }
    let _ = hangup;
    std::future::pending::<()>().await;
}
