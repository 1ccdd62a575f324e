//! The Redis backend: the conformance suite unchanged on standalone Redis and on a 3-master
//! Redis Cluster, plus what only Redis has (scripts, slots, outages, many replicas).
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;
mod conformance;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{
    RedisCluster, RedisProcess, command, fcall_lines, make_certs, shared_cluster,
    shared_standalone, wait_until,
};
use common::*;
use conformance::{Backend, StoreFuture};
use slidegate::limiter::key::{self, Variant};
use slidegate::limiter::rules::Segment;
use slidegate::limiter::{FailurePolicy, LimiterOptions};
use slidegate::store::{ClockSource, RedisOptions, RedisStore, Store};

fn options(url: String, timeout: Duration) -> RedisOptions {
    RedisOptions {
        url,
        pool_size: 2,
        timeout,
        connect_timeout: Duration::from_secs(5),
        clock: ClockSource::Server,
        tls: Default::default(),
        calls_out: RedisOptions::CALLS_OUT,
    }
}

async fn connect(url: String, timeout: Duration) -> Arc<dyn Store> {
    Arc::new(
        RedisStore::connect(options(url, timeout))
            .await
            .expect("connect to test Redis"),
    )
}

/// Tests run two at a time on two loaded cores: a generous deadline keeps them about behaviour.
const TEST_TIMEOUT: Duration = Duration::from_secs(5);

struct Standalone;

impl Backend for Standalone {
    fn store(&self) -> StoreFuture<'_> {
        Box::pin(connect(shared_standalone().url(), TEST_TIMEOUT))
    }
}

struct Cluster;

impl Backend for Cluster {
    fn store(&self) -> StoreFuture<'_> {
        Box::pin(connect(shared_cluster().url(), TEST_TIMEOUT))
    }
}

mod standalone {
    use super::*;
    conformance_suite!(Standalone);
}

mod cluster {
    use super::*;
    conformance_suite!(Cluster);
}

