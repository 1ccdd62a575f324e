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

const README_SERVICES: [&str; 5] = [
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
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

/// `--version` names the commit the binary is built from.
#[test]
fn version_names_the_commit() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("--version")
        .output()
        .expect("run --version");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "slidegate {} (commit {})",
            env!("CARGO_PKG_VERSION"),
            slidegate::COMMIT
        )
    );
    assert!(
        slidegate::COMMIT.len() == 12 && slidegate::COMMIT.bytes().all(|b| b.is_ascii_hexdigit()),
        "a commit, not {:?}",
        slidegate::COMMIT
    );
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

/// A raw HTTP/2 connection to the gRPC port, as Envoy holds one: hyper's client, requests
/// written by hand, so a test can break a call the way a peer can.
#[derive(Clone)]
struct Connection {
    send: hyper::client::conn::http2::SendRequest<RawBody>,
    addr: std::net::SocketAddr,
}

type RawBody = http_body_util::StreamBody<
    futures_util::stream::Iter<
        std::vec::IntoIter<Result<http_body::Frame<prost::bytes::Bytes>, std::io::Error>>,
    >,
>;

/// What a call came back with: its `grpc-status`, `grpc-message`, and the decoded answer's
/// overall code where there is one.
#[derive(Debug, PartialEq)]
struct Answer {
    status: String,
    message: String,
    overall: Option<i32>,
}

/// A gRPC frame: the 5-byte prefix, then the message.
fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8];
    frame.extend(u32::try_from(message.len()).unwrap().to_be_bytes());
    frame.extend(message);
    frame
}

impl Connection {
    async fn open(addr: std::net::SocketAddr) -> Connection {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, connection) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                // Room for a message near the 4 MiB cap in flight.
                .initial_stream_window_size(8 << 20)
                .initial_connection_window_size(64 << 20)
                .handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        Connection { send, addr }
    }

    /// A `ShouldRateLimit` call whose body is `parts` (an `Err` resets the stream there): what
    /// it came back with, or the error the client saw.
    async fn call(
        &mut self,
        parts: Vec<Result<Vec<u8>, std::io::Error>>,
    ) -> Result<Answer, String> {
        use http_body_util::BodyExt as _;
        use prost::Message as _;
        let frames: Vec<_> = parts
            .into_iter()
            .map(|part| part.map(|bytes| http_body::Frame::data(bytes.into())))
            .collect();
        let call = hyper::Request::post(format!(
            "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            self.addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
        .expect("a request");
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            self.send.send_request(call),
        )
        .await
        .expect("answered within 10 s")
        .map_err(|e| e.to_string())?;
        let headers = answer.headers().clone();
        let body = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        let field = |name: &str| {
            body.trailers()
                .and_then(|t| t.get(name))
                .or_else(|| headers.get(name))
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default()
        };
        let (status, message) = (field("grpc-status"), field("grpc-message"));
        let bytes = body.to_bytes();
        let overall = bytes
            .get(5..)
            .and_then(|m| slidegate::proto::RateLimitResponse::decode(m).ok())
            .map(|r| r.overall_code);
        Ok(Answer {
            status,
            message,
            overall,
        })
    }
}

fn user_call(user: &str) -> Vec<u8> {
    use prost::Message as _;
    grpc_frame(&request("web", vec![descriptor(&[("user", user)])]).encode_to_vec())
}

/// A peer that resets a stream mid-call (headers and half the message sent, then RST_STREAM)
/// costs that stream only: nothing is recorded for it, and the same connection goes on serving.
#[tokio::test]
async fn a_stream_reset_mid_call_records_nothing_and_the_connection_serves_on() {
    let server = start().await;
    let mut connection = Connection::open(server.grpc_addr).await;
    let whole = user_call("reset");
    let half = whole[..whole.len() / 2].to_vec();
    let reset = connection
        .call(vec![
            Ok(half),
            Err(std::io::Error::other("the peer gives up")),
        ])
        .await;
    assert!(
        reset
            .as_ref()
            .map_or(true, |answer| answer.overall.is_none()),
        "a reset call is not decided: {reset:?}"
    );
    // Two a minute: both still free after the reset call, then the third is over.
    for (n, code) in [(1, ok()), (2, ok()), (3, over())] {
        let answer = connection.call(vec![Ok(whole.clone())]).await;
        assert_eq!(
            answer.map(|a| (a.status, a.overall)),
            Ok(("0".to_string(), Some(code))),
            "call {n} after the reset, on the same connection"
        );
    }
    server.stop().await;
}

