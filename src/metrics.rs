//! Prometheus metrics, served on the HTTP port at `/metrics`: OpenMetrics text by default
//! (counters carry the `_total` suffix), or, with [`MetricNames::Reference`], the Prometheus text
//! format with the names the reference server's statsd-exporter mapping produces (counters
//! without `_total`), so its dashboards and alerts keep working. Both add the `process_*`
//! metrics.
//!
//! Per rule, with labels `domain`, `key1` (first level of the rule's path) and `key2` (the rest):
//! `ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,within_limit,shadow_mode,
//! over_limit_with_local_cache}_total` as the reference server names them, plus `..._bans_total`. Descriptor values appear in labels
//! only for rules with `detailed_metric`/`value_to_metric`, and only up to
//! [`DETAILED_SERIES_CAP`] label sets; past that, hits count under the rule's own path, so a
//! flood of distinct values cannot grow memory.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::limiter::observe::{CallResult, DescriptorReport, Observer, RuleCounts};
use crate::limiter::rules::{Rule, Segment};
use crate::limiter::{Clock, SystemClock};

mod process;
mod reference;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

/// How `/metrics` names and encodes the series.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MetricNames {
    /// OpenMetrics text; counters end in `_total`.
    #[default]
    Slidegate,
    /// Prometheus text format 0.0.4, counters named as the reference's exporter names them.
    Reference,
}

/// Most label sets with descriptor values kept, over all detailed rules.
pub const DETAILED_SERIES_CAP: usize = 1000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    domain: Arc<str>,
    key1: Arc<str>,
    key2: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabels {
    store: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    grpc_method: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdminLabels {
    action: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    err_type: &'static str,
}

/// The one RPC, as the reference labels it.
const METHOD: MethodLabels = MethodLabels {
    grpc_method: "ShouldRateLimit",
};

pub struct Metrics {
    registry: Registry,
    names: MetricNames,
    /// The reference's call counters: `ratelimit_server.<method>.*` and
    /// `ratelimit.service.call.should_rate_limit.<error>`.
    total_requests: Family<MethodLabels, Counter>,
    response_seconds: Family<MethodLabels, Histogram>,
    call_errors: Family<ErrorLabels, Counter>,
    total_hits: Family<RuleLabels, Counter>,
    over_limit: Family<RuleLabels, Counter>,
    over_limit_with_local_cache: Family<RuleLabels, Counter>,
    near_limit: Family<RuleLabels, Counter>,
    within_limit: Family<RuleLabels, Counter>,
    shadow_mode: Family<RuleLabels, Counter>,
    bans: Family<RuleLabels, Counter>,
    requests: Family<ResultLabels, Counter>,
    request_seconds: Histogram,
    store_seconds: Family<StoreLabels, Histogram>,
    store_errors: Family<StoreLabels, Counter>,
    config_success: Counter,
    config_error: Counter,
    config_age: Gauge<f64, AtomicU64>,
    store_keys: Gauge,
    /// 1 while ready (as `/readyz` answers), set when scraped.
    ready: Gauge,
    /// 1, labelled with Redis's `maxmemory-policy`, when it evicts keys.
    evicting: Family<PolicyLabels, Gauge>,
    /// Times the store was found to have lost its data, and the count last read.
    data_losses: Counter,
    data_losses_seen: AtomicU64,
    store_resent: Counter,
    /// The store's own count of `store_resent` when last scraped.
    store_resent_seen: AtomicU64,
    /// When the current config was loaded, in ms since the epoch (0: never).
    config_loaded_ms: AtomicU64,
    unknown_domain: Counter,
    global_shadow: Counter,
    admin_calls: Family<AdminLabels, Counter>,
    /// Spans dropped with the export queue full, and the count last read.
    spans_dropped: Counter,
    spans_dropped_seen: AtomicU64,
    detailed_seen: Mutex<HashSet<RuleLabels>>,
    /// Tells this instance's series apart in the rules' observer slots (tests make several).
    id: u64,
    /// Series with fixed labels, looked up in their family once, on first use (so a series
    /// still appears only once it has counted something): a lookup hashes the labels under a
    /// lock, on every call.
    requests_by_result: [OnceLock<Counter>; 4],
    total_requests_method: OnceLock<Counter>,
    response_seconds_method: OnceLock<Histogram>,
    store_seconds_first: OnceLock<(&'static str, Histogram)>,
}

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

/// Ids of `Metrics` instances.
static NEXT_METRICS_ID: AtomicU64 = AtomicU64::new(1);

/// `family`'s series for the labels `labels` makes, looked up once and kept in `cell`.
fn series<'a, L, M, C>(
    cell: &'a OnceLock<M>,
    family: &Family<L, M, C>,
    labels: impl FnOnce() -> L,
) -> &'a M
where
    L: Clone + std::hash::Hash + Eq,
    M: Clone,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    cell.get_or_init(|| family.get_or_create(&labels()).clone())
}