/// Slot of a key as Redis Cluster computes it (CRC16 of the hash tag, mod 16384).
fn slot(key: &str) -> u16 {
    let tag = match (key.find('{'), key.find('}')) {
        (Some(open), Some(close)) if close > open + 1 => &key[open + 1..close],
        _ => key,
    };
    let mut crc: u16 = 0;
    for byte in tag.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// A command on the cluster through `redis-cli -c`, which follows redirects to the key's owner.
fn cluster_cli(cluster: &RedisCluster, args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-c", "-p", &cluster.nodes[0].port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn zcard(cluster: &RedisCluster, key: &str) -> i64 {
    cluster_cli(cluster, &["ZCARD", key])[0]
        .parse()
        .expect("integer reply")
}

/// Hits held in a descriptor's sliding_counter buckets.
fn bucket_hits(cluster: &RedisCluster, key: &str) -> i64 {
    cluster_cli(cluster, &["HVALS", key])
        .iter()
        .map(|v| v.parse::<i64>().expect("integer"))
        .sum()
}

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
                zcard(cluster, &ka.log()),
                zcard(cluster, &kb.log()),
                zcard(cluster, &kc.log()),
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

/// sliding_counter memory stays constant: at most one field per bucket that still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_counter_memory_is_constant() {
    let redis = shared_standalone();
    let domain = unique_domain("constant");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    algorithm: sliding_counter\n    buckets: 10\n    rate_limit: {{unit: minute, requests_per_unit: 1000000}}\n"
    );
    let server = TestServer::start(
        &config,
        connect(redis.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    // Two minutes of traffic, a request every 0.5 s, 100 hits each.
    for _ in 0..240 {
        server.clock.advance(500);
        let r = server
            .call(request(
                &domain,
                vec![with_hits(descriptor(&[("k", "v")]), 100)],
            ))
            .await;
        assert_eq!(r.overall_code, ok());
    }
    let counters = key::build(
        &domain,
        &[Segment::Value {
            key: "k",
            value: "v",
        }],
        Variant::Configured,
        None,
    )
    .counters();
    let fields: i64 = redis
        .cmd(&format!("HLEN {counters}"))
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("HLEN");
    assert!(
        (1..=11).contains(&fields),
        "{fields} buckets kept for a 10-bucket window"
    );
    assert_eq!(
        redis
            .cmd(&format!(
                "EXISTS {}",
                key::build(
                    &domain,
                    &[Segment::Value {
                        key: "k",
                        value: "v"
                    }],
                    Variant::Configured,
                    None
                )
                .log()
            ))
            .trim(),
        ":0",
        "no log at all"
    );
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
    assert_eq!(zcard(cluster, &braces.log()), 2);
    let method = key::build(
        &domain,
        &[seg("user", "42"), seg("method", "GET")],
        Variant::Configured,
        Some("user"),
    );
    assert_eq!(
        zcard(cluster, &method.log()),
        2,
        "the rejected third request recorded nothing in either"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_flush_is_recovered_on_standalone_and_cluster() {
    let own = RedisProcess::start(&[]);
    let cluster = RedisCluster::start();
    for (url, ports) in [
        (own.url(), vec![own.port]),
        (
            cluster.url(),
            cluster.nodes.iter().map(|n| n.port).collect(),
        ),
    ] {
        let config = "domain: flush\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
        let server = TestServer::start(
            config,
            connect(url, TEST_TIMEOUT).await,
            LimiterOptions::default(),
        )
        .await;
        assert_eq!(
            server
                .call(request("flush", vec![descriptor(&[("k", "v")])]))
                .await
                .overall_code,
            ok()
        );
        for port in &ports {
            assert!(
                command(*port, "FUNCTION FLUSH")
                    .expect("FUNCTION FLUSH")
                    .starts_with("+OK")
            );
        }
        let r = server
            .call(request("flush", vec![descriptor(&[("k", "v")])]))
            .await;
        assert_eq!(r.overall_code, ok());
        assert_eq!(
            r.statuses[0].limit_remaining, 8,
            "the first hit is still counted after the reload"
        );
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_fails_fast_by_policy_and_recovers() {
    let mut redis = RedisProcess::start(&[]);
    let config = "domain: outage\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
    let deadline = Duration::from_millis(200);
    let mut servers = Vec::new();
    for policy in [
        FailurePolicy::Error,
        FailurePolicy::Allow,
        FailurePolicy::Deny,
    ] {
        let options = LimiterOptions {
            failure_policy: policy,
            ..LimiterOptions::default()
        };
        servers
            .push(TestServer::start(config, connect(redis.url(), deadline).await, options).await);
    }
    let req = || request("outage", vec![descriptor(&[("k", "v")])]);
    for s in &servers {
        assert_eq!(s.call(req()).await.overall_code, ok());
    }
    redis.stop();
    let started = Instant::now();
    let status = servers[0].call_err(req()).await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(servers[1].call(req()).await.overall_code, ok(), "fail open");
    assert_eq!(
        servers[2].call(req()).await.overall_code,
        over(),
        "fail closed"
    );
    // Three calls, each bounded by the 200 ms deadline (plus scheduling on a busy machine).
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(servers.iter().all(|s| s.limiter.store_errors() >= 1));

    redis.restart();
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let mut client = servers[0].client.clone();
        match client.should_rate_limit(req()).await {
            Ok(r) if r.get_ref().overall_code == ok() => break,
            _ if Instant::now() > end => panic!("service did not resume after Redis came back"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    for s in servers {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_clock_from_time() {
    let redis = shared_standalone();
    let mut opts = options(redis.url(), TEST_TIMEOUT);
    opts.clock = ClockSource::Redis;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    let domain = unique_domain("redisclock");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 3}}\n"
    );
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(
            server
                .call(request(&domain, vec![descriptor(&[("k", "v")])]))
                .await
                .overall_code,
        );
    }
    assert_eq!(codes, vec![ok(), ok(), ok(), over()]);
    server.stop().await;
}

/// The real binary, twice, sharing one Redis: 64 clients split over both, exactly 100 admitted.
async fn two_processes_share_exact_limits(url: String) {
    let dir = std::env::temp_dir().join(unique_domain("twoproc"));
    std::fs::create_dir_all(&dir).expect("config dir");
    let domain = unique_domain("twoproc");
    std::fs::write(
        dir.join("limits.yaml"),
        format!("domain: {domain}\ndescriptors:\n  - key: hot\n    rate_limit: {{unit: minute, requests_per_unit: 100}}\n"),
    )
    .expect("write config");
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let grpc = common::redis::free_port();
        let http = common::redis::free_port();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .arg("--config")
            .arg(&dir)
            .args(["--redis", &url, "--redis-timeout", "5s"])
            .args([
                "--grpc-addr",
                &format!("127.0.0.1:{grpc}"),
                "--http-addr",
                &format!("127.0.0.1:{http}"),
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start slidegate");
        children.push(KillOnDrop(child));
        wait_until("slidegate /readyz", Duration::from_secs(20), || {
            command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
        });
        addrs.push(std::net::SocketAddr::from(([127, 0, 0, 1], grpc)));
    }
    assert_eq!(
        hammer(&addrs, &domain, "hot").await,
        100,
        "640 calls over two processes, 100 per minute"
    );
    drop(children);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_exact_on_standalone() {
    two_processes_share_exact_limits(shared_standalone().url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_exact_on_cluster() {
    two_processes_share_exact_limits(shared_cluster().url()).await;
}

#[test]
fn malformed_script_arguments_get_an_error_reply() {
    let redis = shared_standalone();
    let cli = |args: &[&str]| node_cli(redis.port, args).join("\n").trim().to_string();
    let library = slidegate::store::redis::Library::new();
    let loaded = cli(&["FUNCTION", "LOAD", "REPLACE", &library.code]);
    assert_eq!(loaded, &*library.function, "FUNCTION LOAD: {loaded}");
    let function: &str = &library.function;
    // One key per descriptor (its log or counters), two with a ban. Arguments: the number of
    // requests, the call's time, then per request: shape (4 x descriptor count + mode), per
    // descriptor hits and the rule "role:ban_ms:buckets:debit:limit:window_ms[:limit:window_ms...]",
    // and a tentative request's prefix.
    let ok = "0:0:0:0:10:1000";
    let request =
        |now: &'static str, shape: &'static str, hits: &'static str, rule: &'static str| {
            vec!["1", "k", "1", now, shape, hits, rule]
        };
    let cases: Vec<Vec<&str>> = vec![
        vec!["0"],
        vec!["1", "k", "0"],
        vec!["1", "k", "2", "1", "5", "1", ok],
        request("x", "5", "1", ok),
        // The call's time: digits only (its text becomes entries' scores as it came).
        request(" 5", "5", "1", ok),
        request("5 ", "5", "1", ok),
        request("1.5", "5", "1", ok),
        request("-1", "5", "1", ok),
        request("1e3", "5", "1", ok),
        // A tentative request (mode 0) ends with the prefix that names its entries.
        vec!["1", "k", "1", "1", "4", "1", ok],
        vec!["1", "k", "1", "1", "4", "1", ok, ""],
        // Mode 3, no descriptor, a shape that is no number.
        request("1", "7", "1", ok),
        request("1", "1", "1", ok),
        request("1", "x", "1", ok),
        request("1", "5", "abc", ok),
        request("1", "5", "1", "9:0:0:0:10:1000"),
        request("1", "5", "1", "0:0:0:2:10:1000"),
        request("1", "5", "1", "0:0:0:0:10:0"),
        request("1", "5", "1", "0:0:0:0:10"),
        request("1", "5", "1", "0:0:0:0"),
        request("1", "5", "1", "0:0:x:0:10:1000"),
        request("1", "5", "1", "0::0:0:10:1000"),
        request("1", "5", "1", "0:0:0:0:10:1000:"),
        request("1", "5", "1", "0:0:0:0:10:1000:5"),
        // A ban takes a second key.
        request("1", "5", "1", "0:500:0:0:10:1000"),
        vec!["2", "k", "k2", "1", "1", "5", "1", ok],
        vec!["1", "k", "1", "1", "5", "1", ok, "extra"],
    ];
    for args in cases {
        let mut full = vec!["FCALL", function];
        full.extend_from_slice(&args);
        let reply = cli(&full);
        // The whole call refused (a bad request count, keys or arguments left over), or its
        // request answered -1 and why.
        let lines: Vec<&str> = reply.lines().collect();
        let refused = reply.starts_with("SLIDEGATE ");
        let request_failed = lines.len() >= 2
            && lines[lines.len() - 2] == "-1"
            && lines[lines.len() - 1].starts_with("SLIDEGATE request ");
        assert!(refused || request_failed, "FCALL {args:?} -> {reply}");
    }
    // A bad request fails before it writes anything, and so does every request after it (where
    // they start can no longer be told); a request before it stands.
    let mut full = vec![
        "FCALL", function, "3", "b1:log", "b2:log", "b3:log", "3", "1000",
    ];
    full.extend_from_slice(&["5", "1", ok]);
    full.extend_from_slice(&["5", "1", "0:0:0:0:10"]);
    full.extend_from_slice(&["5", "1", ok]);
    let reply = cli(&full);
    let lines: Vec<&str> = reply.lines().collect();
    assert_eq!(lines[..6], ["1000", "4", "5", "1", "1", "1000"], "{reply}");
    assert_eq!((lines[6], lines[8]), ("-1", "-1"), "{reply}");
    assert!(lines[7].starts_with("SLIDEGATE request 2: "), "{reply}");
    assert!(
        lines[9].starts_with("SLIDEGATE request 3: not decided"),
        "{reply}"
    );
    assert_eq!(lines.len(), 10, "{reply}");
    assert_eq!(cli(&["ZCARD", "b1:log"]), "1");
    assert_eq!(cli(&["EXISTS", "b2:log", "b3:log"]), "0");
    // And a well-formed call answers the documented layout: the call's time, then per request
    // its length, flags (1 fits, 4 recorded), the entry it recorded, count, reset.
    let call = |key: &str, rule: &str| {
        let mut full = vec!["FCALL", function, "1", key];
        full.extend_from_slice(&["1", "1000", "5", "1", rule]);
        cli(&full).lines().map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(
        call("t:log", "0:0:0:0:10:1000"),
        vec!["1000", "4", "5", "1", "1", "1000"]
    );
    assert_eq!(
        cli(&["ZRANGE", "t:log", "0", "-1"]),
        "00000000000000000001:1:1000",
        "one weighted entry: running total, weight, time"
    );
    // sliding_counter with 10 buckets of 100 ms: the hit sits in bucket 10 (1,000..1,100), which
    // stops counting at 1,100 + 1,000.
    assert_eq!(
        call("u:cnt", "0:0:10:0:10:1000"),
        vec!["1000", "4", "5", "0", "1", "1100"]
    );
    assert_eq!(
        cli(&["HGETALL", "u:cnt"]).lines().collect::<Vec<_>>(),
        vec!["100:10", "1"]
    );
    // One call, three requests, each decided as if alone and in order: the first meets a key of
    // another type and fails alone (-1 and what Redis said), the second and third share a log
    // with a limit of 1, so the third finds the second's entry and is rejected.
    assert_eq!(cli(&["SET", "w:log", "not a log"]), "OK");
    let request = ["5", "1", "0:0:0:0:1:1000"];
    let mut full = vec![
        "FCALL", function, "3", "w:log", "v:log", "v:log", "3", "2000",
    ];
    for _ in 0..3 {
        full.extend_from_slice(&request);
    }
    let reply = cli(&full);
    let lines: Vec<&str> = reply.lines().collect();
    assert_eq!((lines[0], lines[1]), ("2000", "-1"), "{reply}");
    assert!(lines[2].starts_with("WRONGTYPE"), "{reply}");
    assert_eq!(
        lines[3..],
        [
            "4", "5", "1", "1", "1000", // admitted: fits, recorded entry 1
            "3", "0", "1", "1000", // 1 of 1, nothing recorded: wait 1,000 ms
        ]
    );
    assert_eq!(cli(&["ZCARD", "v:log"]), "1");
}

/// Loading the script at start-up waits as long as connecting may (`--redis-connect-timeout`),
/// not a decision's deadline: a Redis that holds every write for 300 ms when slidegate starts
/// (`CLIENT PAUSE 300 WRITE`; `FUNCTION LOAD` is a write) still gets the library loaded, and the
/// store starts, with a 15 ms decision deadline.
#[tokio::test]
async fn a_slow_script_load_at_start_is_waited_for() {
    let redis = RedisProcess::start(&[]);
    assert_eq!(redis.cmd("CLIENT PAUSE 300 WRITE").trim(), "+OK");
    let started = std::time::Instant::now();
    let store = RedisStore::connect(options(redis.url(), Duration::from_millis(15))).await;
    assert!(store.is_ok(), "start-up failed: {:?}", store.err());
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "the load did not wait for the pause: {:?}",
        started.elapsed()
    );
    let libraries = node_cli(redis.port, &["FUNCTION", "LIST"]).join("\n");
    let library = slidegate::store::redis::Library::new();
    assert!(libraries.contains(&*library.function), "{libraries}");
}

/// A script load that takes longer than connecting may (`--redis-connect-timeout`, 500 ms here:
/// Redis holds writes for 5 s) does not stop the start: the store starts, and once Redis takes
/// writes again the first decision loads the script and is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_load_past_the_connect_timeout_is_left_to_the_first_call() {
    let redis = RedisProcess::start(&[]);
    assert_eq!(redis.cmd("CLIENT PAUSE 5000 WRITE").trim(), "+OK");
    let mut opts = options(redis.url(), TEST_TIMEOUT);
    opts.connect_timeout = Duration::from_millis(500);
    let store = RedisStore::connect(opts).await;
    let store: Arc<dyn Store> = Arc::new(store.expect("the store starts"));
    let libraries = node_cli(redis.port, &["FUNCTION", "LIST"]).join("\n");
    assert!(
        !libraries.contains("slidegate_"),
        "loaded during the pause: {libraries}"
    );
    let unpaused = command(redis.port, "CLIENT UNPAUSE\r\n").expect("CLIENT UNPAUSE");
    assert!(unpaused.starts_with("+OK"), "{unpaused}");
    let domain = unique_domain("lateload");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
    );
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    let mut codes = Vec::new();
    for _ in 0..2 {
        let call = server.call(request(&domain, vec![descriptor(&[("k", "v")])]));
        codes.push(call.await.overall_code);
    }
    assert_eq!(codes, vec![ok(), over()]);
    server.stop().await;
}

/// An HTTP/2 connection to `addr` from hyper's client, with `ShouldRateLimit` calls of
/// `message` written by hand, `grpc-timeout` only where given: tonic's client would also end a
/// call itself at its deadline, hiding whether the server did.
struct RawCaller {
    send: hyper::client::conn::http2::SendRequest<http_body_util::Full<prost::bytes::Bytes>>,
    addr: std::net::SocketAddr,
    body: prost::bytes::Bytes,
}

impl RawCaller {
    async fn connect(
        addr: std::net::SocketAddr,
        message: &slidegate::proto::RateLimitRequest,
    ) -> RawCaller {
        use prost::Message as _;
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let message = message.encode_to_vec();
        let mut body = vec![0u8];
        body.extend(u32::try_from(message.len()).expect("small").to_be_bytes());
        body.extend(message);
        RawCaller {
            send,
            addr,
            body: body.into(),
        }
    }

    /// One call: its `grpc-status` (in the trailers, or the headers of a trailers-only
    /// answer), the headers it came with, and how long it took.
    async fn call(
        &mut self,
        timeout: Option<&'static str>,
    ) -> (Option<String>, hyper::HeaderMap, Duration) {
        use http_body_util::BodyExt as _;
        let mut call = hyper::Request::post(format!(
            "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            self.addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
        if let Some(timeout) = timeout {
            call = call.header("grpc-timeout", timeout);
        }
        let call = call
            .body(http_body_util::Full::new(self.body.clone()))
            .expect("a request");
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), self.send.send_request(call))
            .await
            .expect("answered within 5 s")
            .expect("an answer");
        let headers = answer.headers().clone();
        let body = answer.into_body().collect().await.expect("a body");
        let waited = started.elapsed();
        let status = body
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| headers.get("grpc-status"))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        (status, headers, waited)
    }
}

/// A Redis of its own, a server on it whose store waits `timeout` for a caller without a
/// deadline, and a [`RawCaller`] whose first call shows the path works (the script loaded).
async fn raw_caller_on_redis(timeout: Duration) -> (RedisProcess, TestServer, RawCaller) {
    let redis = RedisProcess::start(&[]);
    let store = RedisStore::connect(options(redis.url(), timeout))
        .await
        .expect("the store starts");
    let domain = unique_domain("deadline");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 10}}\n"
    );
    let server = TestServer::start(&config, Arc::new(store), LimiterOptions::default()).await;
    let message = request(&domain, vec![descriptor(&[("k", "v")])]);
    let mut caller = RawCaller::connect(server.grpc_addr, &message).await;
    let (status, _, _) = caller.call(None).await;
    assert_eq!(status.as_deref(), Some("0"), "Redis answers while it runs");
    (redis, server, caller)
}

/// The caller's `grpc-timeout` (Envoy sends its filter timeout) ends a call there, over a real
/// connection: Redis holds every command (`CLIENT PAUSE ... ALL`) and the store would wait 10 s,
/// but a call sent with `grpc-timeout: 50m` is answered `CANCELLED` long before either ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_grpc_timeout_ends_the_call_while_redis_holds_it() {
    let (redis, server, mut caller) = raw_caller_on_redis(Duration::from_secs(10)).await;

    assert_eq!(redis.cmd("CLIENT PAUSE 3000 ALL").trim(), "+OK");
    let (status, headers, waited) = caller.call(Some("50m")).await;
    assert_eq!(
        status.as_deref(),
        Some("1"),
        "CANCELLED, trailers-only: {headers:?}"
    );
    assert_eq!(
        headers.get("grpc-message").map(|v| v.as_bytes()),
        Some(&b"Timeout%20expired"[..])
    );
    assert!(
        waited >= Duration::from_millis(50) && waited < Duration::from_secs(2),
        "answered at {waited:?}"
    );
    // The pause ends by itself (Redis holds even `CLIENT UNPAUSE` from a client during it).
    drop(caller);
    server.stop().await;
}

/// A caller that waits longer than `--redis-timeout` (a gRPC client's deadline, Envoy with a
/// longer filter timeout) gets Redis's answer rather than a failure while it still waits: with
/// the shipped 15 ms, a call sent with `grpc-timeout: 2S` while Redis holds every command for
/// 300 ms is decided when Redis resumes; one sent with no deadline fails at 15 ms, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_longer_deadline_is_waited_for() {
    let (redis, server, mut caller) = raw_caller_on_redis(Duration::from_millis(15)).await;

    assert_eq!(redis.cmd("CLIENT PAUSE 300 ALL").trim(), "+OK");
    let (status, headers, waited) = caller.call(Some("2S")).await;
    assert_eq!(
        status.as_deref(),
        Some("0"),
        "decided, not failed: {headers:?}"
    );
    assert!(
        waited >= Duration::from_millis(200),
        "decided when Redis resumed, not before: {waited:?}"
    );

    // A long pause, so that failing at 15 ms and waiting for Redis stay far apart however
    // slowly the machine runs (the pause ends by itself; the test does not wait for it).
    assert_eq!(redis.cmd("CLIENT PAUSE 3000 ALL").trim(), "+OK");
    let (status, headers, waited) = caller.call(None).await;
    assert_eq!(
        status.as_deref(),
        Some("14"),
        "UNAVAILABLE at --redis-timeout: {headers:?}"
    );
    assert!(
        waited < Duration::from_millis(2_000),
        "failed at the store deadline, before Redis resumed: {waited:?}"
    );
    drop(caller);
    server.stop().await;
}

/// slidegate's library loaded into the shared standalone Redis, and a `redis-cli` there that
/// takes built strings (its replies one per line).
fn library_on_shared_redis() -> (
    slidegate::store::redis::Library,
    impl Fn(&[String]) -> String,
) {
    let port = shared_standalone().port;
    let library = slidegate::store::redis::Library::new();
    let cli = move |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node_cli(port, &args).join("\n")
    };
    let loaded = cli(&[
        "FUNCTION".into(),
        "LOAD".into(),
        "REPLACE".into(),
        library.code.to_string(),
    ]);
    assert_eq!(loaded, &*library.function);
    (library, cli)
}

