//! The link between slidegate and Redis degraded by the fault proxy (`tests/common/proxy.rs`):
//! added latency, a partition, connections reset; and what a decision waits for, its turn or
//! Redis's reply, each within its own bound.

use std::sync::atomic::{AtomicU64, Ordering};

use slidegate::limiter::{Code, Decision, Limiter, LimiterError, SystemClock};
use slidegate::store::with_caller_deadline;

use super::*;
use common::proxy::FaultProxy;

/// The proxy does what it says: a round trip through it takes its delay twice; a stall holds a
/// command until it heals, then passes it on; a reset breaks the connection.
#[test]
fn the_fault_proxy_delays_stalls_and_resets() {
    use std::io::{Read as _, Write as _};
    let redis = shared_standalone();
    let proxy = FaultProxy::start(redis.port);
    let mut link = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).expect("connect");
    link.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let ping = |link: &mut std::net::TcpStream| {
        let started = Instant::now();
        link.write_all(b"PING\r\n")?;
        let mut reply = [0u8; 7];
        link.read_exact(&mut reply).map(|()| started.elapsed())
    };
    assert!(ping(&mut link).expect("a reply") < Duration::from_millis(500));
    proxy.delay(Duration::from_millis(40));
    let delayed = ping(&mut link).expect("a reply");
    assert!(delayed >= Duration::from_millis(80), "{delayed:?}");
    proxy.delay(Duration::ZERO);
    proxy.stall();
    link.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    assert!(ping(&mut link).is_err(), "answered through a stall");
    proxy.heal();
    link.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut held = [0u8; 7];
    link.read_exact(&mut held)
        .expect("the held reply after healing");
    assert_eq!(&held, b"+PONG\r\n");
    proxy.reset();
    let broken = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        ping(&mut link).is_err()
    });
    assert!(broken, "the connection survived a reset");
    let mut again = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).expect("connect");
    again
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    assert!(ping(&mut again).is_ok(), "a new connection after a reset");
    assert_eq!(proxy.accepted(), 2);
}

/// A store on Redis through `proxy`: `timeout` for Redis, `queue_timeout` for a turn.
async fn store_through(
    proxy: &FaultProxy,
    timeout: Duration,
    queue_timeout: Duration,
) -> Arc<dyn Store> {
    let mut opts = options(proxy.url(), timeout);
    opts.queue_timeout = queue_timeout;
    Arc::new(
        RedisStore::connect(opts)
            .await
            .expect("connect through the proxy"),
    )
}

/// A limiter of one rule (`k`, `per_hour` an hour) in a domain of its own, on `store`.
fn limiter_on(
    store: Arc<dyn Store>,
    per_hour: u32,
    policy: FailurePolicy,
) -> (Arc<Limiter>, String) {
    let domain = unique_domain("link");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {per_hour}}}\n"
    );
    let limits =
        slidegate::config::compile_sources(&[("link.yaml".into(), config)]).expect("config");
    let options = LimiterOptions {
        failure_policy: policy,
        over_limit_cache: 0,
        ..LimiterOptions::default()
    };
    let limiter = Limiter::new(limits, store, Arc::new(SystemClock), options);
    (Arc::new(limiter), domain)
}

/// A request of `n` descriptors `k=<tag>-<i>`: 32 of them fill a call alone.
fn wide(domain: &str, tag: &str, n: usize) -> slidegate::limiter::Request {
    let descriptors = (0..n)
        .map(|i| descriptor(&[("k", &format!("{tag}-{i}"))]))
        .collect();
    slidegate::wire::from_proto(request(domain, descriptors))
}

/// `limiter`'s decision of `request` for a caller that waits until `deadline` from now, where
/// it sets one.
async fn decide_for(
    limiter: &Limiter,
    request: &slidegate::limiter::Request,
    deadline: Option<Duration>,
) -> Result<Decision, LimiterError> {
    let decision = limiter.should_rate_limit(request);
    match deadline {
        Some(d) => with_caller_deadline(tokio::time::Instant::now() + d, decision).await,
        None => decision.await,
    }
}

