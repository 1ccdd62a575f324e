//! The model into the rule tree ([`Limits`]): each file's domain settings, and its descriptors
//! hung under their parents by key and value (exact, wildcard in file order, or any value).
//! Files and xDS resources both come through here, so a rule means the same whichever way it
//! arrived. Every problem is reported with its file, line and YAML path, and one bad file
//! rejects the whole config: a rule tree is replaced whole or not at all.

use std::collections::HashMap;
use std::sync::Arc;

use serde_saphyr::Spanned;

use super::errors::{ConfigError, ConfigErrors};
use super::model::{RawDescriptor, RawFile};
use super::parse::parse_reporting_all;
use crate::limiter::rules::{
    Algorithm, Domain, FailurePolicy, KeyChildren, Limit, Limits, Node, Pattern, WildcardChild,
    human_bytes,
};

mod rule;

/// Above this, a window's log (one entry per admitted hit) gets large: about 14 MB in Redis per
/// descriptor value ([`Limit::redis_bytes`], a sorted set at this size).
pub const LARGE_LOG_LIMIT: u32 = 100_000;

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

/// Compiles one file's model, collecting every problem in `errors` rather than stopping at the
/// first. The rule of one descriptor is compiled in [`rule`].
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
    use crate::limiter::Unit;
    use crate::limiter::rules::Window;

    pub(super) fn compile(files: &[(&str, &str)]) -> Result<Limits, ConfigErrors> {
        let sources: Vec<(String, String)> = files
            .iter()
            .map(|(f, t)| (f.to_string(), t.to_string()))
            .collect();
        compile_sources(&sources)
    }

    /// The one error a single-file config produces, as `line: path: message`.
    pub(super) fn only_error(yaml: &str) -> String {
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
}
