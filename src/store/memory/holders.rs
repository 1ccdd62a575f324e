//! The embedded store's quotas (Envoy's Rate Limit Quota Service): a bucket's reported usage
//! recorded in its descriptor's slot, and its holders kept beside the log, shared by
//! [`crate::store::shares::share`], as the Redis library does in `lua/quota.lua`.

use super::shards::lock;
use super::{MemoryStore, Slot};
use crate::store::StoreError;
use crate::store::shares::{Holder, MOST_REPORTED, QuotaItem, QuotaOutcome, demand, share};

impl MemoryStore {
    /// Records each bucket's usage and shares its limit among its holders, one bucket at a time
    /// under its shard's lock (a report's buckets are independent, so nothing spans them).
    pub(super) fn quota_items(
        &self,
        items: &[QuotaItem<'_>],
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<Vec<QuotaOutcome>, StoreError> {
        items
            .iter()
            .map(|item| {
                let key = item.key.as_str();
                let mut shard = lock(&self.shards.shards[self.shards.shard_of(key)]);
                shard.sweep(now_ms);
                if !shard.slots.contains_key(key) && shard.slots.len() >= self.shards.per_shard {
                    return Err(StoreError::unavailable(format!(
                        "the embedded store is full ({} descriptors hold state; --memory-max-keys)",
                        self.shards.max_keys
                    )));
                }
                let slot = shard.slots.entry(key.to_owned()).or_default();
                Ok(slot.report(item, ttl_ms, now_ms))
            })
            .collect()
    }
}

impl Slot {
    /// One holder's report: its usage recorded, whatever the counts (the Envoy admitted those
    /// requests already), then its share of what is left.
    fn report(&mut self, item: &QuotaItem<'_>, ttl_ms: u64, now_ms: u64) -> QuotaOutcome {
        self.trim(item.algorithm, now_ms, &item.windows);
        if item.allowed > 0 {
            let hits = item.allowed.min(MOST_REPORTED);
            self.record(item.algorithm, now_ms, hits, &item.windows);
        }
        let counts: Vec<u64> = item
            .windows
            .iter()
            .map(|w| self.count(item.algorithm, w, now_ms))
            .collect();
        self.holders.retain(|(_, h)| h.expires_ms > now_ms);
        let previous = self
            .holders
            .iter()
            .position(|(name, _)| **name == *item.holder)
            .map(|at| self.holders.swap_remove(at).1);
        let others: Vec<Holder> = self.holders.iter().map(|(_, h)| *h).collect();
        let demand = demand(
            item.allowed,
            item.denied,
            item.elapsed_ms,
            previous.map(|h| h.demand),
            &others,
        );
        let (grant, held) = share(&item.windows, &counts, &others, demand, ttl_ms, now_ms);
        self.holders.push((item.holder.into(), held));
        self.keep_until_ms = self.keep_until_ms.max(held.expires_ms);
        QuotaOutcome { grant, counts }
    }
}
