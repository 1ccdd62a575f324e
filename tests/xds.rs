//! The xDS config source and gRPC TLS, as Envoy Gateway uses them: the binary started with the
//! environment Envoy Gateway gives its rate-limit container (paths and ports pointing at this
//! test's certificates and servers), a management server written here pushing
//! `RateLimitConfig` over mutual TLS, and clients over mutual TLS.
// Tests may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::time::Duration;

use common::redis::{command, wait_until};
use common::xds::{
    Snapshot, XdsServer, gateway_certs as certs, gateway_config, mtls_files,
    start_as_gateway_ratelimit, tls_channel,
};
use common::{descriptor, ok, over, request, temp_dir};
use slidegate::proto::RateLimitRequest;
use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use slidegate::proto::ratelimit::config::ratelimit::v3::RateLimitUnit;

const DOMAIN: &str = "default/eg/http";
const ROUTE: &str = "httproute/default/backend/rule/0/match/0/www_example_com";

fn healthcheck(http: u16) -> u16 {
    let answer = command(http, "GET /healthcheck HTTP/1.0\r\n").unwrap_or_default();
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Envoy Gateway's request for the route: the route's generic key, then the header's value.
fn gateway_request(user: &str) -> RateLimitRequest {
    request(
        DOMAIN,
        vec![descriptor(&[(ROUTE, ROUTE), ("rule-0-match-0", user)])],
    )
}

/// The nonce of the response that carried `version`, once the server has sent it.
async fn sent_nonce(xds: &XdsServer, version: &str) -> String {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(n) = xds.nonce_of(version) {
            return n;
        }
        assert!(
            std::time::Instant::now() < end,
            "version {version} was never sent"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn admitted(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    r: RateLimitRequest,
    n: usize,
) -> Vec<i32> {
    let mut codes = Vec::new();
    for _ in 0..n {
        let answer = client
            .should_rate_limit(r.clone())
            .await
            .expect("call")
            .into_inner();
        codes.push(answer.overall_code);
    }
    codes
}

/// Push, update, a refused update (NACK, old rules kept), the server restarting
/// (re-subscription with the version applied), readiness and calls before the first config
/// (not ready, gRPC health NOT_SERVING, calls refused UNAVAILABLE), and mutual TLS on both
/// ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_over_xds_with_mutual_tls() {
    let scratch = temp_dir("xds");
    let dir = scratch.0.as_path();
    certs(dir);
    let xds = XdsServer::start("127.0.0.1:0".parse().unwrap(), Some(mtls_files(dir, "xds"))).await;
    let log = dir.join("slidegate.log");
    let (grpc, http, _child) =
        start_as_gateway_ratelimit(dir, &xds, "envoy-ratelimit", false, &log, &[]);
    let grpc_addr = format!("127.0.0.1:{grpc}").parse().unwrap();

    // Subscribed with the node id and the type, nothing applied yet: not ready.
    let subscription = xds
        .wait_for_request("subscription", |r| r.response_nonce.is_empty())
        .await;
    assert_eq!(subscription.type_url, common::xds::TYPE_URL);
    assert_eq!(
        subscription.node.as_ref().map(|n| n.id.as_str()),
        Some("envoy-ratelimit")
    );
    assert_eq!(subscription.version_info, "");
    assert_eq!(healthcheck(http), 500, "not ready before the first config");
    let channel = tls_channel(grpc_addr, dir, Some("envoy"))
        .await
        .expect("mTLS channel");
    let mut client = RateLimitServiceClient::new(channel.clone());
    let health = || {
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        async move {
            let service = "envoy.service.ratelimit.v3.RateLimitService".to_string();
            let checked = health.check(tonic_health::pb::HealthCheckRequest { service });
            checked
                .await
                .expect("gRPC health answers")
                .into_inner()
                .status
        }
    };
    use tonic_health::pb::health_check_response::ServingStatus;
    assert_eq!(health().await, ServingStatus::NotServing as i32);
    // Nor answering: a call is refused UNAVAILABLE, so the caller's failure mode decides
    // (Envoy's failure_mode_deny), not a silent OK without limits; POST /json alike, 503.
    let refused = client
        .should_rate_limit(gateway_request("early"))
        .await
        .expect_err("a call before the first config is refused");
    let no_config = "no rate limit config has arrived from the xDS server yet";
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains(no_config), "{refused:?}");
    let json = format!(
        r#"{{"domain":"{DOMAIN}","descriptors":[{{"entries":[{{"key":"{ROUTE}","value":"{ROUTE}"}},{{"key":"rule-0-match-0","value":"early"}}]}}]}}"#
    );
    let http_addr = format!("127.0.0.1:{http}").parse().unwrap();
    let (status, body) = common::http(http_addr, "POST", "/json", &json).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(no_config), "{body}");

    xds.push(Snapshot {
        version: "1".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 3, RateLimitUnit::Hour)],
    });
    xds.wait_for_ack("1").await;
    wait_until(
        "ready after the first config",
        Duration::from_secs(10),
        || healthcheck(http) == 200,
    );
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while health().await != ServingStatus::Serving as i32 {
        assert!(
            std::time::Instant::now() < end,
            "gRPC health never turned SERVING"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        admitted(&mut client, gateway_request("alice"), 4).await,
        vec![ok(), ok(), ok(), over()],
        "3 per hour per user"
    );
    assert_eq!(
        admitted(&mut client, gateway_request("bob"), 1).await,
        vec![ok()]
    );

    // An update: another limit for the same route.
    xds.push(Snapshot {
        version: "2".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 1, RateLimitUnit::Minute)],
    });
    xds.wait_for_ack("2").await;
    assert_eq!(
        admitted(&mut client, gateway_request("carol"), 2).await,
        vec![ok(), over()],
        "1 per minute after the update"
    );

    // A config that does not compile (a limit without a unit): NACKed, version 2 still serves.
    xds.push(Snapshot {
        version: "3".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 100, RateLimitUnit::Unknown)],
    });
    let nonce = sent_nonce(&xds, "3").await;
    let nack = xds
        .wait_for_request("NACK of version 3", |r| r.response_nonce == nonce)
        .await;
    assert_eq!(
        nack.version_info, "2",
        "a NACK names the version still applied"
    );
    let detail = nack.error_detail.expect("a NACK carries error_detail");
    assert!(detail.message.contains("unit"), "{}", detail.message);
    assert_eq!(
        admitted(&mut client, gateway_request("dave"), 2).await,
        vec![ok(), over()],
        "the previous rules keep serving"
    );

    // Version 4, then the management server restarts: slidegate re-subscribes saying it has 4.
    xds.push(Snapshot {
        version: "4".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 2, RateLimitUnit::Minute)],
    });
    xds.wait_for_ack("4").await;
    let xds = xds.restart().await;
    let again = xds
        .wait_for_request("re-subscription", |r| r.response_nonce.is_empty())
        .await;
    assert_eq!(
        again.version_info, "4",
        "re-subscribes with the version it applied"
    );
    xds.wait_for_ack("4").await;
    assert_eq!(
        admitted(&mut client, gateway_request("erin"), 3).await,
        vec![ok(), ok(), over()],
    );

    // The established channel survived all of it; a client without a certificate does not get
    // through the handshake, and neither does a plaintext one.
    let refused = match tls_channel(grpc_addr, dir, None).await {
        Err(_) => true,
        Ok(channel) => RateLimitServiceClient::new(channel)
            .should_rate_limit(gateway_request("mallory"))
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    let plain_refused = match plain {
        Err(_) => true,
        Ok(channel) => RateLimitServiceClient::new(channel)
            .should_rate_limit(gateway_request("mallory"))
            .await
            .is_err(),
    };
    assert!(plain_refused, "a plaintext client was served");
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(log.contains("xDS config rejected"), "{log}");
}

