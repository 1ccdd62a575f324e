//! Reading config files and compiling them into [`Limits`]. Every problem found is reported with
//! its file, line and YAML path; one bad file rejects the whole load.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_saphyr::Spanned;

use super::duration;
use super::model::{RawDescriptor, RawFile, RawRateLimit};
use crate::limiter::Unit;

use crate::limiter::rules::{
    Algorithm, Domain, FailurePolicy, KeyChildren, Limit, Limits, Node, ObserverSlot, Pattern,
    Rule, WildcardChild, Window, human_bytes,
};

/// One problem in the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    /// 1-based; 0 when the problem has no line (a file that cannot be read).
    pub line: u64,
    /// Where in the YAML, e.g. `descriptors[2].rate_limit.unit`; empty for the whole file.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}", self.line)?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem of a failed load.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, e) in self.0.iter().enumerate() {
            if n > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

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

/// Above this, a window's log (one entry per admitted hit) gets large: about 14 MB in Redis per
/// descriptor value ([`Limit::redis_bytes`], a sorted set at this size).
pub const LARGE_LOG_LIMIT: u32 = 100_000;

/// Buckets per window for `sliding_counter` when the config does not say.
pub const DEFAULT_BUCKETS: u32 = 10;
/// More buckets approach the exact log's precision at the log's cost; past this, use the log.
pub const MAX_BUCKETS: u32 = 1000;

/// Rules whose logs can grow past [`LARGE_LOG_LIMIT`] entries.
pub fn warnings(limits: &Limits) -> Vec<String> {
    limits
        .rules()
        .into_iter()
        .filter_map(|(_, rule)| match &rule.limit {
            Limit::Windows {
                windows,
                algorithm: Algorithm::SlidingLog,
                ..
            } => windows
                .iter()
                .map(|w| w.limit)
                .max()
                .filter(|max| *max > LARGE_LOG_LIMIT)
                .map(|max| {
                    format!(
                        "{}: {}: a limit of {max} keeps up to {max} log entries per descriptor value (about {} in Redis); algorithm: sliding_counter keeps constant memory",
                        rule.source,
                        rule.path,
                        human_bytes(rule.limit.redis_bytes().unwrap_or(0))
                    )
                }),
            _ => None,
        })
        .collect()
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

/// How files combine into one config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Several files may name one domain; their descriptors are merged (the reference's
    /// `MERGE_DOMAIN_CONFIG`). A descriptor defined twice is still an error.
    pub merge_domains: bool,
    /// A reload may leave no domain at all. Off, such a reload is refused while domains are
    /// loaded: a directory emptied by mistake must not remove every limit.
    pub allow_no_domains: bool,
}

/// Compiles `(file name, YAML text)` pairs, one domain per file.
pub fn compile_sources(sources: &[(String, String)]) -> Result<Limits, ConfigErrors> {
    compile_sources_with(sources, LoadOptions::default())
}

