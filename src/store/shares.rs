//! Quotas for Envoy's Rate Limit Quota Service: what the limiter hands a store for a bucket's
//! usage report, what the store answers, and the one sharing rule both stores follow (the Redis
//! library's `lua/quota.lua` mirrors [`share`], `tests/differential.rs` holds them to the same
//! answers).
//!
//! A bucket is one descriptor: its reported usage is recorded in the descriptor's window, as
//! `ShouldRateLimit` records an admitted request. Each Envoy stream that reports the bucket is
//! a *holder*, and its assignment is a token bucket of `max_tokens` that refills
//! `tokens_per_fill` every `fill_interval_s` seconds, valid for the assignment's time to live.
//! Such a bucket admits at most `max_tokens` plus what it refills over any interval, so a
//! holder's **cost** in a window of length `W` is `max_tokens + ceil(rate * min(W, horizon))`,
//! the horizon being the time to live and a second of slack. What a holder admitted since its
//! last report is covered by that cost until the report records it in the window. The store
//! keeps, for every window, `count + the holders' costs <= limit`: the limit is never handed
//! out twice, however many Envoys and slidegate replicas share it.
//!
//! The budget a holder may cost is its part of what is left of each window, by the demand it
//! reports (allowed and denied requests a second), at most what it could use (twice its
//! demand over the horizon), and never what other holders already hold. A holder whose last
//! report is older than its time to live (an Envoy gone, or no longer reporting the bucket)
//! holds nothing.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use super::{Algorithm, StoreError, StoreKey, Window};

/// One bucket's usage report, as a store sees it.
#[derive(Clone, Debug)]
pub struct QuotaItem<'a> {
    pub key: StoreKey,
    pub windows: Cow<'a, [Window]>,
    pub algorithm: Algorithm,
    /// The stream that reports: unique to a slidegate process and stream.
    pub holder: &'a str,
    /// Requests the Envoy admitted since its last report: recorded in the window.
    pub allowed: u64,
    pub denied: u64,
    /// Since the holder's last report of the bucket (0 in its first).
    pub elapsed_ms: u64,
}

/// What a holder is assigned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// A token bucket: up to `max_tokens` at once, refilled by `tokens_per_fill` every
    /// `fill_interval_s` seconds.
    TokenBucket {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_interval_s: u32,
    },
    /// A window's limit is used up: nothing until its count falls.
    Full,
    /// What is left of the limit is held by other holders, or less than a request's worth.
    Held,
}

/// A store's answer to one bucket's report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaOutcome {
    pub grant: Grant,
    /// Per window, in the rule's order: the hits inside it after the report was recorded.
    pub counts: Vec<u64>,
}

pub type QuotaFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<QuotaOutcome>, StoreError>> + Send + 'a>>;

/// What a store keeps of one holder of a bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    /// When its assignment ends (its time to live and a second), ms since the epoch.
    pub expires_ms: u64,
    pub max_tokens: u64,
    pub tokens_per_fill: u64,
    pub fill_interval_s: u64,
    /// Requests (allowed and denied) a thousand seconds: its recent demand.
    pub demand: u64,
}

impl Holder {
    /// The most it can admit in a window of `tau_ms` (the window or the horizon, the shorter).
    pub fn cost(&self, tau_ms: u64) -> u64 {
        if self.max_tokens == 0 {
            return 0;
        }
        let per = self.fill_interval_s.max(1) * 1000;
        self.max_tokens + (self.tokens_per_fill * tau_ms).div_ceil(per)
    }
}

/// The longest `time_elapsed` a report is read as (an Envoy's clock or a bad client), and the
/// most requests one report counts: beyond these a figure says nothing more of demand.
pub const MOST_ELAPSED_MS: u64 = 3_600_000;
pub const MOST_REPORTED: u64 = 1_000_000_000;
/// The budget of the smallest assignment: one request now, and a slow refill.
const LEAST_BUDGET: i64 = 2;
/// The fill intervals tried for a rate of a request a second or more.
const FILL_INTERVALS: u64 = 10;

/// The horizon a holder's cost covers: its assignment's time to live and a second (Envoy's
/// timers fire a few ms late; a report in flight).
pub fn horizon_ms(ttl_ms: u64) -> u64 {
    ttl_ms + 1000
}

/// What one report tells of its holder's demand, requests a thousand seconds: its own rate,
/// at least half what it was (a quiet report does not drop a busy holder at once); a new
/// holder (no `previous`) is taken to want as much as the others do on average, until its
/// reports say otherwise.
pub fn demand(
    allowed: u64,
    denied: u64,
    elapsed_ms: u64,
    previous: Option<u64>,
    others: &[Holder],
) -> u64 {
    let reported = allowed.min(MOST_REPORTED) + denied.min(MOST_REPORTED);
    let measured = reported * 1_000_000 / elapsed_ms.clamp(1000, MOST_ELAPSED_MS);
    match previous {
        Some(previous) => measured.max(previous / 2),
        None if others.is_empty() => measured,
        None => {
            let total: u64 = others.iter().map(|h| h.demand).sum();
            measured.max(total / others.len() as u64)
        }
    }
}

