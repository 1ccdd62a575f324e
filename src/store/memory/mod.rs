//! The embedded store: the same sliding-window-log semantics as Redis, in process.
//!
//! Logs live in a fixed number of shards, each behind its own mutex, so unrelated descriptors do
//! not contend. A batch locks the shards it touches in index order (no deadlock between batches)
//! and holds them for the whole decision, which makes a batch atomic exactly as a Lua call is in
//! Redis. No lock is held across an `.await`: `check` does all its work before returning.
//!
//! A log keeps one entry per admitted request (time, running total of hits) instead of one per
//! hit, so a request with many hits costs one entry, and counting any window is a binary search.
//!
//! Here: the store, its batch decided in three phases (what fits, what is recorded, what is
//! answered), and the [`Store`] implementation. `shards.rs`: the shards, the order a batch
//! locks them in, and the sweep of idle state; `slot.rs`: one descriptor's state and the
//! window arithmetic that the Redis script mirrors.

use std::sync::Arc;
use std::time::Duration;

use super::{
    Algorithm, CheckItem, CheckOutcome, InspectFuture, ItemOutcome, ItemState, ResetFuture, Store,
    StoreError, StoreFuture, StoreKey, WindowOutcome, admits,
};
use shards::{Locked, Shard, Shards, SweeperGuard, lock, sweep_forever};

mod holders;
mod shards;
mod slot;

pub(crate) use slot::Slot;

/// Descriptors that may hold state at once, by default (4,096 a shard): some 300 bytes each,
/// so about 80 MB.
pub const DEFAULT_MAX_KEYS: usize = 262_144;

pub struct MemoryStore {
    shards: Arc<Shards>,
    /// Stops the sweeper task when the store goes (mini-redis's `DbDropGuard` idea).
    _sweeper: Option<SweeperGuard>,
}

/// What phase 1 found for one item.
#[derive(Clone, Copy, Default)]
struct Fit {
    fits: bool,
    /// Records its hits if the batch is admitted (a debit: whatever the decision).
    records: bool,
    ban_remaining_ms: u64,
    ban_set: bool,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store of at most [`DEFAULT_MAX_KEYS`] descriptors that sweeps idle logs when requests
    /// touch their shard.
    pub fn new() -> MemoryStore {
        MemoryStore::bounded(DEFAULT_MAX_KEYS)
    }

    /// A store of at most `max_keys` descriptors holding state at once. A batch that would add
    /// a descriptor to a full shard is refused (a store failure, answered by the failure
    /// policy); descriptors already held, and checks that record nothing, go on as usual.
    /// Nothing is evicted: forgetting a live log would let its window's requests through again.
    pub fn bounded(max_keys: usize) -> MemoryStore {
        MemoryStore {
            shards: Arc::new(Shards::new(max_keys)),
            _sweeper: None,
        }
    }

    /// Also sweeps every shard every `every`, so idle logs go even without traffic. `now_ms`
    /// is the limiter's clock. The sweeper is a task on the current Tokio runtime and ends with
    /// the store; outside a runtime the store sweeps on access only.
    pub fn with_sweeper(
        self,
        every: Duration,
        now_ms: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> MemoryStore {
        let mut store = self;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no async runtime: the embedded store sweeps on access only");
            return store;
        };
        let shards = Arc::downgrade(&store.shards);
        store._sweeper = Some(SweeperGuard(
            runtime.spawn(sweep_forever(shards, every, now_ms)),
        ));
        store
    }

