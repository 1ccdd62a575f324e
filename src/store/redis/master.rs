//! A Redis Cluster master's own clients, connected to it alone, and how its calls go: counted in
//! short windows, so that a master whose calls keep failing has the slot map read again (it may
//! have been failed over) and then new clients, however the other masters fare.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::prelude::*;
use tokio::time::Instant;

use super::connection::PoolRecipe;

/// A cluster master and its own clients (`--redis-pool-size` of them), and how its calls go.
pub(super) struct Master {
    pub server: Server,
    pub pool: ArcSwap<Pool>,
    rate: Mutex<Rate>,
    recipe: Arc<PoolRecipe>,
}

/// How long a master's calls are counted together ([`Rate`]).
pub(super) const RATE_WINDOW: Duration = Duration::from_millis(250);

/// The fewest calls in a window that can show a master failing.
const RATE_MIN_CALLS: u32 = 4;

/// How long a master may keep failing before its clients are replaced, at first; doubled after
/// each replacement while it keeps failing, up to [`REPLACE_AT_MOST_EVERY`].
const REPLACE_AFTER: Duration = Duration::from_millis(500);
const REPLACE_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// A master's calls over the current window, and since when its windows have been failing:
/// half its calls or more failed (a timeout, or the master unreachable), of at least
/// [`RATE_MIN_CALLS`]. Other masters' calls do not count: one master failing while the rest
/// answer is found as soon as it fails alone.
struct Rate {
    since: Option<Instant>,
    calls: u32,
    failed: u32,
    failing_since: Option<Instant>,
    replace_after: Duration,
    replacing: bool,
}

/// What a master's failing windows call for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Remedy {
    /// Nothing: the window is not over, or it went well.
    None,
    /// Read the cluster's slots again: a master that fails may have been failed over.
    Refresh,
    /// That, and replace its clients: it has kept failing for a while.
    Replace,
}

impl Rate {
    fn new() -> Rate {
        Rate {
            since: None,
            calls: 0,
            failed: 0,
            failing_since: None,
            replace_after: REPLACE_AFTER,
            replacing: false,
        }
    }

    /// Counts a call at `now`, and says what a window that closed calls for.
    fn note(&mut self, now: Instant, failed: bool) -> Remedy {
        let since = *self.since.get_or_insert(now);
        let mut remedy = Remedy::None;
        if now.saturating_duration_since(since) >= RATE_WINDOW {
            let failing = self.calls >= RATE_MIN_CALLS && self.failed * 2 >= self.calls;
            (self.since, self.calls, self.failed) = (Some(now), 0, 0);
            if failing {
                let failing_since = *self.failing_since.get_or_insert(since);
                let due = now.saturating_duration_since(failing_since) >= self.replace_after;
                remedy = if due && !self.replacing {
                    self.replacing = true;
                    Remedy::Replace
                } else {
                    Remedy::Refresh
                };
            } else {
                self.failing_since = None;
                self.replace_after = REPLACE_AFTER;
            }
        }
        self.calls += 1;
        self.failed += u32::from(failed);
        remedy
    }

    /// A replacement ended: the next one waits twice as long (counted from now) while the
    /// master keeps failing.
    fn replaced(&mut self, now: Instant) {
        self.replacing = false;
        self.replace_after = (self.replace_after * 2).min(REPLACE_AT_MOST_EVERY);
        if self.failing_since.is_some() {
            self.failing_since = Some(now);
        }
    }
}

impl Drop for Master {
    /// A master no longer in the routing (failed over, removed): its clients stop, or they
    /// would try to reconnect to it for ever.
    fn drop(&mut self) {
        let pool = self.pool.load_full();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), pool.quit()).await;
            });
        }
    }
}

impl Master {
    pub fn new(server: Server, pool: Pool, recipe: Arc<PoolRecipe>) -> Master {
        Master {
            server,
            pool: ArcSwap::from_pointee(pool),
            rate: Mutex::new(Rate::new()),
            recipe,
        }
    }