/// Compiles `(file name, YAML text)` pairs with `options`.
pub fn compile_sources_with(
    sources: &[(String, String)],
    options: LoadOptions,
) -> Result<Limits, ConfigErrors> {
    let mut errors = Vec::new();
    let mut limits = Limits::default();
    let mut domain_files: HashMap<String, String> = HashMap::new();
    for (file, text) in sources {
        let raw = match parse_reporting_all(file, text) {
            Ok(raw) => raw,
            Err(found) => {
                errors.extend(found);
                continue;
            }
        };
        let mut ctx = Compiler {
            file,
            domain: String::new(),
            errors: &mut errors,
        };
        let (domain, line) = match &raw.domain {
            Some(d) => (d.value.clone(), d.referenced.line()),
            None => (String::new(), 1),
        };
        if domain.is_empty() {
            let message = "config file cannot have empty domain";
            ctx.error(line, "domain", message.into());
            continue;
        }
        match domain_files.get(&domain) {
            Some(first) if !options.merge_domains => {
                let message = format!(
                    "duplicate domain '{domain}' in config file (first defined in {first})"
                );
                ctx.error(line, "domain", message);
                continue;
            }
            Some(_) => {}
            None => {
                domain_files.insert(domain.clone(), file.clone());
            }
        }
        ctx.domain = domain.clone();
        let entry = limits.domains.entry(domain.clone()).or_default();
        ctx.domain_file(&raw, &domain, entry);
    }
    if errors.is_empty() {
        let mut longest: HashMap<String, u64> = HashMap::new();
        for (domain, rule) in limits.rules() {
            if let Limit::Windows { windows, .. } = &rule.limit {
                let most = windows.iter().map(|w| w.length_ms).max().unwrap_or(0);
                let at = longest.entry(domain.to_string()).or_default();
                *at = (*at).max(most);
            }
        }
        for (name, domain) in &mut limits.domains {
            domain.longest_window_ms = longest.get(name).copied().unwrap_or(0);
        }
        Ok(limits)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// How many field errors of one file are collected before giving up on the rest.
const MAX_FIELD_ERRORS: usize = 50;

/// Parses a file and, on a field error (a wrong type, an unknown key), reports it and parses
/// again without that field, so one run names every such error of the file, not only the
/// first. The field's lines are blanked, not removed, so later errors keep their line numbers.
/// It stops at a syntax error, at a field that opens a list item (blanking it would change
/// the structure), or when a retry finds something other than a field error (which could then
/// be an artefact of the blanking, so it is not reported).
fn parse_reporting_all(file: &str, text: &str) -> Result<RawFile, Vec<ConfigError>> {
    let mut lines: Vec<&str> = text.lines().collect();
    let mut errors: Vec<ConfigError> = Vec::new();
    let mut current = std::borrow::Cow::Borrowed(text);
    loop {
        let error = match parse(file, &current) {
            Ok(raw) if errors.is_empty() => return Ok(raw),
            Ok(_) => return Err(errors),
            Err(error) => error,
        };
        let field_error = is_field_error(&error.message);
        if !errors.is_empty() && !field_error {
            return Err(errors);
        }
        let line = error.line;
        errors.push(error);
        if !field_error || errors.len() >= MAX_FIELD_ERRORS || !blank_field(&mut lines, line) {
            return Err(errors);
        }
        current = std::borrow::Cow::Owned(lines.join("\n"));
    }
}

/// A serde error about one field's value or name, as opposed to the YAML's structure.
fn is_field_error(message: &str) -> bool {
    // serde's own messages, and the YAML parser's for scalars that do not read as the type
    // (`invalid u32`, `invalid boolean`, ...).
    [
        "unknown field",
        "duplicate field",
        "invalid ",
        "expected a whole number",
        "expected a number",
    ]
    .iter()
    .any(|start| message.starts_with(start))
}

/// Blanks the field at 1-based `line` and the lines nested under it; false when that is not a
/// plain `key: value` line (a list item's first key, or no line at all).
fn blank_field(lines: &mut [&str], line: u64) -> bool {
    let Some(at) = usize::try_from(line).ok().and_then(|l| l.checked_sub(1)) else {
        return false;
    };
    let Some(text) = lines.get(at) else {
        return false;
    };
    let trimmed = text.trim_start();
    if trimmed.is_empty() || trimmed.starts_with('-') || !trimmed.contains(':') {
        return false;
    }
    let indent = text.len() - trimmed.len();
    let nested = lines[at + 1..]
        .iter()
        .take_while(|l| {
            let t = l.trim_start();
            t.is_empty() || t.starts_with('#') || l.len() - t.len() > indent
        })
        .count();
    for blanked in &mut lines[at..=at + nested] {
        *blanked = "";
    }
    true
}

/// The parser's limits for one file of `bytes`: its defaults (which stop inputs that expand,
/// by aliases or nesting, into far more than they hold), except that the node and event counts
/// grow with the file, as no node takes less than a byte without an alias: a file of 100,000
/// rules (about 900,000 nodes) loads as its size allows.
fn parse_options(bytes: usize) -> serde_saphyr::Options {
    let defaults = serde_saphyr::Budget::default();
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_nodes: defaults.max_nodes.max(bytes),
            max_events: defaults.max_events.max(bytes.saturating_mul(2)),
        },
    }
}

fn parse(file: &str, text: &str) -> Result<RawFile, ConfigError> {
    let mut path = String::new();
    let options = parse_options(text.len());
    let parsed = serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = yaml_path(e.path());
            e.into_inner()
        })
    });
    parsed.map_err(|e| {
        let location = e.location();
        let found = location.and_then(|l| scalar_at(text, l.line(), l.column()));
        ConfigError {
            file: file.to_string(),
            line: location.map_or(0, |l| l.line()),
            path,
            message: plain(&first_line(&e.to_string()), found),
        }
    })
}

/// The parser's terse messages for a number that is not one, said with the accepted form and
/// what was found.
fn plain(message: &str, found: Option<&str>) -> String {
    let range = match message {
        "invalid u32" => "a whole number from 0 to 4294967295",
        "invalid u64" => "a whole number from 0 to 18446744073709551615",
        "invalid u16" => "a whole number from 0 to 65535",
        "invalid f64" | "invalid f32" => "a number",
        _ => return message.to_string(),
    };
    match found {
        Some(found) => format!("expected {range}, found `{found}`"),
        None => format!("expected {range}"),
    }
}