/// A script reply to `requests` requests of one descriptor each, admitted, split per request:
/// flags, entry, count, reset (each after its length, 4; the call's time first).
fn one_descriptor_answers(reply: &str, requests: usize) -> Vec<Vec<&str>> {
    let lines: Vec<&str> = reply.lines().collect();
    let head = &reply[..reply.len().min(400)];
    assert_eq!(lines.len(), 1 + requests * 5, "{head}");
    lines[1..]
        .chunks(5)
        .map(|answer| {
            assert_eq!(answer[0], "4", "{head}");
            answer[1..].to_vec()
        })
        .collect()
}

/// The library keeps the rules it has read from call to call, up to 1,000, then drops them all
/// at once: a call with more distinct rules than that (the drop happens between checking its
/// arguments and deciding them) still decides every request.
#[test]
fn a_call_with_more_rules_than_the_library_keeps_decides_each_request() {
    let (library, cli) = library_on_shared_redis();
    let requests = 1_200;
    let mut args = vec![
        "FCALL".to_string(),
        library.function.to_string(),
        requests.to_string(),
    ];
    args.extend((0..requests).map(|r| format!("rl:{{many-rules}}:{r}:log")));
    args.extend([requests.to_string(), "1000".to_string()]);
    for r in 0..requests {
        // Every request its own rule: limit 10 + r in a 1 s window.
        args.extend(["5".into(), "1".into(), format!("0:0:0:0:{}:1000", 10 + r)]);
    }
    let reply = cli(&args);
    for (r, answer) in one_descriptor_answers(&reply, requests).iter().enumerate() {
        assert_eq!(answer[..2], ["5", "1"], "request {r} was admitted");
    }
}

/// The library keeps the numbers it has read (and their text) from call to call, and drops them
/// all when a call starts with more than it keeps (1,000), never during a call: a call whose own
/// arguments hold more distinct numbers than that decides each request, and the calls after the
/// drop still count every hit (two calls of 1,200 requests on one log, each request with hits
/// of its own, 1 to 1,200).
#[test]
fn calls_across_the_dropped_numbers_count_every_hit() {
    let (library, cli) = library_on_shared_redis();
    let requests = 1_200;
    let mut total = 0u64;
    for call in 0..2u64 {
        let mut args = vec![
            "FCALL".to_string(),
            library.function.to_string(),
            requests.to_string(),
        ];
        args.extend((0..requests).map(|_| "rl:{many-numbers}:log".to_string()));
        let now = 1_000_000 + call * 10_000;
        args.extend([requests.to_string(), now.to_string()]);
        for r in 0..requests as u64 {
            args.extend([
                "5".into(),
                (1 + r).to_string(),
                "0:0:0:0:100000000:100000000".into(),
            ]);
        }
        let reply = cli(&args);
        for (r, answer) in one_descriptor_answers(&reply, requests).iter().enumerate() {
            total += 1 + r as u64;
            let expected = total.to_string();
            assert_eq!(
                answer[..3],
                ["5", expected.as_str(), expected.as_str()],
                "call {call}, request {r}: admitted, recorded at the running total, counted"
            );
        }
    }
    // Members are the running total, 20 digits zero-padded, below the totals the library keeps
    // made (1,000) and above, the weight and the time: the first entry's weight is 1, the
    // last's total 1,441,200.
    let members = cli(&[
        "ZRANGE".into(),
        "rl:{many-numbers}:log".into(),
        "0".into(),
        "-1".into(),
    ]);
    let members: Vec<&str> = members.lines().collect();
    assert_eq!(members.len(), 2 * requests, "one entry per request");
    assert_eq!(members[0], "00000000000000000001:1:1000000");
    let last = members[members.len() - 1];
    assert_eq!(last, format!("{total:020}:1200:1010000"));
}

/// A tentative request's entry (a request over several cluster masters) holds its time too,
/// `<cum>:<weight>:<time>:<prefix>:<i>`, and the reply gives that time after the running total,
/// so that the caller can name the entry to remove it; reading such entries back, as the newest
/// and as the window's first, takes no read of their score.
#[test]
fn a_tentative_entry_holds_its_time_and_is_read_without_its_score() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // One descriptor, tentative (shape 4: mode 0), one hit, 5 a second, then the prefix.
    let call = |now: &str, prefix: &str| {
        cli(&[
            "FCALL",
            &library.function,
            "1",
            "t:log",
            "1",
            now,
            "4",
            "1",
            "0:0:0:0:5:1000",
            prefix,
        ])
    };
    // The call's time, the request's length, then flags (fits, recorded), cum, time, count,
    // reset.
    assert_eq!(
        call("10000", "p-1"),
        ["10000", "5", "5", "1", "10000", "1", "1000"]
    );
    assert_eq!(
        call("10010", "p-2"),
        ["10010", "5", "5", "2", "10010", "2", "990"]
    );
    let scores_read = calls_of(&redis, "zscore");
    // The third finds a log of two: its newest entry and, after the trim, its first are read.
    assert_eq!(
        call("10020", "p-3"),
        ["10020", "5", "5", "3", "10020", "3", "980"]
    );
    assert_eq!(calls_of(&redis, "zscore"), scores_read, "no score read");
    assert_eq!(
        cli(&["ZRANGE", "t:log", "0", "-1"]),
        [
            "00000000000000000001:1:10000:p-1:1",
            "00000000000000000002:1:10010:p-2:1",
            "00000000000000000003:1:10020:p-3:1"
        ]
    );
}

