//! The embedded store: the same sliding-window-log semantics as Redis, in process.
//!
//! Logs live in a fixed number of shards, each behind its own mutex, so unrelated descriptors do
//! not contend. A batch locks the shards it touches in index order (no deadlock between batches)
//! and holds them for the whole decision, which makes a batch atomic exactly as a Lua call is in
//! Redis. No lock is held across an `.await`: `check` does all its work before returning.
//!
//! A log keeps one entry per admitted request (time, running total of hits) instead of one per
//! hit, so a request with many hits costs one entry, and counting any window is a binary search.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::{
    Algorithm, CheckItem, CheckOutcome, InspectFuture, ItemOutcome, ItemState, ResetFuture, Store,
    StoreError, StoreFuture, StoreKey, Window, WindowOutcome, admits, longest_ms,
};

const SHARDS: usize = 64;
/// How often a shard drops idle logs, at the latest (checked on access, and by the sweeper).
const SWEEP_EVERY_MS: u64 = 10_000;
/// How long idle state is kept past the moment no window needs it: the 1 s the Redis keys
/// outlive their data too (their TTLs), so that a request whose time is up to this much
/// behind the latest one seen (the clock stepped back) counts what it would have counted,
/// on either store.
const CLOCK_SLACK_MS: u64 = 1_000;
/// Descriptors that may hold state at once, by default (4,096 a shard): some 300 bytes each,
/// so about 80 MB.
pub const DEFAULT_MAX_KEYS: usize = 262_144;

pub struct MemoryStore {
    shards: Arc<Shards>,
    /// Stops the sweeper task when the store goes (mini-redis's `DbDropGuard` idea).
    _sweeper: Option<SweeperGuard>,
}

struct Shards {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    /// Most descriptors one shard holds (the store's bound, spread over the shards).
    per_shard: usize,
    max_keys: usize,
}

struct SweeperGuard(tokio::task::JoinHandle<()>);

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Default)]
struct Shard {
    slots: HashMap<String, Slot>,
    next_sweep_ms: u64,
}

/// One descriptor's state: its log or counters and its ban. The Redis store builds one from what
/// it reads ([`Slot::held`]) to answer as a decision counts.
#[derive(Default)]
pub(crate) struct Slot {
    /// `sliding_counter` rules: hits per bucket.
    buckets: Vec<Bucket>,
    entries: VecDeque<Entry>,
    /// Running total of hits up to and including the last entry trimmed away.
    trimmed_total: u64,
    ban_until_ms: u64,
    /// After this the slot holds nothing that any window or ban still needs.
    keep_until_ms: u64,
}

#[derive(Clone, Copy)]
struct Bucket {
    size_ms: u64,
    index: u64,
    hits: u64,
}

#[derive(Clone, Copy)]
struct Entry {
    at_ms: u64,
    /// Running total of hits including this entry.
    total: u64,
}

/// The shards one batch holds, sorted by index, locked for the whole decision.
struct Locked<'s> {
    guards: Vec<(usize, MutexGuard<'s, Shard>)>,
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
            shards: Arc::new(Shards {
                shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
                hasher: RandomState::new(),
                // The bound is kept per shard, so it is never passed (at least one a shard).
                per_shard: (max_keys / SHARDS).max(1),
                max_keys,
            }),
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

async fn sweep_forever(
    shards: Weak<Shards>,
    every: Duration,
    now_ms: impl Fn() -> u64 + Send + Sync + 'static,
) {
    loop {
        tokio::time::sleep(every).await;
        match shards.upgrade() {
            Some(shards) => shards.sweep(now_ms()),
            None => return,
        }
    }
}

impl Shards {
    fn shard_of(&self, key: &str) -> usize {
        // SHARDS is a power of two, so the mask keeps the index in range; only the low bits
        // of the hash are wanted, so truncating it is the point.
        #[allow(clippy::cast_possible_truncation)]
        let hash = self.hasher.hash_one(key) as usize;
        hash & (SHARDS - 1)
    }

    /// Locks the given shards in index order, so two batches never wait on each other in a
    /// cycle.
    fn lock_all(&self, shard_of: &[usize]) -> Locked<'_> {
        let mut order = shard_of.to_vec();
        order.sort_unstable();
        order.dedup();
        Locked {
            guards: order
                .into_iter()
                .map(|i| (i, lock(&self.shards[i])))
                .collect(),
        }
    }

    fn sweep(&self, now_ms: u64) {
        // One shard at a time, so requests on other shards never wait for the whole sweep.
        for shard in self.shards.iter() {
            lock(shard).sweep(now_ms);
        }
    }
}

