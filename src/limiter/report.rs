//! What a decision tells beside its answer: the observer (metrics) how each checked
//! descriptor's hits count, the decision log its lines ([`super::why`]), and a trace's span the
//! overall code, the rules that matched and whether the over-limit cache answered.

use super::engine::Limiter;
use super::plan::{Plan, Planned};
use super::rules::{Rule, Segment};
use super::{DescriptorReport, Request, Status, why};
use crate::store::{CheckItem, CheckOutcome, ItemOutcome};

impl Limiter {
    /// What a trace's span says of the decision (only built for a span being recorded).
    pub(super) fn describe_span(
        &self,
        span: &tracing::Span,
        request: &Request,
        planned: &Planned<'_>,
        outcome: &CheckOutcome,
        cached: &[bool],
    ) {
        let code = if outcome.admitted { "OK" } else { "OVER_LIMIT" };
        let rules: Vec<&str> = planned
            .plans
            .iter()
            .filter_map(|plan| match plan {
                Plan::Check {
                    rule: Some(rule), ..
                }
                | Plan::Unlimited(rule) => Some(rule.path.as_str()),
                _ => None,
            })
            .collect();
        span.record("code", code);
        span.record("rules", rules.join(",").as_str());
        span.record("cached", cached.iter().any(|c| *c));
        if self.options.span_descriptor_values {
            let entries: Vec<String> = request
                .descriptors
                .iter()
                .map(|d| {
                    let pairs: Vec<String> =
                        d.entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    pairs.join(",")
                })
                .collect();
            span.record("entries", entries.join(";").as_str());
        }
    }

    /// Tells the observer how each checked descriptor's hits count ([`descriptor_report`]).
    pub(super) fn observe_descriptors(
        &self,
        request: &Request,
        planned: &Planned<'_>,
        outcome: &CheckOutcome,
        cached: &[bool],
    ) {
        for plan in &planned.plans {
            if let Plan::Check {
                item,
                rule,
                segments,
                ..
            } = plan
                && let Some(found) = outcome.items.get(*item)
            {
                let from_cache = cached.get(*item).copied().unwrap_or(false);
                let report = descriptor_report(
                    &request.domain,
                    rule.map(|r| &**r),
                    segments,
                    &planned.items[*item],
                    found,
                    from_cache,
                    self.options.near_limit_ratio,
                );
                self.observer.descriptor(&report);
            }
        }
    }

    /// The decision log's lines, one per checked descriptor ([`why`]).
    pub(super) fn tell_why(
        &self,
        request: &Request,
        planned: &Planned<'_>,
        outcome: &CheckOutcome,
        cached: &[bool],
        statuses: &[Status],
        loud: bool,
    ) {
        let trace_id = crate::traces::current_trace_id();
        for (index, (plan, status)) in planned.plans.iter().zip(statuses).enumerate() {
            if let Plan::Check { item, rule, .. } = plan
                && let (Some(found), Some(descriptor)) =
                    (outcome.items.get(*item), request.descriptors.get(index))
            {
                why::Why {
                    domain: &request.domain,
                    index,
                    descriptor,
                    rule: rule.map(|r| &**r),
                    item: &planned.items[*item],
                    outcome: found,
                    code: status.code,
                    from_cache: cached.get(*item).copied().unwrap_or(false),
                    trace_id: trace_id.as_deref(),
                }
                .log(loud, self.options.log_descriptor_values);
            }
        }
    }
}

/// How one checked descriptor's hits count in metrics: what it adds to the per-rule counters
/// ([`DescriptorReport`]), counted as the reference's `base_limiter.go` counts them: every
/// admitted hit is `within_limit`, and those of them past the near-limit ratio also
/// `near_limit`; of a descriptor over its limit, the hits past the limit are `over_limit` (all of
/// them when the window was already full) and those between the near-limit ratio and the limit
/// `near_limit`; `shadow_mode` counts the over-limit hits of a shadow rule; the over-limit
/// cache's answers are over the limit in full. The window that binds is the one with the least
/// room (admitted) or the most hits past its limit (over). A descriptor whose hits were not
/// recorded because another rejected the request counts where its hits would have landed, as
/// the reference's counter does.
fn descriptor_report<'a>(
    domain: &'a str,
    rule: Option<&'a Rule>,
    segments: &'a [Segment<'a>],
    item: &CheckItem<'_>,
    outcome: &ItemOutcome,
    from_cache: bool,
    near_ratio: f64,
) -> DescriptorReport<'a> {
    let hits = item.hits;
    let mut report = DescriptorReport {
        domain,
        rule,
        segments,
        hits,
        within: 0,
        near: 0,
        over: 0,
        shadow: 0,
        ban_set: outcome.ban_set,
        from_cache,
    };
    // Each window's count before and after this request's hits.
    let recorded = outcome.recorded;
    let counts = item.windows.iter().zip(&outcome.windows).map(|(w, o)| {
        let before = if recorded {
            o.count.saturating_sub(hits)
        } else {
            o.count
        };
        (w, before, before + hits)
    });
    if !outcome.fits {
        let limit = |w: &crate::store::Window| u64::from(w.limit);
        let binding = counts
            .filter(|&(w, _, after)| after > limit(w))
            .max_by_key(|&(w, _, after)| after - limit(w));
        let (over, near) = match binding {
            // Banned, answered from the over-limit cache, or already full: every hit is over.
            Some((w, before, after)) if !from_cache && before < limit(w) => {
                let threshold = near_threshold(w.limit, near_ratio);
                (after - limit(w), limit(w) - before.max(threshold))
            }
            _ => (hits, 0),
        };
        report.over = over;
        report.near = near;
        if rule.is_some_and(|r| r.shadow_mode) {
            report.shadow = over;
        }
        return report;
    }
    let binding = counts.min_by_key(|&(w, _, after)| u64::from(w.limit).saturating_sub(after));
    report.within = hits;
    report.near = binding.map_or(0, |(w, before, after)| {
        let threshold = near_threshold(w.limit, near_ratio);
        after.saturating_sub(before.max(threshold)).min(hits)
    });
    report
}

/// Hits above this count of a window are "near" its limit.
fn near_threshold(limit: u32, ratio: f64) -> u64 {
    // `ratio` is in [0, 1] (the flag is checked), so the product is in [0, limit] and fits.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let threshold = (f64::from(limit) * ratio.clamp(0.0, 1.0)).floor() as u64;
    threshold
}