/// A ban key holds the ban's end and lives a second past it, the slack the data keys keep for
/// replicas' clocks: a replica whose clock is behind still finds the ban until its own clock
/// reaches the end, and one past the end is not banned though the key is still there.
#[test]
fn a_ban_key_outlasts_its_ban_by_the_clock_slack() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // role:ban_ms:buckets:debit:limit:window_ms: 1 a second, a ban of 800 ms. One request of
    // one descriptor in final mode (shape 5), one hit; keys: the log, the ban.
    let call = |now: &str| {
        cli(&[
            "FCALL",
            &library.function,
            "2",
            "b:log",
            "b:ban",
            "1",
            now,
            "5",
            "1",
            "0:800:0:0:1:1000",
        ])
    };
    // Per request: its length, then flags (1 fits, 2 set the ban, 4 recorded, 8 banned).
    assert_eq!(call("10000")[2], "5", "admitted and recorded");
    assert_eq!(
        call("10010")[2..4],
        ["10", "800"],
        "over: the ban is set, 800 ms left"
    );
    assert_eq!(cli(&["GET", "b:ban"]), ["10810"], "the ban's end");
    let left: u64 = cli(&["PTTL", "b:ban"])[0].parse().expect("PTTL");
    assert!(
        (1_000..=1_800).contains(&left),
        "the ban (800 ms) and the slack (1 s): {left} ms left"
    );
    // Inside the ban by the caller's clock: banned, 310 ms left.
    assert_eq!(call("10500")[2..4], ["8", "310"]);
    // Past the ban's end and the window: admitted, the key notwithstanding.
    assert_eq!(call("11100")[2], "5");
}

/// A log's expiry, on the common paths (one request of one descriptor; one of two on logs of
/// their own), is set when its newest entry is the first of its period (a quarter window), to
/// the window plus a period plus 1 s, and by a call that finds the newest entry in an earlier
/// period than its own: exactly those calls set it (an admitted call in the newest entry's
/// period does not), and the key outlives its newest entry by the window plus 1 s after every
/// call, admitted or rejected. 80 calls 37 ms apart (the script's clock injected) on a 1 s
/// window, with a limit of 10 (most are rejected) and of 1,000 (all admitted, and the expiry
/// set about once a period); Redis's own clock barely moves, so an expiry set at call time t
/// lasts, in the calls' time, until t plus the TTL.
#[test]
fn a_logs_expiry_is_set_once_a_period_and_outlasts_its_newest_entry() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // role:ban_ms:buckets:debit:limit:window_ms; a period of 250 ms, a TTL of 2,250 ms.
    let (window, ttl) = (1_000u64, 2_250u64);
    for (rule, keys) in [
        ("0:0:0:0:10:1000", vec!["one:log"]),
        ("0:0:0:0:10:1000", vec!["two:log", "three:log"]),
        ("0:0:0:0:1000:1000", vec!["four:log"]),
        ("0:0:0:0:1000:1000", vec!["five:log", "six:log"]),
    ] {
        let n = keys.len().to_string();
        // Final mode (1), n descriptors.
        let shape = (4 * keys.len() + 1).to_string();
        // Per key: when its expiry was last set, and its newest entry (call times).
        let mut set_at: Option<u64> = None;
        let mut newest: Option<u64> = None;
        let (mut sets, mut rejected) = (0, 0);
        let period = |t: u64| t / 250;
        for call in 0..80u64 {
            let now = 10_000 + 37 * call;
            let now_text = now.to_string();
            let mut args = vec!["FCALL", &library.function, &n];
            args.extend(&keys);
            args.extend(["1", &now_text, &shape]);
            for _ in &keys {
                args.extend(["1", rule]);
            }
            let before = calls_of(&redis, "pexpire");
            let reply = cli(&args);
            let expiries = calls_of(&redis, "pexpire") - before;
            // Each key sees the same calls: all set their expiry, or none.
            assert!(
                expiries == 0 || expiries == keys.len() as u64,
                "call {call}: {expiries} expiries set for {keys:?}"
            );
            if expiries > 0 {
                set_at = Some(now);
                sets += 1;
            }
            // The length, now, then the first descriptor's flags: 5 admitted and recorded.
            let recorded = match reply[2].as_str() {
                "5" => true,
                "0" => false,
                flags => panic!("call {call}: flags {flags}: {reply:?}"),
            };
            let expected = match newest {
                None => recorded,
                Some(head) => period(now) != period(head),
            };
            assert_eq!(
                expiries > 0,
                expected,
                "call {call} at {now} (newest entry {newest:?}, recorded {recorded})"
            );
            if recorded {
                newest = Some(now);
            } else {
                rejected += 1;
            }
            if let Some(newest) = newest {
                let set_at = set_at.expect("a log with entries has had its expiry set");
                assert!(
                    set_at + ttl >= newest + window + 1_000,
                    "call {call}: the expiry set at {set_at} ends before the entry at {newest} leaves the window (plus 1 s)"
                );
                for key in &keys {
                    let left: i64 = cli(&["PTTL", key])[0].parse().expect("PTTL");
                    assert!(left > 0, "call {call}: {key} has no expiry: {left}");
                }
            }
        }
        if rule.contains(":10:") {
            assert!(rejected > 40, "{keys:?}: {rejected} of 80 rejected");
        } else {
            // 80 calls over 2.9 s: twelve periods.
            assert_eq!((rejected, sets), (0, 12), "{keys:?}: rejected, expiry set");
        }
    }
}

/// The script decides the common requests by paths of their own (`decide_logs`: every
/// descriptor on a one-window log without a ban, each on a log of its own; `decide_single`: the
/// same for one descriptor), a fifth to a quarter fewer instructions than the general `decide`.
/// Fed the same calls on twin logs, the library with those paths and one whose general path
/// decides everything must answer alike, field by field: every role, mode and debit, checks
/// (hits 0), weighted hits, rejections whose reset is searched in the log, logs emptied by the
/// window, logs whose only entry is their first (which the common paths read as such), several
/// requests on one log in one call, calls whose time is behind their logs' newest entries (a
/// replica's clock behind another's), and requests that are not of those kinds (two
/// descriptors on one log, a ban, two windows) left to the general path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_common_request_paths_answer_as_the_general_one() {
    use fred::prelude::{ClientLike as _, SortedSetsInterface as _, Value};
    use slidegate::store::redis::Library;

    const SOURCE: &str = include_str!("../lua/slidegate.lua");
    const TAKES_OWN_PATHS: &str = "local n = shape and (shape - shape % 4) / 4";
    assert!(
        SOURCE.contains(TAKES_OWN_PATHS),
        "the script no longer chooses its own paths where this test turns them off"
    );
    let own_paths = Library::new();
    let general = Library::from_source(&SOURCE.replace(TAKES_OWN_PATHS, "local n = false"));
    let config = fred::types::config::Config::from_url(&shared_standalone().url()).unwrap();
    let client = fred::clients::Client::new(config, None, None, None);
    client.init().await.unwrap();
    for library in [&own_paths, &general] {
        library.load(&client, TEST_TIMEOUT).await.unwrap();
    }
    // role:ban_ms:buckets:debit:limit:window_ms (layout in lua/slidegate.lua); the last two are
    // for the general path only.
    const RULES: [&str; 9] = [
        "0:0:0:0:3:1000",
        "0:0:0:0:1:300",
        "1:0:0:0:2:1000",
        "2:0:0:0:2:1500",
        "0:0:0:1:5:2000",
        "2:0:0:1:4:1000",
        "0:0:0:0:6:2500",
        "0:800:0:0:2:1000",
        "0:0:0:0:2:500:4:2000",
    ];
    // A fixed pseudo-random sequence (64-bit LCG): a failure names its case and step.
    let mut seed: u64 = 0x5eed_f51d;
    let mut next = |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    // Flags of lone descriptors' answers: 5 admitted and recorded, 0 or 1 recorded nothing,
    // 4 a debit recorded past its budget.
    let mut lone = [0u64; 3];
    let mut several = 0u64;
    let mut one_entry = 0u64;
    for case in 0..32 {
        let tag = unique_domain("paths");
        let mut now = 1_000_000u64;
        for step in 0..60 {
            now += next(600);
            // One call in six from a replica whose clock is behind the one that wrote the
            // newest entries (each path stamps an entry no earlier than its log's newest).
            let at = if next(6) == 0 {
                now - 1 - next(800)
            } else {
                now
            };
            let requests = 1 + next(3);
            let mode = next(3);
            let mut descriptors = Vec::new();
            let mut args = vec![
                Value::from(requests.to_string()),
                Value::from(at.to_string()),
            ];
            for r in 0..requests {
                // Mostly one descriptor, from one of the first rules (the common kinds).
                let n = if next(2) == 0 { 1 } else { 1 + next(3) };
                args.push(Value::from((4 * n + mode).to_string()));
                for _ in 0..n {
                    let kinds = if next(4) == 0 { 9 } else { 7 };
                    let rule = RULES[usize::try_from(next(kinds)).unwrap()];
                    let log = next(3);
                    args.extend([Value::from(next(4).to_string()), Value::from(rule)]);
                    descriptors.push((log, rule.starts_with("0:800:")));
                }
                // A tentative request (mode 0) ends with the prefix that names its entries.
                if mode == 0 {
                    args.push(Value::from(format!("p{step}-{r}")));
                }
                several += u64::from(n > 1);
            }
            // Logs whose newest entry has a running total of 1, their only entry (the common
            // paths read such a log as it is: nothing to trim, no first entry to read),
            // counted on the own paths' twin before the call.
            // A member starts with its running total, padded to 20 digits.
            const ONLY_ENTRY: &str = "00000000000000000001:";
            let mut logs: Vec<u64> = descriptors.iter().map(|&(log, _)| log).collect();
            logs.sort_unstable();
            logs.dedup();
            for log in logs {
                let key = format!("rl:{{{tag}}}:own:{log}");
                let newest: Vec<String> = client
                    .zrange(key, -1, -1, None, false, None, false)
                    .await
                    .unwrap();
                one_entry += u64::from(newest.first().is_some_and(|m| m.starts_with(ONLY_ENTRY)));
            }
            let mut answers = Vec::new();
            for (library, twin) in [(&own_paths, "own"), (&general, "general")] {
                let mut keys = Vec::new();
                for &(log, banned) in &descriptors {
                    keys.push(fred::types::Key::from(format!("rl:{{{tag}}}:{twin}:{log}")));
                    if banned {
                        keys.push(fred::types::Key::from(format!(
                            "rl:{{{tag}}}:{twin}:{log}:ban"
                        )));
                    }
                }
                answers.push(library.call(&client, keys, args.clone()).await.unwrap());
            }
            assert_eq!(answers[0], answers[1], "case {case}, step {step}: {args:?}");
            let flat = &unpacked(&answers[0]);
            // The call's time, then per request its length and its values.
            let mut rest = &flat[1..];
            while let [Value::Integer(length), tail @ ..] = rest {
                let length = usize::try_from(*length).unwrap_or_else(|_| {
                    panic!("a request failed: {rest:?}");
                });
                let (fields, tail) = tail.split_at(length);
                rest = tail;
                // A lone descriptor's answer is flags, [entry,] count, reset.
                match (fields.len(), fields.first()) {
                    (4, Some(Value::Integer(5))) => lone[0] += 1,
                    (3, Some(Value::Integer(0 | 1))) => lone[1] += 1,
                    (4, Some(Value::Integer(4))) => lone[2] += 1,
                    _ => {}
                }
            }
            assert!(rest.is_empty(), "case {case}, step {step}: {flat:?}");
        }
    }
    // The sequence reaches each kind of answer.
    assert!(
        lone.iter().all(|&n| n > 0) && several > 100 && one_entry > 100,
        "lone descriptors' answers by kind: {lone:?}; requests of several: {several}; \
         logs of one entry: {one_entry}"
    );
    client.quit().await.unwrap();
}

