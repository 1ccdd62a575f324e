//! Load benchmark: throughput and latency of `ShouldRateLimit` over gRPC on loopback, for the
//! embedded store, standalone Redis and a 3-master Redis Cluster (each started here, on free
//! ports), with CPU per decision (this process from `/proc`, Redis from `INFO`) and Redis commands
//! per decision, plus Redis memory per log entry (one per call, whatever its hits) and per idle key.
//!
//!     cargo bench --bench load                      # defaults: 64 callers, 5 s per scenario
//!     SLIDEGATE_BENCH_SECS=10 SLIDEGATE_BENCH_CALLERS=128 cargo bench --bench load
//!
//! Figures from one run on one machine are comparable with each other; across machines or runs
//! on a shared machine, compare ratios.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines,
    clippy::cast_possible_truncation
)]

#[allow(dead_code)] // shared with the tests; the bench uses part of it
#[path = "../tests/common/redis.rs"]
mod redis_proc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use slidegate::limiter::{Limiter, LimiterOptions, SystemClock};
use slidegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use slidegate::proto::{RateLimitDescriptor, RateLimitRequest};
use slidegate::store::{ClockSource, MemoryStore, RedisOptions, RedisStore, Store};
use tokio::net::TcpListener;

const CONFIG: &str = "domain: bench
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000000}
  - key: api
    rate_limits:
      - {unit: second, requests_per_unit: 50}
      - {unit: minute, requests_per_unit: 1000}
";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Report {
    calls: usize,
    errors: usize,
    over: usize,
    elapsed: Duration,
    latencies_us: Vec<u64>,
    /// Usage over the timed phase: the end's snapshot minus the start's.
    usage: Usage,
}

/// CPU seconds and command counts, read from `/proc` and Redis's `INFO`.
#[derive(Default, Clone, Copy)]
struct Usage {
    /// This process: the server and the load generator together (they share one runtime).
    process_cpu_s: f64,
    redis_cpu_s: f64,
    /// Commands Redis ran, those a script calls included (`INFO commandstats`).
    redis_commands: u64,
}

impl Usage {
    fn now(redis_ports: &[u16]) -> Usage {
        let mut usage = Usage {
            process_cpu_s: process_cpu_s(),
            ..Usage::default()
        };
        for &port in redis_ports {
            let cpu = redis_proc::command(port, "INFO cpu").unwrap_or_default();
            usage.redis_cpu_s +=
                info_field(&cpu, "used_cpu_sys:") + info_field(&cpu, "used_cpu_user:");
            let stats = redis_proc::command(port, "INFO commandstats").unwrap_or_default();
            usage.redis_commands += stats
                .lines()
                .filter_map(|l| l.split("calls=").nth(1))
                .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
                .sum::<u64>();
        }
        usage
    }

    fn since(self, start: Usage) -> Usage {
        Usage {
            process_cpu_s: self.process_cpu_s - start.process_cpu_s,
            redis_cpu_s: self.redis_cpu_s - start.redis_cpu_s,
            redis_commands: self.redis_commands.saturating_sub(start.redis_commands),
        }
    }
}

fn info_field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// User plus system CPU of this process, from `/proc/self/stat` (fields 14 and 15, in clock
/// ticks of 1/100 s, the value on Linux for x86-64 and arm64).
fn process_cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it start past its ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // fields[0] is field 3 (state): utime is field 14, stime field 15.
    (ticks(11) + ticks(12)) / 100.0
}

impl Report {
    fn percentile(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[i] as f64 / 1000.0
    }

    fn print(&self, name: &str) {
        println!(
            "{name:<34} {:>9.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>7.2} ms  ({} calls, {} over limit, {} errors)",
            self.calls as f64 / self.elapsed.as_secs_f64(),
            self.percentile(0.50),
            self.percentile(0.99),
            self.percentile(1.0),
            self.calls,
            self.over,
            self.errors
        );
        let per = |x: f64| x / self.calls.max(1) as f64;
        println!(
            "{:<34} cpu per decision: {:>5.1} us process (server + load generator), {:>5.1} us Redis; {:.2} Redis commands per decision",
            "",
            per(self.usage.process_cpu_s) * 1e6,
            per(self.usage.redis_cpu_s) * 1e6,
            per(self.usage.redis_commands as f64)
        );
    }
}