/// With FORCE_START_WITHOUT_INITIAL_CONFIG=true (what Envoy Gateway sets) slidegate is ready
/// and answers OK without limits before the first config; the AI Gateway's quota service is the
/// same contract with its own node id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_start_serves_before_the_first_config() {
    let scratch = temp_dir("xds-force");
    let dir = scratch.0.as_path();
    certs(dir);
    let xds = XdsServer::start("127.0.0.1:0".parse().unwrap(), Some(mtls_files(dir, "xds"))).await;
    let log = dir.join("slidegate.log");
    let (grpc, http, _child) =
        start_as_gateway_ratelimit(dir, &xds, "envoy-ai-gateway-ratelimit", true, &log, &[]);
    let subscription = xds
        .wait_for_request("subscription", |r| r.response_nonce.is_empty())
        .await;
    assert_eq!(
        subscription.node.as_ref().map(|n| n.id.as_str()),
        Some("envoy-ai-gateway-ratelimit")
    );
    wait_until("ready without config", Duration::from_secs(10), || {
        healthcheck(http) == 200
    });
    let grpc_addr = format!("127.0.0.1:{grpc}").parse().unwrap();
    let mut client = RateLimitServiceClient::new(
        tls_channel(grpc_addr, dir, Some("envoy"))
            .await
            .expect("mTLS"),
    );
    assert_eq!(
        admitted(&mut client, gateway_request("a"), 5).await,
        vec![ok(); 5]
    );
    xds.push(Snapshot {
        version: "v1".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 1, RateLimitUnit::Second)],
    });
    xds.wait_for_ack("v1").await;
    assert_eq!(
        admitted(&mut client, gateway_request("a"), 2).await,
        vec![ok(), over()]
    );
}

