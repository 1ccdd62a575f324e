//! The admin API's inspect reads a descriptor as a decision counts it: after each decision of a
//! long pseudo-random sequence (weights, two windows, both algorithms, bans, requests over
//! several slots rejected and taken back), inspecting at the same moment gives the counts the
//! decision reported, on the embedded store, standalone Redis and Redis Cluster alike.

use std::borrow::Cow;

use slidegate::store::{
    Algorithm, CheckItem, ItemState, MemoryStore, Role, StoreKey, Window, WindowOutcome,
};

use super::*;

fn windows() -> Vec<Window> {
    vec![
        Window {
            limit: 5,
            length_ms: 1_000,
        },
        Window {
            limit: 12,
            length_ms: 5_000,
        },
    ]
}

/// An enforcing sliding-log item of one hit on `key`, in [`windows`].
fn enforced(key: StoreKey) -> CheckItem<'static> {
    CheckItem {
        key,
        windows: Cow::Owned(windows()),
        algorithm: Algorithm::SlidingLog,
        ban_ms: None,
        hits: 1,
        role: Role::Enforce,
        debit: false,
        text: None,
    }
}

/// What one store saw: per step, the inspection of every key.
async fn run(store: Arc<dyn Store>, domain: &str) -> Vec<Vec<ItemState>> {
    let keys: Vec<StoreKey> = (0..4)
        .map(|n| StoreKey::new(&format!("{domain}:user={n}"), ""))
        .collect();
    let algorithm = |n: usize| {
        if n.is_multiple_of(2) {
            Algorithm::SlidingLog
        } else {
            Algorithm::SlidingCounter { buckets: 5 }
        }
    };
    let item = |n: usize, hits: u64| CheckItem {
        algorithm: algorithm(n),
        ban_ms: (n == 2).then_some(700),
        hits,
        ..enforced(keys[n].clone())
    };
    let mut seed: u64 = 0x5eed;
    let mut next = move |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    let mut now = T0;
    let mut seen = Vec::new();
    for _ in 0..300 {
        now += next(120);
        // One to three descriptors (over several slots on a cluster), weights 1 to 3.
        let mut chosen: Vec<usize> = (0..1 + next(3))
            .map(|_| usize::try_from(next(4)).unwrap())
            .collect();
        chosen.sort_unstable();
        chosen.dedup();
        let items: Vec<CheckItem<'_>> = chosen.iter().map(|&n| item(n, 1 + next(3))).collect();
        let decided = store.check(&items, now).await.expect("a decision");
        let all: Vec<CheckItem<'_>> = (0..4).map(|n| item(n, 0)).collect();
        let states = store.inspect(&all, now).await.expect("an inspection");
        for (n, outcome) in chosen.iter().zip(&decided.items) {
            let state = &states[*n];
            if outcome.ban_remaining_ms > 0 {
                assert_eq!(state.ban_remaining_ms, outcome.ban_remaining_ms);
                continue;
            }
            let counts: Vec<u64> = outcome.windows.iter().map(|w| w.count).collect();
            let found: Vec<u64> = state.windows.iter().map(|w| w.count).collect();
            assert_eq!(
                found, counts,
                "descriptor {n} at {now}: {outcome:?} / {state:?}"
            );
            if outcome.fits && decided.admitted {
                let resets: Vec<u64> = outcome.windows.iter().map(|w| w.reset_ms).collect();
                let found: Vec<u64> = state.windows.iter().map(|w| w.reset_ms).collect();
                assert_eq!(found, resets, "descriptor {n} at {now}");
            }
        }
        seen.push(states);
    }
    // Something was counted, banned and rejected along the way.
    let flat: Vec<&ItemState> = seen.iter().flatten().collect();
    assert!(flat.iter().any(|s| s.ban_remaining_ms > 0), "a ban was set");
    assert!(
        flat.iter().any(|s| s.windows.iter().any(|w| w.count >= 5)),
        "a window filled"
    );
    assert!(flat.iter().all(|s| s.windows.len() == 2));
    let empty = WindowOutcome::default();
    assert!(flat.iter().any(|s| s.windows[1] != empty));
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_counts_as_every_store_decides() {
    let memory = run(Arc::new(MemoryStore::new()), &unique_domain("inspect")).await;
    let standalone = run(
        connect(shared_standalone().url(), TEST_TIMEOUT).await,
        &unique_domain("inspect"),
    )
    .await;
    let cluster = run(
        connect(shared_cluster().url(), TEST_TIMEOUT).await,
        &unique_domain("inspect"),
    )
    .await;
    assert_eq!(
        standalone, memory,
        "standalone Redis reads as the embedded store"
    );
    assert_eq!(cluster, memory, "Redis Cluster reads as the embedded store");
}

/// The admin API's calls wait as long as connecting may (`--redis-connect-timeout`, 5 s here),
/// not a decision's `--redis-timeout` (15 ms here): while Redis holds every command for 300 ms,
/// an inspection and a reset are answered once it resumes, and a decision meanwhile fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_wait_past_the_decision_timeout() {
    let redis = RedisProcess::start(&[]);
    let store = connect(redis.url(), Duration::from_millis(15)).await;
    let other = enforced(StoreKey::new("admin-wait:user=2", ""));
    let items = [enforced(StoreKey::new("admin-wait:user=1", ""))];
    assert!(store.check(&items, T0).await.expect("a decision").admitted);

    assert_eq!(redis.cmd("CLIENT PAUSE 300 ALL").trim(), "+OK");
    // (On another key: Redis still runs it once the pause ends.)
    assert!(
        store.check(&[other], T0 + 1).await.is_err(),
        "a decision fails at --redis-timeout while Redis holds commands"
    );
    let states = store.inspect(&items, T0 + 2).await.expect("an inspection");
    assert_eq!(states[0].windows[0].count, 1);

    assert_eq!(redis.cmd("CLIENT PAUSE 300 ALL").trim(), "+OK");
    let started = Instant::now();
    let cleared = store.reset(&[items[0].key.clone()]).await.expect("a reset");
    assert_eq!(cleared, vec![true]);
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "the reset waited for the pause: {:?}",
        started.elapsed()
    );
}
