//! Planning a decision: each of a request's descriptors matched to its rule (or to the caller's
//! own limit), and the store's batch built from the ones that need the store. A decision and
//! the admin API's inspect and reset plan a request the same way, so an operator sees the rule
//! and the keys a caller's request meets.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use super::engine::Limiter;
use super::key::{self, Variant};
use super::rules::{Algorithm, Domain, Limit, Match, Node, Rule, Segment, Window};
use super::{Code, Descriptor, Request, Status, Unit};
use crate::store::{CheckItem, Role};

/// The rule a request descriptor found.
enum Found<'a> {
    Nothing,
    /// The caller's `limit` override, which wins over the config.
    Override(Window),
    Rule(Match<'a>),
}

/// What one request descriptor turned into.
pub(super) enum Plan<'a> {
    /// No rule, or a rule another matched rule `replaces`: OK without a limit.
    NoLimit,
    /// A rule that says `unlimited`.
    Unlimited(&'a Arc<Rule>),
    /// Sent to the store as item `item`.
    Check {
        item: usize,
        rule: Option<&'a Arc<Rule>>,
        /// The windows as configured (names and units for the status), in the store's order.
        windows: Cow<'a, [Window]>,
        segments: Vec<Segment<'a>>,
    },
}

/// A request matched against the rules: one plan per descriptor, and the store's batch.
pub(super) struct Planned<'a> {
    pub(super) plans: Vec<Plan<'a>>,
    pub(super) items: Vec<CheckItem<'a>>,
}

/// Switches that apply to every rule a request matches.
#[derive(Clone, Copy)]
pub(super) struct Modes {
    /// Every rule is a quota rule.
    pub(super) quota_all: bool,
    /// Every rule takes debits.
    pub(super) debit: bool,
}

impl Limiter {
    /// The switches that apply to every rule of `domain` (named `name`).
    pub(super) fn modes(&self, domain: &Domain, name: &str) -> Modes {
        let debit = domain.debit
            || self
                .options
                .debit_domains
                .iter()
                .any(|d| d == "*" || d == name);
        Modes {
            quota_all: self.options.global_quota_mode,
            debit,
        }
    }
}

/// Matches every descriptor and turns the ones that need the store into check items.
pub(super) fn plan<'a>(request: &'a Request, root: &'a Node, modes: Modes) -> Planned<'a> {
    // First every descriptor's rule, so that `replaces` can see all of them.
    let found: Vec<Found<'_>> = request
        .descriptors
        .iter()
        .map(|descriptor| find(descriptor, root))
        .collect();
    let replaced = replaced_names(&found);
    let request_hits = u64::from(request.hits_addend.max(1));
    let mut planned = Planned {
        plans: Vec::with_capacity(request.descriptors.len()),
        items: Vec::with_capacity(request.descriptors.len()),
    };
    for (descriptor, found) in request.descriptors.iter().zip(found) {
        let hits = descriptor.hits_addend.unwrap_or(request_hits);
        let plan = match found {
            Found::Nothing => Plan::NoLimit,
            Found::Override(window) => {
                planned.push_override(&request.domain, descriptor, window, hits, modes)
            }
            Found::Rule(m) if replaced.iter().any(|name| m.rule.is_named(name)) => Plan::NoLimit,
            Found::Rule(m) => planned.push_rule(&request.domain, m, hits, modes),
        };
        planned.plans.push(plan);
    }
    planned
}

/// The rule `descriptor` finds: its own limit if it carries one, else the rule its entries
/// match ([`Node::find`]).
fn find<'a>(descriptor: &'a Descriptor, root: &'a Node) -> Found<'a> {
    match descriptor.limit {
        Some(over) => match Unit::from_proto(over.unit) {
            Some(unit) => Found::Override(Window::per_unit(over.requests_per_unit, unit, None)),
            // `validate` rejected unknown units already.
            None => Found::Nothing,
        },
        None => root
            .find(&descriptor.entries)
            .map_or(Found::Nothing, Found::Rule),
    }
}

/// The names every matched rule `replaces`: a rule so named is taken out of the decision (OK
/// without a limit, its log untouched).
fn replaced_names<'a>(found: &[Found<'a>]) -> HashSet<&'a str> {
    found
        .iter()
        .filter_map(|f| match f {
            Found::Rule(m) => Some(m.rule.replaces.iter().map(|n| &**n)),
            _ => None,
        })
        .flatten()
        .collect()
}

impl<'a> Planned<'a> {
    /// Adds the store item of a descriptor that carries its own limit, keyed by every entry's
    /// value.
    fn push_override(
        &mut self,
        domain: &str,
        descriptor: &'a Descriptor,
        window: Window,
        hits: u64,
        modes: Modes,
    ) -> Plan<'a> {
        let segments = value_segments(descriptor);
        let variant = Variant::Override {
            window_ms: window.length_ms,
        };
        self.items.push(CheckItem {
            key: key::build(domain, &segments, variant, None),
            windows: Cow::Owned(vec![window.counted()]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits,
            role: Role::Enforce,
            debit: modes.debit,
            text: None,
        });
        Plan::Check {
            item: self.items.len() - 1,
            rule: None,
            windows: Cow::Owned(vec![window]),
            segments,
        }
    }