    /// Counts a call to this master; what its failing calls call for, when a window closes.
    pub fn note(&self, failed: bool) -> Remedy {
        lock(&self.rate).note(Instant::now(), failed)
    }

    /// New clients for this master, swapped in once connected (the old ones close); kept as
    /// they are if the new ones cannot connect either.
    pub async fn replace(self: Arc<Self>) {
        let deadline = self.recipe.options.connect_timeout;
        match self.recipe.master(&self.server) {
            Ok(fresh) => match tokio::time::timeout(deadline, fresh.wait_for_connect()).await {
                Ok(Ok(())) => {
                    tracing::warn!(master = %self.server, "a Redis Cluster master's calls kept failing: replaced its clients");
                    let old = self.pool.swap(Arc::new(fresh));
                    let _ = old.quit().await;
                }
                _ => {
                    tracing::warn!(master = %self.server, "a Redis Cluster master's calls keep failing and new clients cannot connect to it either");
                    let _ = fresh.quit().await;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, master = %self.server, "cannot make clients for a cluster master")
            }
        }
        lock(&self.rate).replaced(Instant::now());
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain values: one left by a panicking holder is still usable.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls at `every` ms from `start`, each failing as `fails` says; the remedies asked for.
    fn remedies(rate: &mut Rate, start: Instant, every: u64, fails: &[bool]) -> Vec<Remedy> {
        fails
            .iter()
            .enumerate()
            .map(|(n, &failed)| {
                let at = start + Duration::from_millis(every * n as u64);
                rate.note(at, failed)
            })
            .filter(|r| *r != Remedy::None)
            .collect()
    }

    /// A master whose calls fail: each failing window (250 ms) asks for the slots to be read
    /// again, and once it has failed for half a second, for its clients to be replaced, one
    /// replacement at a time and the next twice as late; a window that goes well clears it;
    /// too few calls show nothing.
    #[test]
    fn a_master_failing_is_refreshed_then_replaced() {
        use Remedy::{Refresh, Replace};
        let ms = |n: u64| Duration::from_millis(n);
        let start = Instant::now();
        let mut rate = Rate::new();
        // Calls 50 ms apart, all failing: windows close at 250 (failing for 250 ms), 500 (for
        // 500 ms: replace), 750 (replacing already).
        let failing = remedies(&mut rate, start, 50, &[true; 16]);
        assert_eq!(failing, [Refresh, Replace, Refresh]);
        let more = remedies(&mut rate, start + ms(800), 50, &[true; 11]);
        assert_eq!(
            more,
            [Refresh, Refresh],
            "no second replacement while one runs"
        );
        // Replaced at 1400 and still failing: the next replacement a second later, no sooner.
        rate.replaced(start + ms(1_400));
        let again = remedies(&mut rate, start + ms(1_400), 50, &[true; 21]);
        assert_eq!(again, [Refresh; 4]);
        let more = remedies(&mut rate, start + ms(2_450), 50, &[true; 6]);
        assert_eq!(more, [Replace]);

        // Two failures of four calls in a window: failing.
        let mut half = Rate::new();
        let mixed = remedies(&mut half, start, 70, &[true, false, true, false, false]);
        assert_eq!(mixed, [Refresh]);
        // A window that goes well clears it.
        let mut cleared = Rate::new();
        assert_eq!(remedies(&mut cleared, start, 50, &[true; 6]), [Refresh]);
        assert!(cleared.failing_since.is_some());
        assert_eq!(remedies(&mut cleared, start + ms(300), 50, &[false; 6]), []);
        assert_eq!(cleared.failing_since, None);
        // Too few calls in a window: nothing, however they went.
        let mut quiet = Rate::new();
        assert_eq!(remedies(&mut quiet, start, 100, &[true; 20]), []);
    }
}
