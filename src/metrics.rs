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
//!
//! One concern a file: the series and their labels, and the exposition, here;
//! `registration.rs` the name and help each family is registered under; `observer.rs` what is
//! counted as it happens (the limiter's calls and decisions, config loads, admin API calls);
//! `rule_series.rs` the per-rule counters and their labels; `scraped.rs` what is read from the
//! store and the process at each scrape; `quota_series.rs` the Rate Limit Quota Service's; `prometheus_text.rs` the reference's text format;
//! `process.rs` the `process_*` metrics.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::limiter::{Clock, SystemClock};

mod observer;
mod process;
mod prometheus_text;
mod quota_series;
mod registration;
mod rule_series;
mod scraped;

pub use rule_series::DETAILED_SERIES_CAP;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
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

/// The metrics of one server: every family, registered once in `registry`, and the series
/// of fixed labels kept beside their families.
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
    quota: quota_series::QuotaMetrics,
    /// Spans dropped with the export queue full, and the count last read.
    spans_dropped: Counter,
    spans_dropped_seen: AtomicU64,
    detailed_seen: Mutex<HashSet<RuleLabels>>,
    /// Tells this instance's series apart in the rules' observer slots (tests make several).
    id: u64,
    /// Series with fixed labels, looked up in their family once, on first use (so a series
    /// still appears only once it has counted something): a lookup hashes the labels under a
    /// lock, on every call.
    requests_by_result: [OnceLock<Counter>; 5],
    total_requests_method: OnceLock<Counter>,
    response_seconds_method: OnceLock<Histogram>,
    store_seconds_first: OnceLock<(&'static str, Histogram)>,
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
            quota: quota_series::QuotaMetrics::default(),
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
        m.register_all(&mut registry);
        Metrics { registry, ..m }
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
                let mut text = prometheus_text::from_open_metrics(&open_metrics);
                text.push_str(&process::render(true));
                ("text/plain; version=0.0.4; charset=utf-8", text)
            }
        }
    }
}
