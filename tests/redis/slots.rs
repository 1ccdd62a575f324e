//! Redis Cluster: requests over several slots and masters, all-or-nothing with undo, the spread
//! function, and slots that move under load.

use super::*;

/// A request with descriptors in three slots where the third rejects: the other two keep
/// exactly what they had (their tentative hits are removed again).
async fn rejecting_slot_leaves_nothing_in_the_others(algorithm: &str) {
    let cluster = shared_cluster();
    let domain = unique_domain("slots");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: a\n    algorithm: {algorithm}\n    rate_limit: {{unit: minute, requests_per_unit: 5}}\n  - key: b\n    algorithm: {algorithm}\n    rate_limit: {{unit: minute, requests_per_unit: 5}}\n  - key: c\n    algorithm: {algorithm}\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n"
    );
    let server = TestServer::start(
        &config,
        connect(cluster.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    let keys = |k: &str| {
        key::build(
            &domain,
            &[Segment::Value { key: k, value: "1" }],
            Variant::Configured,
            None,
        )
    };
    let (ka, kb, kc) = (keys("a"), keys("b"), keys("c"));
    let mut slots = vec![slot(&ka.log()), slot(&kb.log()), slot(&kc.log())];
    slots.dedup();
    assert_eq!(
        slots.len(),
        3,
        "the three descriptors must sit in three slots"
    );
    let held = || -> (i64, i64, i64) {
        if algorithm == "sliding_log" {
            (
                entries_in(cluster, &ka.log()),
                entries_in(cluster, &kb.log()),
                entries_in(cluster, &kc.log()),
            )
        } else {
            (
                bucket_hits(cluster, &ka.counters()),
                bucket_hits(cluster, &kb.counters()),
                bucket_hits(cluster, &kc.counters()),
            )
        }
    };
    let all = || {
        request(
            &domain,
            vec![
                descriptor(&[("a", "1")]),
                descriptor(&[("b", "1")]),
                descriptor(&[("c", "1")]),
            ],
        )
    };
    assert_eq!(server.call(all()).await.overall_code, ok());
    assert_eq!(held(), (1, 1, 1));
    // c is now full: the request is rejected and a and b keep exactly what they had.
    let r = server.call(all()).await;
    assert_eq!(r.overall_code, over());
    assert_eq!(
        (r.statuses[0].code, r.statuses[1].code, r.statuses[2].code),
        (ok(), ok(), over())
    );
    assert_eq!(held(), (1, 1, 1));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejecting_slot_leaves_nothing_in_the_other_logs() {
    rejecting_slot_leaves_nothing_in_the_others("sliding_log").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejecting_slot_leaves_nothing_in_the_other_counters() {
    rejecting_slot_leaves_nothing_in_the_others("sliding_counter").await;
}

/// On a cluster a request over 40 slots is a call per slot, more than each master has out at
/// once (two): the rest wait in the masters' queues and go together, and every descriptor is
/// counted exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_more_slots_than_calls_out_is_decided() {
    let cluster = shared_cluster();
    let domain = unique_domain("many_slots");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n"
    );
    let mut single = options(cluster.url(), TEST_TIMEOUT);
    single.pool_size = 1;
    let store = Arc::new(RedisStore::connect(single).await.expect("connect"));
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    let values: Vec<String> = (0..40).map(|i| format!("v{i}")).collect();
    let mut slots: Vec<u16> = values
        .iter()
        .map(|v| {
            let k = key::build(
                &domain,
                &[Segment::Value { key: "k", value: v }],
                Variant::Configured,
                None,
            );
            slot(&k.log())
        })
        .collect();
    slots.sort_unstable();
    slots.dedup();
    assert!(slots.len() > 16, "only {} slots", slots.len());
    let all = || {
        let descriptors = values.iter().map(|v| descriptor(&[("k", v)])).collect();
        request(&domain, descriptors)
    };
    let first = server.call(all()).await;
    assert_eq!(first.overall_code, ok());
    // Each descriptor counted once: the second request is over in every slot.
    let second = server.call(all()).await;
    assert_eq!(second.overall_code, over());
    assert!(second.statuses.iter().all(|s| s.code == over()));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_by_keeps_escaped_values_in_the_tagged_slot() {
    let cluster = shared_cluster();
    let domain = unique_domain("tagby");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: path\n        tag_by: user\n        rate_limit: {{unit: minute, requests_per_unit: 2}}\n      - key: method\n        tag_by: user\n        rate_limit: {{unit: minute, requests_per_unit: 3}}\n"
    );
    let tricky = "/a}{b:c";
    let seg = |k: &'static str, v: &'static str| Segment::Value { key: k, value: v };
    let plain = key::build(
        &domain,
        &[seg("user", "42"), seg("path", "/plain")],
        Variant::Configured,
        Some("user"),
    );
    let braces = key::build(
        &domain,
        &[seg("user", "42"), seg("path", tricky)],
        Variant::Configured,
        Some("user"),
    );
    assert_eq!(slot(&plain.log()), slot(&braces.log()));
    assert_eq!(slot(&braces.log()), slot(&braces.ban()));

    let server = TestServer::start(
        &config,
        connect(cluster.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    // Both descriptors share user 42's slot: one script call, all-or-nothing.
    let req = || {
        request(
            &domain,
            vec![
                descriptor(&[("user", "42"), ("path", tricky)]),
                descriptor(&[("user", "42"), ("method", "GET")]),
            ],
        )
    };
    assert_eq!(server.call(req()).await.overall_code, ok());
    assert_eq!(server.call(req()).await.overall_code, ok());
    assert_eq!(server.call(req()).await.overall_code, over());
    assert_eq!(entries_in(cluster, &braces.log()), 2);
    let method = key::build(
        &domain,
        &[seg("user", "42"), seg("method", "GET")],
        Variant::Configured,
        Some("user"),
    );
    assert_eq!(
        entries_in(cluster, &method.log()),
        2,
        "the rejected third request recorded nothing in either"
    );
    server.stop().await;
}

/// A request whose two descriptors sit in two slots of one master is one call there, decided
/// whole: rejected by one, it records nothing in the other (no entry recorded and removed
/// again). After the slot of one moved under the client, the master refuses the call's key of
/// it before anything is recorded, and the request goes as a call per slot: still exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_two_slots_of_one_master_is_one_call() {
    let domain = unique_domain("two_slots");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: a\n    rate_limit: {{unit: minute, requests_per_unit: 100}}\n  - key: b\n    rate_limit: {{unit: minute, requests_per_unit: 2}}\n"
    );
    let (cluster, server) = on_own_cluster(&config, Duration::from_secs(2)).await;
    let log = |k: &str, v: &str| log_of(&domain, k, v);
    let owner = owners(&cluster);
    let a = log("a", "x");
    let master = owner(slot(&a));
    // Two values of b in slots of their own on a's master.
    let mut taken = vec![slot(&a)];
    let mut values = Vec::new();
    for n in 0..2_000 {
        let value = format!("y{n}");
        let s = slot(&log("b", &value));
        if owner(s) == master && !taken.contains(&s) {
            taken.push(s);
            values.push(value);
        }
    }
    let (w, y) = (&values[0], &values[1]);
    let both = |b: &str| {
        request(
            &domain,
            vec![descriptor(&[("a", "x")]), descriptor(&[("b", b)])],
        )
    };
    let node = cluster
        .nodes
        .iter()
        .find(|n| n.port == master)
        .expect("the master");
    let (fcalls, zrems) = (fcall_calls(node), calls_of(node, "zrem"));
    assert_eq!(server.call(both(w)).await.overall_code, ok());
    assert_eq!(server.call(both(w)).await.overall_code, ok());
    assert_eq!(
        server.call(both(w)).await.overall_code,
        over(),
        "b allows 2"
    );
    assert_eq!(fcall_calls(node) - fcalls, 3, "one call per request");
    assert_eq!(
        calls_of(node, "zrem"),
        zrems,
        "nothing recorded to remove again"
    );
    assert_eq!(
        (entries_in(&cluster, &a), entries_in(&cluster, &log("b", w))),
        (2, 2)
    );

    // y's slot moves after one request; the client's routing and slidegate's copy still say
    // it is on a's master.
    assert_eq!(server.call(both(y)).await.overall_code, ok());
    let cluster_ref = &cluster;
    tokio::task::block_in_place(|| migrate_slot(cluster_ref, slot(&log("b", y))));
    let errors = || err_replies(master);
    let refused = errors();
    assert_eq!(server.call(both(y)).await.overall_code, ok());
    assert!(errors() > refused, "a's master refused y's key");
    assert_eq!(
        server.call(both(y)).await.overall_code,
        over(),
        "b allows 2"
    );
    // a counted the two admitted requests only: the rejected one's entry, if a per-slot call
    // recorded it, was removed again.
    assert_eq!(
        (entries_in(&cluster, &a), entries_in(&cluster, &log("b", y))),
        (4, 2)
    );
    server.stop().await;
}

/// Where `FUNCTION LOAD` is refused on a cluster (a user without it), the script goes by
/// `EVALSHA`, which cannot reach keys of several slots: a call keeps to one slot. A request over
/// two slots of one master goes as a call per slot (rejected by one, the other's entry is
/// removed again), and concurrent requests of many slots, queued for the same masters, each go
/// on their own: every user admitted once of two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_function_load_a_cluster_call_keeps_to_one_slot() {
    let cluster = RedisCluster::start();
    for node in &cluster.nodes {
        assert!(
            node.cmd("ACL SETUSER limited on >secret ~* +@all -function")
                .starts_with("+OK")
        );
    }
    let url = cluster
        .url()
        .replacen("redis-cluster://", "redis-cluster://limited:secret@", 1);
    let domain = unique_domain("evalsha_cluster");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: a\n    rate_limit: {{unit: minute, requests_per_unit: 100}}\n  - key: b\n    rate_limit: {{unit: minute, requests_per_unit: 2}}\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n"
    );
    let server = server_on(url, &config, Duration::from_secs(2)).await;
    let log = |k: &str, v: &str| log_of(&domain, k, v);
    let owner = owners(&cluster);
    let a = log("a", "x");
    let w = (0..2_000)
        .map(|n| format!("w{n}"))
        .find(|w| {
            let s = slot(&log("b", w));
            s != slot(&a) && owner(s) == owner(slot(&a))
        })
        .expect("a value of b on a's master");
    let both = || {
        request(
            &domain,
            vec![descriptor(&[("a", "x")]), descriptor(&[("b", &w)])],
        )
    };
    assert_eq!(server.call(both()).await.overall_code, ok());
    assert_eq!(server.call(both()).await.overall_code, ok());
    assert_eq!(server.call(both()).await.overall_code, over(), "b allows 2");
    assert_eq!(
        (
            entries_in(&cluster, &a),
            entries_in(&cluster, &log("b", &w))
        ),
        (2, 2)
    );

    let wave = || {
        let requests = (0..300)
            .map(|n| request(&domain, vec![descriptor(&[("user", &format!("u{n}"))])]))
            .collect();
        all_at_once(&server, requests)
    };
    let first = wave().await;
    assert!(first.iter().all(|&c| c == ok()), "{first:?}");
    let second = wave().await;
    assert!(second.iter().all(|&c| c == over()), "{second:?}");
    for node in &cluster.nodes {
        assert_eq!(fcall_calls(node), 0, "no function calls");
        assert!(calls_of(node, "evalsha") > 0, "decided by EVALSHA");
    }
    server.stop().await;
}

