//! Load benchmark. Starts its own Redis (standalone and a 3-master cluster) and the slidegate
//! binary (a separate process, so its CPU is its own), drives it over many HTTP/2 connections
//! from this process, and prints one line per scenario: decisions/s, latency percentiles,
//! errors, admitted against the limit where there is one, slidegate CPU and Redis CPU per
//! decision (`/proc/<pid>/stat`, `INFO cpu`), slidegate's context switches per decision
//! (`/proc/<pid>/task/*/status`), and Redis commands per decision
//! (`INFO commandstats`, the script's own calls included). The first lines are the floor:
//! calls whose descriptor no rule names, which take the whole path but count nothing, so that a
//! decision's cost reads against what any call costs on this machine in the same run. Then
//! the ceiling: calls per second
//! of the script alone on one Redis core (`redis-benchmark` running `FCALL` with the
//! arguments slidegate sends, and calls to logs that hold entries), and Redis memory per log
//! entry.
//!
//!     cargo bench --bench load
//!     SLIDEGATE_BENCH_SECS=10 SLIDEGATE_BENCH_CONNECTIONS=16 SLIDEGATE_BENCH_STREAMS=16 cargo bench --bench load
//!     SLIDEGATE_BENCH_ONLY=hot cargo bench --bench load     # scenarios whose name contains "hot"
//!     SLIDEGATE_BENCH_BINARY=/tmp/old-slidegate cargo bench --bench load   # another build
//!     SLIDEGATE_BENCH_SCRIPT=/tmp/old.lua SLIDEGATE_BENCH_ONLY=ceiling cargo bench --bench load
//!     SLIDEGATE_BENCH_LIMITADOR=/path/to/limitador-server cargo bench --bench load  # side by side
//!     SLIDEGATE_BENCH_GRPC_TIMEOUT_MS=20 cargo bench --bench load   # Envoy's default deadline
//!     SLIDEGATE_BENCH_GRPC_TIMEOUT_MS=none cargo bench --bench load   # a client with no deadline
//!     SLIDEGATE_BENCH_WARM_SECS=65 cargo bench --bench load   # measured after 65 s of the load
//!     SLIDEGATE_BENCH_USERS=1000000 SLIDEGATE_BENCH_WARM_SECS=65 cargo bench --bench load  # more users
//!     SLIDEGATE_BENCH_CALLS_PER_VISIT=2 cargo bench --bench load   # two calls in a row per user
//!     SLIDEGATE_BENCH_REDIS_CONFIG="zset-max-listpack-entries 16" cargo bench --bench load  # Redis settings
//!
//! A scenario under load starts from empty stores: in 5 s each of the 100,000 users is called
//! about twice, so its log holds a few entries, where a deployment serving them for a minute
//! holds a window's worth. `SLIDEGATE_BENCH_WARM_SECS` drives the same load that long before
//! measuring (with one call in flight there is none); the admitted count is then of the
//! measured calls only. One scenario is always measured so: the steady state, the same users on
//! a rule of a 10 s window after 11 s of the load (or the warm-up asked for, if longer), where
//! every log holds entries and each call trims its own (limitador alike counts in 10 s windows
//! there).
//!
//! Side by side, limitador runs after each standalone scenario under load; with one call in
//! flight the two take turns, a second each, so that both meet the machine's same spells.
//!
//! Every call carries the headers Envoy sends, its `grpc-timeout` 1,000 ms unless
//! `SLIDEGATE_BENCH_GRPC_TIMEOUT_MS` says otherwise: reading them and the server's timer per
//! call are part of a real call's cost, and a deadline as long as a second leaves the figures
//! of a saturated run comparable with runs before it (Envoy's 20 ms would cut off the slowest
//! calls of both servers at 256 in flight, which a closed loop on two shared cores makes slower
//! than Envoy's traffic would). With the variable set, the generator also gives up on a call at
//! that deadline, as Envoy does, and counts it failed, whether or not the server keeps to it;
//! `none` sends no `grpc-timeout` at all, as a gRPC client that sets no deadline.
//!
//! The load generator shares the machine with slidegate and Redis: compare figures from one
//! run, as ratios.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
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

#[path = "common/workload.rs"]
mod workload;

#[path = "common/redis_settings.rs"]
mod redis_settings;

#[path = "common/limitador.rs"]
mod limitador;

#[path = "common/usage.rs"]
mod usage;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use prost::bytes::{BufMut as _, Bytes, BytesMut};
use slidegate::proto::{RateLimitRequest, RateLimitResponse};
use usage::{cpu_s, env_number, redis_cpu};
use workload::{
    ENVOY_AUTHORITY, STEADY_WINDOW_SECS, Shape, config, envoy_headers, request, request_number,
};

/// Context switches of a process's threads so far, voluntary (it waited: for a socket, a lock,
/// work) and not (the kernel took its core), summed over `/proc/<pid>/task/*/status`. Per
/// decision, it counts the wake-ups a call costs, which the machine's speed does not move.
fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|line| line.contains("ctxt_switches:"))
                .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Keys held by the Redis servers at `ports` together.
fn redis_keys(ports: &[u16]) -> u64 {
    ports
        .iter()
        .filter_map(|&port| redis_proc::command(port, "DBSIZE").ok())
        .filter_map(|reply| reply.trim().strip_prefix(':')?.parse::<u64>().ok())
        .sum()
}

