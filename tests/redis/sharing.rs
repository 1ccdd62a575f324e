//! Many callers on one Redis: processes sharing exact limits, Redis's clock, batched calls and
//! callers that give up.

use super::*;

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

/// `--redis-key-prefix` (`CACHE_KEY_PREFIX`): two installations on one Redis, with the same
/// domain and rule, keep apart (each admits its own limit) and every key starts with its
/// prefix; on a cluster, a request over several slots is still decided (the prefix leaves the
/// hash tag, so the slot, as it was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_prefixes_keep_installations_on_one_redis_apart() {
    for url in [shared_standalone().url(), shared_cluster().url()] {
        let domain = unique_domain("prefix");
        let config = format!(
            "domain: {domain}\ndescriptors:\n  - key: a\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n  - key: b\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
        );
        let mut servers = Vec::new();
        for prefix in ["team-a:", "team-b:"] {
            let mut opts = options(url.clone(), TEST_TIMEOUT);
            opts.key_prefix = prefix.into();
            let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
            servers.push(TestServer::start(&config, store, LimiterOptions::default()).await);
        }
        // Two descriptors in slots of their own: a spread call on a cluster.
        let both = || {
            request(
                &domain,
                vec![descriptor(&[("a", "x")]), descriptor(&[("b", "y")])],
            )
        };
        for server in &servers {
            assert_eq!(server.call(both()).await.overall_code, ok(), "{url}");
            assert_eq!(server.call(both()).await.overall_code, over(), "{url}");
        }
        let store = RedisStore::connect(options(url.clone(), TEST_TIMEOUT))
            .await
            .expect("connect");
        let client = store.client();
        use fred::prelude::LuaInterface as _;
        for prefix in ["team-a:", "team-b:"] {
            let key = format!("{prefix}rl:{{{domain}:a=x}}:log");
            let held: Vec<u64> = client
                .eval(LOG_ENTRIES, &key, Vec::<String>::new())
                .await
                .expect("the log's entries");
            assert_eq!(held.len(), 2, "one entry (time, weight) in {key} on {url}");
        }
        for server in servers {
            server.stop().await;
        }
    }
}