/// `rediss://` with a password: a real TLS Redis with a test CA, which the binary trusts through
/// `SSL_CERT_FILE` (read by rustls' native roots). A wrong password fails start-up with the
/// password redacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_password_from_the_url() {
    let scratch = common::temp_dir("tls");
    let dir = &scratch.0;
    make_certs(dir, &[("server", "DNS:localhost,IP:127.0.0.1")]);
    let ca = dir.join("ca.crt").display().to_string();
    let redis = RedisProcess::start_tls(dir, None, &["--requirepass", "s3cret-pw"]);
    let config = dir.join("limits.yaml");
    std::fs::write(&config, "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n").expect("write");
    let start = |password: &str, grpc: u16, http: u16| {
        std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .env("SSL_CERT_FILE", &ca)
            .arg("--config")
            .arg(&config)
            .args([
                "--redis",
                &format!("rediss://:{password}@localhost:{}", redis.port),
                "--redis-timeout",
                "5s",
            ])
            .args([
                "--grpc-addr",
                &format!("127.0.0.1:{grpc}"),
                "--http-addr",
                &format!("127.0.0.1:{http}"),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start slidegate")
    };

    let wrong = start(
        "wrong-pw",
        common::redis::free_port(),
        common::redis::free_port(),
    )
    .wait_with_output()
    .expect("slidegate exits");
    assert!(!wrong.status.success());
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        stderr.contains("cannot use Redis at rediss://:***@localhost"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("wrong-pw"),
        "the password leaked: {stderr}"
    );

    let (grpc, http) = (common::redis::free_port(), common::redis::free_port());
    let _server = KillOnDrop(start("s3cret-pw", grpc, http));
    wait_until("slidegate over TLS ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let client = common::connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let mut codes = Vec::new();
    for _ in 0..2 {
        let r = client
            .clone()
            .should_rate_limit(request("tls", vec![descriptor(&[("k", "v")])]))
            .await
            .expect("call");
        codes.push(r.into_inner().overall_code);
    }
    assert_eq!(codes, vec![ok(), over()]);
    // Redis goes before its certificates' directory.
    drop(redis);
    drop(scratch);
}

fn budget_item(
    key: &slidegate::store::StoreKey,
    hits: u64,
    limit: u32,
) -> slidegate::store::CheckItem<'static> {
    slidegate::store::CheckItem {
        key: key.clone(),
        windows: std::borrow::Cow::Owned(vec![slidegate::store::Window {
            limit,
            length_ms: 3_600_000,
        }]),
        algorithm: slidegate::store::Algorithm::SlidingLog,
        ban_ms: None,
        hits,
        role: slidegate::store::Role::Enforce,
        debit: true,
        memo: None,
    }
}

/// Writes entries into a log as another writer left them: (score, member) each.
fn seed_log(redis: &common::redis::RedisProcess, log: &str, entries: &[(u64, String)]) {
    for (at, member) in entries {
        let reply = redis.cmd(&format!("ZADD {log} {at} {member}"));
        assert!(reply.starts_with(":1"), "{reply}");
    }
}

/// A log written by the previous version (one member `<time>:<prefix>:<i>:<j>` per hit) keeps
/// counting: the first call rewrites it as weighted entries, weight 1 each, times kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_format_logs_are_migrated_on_first_touch() {
    let redis = shared_standalone();
    let key = slidegate::store::StoreKey::new(&unique_domain("old"), "");
    let log = key.log();
    let old = |at: u64, member: &str| (at, format!("{at}:oldcall:{member}"));
    seed_log(
        redis,
        &log,
        &[
            old(T0 - 9_000, "1:1"),
            old(T0 - 5_000, "1:2"),
            old(T0 - 5_000, "1:3"),
        ],
    );
    let store = connect(redis.url(), TEST_TIMEOUT).await;
    let outcome = store
        .check(&[budget_item(&key, 2, 10)], T0)
        .await
        .expect("decided");
    assert_eq!(outcome.items[0].windows[0].count, 5, "3 old hits + 2");
    let members = redis.cmd(&format!("ZRANGE {log} 0 -1"));
    let members: Vec<&str> = members
        .lines()
        .filter(|l| !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    assert_eq!(members.len(), 4, "{members:?}");
    // Running total, weight and time, as every final request's entry is now written.
    assert_eq!(
        members,
        [
            format!("00000000000000000001:1:{}", T0 - 9_000),
            format!("00000000000000000002:1:{}", T0 - 5_000),
            format!("00000000000000000003:1:{}", T0 - 5_000),
            format!("00000000000000000005:2:{T0}"),
        ]
    );
    // The oldest hit still leaves when it did: 9 s ago in a 1 h window.
    let check = store
        .check(&[budget_item(&key, 0, 10)], T0)
        .await
        .expect("check");
    assert_eq!(check.items[0].windows[0].reset_ms, 3_600_000 - 9_000);
}

/// Entries whose member holds no time (an earlier version wrote a tentative request's as
/// `<cum>:<weight>:<prefix>:<i>`) are read by their score: the count, the reset
/// from the window's first entry, and a new entry stamped no earlier than the newest one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_without_their_time_in_the_member_are_read_by_their_score() {
    let redis = shared_standalone();
    let key = slidegate::store::StoreKey::new(&unique_domain("untimed"), "");
    let log = key.log();
    // Totals 2 and 5 (weights 2 and 3); the newest half a second ahead of the caller's clock.
    seed_log(
        redis,
        &log,
        &[
            (
                T0 - 9_000,
                "00000000000000000002:2:0123456789abcdef-7:1".into(),
            ),
            (
                T0 + 500,
                "00000000000000000005:3:0123456789abcdef-8:2".into(),
            ),
        ],
    );
    let store = connect(redis.url(), TEST_TIMEOUT).await;
    let outcome = store
        .check(&[budget_item(&key, 1, 10)], T0)
        .await
        .expect("decided");
    let window = &outcome.items[0].windows[0];
    assert_eq!(window.count, 6, "5 hits before + 1");
    assert_eq!(
        window.reset_ms,
        3_600_000 - 9_000,
        "until the first entry, 9 s old, leaves the 1 h window"
    );
    let newest = redis.cmd(&format!("ZRANGE {log} -1 -1 WITHSCORES"));
    let newest: Vec<&str> = newest
        .lines()
        .filter(|l| !l.starts_with('*') && !l.starts_with('$'))
        .collect();
    let stamp = (T0 + 500).to_string();
    assert_eq!(
        newest,
        [format!("00000000000000000006:1:{stamp}"), stamp.clone()],
        "stamped at the newest entry's time, not the caller's earlier one"
    );
}

/// The script of `e21026b`, the last one before an entry's time went into its member and a final
/// request stopped sending its member prefix: a fixture for the rolling upgrade, kept verbatim.
const PREVIOUS_SCRIPT: &str = include_str!("fixtures/slidegate-e21026b.lua");

/// One version of the script, called the way that version takes its arguments.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Version {
    /// `PREVIOUS_SCRIPT`: per request the member prefix, the shape, then the descriptors.
    Previous,
    /// `lua/slidegate.lua`: the shape, the descriptors, then the prefix of a tentative request.
    Current,
}

