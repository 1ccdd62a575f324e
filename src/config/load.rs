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
    KeyChildren, Limit, Limits, Node, Pattern, Rule, WildcardChild, Window,
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
#[derive(Debug)]
pub struct Loaded {
    pub limits: Limits,
    pub files: Vec<PathBuf>,
}

/// Loads a file, or every `*.yaml`/`*.yml` in a directory (not recursing; names starting with
/// `.` are skipped, which also skips Kubernetes' `..data` and timestamped ConfigMap folders while
/// the visible symlinks into them are read).
pub fn load_path(path: &Path) -> Result<Loaded, ConfigErrors> {
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
    let compiled = compile_sources(&sources);
    match compiled {
        Ok(limits) if errors.is_empty() => Ok(Loaded { limits, files }),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more);
            Err(ConfigErrors(errors))
        }
    }
}

fn config_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read config: {e}"))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    let entries =
        std::fs::read_dir(path).map_err(|e| format!("cannot list config directory: {e}"))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list config directory: {e}"))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        // metadata() follows symlinks, so ConfigMap links to files count as files.
        let is_file = std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file());
        if yaml && !name.starts_with('.') && is_file {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// Compiles `(file name, YAML text)` pairs, one domain per file.
pub fn compile_sources(sources: &[(String, String)]) -> Result<Limits, ConfigErrors> {
    let mut errors = Vec::new();
    let mut limits = Limits::default();
    let mut domain_files: HashMap<String, String> = HashMap::new();
    for (file, text) in sources {
        let raw = match parse(file, text) {
            Ok(raw) => raw,
            Err(e) => {
                errors.push(e);
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
            ctx.error(
                line,
                "domain",
                "config file cannot have empty domain".into(),
            );
            continue;
        }
        if let Some(first) = domain_files.get(&domain) {
            ctx.error(
                line,
                "domain",
                format!("duplicate domain '{domain}' in config file (first defined in {first})"),
            );
            continue;
        }
        domain_files.insert(domain.clone(), file.clone());
        ctx.domain = domain.clone();
        let mut root = Node::default();
        ctx.descriptors(&raw.descriptors, "descriptors", &domain, &[], &mut root);
        limits.domains.insert(domain, root);
    }
    if errors.is_empty() {
        Ok(limits)
    } else {
        Err(ConfigErrors(errors))
    }
}

fn parse(file: &str, text: &str) -> Result<RawFile, ConfigError> {
    let mut path = String::new();
    let parsed = serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = yaml_path(e.path());
            e.into_inner()
        })
    });
    parsed.map_err(|e| ConfigError {
        file: file.to_string(),
        line: e.location().map_or(0, |l| l.line()),
        path,
        message: first_line(&e.to_string()),
    })
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
            let wildcard = value.is_some_and(|v| v.contains('*'));
            if raw.share_threshold && !wildcard {
                self.error(
                    line,
                    &format!("{here}.share_threshold"),
                    "share_threshold can only be used with wildcard values (a value containing '*')".into(),
                );
            }
            let level = match value {
                Some(v) => format!("{}_{}", raw.key, v),
                None => raw.key.clone(),
            };
            let stat = format!("{stat_path}.{level}");
            let mut keys = ancestor_keys.to_vec();
            keys.push(&raw.key);
            let mut child = Node {
                rule: self.rule(raw, line, &here, &stat, &keys).map(Arc::new),
                ..Node::default()
            };
            self.descriptors(
                &raw.descriptors,
                &format!("{here}.descriptors"),
                &stat,
                &keys,
                &mut child,
            );

            let children: &mut KeyChildren = node.children.entry(raw.key.clone()).or_default();
            let duplicate = match value {
                None => children.any_value.is_some(),
                Some(v) if wildcard => children.wildcards.iter().any(|w| w.pattern.as_str() == v),
                Some(v) => children.exact.contains_key(v),
            };
            if duplicate {
                let composite = format!(
                    "{}.{}",
                    self.domain,
                    stat.split_once('.').map_or(&*stat, |(_, rest)| rest)
                );
                self.error(
                    line,
                    &here,
                    format!("duplicate descriptor composite key '{composite}'"),
                );
                continue;
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
    }

    /// The rule of one descriptor, or `None` when it has no limit (or a problem was reported).
    fn rule(
        &mut self,
        raw: &RawDescriptor,
        line: u64,
        here: &str,
        stat: &str,
        keys: &[&str],
    ) -> Option<Rule> {
        let limits: Vec<(String, &Spanned<RawRateLimit>)> =
            match (&raw.rate_limit, &raw.rate_limits) {
                (Some(_), Some(_)) => {
                    self.error(
                        line,
                        here,
                        "use either rate_limit or rate_limits, not both".into(),
                    );
                    return None;
                }
                (Some(one), None) => vec![(format!("{here}.rate_limit"), one)],
                (None, Some(many)) if many.is_empty() => {
                    self.error(
                        line,
                        &format!("{here}.rate_limits"),
                        "rate_limits must list at least one limit".into(),
                    );
                    return None;
                }
                (None, Some(many)) => many
                    .iter()
                    .enumerate()
                    .map(|(n, l)| (format!("{here}.rate_limits[{n}]"), l))
                    .collect(),
                (None, None) => {
                    if raw.ban.is_some() {
                        self.error(
                            line,
                            &format!("{here}.ban"),
                            "ban needs a rate_limit on the same descriptor".into(),
                        );
                    }
                    if raw.tag_by.is_some() {
                        self.error(
                            line,
                            &format!("{here}.tag_by"),
                            "tag_by needs a rate_limit on the same descriptor".into(),
                        );
                    }
                    return None;
                }
            };
        let errors_before = self.errors.len();

        let ban_ms = match &raw.ban {
            Some(text) => match duration::parse_ms(text) {
                Ok(ms) => Some(ms),
                Err(message) => {
                    self.error(line, &format!("{here}.ban"), message);
                    None
                }
            },
            None => None,
        };
        if let Some(tag_key) = raw.tag_by.as_ref().filter(|k| !keys.contains(&k.as_str())) {
            self.error(
                line,
                &format!("{here}.tag_by"),
                format!(
                    "tag_by '{tag_key}' is not a key of this descriptor (keys: {})",
                    keys.join(", ")
                ),
            );
        }

        let mut windows = Vec::with_capacity(limits.len());
        let mut unlimited = false;
        let mut replaces = Vec::new();
        for (path, spanned) in &limits {
            let l = &spanned.value;
            let line = spanned.referenced.line();
            if l.unlimited {
                if l.unit.is_some() || l.window.is_some() {
                    self.error(
                        line,
                        &format!("{path}.unit"),
                        "should not specify rate limit unit when unlimited".into(),
                    );
                }
                if limits.len() > 1 {
                    self.error(
                        line,
                        &format!("{path}.unlimited"),
                        "an unlimited rate limit cannot be combined with other limits".into(),
                    );
                }
                if raw.ban.is_some() {
                    self.error(
                        line,
                        &format!("{here}.ban"),
                        "an unlimited rate limit cannot have a ban".into(),
                    );
                }
                unlimited = true;
            } else {
                let name: Option<Arc<str>> = l.name.as_deref().map(Into::into);
                match (&l.unit, &l.window) {
                    (Some(_), Some(_)) => {
                        self.error(line, &format!("{path}.window"), "use either unit or window, not both".into())
                    }
                    (Some(unit), None) => match Unit::from_name(unit) {
                        Some(unit) => windows.push(Window::per_unit(l.requests_per_unit, unit, name)),
                        None => self.error(line, &format!("{path}.unit"), format!("invalid rate limit unit '{unit}'")),
                    },
                    (None, Some(text)) => match duration::parse_ms(text) {
                        Ok(length_ms) => windows.push(Window {
                            limit: l.requests_per_unit,
                            length_ms,
                            unit: Unit::nearest(length_ms),
                            name,
                        }),
                        Err(message) => self.error(line, &format!("{path}.window"), message),
                    },
                    (None, None) => self.error(
                        line,
                        &format!("{path}.unit"),
                        "invalid rate limit unit '': set unit (second, minute, hour, day, week, month, year) or window (e.g. 90s)".into(),
                    ),
                }
            }
            for (n, replace) in l.replaces.iter().flatten().enumerate() {
                match replace.name.as_deref().filter(|n| !n.is_empty()) {
                    None => self.error(
                        line,
                        &format!("{path}.replaces[{n}]"),
                        "should not have an empty replaces entry".into(),
                    ),
                    Some(name) => replaces.push(Arc::<str>::from(name)),
                }
            }
        }
        let own_names: Vec<&str> = limits
            .iter()
            .filter_map(|(_, l)| l.value.name.as_deref())
            .collect();
        if let Some(name) = replaces.iter().find(|r| own_names.contains(&&***r)) {
            self.error(
                line,
                here,
                format!("replaces should not contain name of same descriptor ('{name}')"),
            );
        }
        if self.errors.len() > errors_before {
            return None;
        }
        Some(Rule {
            path: stat.to_string(),
            limit: if unlimited {
                Limit::Unlimited
            } else {
                Limit::Windows { windows, ban_ms }
            },
            replaces,
            shadow_mode: raw.shadow_mode,
            quota_mode: raw.quota_mode,
            detailed_metric: raw.detailed_metric,
            metadata: raw.metadata.clone(),
            tag_by: raw.tag_by.clone(),
            source: format!("{}:{line}", self.file).into(),
        })
    }
}
