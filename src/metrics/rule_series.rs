//! The per-rule counters, labelled `domain`, `key1` and `key2` as the reference labels them.
//! A rule whose labels carry no descriptor values keeps its series in the rule itself, made
//! when the config is handed to the limiter, so a decision hashes no labels; a rule with values
//! in its labels counts through its families, under at most [`DETAILED_SERIES_CAP`] label sets.

use std::sync::{Arc, OnceLock};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::{Metrics, RuleLabels, series};
use crate::limiter::observe::{DescriptorReport, RuleCounts};
use crate::limiter::rules::{Rule, Segment};

/// Most label sets with descriptor values kept, over all detailed rules.
pub const DETAILED_SERIES_CAP: usize = 1000;

/// The per-rule counters.
#[derive(Clone, Copy)]
enum RuleCounter {
    TotalHits,
    OverLimit,
    OverLimitWithLocalCache,
    NearLimit,
    WithinLimit,
    ShadowMode,
    Bans,
}

/// One rule's series under its plain labels (no descriptor values), kept in the rule's
/// observer slot, each looked up in its family on its first use, by `RuleCounter` order.
struct RuleSeries {
    owner: u64,
    labels: RuleLabels,
    families: [Family<RuleLabels, Counter>; 7],
    series: [OnceLock<Counter>; 7],
}

impl RuleCounts for RuleSeries {
    fn owner(&self) -> u64 {
        self.owner
    }

    fn count(&self, report: &DescriptorReport<'_>) {
        count(report, |counter, n| {
            let i = counter as usize;
            series(&self.series[i], &self.families[i], || self.labels.clone()).inc_by(n);
        });
    }
}

/// A rule's labels without descriptor values: its domain and the two parts of its path.
fn plain_labels(rule: &Rule) -> RuleLabels {
    RuleLabels {
        domain: rule.domain.clone(),
        key1: rule.stat_key1.clone(),
        key2: rule.stat_key2.clone(),
    }
}

impl Metrics {
    /// Counts one descriptor's report: through the series kept in its rule where this
    /// instance put them there, else in the families under the report's labels.
    pub(super) fn count_descriptor(&self, report: &DescriptorReport<'_>) {
        let kept = report
            .rule
            .and_then(|rule| rule.observer_slot.get())
            .filter(|kept| kept.owner() == self.id);
        match kept {
            Some(kept) => kept.count(report),
            None => {
                let labels = self.labels(report);
                count(report, |counter, n| {
                    self.rule_family(counter).get_or_create(&labels).inc_by(n);
                });
            }
        }
    }

    /// The series a rule keeps (see [`RuleSeries`]): only a rule without values in its labels
    /// keeps any.
    pub(super) fn kept_series(&self, rule: &Rule) -> Option<Arc<dyn RuleCounts>> {
        (!rule.value_levels.contains(&true))
            .then(|| Arc::new(self.rule_series(rule)) as Arc<dyn RuleCounts>)
    }

    /// Labels for a descriptor: the rule's path, or with values where the rule asks for them
    /// (while under the cap).
    fn labels(&self, report: &DescriptorReport<'_>) -> RuleLabels {
        let Some(rule) = report.rule else {
            // Request overrides: one series per domain and entry keys, never per value.
            let keys: Vec<&str> = report
                .segments
                .iter()
                .map(|s| match s {
                    Segment::Value { key, .. } | Segment::Shared { key, .. } => *key,
                })
                .collect();
            return RuleLabels {
                domain: report.domain.into(),
                key1: "_override".into(),
                key2: keys.join(".").into(),
            };
        };
        let plain = plain_labels(rule);
        if !rule.value_levels.iter().any(|v| *v) {
            return plain;
        }
        let levels: Vec<String> = report
            .segments
            .iter()
            .zip(rule.value_levels.iter().chain(std::iter::repeat(&false)))
            .map(|(segment, with_value)| match segment {
                Segment::Value { key, value } if *with_value => format!("{key}_{value}"),
                Segment::Shared { key, pattern } if *with_value => format!("{key}_{pattern}"),
                Segment::Value { key, .. } | Segment::Shared { key, .. } => key.to_string(),
            })
            .collect();
        let detailed = RuleLabels {
            domain: rule.domain.clone(),
            key1: levels.first().map_or("", String::as_str).into(),
            key2: levels
                .get(1..)
                .map_or(String::new(), |rest| rest.join("."))
                .into(),
        };
        let mut seen = self
            .detailed_seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if seen.contains(&detailed) {
            return detailed;
        }
        if seen.len() < DETAILED_SERIES_CAP {
            seen.insert(detailed.clone());
            return detailed;
        }
        plain
    }