/// A rolling upgrade: replicas of the previous version and of this one, side by side on one
/// Redis, write the same logs. Each version runs its own library (named after its hash) and reads
/// the other's entries: the previous one reads a member's total and weight and takes the time from
/// the score, this one reads a member without its time by its score. One sequence of requests on a
/// log of 5 a second (weights 1 to 3, some a tentative request's, some stamped by a clock 250 ms
/// behind) goes to three logs: one written by this version alone, one by the previous alone, one
/// by the two in turn. Every answer (fits, recorded, running total, count, reset) and every entry
/// (total, weight, time) is the same in all three.
#[test]
fn two_versions_side_by_side_count_one_log_exactly() {
    let (redis, current) = redis_with_library();
    let previous = slidegate::store::redis::Library::from_source(PREVIOUS_SCRIPT);
    assert_ne!(previous.function, current.function, "two libraries");
    assert_eq!(
        node_cli(redis.port, &["FUNCTION", "LOAD", &previous.code]),
        [previous.function.to_string()]
    );
    let rule = "0:0:0:0:5:1000";
    // One request of one descriptor: the reply's integers after the call's time and the
    // request's length, without the entry's time that this version adds for a tentative one.
    let decide = |version: Version, log: &str, now: u64, hits: u64, tentative: bool, n: usize| {
        let shape = if tentative { "4" } else { "5" };
        let prefix = format!("upgrade-{n}");
        let (now, hits) = (now.to_string(), hits.to_string());
        let mut args = vec!["FCALL", "", "1", log, "1", &now];
        match version {
            Version::Previous => {
                args[1] = &*previous.function;
                args.extend([prefix.as_str(), shape, hits.as_str(), rule]);
            }
            Version::Current => {
                args[1] = &*current.function;
                args.extend([shape, hits.as_str(), rule]);
                if tentative {
                    args.push(prefix.as_str());
                }
            }
        }
        let reply = node_cli(redis.port, &args);
        assert!(reply.len() > 2, "{version:?}: {reply:?}");
        assert_eq!(reply[0], now, "{version:?}: {reply:?}");
        let mut answer: Vec<i64> = reply[2..]
            .iter()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{version:?}: {reply:?}"))
            })
            .collect();
        assert_eq!(answer.len().to_string(), reply[1], "{version:?}: {reply:?}");
        let recorded = answer[0] & 4 != 0;
        if version == Version::Current && tentative && recorded {
            // The call's time, or the newest entry's where the caller's clock is behind it.
            let at = answer.remove(2);
            let now: i64 = now.parse().unwrap_or_default();
            assert!(
                (now..=now + 250).contains(&at),
                "the entry's time {at} at {now}"
            );
        }
        answer
    };
    let logs = ["up:{current}:log", "up:{previous}:log", "up:{mixed}:log"];
    let (mut now, mut admitted, mut rejected, mut side_by_side) = (100_000u64, 0, 0, 0);
    for n in 0..90 {
        // Mostly forward by 83 ms; every seventh request from a clock 250 ms behind.
        now = if n % 7 == 6 { now - 250 } else { now + 83 };
        let hits = 1 + n as u64 % 3;
        let tentative = n % 5 == 4;
        let mixed = if n % 2 == 0 {
            Version::Previous
        } else {
            Version::Current
        };
        let answers: Vec<Vec<i64>> = [Version::Current, Version::Previous, mixed]
            .into_iter()
            .zip(logs)
            .map(|(version, log)| decide(version, log, now, hits, tentative, n))
            .collect();
        assert_eq!(
            answers[0], answers[1],
            "request {n}: one version or the other"
        );
        assert_eq!(answers[0], answers[2], "request {n}: the two in turn");
        let members = node_cli(redis.port, &["ZRANGE", logs[2], "0", "-1"]);
        let timed = |m: &&String| {
            m.split(':')
                .nth(2)
                .is_some_and(|t| t.parse::<u64>().is_ok())
        };
        if members.iter().any(|m| timed(&m)) && members.iter().any(|m| !timed(&m)) {
            side_by_side += 1;
        }
        if answers[0][0] & 1 == 1 {
            admitted += 1;
        } else {
            rejected += 1;
        }
    }
    assert!(
        admitted > 10 && rejected > 10,
        "{admitted} admitted, {rejected} rejected"
    );
    // The entries: total, weight and time, whoever wrote them.
    let entries = |log: &str| -> Vec<(String, String, String)> {
        let all = node_cli(redis.port, &["ZRANGE", log, "0", "-1", "WITHSCORES"]);
        all.chunks(2)
            .map(|pair| {
                let mut fields = pair[0].split(':');
                let cum = fields.next().unwrap_or_default().to_string();
                let weight = fields.next().unwrap_or_default().to_string();
                (cum, weight, pair[1].clone())
            })
            .collect()
    };
    let written = entries(logs[0]);
    assert!(!written.is_empty());
    assert_eq!(entries(logs[1]), written);
    assert_eq!(entries(logs[2]), written);
    // The mixed log really held both layouts side by side: this version's `<cum>:<weight>:<time>`
    // and the previous one's `<cum>:<weight>:<prefix>:<i>`.
    assert!(
        side_by_side > 10,
        "both layouts in the mixed log after {side_by_side} requests"
    );
}

/// Memory per call, not per hit: 10,000 debits of 5,000 tokens are 10,000 log entries (the
/// previous format would have held 50,000,000 members).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_log_memory_is_per_call() {
    let redis = shared_standalone();
    let store = connect(redis.url(), TEST_TIMEOUT).await;
    let key = slidegate::store::StoreKey::new(&unique_domain("tokens"), "");
    for n in 0..10_000u64 {
        let outcome = store
            .check(&[budget_item(&key, 5_000, u32::MAX)], T0 + n)
            .await
            .expect("debit");
        assert!(outcome.items[0].recorded);
    }
    let log = key.log();
    let entries: u64 = redis
        .cmd(&format!("ZCARD {log}"))
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("ZCARD");
    assert_eq!(entries, 10_000);
    let bytes: u64 = redis
        .cmd(&format!("MEMORY USAGE {log}"))
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("MEMORY USAGE");
    eprintln!(
        "10,000 weighted entries: {bytes} bytes, {} bytes per entry",
        bytes / 10_000
    );
    // About 160 bytes an entry (a sorted-set member of ~50 characters and its score); the
    // previous format took about 145 bytes per hit, 50,000,000 of them here.
    assert!(
        bytes < 10_000 * 200,
        "{bytes} bytes for 10,000 entries: more than 200 bytes each"
    );
    let last = store
        .check(&[budget_item(&key, 0, u32::MAX)], T0 + 10_000)
        .await
        .expect("check");
    assert_eq!(last.items[0].windows[0].count, 50_000_000);
}

/// Requests past a bound are refused before the store: many descriptors, huge values, and
/// hits that only add up past the bound over several descriptors leave Redis untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_a_bound_never_reach_redis() {
    let redis = RedisProcess::start(&[]);
    let server = TestServer::start(
        "domain: DOMAIN\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
        connect(redis.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    let big = "v".repeat(2 * 1024 * 1024);
    let cases = [
        (
            request(
                "DOMAIN",
                (0..100).map(|_| descriptor(&[("k", "v")])).collect(),
            ),
            "--max-descriptors",
        ),
        (
            request("DOMAIN", vec![descriptor(&[("k", &big)])]),
            "--max-value-bytes",
        ),
        (
            request(
                "DOMAIN",
                (0..10)
                    .map(|_| with_hits(descriptor(&[("k", "v")]), 500_000_000))
                    .collect(),
            ),
            "--max-hits",
        ),
    ];
    for (call, bound) in cases {
        let status = server.call_err(call).await;
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains(bound), "{}", status.message());
    }
    assert_eq!(redis.cmd("DBSIZE").trim(), ":0", "nothing reached Redis");
    // Within the bounds, the same shapes are decided and recorded.
    let decided = server
        .call(request("DOMAIN", vec![descriptor(&[("k", "v")])]))
        .await;
    assert_eq!(decided.overall_code, ok());
    assert_eq!(redis.cmd("DBSIZE").trim(), ":1");
    server.stop().await;
}

/// A Redis at its `maxmemory` (with `noeviction`) refuses the script before it runs (the script
/// declares itself a writer), so nothing is written past the limit and the answer follows the
/// store-failure policy: UNAVAILABLE by default, OVER_LIMIT with `deny`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_the_script_and_the_policy_answers() {
    let redis = RedisProcess::start(&["--maxmemory-policy", "noeviction"]);
    let config = "domain: DOMAIN\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n";
    let errors = TestServer::start(
        config,
        connect(redis.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    let denies = TestServer::start(
        config,
        connect(redis.url(), TEST_TIMEOUT).await,
        LimiterOptions {
            failure_policy: FailurePolicy::Deny,
            ..LimiterOptions::default()
        },
    )
    .await;
    let call = |n: u32| request("DOMAIN", vec![descriptor(&[("k", &n.to_string())])]);
    assert_eq!(
        errors.call(call(0)).await.overall_code,
        ok(),
        "room at first"
    );
    // Fill it: a 3 MB value, then a 2 MB limit.
    let filler = "x".repeat(3 * 1024 * 1024);
    let mut set = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "-x", "SET", "filler"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-cli");
    std::io::Write::write_all(&mut set.stdin.take().expect("stdin"), filler.as_bytes())
        .expect("value");
    assert!(set.wait().expect("redis-cli").success());
    assert!(redis.cmd("CONFIG SET maxmemory 2mb").starts_with("+OK"));
    let keys_before = redis.cmd("DBSIZE");
    for n in 1..=20 {
        let status = errors.call_err(call(n)).await;
        assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "{}",
            status.message()
        );
        assert!(status.message().contains("OOM"), "{}", status.message());
        let denied = denies.call(call(n)).await;
        assert_eq!(
            denied.overall_code,
            over(),
            "--store-failure deny answers OVER_LIMIT"
        );
    }
    assert_eq!(redis.cmd("DBSIZE"), keys_before, "no new log was written");
    errors.stop().await;
    denies.stop().await;
}

/// The values of the script's packed reply (a bulk string), as fred values.
fn unpacked(reply: &fred::types::Value) -> Vec<fred::types::Value> {
    use slidegate::store::redis::packed::{self, Item};
    let Some(bytes) = reply.as_bytes() else {
        panic!("not a packed reply: {reply:?}");
    };
    let items = packed::read_all(bytes).unwrap_or_else(|e| panic!("{e}: {reply:?}"));
    items
        .into_iter()
        .map(|item| match item {
            Item::Int(n) => fred::types::Value::Integer(n),
            Item::Text(text) => {
                fred::types::Value::from(String::from_utf8_lossy(text).into_owned())
            }
        })
        .collect()
}

/// A standalone Redis of the test's own with the script's library loaded.
fn redis_with_library() -> (RedisProcess, slidegate::store::redis::Library) {
    let redis = RedisProcess::start(&[]);
    let library = slidegate::store::redis::Library::new();
    assert_eq!(
        node_cli(redis.port, &["FUNCTION", "LOAD", &library.code]),
        [library.function.to_string()]
    );
    (redis, library)
}