/// The plain scalar written at `line` and `column` (1-based) of `text`.
fn scalar_at(text: &str, line: u64, column: u64) -> Option<&str> {
    let line = text
        .lines()
        .nth(usize::try_from(line.checked_sub(1)?).ok()?)?;
    let from = usize::try_from(column.checked_sub(1)?).ok()?;
    let rest = line.get(from..)?;
    let end = rest.find([',', '}', ']', '#']).unwrap_or(rest.len());
    let scalar = rest[..end].trim();
    (!scalar.is_empty()).then_some(scalar)
}

/// The YAML path of a parse error as the user wrote it. The `value` level that `Spanned`
/// wrappers add (after a domain, a descriptor, a `rate_limit` or a `rate_limits` item) is left out.
fn yaml_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    let mut spanned_before = false;
    let mut parent = "";
    for segment in path.iter() {
        match segment {
            Segment::Map { key } if key == "value" && spanned_before => spanned_before = false,
            Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
                spanned_before = matches!(key.as_str(), "domain" | "rate_limit");
                parent = key;
            }
            Segment::Seq { index } => {
                out.push_str(&format!("[{index}]"));
                spanned_before = matches!(parent, "descriptors" | "rate_limits");
            }
            Segment::Enum { .. } | Segment::Unknown => spanned_before = false,
        }
    }
    out
}

/// The parser's message without its source snippet (file and line are printed separately).
fn first_line(message: &str) -> String {
    let mut line = message.lines().next().unwrap_or(message).trim();
    line = line.strip_prefix("error: ").unwrap_or(line);
    if let (true, Some(at)) = (line.starts_with("line "), line.find(": ")) {
        line = &line[at + 2..];
    }
    line.to_string()
}

struct Compiler<'a> {
    file: &'a str,
    domain: String,
    errors: &'a mut Vec<ConfigError>,
}

