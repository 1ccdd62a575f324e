//! Differential test: the embedded store and the Lua script on a real standalone Redis are given
//! the same random request sequences under the same injected clock, and must give the same
//! answer, field by field (overall code, every status, response headers, dynamic metadata).
//! Windows, several windows per rule, bans, sliding counters (two windows sharing a bucket
//! length), shadow and quota rules, debits (token budgets), overrides, weighted per-descriptor
//! hits (a few, and thousands on a rule of 5,000), repeated descriptors in one request and
//! requests from a replica whose clock is behind are all in the mix.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::redis::{RedisProcess, shared_cluster, shared_standalone};
use common::{T0, redis_options, unique_domain};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use slidegate::limiter::{Descriptor, Limiter, LimiterOptions, ManualClock, Override, Request};
use slidegate::store::{
    CheckItem, InspectFuture, LogFormat, MemoryStore, RedisOptions, RedisStore, ResetFuture, Store,
    StoreFuture, StoreKey,
};

const CONFIG: &str = r#"
domain: DOMAIN
descriptors:
  - key: user
    rate_limits:
      - {requests_per_unit: 3, window: 1s, name: burst}
      - {requests_per_unit: 5, window: 3s}
  - key: login
    rate_limit: {requests_per_unit: 2, window: 1s}
    ban: 2s
  - key: big
    rate_limits:
      - {requests_per_unit: 4, window: 2s}
      - {requests_per_unit: 6, window: 2000ms}
    algorithm: sliding_counter
    buckets: 4
  - key: budget
    rate_limits:
      - {requests_per_unit: 10, window: 2s}
      - {requests_per_unit: 14, window: 3s}
    debit: true
  - key: meter
    rate_limit: {requests_per_unit: 6, window: 2s}
    algorithm: sliding_counter
    buckets: 4
    debit: true
  - key: shadow
    rate_limit: {requests_per_unit: 1, window: 1s}
    shadow_mode: true
  - key: quota
    rate_limit: {requests_per_unit: 2, window: 1s}
    quota_mode: true
  - key: free
    rate_limit: {unlimited: true}
  # One window, no ban: the script's own paths for the common requests.
  - key: plain
    rate_limit: {requests_per_unit: 4, window: 2s}
  # Thousands of hits a request (tokens): running totals past 1,000, which the script formats
  # anew each time (it keeps only smaller ones formatted), and resets searched through weighted
  # entries. A limit past 1,000: its log is a sorted set beside the others' compact logs.
  - key: tokens
    rate_limit: {requests_per_unit: 5000, window: 2s}
"#;

const KEYS: [&str; 11] = [
    "user", "login", "big", "shadow", "quota", "free", "none", "budget", "meter", "plain", "tokens",
];

/// One generated descriptor: which key, which value, its own hits, an override.
#[derive(Clone, Debug)]
struct Gen {
    key: usize,
    value: bool,
    hits: Option<u64>,
    limit: Option<u32>,
}

/// One step: how far the clock moves, then one request, made by a replica whose clock is
/// `behind_ms` behind (0 for most steps): replicas' clocks differ by a little, and a log gets
/// entries from a replica behind the one that wrote its newest. At most 1 s behind: both
/// stores keep idle state a second past its last window for such clocks (Redis by its keys'
/// TTLs, which in this test never run out, as its clock is the real one; the embedded store
/// until its sweep), and no further.
#[derive(Clone, Debug)]
struct Step {
    advance_ms: u64,
    behind_ms: u64,
    hits_addend: u32,
    descriptors: Vec<Gen>,
}

fn descriptor() -> impl Strategy<Value = Gen> {
    (
        0..KEYS.len(),
        any::<bool>(),
        prop::option::weighted(0.4, prop_oneof![4 => 0u64..8, 1 => 100u64..3000]),
        prop::option::weighted(0.1, 0u32..4),
    )
        .prop_map(|(key, value, hits, limit)| Gen {
            key,
            value,
            hits,
            limit,
        })
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![Just(0u64), 0u64..400, 900u64..1100, 0u64..3000],
        prop::option::weighted(0.15, 1u64..=1000),
        0u32..3,
        prop::collection::vec(descriptor(), 1..4),
    )
        .prop_map(|(advance_ms, behind_ms, hits_addend, descriptors)| Step {
            advance_ms,
            behind_ms: behind_ms.unwrap_or(0),
            hits_addend,
            descriptors,
        })
}

impl Step {
    fn request(&self, domain: &str) -> Request {
        Request {
            domain: domain.to_string(),
            hits_addend: self.hits_addend,
            descriptors: self
                .descriptors
                .iter()
                .map(|g| Descriptor {
                    entries: vec![(
                        KEYS[g.key].to_string(),
                        if g.value { "a" } else { "b" }.to_string(),
                    )],
                    limit: g.limit.map(|requests_per_unit| Override {
                        requests_per_unit,
                        unit: 1,
                    }),
                    hits_addend: g.hits,
                })
                .collect(),
        }
    }
}

