//! Faults: Redis down, slow, full, restarted or behind TLS; callers' deadlines; bounds; the
//! health endpoints while the client recovers.

use super::*;

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

/// The failure policy answers before the caller's deadline, not the caller's own timeout:
/// Redis holds every command (`CLIENT PAUSE ... ALL`) and the store would wait 10 s, but a call
/// sent with `grpc-timeout: 500m` is answered `UNAVAILABLE` (the policy) a tenth of it (50 ms)
/// before its deadline, not `CANCELLED` at it. (At Envoy's 20 ms the margin is 3 ms, which a
/// loaded two-core machine can lose to scheduling; `answer_by`'s own tests in src/store/mod.rs
/// check that moment.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_answers_just_before_the_callers_deadline() {
    let (redis, server, mut caller) = raw_caller_on_redis(Duration::from_secs(10)).await;

    assert_eq!(redis.cmd("CLIENT PAUSE 3000 ALL").trim(), "+OK");
    let (status, headers, waited) = caller.call(Some("500m")).await;
    assert_eq!(
        status.as_deref(),
        Some("14"),
        "UNAVAILABLE by the policy, not CANCELLED: {headers:?}"
    );
    assert!(
        waited >= Duration::from_millis(440) && waited < Duration::from_secs(2),
        "answered at {waited:?}"
    );
    // The pause ends by itself (Redis holds even `CLIENT UNPAUSE` from a client during it).
    drop(caller);
    server.stop().await;
}

/// `--redis-timeout` bounds a decision whatever its caller's deadline: with the shipped 15 ms,
/// a call sent with `grpc-timeout: 5S` while Redis holds every command for 3 s is answered by
/// the policy long before Redis resumes, as is one sent with no deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_answers_at_the_redis_timeout_whatever_the_callers_deadline() {
    let (redis, server, mut caller) = raw_caller_on_redis(Duration::from_millis(15)).await;

    // A long pause, so that failing at 15 ms and waiting for Redis stay far apart however
    // slowly the machine runs (the pause ends by itself; the test does not wait for it).
    assert_eq!(redis.cmd("CLIENT PAUSE 3000 ALL").trim(), "+OK");
    for timeout in [Some("5S"), None] {
        let (status, headers, waited) = caller.call(timeout).await;
        assert_eq!(
            status.as_deref(),
            Some("14"),
            "UNAVAILABLE at --redis-timeout ({timeout:?}): {headers:?}"
        );
        assert!(
            waited < Duration::from_millis(1_000),
            "failed at the store deadline ({timeout:?}), before Redis resumed: {waited:?}"
        );
    }
    drop(caller);
    server.stop().await;
}