/// The sharing rule: for a holder reporting with `demand`, given the windows' counts after its
/// report and the other holders that have not expired, its grant and what it holds now (its
/// cost in every window within its budget; a holder with no grant holds nothing, its demand
/// still counted by the others). The fair part and the need are computed in `f64`, in the same
/// order of operations as the Lua library's doubles, so that both stores answer alike; both
/// are far below 2^53.
#[allow(clippy::cast_possible_truncation)]
pub fn share(
    windows: &[Window],
    counts: &[u64],
    others: &[Holder],
    demand: u64,
    ttl_ms: u64,
    now_ms: u64,
) -> (Grant, Holder) {
    let horizon = horizon_ms(ttl_ms);
    let mut held = Holder {
        expires_ms: now_ms + horizon,
        demand,
        ..Holder::default()
    };
    let total_demand: u64 = demand + others.iter().map(|h| h.demand).sum::<u64>();
    let mut budgets: Vec<(i64, u64)> = Vec::with_capacity(windows.len());
    for (w, &count) in windows.iter().zip(counts) {
        let remaining = i64::from(w.limit) - i64::try_from(count).unwrap_or(i64::MAX);
        if remaining <= 0 {
            return (Grant::Full, held);
        }
        let tau = w.length_ms.min(horizon);
        let others_cost: u64 = others.iter().map(|h| h.cost(tau)).sum();
        let room = remaining - i64::try_from(others_cost).unwrap_or(i64::MAX);
        let fair = if total_demand == 0 {
            remaining
        } else {
            (remaining as f64 * (demand as f64 / total_demand as f64)).floor() as i64
        };
        let need = (demand as f64 * tau as f64 / 500_000.0).floor() as i64 + LEAST_BUDGET;
        let budget = room.min(LEAST_BUDGET.max(fair.min(need)));
        if budget < LEAST_BUDGET {
            return (Grant::Held, held);
        }
        budgets.push((budget, tau));
    }
    let (max_tokens, tokens_per_fill, fill_interval_s) = token_bucket(&budgets);
    held.max_tokens = max_tokens;
    held.tokens_per_fill = tokens_per_fill;
    held.fill_interval_s = fill_interval_s;
    let grant = Grant::TokenBucket {
        max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
        tokens_per_fill: u32::try_from(tokens_per_fill).unwrap_or(u32::MAX),
        fill_interval_s: u32::try_from(fill_interval_s).unwrap_or(u32::MAX),
    };
    (grant, held)
}

