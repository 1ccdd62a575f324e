//! The over-limit cache changes no decision: random request sequences through two limiters,
//! one with the cache and one without, each on its own embedded store under one injected
//! clock, must get the same overall code and the same code per descriptor at every step, and
//! the cached one must have answered some of them without its store. Then the same with two
//! replicas sharing one store, where only the limit holds: never more admitted in any window
//! than the limit.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use slidegate::limiter::{
    CallResult, Descriptor, DescriptorReport, Limiter, LimiterOptions, ManualClock, Observer,
    Request,
};
use slidegate::store::MemoryStore;

/// Counts the descriptors answered from the cache.
#[derive(Default)]
struct Cached(AtomicUsize);

impl Observer for Cached {
    fn call(&self, _: CallResult, _: Duration) {}
    fn descriptor(&self, report: &DescriptorReport<'_>) {
        self.0
            .fetch_add(usize::from(report.from_cache), Ordering::Relaxed);
    }
    fn unknown_domain(&self) {}
    fn global_shadow(&self) {}
    fn store_call(&self, _: &'static str, _: Duration, _: bool) {}
}

const CONFIG: &str = "domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: pair
    rate_limits:
      - {unit: second, requests_per_unit: 2}
      - {unit: minute, requests_per_unit: 5}
  - key: banned
    rate_limit: {unit: minute, requests_per_unit: 2}
    ban: 90s
";

#[derive(Clone, Debug)]
enum Step {
    /// Descriptors by index into `DESCRIPTORS`, each with its hits.
    Call(Vec<(usize, u64)>),
    Advance(u64),
}

const DESCRIPTORS: [(&str, &str); 5] = [
    ("k", "a"),
    ("k", "b"),
    ("pair", "p"),
    ("banned", "u"),
    ("unlimited", "x"),
];

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => prop::collection::vec((0..DESCRIPTORS.len(), 1u64..=2), 1..=3).prop_map(Step::Call),
        1 => (0u64..40_000).prop_map(Step::Advance),
    ]
}

fn request(call: &[(usize, u64)]) -> Request {
    Request {
        domain: "d".into(),
        descriptors: call
            .iter()
            .map(|&(n, hits)| Descriptor {
                entries: vec![(DESCRIPTORS[n].0.into(), DESCRIPTORS[n].1.into())],
                limit: None,
                hits_addend: Some(hits),
            })
            .collect(),
        hits_addend: 0,
    }
}

fn limiter(clock: &ManualClock, store: Arc<MemoryStore>, cache: usize) -> Limiter {
    let limits = slidegate::config::compile_sources(&[("t.yaml".into(), CONFIG.into())]).unwrap();
    Limiter::new(
        limits,
        store,
        Arc::new(clock.clone()),
        LimiterOptions {
            over_limit_cache: cache,
            ..LimiterOptions::default()
        },
    )
}

fn run(steps: &[Step]) -> (usize, usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let clock = ManualClock::new(1_767_225_600_000);
    let counter = Arc::new(Cached::default());
    let cached =
        limiter(&clock, Arc::new(MemoryStore::new()), 1_000).with_observer(counter.clone());
    let plain = limiter(&clock, Arc::new(MemoryStore::new()), 0);
    let mut calls = 0;
    for step in steps {
        match step {
            Step::Advance(ms) => clock.advance(*ms),
            Step::Call(call) => {
                let r = request(call);
                let a = runtime.block_on(cached.should_rate_limit(&r)).unwrap();
                let b = runtime.block_on(plain.should_rate_limit(&r)).unwrap();
                let codes = |d: &slidegate::limiter::Decision| {
                    (
                        d.overall,
                        d.statuses.iter().map(|s| s.code).collect::<Vec<_>>(),
                    )
                };
                assert_eq!(codes(&a), codes(&b), "step {calls}: {call:?}");
                calls += 1;
            }
        }
    }
    (calls, counter.0.load(Ordering::Relaxed))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn the_cache_changes_no_decision(steps in prop::collection::vec(step(), 1..80)) {
        run(&steps);
    }
}

/// A fixed sequence that certainly uses the cache (so the property above is not vacuous).
#[test]
fn the_property_exercises_the_cache() {
    let mut steps = Vec::new();
    for _ in 0..10 {
        steps.push(Step::Call(vec![(0, 1)]));
        steps.push(Step::Call(vec![(0, 1), (2, 1)]));
        steps.push(Step::Call(vec![(3, 1)]));
        steps.push(Step::Advance(7_000));
    }
    let (calls, from_cache) = run(&steps);
    assert!(
        from_cache >= calls / 3,
        "{from_cache} descriptors from the cache in {calls} calls"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// Two replicas with caches on one store: whatever they answer, `k=a` never has more than
    /// 4 hits admitted in any minute.
    #[test]
    fn replicas_with_caches_never_over_admit(
        steps in prop::collection::vec((any::<bool>(), 1u64..=2, 0u64..20_000), 1..120),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let clock = ManualClock::new(1_767_225_600_000);
        let store = Arc::new(MemoryStore::new());
        let replicas = [limiter(&clock, store.clone(), 1_000), limiter(&clock, store, 1_000)];
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (which, hits, advance) in steps {
            clock.advance(advance);
            let r = request(&[(0, hits)]);
            let d = runtime.block_on(replicas[usize::from(which)].should_rate_limit(&r)).unwrap();
            if d.overall == slidegate::limiter::Code::Ok {
                let now = slidegate::limiter::Clock::now_ms(&clock);
                admitted.push((now, hits));
                let in_window: u64 = admitted
                    .iter()
                    .filter(|(t, _)| t + 60_000 > now)
                    .map(|(_, h)| h)
                    .sum();
                prop_assert!(in_window <= 4, "{in_window} admitted in a minute");
            }
        }
    }
}
