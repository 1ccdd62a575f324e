//! Answering a request: each descriptor's status from the store's outcome (the binding window,
//! a ban, a shadow rule's OK), the overall code and global shadow mode, resets in whole seconds,
//! the response headers, and the metadata of the rules that passed. The observer and the
//! decision log are told from here too ([`super::report`]), as the statuses are made.

use std::sync::Arc;

use super::engine::Limiter;
use super::headers;
use super::plan::{Plan, Planned};
use super::rules::{Rule, Window};
use super::{Code, Decision, ReportedLimit, Request, RuleMetadata, Status, why};
use crate::store::{CheckOutcome, ItemOutcome};

impl Limiter {
    /// Shapes the answer from the store's outcome, and tells the observer and the decision log
    /// about each checked descriptor.
    pub(super) fn respond(
        &self,
        request: &Request,
        planned: &Planned<'_>,
        outcome: &CheckOutcome,
        cached: &[bool],
        loud: bool,
    ) -> Decision {
        let overall = if outcome.admitted {
            Code::Ok
        } else {
            Code::OverLimit
        };
        let statuses: Vec<Status> = planned
            .plans
            .iter()
            .map(|plan| status_of_plan(plan, outcome))
            .collect();
        self.observe_descriptors(request, planned, outcome, cached);
        if why::wanted(loud) {
            self.tell_why(request, planned, outcome, cached, &statuses, loud);
        }
        // When global shadow mode turns a rejection into OK the client is not limited, so it
        // gets no Retry-After and no zero-remaining RateLimit either.
        let mut headers = Vec::new();
        if self.options.response_headers && !self.shadowed(overall) {
            headers = headers::build(&statuses, |n| planned.windows_of(n), overall);
        }
        if let Some(names) = &self.options.limit_headers
            && !self.shadowed(overall)
        {
            headers.extend(headers::reference(&statuses, names));
        }
        if self.shadowed(overall) {
            self.observer.global_shadow();
        }
        let passed = |statuses: &[Status]| planned.passed_rules(statuses);
        self.finish(statuses, overall, headers, passed)
    }

    /// Whether global shadow mode turns this overall code into OK.
    fn shadowed(&self, overall: Code) -> bool {
        self.options.global_shadow_mode && overall == Code::OverLimit
    }

    /// The decision as the caller gets it: overall OK under global shadow mode, resets in whole
    /// seconds if asked for, and the passed rules' metadata if dynamic metadata is on.
    pub(super) fn finish<'r>(
        &self,
        statuses: Vec<Status>,
        overall: Code,
        response_headers: Vec<(String, String)>,
        // The rules of the descriptors that passed, whose metadata the response carries; asked
        // for only when dynamic metadata is on, so other calls build no list of rules.
        rules: impl FnOnce(&[Status]) -> Vec<&'r Arc<Rule>>,
    ) -> Decision {
        let overall = if self.options.global_shadow_mode {
            Code::Ok
        } else {
            overall
        };
        let mut statuses = statuses;
        if self.options.whole_second_resets {
            for status in &mut statuses {
                // Never earlier than the true reset.
                status.duration_until_reset_ms = status
                    .duration_until_reset_ms
                    .map(|ms| ms.div_ceil(1000).saturating_mul(1000));
            }
        }
        let dynamic_metadata = self
            .options
            .dynamic_metadata
            .then(|| rule_metadata(&rules(&statuses)));
        Decision {
            overall,
            statuses,
            response_headers,
            dynamic_metadata,
        }
    }
}

/// The status of one request descriptor, by what it was planned to be.
fn status_of_plan(plan: &Plan<'_>, outcome: &CheckOutcome) -> Status {
    match plan {
        Plan::NoLimit => Status::unlimited_by_config(),
        Plan::Unlimited(_) => Status {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: u32::MAX,
            duration_until_reset_ms: None,
        },
        Plan::Check {
            item,
            rule,
            windows,
            ..
        } => {
            let shadow = rule.is_some_and(|r| r.shadow_mode);
            match outcome.items.get(*item) {
                Some(found) => status_of(windows, found, shadow),
                None => Status::unlimited_by_config(),
            }
        }
    }
}

