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
/// (re-subscription with the version applied), readiness before the first config, and mutual
/// TLS on both ports.
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

    let channel = tls_channel(grpc_addr, dir, Some("envoy"))
        .await
        .expect("mTLS channel");
    let mut client = RateLimitServiceClient::new(channel);
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
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let nonce = loop {
        if let Some(n) = xds.nonce_of("3") {
            break n;
        }
        assert!(std::time::Instant::now() < end, "version 3 was never sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
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