    /// Adds the store item of a descriptor that matched a rule, unless the rule is `unlimited`.
    fn push_rule(&mut self, domain: &str, m: Match<'a>, hits: u64, modes: Modes) -> Plan<'a> {
        let rule = m.rule;
        let Limit::Windows {
            windows,
            counted,
            ban_ms,
            algorithm,
            text,
        } = &rule.limit
        else {
            return Plan::Unlimited(rule);
        };
        self.items.push(CheckItem {
            key: key::build(
                domain,
                &m.segments,
                Variant::Configured,
                rule.tag_by.as_deref(),
            ),
            windows: Cow::Borrowed(counted),
            algorithm: *algorithm,
            ban_ms: *ban_ms,
            hits,
            role: if rule.shadow_mode {
                Role::Shadow
            } else if rule.quota_mode || modes.quota_all {
                Role::Quota
            } else {
                Role::Enforce
            },
            debit: rule.debit || modes.debit,
            text: Some(text),
        });
        Plan::Check {
            item: self.items.len() - 1,
            rule: Some(rule),
            windows: Cow::Borrowed(windows),
            segments: m.segments,
        }
    }

    /// The configured windows of request descriptor `n`, if it was checked.
    pub(super) fn windows_of(&self, n: usize) -> Option<&[Window]> {
        match self.plans.get(n) {
            Some(Plan::Check { windows, .. }) => Some(windows),
            _ => None,
        }
    }

    /// The rules of the checked descriptors whose status is OK, in request order (the
    /// reference's "passed descriptors": an unlimited one is not among them).
    pub(super) fn passed_rules(&self, statuses: &[Status]) -> Vec<&'a Arc<Rule>> {
        self.plans
            .iter()
            .zip(statuses)
            .filter_map(|(p, status)| match p {
                Plan::Check {
                    rule: Some(rule), ..
                } if status.code == Code::Ok => Some(*rule),
                _ => None,
            })
            .collect()
    }
}

/// A descriptor's entries as the key of a caller's own limit: every entry by its value.
fn value_segments(descriptor: &Descriptor) -> Vec<Segment<'_>> {
    descriptor
        .entries
        .iter()
        .map(|(key, value)| Segment::Value { key, value })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{CONFIG, decide, limiter, req};
    use super::super::{LimiterError, LimiterOptions, Override};
    use super::*;

    #[test]
    fn key_only_rules_count_per_concrete_value() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        for _ in 0..3 {
            decide(&l, &req(&[&[("ip", "a")]]));
        }
        assert_eq!(decide(&l, &req(&[&[("ip", "a")]])).overall, Code::OverLimit);
        assert_eq!(decide(&l, &req(&[&[("ip", "b")]])).overall, Code::Ok);
    }

    #[test]
    fn request_hits_zero_counts_as_one_and_descriptor_hits_win() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        let mut r = req(&[&[("ip", "h")]]);
        assert_eq!(decide(&l, &r).statuses[0].limit_remaining, 2);
        r.hits_addend = 2;
        assert_eq!(decide(&l, &r).statuses[0].limit_remaining, 0);
        r.descriptors[0].hits_addend = Some(0);
        let d = decide(&l, &r);
        assert_eq!((d.overall, d.statuses[0].limit_remaining), (Code::Ok, 0));
    }

    #[test]
    fn overrides_with_unknown_units_are_invalid() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        let mut r = req(&[&[("ip", "o")]]);
        r.descriptors[0].limit = Some(Override {
            requests_per_unit: 1,
            unit: 0,
        });
        let err = futures_util::FutureExt::now_or_never(l.should_rate_limit(&r)).expect("ready");
        assert!(matches!(err, Err(LimiterError::InvalidRequest(m)) if m.contains("limit.unit")));
        r.descriptors[0].limit = Some(Override {
            requests_per_unit: 1,
            unit: 99,
        });
        assert!(
            futures_util::FutureExt::now_or_never(l.should_rate_limit(&r))
                .expect("ready")
                .is_err()
        );
    }

    /// Debits come from the rule, the domain's file, or `--debit-domains`: each makes a call
    /// that crosses the budget count, so the next check fails.
    #[test]
    fn debits_by_rule_domain_or_option() {
        let budget = "domain: d\ndescriptors:\n  - key: ip\n    rate_limit: {requests_per_unit: 3, window: 90s}\n";
        let crossing = |yaml: &str, options: LimiterOptions| {
            let (l, _) = limiter(yaml, options);
            let mut r = req(&[&[("ip", "x")]]);
            r.descriptors[0].hits_addend = Some(5);
            decide(&l, &r);
            r.descriptors[0].hits_addend = Some(0);
            decide(&l, &r).overall
        };
        assert_eq!(
            crossing(budget, LimiterOptions::default()),
            Code::Ok,
            "no debit: not charged"
        );
        let rule = budget.replace("    rate_limit:", "    debit: true\n    rate_limit:");
        assert_eq!(crossing(&rule, LimiterOptions::default()), Code::OverLimit);
        let file = budget.replace("domain: d\n", "domain: d\ndebit: true\n");
        assert_eq!(crossing(&file, LimiterOptions::default()), Code::OverLimit);
        for domains in [vec!["d".to_string()], vec!["*".to_string()]] {
            let options = LimiterOptions {
                debit_domains: domains,
                ..LimiterOptions::default()
            };
            assert_eq!(crossing(budget, options), Code::OverLimit);
        }
        let other = LimiterOptions {
            debit_domains: vec!["e".to_string()],
            ..LimiterOptions::default()
        };
        assert_eq!(crossing(budget, other), Code::Ok);
    }
}