/// `calls` decisions of 32 descriptors each, all at once, each for a caller with `deadline`
/// (or none): how each was answered, and how long it took.
async fn all_at_once(
    limiter: &Arc<Limiter>,
    domain: &str,
    calls: usize,
    deadline: Option<Duration>,
) -> Vec<(Result<Decision, LimiterError>, Duration)> {
    static TAG: AtomicU64 = AtomicU64::new(0);
    let tasks: Vec<_> = (0..calls)
        .map(|_| {
            let request = wide(
                domain,
                &format!("w{}", TAG.fetch_add(1, Ordering::SeqCst)),
                32,
            );
            let limiter = limiter.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let decided = decide_for(&limiter, &request, deadline).await;
                (decided, started.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("decision task"));
    }
    answers
}

/// Waiting for a turn is not Redis being slow: ten calls that each fill a call to Redis, at
/// once, where every call takes 50 ms or more (the link's delay). Two are out at a time, so
/// the last waits four turns, longer than `--redis-timeout` (150 ms): without a caller's
/// deadline each is decided by Redis, its wait for a turn bounded by `--redis-queue-timeout`.
/// With a short queue timeout the ones left waiting are answered by the policy, saying they
/// waited for a turn; with Redis slower than `--redis-timeout`, saying Redis did not answer;
/// with a caller's deadline that Redis cannot meet, each just before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_and_a_reply_are_waited_for_each_within_its_own_bound() {
    let redis = RedisProcess::start(&[]);
    let proxy = FaultProxy::start(redis.port);
    let ms = Duration::from_millis;
    let store = store_through(&proxy, ms(150), Duration::from_secs(5)).await;
    let (limiter, domain) = limiter_on(store, 1_000, FailurePolicy::Error);
    proxy.delay(ms(25));
    let answers = all_at_once(&limiter, &domain, 10, None).await;
    let slowest = answers
        .iter()
        .map(|(_, took)| *took)
        .max()
        .unwrap_or_default();
    for (answer, took) in &answers {
        let decision = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("answered by the policy after {took:?}: {e}"));
        assert_eq!(decision.overall, Code::Ok);
    }
    assert!(
        slowest > ms(150),
        "no call waited past --redis-timeout ({slowest:?}): the test shows nothing"
    );

    let store = store_through(&proxy, ms(150), ms(60)).await;
    let (limiter, domain) = limiter_on(store, 1_000, FailurePolicy::Error);
    let answers = all_at_once(&limiter, &domain, 10, None).await;
    let turns: Vec<String> = answers
        .iter()
        .filter_map(|(a, _)| a.as_ref().err())
        .map(ToString::to_string)
        .collect();
    assert!(
        !turns.is_empty(),
        "no call waited past --redis-queue-timeout"
    );
    for text in &turns {
        assert!(
            text.starts_with("waited ")
                && text.ends_with(" ms for a turn to call Redis (--redis-queue-timeout)"),
            "{text}"
        );
    }

    proxy.delay(ms(100));
    let store = store_through(&proxy, ms(50), Duration::from_secs(5)).await;
    let (limiter, domain) = limiter_on(store, 1_000, FailurePolicy::Error);
    let answers = all_at_once(&limiter, &domain, 3, None).await;
    for (answer, took) in &answers {
        let text = answer
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default();
        assert_eq!(
            text, "Redis did not answer within 50 ms (--redis-timeout)",
            "after {took:?}"
        );
    }

    proxy.delay(ms(60));
    let store = store_through(&proxy, ms(150), Duration::from_secs(5)).await;
    let (limiter, domain) = limiter_on(store, 1_000, FailurePolicy::Error);
    let answers = all_at_once(&limiter, &domain, 10, Some(ms(100))).await;
    for (answer, took) in &answers {
        assert!(
            *took < ms(100),
            "answered at {took:?}, past the caller's deadline"
        );
        let text = answer
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(
            text.ends_with(", until just before the caller's deadline"),
            "{text}"
        );
    }
}

