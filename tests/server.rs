//! The server as a user meets it: reflection (what `grpcurl list` uses), gRPC health, the HTTP
//! port, and the binary's CLI.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::sync::Arc;

use common::*;
use slidegate::limiter::LimiterOptions;
use slidegate::store::MemoryStore;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const CONFIG: &str = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

async fn start() -> TestServer {
    TestServer::start(
        CONFIG,
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await
}

#[tokio::test]
async fn reflection_lists_the_service() {
    let s = start().await;
    let channel = channel(s.grpc_addr).await;
    let mut client = ServerReflectionClient::new(channel);
    let ask = |message: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    };
    // What `grpcurl list` and `grpcurl describe` ask: the services, the file that defines one,
    // and the files it imports.
    let requests = vec![
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "envoy.service.ratelimit.v3.RateLimitService".into(),
        )),
        ask(MessageRequest::FileByFilename(
            "google/protobuf/duration.proto".into(),
        )),
        ask(MessageRequest::FileByFilename(
            "envoy/extensions/common/ratelimit/v3/ratelimit.proto".into(),
        )),
    ];
    let mut replies = client
        .server_reflection_info(futures_util::stream::iter(requests))
        .await
        .expect("reflection")
        .into_inner();
    let reply = replies.message().await.expect("stream").expect("one reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reply {reply:?}");
    };
    for _ in 0..3 {
        let reply = replies.message().await.expect("stream").expect("a reply");
        let Some(MessageResponse::FileDescriptorResponse(files)) = reply.message_response else {
            panic!("expected file descriptors, got {reply:?}");
        };
        assert!(!files.file_descriptor_proto.is_empty());
    }
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    // Exactly what the README's `grpcurl list` shows.
    assert_eq!(names, README_SERVICES, "v1");
    // Older grpcurl asks v1alpha: the same list.
    let mut alpha =
        tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient::new(
            common::channel(s.grpc_addr).await,
        );
    let request = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut replies = alpha
        .server_reflection_info(futures_util::stream::iter(vec![request]))
        .await
        .expect("v1alpha reflection")
        .into_inner();
    let reply = replies.message().await.expect("stream").expect("one reply");
    let Some(
        tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list),
    ) = reply.message_response
    else {
        panic!("unexpected reply {reply:?}");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(names, README_SERVICES, "v1alpha");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README");
    let listed: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("grpcurl -plaintext localhost:8081 list"))
        .skip(1)
        .take_while(|l| l.starts_with("# "))
        .map(|l| l.trim_start_matches("# "))
        .collect();
    assert_eq!(listed, README_SERVICES, "the README's grpcurl list");
    s.stop().await;
}

const README_SERVICES: [&str; 4] = [
    "envoy.service.ratelimit.v3.RateLimitService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

#[tokio::test]
async fn health_reports_serving() {
    let s = start().await;
    let channel = channel(s.grpc_addr).await;
    let mut health = HealthClient::new(channel);
    for service in [
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
        "ratelimit",
    ] {
        let reply = health
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .expect("health")
            .into_inner();
        assert_eq!(
            reply.status,
            ServingStatus::Serving as i32,
            "service '{service}'"
        );
    }
    s.stop().await;
}

#[tokio::test]
async fn http_endpoints() {
    let s = start().await;
    assert_eq!(
        http(s.http_addr, "GET", "/healthz", "").await,
        (200, "OK\n".to_string())
    );
    assert_eq!(http(s.http_addr, "GET", "/readyz", "").await.0, 200);

    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"u1"}]}]}"#;
    let (code, first) = http(s.http_addr, "POST", "/json", body).await;
    assert_eq!(code, 200);
    let first: serde_json::Value = serde_json::from_str(&first).expect("JSON body");
    assert_eq!(
        first,
        serde_json::json!({"overallCode": "OK", "statuses": [{"code": "OK",
            "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE"}, "limitRemaining": 1, "durationUntilReset": "60s"}]})
    );
    assert_eq!(http(s.http_addr, "POST", "/json", body).await.0, 200);
    let (code, over) = http(s.http_addr, "POST", "/json", body).await;
    assert_eq!(code, 429);
    assert!(over.contains("\"overallCode\":\"OVER_LIMIT\""), "{over}");

    let (code, message) = http(
        s.http_addr,
        "POST",
        "/json",
        r#"{"domain":"","descriptors":[]}"#,
    )
    .await;
    assert_eq!(code, 400);
    assert!(message.contains("domain must not be empty"), "{message}");
    assert_eq!(http(s.http_addr, "POST", "/json", "{not json").await.0, 400);
    s.stop().await;
}

#[test]
fn check_command_validates_configs() {
    let bin = env!("CARGO_BIN_EXE_slidegate");
    let ok = std::process::Command::new(bin)
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.yaml"),
        ])
        .output()
        .expect("run check");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("OK"));

    let dir = std::env::temp_dir().join(unique_domain("check"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        dir.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight}\n",
    )
    .expect("write");
    std::fs::write(
        dir.join("b.yaml"),
        "domain: b\ndescriptors:\n  - value: x\n",
    )
    .expect("write");
    let bad = std::process::Command::new(bin)
        .args(["check", "--config"])
        .arg(&dir)
        .output()
        .expect("run check");
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains(
            "a.yaml:4: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("b.yaml:3: descriptors[0]: descriptor has empty key"),
        "{stderr}"
    );
    assert!(stderr.contains("2 error(s)"), "{stderr}");
    // The directory as a plain argument works the same.
    let positional = std::process::Command::new(bin)
        .arg("check")
        .arg(&dir)
        .output()
        .expect("run check DIR");
    assert!(!positional.status.success());
    assert_eq!(String::from_utf8_lossy(&positional.stderr), stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn binary_serves_the_example_config() {
    let grpc = common::redis::free_port();
    let http_port = common::redis::free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .args([
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.yaml"),
        ])
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--http-addr",
            &format!("127.0.0.1:{http_port}"),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start slidegate");
    let _child = KillOnDrop(child);
    let client = connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        let r = client
            .clone()
            .should_rate_limit(request(
                "example",
                vec![descriptor(&[("login_user", "alice")])],
            ))
            .await
            .expect("call")
            .into_inner();
        codes.push(r.overall_code);
    }
    assert_eq!(codes, vec![ok(), ok(), ok(), over()], "3 logins a minute");
}