    /// Number of descriptors that currently hold state, for tests and introspection.
    pub fn len(&self) -> usize {
        self.shards.shards.iter().map(|s| lock(s).slots.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops, in every shard, state that no window or ban needs at `now_ms` any more.
    pub fn sweep(&self, now_ms: u64) {
        self.shards.sweep(now_ms);
    }

    /// Decides a batch atomically: lock its shards, see what fits, record if admitted, report.
    /// With `rejected`, the request is already rejected elsewhere (see `Store::check_rejected`).
    fn decide(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        rejected: bool,
    ) -> Result<CheckOutcome, StoreError> {
        let shard_of: Vec<usize> = items
            .iter()
            .map(|i| self.shards.shard_of(i.key.as_str()))
            .collect();
        let mut locked = self.shards.lock_all(&shard_of);
        for (_, shard) in locked.guards.iter_mut() {
            shard.sweep(now_ms);
        }
        self.check_room(&mut locked, items, &shard_of)?;
        let fits = fit_all(&mut locked, items, &shard_of, now_ms);
        let admitted = !rejected && admits(items.iter().zip(&fits).map(|(i, f)| (i.role, f.fits)));
        record_all(&mut locked, items, &shard_of, &fits, admitted, now_ms);
        let outcomes = items
            .iter()
            .zip(&fits)
            .zip(&shard_of)
            .map(|((item, fit), &shard)| {
                let slot = locked.shard(shard).slots.get(item.key.as_str());
                item_outcome(slot, item, *fit, admitted, now_ms)
            })
            .collect();
        Ok(CheckOutcome {
            admitted,
            items: outcomes,
        })
    }

    /// Refuses a batch that would add a descriptor to a full shard (see [`MemoryStore::bounded`]).
    fn check_room(
        &self,
        locked: &mut Locked<'_>,
        items: &[CheckItem<'_>],
        shard_of: &[usize],
    ) -> Result<(), StoreError> {
        let mut new_keys: Vec<(usize, &str)> = items
            .iter()
            .zip(shard_of)
            .filter(|(item, _)| item.hits > 0 || item.ban_ms.is_some())
            .map(|(item, &shard)| (shard, item.key.as_str()))
            .filter(|(shard, key)| !locked.shard(*shard).slots.contains_key(*key))
            .collect();
        new_keys.sort_unstable();
        new_keys.dedup();
        for (shard, _) in &new_keys {
            let adding = new_keys.iter().filter(|(s, _)| s == shard).count();
            if locked.shard(*shard).slots.len() + adding > self.shards.per_shard {
                return Err(StoreError::unavailable(format!(
                    "the embedded store is full ({} descriptors hold state; --memory-max-keys)",
                    self.shards.max_keys
                )));
            }
        }
        Ok(())
    }
}

/// Phase 1: does each item fit? Hits of earlier fitting items on the same key count as pending,
/// so two descriptors of one request that share a log cannot overshoot together. An item that
/// does not fit and has a ban is banned here.
fn fit_all(
    locked: &mut Locked<'_>,
    items: &[CheckItem<'_>],
    shard_of: &[usize],
    now_ms: u64,
) -> Vec<Fit> {
    let mut fits: Vec<Fit> = Vec::with_capacity(items.len());
    for (n, item) in items.iter().enumerate() {
        let pending: u64 = items[..n]
            .iter()
            .zip(&fits)
            .filter(|(other, fit)| fit.records && other.key == item.key)
            .map(|(other, _)| other.hits)
            .sum();
        fits.push(fit_one(locked.shard(shard_of[n]), item, pending, now_ms));
    }
    fits
}

fn fit_one(shard: &mut Shard, item: &CheckItem<'_>, pending: u64, now_ms: u64) -> Fit {
    let slot = shard.slots.get_mut(item.key.as_str());
    if let Some(slot) = slot.as_ref().filter(|s| s.ban_until_ms > now_ms) {
        return Fit {
            ban_remaining_ms: slot.ban_until_ms - now_ms,
            ..Fit::default()
        };
    }
    let slot = slot.map(|s| {
        s.trim(item.algorithm, now_ms, &item.windows);
        &*s
    });
    let counts: Vec<u64> = item
        .windows
        .iter()
        .map(|w| slot.map_or(0, |s| s.count(item.algorithm, w, now_ms)) + pending)
        .collect();
    let size = item.size();
    let fits = counts
        .iter()
        .zip(item.windows.iter())
        .all(|(count, w)| count + size <= u64::from(w.limit));
    let has_room = counts
        .iter()
        .zip(item.windows.iter())
        .all(|(count, w)| *count < u64::from(w.limit));
    match item.ban_ms.filter(|_| !fits) {
        Some(ban_ms) => {
            let slot = shard.slots.entry(item.key.as_str().to_owned()).or_default();
            slot.ban_until_ms = now_ms.saturating_add(ban_ms);
            slot.keep_until_ms = slot.keep_until_ms.max(slot.ban_until_ms);
            Fit {
                fits: false,
                records: false,
                ban_remaining_ms: ban_ms,
                ban_set: true,
            }
        }
        None => Fit {
            fits,
            records: item.hits > 0 && (fits || (item.debit && has_room)),
            ..Fit::default()
        },
    }
}

/// Phase 2: record the hits of every item that fits in an admitted batch, and of every debit
/// that still had room, whatever the decision.
fn record_all(
    locked: &mut Locked<'_>,
    items: &[CheckItem<'_>],
    shard_of: &[usize],
    fits: &[Fit],
    admitted: bool,
    now_ms: u64,
) {
    for ((item, fit), &shard) in items.iter().zip(fits).zip(shard_of) {
        if fit.records && (admitted || item.debit) {
            let slot = locked
                .shard(shard)
                .slots
                .entry(item.key.as_str().to_owned())
                .or_default();
            slot.record(item.algorithm, now_ms, item.hits, &item.windows);
        }
    }
}

/// Phase 3: each window's state after the decision.
fn item_outcome(
    slot: Option<&Slot>,
    item: &CheckItem<'_>,
    fit: Fit,
    admitted: bool,
    now_ms: u64,
) -> ItemOutcome {
    if fit.ban_remaining_ms > 0 {
        return ItemOutcome {
            recorded: false,
            ban_remaining_ms: fit.ban_remaining_ms,
            ban_set: fit.ban_set,
            fits: false,
            windows: Vec::new(),
        };
    }
    let windows = item
        .windows
        .iter()
        .map(|w| match slot {
            Some(slot) => slot.outcome(item.algorithm, w, now_ms, fit.fits, item.size()),
            None => WindowOutcome {
                count: 0,
                reset_ms: if fit.fits || item.size() <= u64::from(w.limit) {
                    0
                } else {
                    w.length_ms
                },
            },
        })
        .collect();
    ItemOutcome {
        recorded: fit.records && (admitted || item.debit),
        ban_remaining_ms: 0,
        ban_set: false,
        fits: fit.fits,
        windows,
    }
}

impl Store for MemoryStore {
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        let outcome = self.decide(items, now_ms, false);
        Box::pin(async move { outcome })
    }

    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        let outcome = self.decide(items, now_ms, true);
        Box::pin(async move { outcome })
    }

    fn inspect<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> InspectFuture<'a> {
        let states = items
            .iter()
            .map(|item| {
                let shard = lock(&self.shards.shards[self.shards.shard_of(item.key.as_str())]);
                let slot = shard.slots.get(item.key.as_str());
                slot.map_or_else(|| state_of_nothing(item), |slot| slot.state(item, now_ms))
            })
            .collect();
        Box::pin(async move { Ok(states) })
    }

    fn reset<'a>(&'a self, keys: &'a [StoreKey]) -> ResetFuture<'a> {
        let cleared = keys
            .iter()
            .map(|key| {
                let mut shard = lock(&self.shards.shards[self.shards.shard_of(key.as_str())]);
                shard.slots.remove(key.as_str()).is_some()
            })
            .collect();
        Box::pin(async move { Ok(cleared) })
    }

    fn quota<'a>(
        &'a self,
        items: &'a [crate::store::QuotaItem<'a>],
        ttl_ms: u64,
        now_ms: u64,
    ) -> crate::store::QuotaFuture<'a> {
        let outcomes = self.quota_items(items, ttl_ms, now_ms);
        Box::pin(async move { outcomes })
    }

    fn live_keys(&self) -> Option<u64> {
        u64::try_from(self.len()).ok()
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

/// An item with no state: every window empty.
fn state_of_nothing(item: &CheckItem<'_>) -> ItemState {
    ItemState {
        ban_remaining_ms: 0,
        windows: vec![WindowOutcome::default(); item.windows.len()],
        entries: matches!(item.algorithm, Algorithm::SlidingLog).then_some(0),
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::store::{Role, StoreKey, Window};

    pub(super) fn item(value: &str, windows: Vec<Window>, hits: u64) -> CheckItem<'static> {
        CheckItem {
            key: StoreKey::new(&format!("d:k={value}"), ""),
            windows: Cow::Owned(windows),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits,
            role: Role::Enforce,
            debit: false,
            text: None,
        }
    }

    pub(super) fn window(limit: u32, length_ms: u64) -> Window {
        Window { limit, length_ms }
    }

    pub(super) fn decide(
        store: &MemoryStore,
        items: &[CheckItem<'_>],
        now_ms: u64,
    ) -> CheckOutcome {
        store
            .decide(items, now_ms, false)
            .expect("room in the store")
    }

    #[test]
    fn a_full_store_refuses_new_descriptors_and_keeps_the_rest() {
        let store = MemoryStore::bounded(640);
        let mut refused = 0;
        for n in 0..2_000 {
            match store.decide(
                &[item(&format!("v{n}"), vec![window(5, 60_000)], 1)],
                0,
                false,
            ) {
                Ok(outcome) => assert!(outcome.admitted),
                Err(e) => {
                    assert!(e.to_string().contains("--memory-max-keys"), "{e}");
                    refused += 1;
                }
            }
        }
        assert!(store.len() <= 640, "{} held", store.len());
        assert_eq!(store.len() + refused, 2_000);
        // Held descriptors go on; checks of new ones record nothing and pass.
        let held = (0..2_000)
            .map(|n| format!("v{n}"))
            .find(|v| {
                store
                    .decide(&[item(v, vec![window(5, 60_000)], 0)], 1, false)
                    .is_ok_and(|o| o.items[0].windows[0].count == 1)
            })
            .expect("one held descriptor");
        assert!(decide(&store, &[item(&held, vec![window(5, 60_000)], 1)], 2).admitted);
        assert!(decide(&store, &[item("never-seen", vec![window(5, 60_000)], 0)], 3).admitted);
        // Once their windows pass, the sweep frees room again.
        assert!(
            decide(
                &store,
                &[item("after", vec![window(5, 60_000)], 1)],
                120_000
            )
            .admitted
        );
    }

    /// A million distinct values through the default store stay under its bound.
    #[test]
    fn a_million_distinct_values_stay_under_the_bound() {
        let store = MemoryStore::new();
        let w = vec![window(100, 60_000)];
        for n in 0..1_000_000u64 {
            let _ = store.decide(
                &[item(&n.to_string(), w.clone(), 1)],
                1_000 + n / 100,
                false,
            );
        }
        assert!(store.len() <= DEFAULT_MAX_KEYS, "{} held", store.len());
        assert!(
            store.len() > DEFAULT_MAX_KEYS * 9 / 10,
            "{} held",
            store.len()
        );
    }

    #[test]
    fn rejected_batches_record_nothing_anywhere() {
        let store = MemoryStore::new();
        let ok = item("ok", vec![window(10, 1000)], 1);
        let full = item("full", vec![window(0, 1000)], 1);
        let outcome = decide(&store, &[ok.clone(), full], 0);
        assert!(!outcome.admitted);
        assert!(outcome.items[0].fits);
        assert_eq!(outcome.items[0].windows[0].count, 0);
        assert!(store.is_empty());
    }

    #[test]
    fn duplicate_keys_in_one_batch_share_the_limit() {
        let store = MemoryStore::new();
        let a = item("a", vec![window(3, 1000)], 2);
        let outcome = decide(&store, &[a.clone(), a.clone()], 0);
        assert!(!outcome.admitted, "2 + 2 hits cannot both fit a limit of 3");
        assert!(store.is_empty());
    }
}
