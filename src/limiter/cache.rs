//! The exact local over-limit cache: descriptors the store just found over their limit, and
//! until when they stay over, so a request for one is answered without asking the store.
//!
//! Why it is exact: a log only grows until its entries age out (a rejected request records
//! nothing), so once the store says "this request's hits fit again in `reset` ms", no replica
//! can make them fit sooner: other replicas can only add entries, which moves that moment
//! later, never earlier. Until then, a request for the descriptor with at least as many hits is
//! over too, and the cache answers it so; past it, the store decides again. The cache therefore
//! never admits what the store would reject. The one way capacity frees early is a rejected
//! cross-slot request taking its tentative entries back out of a Redis Cluster slot (or a
//! config reload, which clears the cache): then the cache can only delay an admission, by at
//! most the time that entry would have stayed in the window.
//!
//! What is cached: enforcing descriptors (not shadow, not quota, not debits) that did not fit,
//! keyed by their store key and windows; a lookup must match both and ask for at least the
//! hits that did not fit. The reported reset counts down from the store's; when smaller
//! requests are admitted meanwhile the true reset for this size can only be later.
//! Bounded: a full shard first drops what has expired, then evicts an entry.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::store::{CheckItem, ItemOutcome, Role, Window, WindowOutcome};

const SHARDS: usize = 16;

/// One descriptor known to be over.
#[derive(Clone, Debug)]
struct Entry {
    windows: Vec<Window>,
    /// The hits that did not fit: a request with as many is over too.
    size: u64,
    /// Until when (ms since the epoch, the limiter's clock) it stays over.
    until_ms: u64,
    /// When each window's reset ends (0: that window had room), and when a ban ends.
    window_ends: Vec<(u64, u64)>,
    ban_end_ms: u64,
    generation: u64,
}

/// Bounded, sharded, cleared on config reload.
pub struct OverLimitCache {
    shards: Vec<Mutex<HashMap<String, Entry>>>,
    per_shard: usize,
    len: AtomicUsize,
    generation: AtomicU64,
    /// The longest an entry answers before the store is asked again.
    hold_ms: u64,
    hasher: std::collections::hash_map::RandomState,
}

impl OverLimitCache {
    /// A cache of at most about `capacity` descriptors (0: disabled).
    pub fn new(capacity: usize, hold_ms: Option<u64>) -> OverLimitCache {
        OverLimitCache {
            hold_ms: hold_ms.unwrap_or(u64::MAX),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS),
            len: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.per_shard > 0
    }

