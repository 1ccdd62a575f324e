//! The limiter: its options, its state, and the one request path, [`Limiter::should_rate_limit`].
//! gRPC and `POST /json` both call it, and it reports every call to the [`Observer`] (metrics),
//! so no transport times or counts calls.
//!
//! Its steps live beside it, one concern a file, in the order a request takes them: checked
//! against its bounds (`bounds.rs`), its descriptors matched to rules and the store's items built
//! (`plan.rs`), the store asked, or the failure policy (`ask_store.rs`), the answer shaped
//! (`answer.rs`), and the observer, the decision log and the trace told (`report.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use tracing::Instrument as _;

use super::bounds::RequestBounds;
use super::cache::OverLimitCache;
use super::clock::Stopwatch;
use super::headers::LimitHeaderNames;
use super::observe::{CallResult, NoObserver, Observer};
use super::plan::plan;
use super::rules::{FailurePolicy, Limits};
use super::{Clock, Code, Decision, LimiterError, Request, Status};
use crate::store::Store;

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
    /// How long a Rate Limit Quota Service assignment lives ([`super::assignments::QUOTA_TTL`]).
    pub quota_ttl: std::time::Duration,
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
            quota_ttl: super::assignments::QUOTA_TTL,
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
    /// Descriptors known to be over, answered without the store.
    pub(super) cache: OverLimitCache,
    /// This process among the replicas sharing a store, and its quota streams so far: the
    /// names of the streams that hold quotas ([`Limiter::quota_holder`]).
    pub(super) instance: String,
    pub(super) quota_streams: AtomicU64,
    /// Where set, calls are refused until it is true: the first config from an xDS server.
    pub(super) config_arrived: Option<Arc<AtomicBool>>,
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
            instance: random_instance(),
            quota_streams: AtomicU64::new(0),
            config_arrived: None,
        }
    }

    /// What the limiter reports to (the metrics), for the transports' own events (a quota
    /// stream opened or ended).
    pub fn observer(&self) -> &dyn Observer {
        &*self.observer
    }

    /// What one request may ask for.
    pub fn bounds(&self) -> &RequestBounds {
        &self.options.bounds
    }

    /// Refuses calls (`LimiterError::NoConfig`, gRPC `UNAVAILABLE`) until `arrived` is true:
    /// a config taken from an xDS server, before the server's first, limits nothing, and a
    /// caller told `OK` then would never know it went unlimited; refused, its own failure mode
    /// decides (Envoy's `failure_mode_deny`).
    pub fn awaiting_first_config(mut self, arrived: Arc<AtomicBool>) -> Limiter {
        self.config_arrived = Some(arrived);
        self
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

    /// The store this limiter asks, for its name, its health and its figures. Decisions, inspect
    /// and reset go through the limiter, which keeps the over-limit cache and the failure policy
    /// in step with what the store says.
    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// Store failures this limiter met since start, whatever the failure policy answered: its own
    /// count, not the store's.
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
            Err(LimiterError::NoConfig(_)) => CallResult::NoConfig,
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

    /// Validates, plans, asks the store and answers; a domain without rules answers OK without
    /// a limit.
    async fn decide(
        &self,
        request: &Request,
        span: &tracing::Span,
    ) -> Result<Decision, LimiterError> {
        if let Some(arrived) = &self.config_arrived
            && !arrived.load(Ordering::Acquire)
        {
            return Err(LimiterError::NoConfig(NO_CONFIG_YET.into()));
        }
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
}

/// 64 random bits in hex, from the standard library's per-map random keys: a process's name
/// among the replicas.
fn random_instance() -> String {
    use std::hash::BuildHasher as _;
    format!(
        "{:016x}",
        std::collections::hash_map::RandomState::new().hash_one(0u8)
    )
}

/// What a call is refused with before the first config from an xDS server.
const NO_CONFIG_YET: &str = "no rate limit config has arrived from the xDS server yet; calls are refused until it sends one (--force-start-without-initial-config, FORCE_START_WITHOUT_INITIAL_CONFIG=true, answers them OK without limits instead)";

/// Fills every rule's observer slot with what `observer` keeps there.
fn prepare(limits: &Limits, observer: &dyn Observer) {
    for (_, rule) in limits.rules() {
        if let Some(counts) = observer.rule_counts(rule) {
            rule.observer_slot.fill(counts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::observe::DescriptorReport;
    use super::super::rules::Rule;
    use super::super::testing::{CONFIG, decide, limiter, req};
    use super::*;

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
