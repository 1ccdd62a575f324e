//! OpenTelemetry traces (`--tracing`) from the real binary to an OTLP receiver written on
//! OpenTelemetry's own service definitions (`tests/clients/otlp_receiver.py`): a call's span
//! joins the trace the caller sent (W3C `traceparent`, B3 single and multi), the store's span is
//! its child, sampling 0 sends nothing, and a collector that is away or slow changes no decision.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::time::Duration;

use common::otlp::{Receiver, Span};
use common::redis::{RedisProcess, free_port, wait_until};
use common::{
    KillOnDrop, TempDir, connect, descriptor, http, ok, over, request, spawn_slidegate_logged,
    temp_dir,
};

const CONFIG: &str = r"
domain: login
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
";

struct Server {
    grpc: std::net::SocketAddr,
    http: std::net::SocketAddr,
    dir: TempDir,
    _process: KillOnDrop,
}

impl Server {
    fn start(name: &str, flags: &[String]) -> Server {
        let dir = temp_dir(name);
        std::fs::write(dir.0.join("login.yaml"), CONFIG).unwrap();
        let mut extra = vec!["--tracing"];
        extra.extend(flags.iter().map(String::as_str));
        let (grpc, http, process) =
            spawn_slidegate_logged(&dir.0.join("login.yaml"), &extra, &dir.0.join("log"));
        let server = Server {
            grpc: ([127, 0, 0, 1], grpc).into(),
            http: ([127, 0, 0, 1], http).into(),
            dir,
            _process: process,
        };
        wait_until("slidegate listens", Duration::from_secs(20), || {
            std::net::TcpStream::connect(server.grpc).is_ok()
                && std::net::TcpStream::connect(server.http).is_ok()
        });
        server
    }

