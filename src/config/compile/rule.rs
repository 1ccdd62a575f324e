//! One descriptor's settings compiled into its [`Rule`]: its limits (`rate_limit` or
//! `rate_limits`, each a reference `unit` or a `window` of any length), ban, algorithm, hash tag
//! and replacements, each checked against the others. The tree they hang in is the parent
//! module's; this is what one rule holds.

use std::sync::Arc;

use serde_saphyr::Spanned;

use super::{Compiler, Here};
use crate::config::duration;
use crate::config::model::{RawDescriptor, RawRateLimit};
use crate::limiter::Unit;
use crate::limiter::rules::{Algorithm, Limit, ObserverSlot, Rule, Window};

/// Buckets per window for `sliding_counter` when the config does not say.
const DEFAULT_BUCKETS: u32 = 10;
/// More buckets approach the exact log's precision at the log's cost; past this, use the log.
const MAX_BUCKETS: u32 = 1000;

impl Compiler<'_> {
    /// The rule of one descriptor, or `None` when it has no limit (or a problem was reported).
    pub(super) fn rule(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::compile::tests::{compile, only_error};
    use crate::config::compile::warnings;

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
}