/// Kubernetes rotates the mounted secret: new connections get the new certificate, a
/// connection made before keeps working, and a half-written rotation keeps the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_certificate_is_reloaded_when_its_files_change() {
    let scratch = temp_dir("xds-rotate");
    let dir = scratch.0.as_path();
    certs(dir);
    let xds = XdsServer::start("127.0.0.1:0".parse().unwrap(), Some(mtls_files(dir, "xds"))).await;
    xds.push(Snapshot {
        version: "1".into(),
        configs: vec![gateway_config(DOMAIN, ROUTE, 1000, RateLimitUnit::Second)],
    });
    let log = dir.join("slidegate.log");
    let (grpc, _http, _child) =
        start_as_gateway_ratelimit(dir, &xds, "envoy-ratelimit", false, &log, &[]);
    xds.wait_for_ack("1").await;
    let grpc_addr = format!("127.0.0.1:{grpc}").parse().unwrap();
    let before = common::xds::presented_certificate(grpc_addr, dir, "envoy").await;
    let mut established = RateLimitServiceClient::new(
        tls_channel(grpc_addr, dir, Some("envoy"))
            .await
            .expect("mTLS"),
    );
    assert_eq!(
        admitted(&mut established, gateway_request("a"), 1).await,
        vec![ok()]
    );

    // A certificate without its key first (a rotation caught half-way): the old one stays.
    let renewed = dir.join("renewed");
    std::fs::create_dir_all(&renewed).unwrap();
    for file in ["ca.crt", "ca.key"] {
        std::fs::copy(dir.join(file), renewed.join(file)).unwrap();
    }
    common::redis::sign_cert(&renewed, "new", "DNS:localhost,IP:127.0.0.1");
    std::fs::copy(renewed.join("new.crt"), dir.join("ratelimit.crt")).unwrap();
    let waited_from = std::time::Instant::now();
    loop {
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        if log_text.contains("do not load") {
            break;
        }
        assert!(
            waited_from.elapsed() < Duration::from_secs(10),
            "the mismatched pair was not noticed:\n{log_text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        common::xds::presented_certificate(grpc_addr, dir, "envoy").await,
        before,
        "a certificate without its key is not used"
    );
    // The key arrives: the new certificate is used for new connections.
    std::fs::copy(renewed.join("new.key"), dir.join("ratelimit.key")).unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if common::xds::presented_certificate(grpc_addr, dir, "envoy").await != before {
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "the renewed certificate was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        admitted(&mut established, gateway_request("a"), 1).await,
        vec![ok()],
        "a connection made before the rotation keeps working"
    );
}

/// `GRPC_CLIENT_TLS_SAN`: a client certificate from the right CA but for another name is
/// refused; the named one is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_client_san_is_checked() {
    let scratch = temp_dir("xds-san");
    let dir = scratch.0.as_path();
    certs(dir);
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
    let grpc_addr = common::xds::start_mtls_server(
        dir,
        yaml,
        std::sync::Arc::new(slidegate::store::MemoryStore::new()),
        slidegate::server::ServerOptions::default(),
    )
    .await;

    let named = tls_channel(grpc_addr, dir, Some("envoy"))
        .await
        .expect("the named client connects");
    let answer = RateLimitServiceClient::new(named)
        .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .expect("the named client is served");
    assert_eq!(answer.into_inner().overall_code, ok());
    // `ratelimit.crt` is signed by the same CA but names localhost, not envoy.
    assert!(
        common::xds::refused_as(grpc_addr, dir, "ratelimit").await,
        "a certificate for another name was served"
    );
}