fn limiter(domain: &str, store: Arc<dyn Store>, clock: &ManualClock) -> Limiter {
    let limits = slidegate::config::compile_sources(&[(
        "diff.yaml".into(),
        CONFIG.replace("DOMAIN", domain),
    )])
    .expect("valid config");
    let options = LimiterOptions {
        response_headers: true,
        dynamic_metadata: true,
        ..LimiterOptions::default()
    };
    Limiter::new(limits, store, Arc::new(clock.clone()), options)
}

#[test]
fn embedded_store_and_lua_script_answer_alike() {
    answer_alike(&shared_standalone().url(), &[LogFormat::Compact]);
}

/// On a Redis Cluster of three masters: a request's descriptors sit in slots of several masters,
/// decided by tentative calls and taken back where another master rejects (`undo`).
#[test]
fn on_a_cluster_the_lua_script_answers_alike() {
    answer_alike(&shared_cluster().url(), &[LogFormat::Compact]);
}

/// The sorted-set log, written when asked for (`--redis-log-format sorted-set`) and for logs past
/// 1,000 entries.
#[test]
fn sorted_set_logs_answer_alike() {
    answer_alike(&shared_standalone().url(), &[LogFormat::SortedSet]);
}

/// A rolling upgrade, both ways: replicas asked for either format decide on the same logs, each
/// rewriting a log it finds in the other format, and every answer is the embedded store's.
#[test]
fn replicas_of_either_log_format_side_by_side_answer_alike() {
    answer_alike(
        &shared_standalone().url(),
        &[LogFormat::Compact, LogFormat::SortedSet],
    );
}

/// Redis keeps a log of up to `zset-max-listpack-entries` entries (128 by default) as a listpack
/// and a longer one as a skiplist, and an operator may set any limit (`docs/performance.md`
/// measures what a lower one costs). With 0 every log is a skiplist from its first entry, and
/// the answers must not move.
#[test]
fn logs_kept_as_skiplists_answer_alike_too() {
    let redis = RedisProcess::start(&["--zset-max-listpack-entries", "0"]);
    // The setting is in force: a one-member sorted set is already a skiplist.
    assert!(redis.cmd("ZADD probe 1 one").starts_with(":1"));
    assert!(
        redis.cmd("OBJECT ENCODING probe").contains("skiplist"),
        "zset-max-listpack-entries 0 not in force"
    );
    answer_alike(&redis.url(), &[LogFormat::SortedSet]);
}

/// Stores that take calls in turn: replicas of two log formats on one Redis.
struct Turns {
    stores: Vec<Arc<dyn Store>>,
    next: AtomicUsize,
}

impl Turns {
    fn store(&self) -> &dyn Store {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        &*self.stores[turn % self.stores.len()]
    }
}

impl Store for Turns {
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        self.store().check(items, now_ms)
    }

    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        self.store().check_rejected(items, now_ms)
    }

    fn inspect<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> InspectFuture<'a> {
        self.store().inspect(items, now_ms)
    }

    fn reset<'a>(&'a self, keys: &'a [StoreKey]) -> ResetFuture<'a> {
        self.store().reset(keys)
    }

    fn name(&self) -> &'static str {
        "turns"
    }
}

/// `request` decided by both limiters (the embedded store's, then the Redis one's): their
/// answers, alike, or why not.
fn decided_alike(
    runtime: &tokio::runtime::Runtime,
    [embedded, scripted]: [&Limiter; 2],
    request: &Request,
) -> Result<(), String> {
    let (a, b) = runtime.block_on(async {
        (
            embedded.should_rate_limit(request).await,
            scripted.should_rate_limit(request).await,
        )
    });
    let a = a.map_err(|e| format!("embedded: {e}"))?;
    let b = b.map_err(|e| format!("redis: {e}"))?;
    if a == b {
        Ok(())
    } else {
        Err(format!("the embedded store answered {a:?}, Redis {b:?}"))
    }
}