/// Redis CPU seconds and commands run, summed over `ports`.
fn redis_usage(ports: &[u16]) -> (f64, u64) {
    let mut cpu = 0.0;
    let mut commands = 0;
    for &port in ports {
        cpu += redis_cpu(port);
        let stats = redis_proc::command(port, "INFO commandstats").unwrap_or_default();
        commands += stats
            .lines()
            .filter(|l| !l.starts_with("cmdstat_info:"))
            .filter_map(|l| l.split("calls=").nth(1))
            .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    (cpu, commands)
}

/// The slidegate binary, started on `config` with `args`.
struct Server {
    child: Child,
    grpc: u16,
}

impl Server {
    fn start(config: &Path, args: &[String]) -> Server {
        let (grpc, http) = (redis_proc::free_port(), redis_proc::free_port());
        // SLIDEGATE_BENCH_BINARY: another build to compare with, in the same run.
        let binary = std::env::var_os("SLIDEGATE_BENCH_BINARY").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_slidegate")),
            PathBuf::from,
        );
        let child = Command::new(binary)
            .arg("--config")
            .arg(config)
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--http-addr", &format!("127.0.0.1:{http}")])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start slidegate");
        redis_proc::wait_until("slidegate ready", Duration::from_secs(20), || {
            redis_proc::command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200"))
        });
        Server { child, grpc }
    }
}