/// The reference's current `RateLimitConfig` (its `rls_conf.proto`): units WEEK, MONTH and YEAR,
/// `detailed_metric`, `quota_mode` and `metadata` are ACKed and served, the metadata coming
/// back in the response's dynamic metadata (with `RESPONSE_DYNAMIC_METADATA=true`). A resource
/// with a unit slidegate cannot read is rejected alone: the others apply, and it keeps the
/// rules it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_current_resource_is_served_and_a_bad_one_fails_alone() {
    use slidegate::proto::ratelimit::config::ratelimit::v3::{
        RateLimitConfig, RateLimitDescriptor, RateLimitPolicy,
    };
    let scratch = temp_dir("xds-api");
    let dir = scratch.0.as_path();
    certs(dir);
    let xds = XdsServer::start("127.0.0.1:0".parse().unwrap(), Some(mtls_files(dir, "xds"))).await;
    let log = dir.join("slidegate.log");
    let env = [("RESPONSE_DYNAMIC_METADATA", "true".to_string())];
    let (grpc, _http, _child) =
        start_as_gateway_ratelimit(dir, &xds, "envoy-ratelimit", false, &log, &env);
    let grpc_addr = format!("127.0.0.1:{grpc}").parse().unwrap();
    let limit = |unit: RateLimitUnit, n: u32| {
        Some(RateLimitPolicy {
            unit: unit.into(),
            requests_per_unit: n,
            ..Default::default()
        })
    };
    let metadata = pbjson_types::Struct {
        fields: [(
            "team".to_string(),
            pbjson_types::Value {
                kind: Some(pbjson_types::value::Kind::StringValue("billing".into())),
            },
        )]
        .into(),
    };
    let api = RateLimitConfig {
        name: "api".into(),
        domain: "api".into(),
        descriptors: vec![
            RateLimitDescriptor {
                key: "week".into(),
                rate_limit: limit(RateLimitUnit::Week, 2),
                detailed_metric: true,
                metadata: Some(metadata),
                ..Default::default()
            },
            RateLimitDescriptor {
                key: "month".into(),
                rate_limit: limit(RateLimitUnit::Month, 1),
                quota_mode: true,
                ..Default::default()
            },
            RateLimitDescriptor {
                key: "year".into(),
                rate_limit: limit(RateLimitUnit::Year, 1),
                ..Default::default()
            },
        ],
    };
    let other = |n: u32, unit: i32| RateLimitConfig {
        name: "other".into(),
        domain: "other".into(),
        descriptors: vec![RateLimitDescriptor {
            key: "k".into(),
            rate_limit: Some(RateLimitPolicy {
                unit,
                requests_per_unit: n,
                ..Default::default()
            }),
            ..Default::default()
        }],
    };
    xds.push(Snapshot {
        version: "1".into(),
        configs: vec![api.clone(), other(1, RateLimitUnit::Minute.into())],
    });
    xds.wait_for_ack("1").await;
    let channel = tls_channel(grpc_addr, dir, Some("envoy"))
        .await
        .expect("mTLS channel");
    let mut client = RateLimitServiceClient::new(channel);
    let week = request("api", vec![descriptor(&[("week", "a")])]);
    let first = client
        .should_rate_limit(week.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.overall_code, ok());
    let status = &first.statuses[0];
    assert_eq!(
        status
            .current_limit
            .as_ref()
            .map(|l| (l.requests_per_unit, l.unit)),
        Some((2, 7)),
        "2 a WEEK (7)"
    );
    let meta = first.dynamic_metadata.expect("dynamic metadata");
    let team = meta.fields.get("metadata").and_then(|m| match &m.kind {
        Some(pbjson_types::value::Kind::StructValue(s)) => s.fields.get("team").cloned(),
        _ => None,
    });
    assert_eq!(
        team.and_then(|t| t.kind),
        Some(pbjson_types::value::Kind::StringValue("billing".into())),
        "the descriptor's metadata in the dynamic metadata"
    );
    // quota_mode: over its limit, the month descriptor alone does not reject.
    let month = request("api", vec![descriptor(&[("month", "a")])]);
    let codes = admitted(&mut client, month, 2).await;
    assert_eq!(
        codes,
        vec![ok(), over()],
        "quota mode alone: all quota descriptors over"
    );
    let year = request("api", vec![descriptor(&[("year", "a")])]);
    assert_eq!(admitted(&mut client, year, 2).await, vec![ok(), over()]);

    // Version 2 breaks `other` (a unit no proto defines) and changes `api`: `api` applies,
    // `other` keeps its version-1 rules, and the response is NACKed naming `other`.
    let mut api2 = api.clone();
    api2.descriptors[2].rate_limit = limit(RateLimitUnit::Year, 3);
    xds.push(Snapshot {
        version: "2".into(),
        configs: vec![api2, other(5, 42)],
    });
    let nonce = sent_nonce(&xds, "2").await;
    let nack = xds
        .wait_for_request("NACK of version 2", |r| r.response_nonce == nonce)
        .await;
    let detail = nack.error_detail.expect("a NACK carries error_detail");
    assert!(
        detail.message.contains("xds:other") && detail.message.contains("42"),
        "{}",
        detail.message
    );
    let year = request("api", vec![descriptor(&[("year", "b")])]);
    assert_eq!(
        admitted(&mut client, year, 4).await,
        vec![ok(), ok(), ok(), over()],
        "the good resource of version 2 applies"
    );
    let k = request("other", vec![descriptor(&[("k", "v")])]);
    assert_eq!(
        admitted(&mut client, k, 2).await,
        vec![ok(), over()],
        "the bad resource keeps its version-1 rules"
    );
}
