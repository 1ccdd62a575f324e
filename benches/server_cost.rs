//! What one decision costs slidegate in instructions, counted by callgrind: repeatable where the
//! load benchmark's CPU figures move by a quarter between runs of the same build on this shared
//! machine, so a change of a few percent in the server's own work shows.
//!
//!     cargo bench --bench server_cost                       # every case
//!     cargo bench --bench server_cost -- standalone         # cases whose name holds "standalone"
//!     SLIDEGATE_BENCH_BINARY=/tmp/old-slidegate cargo bench --bench server_cost   # another build
//!     SLIDEGATE_COST_KEEP=/tmp/cost cargo bench --bench server_cost   # keep callgrind's files
//!     SLIDEGATE_BENCH_SERVER_ARGS="--tracing" cargo bench --bench server_cost   # more flags
//!
//! For each case it starts the slidegate binary under `valgrind --tool=callgrind` with
//! instrumentation off (the embedded store, or a standalone `redis-server` of its own, native),
//! opens 8 HTTP/2 connections and sends warm-up calls, then turns instrumentation on for a
//! fixed stream of calls (32 in flight, the same requests every run, each with the headers Envoy
//! sends; or, in the cases of one call in flight, 1,000 calls one after another on one
//! connection) and prints slidegate's instructions per decision over all its threads, and
//! the inclusive share of a few layers (hyper's streams, the `ShouldRateLimit` call inside
//! them and its store's part, h2's connections, the Redis client, memcpy). The server runs
//! about 50 times slower under valgrind, and one thread at a time, so more calls wait in its
//! queues than at native speed and a socket read finds several: the figure is for comparing
//! builds, not a native cost.
//! Needs valgrind (`callgrind_control`, `callgrind_annotate`) and redis-server.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

#[allow(dead_code)] // shared with the tests; the bench uses part of it
#[path = "../tests/common/redis.rs"]
mod redis_proc;

#[path = "common/callgrind.rs"]
mod callgrind;

#[allow(dead_code)] // shared with the load benchmark; some shapes are unused here
#[path = "common/workload.rs"]
mod workload;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use workload::{Shape, config, envoy_headers, request, request_number};

/// How the calls come: connections, streams on each, and calls per stream.
#[derive(Clone, Copy)]
struct Load {
    connections: u64,
    streams_per_connection: u64,
    warm_up_calls_per_stream: u64,
    measured_calls_per_stream: u64,
}

impl Load {
    fn streams(self) -> u64 {
        self.connections * self.streams_per_connection
    }

    fn measured_calls(self) -> u64 {
        self.streams() * self.measured_calls_per_stream
    }
}

/// 32 in flight over 8 connections: each socket read finds several calls, and a script call
/// carries several decisions.
const MANY: Load = Load {
    connections: 8,
    streams_per_connection: 4,
    warm_up_calls_per_stream: 20,
    measured_calls_per_stream: 100,
};

/// One call in flight: every call reads its own socket, makes its own script call and writes
/// its own answer, nothing shared with another.
const LONE: Load = Load {
    connections: 1,
    streams_per_connection: 1,
    warm_up_calls_per_stream: 200,
    measured_calls_per_stream: 1000,
};

/// One measured case: the store, what each request sends, and how many come at once.
struct Case {
    name: &'static str,
    redis: bool,
    shape: Shape,
    load: Load,
}

const CASES: [Case; 6] = [
    Case {
        name: "embedded, 100k users",
        redis: false,
        shape: Shape::Users,
        load: MANY,
    },
    Case {
        name: "standalone, 100k users",
        redis: true,
        shape: Shape::Users,
        load: MANY,
    },
    Case {
        name: "standalone, three descriptors",
        redis: true,
        shape: Shape::ThreeSlots,
        load: MANY,
    },
    Case {
        name: "embedded, hot key under attack",
        redis: false,
        shape: Shape::Attack,
        load: MANY,
    },
    Case {
        name: "embedded, one call in flight",
        redis: false,
        shape: Shape::Users,
        load: LONE,
    },
    Case {
        name: "standalone, one call in flight",
        redis: true,
        shape: Shape::Users,
        load: LONE,
    },
];