/// The script's spread function on a cluster master: requests whose keys sit in two of its
/// slots are decided in one call; a request reaching for a key of another master's slot fails
/// alone, with Redis's "non local key" error, and records nothing.
#[test]
fn a_spread_call_decides_one_masters_slots_and_refuses_others() {
    let cluster = shared_cluster();
    let library = slidegate::store::redis::Library::new();
    for node in &cluster.nodes {
        let loaded = node_cli(node.port, &["FUNCTION", "LOAD", "REPLACE", &library.code]);
        assert_eq!(loaded, [library.function.to_string()]);
    }
    let domain = unique_domain("spread");
    let key = |n: usize| format!("rl:{{{domain}-{n}}}:log");
    let owner = owners(cluster);
    let owner = |k: &str| owner(slot(k));
    let here = owner(&key(0));
    let local: Vec<String> = (1..200)
        .map(key)
        .filter(|k| slot(k) != slot(&key(0)) && owner(k) == here)
        .take(1)
        .collect();
    let foreign: Vec<String> = (1..200)
        .map(key)
        .filter(|k| owner(k) != here)
        .take(1)
        .collect();
    let keys = [key(0), local[0].clone(), foreign[0].clone()];
    let mut args = vec![
        "FCALL".to_string(),
        library.spread.to_string(),
        "1".into(),
        keys[0].clone(),
        "3".into(),
    ];
    args.extend(keys.iter().cloned());
    args.extend(["3".to_string(), "1000".to_string()]);
    for _ in 0..3 {
        args.extend(["5".into(), "1".into(), "0:0:0:0:5:60000".into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let reply = node_cli(here, &args);
    // The call's time, two admitted requests (4 values: flags, entry, count, reset), then -1
    // and Redis's error.
    assert_eq!(reply.len(), 13, "{reply:?}");
    assert_eq!(reply[..4], ["1000", "4", "5", "1"], "{reply:?}");
    assert_eq!(reply[6..8], ["4", "5"], "{reply:?}");
    assert_eq!(reply[11], "-1", "{reply:?}");
    assert!(reply[12].contains("non local key"), "{reply:?}");
    assert_eq!(entries_in(cluster, &keys[0]), 1);
    assert_eq!(entries_in(cluster, &keys[1]), 1);
    assert_eq!(
        entries_in(cluster, &keys[2]),
        0,
        "the refused request recorded nothing"
    );
    // The same keys declared are refused before the function runs.
    let mut declared = vec!["FCALL", &library.function, "2", &keys[0], &keys[1]];
    declared.extend_from_slice(&["2", "1000"]);
    declared.extend_from_slice(&args[args.len() - 8..]);
    let refused = node_cli(here, &declared).join(" ");
    assert!(refused.contains("CROSSSLOT"), "{refused}");
}

/// On a cluster each master's decisions share its script calls, whatever their slots, and stay
/// exact, also right after a slot moved under the client (its routing, and slidegate's copy, out
/// of date): the requests a master no longer serves are refused there and sent again on their
/// own. 100 users of one team (one slot, by `tag_by`) and 200 others, 2 a minute each, three
/// waves of concurrent requests: two admitted per user, the third refused, no errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_masters_slots_share_calls_and_stay_exact_when_a_slot_moves() {
    let domain = unique_domain("node_batch");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: team\n    descriptors:\n      - key: user\n        tag_by: team\n        rate_limit: {{unit: minute, requests_per_unit: 2}}\n"
    );
    let (cluster, server) = on_own_cluster(&config, Duration::from_secs(2)).await;
    let users: Vec<(String, String)> = (0..300)
        .map(|n| {
            let team = if n < 100 {
                "t0".to_string()
            } else {
                format!("t{n}")
            };
            (team, format!("u{n}"))
        })
        .collect();
    let wave = |server: &TestServer| {
        let requests = users
            .iter()
            .map(|(team, user)| {
                request(&domain, vec![descriptor(&[("team", team), ("user", user)])])
            })
            .collect();
        all_at_once(server, requests)
    };
    let fcalls = || -> u64 { cluster.nodes.iter().map(fcall_calls).sum() };
    let before = fcalls();
    let first = wave(&server).await;
    assert!(first.iter().all(|&c| c == ok()), "{first:?}");
    let used = fcalls() - before;
    assert!(used < 300, "{used} script calls for 300 decisions");

    let team_key = key::build(
        &domain,
        &[
            Segment::Value {
                key: "team",
                value: "t0",
            },
            Segment::Value {
                key: "user",
                value: "u0",
            },
        ],
        Variant::Configured,
        Some("team"),
    );
    let moved = slot(&team_key.log());
    let refused = || -> u64 { cluster.nodes.iter().map(|n| err_replies(n.port)).sum() };
    let cluster_ref = &cluster;
    tokio::task::block_in_place(|| migrate_slot(cluster_ref, moved));
    let refused_before = refused();
    let second = wave(&server).await;
    assert!(second.iter().all(|&c| c == ok()), "{second:?}");
    assert!(
        refused() > refused_before,
        "a master refused requests of the moved slot"
    );
    // And the metrics count the requests sent again.
    assert!(resent(&server).await > 0, "no request sent again");
    let third = wave(&server).await;
    assert!(third.iter().all(|&c| c == over()), "{third:?}");
    assert_eq!(
        entries_in(&cluster, &team_key.log()),
        2,
        "u0's log moved whole"
    );
    server.stop().await;
}

/// A request rejected on one master after another admitted it tentatively reports what is left
/// once its hits are taken back, as the embedded store does (which never recorded them), field
/// by field: a sliding counter whose hits went, from a replica whose clock is behind, to an
/// older bucket than the one it counted already (its reset is that newer bucket's), and a quota
/// descriptor that did not fit beside one of its own value that did (it fits once fewer hits
/// have left).
#[test]
fn a_taken_back_request_reports_what_is_left() {
    use slidegate::limiter::{Descriptor, Limiter, ManualClock, Request};
    let cluster = shared_cluster();
    let owner = owners(cluster);
    let config = |domain: &str| {
        format!(
            "domain: {domain}\ndescriptors:\n  - key: big\n    rate_limit: {{requests_per_unit: 4, window: 2s}}\n    algorithm: sliding_counter\n    buckets: 4\n  - key: meter\n    rate_limit: {{requests_per_unit: 6, window: 2s}}\n  - key: q\n    rate_limit: {{requests_per_unit: 3, window: 10s}}\n    quota_mode: true\n"
        )
    };
    let master = |domain: &str, k: &str, value: &str| {
        let key = key::build(
            domain,
            &[Segment::Value { key: k, value }],
            Variant::Configured,
            None,
        );
        owner(slot(&key.log()))
    };
    // A domain whose rejecting descriptors sit on other masters than those they are sent with.
    let domain = (0..1000)
        .map(|_| unique_domain("taken_back"))
        .find(|d| {
            master(d, "big", "a") != master(d, "meter", "x")
                && master(d, "q", "a") != master(d, "meter", "y")
        })
        .expect("a domain spread over two masters");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let clock = ManualClock::new(T0);
    let limiter = |store: Arc<dyn Store>| {
        let limits =
            slidegate::config::compile_sources(&[("taken_back.yaml".into(), config(&domain))])
                .expect("valid config");
        Limiter::new(
            limits,
            store,
            Arc::new(clock.clone()),
            LimiterOptions::default(),
        )
    };
    let redis = limiter(runtime.block_on(connect(cluster.url(), TEST_TIMEOUT)));
    let embedded = limiter(Arc::new(slidegate::store::MemoryStore::new()));
    let request = |descriptors: &[(&str, &str, u64)]| Request {
        domain: domain.clone(),
        hits_addend: 0,
        descriptors: descriptors
            .iter()
            .map(|&(k, v, hits)| Descriptor {
                entries: vec![(k.to_owned(), v.to_owned())],
                limit: None,
                hits_addend: Some(hits),
            })
            .collect(),
    };
    // (clock, request, the status whose reset is checked, that reset)
    let t = T0 + 100; // 100 ms into a bucket of 500
    let steps = [
        (t, request(&[("big", "a", 1)]), 0, 2_400),
        // 238 ms behind: this bucket is the one before the counted hit's.
        (
            t - 238,
            request(&[("meter", "x", 7), ("big", "a", 1)]),
            1,
            2_638,
        ),
        (T0 + 10_000, request(&[("q", "a", 1)]), 0, 10_000),
        (T0 + 11_000, request(&[("q", "a", 1)]), 0, 9_000),
        // The first q fits (and was recorded, then taken back); the second fits once the
        // oldest entry has left.
        (
            T0 + 12_000,
            request(&[("q", "a", 1), ("q", "a", 2), ("meter", "y", 7)]),
            1,
            8_000,
        ),
    ];
    for (n, (at, request, status, reset)) in steps.iter().enumerate() {
        clock.set(*at);
        let (want, got) = runtime.block_on(async {
            (
                embedded.should_rate_limit(request).await.expect("embedded"),
                redis.should_rate_limit(request).await.expect("redis"),
            )
        });
        assert_eq!(
            want.statuses[*status].duration_until_reset_ms,
            Some(*reset),
            "step {n}: the embedded store's reset"
        );
        assert_eq!(got, want, "step {n}");
    }
}
