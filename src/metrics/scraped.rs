//! What `/metrics` reads from the store, the process and the traces' exporter at each scrape:
//! readiness, the embedded store's size, Redis's memory policy, and the counts the store and
//! the exporter keep themselves (requests sent again, data losses, spans dropped), which the
//! counters here follow.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;

use super::{Metrics, PolicyLabels};

impl Metrics {
    /// Redis's evicting memory policy, read at connect.
    pub fn set_evicting(&self, policy: &str) {
        self.evicting
            .get_or_create(&PolicyLabels {
                policy: policy.to_string(),
            })
            .set(1);
    }

    /// Readiness as it stands when the metrics are scraped.
    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// The embedded store's size, read when the metrics are scraped.
    pub fn set_store_keys(&self, keys: u64) {
        self.store_keys.set(i64::try_from(keys).unwrap_or(i64::MAX));
    }

    /// The store's count of requests sent again, read when the metrics are scraped.
    pub fn set_store_resent(&self, resent: u64) {
        follow(&self.store_resent, &self.store_resent_seen, resent);
    }

    /// The store's count of data losses, read when the metrics are scraped.
    pub fn set_data_losses(&self, losses: u64) {
        follow(&self.data_losses, &self.data_losses_seen, losses);
    }

    /// Sets the spans dropped so far, as the traces' exporter counts them.
    pub fn set_spans_dropped(&self, dropped: u64) {
        follow(&self.spans_dropped, &self.spans_dropped_seen, dropped);
    }
}

/// Grows `counter` by what `count`, a count kept elsewhere, grew since the largest one `seen`.
fn follow(counter: &Counter, seen: &AtomicU64, count: u64) {
    // Scrapes may run at once: each adds what it alone saw grow.
    let before = seen.fetch_max(count, Ordering::Relaxed);
    if count > before {
        counter.inc_by(count - before);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