/// A rule's labels without descriptor values: its domain and the two parts of its path.
fn plain_labels(rule: &Rule) -> RuleLabels {
    RuleLabels {
        domain: rule.domain.clone(),
        key1: rule.stat_key1.clone(),
        key2: rule.stat_key2.clone(),
    }
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

fn now_ms() -> u64 {
    SystemClock.now_ms()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::with_names(MetricNames::default())
    }

    pub fn with_names(names: MetricNames) -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            names,
            total_requests: Family::default(),
            response_seconds: Family::new_with_constructor(latency_histogram),
            call_errors: Family::default(),
            total_hits: Family::default(),
            over_limit: Family::default(),
            over_limit_with_local_cache: Family::default(),
            near_limit: Family::default(),
            within_limit: Family::default(),
            shadow_mode: Family::default(),
            bans: Family::default(),
            requests: Family::default(),
            request_seconds: latency_histogram(),
            store_seconds: Family::new_with_constructor(latency_histogram),
            store_errors: Family::default(),
            config_success: Counter::default(),
            config_error: Counter::default(),
            config_age: Gauge::default(),
            store_keys: Gauge::default(),
            ready: Gauge::default(),
            evicting: Family::default(),
            data_losses: Counter::default(),
            data_losses_seen: AtomicU64::new(0),
            store_resent: Counter::default(),
            store_resent_seen: AtomicU64::new(0),
            config_loaded_ms: AtomicU64::new(0),
            unknown_domain: Counter::default(),
            global_shadow: Counter::default(),
            admin_calls: Family::default(),
            spans_dropped: Counter::default(),
            spans_dropped_seen: AtomicU64::new(0),
            detailed_seen: Mutex::new(HashSet::new()),
            registry: Registry::default(),
            id: NEXT_METRICS_ID.fetch_add(1, Ordering::Relaxed),
            requests_by_result: Default::default(),
            total_requests_method: OnceLock::new(),
            response_seconds_method: OnceLock::new(),
            store_seconds_first: OnceLock::new(),
        };
        m.register_rule_counters(&mut registry);
        m.register_service_metrics(&mut registry);
        Self::register_build_info(&mut registry);
        m.register_state(&mut registry);
        m.register_operations(&mut registry);
        Metrics { registry, ..m }
    }

    /// The reference server's per-rule counters (its statsd names, as its exporter maps them).
    fn register_rule_counters(&self, registry: &mut Registry) {
        let rule = "per rule (domain, key1 = first level, key2 = the rest)";
        let counters = [
            ("total_hits", "Hits asked for", &self.total_hits),
            ("over_limit", "Hits over the limit", &self.over_limit),
            (
                "over_limit_with_local_cache",
                "Hits over the limit answered from the over-limit cache, without the store (also in over_limit)",
                &self.over_limit_with_local_cache,
            ),
            (
                "near_limit",
                "Hits between the near-limit ratio and the limit, admitted or not",
                &self.near_limit,
            ),
            (
                "within_limit",
                "Hits within the limit, near ones included",
                &self.within_limit,
            ),
            (
                "shadow_mode",
                "Hits over the limit let through by shadow mode",
                &self.shadow_mode,
            ),
            ("bans", "Bans set", &self.bans),
        ];
        for (name, help, family) in counters {
            registry.register(
                format!("ratelimit_service_rate_limit_{name}"),
                format!("{help}, {rule}"),
                family.clone(),
            );
        }
    }

    /// The version and commit, as a series whose value is always 1.
    fn register_build_info(registry: &mut Registry) {
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: crate::VERSION,
                commit: crate::COMMIT,
            })
            .set(1);
        registry.register(
            "slidegate_build_info",
            "The version and commit slidegate is built from (always 1)",
            build,
        );
    }

    /// What is read at each scrape: readiness, Redis's memory policy and its data losses.
    fn register_state(&self, registry: &mut Registry) {
        registry.register(
            "slidegate_store_data_losses",
            "Times Redis was found to have lost its data (restarted without persistence, flushed): the marker slidegate keeps there was gone",
            self.data_losses.clone(),
        );
        registry.register(
            "slidegate_redis_evicting",
            "1 when Redis's maxmemory-policy evicts keys (an evicted window is forgotten and its requests admitted again); set noeviction",
            self.evicting.clone(),
        );
        registry.register(
            "slidegate_ready",
            "1 while slidegate can decide (as /readyz answers: serving, the store answering, a config loaded where one is required), else 0",
            self.ready.clone(),
        );
    }

    /// The admin API's calls and the traces' export.
    fn register_operations(&self, registry: &mut Registry) {
        registry.register(
            "slidegate_tracing_spans_dropped",
            "Trace spans dropped because the export queue was full (--tracing-queue-size): the collector is slow or away",
            self.spans_dropped.clone(),
        );
        registry.register(
            "slidegate_admin_calls",
            "Admin API calls (--admin-addr) by action (inspect, reset) and result (ok, unauthorized, invalid, store_error)",
            self.admin_calls.clone(),
        );
    }

    /// Calls, latencies, the store and the config.
    fn register_service_metrics(&self, registry: &mut Registry) {
        registry.register(
            "slidegate_requests",
            "ShouldRateLimit calls by result",
            self.requests.clone(),
        );
        registry.register(
            "slidegate_request_duration_seconds",
            "ShouldRateLimit latency inside slidegate",
            self.request_seconds.clone(),
        );
        registry.register(
            "slidegate_store_duration_seconds",
            "Latency of one store decision",
            self.store_seconds.clone(),
        );
        registry.register(
            "slidegate_store_errors",
            "Store calls that failed or timed out",
            self.store_errors.clone(),
        );
        let counters = [
            (
                "ratelimit_service_config_load_success",
                "Config loads that succeeded",
                &self.config_success,
            ),
            (
                "ratelimit_service_config_load_error",
                "Config loads that were rejected (the old config stays)",
                &self.config_error,
            ),
            (
                "ratelimit_service_rate_limit_domain_not_found",
                "Requests for a domain with no config",
                &self.unknown_domain,
            ),
            (
                "ratelimit_service_global_shadow_mode",
                "OVER_LIMIT answers turned into OK by --shadow-mode",
                &self.global_shadow,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "slidegate_store_keys",
            "Descriptors holding state in the embedded store (bounded by --memory-max-keys)",
            self.store_keys.clone(),
        );
        registry.register(
            "slidegate_redis_cluster_resent",
            "Requests a Redis Cluster master refused because it no longer served their slot (resharding), sent again",
            self.store_resent.clone(),
        );
        registry.register(
            "slidegate_config_age_seconds",
            "Seconds since the serving config was loaded",
            self.config_age.clone(),
        );
        registry.register(
            "ratelimit_service_total_requests",
            "ShouldRateLimit calls, by gRPC method",
            self.total_requests.clone(),
        );
        registry.register(
            "ratelimit_service_response_time_seconds",
            "ShouldRateLimit latency, by gRPC method",
            self.response_seconds.clone(),
        );
        registry.register(
            "ratelimit_service_should_rate_limit_error",
            "Calls that failed: redis_error (store) or service_error (invalid request)",
            self.call_errors.clone(),
        );
    }

    /// The exposition and its content type, in the format [`MetricNames`] chose.
    pub fn render(&self) -> (&'static str, String) {
        let loaded = self.config_loaded_ms.load(Ordering::Relaxed);
        if loaded > 0 {
            #[allow(clippy::cast_precision_loss)] // an age in ms is far below 2^53
            let age_s = now_ms().saturating_sub(loaded) as f64 / 1000.0;
            self.config_age.set(age_s);
        }
        let mut open_metrics = String::new();
        // Writing into a String cannot fail.
        let _ =
            prometheus_client::encoding::text::encode_registry(&mut open_metrics, &self.registry);
        match self.names {
            MetricNames::Slidegate => {
                open_metrics.push_str(&process::render(false));
                open_metrics.push_str("# EOF\n");
                (
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    open_metrics,
                )
            }
            MetricNames::Reference => {
                let mut text = reference::prometheus_text(&open_metrics);
                text.push_str(&process::render(true));
                ("text/plain; version=0.0.4; charset=utf-8", text)
            }
        }
    }

    /// Redis's evicting memory policy, read at connect.
    pub fn set_evicting(&self, policy: &str) {
        self.evicting
            .get_or_create(&PolicyLabels {
                policy: policy.to_string(),
            })
            .set(1);
    }

    /// Readiness as it stands when the metrics are scraped.
    /// Counts one admin API call.
    pub fn admin_call(&self, action: &'static str, result: &'static str) {
        self.admin_calls
            .get_or_create(&AdminLabels { action, result })
            .inc();
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// The embedded store's size, read when the metrics are scraped.
    pub fn set_store_keys(&self, keys: u64) {
        self.store_keys.set(i64::try_from(keys).unwrap_or(i64::MAX));
    }

    /// The store's count of requests sent again, read when the metrics are scraped.
    pub fn set_store_resent(&self, resent: u64) {
        // Scrapes may run at once: each adds what it alone saw grow.
        let seen = self.store_resent_seen.fetch_max(resent, Ordering::Relaxed);
        if resent > seen {
            self.store_resent.inc_by(resent - seen);
        }
    }

    /// The store's count of data losses, read when the metrics are scraped.
    pub fn set_data_losses(&self, losses: u64) {
        let seen = self.data_losses_seen.fetch_max(losses, Ordering::Relaxed);
        if losses > seen {
            self.data_losses.inc_by(losses - seen);
        }
    }

    /// Sets the spans dropped so far, as the traces' exporter counts them.
    pub fn set_spans_dropped(&self, dropped: u64) {
        let seen = self
            .spans_dropped_seen
            .fetch_max(dropped, Ordering::Relaxed);
        if dropped > seen {
            self.spans_dropped.inc_by(dropped - seen);
        }
    }

    pub fn config_loaded(&self, ok: bool) {
        if ok {
            self.config_success.inc();
            self.config_loaded_ms.store(now_ms(), Ordering::Relaxed);
        } else {
            self.config_error.inc();
        }
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
}

impl Metrics {
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

impl Observer for Metrics {
    fn call(&self, result: CallResult, elapsed: Duration) {
        let i = match result {
            CallResult::Ok => 0,
            CallResult::OverLimit => 1,
            CallResult::Invalid => 2,
            CallResult::StoreError => 3,
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
            CallResult::Invalid => "service_error",
            CallResult::Ok | CallResult::OverLimit => return,
        };
        self.call_errors
            .get_or_create(&ErrorLabels { err_type })
            .inc();
    }

    fn descriptor(&self, report: &DescriptorReport<'_>) {
        // A rule without values in its labels counts through the series kept in the rule.
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

    fn unknown_domain(&self) {
        self.unknown_domain.inc();
    }

    fn global_shadow(&self) {
        self.global_shadow.inc();
    }

    /// A rule without values in its labels keeps its series (see [`RuleSeries`]).
    fn rule_counts(&self, rule: &Rule) -> Option<Arc<dyn RuleCounts>> {
        (!rule.value_levels.contains(&true))
            .then(|| Arc::new(self.rule_series(rule)) as Arc<dyn RuleCounts>)
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

    /// The store's count of requests sent again is read at each scrape; the counter grows by
    /// what the store's count grew, whatever the order of the reads.
    #[test]
    fn the_resent_counter_follows_the_stores_count() {
        let metrics = Metrics::new();
        let value = || {
            metrics
                .render()
                .1
                .lines()
                .find_map(|l| l.strip_prefix("slidegate_redis_cluster_resent_total "))
                .map(str::to_owned)
        };
        assert_eq!(value().as_deref(), Some("0"));
        metrics.set_store_resent(3);
        metrics.set_store_resent(3);
        assert_eq!(value().as_deref(), Some("3"));
        // A scrape that read an older count after a newer one adds nothing.
        metrics.set_store_resent(7);
        metrics.set_store_resent(5);
        assert_eq!(value().as_deref(), Some("7"));
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
