//! The decision for one request: validate, match, ask the store, and shape the statuses.
//!
//! [`Limiter::should_rate_limit`] is the one request path: gRPC and `POST /json` both call it, and
//! it reports every call to the [`Observer`] (metrics), so no transport times or counts calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use tracing::Instrument as _;

use super::bounds::RequestBounds;
use super::cache::OverLimitCache;
use super::clock::Stopwatch;
use super::headers::{self, LimitHeaderNames};
use super::observe::{CallResult, DescriptorReport, NoObserver, Observer};
use super::plan::{Plan, Planned, plan};
pub use super::rules::FailurePolicy;
use super::rules::{Limits, Rule, Segment, Window};
use super::why;
use super::{Clock, Code, Decision, LimiterError, ReportedLimit, Request, RuleMetadata, Status};
use crate::store::{CheckItem, CheckOutcome, ItemOutcome, Store};

/// Switches that change answers for every domain.
#[derive(Clone, Debug, PartialEq)]
pub struct LimiterOptions {
    /// Fraction of a limit above which admitted hits count as "near limit" in metrics.
    pub near_limit_ratio: f64,
    pub failure_policy: FailurePolicy,
    /// Answer OK overall whatever the statuses say (statuses are unchanged).
    pub global_shadow_mode: bool,
    /// Add `RateLimit-Policy`, `RateLimit` and, when over, `Retry-After` to the response.
    pub response_headers: bool,
    /// Return the matched rules' `metadata` for the response's `dynamic_metadata`.
    pub dynamic_metadata: bool,
    /// Round each status's time until reset up to whole seconds, as the reference sends it.
    pub whole_second_resets: bool,
    /// Every rule counts as a `quota_mode` rule (the reference's `QUOTA_MODE`).
    pub global_quota_mode: bool,
    /// The reference's three headers (`LIMIT_RESPONSE_HEADERS_ENABLED`), under these names.
    pub limit_headers: Option<LimitHeaderNames>,
    /// Domains whose rules all take debits (usage recorded even when it crosses the limit),
    /// for configs that cannot say so themselves; `*` is every domain.
    pub debit_domains: Vec<String>,
    /// What one request may ask for.
    pub bounds: RequestBounds,
    /// Descriptors the exact local over-limit cache holds at most (0: off); see
    /// [`super::cache`].
    pub over_limit_cache: usize,
    /// The decision log shows descriptor entries' values as they came, not hashed
    /// ([`super::why`]).
    pub log_descriptor_values: bool,
    /// Trace spans carry the descriptors' entries with their values (`--tracing-descriptor-values`).
    pub span_descriptor_values: bool,
    /// The longest the over-limit cache answers for a descriptor before asking the store
    /// again (`None`: until its reset). Set while the admin API is on, so that a reset taken
    /// by one replica reaches every replica's cache within it.
    pub over_limit_cache_hold_ms: Option<u64>,
}

/// The over-limit cache's default bound (about 200 bytes each).
pub const DEFAULT_OVER_LIMIT_CACHE: usize = 65_536;

impl Default for LimiterOptions {
    fn default() -> Self {
        LimiterOptions {
            near_limit_ratio: 0.8,
            failure_policy: FailurePolicy::default(),
            global_shadow_mode: false,
            response_headers: false,
            dynamic_metadata: false,
            whole_second_resets: false,
            global_quota_mode: false,
            limit_headers: None,
            debit_domains: Vec::new(),
            bounds: RequestBounds::default(),
            over_limit_cache: DEFAULT_OVER_LIMIT_CACHE,
            log_descriptor_values: false,
            span_descriptor_values: false,
            over_limit_cache_hold_ms: None,
        }
    }
}

/// Decides requests against the current limits and a store.
pub struct Limiter {
    pub(super) limits: ArcSwap<Limits>,
    pub(super) store: Arc<dyn Store>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) options: LimiterOptions,
    pub(super) observer: Arc<dyn Observer>,
    pub(super) store_errors: AtomicU64,
    /// When a store error was last logged: failures are logged once per burst, not per call.
    pub(super) last_error_log_ms: AtomicU64,
    /// The store's data losses seen so far, and when the last was first seen (ms): domains
    /// with `store_reset: closed` answer by their policy for a window from then.
    pub(super) losses_seen: AtomicU64,
    pub(super) lost_at_ms: AtomicU64,
    /// Descriptors known to be over, answered without the store.
    pub(super) cache: OverLimitCache,
}

impl Limiter {
    pub fn new(
        limits: Limits,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        options: LimiterOptions,
    ) -> Limiter {
        Limiter {
            limits: ArcSwap::from_pointee(limits),
            store,
            clock,
            cache: OverLimitCache::new(options.over_limit_cache, options.over_limit_cache_hold_ms),
            options,
            observer: Arc::new(NoObserver),
            store_errors: AtomicU64::new(0),
            last_error_log_ms: AtomicU64::new(0),
            losses_seen: AtomicU64::new(0),
            lost_at_ms: AtomicU64::new(0),
        }
    }