    /// Descriptors held now.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The generation of the rules in force: an entry made under older rules is never used.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        for shard in &self.shards {
            let mut map = lock(shard);
            self.len.fetch_sub(map.len(), Ordering::Relaxed);
            map.clear();
        }
    }

    /// Forgets one descriptor (its windows and ban were reset).
    pub fn forget(&self, key: &str) {
        if lock(self.shard(key)).remove(key).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Entry>> {
        // Fewer than 2^64 shards: the remainder fits.
        let n = usize::try_from(self.hasher.hash_one(key) % SHARDS as u64).unwrap_or(0);
        &self.shards[n]
    }

    /// The outcome the store gave `item`, counted down to `now_ms`, if it is known to be over.
    pub fn get(&self, item: &CheckItem<'_>, now_ms: u64) -> Option<ItemOutcome> {
        if !cacheable(item) {
            return None;
        }
        let generation = self.generation();
        let map = lock(self.shard(item.key.as_str()));
        let entry = map.get(item.key.as_str())?;
        let usable = entry.generation == generation
            && now_ms < entry.until_ms
            && item.size() == entry.size
            && *entry.windows == *item.windows;
        usable.then(|| ItemOutcome {
            recorded: false,
            ban_remaining_ms: entry.ban_end_ms.saturating_sub(now_ms),
            ban_set: false,
            fits: false,
            windows: if entry.ban_end_ms > now_ms {
                Vec::new()
            } else {
                entry
                    .window_ends
                    .iter()
                    .map(|&(count, end)| WindowOutcome {
                        count,
                        reset_ms: end.saturating_sub(now_ms),
                    })
                    .collect()
            },
        })
    }

    /// Remembers `item` if the store found it over (`outcome`, decided at `now_ms` under rules
    /// of `generation`).
    pub fn insert(
        &self,
        item: &CheckItem<'_>,
        outcome: &ItemOutcome,
        now_ms: u64,
        generation: u64,
    ) {
        if !self.enabled() || !cacheable(item) || outcome.fits || outcome.recorded {
            return;
        }
        let ban_end_ms = if outcome.ban_remaining_ms > 0 {
            now_ms.saturating_add(outcome.ban_remaining_ms)
        } else {
            0
        };
        let window_ends: Vec<(u64, u64)> = outcome
            .windows
            .iter()
            .map(|w| {
                let end = if w.reset_ms > 0 {
                    now_ms.saturating_add(w.reset_ms)
                } else {
                    0
                };
                (w.count, end)
            })
            .collect();
        let until_ms = window_ends
            .iter()
            .map(|&(_, end)| end)
            .chain([ban_end_ms])
            .max()
            .unwrap_or(0);
        let until_ms = until_ms.min(now_ms.saturating_add(self.hold_ms));
        if until_ms <= now_ms {
            return;
        }
        let entry = Entry {
            windows: item.windows.to_vec(),
            size: item.size(),
            until_ms,
            window_ends,
            ban_end_ms,
            generation,
        };
        let mut map = lock(self.shard(item.key.as_str()));
        if generation != self.generation() {
            // The rules changed while the store decided.
            return;
        }
        if map.len() >= self.per_shard && !map.contains_key(item.key.as_str()) {
            let before = map.len();
            map.retain(|_, e| e.until_ms > now_ms && e.generation == generation);
            self.len.fetch_sub(before - map.len(), Ordering::Relaxed);
            if map.len() >= self.per_shard {
                // Still full of live entries: make room with an arbitrary one (losing it only
                // costs one store call).
                if let Some(victim) = map.keys().next().cloned() {
                    map.remove(&victim);
                    self.len.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        if map.insert(item.key.as_str().to_owned(), entry).is_none() {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Only an enforcing descriptor that records nothing when over (not a debit) can be answered
/// without the store, and only for hits it was judged on.
fn cacheable(item: &CheckItem<'_>) -> bool {
    item.role == Role::Enforce && !item.debit && item.size() > 0
}

fn lock(
    shard: &Mutex<HashMap<String, Entry>>,
) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
    // A map left by a panicking holder is still a map of valid entries.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::store::{Algorithm, StoreKey};

    fn item(key: &str, hits: u64, limit: u32) -> CheckItem<'static> {
        CheckItem {
            key: StoreKey::new(key, ""),
            windows: Cow::Owned(vec![Window {
                limit,
                length_ms: 60_000,
            }]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits,
            role: Role::Enforce,
            debit: false,
            text: None,
        }
    }

    fn over(count: u64, reset_ms: u64) -> ItemOutcome {
        ItemOutcome {
            fits: false,
            windows: vec![WindowOutcome { count, reset_ms }],
            ..ItemOutcome::default()
        }
    }

    #[test]
    fn answers_until_the_reset_for_as_many_hits() {
        let cache = OverLimitCache::new(100, None);
        cache.insert(
            &item("a", 2, 10),
            &over(9, 5_000),
            1_000,
            cache.generation(),
        );
        let found = cache.get(&item("a", 2, 10), 3_000).expect("over");
        assert!(!found.fits);
        assert_eq!(found.windows[0].reset_ms, 3_000, "counts down");
        assert!(cache.get(&item("a", 2, 10), 5_999).is_some());
        assert!(
            cache.get(&item("a", 5, 10), 3_000).is_none(),
            "more hits: a later reset, the store's to say"
        );
        assert!(
            cache.get(&item("a", 1, 10), 3_000).is_none(),
            "fewer hits may fit"
        );
        assert!(
            cache.get(&item("a", 2, 10), 6_000).is_none(),
            "the reset has come"
        );
        assert!(
            cache.get(&item("a", 2, 20), 3_000).is_none(),
            "another limit"
        );
        assert!(cache.get(&item("b", 2, 10), 3_000).is_none());
    }

    /// With the admin API on, an entry answers for at most the hold, and a reset forgets it.
    #[test]
    fn a_hold_bounds_an_entry_and_a_reset_forgets_it() {
        let cache = OverLimitCache::new(100, Some(1_000));
        cache.insert(&item("a", 1, 10), &over(10, 50_000), 0, 0);
        let found = cache
            .get(&item("a", 1, 10), 999)
            .expect("over within the hold");
        assert_eq!(
            found.windows[0].reset_ms, 49_001,
            "the store's reset, counted down"
        );
        assert!(
            cache.get(&item("a", 1, 10), 1_000).is_none(),
            "asks the store again"
        );
        cache.insert(&item("b", 1, 10), &over(10, 50_000), 0, 0);
        assert_eq!(cache.len(), 2);
        cache.forget(StoreKey::new("b", "").as_str());
        assert!(cache.get(&item("b", 1, 10), 1).is_none());
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn bans_shadow_debits_and_fitting_items() {
        let cache = OverLimitCache::new(100, None);
        let banned = ItemOutcome {
            fits: false,
            ban_remaining_ms: 900_000,
            ban_set: true,
            ..ItemOutcome::default()
        };
        cache.insert(&item("ban", 1, 10), &banned, 0, 0);
        let found = cache.get(&item("ban", 1, 10), 100_000).expect("banned");
        assert_eq!(found.ban_remaining_ms, 800_000);
        assert!(!found.ban_set, "the ban was set by an earlier request");

        let mut shadow = item("s", 1, 10);
        shadow.role = Role::Shadow;
        cache.insert(&shadow, &over(10, 1_000), 0, 0);
        let mut debit = item("d", 1, 10);
        debit.debit = true;
        cache.insert(&debit, &over(10, 1_000), 0, 0);
        cache.insert(
            &item("fits", 1, 10),
            &ItemOutcome {
                fits: true,
                ..over(1, 1_000)
            },
            0,
            0,
        );
        cache.insert(&item("check", 0, 10), &over(10, 1_000), 0, 0);
        assert_eq!(cache.len(), 1, "only the banned one");
    }

    #[test]
    fn a_reload_clears_and_stale_inserts_are_dropped() {
        let cache = OverLimitCache::new(100, None);
        let before = cache.generation();
        cache.insert(&item("a", 1, 10), &over(10, 5_000), 0, before);
        cache.clear();
        assert!(cache.get(&item("a", 1, 10), 1).is_none());
        assert!(cache.is_empty());
        // Decided under the old rules, inserted after the reload.
        cache.insert(&item("a", 1, 10), &over(10, 5_000), 0, before);
        assert!(cache.get(&item("a", 1, 10), 1).is_none());
    }

    #[test]
    fn bounded() {
        let cache = OverLimitCache::new(32, None);
        for n in 0..1_000 {
            cache.insert(&item(&format!("k{n}"), 1, 10), &over(10, 60_000), 0, 0);
        }
        assert!(cache.len() <= 32, "{}", cache.len());
        assert!(
            cache.get(&item("k999", 1, 10), 1).is_some(),
            "the newest is kept"
        );
        let off = OverLimitCache::new(0, None);
        off.insert(&item("a", 1, 10), &over(10, 5_000), 0, 0);
        assert!(off.is_empty());
    }
}