/// The status of one checked descriptor.
fn status_of(windows: &[Window], outcome: &ItemOutcome, shadow: bool) -> Status {
    let over_code = if shadow { Code::Ok } else { Code::OverLimit };
    let reported = |w: &Window| ReportedLimit {
        name: w.name.clone(),
        requests_per_unit: w.limit,
        unit: w.unit,
        window_ms: w.length_ms,
    };
    if outcome.ban_remaining_ms > 0 {
        return Status {
            code: over_code,
            current_limit: windows.first().map(reported),
            limit_remaining: 0,
            duration_until_reset_ms: Some(outcome.ban_remaining_ms),
        };
    }
    let pairs = windows.iter().zip(&outcome.windows);
    if outcome.fits {
        // Binding window: the least remaining; on a tie, the first in the rule.
        let binding = pairs.min_by_key(|(w, o)| u64::from(w.limit).saturating_sub(o.count));
        match binding {
            Some((w, o)) => Status {
                code: Code::Ok,
                current_limit: Some(reported(w)),
                limit_remaining: clamp_u32(u64::from(w.limit).saturating_sub(o.count)),
                duration_until_reset_ms: Some(o.reset_ms),
            },
            None => Status::unlimited_by_config(),
        }
    } else {
        // Binding window: the one that makes the caller wait longest. (No window outcomes:
        // the store failed and the policy denies; report the rule's first window.)
        let binding = pairs.rev().max_by_key(|(_, o)| o.reset_ms);
        Status {
            code: over_code,
            current_limit: binding.map(|(w, _)| w).or(windows.first()).map(reported),
            limit_remaining: 0,
            duration_until_reset_ms: binding.map(|(_, o)| o.reset_ms),
        }
    }
}

/// `n`, or `u32::MAX` where it does not fit.
fn clamp_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The `metadata` of the rules of the descriptors that passed, merged as the reference merges
/// it: objects under one key merge, field by field; otherwise the first value wins.
fn rule_metadata(rules: &[&Arc<Rule>]) -> RuleMetadata {
    let mut merged = serde_json::Map::new();
    for rule in rules {
        if let Some(serde_json::Value::Object(fields)) = &rule.metadata {
            merge_metadata(&mut merged, fields);
        }
    }
    RuleMetadata(merged)
}