/// Redis killed: each failure policy reaches a caller with a long deadline within 100 ms, and a
/// caller with Envoy's 20 ms deadline gets the policy's answer (OK, OVER_LIMIT or
/// UNAVAILABLE), never `CANCELLED` or `DEADLINE_EXCEEDED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_answered_by_the_policy_in_time() {
    for (policy, status, code) in [
        (FailurePolicy::Allow, "0", Some(ok())),
        (FailurePolicy::Deny, "0", Some(over())),
        (FailurePolicy::Error, "14", None),
    ] {
        let (mut redis, server, mut caller) =
            raw_caller_by_policy(Duration::from_millis(15), policy).await;
        redis.stop();
        for timeout in ["5S", "20m", "20m", "5S"] {
            let (got, decided, waited) = caller.decide(Some(timeout)).await;
            assert_eq!(
                (got.as_deref(), decided),
                (Some(status), code),
                "{policy:?} with grpc-timeout {timeout}"
            );
            assert!(
                waited < Duration::from_millis(100),
                "{policy:?} with grpc-timeout {timeout}: answered at {waited:?}"
            );
        }
        drop(caller);
        server.stop().await;
    }
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
    // (Only slidegate's marker, `slidegate:marker`, is there: no rate-limit key.)
    assert_eq!(redis.cmd("KEYS rl:*").trim(), "*0", "nothing reached Redis");
    // Within the bounds, the same shapes are decided and recorded.
    let decided = server
        .call(request("DOMAIN", vec![descriptor(&[("k", "v")])]))
        .await;
    assert_eq!(decided.overall_code, ok());
    assert!(redis.cmd("KEYS rl:*").starts_with("*1"));
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
    // A store refusing most writes is not ready, though Redis answers PING.
    assert!(
        !errors.limiter.store().ready().await,
        "ready while refusing writes"
    );

    // A slidegate started while Redis is full (the library already loaded, as after a pod
    // restart) starts, serves by the policy and is not ready, rather than exiting.
    let started = RedisStore::connect(options(redis.url(), TEST_TIMEOUT)).await;
    let late: Arc<dyn Store> = Arc::new(started.expect("starts against a full Redis"));
    let late = TestServer::start(
        config,
        late,
        LimiterOptions {
            failure_policy: FailurePolicy::Deny,
            ..LimiterOptions::default()
        },
    )
    .await;
    assert_eq!(
        late.call(call(99)).await.overall_code,
        over(),
        "by the policy"
    );
    assert!(!late.limiter.store().ready().await, "not ready while full");
    // Room again: decided, and ready.
    assert!(redis.cmd("CONFIG SET maxmemory 0").starts_with("+OK"));
    assert_eq!(late.call(call(100)).await.overall_code, ok());
    assert!(late.limiter.store().ready().await, "ready once writes pass");
    late.stop().await;
    errors.stop().await;
    denies.stop().await;
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
        !limiter.store().alive()
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
        !limiter.store().alive()
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
    assert_eq!(redis.cmd(&format!("HSET {log} not a-log")).trim(), ":1");
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

/// A Redis whose `maxmemory-policy` evicts keys would forget windows under memory pressure:
/// slidegate says so at connect, in `/readyz` (still ready) and in a metric; `noeviction` says
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_warned_about() {
    let redis = RedisProcess::start(&["--maxmemory-policy", "allkeys-lru"]);
    let store = RedisStore::connect(options(redis.url(), TEST_TIMEOUT))
        .await
        .expect("connect");
    assert_eq!(store.evicting().as_deref(), Some("allkeys-lru"));
    let config = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let server = TestServer::start(config, Arc::new(store), LimiterOptions::default()).await;
    let (code, body) = common::http(server.http_addr, "GET", "/readyz", "").await;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("warning: Redis evicts keys (maxmemory-policy allkeys-lru)"),
        "{body}"
    );
    let (_, metrics) = common::http(server.http_addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("slidegate_redis_evicting{policy=\"allkeys-lru\"} 1"),
        "{metrics}"
    );
    server.stop().await;
    let quiet = RedisProcess::start(&["--maxmemory-policy", "noeviction"]);
    let store = RedisStore::connect(options(quiet.url(), TEST_TIMEOUT))
        .await
        .expect("connect");
    assert_eq!(store.evicting(), None);
}