/// `redis-cli` against one node, whole reply lines; a script call's packed reply one value a
/// line, as `redis-cli` printed the script's RESP array ([`fcall_lines`]).
fn node_cli(port: u16, args: &[&str]) -> Vec<String> {
    if args
        .first()
        .is_some_and(|a| a.eq_ignore_ascii_case("FCALL"))
    {
        return fcall_lines(port, args);
    }
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// A cluster of the test's own and a server on it with `config` (see [`server_on`]).
async fn on_own_cluster(config: &str, timeout: Duration) -> (RedisCluster, TestServer) {
    let cluster = RedisCluster::start();
    let server = server_on(cluster.url(), config, timeout).await;
    (cluster, server)
}

/// A server on the Redis at `url` with `config`, one pool connection (the store's calls share
/// it) and `timeout` per call.
async fn server_on(url: String, config: &str, timeout: Duration) -> TestServer {
    let mut opts = options(url, timeout);
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    TestServer::start(config, store, LimiterOptions::default()).await
}

/// Sends `requests` all at once, each on its own task: their overall codes, in order. Every one
/// must be answered (an error fails the test).
fn all_at_once(
    server: &TestServer,
    requests: Vec<slidegate::proto::RateLimitRequest>,
) -> impl std::future::Future<Output = Vec<i32>> + use<> {
    let calls: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let mut client = server.client.clone();
            tokio::spawn(async move { client.should_rate_limit(request).await })
        })
        .collect();
    async move {
        let mut codes = Vec::new();
        for call in calls {
            let answer = call.await.expect("task").expect("an answer, not an error");
            codes.push(answer.get_ref().overall_code);
        }
        codes
    }
}

/// The log key of descriptor `key=value` under a configured rule of `domain`, untagged.
fn log_of(domain: &str, key: &str, value: &str) -> String {
    key::build(
        domain,
        &[Segment::Value { key, value }],
        Variant::Configured,
        None,
    )
    .log()
}

/// `ERR` error replies a node has counted. A key a script reaches for on a master that does not
/// serve its slot counts as one, even when the script catches the error.
fn err_replies(port: u16) -> u64 {
    node_cli(port, &["INFO", "errorstats"])
        .iter()
        .find_map(|l| l.strip_prefix("errorstat_ERR:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Which master (its port) serves each slot, as the cluster's first node sees it now.
fn owners(cluster: &RedisCluster) -> impl Fn(u16) -> u16 {
    // "<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <state> <ranges...>"
    let ranges: Vec<(u16, u16, u16)> = node_cli(cluster.nodes[0].port, &["CLUSTER", "NODES"])
        .iter()
        .flat_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("a port");
            fields[8..]
                .iter()
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    Some((a.parse().ok()?, b.parse().ok()?, port))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    move |slot| {
        ranges
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|r| r.2)
            .expect("an owner")
    }
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
    assert_eq!((zcard(&cluster, &a), zcard(&cluster, &log("b", w))), (2, 2));

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
    assert_eq!((zcard(&cluster, &a), zcard(&cluster, &log("b", y))), (4, 2));
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
        (zcard(&cluster, &a), zcard(&cluster, &log("b", &w))),
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

/// The port of the master that serves `slot`, as it says itself.
fn owner_of(cluster: &RedisCluster, slot: u16) -> u16 {
    cluster
        .nodes
        .iter()
        .map(|n| n.port)
        .find(|p| {
            node_cli(*p, &["CLUSTER", "NODES"]).iter().any(|line| {
                line.contains("myself")
                    && line.split_whitespace().skip(8).any(|range| {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        match (a.parse::<u16>(), b.parse::<u16>()) {
                            (Ok(a), Ok(b)) => (a..=b).contains(&slot),
                            _ => false,
                        }
                    })
            })
        })
        .expect("an owner")
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
    assert_eq!(zcard(cluster, &keys[0]), 1);
    assert_eq!(zcard(cluster, &keys[1]), 1);
    assert_eq!(
        zcard(cluster, &keys[2]),
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
    let (status, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    let resent: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("slidegate_redis_cluster_resent_total "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the resent counter");
    assert!(resent > 0, "{resent} requests sent again");
    let third = wave(&server).await;
    assert!(third.iter().all(|&c| c == over()), "{third:?}");
    assert_eq!(zcard(&cluster, &team_key.log()), 2, "u0's log moved whole");
    server.stop().await;
}

/// Moves `slot` from the master that holds it to another, the way `redis-cli --cluster
/// reshard` does: IMPORTING, MIGRATING, MIGRATE of its keys in batches, then SETSLOT NODE on
/// every master. Returns the ports (from, to).
fn migrate_slot(cluster: &RedisCluster, slot: u16) -> (u16, u16) {
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let id = |port: u16| node_cli(port, &["CLUSTER", "MYID"])[0].clone();
    let owner = owner_of(cluster, slot);
    let target = *ports.iter().find(|p| **p != owner).expect("another master");
    let (owner_id, target_id) = (id(owner), id(target));
    let s = slot.to_string();
    node_cli(target, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &owner_id]);
    node_cli(owner, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &target_id]);
    loop {
        let keys = node_cli(owner, &["CLUSTER", "GETKEYSINSLOT", &s, "10"]);
        let keys: Vec<&str> = keys
            .iter()
            .map(String::as_str)
            .filter(|k| !k.is_empty())
            .collect();
        if keys.is_empty() {
            break;
        }
        let mut args = vec!["MIGRATE", "127.0.0.1"];
        let target_port = target.to_string();
        args.push(&target_port);
        args.extend_from_slice(&["", "0", "5000", "KEYS"]);
        args.extend_from_slice(&keys);
        node_cli(owner, &args);
    }
    for port in &ports {
        node_cli(*port, &["CLUSTER", "SETSLOT", &s, "NODE", &target_id]);
    }
    (owner, target)
}

/// A hot slot (one user's 200 logs, kept together by `tag_by`) moved to another master while
/// 48 callers keep asking for it and 16 for a key in another slot: errors only while it moves
/// (none 2 s after, on either slot), and never more admitted than the limits. With a pool of
/// one connection, the hardest case: a client that cannot route after the move is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_a_hot_slot_under_load() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    let domain = unique_domain("reshard");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: item\n        tag_by: user\n        rate_limit: {{unit: hour, requests_per_unit: 5}}\n  - key: other\n    rate_limit: {{unit: hour, requests_per_unit: 1000000}}\n"
    );
    let (cluster, server) = on_own_cluster(&config, Duration::from_millis(500)).await;
    let hot = key::build(
        &domain,
        &[
            Segment::Value {
                key: "user",
                value: "u",
            },
            Segment::Value {
                key: "item",
                value: "0",
            },
        ],
        Variant::Configured,
        Some("user"),
    );
    let other = key::build(
        &domain,
        &[Segment::Value {
            key: "other",
            value: "o",
        }],
        Variant::Configured,
        None,
    );
    let slot = slot(&hot.log());
    assert_ne!(
        slot,
        self::slot(&other.log()),
        "the other key must sit elsewhere"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let moved_at: Arc<std::sync::Mutex<Option<Instant>>> = Arc::new(std::sync::Mutex::new(None));
    // admitted, errors while moving, errors 2 s after, other slot: errors while moving, after
    let counts: Arc<[AtomicU64; 5]> = Arc::new(Default::default());
    // The latest error after the move finished, in ms since then.
    let last_error = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for n in 0..64u64 {
        let client = common::connect(server.grpc_addr).await;
        let (d, stop, counts, moved_at, last_error) = (
            domain.clone(),
            stop.clone(),
            counts.clone(),
            moved_at.clone(),
            last_error.clone(),
        );
        callers.push(tokio::spawn(async move {
            let mut i = n;
            while !stop.load(SeqCst) {
                i += 64;
                let hot = n < 48;
                let item = (i % 200).to_string();
                let descriptor = if hot {
                    descriptor(&[("user", "u"), ("item", &item)])
                } else {
                    descriptor(&[("other", "o")])
                };
                match client
                    .clone()
                    .should_rate_limit(request(&d, vec![descriptor]))
                    .await
                {
                    Ok(r) if hot && r.get_ref().overall_code == ok() => {
                        counts[0].fetch_add(1, SeqCst);
                    }
                    Ok(_) => {}
                    Err(_) => {
                        let since_move = moved_at.lock().expect("lock").map(|at| at.elapsed());
                        if let Some(since) = since_move {
                            last_error.fetch_max(
                                u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
                                SeqCst,
                            );
                        }
                        let settled = since_move.is_some_and(|s| s > Duration::from_secs(2));
                        let slot = match (hot, settled) {
                            (true, false) => 1,
                            (true, true) => 2,
                            (false, false) => 3,
                            (false, true) => 4,
                        };
                        counts[slot].fetch_add(1, SeqCst);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cluster_ref = &cluster;
    let (from, to) = tokio::task::block_in_place(|| migrate_slot(cluster_ref, slot));
    *moved_at.lock().expect("lock") = Some(Instant::now());
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, SeqCst);
    for c in callers {
        c.await.expect("caller");
    }
    let [admitted, during, after, elsewhere, elsewhere_after] =
        [0, 1, 2, 3, 4].map(|i| counts[i].load(SeqCst));
    eprintln!(
        "slot {slot} moved {from} -> {to}: {admitted} admitted; errors while moving {during} (other slot {elsewhere}), 2 s after {after} (other slot {elsewhere_after}); last error {} ms after the move",
        last_error.load(SeqCst)
    );
    assert!(admitted <= 200 * 5, "over-admitted: {admitted}");
    assert_eq!(
        (after, elsewhere_after),
        (0, 0),
        "errors 2 s after the move"
    );
    // And the moved logs are where the cluster says: a new call finds them full.
    let r = server
        .call(request(
            &domain,
            vec![descriptor(&[("user", "u"), ("item", "7")])],
        ))
        .await;
    assert_eq!(r.overall_code, over(), "the moved log kept its entries");
    server.stop().await;
}

/// Calls every 50 ms until `done` holds or `deadline` passes; whether it held.
async fn call_until(
    server: &TestServer,
    domain: &str,
    deadline: Duration,
    mut done: impl FnMut() -> bool,
) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if done() {
            return true;
        }
        let _ = server
            .client
            .clone()
            .should_rate_limit(request(domain, vec![descriptor(&[("k", "v")])]))
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done()
}

/// A Redis that answers but refuses every call (FCALL renamed away): fresh clients connect
/// and do not help, so after three of them and 5 s the store says it cannot recover and `/healthz`
/// answers 503, the signal for a liveness probe to restart it. Readiness (PING) still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_fresh_clients_do_not_help() {
    let redis = RedisProcess::start(&["--rename-command", "FCALL", ""]);
    let domain = unique_domain("hopeless");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 5}}\n"
    );
    let store = connect(redis.url(), Duration::from_millis(200)).await;
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    assert_eq!(http(server.http_addr, "GET", "/healthz", "").await.0, 200);
    let limiter = server.limiter.clone();
    let started = Instant::now();
    let gave_up = call_until(&server, &domain, Duration::from_secs(20), || {
        !limiter.store_alive()
    })
    .await;
    assert!(gave_up, "the store never reported that it cannot recover");
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "gave up after {:?}, before five seconds of failing calls",
        started.elapsed()
    );
    let (code, body) = http(server.http_addr, "GET", "/healthz", "").await;
    assert_eq!(
        (code, body.as_str()),
        (503, "the store cannot recover by itself\n")
    );
    assert_eq!(http(server.http_addr, "GET", "/readyz", "").await.0, 200);
    server.stop().await;
}

/// A Redis that is down is waited for, not a reason to restart: `/healthz` stays 200 through
/// seconds of failing calls, since fresh clients cannot connect either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_holds_while_redis_is_down() {
    let mut redis = RedisProcess::start(&[]);
    let domain = unique_domain("down");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 5}}\n"
    );
    let store = connect(redis.url(), Duration::from_millis(200)).await;
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    redis.stop();
    let limiter = server.limiter.clone();
    let gave_up = call_until(&server, &domain, Duration::from_secs(5), || {
        !limiter.store_alive()
    })
    .await;
    assert!(!gave_up, "a Redis that is down made the store give up");
    assert_eq!(http(server.http_addr, "GET", "/healthz", "").await.0, 200);
    redis.restart();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = server
            .client
            .clone()
            .should_rate_limit(request(&domain, vec![descriptor(&[("k", "v")])]))
            .await
            .map(tonic::Response::into_inner);
        if reply.as_ref().is_ok_and(|r| r.overall_code == ok()) {
            break;
        }
        assert!(
            Instant::now() < end,
            "calls never resumed after Redis returned; the last answer: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http(server.http_addr, "GET", "/healthz", "").await.0, 200);
    server.stop().await;
}