/// A message just under the 4 MiB cap is read whole and answered (here `INVALID_ARGUMENT`: its
/// value is past `--max-value-bytes`); one over the cap is `OUT_OF_RANGE` before it is read;
/// the connection serves on after both.
#[tokio::test]
async fn a_message_near_the_size_cap_is_read_and_one_past_it_is_refused() {
    use prost::Message as _;
    let server = start().await;
    let mut connection = Connection::open(server.grpc_addr).await;
    let cap = slidegate::server::grpc::direct::MAX_REQUEST_BYTES;
    let big = |value_bytes: usize| {
        request(
            "web",
            vec![descriptor(&[("user", &"x".repeat(value_bytes))])],
        )
        .encode_to_vec()
    };
    let near = big(cap - 64);
    assert!(near.len() <= cap && near.len() > cap - 64, "{}", near.len());
    let answer = connection
        .call(vec![Ok(grpc_frame(&near))])
        .await
        .expect("answered");
    assert_eq!(answer.status, "3", "INVALID_ARGUMENT: {answer:?}");
    assert!(answer.message.contains("max-value-bytes"), "{answer:?}");
    let over = big(cap);
    assert!(over.len() > cap, "{}", over.len());
    let answer = connection
        .call(vec![Ok(grpc_frame(&over))])
        .await
        .expect("answered");
    assert_eq!(answer.status, "11", "OUT_OF_RANGE: {answer:?}");
    let answer = connection
        .call(vec![Ok(user_call("after-big"))])
        .await
        .expect("answered");
    assert_eq!(
        (answer.status.as_str(), answer.overall),
        ("0", Some(ok())),
        "serves on"
    );
    server.stop().await;
}

/// Envoy multiplexes a worker's calls on one connection: 2,000 calls at once on one
/// connection of a client that keeps to the server's stream cap (100 open at a time, the rest
/// queued by the client, as gRPC clients do) are all answered, each exactly (one user each, one
/// call each: all OK).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_streams_on_one_connection_are_all_answered() {
    let server = start().await;
    let connection = Connection::open(server.grpc_addr).await;
    let calls = (0..2_000).map(|n| {
        let mut connection = connection.clone();
        async move {
            connection
                .call(vec![Ok(user_call(&format!("many-{n}")))])
                .await
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    let wrong: Vec<_> = answers
        .iter()
        .filter(|a| !matches!(a, Ok(Answer { status, overall: Some(1), .. }) if status == "0"))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of 2,000 not OK, first: {:?}",
        wrong.len(),
        wrong.first()
    );
    server.stop().await;
}

/// A gRPC client written elsewhere (Python's grpcio, installed into `.venv` by tests/run.sh),
/// used as grpcurl uses a server: no proto file, the services listed by reflection, the call's
/// types built from the descriptors the server sends. Three calls for one user of two a minute:
/// OK with one left, OK with none left, then OVER_LIMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_written_elsewhere_calls_by_reflection_alone() {
    let server = start().await;
    let address = server.grpc_addr.to_string();
    let seen = python_client(
        "reflection_call.py",
        vec![
            address,
            r#"{"domain":"web","descriptors":[{"entries":[{"key":"user","value":"by-reflection"}]}]}"#
                .into(),
            "3".into(),
        ],
    )
    .await;
    assert_eq!(seen["services"], serde_json::json!(README_SERVICES));
    let responses = seen["responses"].as_array().expect("responses");
    let codes: Vec<&str> = responses
        .iter()
        .map(|r| r["overallCode"].as_str().unwrap_or("none"))
        .collect();
    assert_eq!(codes, ["OK", "OK", "OVER_LIMIT"], "{responses:?}");
    assert_eq!(responses[0]["statuses"][0]["limitRemaining"], 1);
    assert_eq!(
        responses[0]["statuses"][0]["currentLimit"]["unit"],
        "MINUTE"
    );
    server.stop().await;
}