/// The failover probe: the replica cut off from its master (as by a network partition: it is
/// made a master of its own, so nothing more reaches it) while the master takes 30 more calls,
/// then the master killed and the replica serving. Returns the calls admitted over the limit
/// across both (the master's before, the promoted replica's after). (A replica frozen with
/// SIGSTOP loses nothing: the kernel buffers the replication stream for it.)
async fn failover_probe(wait_replicas: u32) -> u64 {
    let master = RedisProcess::start(&[]);
    let replica = RedisProcess::start(&["--replicaof", "127.0.0.1", &master.port.to_string()]);
    wait_until("the replica in sync", Duration::from_secs(20), || {
        replica
            .cmd("INFO replication")
            .contains("master_link_status:up")
    });
    let limit = 40;
    let domain = unique_domain("failover");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    );
    let deny = LimiterOptions {
        failure_policy: FailurePolicy::Deny,
        ..LimiterOptions::default()
    };
    let mut opts = options(master.url(), Duration::from_millis(100));
    opts.wait_replicas = wait_replicas;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    let server = TestServer::start(&config, store, deny.clone()).await;
    let call = || request(&domain, vec![descriptor(&[("k", "v")])]);
    let mut admitted = 0u64;
    for _ in 0..20 {
        assert_eq!(
            server.call(call()).await.overall_code,
            ok(),
            "room, replica up"
        );
        admitted += 1;
    }
    assert!(replica.cmd("REPLICAOF NO ONE").starts_with("+OK"));
    for _ in 0..30 {
        if server.call(call()).await.overall_code == ok() {
            admitted += 1;
        }
    }
    server.stop().await;
    // The master dies with what the replica never got; the replica takes over.
    let mut master = master;
    master.stop();
    let store: Arc<dyn Store> = Arc::new(
        RedisStore::connect(options(replica.url(), TEST_TIMEOUT))
            .await
            .expect("connect to the promoted replica"),
    );
    let server = TestServer::start(&config, store, deny).await;
    for _ in 0..60 {
        if server.call(call()).await.overall_code == ok() {
            admitted += 1;
        }
    }
    server.stop().await;
    admitted.saturating_sub(limit)
}

/// `--redis-wait-replicas 1`: a failover that loses the master's unreplicated writes admits
/// nothing over the limit, where answering at the master's word over-admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_replica_keeps_a_failover_exact() {
    let without = failover_probe(0).await;
    eprintln!(
        "failover probe: {without} admitted over a limit of 40 without --redis-wait-replicas"
    );
    assert!(
        without > 0,
        "the probe loses unreplicated hits without waiting"
    );
    assert_eq!(
        failover_probe(1).await,
        0,
        "over-admitted with --redis-wait-replicas 1"
    );
}

