//! The embedded store against a brute-force model: random batches under an injected clock,
//! every answer field compared. The model keeps every entry and answers by scanning: counts by
//! summing the entries inside each window, resets by trying every moment an entry leaves. So it
//! shares no arithmetic with the store (running totals, binary searches), only the rules.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

use std::borrow::Cow;
use std::collections::HashMap;

use proptest::prelude::*;
use slidegate::store::{
    Algorithm, CheckItem, CheckOutcome, ItemOutcome, MemoryStore, Role, StoreKey, Window,
    WindowOutcome,
};

#[derive(Clone, Debug)]
struct Gen {
    key: u8,
    hits: u64,
    debit: bool,
    ban: bool,
    windows: Vec<(u32, u64)>,
}

#[derive(Default)]
struct Model {
    entries: HashMap<u8, Vec<(u64, u64)>>,
    ban_until: HashMap<u8, u64>,
}

impl Model {
    fn count(&self, key: u8, length: u64, at: u64) -> u64 {
        self.entries.get(&key).map_or(0, |es| {
            es.iter()
                .filter(|(t, _)| *t + length > at)
                .map(|(_, w)| w)
                .sum()
        })
    }

    fn decide(&mut self, batch: &[Gen], now: u64) -> CheckOutcome {
        let mut fits = Vec::new();
        let mut records = Vec::new();
        let mut bans: Vec<(u64, bool)> = Vec::new();
        let mut pending: HashMap<u8, u64> = HashMap::new();
        for g in batch {
            let until = self.ban_until.get(&g.key).copied().unwrap_or(0);
            if until > now {
                fits.push(false);
                records.push(false);
                bans.push((until - now, false));
                continue;
            }
            let p = pending.get(&g.key).copied().unwrap_or(0);
            let size = if g.debit && g.hits == 0 { 1 } else { g.hits };
            let counts: Vec<u64> = g
                .windows
                .iter()
                .map(|(_, len)| self.count(g.key, *len, now) + p)
                .collect();
            let fit = g
                .windows
                .iter()
                .zip(&counts)
                .all(|((l, _), c)| c + size <= u64::from(*l));
            let room = g
                .windows
                .iter()
                .zip(&counts)
                .all(|((l, _), c)| *c < u64::from(*l));
            let mut record = g.hits > 0 && (fit || (g.debit && room));
            let mut ban = (0, false);
            if !fit && g.ban {
                self.ban_until.insert(g.key, now + 5_000);
                ban = (5_000, true);
                record = false;
            }
            if record {
                *pending.entry(g.key).or_default() += g.hits;
            }
            fits.push(fit);
            records.push(record);
            bans.push(ban);
        }
        let admitted = fits.iter().all(|f| *f);
        for (n, g) in batch.iter().enumerate() {
            records[n] = records[n] && (admitted || g.debit);
            if records[n] {
                self.entries.entry(g.key).or_default().push((now, g.hits));
            }
        }
        let items = batch
            .iter()
            .enumerate()
            .map(|(n, g)| {
                if bans[n].0 > 0 {
                    return ItemOutcome {
                        recorded: false,
                        ban_remaining_ms: bans[n].0,
                        ban_set: bans[n].1,
                        fits: false,
                        windows: Vec::new(),
                    };
                }
                let size = if g.debit && g.hits == 0 { 1 } else { g.hits };
                let windows = g
                    .windows
                    .iter()
                    .map(|(limit, len)| self.window(g.key, *limit, *len, now, fits[n], size))
                    .collect();
                ItemOutcome {
                    recorded: records[n],
                    ban_remaining_ms: 0,
                    ban_set: false,
                    fits: fits[n],
                    windows,
                }
            })
            .collect();
        CheckOutcome { admitted, items }
    }

    /// A window's state after the call, by scanning.
    fn window(
        &self,
        key: u8,
        limit: u32,
        len: u64,
        now: u64,
        fits: bool,
        size: u64,
    ) -> WindowOutcome {
        let count = self.count(key, len, now);
        let inside: Vec<u64> = self
            .entries
            .get(&key)
            .map(|es| {
                es.iter()
                    .map(|(t, _)| *t)
                    .filter(|t| t + len > now)
                    .collect()
            })
            .unwrap_or_default();
        let reset_ms = if fits {
            inside.iter().min().map_or(0, |t| t + len - now)
        } else if count + size <= u64::from(limit) {
            0
        } else if size > u64::from(limit) {
            len
        } else {
            // The first moment an entry leaves after which the request fits.
            let mut moments: Vec<u64> = inside.iter().map(|t| t + len).collect();
            moments.sort_unstable();
            moments
                .into_iter()
                .find(|at| self.count(key, len, *at) + size <= u64::from(limit))
                .map_or(len, |at| at - now)
        };
        WindowOutcome { count, reset_ms }
    }
}

fn batch_item() -> impl Strategy<Value = Gen> {
    (
        0u8..3,
        prop_oneof![Just(0u64), 1u64..4, 4u64..12],
        any::<bool>(),
        prop::bool::weighted(0.15),
        prop::collection::vec(
            (
                1u32..12,
                prop_oneof![Just(1_000u64), Just(3_000), 500u64..4_000],
            ),
            1..3,
        ),
    )
        .prop_map(|(key, hits, debit, ban, windows)| Gen {
            key,
            hits,
            debit,
            ban,
            windows,
        })
}

fn item(g: &Gen) -> CheckItem<'static> {
    CheckItem {
        key: StoreKey::new(&format!("model:k={}", g.key), ""),
        windows: Cow::Owned(
            g.windows
                .iter()
                .map(|(limit, length_ms)| Window {
                    limit: *limit,
                    length_ms: *length_ms,
                })
                .collect(),
        ),
        algorithm: Algorithm::SlidingLog,
        ban_ms: g.ban.then_some(5_000),
        hits: g.hits,
        role: Role::Enforce,
        debit: g.debit,
        text: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_embedded_store_answers_as_the_model(
        steps in prop::collection::vec((0u64..1_500, prop::collection::vec(batch_item(), 1..3)), 1..40)
    ) {
        // A key keeps the same windows and ban in every batch, as a rule would.
        let mut shapes: HashMap<u8, (Vec<(u32, u64)>, bool)> = HashMap::new();
        let store = MemoryStore::new();
        let mut model = Model::default();
        let mut now = 1_767_225_600_000u64;
        for (advance, batch) in steps {
            now += advance;
            let batch: Vec<Gen> = batch
                .into_iter()
                .map(|mut g| {
                    let (windows, ban) = shapes.entry(g.key).or_insert((g.windows.clone(), g.ban)).clone();
                    g.windows = windows;
                    g.ban = ban;
                    g
                })
                .collect();
            let items: Vec<CheckItem<'static>> = batch.iter().map(item).collect();
            let got = futures_util::FutureExt::now_or_never(slidegate::store::Store::check(&store, &items, now))
                .expect("the embedded store never waits")
                .expect("room");
            let want = model.decide(&batch, now);
            prop_assert_eq!(got, want, "at {} for {:?}", now, batch);
        }
    }
}
