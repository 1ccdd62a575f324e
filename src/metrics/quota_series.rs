//! The Rate Limit Quota Service's metrics: streams and buckets open now, assignments by kind,
//! and the usage Envoys reported, per domain (a configured one; any other counts as
//! `unknown`, so a client cannot grow the series by naming domains).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AssignmentLabels {
    domain: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UsageLabels {
    domain: String,
    result: &'static str,
}

#[derive(Default)]
pub(super) struct QuotaMetrics {
    streams: Gauge,
    buckets: Gauge,
    assignments: Family<AssignmentLabels, Counter>,
    usage: Family<UsageLabels, Counter>,
}

impl QuotaMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "slidegate_rlqs_streams",
            "Rate Limit Quota Service streams open now",
            self.streams.clone(),
        );
        registry.register(
            "slidegate_rlqs_buckets",
            "Buckets the open quota streams report",
            self.buckets.clone(),
        );
        registry.register(
            "slidegate_rlqs_assignments",
            "Bucket assignments sent, by domain and kind (token_bucket, deny_all, allow_all; none: the store failed under the error policy)",
            self.assignments.clone(),
        );
        registry.register(
            "slidegate_rlqs_reported_requests",
            "Requests Envoys reported for their buckets, by domain and result (allowed, denied)",
            self.usage.clone(),
        );
    }

    pub(super) fn stream(&self, opened: bool) {
        if opened {
            self.streams.inc();
        } else {
            self.streams.dec();
        }
    }

    pub(super) fn buckets(&self, delta: i64) {
        self.buckets.inc_by(delta);
    }

    pub(super) fn usage(&self, domain: &str, allowed: u64, denied: u64) {
        for (result, n) in [("allowed", allowed), ("denied", denied)] {
            if n > 0 {
                let labels = UsageLabels {
                    domain: domain.to_string(),
                    result,
                };
                self.usage.get_or_create(&labels).inc_by(n);
            }
        }
    }

    pub(super) fn assignments(&self, domain: &str, kind: &'static str, count: u64) {
        let labels = AssignmentLabels {
            domain: domain.to_string(),
            kind,
        };
        self.assignments.get_or_create(&labels).inc_by(count);
    }
}