/// Redis restarted empty (no persistence): each replica finds its marker gone or written again,
/// and counts the loss; a domain with `store_reset: closed` answers by its failure policy for
/// one longest window of its rules (2 s here), on every replica, where an open domain admits the
/// forgotten requests again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_lost_its_data_is_found_and_closed_domains_wait_a_window() {
    let mut redis = RedisProcess::start(&[]);
    let domain = unique_domain("reset");
    let config = format!(
        "domain: {domain}\nstore_failure: deny\nstore_reset: closed\ndescriptors:\n  - key: k\n    rate_limit: {{requests_per_unit: 3, window: 2s}}\n"
    );
    let open = unique_domain("open");
    let open_config = format!(
        "domain: {open}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 3}}\n"
    );
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store = connect(redis.url(), TEST_TIMEOUT).await;
        let limits = slidegate::config::compile_sources(&[
            ("closed.yaml".into(), config.clone()),
            ("open.yaml".into(), open_config.clone()),
        ])
        .expect("config");
        let limiter = slidegate::limiter::Limiter::new(
            limits,
            store,
            Arc::new(slidegate::limiter::SystemClock),
            LimiterOptions::default(),
        );
        assert!(limiter.store().ready().await, "the marker written");
        replicas.push(limiter);
    }
    let call = |d: &str| slidegate::wire::from_proto(request(d, vec![descriptor(&[("k", "v")])]));
    let code =
        |decision: Result<slidegate::limiter::Decision, _>| decision.expect("decided").overall;
    use slidegate::limiter::Code::{Ok as Admitted, OverLimit};
    for d in [&domain, &open] {
        for _ in 0..3 {
            assert_eq!(
                code(replicas[0].should_rate_limit(&call(d)).await),
                Admitted
            );
        }
        assert_eq!(
            code(replicas[1].should_rate_limit(&call(d)).await),
            OverLimit
        );
    }
    redis.restart();
    // The loss is found after this, so its window ends no sooner than 2 s from now.
    let found = Instant::now();
    let end = Instant::now() + Duration::from_secs(20);
    for replica in &replicas {
        while !(replica.store().ready().await && replica.store().data_losses() == Some(1)) {
            assert!(Instant::now() < end, "the loss was not found");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Forgotten: the open domain admits again (on the replica that never refused it: the
    // other's over-limit cache still knows it was over); the closed one answers by its policy.
    assert_eq!(
        code(replicas[0].should_rate_limit(&call(&open)).await),
        Admitted
    );
    for replica in &replicas {
        assert_eq!(
            code(replica.should_rate_limit(&call(&domain)).await),
            OverLimit
        );
    }
    let mut reopened = None;
    while reopened.is_none() {
        assert!(found.elapsed() < Duration::from_secs(10), "never reopened");
        if code(replicas[0].should_rate_limit(&call(&domain)).await) == Admitted {
            reopened = Some(found.elapsed());
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let reopened = reopened.unwrap_or_default();
    assert!(
        reopened >= Duration::from_millis(1_900),
        "reopened {reopened:?} after the loss was found, before its 2 s window"
    );
}

/// Every replica knows Redis forgot, one started after the loss was found too: the marker says
/// when the loss was found. A replica started against the emptied Redis after another found the
/// loss answers the closed domain by its policy (on a Redis it took as fresh it would admit
/// every forgotten request again). One started before any replica checked the emptied Redis
/// takes it as fresh, and knows of the loss once the replica that knew the old marker has
/// checked and written it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_after_a_loss_was_found_keeps_closed_domains_closed() {
    use slidegate::limiter::Code::{Ok as Admitted, OverLimit};
    let mut redis = RedisProcess::start(&[]);
    let domain = unique_domain("late");
    let config = format!(
        "domain: {domain}\nstore_failure: deny\nstore_reset: closed\ndescriptors:\n  - key: k\n    rate_limit: {{requests_per_unit: 5, window: 1h}}\n"
    );
    let url = redis.url();
    let replica = || async {
        let limits = slidegate::config::compile_sources(&[("closed.yaml".into(), config.clone())])
            .expect("config");
        let limiter = slidegate::limiter::Limiter::new(
            limits,
            connect(url.clone(), TEST_TIMEOUT).await,
            Arc::new(slidegate::limiter::SystemClock),
            LimiterOptions::default(),
        );
        assert!(limiter.store().ready().await, "the marker checked");
        limiter
    };
    let call = || slidegate::wire::from_proto(request(&domain, vec![descriptor(&[("k", "v")])]));
    let code =
        |decision: Result<slidegate::limiter::Decision, _>| decision.expect("decided").overall;
    let first = replica().await;
    for _ in 0..5 {
        assert_eq!(code(first.should_rate_limit(&call()).await), Admitted);
    }
    assert_eq!(code(first.should_rate_limit(&call()).await), OverLimit);

    redis.restart();
    let end = Instant::now() + Duration::from_secs(20);
    while !(first.store().ready().await && first.store().data_losses() == Some(1)) {
        assert!(
            Instant::now() < end,
            "the first replica never found the loss"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = replica().await;
    for _ in 0..3 {
        assert_eq!(
            code(second.should_rate_limit(&call()).await),
            OverLimit,
            "started after the loss was found: the domain is closed for its window"
        );
    }

    redis.restart();
    let third = replica().await;
    assert_eq!(
        code(third.should_rate_limit(&call()).await),
        Admitted,
        "started before any replica checked the emptied Redis: taken as fresh"
    );
    assert!(first.store().ready().await);
    assert_eq!(first.store().data_losses(), Some(2));
    assert!(third.store().ready().await);
    assert_eq!(
        code(third.should_rate_limit(&call()).await),
        OverLimit,
        "told of the loss by the replica that knew the old marker"
    );
}