/// The random request sequences, each given to the embedded store and to the script on the
/// Redis at `url`, answer for answer; with several log formats, each step goes to a server
/// asked for one of them.
fn answer_alike(url: &str, formats: &[LogFormat]) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let redis: Vec<Arc<dyn Store>> = runtime.block_on(async {
        let mut stores: Vec<Arc<dyn Store>> = Vec::new();
        for &log_format in formats {
            stores.push(Arc::new(
                RedisStore::connect(RedisOptions {
                    log_format,
                    ..redis_options(url.to_owned())
                })
                .await
                .expect("connect to the test Redis"),
            ));
        }
        stores
    });
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let steps = prop::collection::vec(step(), 1..40);
    let result = runner.run(&steps, |steps| {
        // A fresh domain per case: the Redis logs of earlier cases never meet this one.
        let domain = unique_domain("diff");
        let clock = ManualClock::new(T0);
        let embedded = limiter(&domain, Arc::new(MemoryStore::new()), &clock);
        // One limiter (its over-limit cache is one replica's), whose store calls go to each
        // format's Redis store in turn.
        let turns: Arc<dyn Store> = Arc::new(Turns {
            stores: redis.clone(),
            next: AtomicUsize::new(0),
        });
        let scripted = limiter(&domain, turns, &clock);
        let mut now = T0;
        for (n, step) in steps.iter().enumerate() {
            now += step.advance_ms;
            clock.set(now - step.behind_ms);
            let request = step.request(&domain);
            decided_alike(&runtime, [&embedded, &scripted], &request)
                .map_err(|e| TestCaseError::fail(format!("step {n} of {steps:?}: {e}")))?;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// One generated quota report: which holder, which bucket, its usage.
#[derive(Clone, Debug)]
struct Report {
    advance_ms: u64,
    holder: usize,
    key: usize,
    allowed: u64,
    denied: u64,
    elapsed_ms: u64,
    /// A check of the same descriptor (no hits) after the report: what the window holds.
    check: bool,
}

fn report() -> impl Strategy<Value = Report> {
    (
        prop_oneof![Just(0u64), 0u64..1500, 4000u64..6000],
        0usize..4,
        0..KEYS.len(),
        prop_oneof![2 => Just(0u64), 3 => 0u64..8, 1 => 0u64..3000],
        0u64..60,
        prop_oneof![Just(0u64), 1000u64..6000, Just(u64::MAX)],
        any::<bool>(),
    )
        .prop_map(
            |(advance_ms, holder, key, allowed, denied, elapsed_ms, check)| Report {
                advance_ms,
                holder,
                key,
                allowed,
                denied,
                elapsed_ms,
                check,
            },
        )
}

/// The Rate Limit Quota Service's shares (`store::shares::share`, mirrored in `lua/quota.lua`):
/// random reports of four holders over the config's rules (several windows, a counter, a sorted
/// set past 1,000, unlimited and unmatched buckets), each given to the embedded store and to
/// the library on a real Redis, and every assignment and every check after one alike.
#[test]
fn quota_shares_answer_alike() {
    use slidegate::limiter::BucketUsage;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let redis: Arc<dyn Store> = runtime.block_on(async {
        Arc::new(
            RedisStore::connect(RedisOptions {
                log_format: LogFormat::Compact,
                ..redis_options(shared_standalone().url())
            })
            .await
            .expect("connect to the test Redis"),
        )
    });
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let (tokens, denied) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let reports = prop::collection::vec(report(), 1..60);
    let result = runner.run(&reports, |reports| {
        let domain = unique_domain("quota-diff");
        let clock = ManualClock::new(T0);
        let embedded = limiter(&domain, Arc::new(MemoryStore::new()), &clock);
        let scripted = limiter(&domain, redis.clone(), &clock);
        let holders: Vec<String> = (0..4).map(|_| embedded.quota_holder()).collect();
        for (n, r) in reports.iter().enumerate() {
            clock.advance(r.advance_ms);
            let usage = BucketUsage {
                id: vec![(KEYS[r.key].to_string(), "a".to_string())],
                allowed: r.allowed,
                denied: r.denied,
                elapsed_ms: r.elapsed_ms,
            };
            let usage = std::slice::from_ref(&usage);
            let (a, b) = runtime.block_on(async {
                (
                    embedded
                        .quota_report(&domain, &holders[r.holder], usage)
                        .await,
                    scripted
                        .quota_report(&domain, &holders[r.holder], usage)
                        .await,
                )
            });
            prop_assert_eq!(&a, &b, "report {} of {:?}", n, reports);
            match a[0] {
                Some(slidegate::limiter::Assignment::TokenBucket { .. }) => {
                    tokens.fetch_add(1, Ordering::Relaxed);
                }
                Some(slidegate::limiter::Assignment::DenyAll) => {
                    denied.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            if r.check {
                let request = Request {
                    domain: domain.clone(),
                    hits_addend: 0,
                    descriptors: vec![Descriptor {
                        entries: usage[0].id.clone(),
                        limit: None,
                        hits_addend: Some(0),
                    }],
                };
                decided_alike(&runtime, [&embedded, &scripted], &request).map_err(|e| {
                    TestCaseError::fail(format!("check after report {n} of {reports:?}: {e}"))
                })?;
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (tokens, denied) = (tokens.into_inner(), denied.into_inner());
    assert!(
        tokens > 100 && denied > 20,
        "{tokens} token buckets, {denied} denials"
    );
}