/// `callers` tasks over `connections` HTTP/2 connections, each calling as fast as it can.
async fn drive(
    store: Arc<dyn Store>,
    redis_ports: &[u16],
    secs: u64,
    callers: u64,
    scenario: &'static str,
) -> Report {
    let limits = slidegate::config::compile_sources(&[("bench.yaml".into(), CONFIG.into())])
        .expect("bench config");
    let metrics = Arc::new(slidegate::metrics::Metrics::new());
    let limiter = Arc::new(
        Limiter::new(
            limits,
            store,
            Arc::new(SystemClock),
            LimiterOptions::default(),
        )
        .with_observer(metrics.clone()),
    );
    let app = slidegate::server::App {
        limiter,
        metrics,
        options: slidegate::server::ServerOptions::default(),
    };
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let http = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = grpc.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(slidegate::server::run(
        slidegate::server::Listeners::new(grpc, http),
        app,
        async {
            let _ = stopped.await;
        },
    ));
    let connections = 8.min(callers);
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(
            RateLimitServiceClient::connect(format!("http://{addr}"))
                .await
                .expect("connect"),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let usage_at_start = Usage::now(redis_ports);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for n in 0..callers {
        let mut client = clients[(n % connections) as usize].clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let (mut errors, mut over, mut i) = (0usize, 0usize, 0u64);
            while Instant::now() < deadline {
                i += 1;
                let entries = match scenario {
                    // Many users, each well within its limit: the common case.
                    "spread" => vec![("user", format!("u{}", (n * 7919 + i) % 10_000))],
                    // Every caller on one descriptor with two windows: contention and rejections.
                    _ => vec![("api", "hot".to_string())],
                };
                let request = RateLimitRequest {
                    domain: "bench".into(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: entries
                            .into_iter()
                            .map(|(k, v)| Entry {
                                key: k.into(),
                                value: v,
                            })
                            .collect(),
                        ..Default::default()
                    }],
                    hits_addend: 0,
                };
                let t = Instant::now();
                match client.should_rate_limit(request).await {
                    Ok(r) => over += usize::from(r.into_inner().overall_code == 2),
                    Err(_) => errors += 1,
                }
                latencies.push(t.elapsed().as_micros() as u64);
            }
            (latencies, errors, over)
        }));
    }
    let mut report = Report {
        calls: 0,
        errors: 0,
        over: 0,
        elapsed: Duration::ZERO,
        latencies_us: Vec::new(),
        usage: Usage::default(),
    };
    for t in tasks {
        let (latencies, errors, over) = t.await.expect("caller");
        report.calls += latencies.len();
        report.errors += errors;
        report.over += over;
        report.latencies_us.extend(latencies);
    }
    report.elapsed = started.elapsed();
    report.usage = Usage::now(redis_ports).since(usage_at_start);
    report.latencies_us.sort_unstable();
    let _ = stop.send(());
    let _ = server.await;
    report
}

async fn redis_store(url: String) -> Arc<dyn Store> {
    Arc::new(
        RedisStore::connect(RedisOptions {
            url,
            pool_size: 4,
            // The shipped default (`--redis-timeout`), so errors from our own deadline show.
            timeout: Duration::from_millis(15),
            connect_timeout: Duration::from_secs(5),
            clock: ClockSource::Server,
            tls: Default::default(),
        })
        .await
        .expect("connect to bench Redis"),
    )
}

fn memory_usage(redis: &redis_proc::RedisProcess) {
    let cli = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let sha = cli(&["SCRIPT", "LOAD", slidegate::store::redis::SCRIPT]);
    let now = 1_767_225_600_000u64;
    println!(
        "\nRedis memory (MEMORY USAGE, redis-server 7, default zset-max-listpack-entries 128):"
    );
    // One call: KEYS log, ban, counters; ARGV now, prefix, mode, n, then hits, role, ban_ms,
    // buckets, debit, window count, limit, window_ms.
    let line = |base: &str, now: u64, hits: u64, buckets: &str| {
        format!(
            "EVALSHA {sha} 3 {base}:log {base}:ban {base}:cnt {now} memprobe0000-123456 1 1 {hits} 0 0 {buckets} 0 1 100000 3600000\n"
        )
    };
    let run = |lines: String| {
        use std::io::Write;
        let mut child = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("redis-cli");
        // Written from another thread: the replies fill the output pipe while commands go in.
        let mut stdin = child.stdin.take().expect("stdin");
        let writer = std::thread::spawn(move || stdin.write_all(lines.as_bytes()));
        let out = child.wait_with_output().expect("redis-cli");
        writer.join().expect("writer").expect("commands");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(!text.contains("SLIDEGATE"), "{text}");
    };
    for entries in [10u64, 100, 128, 129, 1000, 10_000] {
        let base = format!("rl:{{bench:m{entries}}}");
        // One entry per call, whatever its hits: `entries` calls of 5 hits each.
        run((0..entries).map(|n| line(&base, now + n, 5, "0")).collect());
        let bytes: f64 = cli(&["MEMORY", "USAGE", &format!("{base}:log"), "SAMPLES", "0"])
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
        cli(&["MEMORY", "USAGE", &format!("{base}:cnt"), "SAMPLES", "0"])
    );
    let ban = "rl:{bench:banned}:ban";
    cli(&["SET", ban, &(now + 900_000).to_string(), "PX", "900000"]);
    println!(
        "  ban key (idle descriptor): {} bytes",
        cli(&["MEMORY", "USAGE", ban, "SAMPLES", "0"])
    );
}

fn main() {
    let secs = env_or("SLIDEGATE_BENCH_SECS", 5);
    let callers = env_or("SLIDEGATE_BENCH_CALLERS", 64);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("slidegate load benchmark: {callers} callers, {secs} s per scenario, loopback gRPC");
    let standalone = redis_proc::RedisProcess::start(&[]);
    let cluster = redis_proc::RedisCluster::start();
    let cluster_ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    runtime.block_on(async {
        for scenario in ["spread", "hot"] {
            drive(Arc::new(MemoryStore::new()), &[], secs, callers, scenario)
                .await
                .print(&format!("embedded, {scenario}"));
            drive(
                redis_store(standalone.url()).await,
                &[standalone.port],
                secs,
                callers,
                scenario,
            )
            .await
            .print(&format!("redis standalone, {scenario}"));
            drive(
                redis_store(cluster.url()).await,
                &cluster_ports,
                secs,
                callers,
                scenario,
            )
            .await
            .print(&format!("redis cluster (3 masters), {scenario}"));
        }
    });
    memory_usage(&standalone);
}
