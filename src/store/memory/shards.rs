//! The embedded store's shards: descriptors spread over a fixed number of maps, each behind its
//! own mutex, so unrelated descriptors do not contend; the order a batch locks them in, so two
//! batches never wait on each other in a cycle; and the sweep that drops state no window or
//! ban needs any more, on access and from a task of its own.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::Slot;

const SHARDS: usize = 64;
/// How often a shard drops idle logs, at the latest (checked on access, and by the sweeper).
const SWEEP_EVERY_MS: u64 = 10_000;
/// How long idle state is kept past the moment no window needs it: the 1 s the Redis keys
/// outlive their data too (their TTLs), so that a request whose time is up to this much
/// behind the latest one seen (the clock stepped back) counts what it would have counted,
/// on either store.
const CLOCK_SLACK_MS: u64 = 1_000;

pub(super) struct Shards {
    pub(super) shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    /// Most descriptors one shard holds (the store's bound, spread over the shards).
    pub(super) per_shard: usize,
    pub(super) max_keys: usize,
}

pub(super) struct SweeperGuard(pub(super) tokio::task::JoinHandle<()>);

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Default)]
pub(super) struct Shard {
    pub(super) slots: HashMap<String, Slot>,
    next_sweep_ms: u64,
}

/// The shards one batch holds, sorted by index, locked for the whole decision.
pub(super) struct Locked<'s> {
    pub(super) guards: Vec<(usize, MutexGuard<'s, Shard>)>,
}

/// The sweeper task: sweeps every shard every `every`, and ends once the store, the shards'
/// one strong owner, has gone.
pub(super) async fn sweep_forever(
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
    /// Empty shards holding at most `max_keys` descriptors between them.
    pub(super) fn new(max_keys: usize) -> Shards {
        Shards {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            // The bound is kept per shard, so it is never passed (at least one a shard).
            per_shard: (max_keys / SHARDS).max(1),
            max_keys,
        }
    }

    pub(super) fn shard_of(&self, key: &str) -> usize {
        // SHARDS is a power of two, so the mask keeps the index in range; only the low bits
        // of the hash are wanted, so truncating it is the point.
        #[allow(clippy::cast_possible_truncation)]
        let hash = self.hasher.hash_one(key) as usize;
        hash & (SHARDS - 1)
    }

    /// Locks the given shards in index order, so two batches never wait on each other in a
    /// cycle.
    pub(super) fn lock_all(&self, shard_of: &[usize]) -> Locked<'_> {
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

    pub(super) fn sweep(&self, now_ms: u64) {
        // One shard at a time, so requests on other shards never wait for the whole sweep.
        for shard in self.shards.iter() {
            lock(shard).sweep(now_ms);
        }
    }
}

impl Locked<'_> {
    /// The locked shard with index `index`. Every item's shard was locked (and `guards` sorted
    /// by index) before this is called, so the binary search always lands on it.
    pub(super) fn shard(&mut self, index: usize) -> &mut Shard {
        let at = self.guards.partition_point(|(i, _)| *i < index);
        &mut self.guards[at].1
    }
}

pub(super) fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a slot half-written in a way that breaks the
    // invariants we rely on (entries stay sorted, totals only grow), so keep serving.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shard {
    pub(super) fn sweep(&mut self, now_ms: u64) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::store::memory::MemoryStore;
    use crate::store::memory::tests::{decide, item, window};

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
}