    /// One call for `user` with these headers: its overall code.
    async fn call(&self, user: &str, headers: &[(&'static str, &str)]) -> i32 {
        let mut call = tonic::Request::new(request("login", vec![descriptor(&[("user", user)])]));
        for (name, value) in headers {
            call.metadata_mut().insert(*name, value.parse().unwrap());
        }
        connect(self.grpc)
            .await
            .should_rate_limit(call)
            .await
            .expect("answered")
            .into_inner()
            .overall_code
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("log")).unwrap_or_default()
    }

    async fn metric(&self, name: &str) -> f64 {
        let (_, text) = http(self.http, "GET", "/metrics", "").await;
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }
}

fn grpc_to(receiver: &Receiver) -> Vec<String> {
    vec![
        "--tracing-protocol".into(),
        "grpc".into(),
        "--tracing-endpoint".into(),
        format!("http://127.0.0.1:{}", receiver.grpc_port),
    ]
}

const DEADLINE: Duration = Duration::from_secs(20);

fn call_span(receiver: &Receiver, trace_id: &str) -> Span {
    receiver.wait_for(&format!("ShouldRateLimit of {trace_id}"), DEADLINE, |s| {
        s.name == "ShouldRateLimit" && s.trace_id == trace_id
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_span_joins_the_callers_trace() {
    let receiver = Receiver::start(Duration::ZERO);
    let mut flags = grpc_to(&receiver);
    flags.extend([
        "--log-level".into(),
        "info,slidegate::decision=debug".into(),
    ]);
    let server = Server::start("traces-grpc", &flags);

    // W3C traceparent, sampled: the span is a child of the caller's, with what was decided.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace}-{parent}-01");
    assert_eq!(
        server.call("alice", &[("traceparent", &traceparent)]).await,
        ok()
    );
    let call = call_span(&receiver, trace);
    assert_eq!(call.parent_span_id, parent);
    assert_eq!(call.service, "slidegate");
    assert_eq!(call.protocol, "grpc");
    assert_eq!(call.attribute("domain").as_deref(), Some("login"));
    assert_eq!(call.attribute("descriptors").as_deref(), Some("1"));
    assert_eq!(call.attribute("code").as_deref(), Some("OK"));
    assert_eq!(call.attribute("rules").as_deref(), Some("login.user"));
    assert_eq!(call.attribute("store").as_deref(), Some("memory"));
    assert_eq!(call.attribute("cached").as_deref(), Some("false"));
    assert!(
        !call
            .attributes
            .values()
            .any(|v| v.to_string().contains("alice")),
        "no descriptor value on a span by default: {call:?}"
    );
    let store = receiver.wait_for("the store's span", DEADLINE, |s| {
        s.name == "store" && s.parent_span_id == call.span_id
    });
    assert_eq!(store.trace_id, trace);
    assert_eq!(store.attribute("outcome").as_deref(), Some("ok"));

    // The decision log names the trace.
    wait_until("the decision log's line", DEADLINE, || {
        server.log().lines().any(|l| {
            l.contains("descriptor decided") && l.contains(&format!("trace_id=\"{trace}\""))
        })
    });

    // A caller's trace it did not sample is not exported, but its id reaches the log.
    let unsampled = "d4cda95b652f4a1592b449d5929fda1b";
    server
        .call(
            "zoe",
            &[(
                "traceparent",
                &format!("00-{unsampled}-6e0c63257de34c92-00"),
            )],
        )
        .await;
    wait_until("the unsampled call's log line", DEADLINE, || {
        server.log().lines().any(|l| {
            l.contains("descriptor decided") && l.contains(&format!("trace_id=\"{unsampled}\""))
        })
    });

    // B3, one header and several.
    let b3_trace = "80f198ee56343ba864fe8b2a57d3eff7";
    let single = format!("{b3_trace}-e457b5a2e4d86bd1-1");
    server.call("bob", &[("b3", &single)]).await;
    assert_eq!(
        call_span(&receiver, b3_trace).parent_span_id,
        "e457b5a2e4d86bd1"
    );
    let multi_trace = "463ac35c9f6413ad48485a3953bb6124";
    server
        .call(
            "carol",
            &[
                ("x-b3-traceid", multi_trace),
                ("x-b3-spanid", "a2fb4a1d1a96d312"),
                ("x-b3-sampled", "1"),
            ],
        )
        .await;
    assert_eq!(
        call_span(&receiver, multi_trace).parent_span_id,
        "a2fb4a1d1a96d312"
    );

    // Without a caller's context, a trace of its own; an over-limit answer says so.
    for _ in 0..4 {
        server.call("dave", &[]).await;
    }
    let root = receiver.wait_for("a root span over the limit", DEADLINE, |s| {
        s.name == "ShouldRateLimit"
            && s.parent_span_id.is_empty()
            && s.attribute("code").as_deref() == Some("OVER_LIMIT")
    });
    // Spans leave in the order they end: the root's came after the unsampled call's would have.
    assert!(
        receiver.spans().iter().all(|s| s.trace_id != unsampled),
        "the unsampled trace sent nothing"
    );
    assert_ne!(root.trace_id, trace);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_from_redis_with_the_redis_calls_span() {
    let receiver = Receiver::start(Duration::ZERO);
    let redis = RedisProcess::start(&[]);
    let flags = vec![
        "--tracing-protocol".into(),
        "http".into(),
        "--tracing-endpoint".into(),
        format!("http://127.0.0.1:{}", receiver.http_port),
        "--tracing-service-name".into(),
        "limits-eu".into(),
        "--tracing-descriptor-values".into(),
        "--redis".into(),
        redis.url(),
    ];
    let server = Server::start("traces-http", &flags);
    let trace = "0af7651916cd43dd8448eb211c80319c";
    server
        .call(
            "erin",
            &[("traceparent", &format!("00-{trace}-b7ad6b7169203331-01"))],
        )
        .await;
    let call = call_span(&receiver, trace);
    assert_eq!(call.protocol, "http");
    assert_eq!(call.service, "limits-eu");
    assert_eq!(call.attribute("store").as_deref(), Some("redis"));
    assert_eq!(
        call.attribute("entries").as_deref(),
        Some("user=erin"),
        "values shown when asked"
    );
    let store = receiver.wait_for("the store's span", DEADLINE, |s| {
        s.name == "store" && s.parent_span_id == call.span_id
    });
    let redis_call = receiver.wait_for("the Redis call's span", DEADLINE, |s| {
        s.name == "redis" && s.parent_span_id == store.span_id
    });
    assert_eq!(redis_call.trace_id, trace);
    assert_eq!(redis_call.attribute("attempt").as_deref(), Some("1"));
    assert_eq!(redis_call.attribute("outcome").as_deref(), Some("ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_zero_sends_nothing_but_what_the_caller_sampled() {
    let receiver = Receiver::start(Duration::ZERO);
    let mut flags = grpc_to(&receiver);
    flags.extend(["--tracing-sampling-rate".into(), "0".into()]);
    let server = Server::start("traces-sampling", &flags);
    for n in 0..10 {
        server.call(&format!("u{n}"), &[]).await;
        let unsampled = format!("00-{:032x}-00f067aa0ba902b7-00", n + 1);
        server
            .call(&format!("v{n}"), &[("traceparent", &unsampled)])
            .await;
    }
    // Parent-based: a caller that sampled its trace has it followed, even at rate 0. Spans leave
    // in the order they end, so once this one arrived, any earlier one would have.
    let sampled = "5b8efff798038103d269b633813fc60c";
    server
        .call(
            "w",
            &[("traceparent", &format!("00-{sampled}-eee19b7ec3c1b174-01"))],
        )
        .await;
    call_span(&receiver, sampled);
    let calls: Vec<Span> = receiver
        .spans()
        .into_iter()
        .filter(|s| s.name == "ShouldRateLimit")
        .collect();
    assert_eq!(calls.len(), 1, "only the sampled trace: {calls:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_away_or_slow_changes_no_decision() {
    // Nobody listens at the endpoint.
    let away = Server::start(
        "traces-away",
        &[
            "--tracing-protocol".into(),
            "grpc".into(),
            "--tracing-endpoint".into(),
            format!("http://127.0.0.1:{}", free_port()),
        ],
    );
    // Answers each export 3 s late, with room for 4 spans waiting.
    let slow_receiver = Receiver::start(Duration::from_secs(3));
    let mut flags = grpc_to(&slow_receiver);
    flags.extend(["--tracing-queue-size".into(), "4".into()]);
    let slow = Server::start("traces-slow", &flags);
    for server in [&away, &slow] {
        let client = connect(server.grpc).await;
        for n in 0..20 {
            let user = format!("user{n}");
            let mut codes = Vec::new();
            for _ in 0..4 {
                let call = request("login", vec![descriptor(&[("user", &user)])]);
                codes.push(
                    client
                        .clone()
                        .should_rate_limit(call)
                        .await
                        .unwrap()
                        .into_inner()
                        .overall_code,
                );
            }
            assert_eq!(codes, vec![ok(), ok(), ok(), over()], "{user}");
        }
    }
    wait_until("the export failure logged", DEADLINE, || {
        away.log().contains("traces not exported")
    });
    // Calls go on until the queue, full while an export waits on the receiver, drops some.
    let client = connect(slow.grpc).await;
    let end = std::time::Instant::now() + DEADLINE;
    let mut n = 0;
    loop {
        let dropped = slow.metric("slidegate_tracing_spans_dropped_total").await;
        if dropped > 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "a full queue drops spans and counts them"
        );
        for _ in 0..20 {
            n += 1;
            let call = request("login", vec![descriptor(&[("user", &format!("more{n}"))])]);
            let answer = client
                .clone()
                .should_rate_limit(call)
                .await
                .unwrap()
                .into_inner();
            assert_eq!(answer.overall_code, ok());
        }
    }
}