/// The token bucket whose cost stays within every `(budget, tau)` (each budget at least
/// [`LEAST_BUDGET`]): a fifth of the smallest budget (at least one) kept for a burst, the
/// fastest refill the rest allows, then whatever the refill leaves of every budget as its
/// burst. Answers (max_tokens, tokens_per_fill, fill_interval_s).
fn token_bucket(budgets: &[(i64, u64)]) -> (u64, u64, u64) {
    let least = budgets
        .iter()
        .map(|&(b, _)| b)
        .min()
        .unwrap_or(LEAST_BUDGET);
    let burst = (least / 5).max(1);
    // What the refill may cost in each window: at least one token (each budget is at least 2).
    let spare = |b: i64| u64::try_from(b - burst).unwrap_or(1).max(1);
    let per_second = |interval: u64| {
        budgets
            .iter()
            .map(|&(b, tau)| spare(b) * 1000 * interval / tau)
            .min()
    };
    let (mut fill, mut interval) = (0, 1);
    if per_second(1).unwrap_or(0) >= 1 {
        for i in 1..=FILL_INTERVALS {
            let f = per_second(i).unwrap_or(0);
            if f * interval > fill * i {
                (fill, interval) = (f, i);
            }
        }
    } else {
        fill = 1;
        interval = budgets
            .iter()
            .map(|&(b, tau)| tau.div_ceil(spare(b) * 1000))
            .max()
            .unwrap_or(1)
            .max(1);
    }
    let refill = |tau: u64| (fill * tau).div_ceil(interval * 1000);
    let max_tokens = budgets
        .iter()
        .map(|&(b, tau)| u64::try_from(b).unwrap_or(0).saturating_sub(refill(tau)))
        .min()
        .unwrap_or(1)
        .max(1);
    (max_tokens, fill, interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(limit: u32, length_ms: u64) -> Window {
        Window { limit, length_ms }
    }

    /// Every grant costs at most its budget in every window, whatever the counts, holders and
    /// demands: over many shapes, the holder's cost plus the others' plus the count never
    /// passes a window's limit.
    #[test]
    fn a_grant_never_hands_out_what_is_held() {
        let mut seed: u64 = 0x5eed;
        let mut next = |below: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % below
        };
        let (mut granted, mut full, mut held_elsewhere) = (0, 0, 0);
        for _ in 0..20_000 {
            let windows: Vec<Window> = (0..1 + next(2))
                .map(|_| {
                    window(
                        1 + u32::try_from(next(200)).unwrap(),
                        1_000 * (1 + next(120)),
                    )
                })
                .collect();
            let counts: Vec<u64> = windows
                .iter()
                .map(|w| next(u64::from(w.limit) + 2))
                .collect();
            let others: Vec<Holder> = (0..next(4))
                .map(|_| Holder {
                    expires_ms: 0,
                    max_tokens: next(4),
                    tokens_per_fill: 1 + next(3),
                    fill_interval_s: 1 + next(5),
                    demand: next(20_000),
                })
                .collect();
            let ttl = 1_000 * (1 + next(20));
            let demand = demand(next(50), next(50), 1000 * next(10), None, &others);
            let (grant, holder) = share(&windows, &counts, &others, demand, ttl, 0);
            for (w, &count) in windows.iter().zip(&counts) {
                let tau = w.length_ms.min(horizon_ms(ttl));
                let others_cost: u64 = others.iter().map(|h| h.cost(tau)).sum();
                let fits = count + others_cost + holder.cost(tau) <= u64::from(w.limit);
                match grant {
                    Grant::TokenBucket { .. } => assert!(
                        fits,
                        "{windows:?} {counts:?} {others:?} {demand}: {grant:?}"
                    ),
                    _ => assert_eq!(holder.cost(tau), 0),
                }
            }
            match grant {
                Grant::TokenBucket {
                    max_tokens,
                    tokens_per_fill,
                    fill_interval_s,
                } => {
                    assert!(max_tokens >= 1 && tokens_per_fill >= 1 && fill_interval_s >= 1);
                    granted += 1;
                }
                Grant::Full => full += 1,
                Grant::Held => held_elsewhere += 1,
            }
        }
        assert!(
            granted > 1000 && full > 1000 && held_elsewhere > 1000,
            "{granted} granted, {full} full, {held_elsewhere} held"
        );
    }

    /// Two holders of equal demand get about half each; one of twice the demand about twice
    /// the other's rate.
    #[test]
    fn shares_follow_demand() {
        let windows = [window(600, 60_000)];
        let ttl = 10_000;
        let rate = |grant: Grant| match grant {
            Grant::TokenBucket {
                tokens_per_fill,
                fill_interval_s,
                ..
            } => f64::from(tokens_per_fill) / f64::from(fill_interval_s),
            other => panic!("{other:?}"),
        };
        let (first, a) = share(&windows, &[0], &[], 10_000, ttl, 0);
        // Alone, it may hold up to twice its demand over the horizon.
        assert!(rate(first) <= 20.0, "{first:?}");
        let (second, b) = share(&windows, &[0], &[a], 20_000, ttl, 0);
        let (again, _) = share(&windows, &[0], &[b], 10_000, ttl, 0);
        assert!(
            rate(second) > 1.5 * rate(again),
            "{second:?} against {again:?}"
        );
    }

    #[test]
    fn a_used_up_window_or_a_held_limit_grants_nothing() {
        let windows = [window(30, 60_000)];
        assert_eq!(share(&windows, &[30], &[], 1_000, 10_000, 0).0, Grant::Full);
        let holder = Holder {
            expires_ms: 0,
            max_tokens: 20,
            tokens_per_fill: 1,
            fill_interval_s: 1,
            demand: 1_000,
        };
        assert_eq!(
            share(&windows, &[0], &[holder], 1_000, 10_000, 0).0,
            Grant::Held
        );
    }

    /// A new holder is taken to want what the others want on average; a known one keeps half
    /// its demand through a quiet report.
    #[test]
    fn demand_of_new_and_quiet_holders() {
        let busy = Holder {
            demand: 10_000,
            ..Holder::default()
        };
        assert_eq!(demand(0, 1, 0, None, &[busy, busy]), 10_000);
        assert_eq!(demand(0, 1, 0, None, &[]), 1_000);
        assert_eq!(demand(0, 0, 5_000, Some(10_000), &[]), 5_000);
        assert_eq!(demand(30, 20, 5_000, Some(10_000), &[]), 10_000);
        // Absurd figures are bounded, never overflow.
        assert!(demand(u64::MAX, u64::MAX, u64::MAX, Some(u64::MAX), &[]) > 0);
    }
}