/// Merges `from` into `into`: objects under one key field by field, otherwise `into`'s value
/// stays.
fn merge_metadata(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(serde_json::Value::Object(had)), serde_json::Value::Object(more)) => {
                merge_metadata(had, more);
            }
            (Some(_), _) => {}
            (None, _) => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{CONFIG, decide, limiter, req};
    use super::super::{LimiterOptions, Unit};
    use super::*;

    #[test]
    fn status_reports_the_binding_window() {
        let (l, clock) = limiter(CONFIG, LimiterOptions::default());
        let first = decide(&l, &req(&[&[("user", "u")]]));
        // 2/s leaves 1, 5/min leaves 4: the per-second window binds.
        let s = &first.statuses[0];
        assert_eq!(s.limit_remaining, 1);
        assert_eq!(
            s.current_limit.as_ref().and_then(|c| c.name.as_deref()),
            Some("per_second")
        );
        assert_eq!(s.duration_until_reset_ms, Some(1_000));
        for _ in 0..3 {
            clock.advance(1_000);
            decide(&l, &req(&[&[("user", "u")]]));
        }
        // Four in the minute: 1 left there, and 1 left this second: tie goes to the first window.
        clock.advance(1_000);
        let s = decide(&l, &req(&[&[("user", "u")]])).statuses.remove(0);
        assert_eq!(s.code, Code::Ok);
        assert_eq!(s.limit_remaining, 0);
        assert_eq!(
            s.current_limit.as_ref().and_then(|c| c.name.as_deref()),
            Some("per_minute")
        );
        clock.advance(1_000);
        let s = decide(&l, &req(&[&[("user", "u")]])).statuses.remove(0);
        assert_eq!(s.code, Code::OverLimit);
        assert_eq!(
            s.current_limit.as_ref().and_then(|c| c.name.as_deref()),
            Some("per_minute")
        );
        // The oldest of the minute's five entries (at T0) leaves at T0 + 60 s; now is T0 + 5 s.
        assert_eq!(s.duration_until_reset_ms, Some(55_000));
        assert_eq!(
            s.current_limit
                .map(|c| (c.requests_per_unit, c.unit, c.window_ms)),
            Some((5, Unit::Minute, 60_000))
        );
    }

    #[test]
    fn arbitrary_windows_report_the_nearest_unit() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        let s = decide(&l, &req(&[&[("ip", "x")]])).statuses.remove(0);
        let limit = s.current_limit.expect("limited");
        assert_eq!(
            (limit.requests_per_unit, limit.unit, limit.window_ms),
            (3, Unit::Minute, 90_000)
        );
        assert_eq!(s.duration_until_reset_ms, Some(90_000));
    }

    #[test]
    fn dynamic_metadata_carries_the_matched_rules_metadata() {
        let options = LimiterOptions {
            dynamic_metadata: true,
            ..LimiterOptions::default()
        };
        let (l, _) = limiter(CONFIG, options);
        let d = decide(&l, &req(&[&[("ip", "m")], &[("nothing", "x")]]));
        let meta = d.dynamic_metadata.expect("switched on");
        assert_eq!(
            serde_json::Value::Object(meta.0),
            serde_json::json!({"team": "edge"})
        );
        let (off, _) = limiter(CONFIG, LimiterOptions::default());
        assert_eq!(decide(&off, &req(&[&[("ip", "m")]])).dynamic_metadata, None);
    }

    /// As the reference's `ratelimitToMetadata`: only descriptors that passed give their
    /// rule's metadata; objects under one key merge, otherwise the first value wins.
    #[test]
    fn dynamic_metadata_merges_the_rules_of_descriptors_that_passed() {
        let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 5}\n    metadata: {team: edge, tier: {a: 1}}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n    metadata: {team: core, tier: {b: 2}}\n  - key: c\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {over: yes}\n";
        let options = LimiterOptions {
            dynamic_metadata: true,
            ..LimiterOptions::default()
        };
        let (l, _) = limiter(yaml, options);
        decide(&l, &req(&[&[("c", "x")]]));
        let d = decide(&l, &req(&[&[("a", "x")], &[("b", "x")], &[("c", "x")]]));
        assert_eq!(d.statuses[2].code, Code::OverLimit);
        let meta = d.dynamic_metadata.expect("switched on");
        assert_eq!(
            serde_json::Value::Object(meta.0),
            serde_json::json!({"team": "edge", "tier": {"a": 1, "b": 2}})
        );
    }

    /// In the reference's form a reset is whole seconds, rounded up: never earlier than the
    /// true one.
    #[test]
    fn whole_second_resets_round_up() {
        let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 2, window: 2500ms}\n";
        let exact = |whole_second_resets| {
            let options = LimiterOptions {
                whole_second_resets,
                ..LimiterOptions::default()
            };
            let (l, clock) = limiter(yaml, options);
            decide(&l, &req(&[&[("k", "a")]]));
            clock.advance(300);
            decide(&l, &req(&[&[("k", "a")]])).statuses[0].duration_until_reset_ms
        };
        assert_eq!(exact(false), Some(2_200));
        assert_eq!(exact(true), Some(3_000));
    }

    #[test]
    fn global_shadow_mode_sends_no_limit_headers_on_answers_it_let_through() {
        let options = LimiterOptions {
            global_shadow_mode: true,
            response_headers: true,
            ..LimiterOptions::default()
        };
        let (l, _) = limiter(CONFIG, options);
        let first = decide(&l, &req(&[&[("ip", "s")]]));
        assert!(
            first.response_headers.iter().any(|(k, _)| k == "RateLimit"),
            "admitted answers keep their headers: {:?}",
            first.response_headers
        );
        for _ in 0..2 {
            decide(&l, &req(&[&[("ip", "s")]]));
        }
        let shadowed = decide(&l, &req(&[&[("ip", "s")]]));
        assert_eq!(shadowed.overall, Code::Ok);
        assert_eq!(shadowed.statuses[0].code, Code::OverLimit);
        assert!(
            shadowed.response_headers.is_empty(),
            "no Retry-After or zero-remaining RateLimit on an answer turned OK: {:?}",
            shadowed.response_headers
        );
    }
}