impl Compiler<'_> {
    /// One file's domain settings and descriptors, compiled into `into` (empty, or holding what
    /// earlier files of the same domain defined when domains are merged).
    fn domain_file(&mut self, raw: &RawFile, domain: &str, into: &mut Domain) {
        if let Some(policy) = &raw.store_failure {
            let line = policy.referenced.line();
            let parsed = match policy.value.as_str() {
                "error" => Some(FailurePolicy::Error),
                "allow" => Some(FailurePolicy::Allow),
                "deny" => Some(FailurePolicy::Deny),
                other => {
                    let message =
                        format!("unknown store_failure '{other}': use error, allow or deny");
                    self.error(line, "store_failure", message);
                    None
                }
            };
            match (into.store_failure, parsed) {
                (Some(earlier), Some(this)) if earlier != this => {
                    let message = format!(
                        "store_failure of domain '{domain}' is set differently in another file"
                    );
                    self.error(line, "store_failure", message);
                }
                (_, Some(this)) => into.store_failure = Some(this),
                _ => {}
            }
        }
        into.debit |= raw.debit;
        into.log_decisions |= raw.log_decisions;
        if let Some(reset) = &raw.store_reset {
            let line = reset.referenced.line();
            match reset.value.as_str() {
                "open" => {}
                "closed" => into.store_reset_closed = true,
                other => {
                    let message =
                        format!("unknown store_reset '{other}': use open (the default) or closed");
                    self.error(line, "store_reset", message);
                }
            }
        }
        self.descriptors(
            &raw.descriptors,
            "descriptors",
            domain,
            &[],
            &[],
            &mut into.root,
        );
    }

    fn error(&mut self, line: u64, path: &str, message: String) {
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            line,
            path: path.to_string(),
            message,
        });
    }

    fn descriptors(
        &mut self,
        list: &[Spanned<RawDescriptor>],
        yaml_path: &str,
        stat_path: &str,
        ancestor_keys: &[&str],
        ancestor_values: &[bool],
        node: &mut Node,
    ) {
        for (n, spanned) in list.iter().enumerate() {
            let raw = &spanned.value;
            let line = spanned.referenced.line();
            let here = format!("{yaml_path}[{n}]");
            if raw.key.is_empty() {
                self.error(line, &here, "descriptor has empty key".into());
                continue;
            }
            let value = raw.value.as_deref().filter(|v| !v.is_empty());
            if raw.share_threshold && !value.is_some_and(|v| v.contains('*')) {
                self.error(
                    line,
                    &format!("{here}.share_threshold"),
                    "share_threshold can only be used with wildcard values (a value containing '*')".into(),
                );
            }
            let stat = match value {
                Some(v) => format!("{stat_path}.{}_{v}", raw.key),
                None => format!("{stat_path}.{}", raw.key),
            };
            let mut keys = ancestor_keys.to_vec();
            keys.push(&raw.key);
            let mut value_levels = ancestor_values.to_vec();
            value_levels.push(raw.value_to_metric);
            let at = Here {
                line,
                path: &here,
                stat: &stat,
            };
            let mut child = Node {
                rule: self.rule(raw, &at, &keys, &value_levels).map(Arc::new),
                ..Node::default()
            };
            let below = format!("{here}.descriptors");
            self.descriptors(
                &raw.descriptors,
                &below,
                &stat,
                &keys,
                &value_levels,
                &mut child,
            );
            self.attach(node, raw, value, child, &at);
        }
    }

    /// Hangs a compiled descriptor under its parent: by exact value, as a wildcard (in file
    /// order), or as the key-only child. A second descriptor in the same place is an error.
    fn attach(
        &mut self,
        parent: &mut Node,
        raw: &RawDescriptor,
        value: Option<&str>,
        child: Node,
        at: &Here<'_>,
    ) {
        let children: &mut KeyChildren = parent.children.entry(raw.key.clone()).or_default();
        let wildcard = value.is_some_and(|v| v.contains('*'));
        let duplicate = match value {
            None => children.any_value.is_some(),
            Some(v) if wildcard => children.wildcards.iter().any(|w| w.pattern.as_str() == v),
            Some(v) => children.exact.contains_key(v),
        };
        if duplicate {
            let composite = format!(
                "{}.{}",
                self.domain,
                at.stat.split_once('.').map_or(at.stat, |(_, rest)| rest)
            );
            self.error(
                at.line,
                at.path,
                format!("duplicate descriptor composite key '{composite}'"),
            );
            return;
        }
        match value {
            None => children.any_value = Some(Box::new(child)),
            Some(v) if wildcard => children.wildcards.push(WildcardChild {
                pattern: Pattern::new(v),
                shared: raw.share_threshold,
                node: child,
            }),
            Some(v) => {
                children.exact.insert(v.to_string(), child);
            }
        }
    }

    /// The rule of one descriptor, or `None` when it has no limit (or a problem was reported).
    fn rule(
        &mut self,
        raw: &RawDescriptor,
        at: &Here<'_>,
        keys: &[&str],
        value_levels: &[bool],
    ) -> Option<Rule> {
        let limits = self.limit_list(raw, at)?;
        let errors_before = self.errors.len();
        let ban_ms = self.ban(raw, at);
        let algorithm = self.algorithm(raw, at);
        self.check_tag_by(raw, keys, at);
        let mut windows = Vec::with_capacity(limits.len());
        let mut unlimited = false;
        let mut replaces = Vec::new();
        for (path, spanned) in &limits {
            let l = &spanned.value;
            let line = spanned.referenced.line();
            if l.unlimited {
                self.check_unlimited(raw, l, limits.len(), path, line, at);
                unlimited = true;
            } else if let Some(window) = self.window(l, path, line) {
                windows.push(window);
            }
            self.replaces(l, path, line, &mut replaces);
        }
        self.check_self_replace(&limits, &replaces, at);
        if self.errors.len() > errors_before {
            return None;
        }
        let limit = if unlimited {
            Limit::Unlimited
        } else {
            Limit::windows(windows, ban_ms, algorithm)
        };
        Some(self.build_rule(raw, at, value_levels, limit, replaces))
    }

    /// The limits a descriptor lists (`rate_limit` or `rate_limits`), each with its YAML path;
    /// `None` when it lists none (then the rule-only settings are errors) or both.
    fn limit_list<'r>(
        &mut self,
        raw: &'r RawDescriptor,
        at: &Here<'_>,
    ) -> Option<Vec<(String, &'r Spanned<RawRateLimit>)>> {
        let here = at.path;
        match (&raw.rate_limit, &raw.rate_limits) {
            (Some(_), Some(_)) => {
                let message = "use either rate_limit or rate_limits, not both";
                self.error(at.line, here, message.into());
                None
            }
            (Some(one), None) => Some(vec![(format!("{here}.rate_limit"), one)]),
            (None, Some(many)) if many.is_empty() => {
                let message = "rate_limits must list at least one limit";
                self.error(at.line, &format!("{here}.rate_limits"), message.into());
                None
            }
            (None, Some(many)) => Some(
                many.iter()
                    .enumerate()
                    .map(|(n, l)| (format!("{here}.rate_limits[{n}]"), l))
                    .collect(),
            ),
            (None, None) => {
                let needs_limit = [
                    (raw.ban.is_some(), "ban", "ban"),
                    (
                        raw.algorithm.is_some() || raw.buckets.is_some(),
                        "algorithm",
                        "algorithm and buckets",
                    ),
                    (raw.tag_by.is_some(), "tag_by", "tag_by"),
                    (raw.debit, "debit", "debit"),
                ];
                for (set, field, what) in needs_limit {
                    if set {
                        let message = format!("{what} needs a rate_limit on the same descriptor");
                        self.error(at.line, &format!("{here}.{field}"), message);
                    }
                }
                None
            }
        }
    }

    fn ban(&mut self, raw: &RawDescriptor, at: &Here<'_>) -> Option<u64> {
        let text = raw.ban.as_ref()?;
        match duration::parse_ms(text) {
            Ok(ms) => Some(ms),
            Err(message) => {
                self.error(at.line, &format!("{}.ban", at.path), message);
                None
            }
        }
    }

    fn algorithm(&mut self, raw: &RawDescriptor, at: &Here<'_>) -> Algorithm {
        match (raw.algorithm.as_deref(), raw.buckets) {
            (None | Some("sliding_log"), None) => Algorithm::SlidingLog,
            (None | Some("sliding_log"), Some(_)) => {
                let message = "buckets only apply to algorithm: sliding_counter";
                self.error(at.line, &format!("{}.buckets", at.path), message.into());
                Algorithm::SlidingLog
            }
            (Some("sliding_counter"), buckets) => {
                let buckets = buckets.unwrap_or(DEFAULT_BUCKETS);
                if !(2..=MAX_BUCKETS).contains(&buckets) {
                    let message = format!("buckets must be between 2 and {MAX_BUCKETS}");
                    self.error(at.line, &format!("{}.buckets", at.path), message);
                }
                Algorithm::SlidingCounter { buckets }
            }
            (Some(other), _) => {
                let message =
                    format!("unknown algorithm '{other}': use sliding_log or sliding_counter");
                self.error(at.line, &format!("{}.algorithm", at.path), message);
                Algorithm::SlidingLog
            }
        }
    }

    fn check_tag_by(&mut self, raw: &RawDescriptor, keys: &[&str], at: &Here<'_>) {
        if let Some(tag_key) = raw.tag_by.as_ref().filter(|k| !keys.contains(&k.as_str())) {
            let message = format!(
                "tag_by '{tag_key}' is not a key of this descriptor (keys: {})",
                keys.join(", ")
            );
            self.error(at.line, &format!("{}.tag_by", at.path), message);
        }
    }

    fn check_unlimited(
        &mut self,
        raw: &RawDescriptor,
        l: &RawRateLimit,
        limit_count: usize,
        path: &str,
        line: u64,
        at: &Here<'_>,
    ) {
        if l.unit.is_some() || l.window.is_some() {
            let message = "should not specify rate limit unit when unlimited";
            self.error(line, &format!("{path}.unit"), message.into());
        }
        if limit_count > 1 {
            let message = "an unlimited rate limit cannot be combined with other limits";
            self.error(line, &format!("{path}.unlimited"), message.into());
        }
        if raw.ban.is_some() {
            let message = "an unlimited rate limit cannot have a ban";
            self.error(line, &format!("{}.ban", at.path), message.into());
        }
    }

    /// One limited window: a reference `unit`, or our `window` of any length.
    fn window(&mut self, l: &RawRateLimit, path: &str, line: u64) -> Option<Window> {
        let name: Option<Arc<str>> = l.name.as_deref().map(Into::into);
        let failed = match (&l.unit, &l.window) {
            (Some(_), Some(_)) => (
                format!("{path}.window"),
                "use either unit or window, not both".to_string(),
            ),
            (Some(unit), None) => match Unit::from_name(unit) {
                Some(unit) => return Some(Window::per_unit(l.requests_per_unit, unit, name)),
                None => (
                    format!("{path}.unit"),
                    format!("invalid rate limit unit '{unit}'"),
                ),
            },
            (None, Some(text)) => match duration::parse_ms(text) {
                Ok(length_ms) => {
                    return Some(Window {
                        limit: l.requests_per_unit,
                        length_ms,
                        unit: Unit::nearest(length_ms),
                        name,
                    });
                }
                Err(message) => (format!("{path}.window"), message),
            },
            (None, None) => (
                format!("{path}.unit"),
                "invalid rate limit unit '': set unit (second, minute, hour, day, week, month, year) or window (e.g. 90s)".to_string(),
            ),
        };
        self.error(line, &failed.0, failed.1);
        None
    }

    fn replaces(&mut self, l: &RawRateLimit, path: &str, line: u64, into: &mut Vec<Arc<str>>) {
        for (n, replace) in l.replaces.iter().flatten().enumerate() {
            match replace.name.as_deref().filter(|n| !n.is_empty()) {
                None => self.error(
                    line,
                    &format!("{path}.replaces[{n}]"),
                    "should not have an empty replaces entry".into(),
                ),
                Some(name) => into.push(Arc::<str>::from(name)),
            }
        }
    }

    fn check_self_replace(
        &mut self,
        limits: &[(String, &Spanned<RawRateLimit>)],
        replaces: &[Arc<str>],
        at: &Here<'_>,
    ) {
        let own_names: Vec<&str> = limits
            .iter()
            .filter_map(|(_, l)| l.value.name.as_deref())
            .collect();
        if let Some(name) = replaces.iter().find(|r| own_names.contains(&&***r)) {
            let message = format!("replaces should not contain name of same descriptor ('{name}')");
            self.error(at.line, at.path, message);
        }
    }

    fn build_rule(
        &self,
        raw: &RawDescriptor,
        at: &Here<'_>,
        value_levels: &[bool],
        limit: Limit,
        replaces: Vec<Arc<str>>,
    ) -> Rule {
        // The stat path below the domain, split for metric labels: first level, then the rest.
        let below_domain = at
            .stat
            .strip_prefix(self.domain.as_str())
            .and_then(|rest| rest.strip_prefix('.'))
            .unwrap_or(at.stat);
        let (key1, key2) = below_domain.split_once('.').unwrap_or((below_domain, ""));
        Rule {
            path: at.stat.to_string(),
            domain: self.domain.as_str().into(),
            stat_key1: key1.into(),
            stat_key2: key2.into(),
            value_levels: if raw.detailed_metric {
                vec![true; value_levels.len()]
            } else {
                value_levels.to_vec()
            },
            limit,
            replaces,
            shadow_mode: raw.shadow_mode,
            quota_mode: raw.quota_mode,
            debit: raw.debit,
            detailed_metric: raw.detailed_metric,
            metadata: raw.metadata.clone(),
            tag_by: raw.tag_by.clone(),
            source: format!("{}:{}", self.file, at.line).into(),
            observer_slot: ObserverSlot::default(),
        }
    }
}