/// `calls` decisions at once for `[k=<user>]` per user, each for a caller with `deadline`
/// (or none), and each user's calls one after another: per user, how many were admitted.
async fn per_user(
    limiter: &Arc<Limiter>,
    domain: &str,
    users: &[String],
    calls: usize,
    deadline: Option<Duration>,
) -> Vec<usize> {
    let tasks: Vec<_> = users
        .iter()
        .map(|user| {
            let (limiter, domain, user) = (limiter.clone(), domain.to_string(), user.clone());
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..calls {
                    let request = slidegate::wire::from_proto(request(
                        &domain,
                        vec![descriptor(&[("k", &user)])],
                    ));
                    let decision = decide_for(&limiter, &request, deadline)
                        .await
                        .unwrap_or_else(|e| panic!("the deny policy answers, not an error: {e}"));
                    admitted += usize::from(decision.overall == Code::Ok);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.push(task.await.expect("user task"));
    }
    admitted
}

/// FCALLs Redis has run so far (decisions and undos alike).
fn fcalls(redis: &RedisProcess) -> u64 {
    redis
        .cmd("INFO commandstats")
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_fcall:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Overload takes no one's quota: Redis slowed past `--redis-timeout` (every call takes 120 ms,
/// the timeout is 50 ms) for a domain whose store failures the deny policy answers. Every call
/// is answered `OVER_LIMIT` by the policy; the calls that went out record their hits when they
/// run, and the late replies are taken back; a decision still waiting for its turn when its
/// caller's deadline comes is never sent. After the link heals, each user gets exactly its
/// limit (5) counting only what was answered OK, and each log holds what was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_answered_by_the_deny_policy_are_taken_back() {
    let redis = RedisProcess::start(&[]);
    let proxy = FaultProxy::start(redis.port);
    let ms = Duration::from_millis;
    let store = store_through(&proxy, ms(50), Duration::from_secs(1)).await;
    let (limiter, domain) = limiter_on(store, 5, FailurePolicy::Deny);
    let users: Vec<String> = (0..10).map(|u| format!("u{u}")).collect();
    let log = |user: &str| format!("rl:{{{domain}:k={user}}}:log");
    let held = |user: &str| log_entries(redis.port, &log(user)).len();
    proxy.delay(ms(60));
    let mut admitted = per_user(&limiter, &domain, &users, 3, None).await;
    assert!(
        admitted.iter().all(|&a| a == 0),
        "admitted through a slow link: {admitted:?}"
    );
    // Nothing left in flight (late replies, their undos) and nothing left recorded.
    let taken_back = || {
        wait_until("every late hit taken back", Duration::from_secs(10), || {
            proxy.quiet_for(ms(300)) && users.iter().all(|u| held(u) == 0)
        });
    };
    taken_back();
    // Two callers without a deadline take both calls out, answered by the policy 50 ms after
    // they are sent; eight that give 30 ms wait for a turn behind them and are answered when
    // it ends, before those calls' moment: never sent. Redis runs the two calls and their
    // undos, nothing more.
    let before = fcalls(&redis);
    let taken = proxy.taken();
    let (blocked, queued) =
        tokio::join!(per_user(&limiter, &domain, &users[..2], 1, None), async {
            let end = Instant::now() + Duration::from_secs(5);
            while proxy.taken() < taken + 2 {
                assert!(Instant::now() < end, "the two calls never went out");
                tokio::time::sleep(ms(1)).await;
            }
            per_user(&limiter, &domain, &users[2..], 1, Some(ms(30))).await
        });
    assert!(blocked.iter().chain(&queued).all(|&a| a == 0));
    taken_back();
    proxy.delay(Duration::ZERO);
    assert_eq!(
        fcalls(&redis) - before,
        4,
        "two calls and two undos for ten callers, of whom two had their turn"
    );
    for (total, now) in admitted
        .iter_mut()
        .zip(per_user(&limiter, &domain, &users, 8, None).await)
    {
        *total += now;
    }
    assert_eq!(
        admitted,
        vec![5; users.len()],
        "each user's limit, once healed"
    );
    for user in &users {
        assert_eq!(held(user), 5, "{user}'s log holds what was admitted");
    }
}