/// SLIDEGATE_BENCH_LIMITADOR: the same limits for Kuadrant's limitador (`limitador-server`,
/// built elsewhere: nothing of it is in this repository), in its `redis` mode on the same
/// standalone Redis, for a side-by-side in one run. Its limits are fixed windows keyed by the
/// descriptor's value (CEL conditions and variables).
fn limitador_limits() -> String {
    format!(
        "- namespace: bench
  max_value: 1000000
  seconds: 60
  conditions: [\"'user' in descriptors[0]\"]
  variables: [\"descriptors[0].user\"]
- namespace: bench
  max_value: 1000000
  seconds: {STEADY_WINDOW_SECS}
  conditions: [\"'regular' in descriptors[0]\"]
  variables: [\"descriptors[0].regular\"]
- namespace: bench
  max_value: 100
  seconds: 60
  conditions: [\"'attack' in descriptors[0]\"]
  variables: [\"descriptors[0].attack\"]
"
    )
}

impl Server {
    fn start_limitador(binary: &Path, limits: &Path, redis_url: &str) -> Server {
        let (child, grpc) = limitador::start(binary, limits, redis_url);
        Server { child, grpc }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Clone, Copy)]
struct Load {
    connections: u64,
    streams: u64,
    secs: u64,
    /// Seconds of the same load before measuring: logs and counters filled as in a deployment
    /// that has served its users for that long (0: measured from empty stores).
    warm_secs: u64,
}

struct Report {
    name: String,
    calls: usize,
    errors: usize,
    /// Of the errors, calls with no answer by the generator's deadline
    /// (`SLIDEGATE_BENCH_GRPC_TIMEOUT_MS`), as Envoy gives up on them.
    late: usize,
    /// Of those, calls the server itself answered `CANCELLED`: it gave up at the deadline as it
    /// counts it (from when it read the call), rather than answering before it.
    cancelled: usize,
    admitted: usize,
    limit: Option<usize>,
    elapsed: Duration,
    latencies_us: Vec<u64>,
    server_cpu_s: f64,
    /// slidegate's context switches while it served the load.
    server_switches: u64,
    /// This process's CPU while it drove the load (the load generator's share of the machine).
    load_cpu_s: f64,
    redis_cpu_s: f64,
    redis_commands: u64,
    /// Keys in Redis when the load stopped (`DBSIZE`, summed over the masters): the
    /// descriptors the load reached, so a table shows how far it spread.
    redis_keys: u64,
}

impl Report {
    /// Another slice of the same server's run added to this one.
    fn add(&mut self, slice: Report) {
        self.calls += slice.calls;
        self.errors += slice.errors;
        self.late += slice.late;
        self.cancelled += slice.cancelled;
        self.admitted += slice.admitted;
        self.elapsed += slice.elapsed;
        self.latencies_us.extend(slice.latencies_us);
        self.latencies_us.sort_unstable();
        self.server_cpu_s += slice.server_cpu_s;
        self.server_switches += slice.server_switches;
        self.load_cpu_s += slice.load_cpu_s;
        self.redis_cpu_s += slice.redis_cpu_s;
        self.redis_commands += slice.redis_commands;
        // Each slice starts from empty stores: the most any of them reached.
        self.redis_keys = self.redis_keys.max(slice.redis_keys);
    }

    fn percentile(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[i] as f64
    }

    fn print(&self) {
        let per = |x: f64| x / self.calls.max(1) as f64;
        let admitted = match self.limit {
            Some(limit) => format!("{} / {limit}", self.admitted),
            None => "-".into(),
        };
        let redis = if self.redis_commands > 0 {
            format!(
                "{:>6.1} | {:>5.2} | {:>7}",
                per(self.redis_cpu_s) * 1e6,
                per(self.redis_commands as f64),
                self.redis_keys
            )
        } else {
            format!("{:>6} | {:>5} | {:>7}", "-", "-", "-")
        };
        println!(
            "| {:<44} | {:>8.0} | {:>7.0} | {:>7.0} | {:>7.0} | {:>6} | {:>5} | {:>5} | {:>9} | {:>6.1} | {:>5.2} | {redis} | {:>6.1} |",
            self.name,
            self.calls as f64 / self.elapsed.as_secs_f64(),
            self.percentile(0.50),
            self.percentile(0.99),
            self.percentile(0.999),
            self.errors,
            self.late,
            self.cancelled,
            admitted,
            per(self.server_cpu_s) * 1e6,
            per(self.server_switches as f64),
            per(self.load_cpu_s) * 1e6,
        );
    }
}

fn header() {
    println!(
        "| {:<44} | {:>8} | {:>7} | {:>7} | {:>7} | {:>6} | {:>5} | {:>5} | {:>9} | {:>6} | {:>5} | {:>6} | {:>5} | {:>7} | {:>6} |",
        "scenario",
        "calls/s",
        "p50 us",
        "p99 us",
        "p99.9us",
        "errors",
        "late",
        "cncld",
        "admitted",
        "sg cpu",
        "sg cs",
        "rd cpu",
        "cmds",
        "rd keys",
        "lg cpu"
    );
    println!(
        "|{:-<46}|{:->10}|{:->9}|{:->9}|{:->9}|{:->8}|{:->7}|{:->7}|{:->11}|{:->8}|{:->7}|{:->8}|{:->7}|{:->9}|{:->8}|",
        "", ":", ":", ":", ":", ":", ":", ":", ":", ":", ":", ":", ":", ":", ":"
    );
}

/// One HTTP/2 connection of the load generator, calling `ShouldRateLimit` with hyper's client
/// directly. tonic's `Channel` costs as much CPU per call as the server it drives (a buffer
/// task and a channel hop per call, body adapters both ways): on two shared cores the
/// generator's CPU is taken from the servers it measures, the same for every server, so a
/// leaner generator measures each one closer to what it does alone. The call is what a gRPC
/// client sends, with the headers Envoy sends (`content-type: application/grpc`, `te: trailers`,
/// its filter timeout as `grpc-timeout`, and the rest of [`envoy_headers`]), and the answer
/// counts only with `grpc-status: 0`.
#[derive(Clone)]
struct Caller {
    send: SendRequest<Full<Bytes>>,
    uri: hyper::Uri,
    headers: hyper::HeaderMap,
    /// Envoy's deadline, when `SLIDEGATE_BENCH_GRPC_TIMEOUT_MS` sets one: an answer later than
    /// it is a failed call, as Envoy gives up on it (and resets the stream) whatever the server
    /// does with `grpc-timeout`.
    deadline: Option<Duration>,
}

impl Caller {
    async fn connect(port: u16) -> Caller {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        tcp.set_nodelay(true).expect("TCP_NODELAY");
        let (send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        // The connection is made: the URI only names the `:authority` sent, Envoy's.
        let uri = format!(
            "http://{ENVOY_AUTHORITY}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
        )
        .parse()
        .expect("uri");
        let asked = std::env::var("SLIDEGATE_BENCH_GRPC_TIMEOUT_MS").ok();
        // `none`: a client that sets no deadline (no `grpc-timeout`).
        let no_deadline = asked.as_deref() == Some("none");
        let deadline = asked
            .and_then(|ms| ms.parse().ok())
            .map(Duration::from_millis);
        let timeout_ms = deadline.map_or(1000, |d| d.as_millis() as u64);
        let mut headers = hyper::HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().expect("ASCII"));
        for (name, value) in envoy_headers(timeout_ms) {
            if no_deadline && name == "grpc-timeout" {
                continue;
            }
            headers.insert(name, value.parse().expect("ASCII"));
        }
        Caller {
            send,
            uri,
            headers,
            deadline,
        }
    }

    /// Whether the call was admitted (`OK`); an error for any failed call, and for one answered
    /// past Envoy's deadline when there is one.
    async fn call(&mut self, request: &RateLimitRequest) -> Result<bool, Failed> {
        let Some(deadline) = self.deadline else {
            return self.call_once(request).await.map_err(Failed::Answered);
        };
        let call = self.call_once(request);
        tokio::pin!(call);
        match tokio::time::timeout(deadline, &mut call).await {
            Ok(answer) => answer.map_err(Failed::Answered),
            // Envoy gives up here. The server's answer, awaited still, tells whether it answered
            // before the deadline as it counts it (the answer reached the generator late) or
            // gave up at it itself (`CANCELLED`).
            Err(_) => {
                let answer = call.await;
                let cancelled = answer.is_err_and(|e| e.grpc_status.as_deref() == Some("1"));
                Err(Failed::Late { cancelled })
            }
        }
    }

    async fn call_once(&mut self, request: &RateLimitRequest) -> Result<bool, NotOk> {
        let failed = |what: String| NotOk {
            grpc_status: None,
            what,
        };
        let mut body = BytesMut::with_capacity(5 + request.encoded_len());
        body.put_u8(0);
        body.put_u32(u32::try_from(request.encoded_len()).expect("a small request"));
        request.encode(&mut body).expect("room for the message");
        let mut call = hyper::Request::post(self.uri.clone())
            .body(Full::new(body.freeze()))
            .expect("a request");
        *call.headers_mut() = self.headers.clone();
        self.send.ready().await.map_err(|e| failed(e.to_string()))?;
        let response = self
            .send
            .send_request(call)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (head, body) = response.into_parts();
        let collected = body.collect().await.map_err(|e| failed(e.to_string()))?;
        // The status is in the trailers, or in the headers of a trailers-only answer.
        let status = collected
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| head.headers.get("grpc-status"))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if head.status != hyper::StatusCode::OK || status.as_deref() != Some("0") {
            return Err(NotOk {
                what: format!("HTTP {} grpc-status {status:?}", head.status),
                grpc_status: status,
            });
        }
        let message = collected.to_bytes();
        let decoded = RateLimitResponse::decode(message.get(5..).unwrap_or_default())
            .map_err(|e| failed(e.to_string()))?;
        Ok(decoded.overall_code == 1)
    }
}

/// A call that did not end with `grpc-status: 0`: its status where it had one, and what
/// happened.
#[derive(Debug, PartialEq, Eq)]
struct NotOk {
    grpc_status: Option<String>,
    what: String,
}

/// How a call failed: answered with an error, or not answered by the generator's deadline,
/// and then whether the server itself gave up at that deadline (`CANCELLED`) or answered
/// before it as it counts it.
#[derive(Debug, PartialEq, Eq)]
enum Failed {
    Answered(NotOk),
    Late { cancelled: bool },
}

/// Drives `server` with `load` requests of `shape`.
async fn drive(
    name: &str,
    server: &Server,
    redis_ports: &[u16],
    load: &Load,
    shape: Shape,
    limit: Option<usize>,
) -> Report {
    let mut clients = Vec::new();
    for _ in 0..load.connections {
        clients.push(Caller::connect(server.grpc).await);
    }
    // A short warm-up: connections open, the script loaded, caches of the allocator warm.
    for (n, client) in clients.iter().enumerate() {
        let _ = client.clone().call(&request(Shape::Users, n as u64)).await;
    }
    // What the server, Redis and this process have used so far: read as the measured calls
    // begin (before the first is sent, or when the warm-up ends) and when they end.
    let usage = || {
        let (redis_cpu, commands) = redis_usage(redis_ports);
        let server_cpu = cpu_s(server.child.id());
        let server_switches = context_switches(server.child.id());
        (
            redis_cpu,
            commands,
            server_cpu,
            server_switches,
            cpu_s(std::process::id()),
        )
    };
    let before = (load.warm_secs == 0).then(usage);
    let measured_from = Instant::now() + Duration::from_secs(load.warm_secs);
    let deadline = measured_from + Duration::from_secs(load.secs);
    let mut tasks = Vec::new();
    let streams = load.connections * load.streams;
    for c in 0..load.connections {
        for s in 0..load.streams {
            let mut client = clients[c as usize].clone();
            let stream = c * load.streams + s;
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(100_000);
                let (mut errors, mut late, mut cancelled, mut admitted, mut i) =
                    (0usize, 0usize, 0usize, 0usize, 0u64);
                while Instant::now() < deadline {
                    let r = request(shape, request_number(i, stream, streams));
                    i += 1;
                    let t = Instant::now();
                    let answer = client.call(&r).await;
                    if t < measured_from {
                        continue;
                    }
                    match answer {
                        Ok(ok) => admitted += usize::from(ok),
                        Err(failed) => {
                            errors += 1;
                            if let Failed::Late {
                                cancelled: by_server,
                            } = failed
                            {
                                late += 1;
                                cancelled += usize::from(by_server);
                            }
                        }
                    }
                    latencies.push(t.elapsed().as_micros() as u64);
                }
                (latencies, (errors, late, cancelled), admitted)
            }));
        }
    }
    // After a warm-up the counters start where the measured calls do (a call in flight across
    // the line counts on the side it started on).
    let (redis_cpu0, commands0, server_cpu0, server_switches0, load_cpu0) = match before {
        Some(before) => before,
        None => {
            tokio::time::sleep_until(measured_from.into()).await;
            usage()
        }
    };
    let started = measured_from;
    let mut report = Report {
        name: name.into(),
        calls: 0,
        errors: 0,
        late: 0,
        cancelled: 0,
        admitted: 0,
        limit,
        elapsed: Duration::ZERO,
        latencies_us: Vec::new(),
        server_cpu_s: 0.0,
        server_switches: 0,
        load_cpu_s: 0.0,
        redis_cpu_s: 0.0,
        redis_commands: 0,
        redis_keys: 0,
    };
    for t in tasks {
        let (latencies, (errors, late, cancelled), admitted) = t.await.expect("caller");
        report.calls += latencies.len();
        report.errors += errors;
        report.late += late;
        report.cancelled += cancelled;
        report.admitted += admitted;
        report.latencies_us.extend(latencies);
    }
    report.elapsed = started.elapsed();
    let (redis_cpu1, commands1, server_cpu1, server_switches1, load_cpu1) = usage();
    report.server_cpu_s = server_cpu1 - server_cpu0;
    report.server_switches = server_switches1.saturating_sub(server_switches0);
    report.load_cpu_s = load_cpu1 - load_cpu0;
    report.redis_cpu_s = redis_cpu1 - redis_cpu0;
    report.redis_commands = commands1.saturating_sub(commands0);
    report.redis_keys = redis_keys(redis_ports);
    report.latencies_us.sort_unstable();
    report
}

/// A bare Redis round trip, one in flight for `load.secs`: `PING` over one TCP connection from
/// this process's one-thread runtime, as the lone calls are driven. Beside the gRPC floor it is
/// the other half of what any server that asks Redis once per call must wait, in the same
/// spells of the machine.
async fn redis_round_trips(name: &str, port: u16, load: &Load) -> Report {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the bench's Redis");
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let mut reply = [0u8; 7];
    let (redis_cpu0, commands0) = redis_usage(&[port]);
    let load_cpu0 = cpu_s(std::process::id());
    let started = Instant::now();
    let deadline = started + Duration::from_secs(load.secs);
    let (mut latencies, mut errors) = (Vec::with_capacity(100_000), 0);
    while Instant::now() < deadline {
        let t = Instant::now();
        stream
            .write_all(b"*1\r\n$4\r\nPING\r\n")
            .await
            .expect("PING");
        stream.read_exact(&mut reply).await.expect("PONG");
        if &reply != b"+PONG\r\n" {
            errors += 1;
        }
        latencies.push(t.elapsed().as_micros() as u64);
    }
    let elapsed = started.elapsed();
    let (redis_cpu1, commands1) = redis_usage(&[port]);
    latencies.sort_unstable();
    Report {
        name: name.into(),
        calls: latencies.len(),
        errors,
        late: 0,
        cancelled: 0,
        admitted: 0,
        limit: None,
        elapsed,
        latencies_us: latencies,
        server_cpu_s: 0.0,
        server_switches: 0,
        load_cpu_s: cpu_s(std::process::id()) - load_cpu0,
        redis_cpu_s: redis_cpu1 - redis_cpu0,
        // The `INFO` calls that read the counters are left out of the count.
        redis_commands: commands1.saturating_sub(commands0),
        redis_keys: 0,
    }
}

/// Calls per second of the script alone on one Redis core, and Redis CPU per decision: the
/// arguments of one `user` descriptor as slidegate sends them, a fresh user per request,
/// `per_call` requests in each call (as slidegate's batches carry them under load).
fn script_ceiling(redis: &redis_proc::RedisProcess, script: &str, name: &str, per_call: usize) {
    let library = slidegate::store::redis::Library::from_source(script);
    let function = redis_cli(redis.port, &["FUNCTION", "LOAD", "REPLACE", &library.code]);
    let (cpu0, commands0) = redis_usage(&[redis.port]);
    let calls = 200_000 / per_call;
    let mut args = vec!["FCALL".to_string(), function, per_call.to_string()];
    for _ in 0..per_call {
        args.push("rl:{bench:user=u__rand_int__}:log".to_string());
    }
    // The number of requests and the call's time, then per request: shape (4 n + mode: one
    // descriptor, final); hits, rule (role:ban_ms:buckets:debit:limit:window_ms).
    args.extend([per_call.to_string(), "1767225600000".to_string()]);
    for _ in 0..per_call {
        args.extend(["5", "1", "0:0:0:0:1000000:60000"].map(String::from));
    }
    let out = Command::new("redis-benchmark")
        .args(["-p", &redis.port.to_string(), "-c", "16"])
        .args(["-n", &calls.to_string(), "-r", "100000", "--csv"])
        .args(&args)
        .output()
        .expect("run redis-benchmark (Debian's redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .lines()
        .filter_map(|l| l.split("\",\"").nth(1))
        .find_map(|v| v.trim_matches('"').parse::<f64>().ok())
        .unwrap_or(0.0);
    let (cpu1, commands1) = redis_usage(&[redis.port]);
    let decisions = (calls * per_call) as f64;
    println!(
        "{name}, {per_call} request(s) per FCALL, alone on one Redis core (redis-benchmark, 16 clients): {:.0} decisions/s, {:.1} us Redis CPU and {:.2} commands per decision",
        rps * per_call as f64,
        (cpu1 - cpu0) / decisions * 1e6,
        commands1.saturating_sub(commands0) as f64 / decisions
    );
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Sends `commands` to the Redis at `port` through `redis-cli` with `flags` (inline commands, or
/// RESP with `--pipe`); no reply may be the script's error.
fn feed(port: u16, flags: &[&str], commands: String) {
    use std::io::Write;
    let mut child = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("redis-cli");
    // Written from another thread: the replies fill the output pipe while commands go in.
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(commands.as_bytes()));
    let out = child.wait_with_output().expect("redis-cli");
    writer.join().expect("writer").expect("commands");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.contains("SLIDEGATE"), "{text}");
    assert!(
        !flags.contains(&"--pipe") || text.contains("errors: 0"),
        "{text}"
    );
}

/// The script alone on one Redis core on logs that hold entries: 3,200 logs (users), each call
/// 32 of them, first filled to 50 entries each, then measured while they grow from 50 to 100
/// (every entry within the hour-long window, so none leaves). Redis CPU per decision is the
/// figure; Redis keeps such logs as listpacks up to `zset-max-listpack-entries` entries, which
/// `SLIDEGATE_BENCH_REDIS_CONFIG` sets.
fn script_on_logs_with_entries(redis: &redis_proc::RedisProcess) {
    const LOGS: u64 = 3_200;
    const PER_CALL: u64 = 32;
    // Calls that add 50 entries to every log.
    const CALLS: u64 = LOGS * 50 / PER_CALL;
    let library = slidegate::store::redis::Library::new();
    let function = redis_cli(redis.port, &["FUNCTION", "LOAD", "REPLACE", &library.code]);
    let commands = |first: u64| -> String {
        let mut out = String::new();
        for call in first..first + CALLS {
            let users: Vec<u64> = (0..PER_CALL)
                .map(|i| (call * PER_CALL + i) % LOGS)
                .collect();
            let mut words = vec!["FCALL".to_string(), function.clone(), PER_CALL.to_string()];
            words.extend(users.iter().map(|u| format!("rl:{{bench:user={u}}}:log")));
            // The request count and the call's time (a ms later each call), then per request:
            // shape (one descriptor, final), hits, rule (a million an hour).
            words.extend([PER_CALL.to_string(), (1_767_225_600_000 + call).to_string()]);
            for _ in 0..PER_CALL {
                words.extend(["5", "1", "0:0:0:0:1000000:3600000"].map(String::from));
            }
            out.push_str(&format!("*{}\r\n", words.len()));
            for word in &words {
                out.push_str(&format!("${}\r\n{word}\r\n", word.len()));
            }
        }
        out
    };
    feed(redis.port, &["--pipe"], commands(0));
    let measured = commands(CALLS);
    let (cpu0, _) = redis_usage(&[redis.port]);
    let started = std::time::Instant::now();
    feed(redis.port, &["--pipe"], measured);
    let secs = started.elapsed().as_secs_f64();
    let (cpu1, _) = redis_usage(&[redis.port]);
    let decisions = (CALLS * PER_CALL) as f64;
    let encoding = redis_cli(redis.port, &["OBJECT", "ENCODING", "rl:{bench:user=7}:log"]);
    println!(
        "The script, {PER_CALL} requests per FCALL, on {LOGS} logs growing from 50 to 100 entries ({encoding}s), alone on one Redis core (redis-cli --pipe): {:.0} decisions/s, {:.1} us Redis CPU per decision",
        decisions / secs,
        (cpu1 - cpu0) / decisions * 1e6
    );
}

fn memory_usage(redis: &redis_proc::RedisProcess) {
    let library = slidegate::store::redis::Library::new();
    let function = redis_cli(redis.port, &["FUNCTION", "LOAD", "REPLACE", &library.code]);
    let now = 1_767_225_600_000u64;
    // `CONFIG GET` answers the name, then the value.
    let listpack = redis_cli(redis.port, &["CONFIG", "GET", "zset-max-listpack-entries"]);
    println!(
        "\nRedis memory (MEMORY USAGE, redis-server 7, compact logs; zset-max-listpack-entries {}):",
        listpack.lines().nth(1).unwrap_or("unknown")
    );
    // One call of one request: KEYS the log or the counters; ARGV request count, now, shape
    // (5: one descriptor, final), then hits and the rule
    // (role:ban_ms:buckets:debit:limit:window_ms).
    let line = |base: &str, now: u64, hits: u64, buckets: &str| {
        let key = if buckets == "0" { "log" } else { "cnt" };
        format!("FCALL {function} 1 {base}:{key} 1 {now} 5 {hits} 0:0:{buckets}:0:100000:3600000\n")
    };
    let run = |lines: String| feed(redis.port, &[], lines);
    for entries in [10u64, 16, 17, 100, 128, 129, 1000, 10_000] {
        let base = format!("rl:{{bench:m{entries}}}");
        // One entry per call, whatever its hits: `entries` calls of 5 hits each.
        run((0..entries).map(|n| line(&base, now + n, 5, "0")).collect());
        let bytes: f64 = redis_cli(
            redis.port,
            &["MEMORY", "USAGE", &format!("{base}:log"), "SAMPLES", "0"],
        )
        .parse()
        .unwrap_or(0.0);
        println!(
            "  log with {entries:>6} entries: {bytes:>9.0} bytes, {:>6.1} bytes per entry",
            bytes / entries as f64
        );
    }
    // sliding_counter, 10 buckets per hour: a call in each of 12 consecutive buckets (old ones
    // are trimmed), whatever the hits.
    let base = "rl:{bench:counter}";
    run((0..12u64)
        .map(|bucket| line(base, now + bucket * 360_000, 5_000, "10"))
        .collect());
    println!(
        "  sliding_counter, 10 buckets: {} bytes, whatever the limit and the hits",
        redis_cli(
            redis.port,
            &["MEMORY", "USAGE", &format!("{base}:cnt"), "SAMPLES", "0"]
        )
    );
    let ban = "rl:{bench:banned}:ban";
    redis_cli(
        redis.port,
        &["SET", ban, &(now + 900_000).to_string(), "PX", "900000"],
    );
    println!(
        "  ban key (idle descriptor): {} bytes",
        redis_cli(redis.port, &["MEMORY", "USAGE", ban, "SAMPLES", "0"])
    );
}

struct Scenario {
    name: &'static str,
    shape: Shape,
    store: Store,
    limit: Option<usize>,
    /// One call in flight instead of the configured load.
    single: bool,
    /// Another scenario's name and shape, driven in turns with this one on the same server (a
    /// second each, its line printed first): two latencies compared over the same spells.
    turns_with: Option<(&'static str, Shape)>,
    /// Seconds of load before measuring, at least (under load): the steady state's warm-up,
    /// a second longer than its rule's window.
    min_warm_secs: u64,
}

#[derive(Clone, Copy)]
enum Store {
    Embedded,
    Standalone,
    Cluster,
}

fn scenarios() -> Vec<Scenario> {
    use Shape::*;
    use Store::*;
    // (name, shape, store, limit, one call in flight)
    let table: [(&'static str, Shape, Store, Option<usize>, bool); 17] = [
        // What a call costs before any counting: the floor the others stand on, in this run.
        ("floor: no rule matches", NoRule, Embedded, None, false),
        ("embedded, 100k users", Users, Embedded, None, false),
        ("standalone, 100k users", Users, Standalone, None, false),
        // The same users after a warm-up longer than their rule's window: each call trims
        // its log, as in a deployment that has served its users for a while.
        (
            "standalone, steady state: 100k users on a 10 s window",
            SteadyUsers,
            Standalone,
            None,
            false,
        ),
        ("cluster, 100k users", Users, Cluster, None, false),
        (
            "floor: no rule matches, one call in flight",
            NoRule,
            Embedded,
            None,
            true,
        ),
        ("embedded, one call in flight", Users, Embedded, None, true),
        (
            "standalone, one call in flight",
            Users,
            Standalone,
            None,
            true,
        ),
        (
            "embedded, hot key under attack (100/min)",
            Attack,
            Embedded,
            Some(100),
            false,
        ),
        (
            "standalone, hot key under attack (100/min)",
            Attack,
            Standalone,
            Some(100),
            false,
        ),
        (
            "cluster, hot key under attack (100/min)",
            Attack,
            Cluster,
            Some(100),
            false,
        ),
        (
            "cluster, three descriptors in three slots",
            ThreeSlots,
            Cluster,
            None,
            false,
        ),
        (
            "standalone, three descriptors",
            ThreeSlots,
            Standalone,
            None,
            false,
        ),
        // Latency of one descriptor against three in three slots, with nothing else in flight
        // (the three slots' calls go out together), in turns (below): "cluster, one call in
        // flight" is driven with it.
        (
            "cluster, three slots, one call in flight",
            ThreeSlots,
            Cluster,
            None,
            true,
        ),
        // The same with three descriptors of one user: the fan-out alone, without the shared
        // tenant and route logs, which every request adds to.
        (
            "cluster, three user slots, one call in flight",
            ThreeUserSlots,
            Cluster,
            None,
            true,
        ),
        (
            "standalone, 1,000 wildcard rules",
            Wildcards,
            Standalone,
            None,
            false,
        ),
        (
            "embedded, 1,000 wildcard rules",
            Wildcards,
            Embedded,
            None,
            false,
        ),
    ];
    table
        .into_iter()
        .map(|(name, shape, store, limit, single)| Scenario {
            name,
            shape,
            store,
            limit,
            single,
            turns_with: (matches!(shape, ThreeSlots | ThreeUserSlots) && single)
                .then_some(("cluster, one call in flight", Users)),
            min_warm_secs: if shape == SteadyUsers {
                STEADY_WINDOW_SECS + 1
            } else {
                0
            },
        })
        .collect()
}

/// The Redis instances every scenario shares (emptied before each).
struct Stores {
    standalone: redis_proc::RedisProcess,
    cluster: redis_proc::RedisCluster,
    cluster_ports: Vec<u16>,
}

impl Stores {
    fn start() -> Stores {
        let standalone = redis_proc::RedisProcess::start(&[]);
        let cluster = redis_proc::RedisCluster::start();
        let cluster_ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
        for (name, value) in redis_settings::from_env("SLIDEGATE_BENCH_REDIS_CONFIG") {
            for port in std::iter::once(standalone.port).chain(cluster_ports.iter().copied()) {
                let answer = redis_cli(port, &["CONFIG", "SET", &name, &value]);
                assert_eq!(answer, "OK", "CONFIG SET {name} {value} on {port}");
            }
        }
        Stores {
            standalone,
            cluster,
            cluster_ports,
        }
    }
}

/// Where the load generator runs. Under load, on a worker per core. With one call in flight,
/// on one thread, as an Envoy worker calls on its own connection from its own event loop: a
/// lone call's client tasks then wake each other without crossing threads, and the generator
/// adds less of its own to the latency measured.
struct Runtimes {
    workers: tokio::runtime::Runtime,
    one_thread: tokio::runtime::Runtime,
}

/// Starts slidegate on the scenario's store and prints its line.
fn run_scenario(
    scenario: &Scenario,
    stores: &Stores,
    config_path: &Path,
    extra: &[String],
    load: &Load,
    runtimes: &Runtimes,
) {
    let (standalone, cluster, cluster_ports) =
        (&stores.standalone, &stores.cluster, &stores.cluster_ports);
    // Every scenario starts from empty stores.
    let _ = redis_cli(standalone.port, &["FLUSHALL"]);
    for port in cluster_ports {
        let _ = redis_cli(*port, &["FLUSHALL"]);
    }
    let (mut args, ports) = match scenario.store {
        Store::Embedded => (Vec::new(), Vec::new()),
        Store::Standalone => (
            vec!["--redis".to_string(), standalone.url()],
            vec![standalone.port],
        ),
        Store::Cluster => (
            vec!["--redis".to_string(), cluster.url()],
            cluster_ports.clone(),
        ),
    };
    args.extend(extra.iter().cloned());
    if !args.iter().any(|a| a == "--log-level") {
        args.extend(["--log-level".to_string(), "error".to_string()]);
    }
    let single = Load {
        connections: 1,
        streams: 1,
        secs: load.secs,
        warm_secs: 0,
    };
    let warmed = Load {
        warm_secs: load.warm_secs.max(scenario.min_warm_secs),
        ..*load
    };
    let (load, runtime) = if scenario.single {
        (&single, &runtimes.one_thread)
    } else {
        (&warmed, &runtimes.workers)
    };
    let run = |name: &str, server: &Server, shape: Shape, load: &Load| {
        runtime.block_on(drive(name, server, &ports, load, shape, scenario.limit))
    };
    if scenario.single && scenario.shape == Shape::NoRule {
        // The lone call's floor, in turns with a bare Redis round trip.
        let server = Server::start(config_path, &args);
        in_turns(
            load.secs,
            &ports,
            |slice| run(scenario.name, &server, scenario.shape, slice),
            |slice| {
                runtime.block_on(redis_round_trips(
                    "floor: Redis round trip (PING), one in flight",
                    standalone.port,
                    slice,
                ))
            },
        );
        return;
    }
    if let Some((other, other_shape)) = scenario.turns_with {
        let server = Server::start(config_path, &args);
        in_turns(
            load.secs,
            &ports,
            |slice| run(other, &server, other_shape, slice),
            |slice| run(scenario.name, &server, scenario.shape, slice),
        );
        return;
    }
    let peer = std::env::var_os("SLIDEGATE_BENCH_LIMITADOR")
        .filter(|_| {
            matches!(scenario.store, Store::Standalone)
                && matches!(
                    scenario.shape,
                    Shape::Users | Shape::SteadyUsers | Shape::Attack
                )
        })
        .map(|binary| {
            let limits = config_path.with_file_name("limitador.yaml");
            std::fs::write(&limits, limitador_limits()).expect("write limitador limits");
            move || Server::start_limitador(Path::new(&binary), &limits, &standalone.url())
        });
    let peer_name = format!("limitador: {}", scenario.name);
    match peer {
        // Both running, one driven at a time.
        Some(start_peer) if scenario.single => {
            let (ours, theirs) = (Server::start(config_path, &args), start_peer());
            in_turns(
                load.secs,
                &ports,
                |slice| run(scenario.name, &ours, scenario.shape, slice),
                |slice| run(&peer_name, &theirs, scenario.shape, slice),
            );
        }
        // Under load, one after the other, each from empty stores, each server stopped at the
        // end of its statement, before the next starts.
        _ => {
            run(
                scenario.name,
                &Server::start(config_path, &args),
                scenario.shape,
                load,
            )
            .print();
            if let Some(start_peer) = peer {
                let _ = redis_cli(standalone.port, &["FLUSHALL"]);
                run(&peer_name, &start_peer(), scenario.shape, load).print();
            }
        }
    }
}

/// Two lone-call measurements taken in turns, a second each for `secs` seconds, and their lines
/// printed in order. A lone call's latency sits near this machine's wake-up floor, which moves
/// from one second to the next: in turns, both meet the same spells of the machine. Each second
/// starts from empty stores (`ports`), as a whole run does: a second's users are the same ones
/// again, and their logs would otherwise be there.
fn in_turns(
    secs: u64,
    ports: &[u16],
    first: impl Fn(&Load) -> Report,
    second: impl Fn(&Load) -> Report,
) {
    let slice = Load {
        connections: 1,
        streams: 1,
        secs: 1,
        warm_secs: 0,
    };
    let second_of = |measure: &dyn Fn(&Load) -> Report| {
        for port in ports {
            let _ = redis_cli(*port, &["FLUSHALL"]);
        }
        measure(&slice)
    };
    let (mut first_report, mut second_report) = (second_of(&first), second_of(&second));
    for _ in 1..secs {
        first_report.add(second_of(&first));
        second_report.add(second_of(&second));
    }
    first_report.print();
    second_report.print();
}

/// The workload where it is not the default one: its users, and calls in a row per user.
fn workload_note() -> String {
    let mut note = String::new();
    if workload::users() != 100_000 {
        note += &format!(
            ", {} users (the scenarios named \"100k users\" too)",
            workload::users()
        );
    }
    if workload::calls_per_visit() != 1 {
        note += &format!(", {} calls in a row per user", workload::calls_per_visit());
    }
    note
}

fn main() {
    let load = Load {
        connections: env_number::<u64>("SLIDEGATE_BENCH_CONNECTIONS", 16),
        streams: env_number::<u64>("SLIDEGATE_BENCH_STREAMS", 16),
        secs: env_number::<u64>("SLIDEGATE_BENCH_SECS", 5),
        warm_secs: env_number::<u64>("SLIDEGATE_BENCH_WARM_SECS", 0),
    };
    let only = std::env::var("SLIDEGATE_BENCH_ONLY").unwrap_or_default();
    let extra: Vec<String> = std::env::var("SLIDEGATE_BENCH_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let runtimes = Runtimes {
        workers: tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("runtime"),
        one_thread: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime"),
    };
    let scratch = std::env::temp_dir().join(format!("slidegate-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let config_path: PathBuf = scratch.join("bench.yaml");
    std::fs::write(&config_path, config()).expect("write config");
    println!(
        "slidegate load benchmark: {} connections x {} streams ({} in flight), {} s per scenario, loopback gRPC, slidegate as its own process{}{}{}",
        load.connections,
        load.streams,
        load.connections * load.streams,
        load.secs,
        workload_note(),
        if extra.is_empty() {
            String::new()
        } else {
            format!(", extra flags: {}", extra.join(" "))
        },
        match std::env::var("SLIDEGATE_BENCH_REDIS_CONFIG") {
            Ok(text) if !text.trim().is_empty() => format!(", Redis set to: {}", text.trim()),
            _ => String::new(),
        }
    );
    println!(
        "latencies in microseconds; CPU per decision in microseconds (sg: slidegate, rd: Redis, lg: the load generator, this process); sg cs: slidegate's context switches per decision; cmds: Redis commands per decision; rd keys: keys in Redis when the load stopped\n"
    );
    let stores = Stores::start();
    let standalone = &stores.standalone;
    header();
    for scenario in scenarios().into_iter().filter(|s| {
        s.name.contains(only.as_str())
            || s.turns_with
                .is_some_and(|(other, _)| other.contains(only.as_str()))
    }) {
        run_scenario(&scenario, &stores, &config_path, &extra, &load, &runtimes);
    }
    if only.is_empty() || "ceiling".contains(only.as_str()) {
        println!();
        for per_call in [1, 32] {
            let _ = redis_cli(standalone.port, &["FLUSHALL"]);
            script_ceiling(
                standalone,
                slidegate::store::redis::SCRIPT,
                "The script",
                per_call,
            );
        }
        // SLIDEGATE_BENCH_SCRIPT: another version of the script (a library text written like the joined parts of `lua/`, taking the same arguments),
        // measured the same way.
        if let Some(path) = std::env::var_os("SLIDEGATE_BENCH_SCRIPT") {
            let other = std::fs::read_to_string(&path).expect("read SLIDEGATE_BENCH_SCRIPT");
            let name = format!("{}", Path::new(&path).display());
            for per_call in [1, 32] {
                let _ = redis_cli(standalone.port, &["FLUSHALL"]);
                script_ceiling(standalone, &other, &name, per_call);
            }
        }
        let _ = redis_cli(standalone.port, &["FLUSHALL"]);
        script_on_logs_with_entries(standalone);
        memory_usage(standalone);
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