    /// A rule's series, to be kept in the rule (see [`RuleSeries`]).
    fn rule_series(&self, rule: &Rule) -> RuleSeries {
        let counters = [
            RuleCounter::TotalHits,
            RuleCounter::OverLimit,
            RuleCounter::OverLimitWithLocalCache,
            RuleCounter::NearLimit,
            RuleCounter::WithinLimit,
            RuleCounter::ShadowMode,
            RuleCounter::Bans,
        ];
        RuleSeries {
            owner: self.id,
            labels: plain_labels(rule),
            families: counters.map(|counter| self.rule_family(counter).clone()),
            series: Default::default(),
        }
    }

    fn rule_family(&self, counter: RuleCounter) -> &Family<RuleLabels, Counter> {
        match counter {
            RuleCounter::TotalHits => &self.total_hits,
            RuleCounter::OverLimit => &self.over_limit,
            RuleCounter::OverLimitWithLocalCache => &self.over_limit_with_local_cache,
            RuleCounter::NearLimit => &self.near_limit,
            RuleCounter::WithinLimit => &self.within_limit,
            RuleCounter::ShadowMode => &self.shadow_mode,
            RuleCounter::Bans => &self.bans,
        }
    }
}

/// Adds a descriptor's report to the per-rule counters through `add`.
fn count(report: &DescriptorReport<'_>, add: impl Fn(RuleCounter, u64)) {
    add(RuleCounter::TotalHits, report.hits);
    for (counter, n) in [
        (RuleCounter::OverLimit, report.over),
        (RuleCounter::NearLimit, report.near),
        (RuleCounter::WithinLimit, report.within),
        (RuleCounter::ShadowMode, report.shadow),
    ] {
        if n > 0 {
            add(counter, n);
        }
    }
    if report.from_cache && report.over > 0 {
        add(RuleCounter::OverLimitWithLocalCache, report.over);
    }
    if report.ban_set {
        add(RuleCounter::Bans, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::observe::Observer;

    fn report<'a>(rule: &'a Rule, segments: &'a [Segment<'a>], over: u64) -> DescriptorReport<'a> {
        DescriptorReport {
            domain: "d",
            rule: Some(rule),
            segments,
            hits: 1,
            within: 1 - over,
            near: 0,
            over,
            shadow: 0,
            ban_set: false,
            from_cache: over > 0,
        }
    }

    /// The series a rule keeps in its slot count for the instance that put them there: a
    /// second instance observing the same rule (its own series not kept: the slot was filled)
    /// counts in its own families, and a counter's series appears only once it has counted.
    #[test]
    fn series_kept_in_a_rule_count_for_their_own_instance() {
        let limits = crate::config::compile_sources(&[(
            "t.yaml".into(),
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n"
                .into(),
        )])
        .expect("valid config");
        let rules = limits.rules();
        let rule = &rules[0].1;
        let segments = [Segment::Value {
            key: "k",
            value: "v",
        }];
        let (first, second) = (Metrics::new(), Metrics::new());
        assert!(
            rule.observer_slot.get().is_none(),
            "filled by the limiter, not by compiling"
        );
        rule.observer_slot.fill(
            first
                .rule_counts(rule)
                .expect("a rule without values keeps its series"),
        );
        if let Some(counts) = second.rule_counts(rule) {
            rule.observer_slot.fill(counts);
        }
        assert_eq!(
            rule.observer_slot.get().map(|kept| kept.owner()),
            Some(first.id)
        );
        first.descriptor(&report(rule, &segments, 0));
        first.descriptor(&report(rule, &segments, 0));
        second.descriptor(&report(rule, &segments, 1));
        let line = |m: &Metrics, name: &str| {
            m.render()
                .1
                .lines()
                .find(|l| l.starts_with(&format!("ratelimit_service_rate_limit_{name}_total{{")))
                .map(str::to_owned)
        };
        let value = |m: &Metrics, name: &str| {
            line(m, name).and_then(|l| l.rsplit(' ').next().map(str::to_owned))
        };
        assert_eq!(value(&first, "total_hits").as_deref(), Some("2"));
        assert_eq!(value(&first, "within_limit").as_deref(), Some("2"));
        assert_eq!(line(&first, "over_limit"), None, "never counted: no series");
        assert_eq!(value(&second, "total_hits").as_deref(), Some("1"));
        assert_eq!(value(&second, "over_limit").as_deref(), Some("1"));
        assert_eq!(
            value(&second, "over_limit_with_local_cache").as_deref(),
            Some("1")
        );
        assert_eq!(line(&second, "within_limit"), None);
        assert!(
            line(&first, "total_hits").is_some_and(|l| l.contains("key1=\"k\"")),
            "{:?}",
            line(&first, "total_hits")
        );
    }
}