/// Where in the config a descriptor is: its line, its YAML path and its stat path.
struct Here<'a> {
    line: u64,
    path: &'a str,
    stat: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(files: &[(&str, &str)]) -> Result<Limits, ConfigErrors> {
        let sources: Vec<(String, String)> = files
            .iter()
            .map(|(f, t)| (f.to_string(), t.to_string()))
            .collect();
        compile_sources(&sources)
    }

    /// The one error a single-file config produces, as `line: path: message`.
    fn only_error(yaml: &str) -> String {
        let errors = compile(&[("f.yaml", yaml)])
            .expect_err("config should be rejected")
            .0;
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = &errors[0];
        assert_eq!(e.file, "f.yaml");
        format!("{}: {}: {}", e.line, e.path, e.message)
    }

    #[test]
    fn reference_examples_load() {
        let limits = compile(&[(
            "messaging.yaml",
            "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n",
        )])
        .expect("valid");
        let rules = limits.rules();
        assert_eq!(rules.len(), 2);
        assert_eq!(
            rules[0].1.path,
            "messaging.message_type_marketing.to_number"
        );
        assert_eq!(rules[1].1.path, "messaging.to_number");
        assert_eq!(
            rules[0].1.limit,
            Limit::windows(
                vec![Window::per_unit(5, Unit::Day, None)],
                None,
                Algorithm::SlidingLog
            )
        );
    }

    #[test]
    fn every_reference_key_is_accepted() {
        let yaml = r#"
domain: all
descriptors:
  - key: a
    value: "x*"
    share_threshold: true
    shadow_mode: true
    quota_mode: true
    detailed_metric: true
    value_to_metric: true
    metadata: {team: payments, tier: 1}
    rate_limit:
      unit: SECOND
      requests_per_unit: 4
      name: a_limit
      replaces: [{name: other}]
  - key: b
    rate_limit: {unlimited: true}
"#;
        let limits = compile(&[("all.yaml", yaml)]).expect("valid");
        let rule = &limits.rules()[0].1;
        assert!(rule.shadow_mode && rule.quota_mode && rule.detailed_metric);
        assert_eq!(rule.replaces, vec![Arc::<str>::from("other")]);
        assert_eq!(
            rule.metadata,
            Some(serde_json::json!({"team": "payments", "tier": 1}))
        );
        assert_eq!(limits.rules()[1].1.limit, Limit::Unlimited);
    }

    #[test]
    fn extensions_compile() {
        let yaml = "domain: ext\ndescriptors:\n  - key: phone\n    rate_limits:\n      - {requests_per_unit: 3, unit: minute, name: burst}\n      - {requests_per_unit: 10, window: 1h30m}\n    ban: 15m\n    tag_by: phone\n";
        let limits = compile(&[("ext.yaml", yaml)]).expect("valid");
        let rule = &limits.rules()[0].1;
        let Limit::Windows {
            windows, ban_ms, ..
        } = &rule.limit
        else {
            panic!("expected windows");
        };
        assert_eq!(windows.len(), 2);
        assert_eq!(windows[1].length_ms, 5_400_000);
        assert_eq!(windows[1].unit, Unit::Hour);
        assert_eq!(*ban_ms, Some(900_000));
        assert_eq!(rule.tag_by.as_deref(), Some("phone"));
        assert_eq!(&*rule.source, "ext.yaml:3");
    }

    #[test]
    fn load_errors_name_file_line_and_path() {
        let cases = [
            (
                "descriptors: []\n",
                "1: domain: config file cannot have empty domain",
            ),
            (
                "domain: d\ndescriptors:\n  - value: x\n",
                "3: descriptors[0]: descriptor has empty key",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "4: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n  - key: b\n    descriptors:\n      - key: c\n        rate_limit: {unit: day, requests_per_unit: 1}\n      - key: c\n        rate_limit: {unit: day, requests_per_unit: 2}\n",
                "8: descriptors[1].descriptors[1]: duplicate descriptor composite key 'd.b.c'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: v\n  - key: a\n    value: v\n",
                "5: descriptors[1]: duplicate descriptor composite key 'd.a_v'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n",
                "4: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: me, replaces: [{name: me}]}\n",
                "3: descriptors[0]: replaces should not contain name of same descriptor ('me')",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{}]}\n",
                "4: descriptors[0].rate_limit.replaces[0]: should not have an empty replaces entry",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: plain\n    share_threshold: true\n",
                "3: descriptors[0].share_threshold: share_threshold can only be used with wildcard values (a value containing '*')",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    ratelimit: {unit: second}\n",
                "4: descriptors[0].ratelimit: unknown field `ratelimit`, expected one of key, value, rate_limit, rate_limits, ban, algorithm, buckets, tag_by, descriptors, shadow_mode, quota_mode, debit, detailed_metric, value_to_metric, share_threshold, metadata",
            ),
        ];
        for (yaml, expected) in cases {
            assert_eq!(only_error(yaml), expected, "for:\n{yaml}");
        }
    }

    #[test]
    fn rule_errors_name_file_line_and_path() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    rate_limits: [{unit: second, requests_per_unit: 1}]\n",
                "3: descriptors[0]: use either rate_limit or rate_limits, not both",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {window: 90, requests_per_unit: 1}\n",
                "4: descriptors[0].rate_limit.window: invalid duration '90': write a number with a unit (ms, s, m, h, d, w), e.g. 90s, 0.05s or 1h30m",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {window: 90s, unit: minute, requests_per_unit: 1}\n",
                "4: descriptors[0].rate_limit.window: use either unit or window, not both",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    ban: 5m\n",
                "3: descriptors[0].ban: ban needs a rate_limit on the same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    debit: true\n",
                "3: descriptors[0].debit: debit needs a rate_limit on the same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    ban: soon\n",
                "3: descriptors[0].ban: invalid duration 'soon': write a number with a unit (ms, s, m, h, d, w), e.g. 90s, 0.05s or 1h30m",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    tag_by: user\n",
                "3: descriptors[0].tag_by: tag_by 'user' is not a key of this descriptor (keys: a)",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limits:\n      - {unlimited: true}\n      - {unit: second, requests_per_unit: 1}\n",
                "5: descriptors[0].rate_limits[0].unlimited: an unlimited rate limit cannot be combined with other limits",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
                "4: descriptors[0].rate_limit.unit: invalid rate limit unit '': set unit (second, minute, hour, day, week, month, year) or window (e.g. 90s)",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: day, requests_per_unit: -1}\n",
                "4: descriptors[0].rate_limit.requests_per_unit: expected a whole number from 0 to 4294967295, found `-1`",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    algorithm: token_bucket\n",
                "3: descriptors[0].algorithm: unknown algorithm 'token_bucket': use sliding_log or sliding_counter",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    buckets: 20\n",
                "3: descriptors[0].buckets: buckets only apply to algorithm: sliding_counter",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    algorithm: sliding_counter\n    buckets: 1\n",
                "3: descriptors[0].buckets: buckets must be between 2 and 1000",
            ),
        ];
        for (yaml, expected) in cases {
            assert_eq!(only_error(yaml), expected, "for:\n{yaml}");
        }
    }

    #[test]
    fn sliding_counter_rules_compile_without_a_warning() {
        let yaml = "domain: c\ndescriptors:\n  - key: tokens\n    algorithm: sliding_counter\n    rate_limit: {unit: minute, requests_per_unit: 10000000}\n  - key: fine\n    algorithm: sliding_counter\n    buckets: 60\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
        let limits = compile(&[("c.yaml", yaml)]).expect("valid");
        let algorithms: Vec<Algorithm> = limits
            .rules()
            .iter()
            .map(|(_, r)| match &r.limit {
                Limit::Windows { algorithm, .. } => *algorithm,
                Limit::Unlimited => panic!("limited"),
            })
            .collect();
        assert_eq!(
            algorithms,
            vec![
                Algorithm::SlidingCounter { buckets: 60 },
                Algorithm::SlidingCounter { buckets: 10 }
            ]
        );
        assert!(warnings(&limits).is_empty());
    }

    #[test]
    fn large_log_limits_load_with_a_warning() {
        let yaml = "domain: big\ndescriptors:\n  - key: bytes\n    rate_limit: {unit: minute, requests_per_unit: 10000000}\n  - key: small\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
        let limits = compile(&[("big.yaml", yaml)]).expect("large limits stay valid");
        assert_eq!(
            warnings(&limits),
            vec!["big.yaml:3: big.bytes: a limit of 10000000 keeps up to 10000000 log entries per descriptor value (about 1.4 GB in Redis); algorithm: sliding_counter keeps constant memory".to_string()]
        );
    }

    #[test]
    fn domains_may_set_their_store_failure_policy() {
        let limits = compile(&[
            ("open.yaml", "domain: open\nstore_failure: allow\n"),
            ("closed.yaml", "domain: closed\nstore_failure: deny\n"),
            ("plain.yaml", "domain: plain\n"),
        ])
        .expect("valid");
        let policy = |d: &str| limits.domain(d).and_then(|d| d.store_failure);
        assert_eq!(policy("open"), Some(FailurePolicy::Allow));
        assert_eq!(policy("closed"), Some(FailurePolicy::Deny));
        assert_eq!(policy("plain"), None);
        assert_eq!(
            only_error("domain: d\nstore_failure: maybe\n"),
            "2: store_failure: unknown store_failure 'maybe': use error, allow or deny"
        );
        assert_eq!(
            only_error("domain: d\nstore_reset: later\n"),
            "2: store_reset: unknown store_reset 'later': use open (the default) or closed"
        );
    }

    #[test]
    fn every_field_error_of_a_file_is_reported() {
        let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: many}\n  - key: b\n    ratelimit:\n      unit: second\n  - key: c\n    rate_limit:\n      unit: minute\n      requests_per_unit: -3\n    shadow_mode: maybe\n";
        let errors = compile(&[("f.yaml", yaml)]).expect_err("three bad fields");
        let lines: Vec<(u64, String)> = errors.0.iter().map(|e| (e.line, e.path.clone())).collect();
        assert_eq!(
            lines,
            [
                (4, "descriptors[0].rate_limit.requests_per_unit".to_string()),
                (6, "descriptors[1].ratelimit".to_string()),
                (
                    11,
                    "descriptors[2].rate_limit.requests_per_unit".to_string()
                ),
                (12, "descriptors[2].shadow_mode".to_string()),
            ],
            "{errors}"
        );
        // A broken structure stops the search instead of guessing.
        let broken = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second\n";
        assert_eq!(
            compile(&[("f.yaml", broken)]).expect_err("syntax").0.len(),
            1
        );
    }

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
    fn domains_merge_across_files_when_asked() {
        let sources = [
            (
                "a.yaml",
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
            ),
            (
                "b.yaml",
                "domain: d\nstore_failure: allow\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
            ),
        ];
        let owned: Vec<(String, String)> = sources
            .iter()
            .map(|(f, t)| (f.to_string(), t.to_string()))
            .collect();
        assert!(compile_sources(&owned).is_err(), "refused without merging");
        let merged = compile_sources_with(
            &owned,
            LoadOptions {
                merge_domains: true,
                ..LoadOptions::default()
            },
        )
        .expect("merged");
        let paths: Vec<&str> = merged
            .rules()
            .iter()
            .map(|(_, r)| r.path.as_str())
            .collect();
        assert_eq!(paths, ["d.a", "d.b"]);
        assert_eq!(
            merged.domain("d").and_then(|d| d.store_failure),
            Some(FailurePolicy::Allow)
        );
        let mut twice = owned.clone();
        twice[1].1 = owned[0].1.clone();
        let errors = compile_sources_with(
            &twice,
            LoadOptions {
                merge_domains: true,
                ..LoadOptions::default()
            },
        )
        .expect_err("the same descriptor twice");
        assert!(
            errors
                .to_string()
                .contains("duplicate descriptor composite key 'd.a'"),
            "{errors}"
        );
    }

    #[test]
    fn duplicate_domains_across_files_are_rejected() {
        let errors = compile(&[("a.yaml", "domain: d\n"), ("b.yaml", "domain: d\n")])
            .expect_err("rejected")
            .0;
        assert_eq!(errors.len(), 1);
        assert_eq!(
            errors[0].to_string(),
            "b.yaml:1: domain: duplicate domain 'd' in config file (first defined in a.yaml)"
        );
    }

    #[test]
    fn every_error_of_every_file_is_reported() {
        let errors = compile(&[
            (
                "a.yaml",
                "domain: a\ndescriptors:\n  - key: ''\n  - key: x\n    rate_limit: {unit: eon}\n",
            ),
            ("b.yaml", "domain: [\n"),
        ])
        .expect_err("rejected")
        .0;
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[2].file == "b.yaml" && errors[2].line > 0);
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
