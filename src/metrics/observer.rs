//! What is counted as it happens: the limiter's calls and decisions (the [`Observer`] it is
//! handed), config loads and admin API calls. The per-rule counting itself is
//! `rule_series.rs`'s.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{
    AdminLabels, ErrorLabels, MethodLabels, Metrics, ResultLabels, StoreLabels, now_ms, series,
};
use crate::limiter::observe::{CallResult, DescriptorReport, Observer, RuleCounts};
use crate::limiter::rules::Rule;

/// The one RPC, as the reference labels it.
const METHOD: MethodLabels = MethodLabels {
    grpc_method: "ShouldRateLimit",
};

impl Observer for Metrics {
    fn call(&self, result: CallResult, elapsed: Duration) {
        let i = match result {
            CallResult::Ok => 0,
            CallResult::OverLimit => 1,
            CallResult::Invalid => 2,
            CallResult::StoreError => 3,
            CallResult::NoConfig => 4,
        };
        series(&self.requests_by_result[i], &self.requests, || {
            ResultLabels {
                result: result.as_str(),
            }
        })
        .inc();
        self.request_seconds.observe(elapsed.as_secs_f64());
        series(&self.total_requests_method, &self.total_requests, || METHOD).inc();
        series(
            &self.response_seconds_method,
            &self.response_seconds,
            || METHOD,
        )
        .observe(elapsed.as_secs_f64());
        let err_type = match result {
            CallResult::StoreError => "redis_error",
            // The reference's service errors include "no rate limit configuration loaded".
            CallResult::Invalid | CallResult::NoConfig => "service_error",
            CallResult::Ok | CallResult::OverLimit => return,
        };
        self.call_errors
            .get_or_create(&ErrorLabels { err_type })
            .inc();
    }

    fn descriptor(&self, report: &DescriptorReport<'_>) {
        self.count_descriptor(report);
    }

    fn unknown_domain(&self) {
        self.unknown_domain.inc();
    }

    fn quota_stream(&self, opened: bool) {
        self.quota.stream(opened);
    }

    fn quota_buckets(&self, delta: i64) {
        self.quota.buckets(delta);
    }

    fn quota_usage(&self, domain: &str, allowed: u64, denied: u64) {
        self.quota.usage(domain, allowed, denied);
    }

    fn quota_assignments(&self, domain: &str, kind: &'static str, count: u64) {
        self.quota.assignments(domain, kind, count);
    }

    fn global_shadow(&self) {
        self.global_shadow.inc();
    }

    /// A rule without values in its labels keeps its series (`rule_series.rs`).
    fn rule_counts(&self, rule: &Rule) -> Option<Arc<dyn RuleCounts>> {
        self.kept_series(rule)
    }

    fn store_call(&self, store: &'static str, elapsed: Duration, ok: bool) {
        let labels = StoreLabels { store };
        // A server has one store: its series is kept after the first call.
        let first = self
            .store_seconds_first
            .get_or_init(|| (store, self.store_seconds.get_or_create(&labels).clone()));
        if first.0 == store {
            first.1.observe(elapsed.as_secs_f64());
        } else {
            self.store_seconds
                .get_or_create(&labels)
                .observe(elapsed.as_secs_f64());
        }
        if !ok {
            self.store_errors.get_or_create(&labels).inc();
        }
    }
}

impl Metrics {
    /// Counts one admin API call.
    pub fn admin_call(&self, action: &'static str, result: &'static str) {
        self.admin_calls
            .get_or_create(&AdminLabels { action, result })
            .inc();
    }

    pub fn config_loaded(&self, ok: bool) {
        if ok {
            self.config_success.inc();
            self.config_loaded_ms.store(now_ms(), Ordering::Relaxed);
        } else {
            self.config_error.inc();
        }
    }
}
