//! Config files on disk: which files a path names (the path itself, or the `*.yaml` and `*.yml`
//! entries of a directory, read through the visible links of a Kubernetes ConfigMap), read and
//! compiled into a [`Loaded`]. An entry that cannot be read (missing, a dangling link, a FIFO)
//! is an error, never skipped, so a broken mount cannot silently drop a domain's limits.

use std::path::{Path, PathBuf};

use super::compile::{LoadOptions, compile_sources_with, warnings};
use super::errors::{ConfigError, ConfigErrors};
use crate::limiter::rules::Limits;

/// A successful load.
#[derive(Debug, Default)]
pub struct Loaded {
    pub limits: Limits,
    pub files: Vec<PathBuf>,
    /// Identifies the files' names and contents: a reload with the same fingerprint changes
    /// nothing.
    pub fingerprint: u64,
    /// Things that load but deserve a look (e.g. limits too large for a log).
    pub warnings: Vec<String>,
}

/// Loads a file, or every `*.yaml`/`*.yml` in a directory (not recursing; names starting with
/// `.` are skipped, which also skips Kubernetes' `..data` and timestamped ConfigMap folders while
/// the visible symlinks into them are read).
pub fn load_path(path: &Path) -> Result<Loaded, ConfigErrors> {
    load_path_with(path, LoadOptions::default())
}

/// [`load_path`] with `options`.
pub fn load_path_with(path: &Path, options: LoadOptions) -> Result<Loaded, ConfigErrors> {
    let files = config_files(path).map_err(|message| {
        ConfigErrors(vec![ConfigError {
            file: path.display().to_string(),
            line: 0,
            path: String::new(),
            message,
        }])
    })?;
    let mut sources = Vec::with_capacity(files.len());
    let mut errors = Vec::new();
    for file in &files {
        if let Some(message) = not_regular(file) {
            errors.push(ConfigError {
                file: file.display().to_string(),
                line: 0,
                path: String::new(),
                message,
            });
            continue;
        }
        match std::fs::read_to_string(file) {
            Ok(text) => sources.push((file.display().to_string(), text)),
            Err(e) => errors.push(ConfigError {
                file: file.display().to_string(),
                line: 0,
                path: String::new(),
                message: format!("cannot read: {e}"),
            }),
        }
    }
    let fingerprint = {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        sources.hash(&mut hasher);
        hasher.finish()
    };
    let compiled = compile_sources_with(&sources, options);
    match compiled {
        Ok(limits) if errors.is_empty() => Ok(Loaded {
            warnings: warnings(&limits),
            limits,
            files,
            fingerprint,
        }),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more);
            Err(ConfigErrors(errors))
        }
    }
}

/// Why `file` (its links followed) is not read, when it is something other than a regular
/// file: opening a FIFO waits for a writer for ever, and a device or socket is no config.
/// Checked without opening it.
fn not_regular(file: &Path) -> Option<String> {
    use std::os::unix::fs::FileTypeExt as _;
    // A missing or unreadable entry is left to the read, which reports it.
    let kind = std::fs::metadata(file).ok()?.file_type();
    let what = if kind.is_file() || kind.is_dir() {
        return None;
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Some(format!(
        "is {what}, not read: a config entry must be a regular file (or a link to one)"
    ))
}

fn config_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read config: {e}"))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !meta.is_dir() {
        return Err(not_regular(path).unwrap_or_else(|| "is not a file or directory".into()));
    }
    let mut files = Vec::new();
    let entries =
        std::fs::read_dir(path).map_err(|e| format!("cannot list config directory: {e}"))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list config directory: {e}"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        // metadata() follows symlinks, so ConfigMap links to files count as files. An entry
        // that cannot be followed (a dangling link, a loop, no permission) is kept: reading it
        // fails, and a config file that cannot be read is an error, never silently skipped.
        let is_dir = std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir());
        if yaml && !name.starts_with('.') && !is_dir {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_entries_are_errors_not_skipped() {
        let dir = std::env::temp_dir().join(format!("slidegate-unreadable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("good.yaml"), "domain: good\n").expect("write");
        std::os::unix::fs::symlink(dir.join("gone.yaml"), dir.join("dangling.yaml")).expect("link");
        std::os::unix::fs::symlink(dir.join("loop-b.yaml"), dir.join("loop-a.yaml")).expect("link");
        std::os::unix::fs::symlink(dir.join("loop-a.yaml"), dir.join("loop-b.yaml")).expect("link");
        let errors = load_path(&dir).expect_err("broken entries");
        let named: Vec<&str> = errors
            .0
            .iter()
            .filter_map(|e| Path::new(&e.file).file_name()?.to_str())
            .collect();
        assert_eq!(
            named,
            ["dangling.yaml", "loop-a.yaml", "loop-b.yaml"],
            "{errors}"
        );
        assert!(
            errors
                .0
                .iter()
                .all(|e| e.message.starts_with("cannot read")),
            "{errors}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn directories_skip_dotfiles_and_read_configmap_links() {
        let dir = std::env::temp_dir().join(format!("slidegate-load-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let data = dir.join("..2026_11_30_v1");
        std::fs::create_dir_all(&data).expect("mkdir");
        std::fs::write(data.join("limits.yaml"), "domain: k8s\n").expect("write");
        std::fs::write(data.join("other.yml"), "domain: k8s2\n").expect("write");
        std::os::unix::fs::symlink("..2026_11_30_v1", dir.join("..data")).expect("link");
        std::os::unix::fs::symlink("..data/limits.yaml", dir.join("limits.yaml")).expect("link");
        std::os::unix::fs::symlink("..data/other.yml", dir.join("other.yml")).expect("link");
        std::fs::write(dir.join(".hidden.yaml"), "not: [valid").expect("write");
        std::fs::write(dir.join("notes.txt"), "ignored").expect("write");
        let loaded = load_path(&dir).expect("loads");
        let mut domains: Vec<_> = loaded.limits.domains.keys().cloned().collect();
        domains.sort();
        assert_eq!(
            domains,
            vec!["k8s", "k8s2"],
            "each domain once, through the visible links"
        );
        assert_eq!(loaded.files.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_path_is_an_error() {
        let errors = load_path(Path::new("/nonexistent/slidegate"))
            .expect_err("rejected")
            .0;
        assert!(
            errors[0].message.starts_with("cannot read config"),
            "{errors:?}"
        );
    }
}