    /// Reports every call and decision to `observer` (metrics).
    pub fn with_observer(mut self, observer: Arc<dyn Observer>) -> Limiter {
        self.observer = observer;
        prepare(&self.limits.load(), &*self.observer);
        self
    }

    /// Replaces the limits at once: a request sees either the old or the new set, never a mix.
    pub fn replace_limits(&self, limits: Limits) {
        prepare(&limits, &*self.observer);
        self.limits.store(Arc::new(limits));
        // What was over under the old rules says nothing about the new ones.
        self.cache.clear();
    }

    /// Descriptors the over-limit cache holds now.
    pub fn over_limit_cached(&self) -> usize {
        self.cache.len()
    }

    pub fn limits(&self) -> Arc<Limits> {
        self.limits.load_full()
    }

    pub fn store_name(&self) -> &'static str {
        self.store.name()
    }

    /// Descriptors holding state in the store, where it counts them (the embedded store).
    pub fn store_keys(&self) -> Option<u64> {
        self.store.live_keys()
    }

    /// How many times the store lost its data (see `Store::data_losses`).
    pub fn store_data_losses(&self) -> Option<u64> {
        self.store.data_losses()
    }

    /// The store's evicting memory policy, if it has one (see `Store::evicting`).
    pub fn store_evicting(&self) -> Option<String> {
        self.store.evicting()
    }

    /// Parts of the store that did not answer (see `Store::silent`).
    pub fn store_silent(&self) -> Vec<String> {
        self.store.silent()
    }

    /// Requests a Redis Cluster master refused and the store sent again (see `Store::resent`).
    pub fn store_resent(&self) -> Option<u64> {
        self.store.resent()
    }

    /// Whether the store can still recover by itself (see `Store::alive`).
    pub fn store_alive(&self) -> bool {
        self.store.alive()
    }

    /// Whether the store answers now.
    pub async fn store_ready(&self) -> bool {
        self.store.ready().await
    }

    /// Store failures since start, whatever the failure policy answered.
    pub fn store_errors(&self) -> u64 {
        self.store_errors.load(Ordering::Relaxed)
    }

    /// Decides one request, and tells the observer how the call ended and how long it took.
    /// Logged as a debug-level span with the domain, descriptor count, result and latency.
    /// As a trace's span (`--tracing`) it also carries the overall code, the rules that
    /// matched, the store and whether the over-limit cache answered. With traces on, the span
    /// is made only for a call that is sampled (or when the log shows debug spans).
    pub async fn should_rate_limit(&self, request: &Request) -> Result<Decision, LimiterError> {
        let span = if crate::traces::spans_wanted() {
            tracing::debug_span!(
                "should_rate_limit",
                otel.name = "ShouldRateLimit",
                otel.kind = "server",
                domain = %request.domain,
                descriptors = request.descriptors.len(),
                store = self.store.name(),
                decision = tracing::field::Empty,
                latency_us = tracing::field::Empty,
                code = tracing::field::Empty,
                rules = tracing::field::Empty,
                cached = tracing::field::Empty,
                entries = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        if span.is_disabled() {
            self.decide_and_tell(request, &span).await
        } else {
            self.decide_and_tell(request, &span)
                .instrument(span.clone())
                .await
        }
    }

    /// [`Limiter::should_rate_limit`] inside its span.
    async fn decide_and_tell(
        &self,
        request: &Request,
        span: &tracing::Span,
    ) -> Result<Decision, LimiterError> {
        let started = Stopwatch::start();
        let result = self.decide(request, span).await;
        let elapsed = started.elapsed();
        let call = match &result {
            Ok(d) if d.overall == Code::Ok => CallResult::Ok,
            Ok(_) => CallResult::OverLimit,
            Err(LimiterError::InvalidRequest(_)) => CallResult::Invalid,
            Err(LimiterError::Store(_)) => CallResult::StoreError,
        };
        self.observer.call(call, elapsed);
        span.record("decision", tracing::field::debug(call));
        span.record(
            "latency_us",
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
        );
        tracing::debug!("decided");
        result
    }

    async fn decide(
        &self,
        request: &Request,
        span: &tracing::Span,
    ) -> Result<Decision, LimiterError> {
        self.options.bounds.validate(request)?;
        let limits = self.limits.load_full();
        let now_ms = self.clock.now_ms();
        let Some(domain) = limits.domain(&request.domain) else {
            self.observer.unknown_domain();
            let statuses = vec![Status::unlimited_by_config(); request.descriptors.len()];
            return Ok(self.finish(statuses, Code::Ok, Vec::new(), |_| Vec::new()));
        };
        let planned = plan(request, &domain.root, self.modes(domain, &request.domain));
        let (outcome, cached) = self.store_outcome(domain, &planned.items, now_ms).await?;
        if !span.is_disabled() {
            self.describe_span(span, request, &planned, &outcome, &cached);
        }
        Ok(self.respond(request, &planned, &outcome, &cached, domain.log_decisions))
    }

    /// What a trace's span says of the decision (only built for a span being recorded).
    fn describe_span(
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

    /// Shapes the answer from the store's outcome and reports each checked descriptor.
    fn respond(
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
        self.report(request, planned, outcome, cached);
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

    fn report(
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
                let report = report(
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
    fn tell_why(
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

    fn finish<'r>(
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

/// Fills every rule's observer slot with what `observer` keeps there.
fn prepare(limits: &Limits, observer: &dyn Observer) {
    for (_, rule) in limits.rules() {
        if let Some(counts) = observer.rule_counts(rule) {
            rule.observer_slot.fill(counts);
        }
    }
}

/// How one checked descriptor's hits count in metrics (see [`DescriptorReport`]).
/// What one checked descriptor adds to the per-rule counters, counted as the reference's
/// `base_limiter.go` counts them: every admitted hit is `within_limit`, and those of them past
/// the near-limit ratio also `near_limit`; of a descriptor over its limit, the hits past the
/// limit are `over_limit` (all of them when the window was already full) and those between the
/// near-limit ratio and the limit `near_limit`; `shadow_mode` counts the over-limit hits of a
/// shadow rule; the over-limit cache's answers are over the limit in full. The window that
/// binds is the one with the least room (admitted) or the most hits past its limit (over). A
/// descriptor whose hits were not recorded because another rejected the request counts where
/// its hits would have landed, as the reference's counter does.
fn report<'a>(
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

/// The status of one checked descriptor.
fn status_of(windows: &[Window], outcome: &ItemOutcome, shadow: bool) -> Status {
    let over_code = if shadow { Code::Ok } else { Code::OverLimit };
    let report = |w: &Window| ReportedLimit {
        name: w.name.clone(),
        requests_per_unit: w.limit,
        unit: w.unit,
        window_ms: w.length_ms,
    };
    if outcome.ban_remaining_ms > 0 {
        return Status {
            code: over_code,
            current_limit: windows.first().map(report),
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
                current_limit: Some(report(w)),
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
            current_limit: binding.map(|(w, _)| w).or(windows.first()).map(report),
            limit_remaining: 0,
            duration_until_reset_ms: binding.map(|(_, o)| o.reset_ms),
        }
    }
}

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
    use super::*;
    use crate::limiter::Unit;

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

    #[test]
    fn reloaded_limits_apply_to_existing_logs() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        for _ in 0..3 {
            decide(&l, &req(&[&[("ip", "r")]]));
        }
        assert_eq!(decide(&l, &req(&[&[("ip", "r")]])).overall, Code::OverLimit);
        let raised = CONFIG.replace(
            "requests_per_unit: 3, window: 90s",
            "requests_per_unit: 10, window: 90s",
        );
        l.replace_limits(
            crate::config::compile_sources(&[("t.yaml".into(), raised)]).expect("valid"),
        );
        let d = decide(&l, &req(&[&[("ip", "r")]]));
        assert_eq!(
            (d.overall, d.statuses[0].limit_remaining),
            (Code::Ok, 6),
            "raising a limit unblocks at once"
        );
    }

    /// An observer that keeps an owner mark in every rule it is offered.
    struct Marking(u64);

    struct Mark(u64);

    impl crate::limiter::observe::RuleCounts for Mark {
        fn owner(&self) -> u64 {
            self.0
        }
        fn count(&self, _: &DescriptorReport<'_>) {}
    }

    impl Observer for Marking {
        fn call(&self, _: CallResult, _: std::time::Duration) {}
        fn descriptor(&self, _: &DescriptorReport<'_>) {}
        fn unknown_domain(&self) {}
        fn global_shadow(&self) {}
        fn store_call(&self, _: &'static str, _: std::time::Duration, _: bool) {}
        fn rule_counts(&self, _: &Rule) -> Option<Arc<dyn crate::limiter::observe::RuleCounts>> {
            Some(Arc::new(Mark(self.0)))
        }
    }

    /// What an observer keeps per rule is made when the limits are handed over: at
    /// `with_observer` for the first ones, and before a reload's new rules serve.
    #[test]
    fn every_rule_is_prepared_for_its_observer_when_it_is_handed_over() {
        let (l, _) = limiter(CONFIG, LimiterOptions::default());
        let owners = |l: &Limiter| -> Vec<Option<u64>> {
            l.limits()
                .rules()
                .iter()
                .map(|(_, rule)| rule.observer_slot.get().map(|kept| kept.owner()))
                .collect()
        };
        assert!(owners(&l).iter().all(Option::is_none), "no observer yet");
        let l = l.with_observer(Arc::new(Marking(7)));
        let first = owners(&l);
        assert!(
            !first.is_empty() && first.iter().all(|o| *o == Some(7)),
            "{first:?}"
        );
        l.replace_limits(
            crate::config::compile_sources(&[("t.yaml".into(), CONFIG.into())]).expect("valid"),
        );
        let reloaded = owners(&l);
        assert!(
            reloaded.len() == first.len() && reloaded.iter().all(|o| *o == Some(7)),
            "{reloaded:?}"
        );
    }
}
