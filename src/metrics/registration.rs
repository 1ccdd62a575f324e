//! The name and help text each family is registered under, in the order `/metrics` lists them.
//! The per-rule and call counters carry the names the reference server's statsd-exporter
//! mapping produces, so its dashboards and alerts read slidegate's series unchanged.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

impl Metrics {
    /// Registers every family in `registry`.
    pub(super) fn register_all(&self, registry: &mut Registry) {
        self.register_rule_counters(registry);
        self.register_service_metrics(registry);
        Self::register_build_info(registry);
        self.register_state(registry);
        self.register_operations(registry);
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
        self.quota.register(registry);
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
}