impl Locked<'_> {
    /// The locked shard with index `index`. Every item's shard was locked (and `guards` sorted
    /// by index) before this is called, so the binary search always lands on it.
    fn shard(&mut self, index: usize) -> &mut Shard {
        let at = self.guards.partition_point(|(i, _)| *i < index);
        &mut self.guards[at].1
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

    fn live_keys(&self) -> Option<u64> {
        u64::try_from(self.len()).ok()
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a slot half-written in a way that breaks the
    // invariants we rely on (entries stay sorted, totals only grow), so keep serving.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shard {
    fn sweep(&mut self, now_ms: u64) {
        if now_ms >= self.next_sweep_ms {
            self.slots
                .retain(|_, slot| slot.keep_until_ms.saturating_add(CLOCK_SLACK_MS) > now_ms);
            // Give memory back after a flood of descriptors has aged out.
            if self.slots.capacity() > 4 * self.slots.len() + 64 {
                self.slots.shrink_to_fit();
            }
            self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
        }
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

impl Slot {
    /// A descriptor's state as Redis holds it: its log's entries as (time, running total,
    /// weight), oldest first (totals may start anywhere: a window counts differences); its
    /// counters as (bucket length, bucket index, hits); the end of its ban (0: none).
    pub(crate) fn held(
        log: &[(u64, u64, u64)],
        buckets: &[(u64, u64, u64)],
        ban_until_ms: u64,
    ) -> Slot {
        // The script counts a window from the total before its first entry: that entry's
        // total less its weight, the previous entry's total unless an entry between them was
        // taken back (a sorted-set log's totals stay as written). So each entry is given here
        // the next one's total less its weight, and the newest its own; totals that would go
        // down (entries slidegate did not write) stay level, so no count is negative.
        let before = |(_, total, weight): (u64, u64, u64)| total.saturating_sub(weight);
        let trimmed_total = log.first().map_or(0, |&e| before(e));
        let next_before = log.iter().skip(1).map(|&e| before(e));
        let entries = log
            .iter()
            .zip(next_before.map(Some).chain([None]))
            .scan(trimmed_total, |most, (&(at_ms, total, _), next)| {
                *most = next.unwrap_or(total).max(*most);
                Some(Entry {
                    at_ms,
                    total: *most,
                })
            })
            .collect();
        Slot {
            buckets: buckets
                .iter()
                .map(|&(size_ms, index, hits)| Bucket {
                    size_ms,
                    index,
                    hits,
                })
                .collect(),
            entries,
            trimmed_total,
            ban_until_ms,
            keep_until_ms: 0,
        }
    }

    /// How `item` stands at `now_ms`, read without trimming.
    pub(crate) fn state(&self, item: &CheckItem<'_>, now_ms: u64) -> ItemState {
        let entries = match item.algorithm {
            Algorithm::SlidingLog => {
                let first = self.first_inside(longest_ms(&item.windows), now_ms);
                Some((self.entries.len() - first) as u64)
            }
            Algorithm::SlidingCounter { .. } => None,
        };
        ItemState {
            ban_remaining_ms: self.ban_until_ms.saturating_sub(now_ms),
            windows: item
                .windows
                .iter()
                .map(|w| self.outcome(item.algorithm, w, now_ms, true, 0))
                .collect(),
            entries,
        }
    }

    fn count(&self, algorithm: Algorithm, window: &Window, now_ms: u64) -> u64 {
        match algorithm {
            Algorithm::SlidingLog => self.log_count(window.length_ms, now_ms),
            Algorithm::SlidingCounter { buckets } => {
                let (size, oldest) = window.bucket_span(buckets, now_ms);
                self.counted_buckets(size, oldest).map(|b| b.hits).sum()
            }
        }
    }

    /// The buckets of one window size that still count, oldest first.
    fn counted_buckets(&self, size: u64, oldest: u64) -> impl Iterator<Item = &Bucket> {
        let mut counted: Vec<&Bucket> = self
            .buckets
            .iter()
            .filter(|b| b.size_ms == size && b.index >= oldest)
            .collect();
        counted.sort_by_key(|b| b.index);
        counted.into_iter()
    }

    fn trim(&mut self, algorithm: Algorithm, now_ms: u64, windows: &[Window]) {
        match algorithm {
            Algorithm::SlidingLog => self.log_trim(now_ms, longest_ms(windows)),
            Algorithm::SlidingCounter { buckets } => self.buckets.retain(|b| {
                windows.iter().any(|w| {
                    let (size, oldest) = w.bucket_span(buckets, now_ms);
                    b.size_ms == size && b.index >= oldest
                })
            }),
        }
    }

    fn record(&mut self, algorithm: Algorithm, now_ms: u64, hits: u64, windows: &[Window]) {
        match algorithm {
            Algorithm::SlidingLog => self.log_record(now_ms, hits, longest_ms(windows)),
            Algorithm::SlidingCounter { buckets } => {
                let mut sizes_done: Vec<u64> = Vec::with_capacity(windows.len());
                for w in windows {
                    let (size, _) = w.bucket_span(buckets, now_ms);
                    let keep = (now_ms / size + 1) * size + w.length_ms;
                    self.keep_until_ms = self.keep_until_ms.max(keep);
                    // Windows with the same bucket length share their buckets: add once.
                    if sizes_done.contains(&size) {
                        continue;
                    }
                    sizes_done.push(size);
                    let index = now_ms / size;
                    match self
                        .buckets
                        .iter_mut()
                        .find(|b| b.size_ms == size && b.index == index)
                    {
                        Some(bucket) => bucket.hits += hits,
                        None => self.buckets.push(Bucket {
                            size_ms: size,
                            index,
                            hits,
                        }),
                    }
                }
            }
        }
    }

    /// One window's count and reset after a decision at `now_ms`, for an item of `hits` hits
    /// that did or did not fit.
    pub(crate) fn outcome(
        &self,
        algorithm: Algorithm,
        window: &Window,
        now_ms: u64,
        fits: bool,
        hits: u64,
    ) -> WindowOutcome {
        let Algorithm::SlidingCounter { buckets } = algorithm else {
            return self.log_outcome(window, now_ms, fits, hits);
        };
        let (size, oldest) = window.bucket_span(buckets, now_ms);
        let count: u64 = self.counted_buckets(size, oldest).map(|b| b.hits).sum();
        let limit = u64::from(window.limit);
        // A bucket stops counting once it no longer overlaps the window.
        let leaves = |b: &Bucket| ((b.index + 1) * size + window.length_ms).saturating_sub(now_ms);
        let reset_ms = if fits {
            self.counted_buckets(size, oldest)
                .find(|b| b.hits > 0)
                .map_or(0, leaves)
        } else if count + hits <= limit {
            0
        } else if hits > limit {
            window.length_ms
        } else {
            let need = count + hits - limit;
            let mut freed = 0;
            self.counted_buckets(size, oldest)
                .find(|b| {
                    freed += b.hits;
                    freed >= need
                })
                .map_or(window.length_ms, leaves)
        };
        WindowOutcome { count, reset_ms }
    }

    /// Index of the first entry inside a window of `length_ms` ending at `now_ms`. An entry
    /// exactly `length_ms` old is outside.
    fn first_inside(&self, length_ms: u64, now_ms: u64) -> usize {
        match now_ms.checked_sub(length_ms) {
            Some(edge) => self.entries.partition_point(|e| e.at_ms <= edge),
            None => 0,
        }
    }

    fn total_before(&self, index: usize) -> u64 {
        match index.checked_sub(1) {
            Some(i) => self.entries[i].total,
            None => self.trimmed_total,
        }
    }

    fn last_total(&self) -> u64 {
        self.entries.back().map_or(self.trimmed_total, |e| e.total)
    }

    fn log_count(&self, length_ms: u64, now_ms: u64) -> u64 {
        self.last_total() - self.total_before(self.first_inside(length_ms, now_ms))
    }

    fn log_trim(&mut self, now_ms: u64, longest_ms: u64) {
        let outside = self.first_inside(longest_ms, now_ms);
        if outside > 0 {
            self.trimmed_total = self.entries[outside - 1].total;
            self.entries.drain(..outside);
        }
    }

    fn log_record(&mut self, now_ms: u64, hits: u64, longest_ms: u64) {
        // Logs stay sorted by time. If the clock stepped back, the entry is stamped with the
        // newest time already in the log: it then stays counted a little longer, which can
        // only make the limiter stricter, never let more through.
        let at_ms = self.entries.back().map_or(now_ms, |e| e.at_ms.max(now_ms));
        let total = self.last_total() + hits;
        self.entries.push_back(Entry { at_ms, total });
        self.keep_until_ms = self.keep_until_ms.max(at_ms.saturating_add(longest_ms));
    }

    fn log_outcome(&self, window: &Window, now_ms: u64, fits: bool, hits: u64) -> WindowOutcome {
        let first = self.first_inside(window.length_ms, now_ms);
        let before = self.total_before(first);
        let count = self.last_total() - before;
        let age_out = |index: usize| self.entries[index].at_ms + window.length_ms - now_ms;
        let limit = u64::from(window.limit);
        let reset_ms = if fits {
            if first < self.entries.len() {
                age_out(first)
            } else {
                0
            }
        } else if count + hits <= limit {
            0
        } else if hits > limit {
            window.length_ms
        } else {
            // The request fits once `need` hits have aged out of this window.
            let need = count + hits - limit;
            let at = self.entries.partition_point(|e| e.total < before + need);
            if at < self.entries.len() {
                age_out(at)
            } else {
                window.length_ms
            }
        };
        WindowOutcome { count, reset_ms }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::store::{Role, StoreKey};

    fn item(value: &str, windows: Vec<Window>, hits: u64) -> CheckItem<'static> {
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

    fn window(limit: u32, length_ms: u64) -> Window {
        Window { limit, length_ms }
    }

    fn decide(store: &MemoryStore, items: &[CheckItem<'_>], now_ms: u64) -> CheckOutcome {
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
    fn an_entry_exactly_one_window_old_is_out() {
        let store = MemoryStore::new();
        let items = [item("a", vec![window(1, 1000)], 1)];
        assert!(decide(&store, &items, 5_000).admitted);
        assert!(!decide(&store, &items, 5_999).admitted);
        let outcome = decide(&store, &items, 6_000);
        assert!(
            outcome.admitted,
            "an entry exactly 1000 ms old no longer counts"
        );
    }

    #[test]
    fn reset_is_the_exact_retry_after() {
        let store = MemoryStore::new();
        let w = vec![window(3, 10_000)];
        for t in [1_000, 2_000, 3_000] {
            assert!(decide(&store, &[item("a", w.clone(), 1)], t).admitted);
        }
        // Two hits at t=4000 need the two oldest entries (1000, 2000) gone: at 12000.
        let outcome = decide(&store, &[item("a", w.clone(), 2)], 4_000);
        assert!(!outcome.admitted);
        assert_eq!(
            outcome.items[0].windows[0],
            WindowOutcome {
                count: 3,
                reset_ms: 8_000
            }
        );
        assert!(!decide(&store, &[item("a", w.clone(), 2)], 11_999).admitted);
        assert!(decide(&store, &[item("a", w.clone(), 2)], 12_000).admitted);
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

    #[test]
    fn idle_logs_are_dropped() {
        let store = MemoryStore::new();
        assert!(decide(&store, &[item("a", vec![window(5, 1000)], 1)], 0).admitted);
        assert_eq!(store.len(), 1);
        // Touch every shard after the window and the sweep interval have passed.
        for n in 0..2000 {
            decide(
                &store,
                &[item(&format!("x{n}"), vec![window(5, 1000)], 0)],
                60_000,
            );
        }
        assert_eq!(
            store.len(),
            0,
            "check-only requests leave no state, the old log is swept"
        );
        // Without traffic, the periodic sweep drops idle logs.
        assert!(decide(&store, &[item("b", vec![window(5, 1000)], 1)], 100_000).admitted);
        store.sweep(100_999);
        assert_eq!(store.len(), 1, "still inside its window");
        store.sweep(111_000);
        assert_eq!(store.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_drops_idle_logs_and_ends_with_the_store() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let now = Arc::new(AtomicU64::new(0));
        let clock = now.clone();
        let store = MemoryStore::new().with_sweeper(Duration::from_secs(10), move || {
            clock.load(Ordering::SeqCst)
        });
        assert!(decide(&store, &[item("a", vec![window(5, 1000)], 1)], 0).admitted);
        now.store(20_000, Ordering::SeqCst);
        // Paused time: this sleep lets the sweeper's 10 s timer fire, with no real waiting.
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(store.len(), 0, "swept without any request");
        let shards = Arc::downgrade(&store.shards);
        drop(store);
        assert!(
            shards.upgrade().is_none(),
            "the sweeper holds no strong reference"
        );
    }

    /// A sweep at the latest time seen keeps what a request up to a second behind it still
    /// counts: the hits recorded at 10,000 in a 2 s window count for a request at 11,500 even
    /// after a sweep at 12,400 (past their window, within the slack).
    #[test]
    fn a_sweep_keeps_what_a_request_a_second_behind_still_counts() {
        let store = MemoryStore::new();
        let w = vec![window(3, 2000)];
        // Every shard's next sweep at 12,400 (they run every 10 s).
        store.sweep(2_400);
        assert!(decide(&store, &[item("a", w.clone(), 3)], 10_000).admitted);
        store.sweep(12_400);
        assert_eq!(store.len(), 1, "kept through the slack");
        let behind = decide(&store, &[item("a", w.clone(), 1)], 11_500);
        assert!(
            !behind.admitted,
            "the 3 hits at 10,000 are in (9,500, 11,500]"
        );
        // The shard's next sweep (one every 10 s).
        store.sweep(22_400);
        assert_eq!(store.len(), 0, "gone once the slack has passed too");
    }

    #[test]
    fn clock_stepping_back_never_admits_more() {
        let store = MemoryStore::new();
        let w = vec![window(2, 1000)];
        assert!(decide(&store, &[item("a", w.clone(), 1)], 10_000).admitted);
        assert!(decide(&store, &[item("a", w.clone(), 1)], 9_500).admitted);
        assert!(!decide(&store, &[item("a", w.clone(), 1)], 10_900).admitted);
    }

    #[test]
    fn sliding_counter_never_admits_more_and_waits_at_most_a_bucket_longer() {
        let store = MemoryStore::new();
        let counter = |hits| CheckItem {
            algorithm: Algorithm::SlidingCounter { buckets: 10 },
            ..item("c", vec![window(3, 10_000)], hits)
        };
        for t in [5_500, 6_200, 6_300] {
            assert!(decide(&store, &[counter(1)], t).admitted);
        }
        assert!(!decide(&store, &[counter(1)], 14_000).admitted);
        // The exact log would admit now (5,500 is out of (5,600, 15,600]), but bucket 5
        // (5,000..6,000) still overlaps the window: one bucket longer, never more hits.
        let outcome = decide(&store, &[counter(1)], 15_600);
        assert!(!outcome.admitted);
        assert_eq!(
            outcome.items[0].windows[0],
            WindowOutcome {
                count: 3,
                reset_ms: 400
            }
        );
        let outcome = decide(&store, &[counter(1)], 16_000);
        assert!(outcome.admitted);
        assert_eq!(
            outcome.items[0].windows[0].count, 3,
            "buckets 6 (two hits) and 16 (this one)"
        );
        // Constant memory: one bucket per window slice, whatever the hits.
        assert!(decide(&store, &[counter(0)], 16_001).admitted);
    }
}