/// Calls of a command Redis has run (`fcall`, `evalsha`), from `INFO commandstats`.
fn calls_of(redis: &RedisProcess, command: &str) -> u64 {
    let stats = redis.cmd("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn fcall_calls(redis: &RedisProcess) -> u64 {
    calls_of(redis, "fcall")
}

/// Where `FUNCTION LOAD` is refused (the command renamed away, or an ACL user without it), the
/// same code goes by `SCRIPT LOAD` and `EVALSHA`, and decides the same: 2 an hour admits two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_function_load_the_script_goes_by_evalsha() {
    let renamed = RedisProcess::start(&["--rename-command", "FUNCTION", ""]);
    let limited = RedisProcess::start(&[]);
    assert!(
        limited
            .cmd("ACL SETUSER limited on >secret ~* +@all -function")
            .starts_with("+OK")
    );
    let limited_url = format!("redis://limited:secret@127.0.0.1:{}", limited.port);
    for (redis, url) in [(&renamed, renamed.url()), (&limited, limited_url)] {
        let store = connect(url.clone(), TEST_TIMEOUT).await;
        let domain = unique_domain("evalsha");
        let config = format!(
            "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 2}}\n"
        );
        let server = TestServer::start(&config, store, LimiterOptions::default()).await;
        let codes: Vec<_> = futures_util::future::join_all(
            (0..3).map(|_| server.call(request(&domain, vec![descriptor(&[("k", "v")])]))),
        )
        .await
        .into_iter()
        .map(|r| r.overall_code)
        .collect();
        assert_eq!(
            codes.iter().filter(|&&c| c == ok()).count(),
            2,
            "{url}: {codes:?}"
        );
        assert!(calls_of(redis, "evalsha") >= 3, "{url}: decided by EVALSHA");
        assert_eq!(calls_of(redis, "fcall"), 0, "{url}");
        server.stop().await;
    }
}

/// A Redis of the test's own and a server on it with one pool connection (the store's calls
/// share it), with `descriptors` (YAML list items) in a fresh domain.
async fn on_one_connection(name: &str, descriptors: &str) -> (RedisProcess, TestServer, String) {
    let redis = RedisProcess::start(&[]);
    let mut opts = options(redis.url(), TEST_TIMEOUT);
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    let domain = unique_domain(name);
    let config = format!("domain: {domain}\ndescriptors:\n{descriptors}");
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    (redis, server, domain)
}

/// On standalone Redis, decisions that arrive together are decided in shared script calls, and
/// still exactly: 400 concurrent requests on one limit of 150 (two calls out at a time, on
/// one connection) admit exactly 150 in far fewer calls than requests; each user of a spread of 250
/// is admitted once and refused the second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_script_calls_and_stay_exact() {
    let (redis, server, domain) = on_one_connection(
        "batch",
        "  - key: hot\n    rate_limit: {unit: minute, requests_per_unit: 150}\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    .await;
    let before = fcall_calls(&redis);
    let calls: Vec<_> = (0..400)
        .map(|_| {
            let mut client = server.client.clone();
            let request = request(&domain, vec![descriptor(&[("hot", "x")])]);
            tokio::spawn(async move { client.should_rate_limit(request).await })
        })
        .collect();
    let mut admitted = 0;
    for call in calls {
        let response = call.await.expect("task").expect("answer");
        admitted += u32::from(response.get_ref().overall_code == ok());
    }
    let used = fcall_calls(&redis) - before;
    assert_eq!(admitted, 150, "exactly the limit");
    assert!(used < 400, "{used} script calls for 400 decisions");
    // Per user: the first of two concurrent requests is admitted, the second refused, whichever
    // call carried each.
    let users: Vec<_> = (0..500)
        .map(|n| {
            let mut client = server.client.clone();
            let user = format!("u{}", n % 250);
            let request = request(&domain, vec![descriptor(&[("user", &user)])]);
            tokio::spawn(async move { (n % 250, client.should_rate_limit(request).await) })
        })
        .collect();
    let mut per_user = [0u32; 250];
    for call in users {
        let (user, response) = call.await.expect("task");
        per_user[user] += u32::from(response.expect("answer").get_ref().overall_code == ok());
    }
    assert!(per_user.iter().all(|&n| n == 1), "{per_user:?}");
    server.stop().await;
}

/// A caller that gives up while its call is out (Envoy's timeout) hands the call's place on:
/// requests waiting behind it are still sent, and the store keeps answering afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_do_not_stall_the_queue() {
    let (redis, server, domain) = on_one_connection(
        "giveup",
        "  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n",
    )
    .await;
    // Redis holds every client's commands for a moment (CLIENT PAUSE answers at once and then
    // holds the rest), so every call is out or waiting when the callers give up.
    assert_eq!(redis.cmd("CLIENT PAUSE 500 ALL").trim(), "+OK");
    let quitters: Vec<_> = (0..50)
        .map(|n| {
            let mut client = server.client.clone();
            let request = request(&domain, vec![descriptor(&[("user", &format!("q{n}"))])]);
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_millis(50), client.should_rate_limit(request))
                    .await
            })
        })
        .collect();
    for quitter in quitters {
        assert!(
            quitter.await.expect("task").is_err(),
            "gave up while Redis slept"
        );
    }
    let mut answered = 0;
    for n in 0..20 {
        let mut client = server.client.clone();
        let request = request(&domain, vec![descriptor(&[("user", &format!("a{n}"))])]);
        let response =
            tokio::time::timeout(Duration::from_secs(10), client.should_rate_limit(request))
                .await
                .expect("an answer, not a stalled queue")
                .expect("answer");
        answered += u32::from(response.get_ref().overall_code == ok());
    }
    assert_eq!(answered, 20, "the store answers after callers gave up");
    server.stop().await;
}

/// A key of another type in Redis (written there by something else) fails the one decision
/// that touches it, with `UNAVAILABLE`, while the decisions that shared its script call are
/// answered as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_fails_only_its_own_decision_in_a_shared_call() {
    let (redis, server, domain) = on_one_connection(
        "foreign",
        "  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .await;
    let log = key::build(
        &domain,
        &[Segment::Value {
            key: "user",
            value: "bad",
        }],
        Variant::Configured,
        None,
    )
    .log();
    assert_eq!(redis.cmd(&format!("SET {log} not-a-log")).trim(), "+OK");
    let before = fcall_calls(&redis);
    let calls: Vec<_> = (0..120)
        .map(|n| {
            let mut client = server.client.clone();
            let user = if n == 60 {
                "bad".to_string()
            } else {
                format!("u{n}")
            };
            let request = request(&domain, vec![descriptor(&[("user", &user)])]);
            tokio::spawn(async move { (n, client.should_rate_limit(request).await) })
        })
        .collect();
    for call in calls {
        let (n, answer) = call.await.expect("task");
        if n == 60 {
            let status = answer.expect_err("the foreign key fails its decision");
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(status.message().contains("WRONGTYPE"), "{status:?}");
        } else {
            assert_eq!(
                answer.expect("answered").get_ref().overall_code,
                ok(),
                "{n}"
            );
        }
    }
    assert!(
        fcall_calls(&redis) - before < 120,
        "the decisions shared calls"
    );
    server.stop().await;
}