/// `calls_per_stream` calls on each of `load`'s streams; every call must be decided.
async fn drive(grpc: u16, shape: Shape, load: Load, first: u64, calls_per_stream: u64) {
    let mut clients = Vec::new();
    for _ in 0..load.connections {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
            .expect("uri")
            .tcp_nodelay(true)
            .timeout(Duration::from_secs(60))
            .connect()
            .await
            .expect("connect");
        clients.push(RateLimitServiceClient::new(channel));
    }
    let mut tasks = Vec::new();
    // Every call a user of its own (`request_number`).
    let streams = load.streams();
    for c in 0..load.connections {
        for s in 0..load.streams_per_connection {
            let mut client = clients[c as usize].clone();
            let stream = c * load.streams_per_connection + s;
            tasks.push(tokio::spawn(async move {
                for i in first..first + calls_per_stream {
                    let mut call =
                        tonic::Request::new(request(shape, request_number(i, stream, streams)));
                    // As Envoy sends them, with a long timeout: valgrind runs the server ~50x
                    // slower. (tonic sends `te` itself.)
                    for (name, value) in envoy_headers(60_000) {
                        if name != "te" {
                            let value = value.parse().expect("ASCII");
                            call.metadata_mut().insert(name, value);
                        }
                    }
                    let reply = client.should_rate_limit(call).await;
                    reply.expect("a decision");
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("caller");
    }
}

/// slidegate's instructions per decision for `case`, and its layers' shares.
fn measure(case: &Case, binary: &Path, config: &Path, dir: &Path) -> (u64, String) {
    let redis = case.redis.then(|| redis_proc::RedisProcess::start(&[]));
    let (grpc, http) = (redis_proc::free_port(), redis_proc::free_port());
    let out_file = dir.join(format!("callgrind.{grpc}.out"));
    let mut command = Command::new("valgrind");
    command
        .args(["--tool=callgrind", "--instr-atstart=no"])
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(binary)
        .arg("--config")
        .arg(config)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--http-addr", &format!("127.0.0.1:{http}")])
        .args(["--log-level", "error", "--no-watch"]);
    if let Ok(extra) = std::env::var("SLIDEGATE_BENCH_SERVER_ARGS") {
        command.args(extra.split_whitespace());
    }
    if let Some(redis) = &redis {
        // Valgrind runs the server about 50 times slower: the shipped 15 ms would fail calls.
        command.args(["--redis", &redis.url(), "--redis-timeout", "10s"]);
    }
    let mut server: Child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("valgrind (Debian's valgrind package)");
    redis_proc::wait_until(
        "slidegate under valgrind ready",
        Duration::from_secs(120),
        || redis_proc::command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200")),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let load = case.load;
    runtime.block_on(drive(
        grpc,
        case.shape,
        load,
        0,
        load.warm_up_calls_per_stream,
    ));
    let pid = server.id().to_string();
    callgrind::run("callgrind_control", &["-i", "on", &pid]);
    runtime.block_on(drive(
        grpc,
        case.shape,
        load,
        load.warm_up_calls_per_stream,
        load.measured_calls_per_stream,
    ));
    callgrind::run("callgrind_control", &["-i", "off", &pid]);
    // SIGTERM lets callgrind write its file as the server exits.
    callgrind::run("kill", &["-TERM", &pid]);
    let _ = server.wait();
    let (annotated, total) = callgrind::annotate(&out_file, &["--inclusive=yes"]);
    (total / load.measured_calls(), top_lines(&annotated))
}

/// Where the instructions go: the inclusive share of a few layers, each the first entry of
/// `callgrind_annotate --inclusive=yes` whose name holds the pattern (layers nest: the store's
/// part is inside the call, inside hyper's stream; each connection's streams and the connection
/// are polled side by side by its task, `slidegate::server::grpc::streams::Served`). The compiler inlines the limiter into
/// the call, so it has no entry of its own.
const LAYERS: [(&str, &str); 6] = [
    (
        "hyper::proto::h2::server::H2Stream",
        "hyper's HTTP/2 streams",
    ),
    (
        "GrpcService<S> as hyper::service::service::Service",
        "  ShouldRateLimit (message, limiter, store)",
    ),
    (
        "slidegate::limiter::ask_store::<impl slidegate::limiter::engine::Limiter>::ask_store::{{closure}}",
        "    the store's part",
    ),
    (
        "h2::proto::connection::Connection<T,P,B>::poll",
        "h2's connections",
    ),
    (
        "fred::runtime::_tokio::ClientLike::connect",
        "the Redis client's tasks",
    ),
    ("__memcpy", "memcpy (everywhere)"),
];

fn top_lines(annotated: &str) -> String {
    let mut out = String::new();
    for (pattern, name) in LAYERS {
        let share = annotated
            .lines()
            .find(|l| l.contains(pattern))
            .and_then(|l| l.split('(').nth(1))
            .and_then(|p| p.split('%').next())
            .map(str::trim);
        if let Some(share) = share {
            out.push_str(&format!("    {name:<44} {share:>6}%\n"));
        }
    }
    out
}

fn main() {
    // `cargo bench` passes --bench; a name filter picks cases.
    let only: String = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_default();
    let binary = std::env::var_os("SLIDEGATE_BENCH_BINARY").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_slidegate")),
        PathBuf::from,
    );
    let keep = std::env::var_os("SLIDEGATE_COST_KEEP").map(PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("slidegate-server-cost-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let config_path = dir.join("bench.yaml");
    std::fs::write(&config_path, config()).expect("write config");
    println!(
        "slidegate instructions per decision (callgrind, all threads; {} measured calls, {} in flight over {} connections, unless the case says one call in flight: {} calls)\n",
        MANY.measured_calls(),
        MANY.streams(),
        MANY.connections,
        LONE.measured_calls(),
    );
    for case in CASES.iter().filter(|c| c.name.contains(only.as_str())) {
        let (per_decision, top) = measure(case, &binary, &config_path, &dir);
        println!("{}: {per_decision} instructions per decision", case.name);
        print!("{top}");
    }
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
