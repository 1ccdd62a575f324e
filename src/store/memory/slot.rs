//! One descriptor's state, a [`Slot`]: its log (one entry per admitted request, with the
//! running total of hits) or its counters' buckets, and its ban; and the window arithmetic
//! over it (count, trim, record, reset) that the Redis script mirrors, which the
//! conformance suite and `tests/differential.rs` keep identical. The Redis store's admin API
//! builds a slot from what it reads from Redis ([`Slot::held`]) to answer as a decision counts.

use std::collections::VecDeque;

use crate::store::{Algorithm, CheckItem, ItemState, Window, WindowOutcome, longest_ms};

/// One descriptor's state: its log or counters and its ban. The Redis store builds one from what
/// it reads ([`Slot::held`]) to answer as a decision counts.
#[derive(Default)]
pub(crate) struct Slot {
    /// `sliding_counter` rules: hits per bucket.
    buckets: Vec<Bucket>,
    entries: VecDeque<Entry>,
    /// Running total of hits up to and including the last entry trimmed away.
    trimmed_total: u64,
    pub(super) ban_until_ms: u64,
    /// After this the slot holds nothing that any window or ban still needs.
    pub(super) keep_until_ms: u64,
    /// The Envoy streams that hold a share of this descriptor's limit (holders.rs).
    pub(super) holders: Vec<(Box<str>, crate::store::shares::Holder)>,
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
            holders: Vec::new(),
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

    pub(super) fn count(&self, algorithm: Algorithm, window: &Window, now_ms: u64) -> u64 {
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

    pub(super) fn trim(&mut self, algorithm: Algorithm, now_ms: u64, windows: &[Window]) {
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

    pub(super) fn record(
        &mut self,
        algorithm: Algorithm,
        now_ms: u64,
        hits: u64,
        windows: &[Window],
    ) {
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
    use crate::store::WindowOutcome;
    use crate::store::memory::MemoryStore;
    use crate::store::memory::tests::{decide, item, window};
    use crate::store::{Algorithm, CheckItem};

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
