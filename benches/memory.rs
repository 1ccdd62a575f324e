//! Redis memory per user. One rule, 1,000 calls an hour per user; every user sent the same
//! number of calls over gRPC; each server alone on a fresh standalone Redis; Redis's
//! `used_memory` above its empty baseline (the library loaded), divided by the users:
//!
//!     cargo bench --bench memory
//!     SLIDEGATE_BENCH_LIMITADOR=/path/to/limitador-server cargo bench --bench memory
//!     SLIDEGATE_BENCH_MEMORY="20000x50,2000x500" cargo bench --bench memory  # users x calls
//!
//! slidegate's exact log (`sliding_log`, one entry per recorded call) in its compact format and
//! as the sorted set it is kept in with `--redis-log-format sorted-set`, and its counter
//! (`sliding_counter`, ten buckets per window); with `SLIDEGATE_BENCH_LIMITADOR`, Kuadrant's
//! limitador (fixed windows) on the same limit, in its `redis` mode. Every call is admitted
//! (500 calls stay under the limit), so each log holds one entry per call.
//!
//! Then the same logs in candidate encodings, written straight into a fresh Redis by one
//! `EVAL` (`FORMATS` below; each key with a TTL, as slidegate's are): the comparison the
//! compact log was chosen by (docs/redis.md). The first row rebuilds the sorted set, which checks
//! the method against the table above.
// Benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::cast_precision_loss
)]

#[allow(dead_code)] // shared with the tests; the bench uses part of it
#[path = "../tests/common/redis.rs"]
mod redis_proc;

#[path = "common/limitador.rs"]
mod limitador;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use slidegate::proto::{RateLimitDescriptor, RateLimitRequest};
use tonic::transport::Channel;

/// Calls in flight at once.
const IN_FLIGHT: usize = 64;

/// A server under measurement, killed when dropped.
struct Server {
    child: Child,
    grpc: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Clone, Copy, Debug)]
enum Contender {
    Log,
    SortedLog,
    Counter,
    Limitador,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Log => "slidegate sliding_log",
            Contender::SortedLog => "slidegate sliding_log, --redis-log-format sorted-set",
            Contender::Counter => "slidegate sliding_counter",
            Contender::Limitador => "limitador (fixed window)",
        }
    }

    /// Starts it on the Redis at `redis_url`, its config written in `dir`.
    fn start(self, dir: &Path, redis_url: &str, limitador: Option<&Path>) -> Server {
        let grpc = redis_proc::free_port();
        let config = dir.join("limits.yaml");
        let child = match self {
            Contender::Log | Contender::SortedLog | Contender::Counter => {
                let algorithm = match self {
                    Contender::Counter => "\n    algorithm: sliding_counter",
                    _ => "",
                };
                std::fs::write(
                    &config,
                    format!(
                        "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {{unit: hour, requests_per_unit: 1000}}{algorithm}\n"
                    ),
                )
                .expect("write config");
                let http = redis_proc::free_port();
                let child = Command::new(env!("CARGO_BIN_EXE_slidegate"))
                    .arg("--config")
                    .arg(&config)
                    .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
                    .args(["--http-addr", &format!("127.0.0.1:{http}")])
                    .args(["--redis", redis_url, "--log-level", "error"])
                    // Memory is measured, not latency: no call given up on a busy machine.
                    .args(["--redis-timeout", "2s"])
                    .args(match self {
                        Contender::SortedLog => &["--redis-log-format", "sorted-set"][..],
                        _ => &[],
                    })
                    .stdout(Stdio::null())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("start slidegate");
                redis_proc::wait_until("slidegate ready", Duration::from_secs(20), || {
                    redis_proc::command(http, "GET /readyz HTTP/1.0\r\n")
                        .is_ok_and(|r| r.contains("200"))
                });
                child
            }
            Contender::Limitador => {
                std::fs::write(
                    &config,
                    "- namespace: bench\n  max_value: 1000\n  seconds: 3600\n  conditions: [\"'user' in descriptors[0]\"]\n  variables: [\"descriptors[0].user\"]\n",
                )
                .expect("write limits");
                let binary = limitador.expect("a limitador binary");
                let (child, grpc) = limitador::start(binary, &config, redis_url);
                return Server { child, grpc };
            }
        };
        Server { child, grpc }
    }
}

/// Redis's `used_memory`, in bytes.
fn used_memory(redis: &redis_proc::RedisProcess) -> f64 {
    redis
        .cmd("INFO memory")
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("used_memory")
}

/// Sends every one of `users` users `calls` calls (a user's calls one after another,
/// [`IN_FLIGHT`] users at once); the calls admitted.
async fn drive(grpc: u16, users: usize, calls: usize) -> usize {
    let channel = Channel::from_shared(format!("http://127.0.0.1:{grpc}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let next = Arc::new(AtomicUsize::new(0));
    let admitted = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (mut client, next, admitted) = (
                RateLimitServiceClient::new(channel.clone()),
                next.clone(),
                admitted.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let user = next.fetch_add(1, Ordering::Relaxed);
                    if user >= users {
                        break;
                    }
                    let request = RateLimitRequest {
                        domain: "bench".into(),
                        descriptors: vec![RateLimitDescriptor {
                            entries: vec![
                                slidegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
                                    key: "user".into(),
                                    value: format!("u{user}"),
                                },
                            ],
                            limit: None,
                            hits_addend: None,
                        }],
                        hits_addend: 0,
                    };
                    for _ in 0..calls {
                        let answer = client.should_rate_limit(request.clone()).await;
                        let ok = answer.is_ok_and(|r| r.get_ref().overall_code == 1);
                        admitted.fetch_add(usize::from(ok), Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("caller");
    }
    admitted.load(Ordering::Relaxed)
}

/// `users x calls` pairs, from SLIDEGATE_BENCH_MEMORY or the two of the issue's table.
fn sizes() -> Vec<(usize, usize)> {
    let text =
        std::env::var("SLIDEGATE_BENCH_MEMORY").unwrap_or_else(|_| "20000x50,2000x500".into());
    text.split(',')
        .map(|pair| {
            let (users, calls) = pair.trim().split_once('x').expect("users x calls");
            (
                users.parse().expect("a number of users"),
                calls.parse().expect("a number of calls"),
            )
        })
        .collect()
}

fn main() {
    let limitador = std::env::var_os("SLIDEGATE_BENCH_LIMITADOR").map(std::path::PathBuf::from);
    let mut contenders = vec![Contender::Log, Contender::SortedLog, Contender::Counter];
    if limitador.is_some() {
        contenders.push(Contender::Limitador);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let scratch = std::env::temp_dir().join(format!("slidegate-memory-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    println!(
        "Redis memory per user (used_memory above the empty baseline, divided by the users; one rule of 1,000 an hour per user; redis-server 7, defaults)\n"
    );
    println!("| users x calls | contender | bytes per user | bytes per call | against limitador |");
    println!("|---|---|---:|---:|---:|");
    for (users, calls) in sizes() {
        let mut limitador_bytes = None;
        let mut rows = Vec::new();
        for contender in contenders.iter().rev() {
            let redis = redis_proc::RedisProcess::start(&[]);
            let server = contender.start(&scratch, &redis.url(), limitador.as_deref());
            // The baseline after the server connected (and loaded its library).
            let before = used_memory(&redis);
            let admitted = runtime.block_on(drive(server.grpc, users, calls));
            assert_eq!(
                admitted,
                users * calls,
                "{}: every call is under the limit",
                contender.name()
            );
            let per_user = (used_memory(&redis) - before) / users as f64;
            drop(server);
            if let Contender::Limitador = contender {
                limitador_bytes = Some(per_user);
            }
            rows.push((*contender, per_user));
        }
        for (contender, per_user) in rows.into_iter().rev() {
            let ratio = limitador_bytes
                .map_or_else(|| "-".to_string(), |l| format!("{:.1}x", per_user / l));
            println!(
                "| {users} x {calls} | {} | {per_user:.0} | {:.1} | {ratio} |",
                contender.name(),
                per_user / calls as f64
            );
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    formats();
}

/// Candidate encodings of one user's log, each written by [`BUILD`] (its `kind` argument).
const FORMATS: [(&str, &str, &[&str]); 5] = [
    (
        "zset",
        "the sorted set (member `<cum>:<weight>:<time>`)",
        &[],
    ),
    (
        "zset",
        "the same, kept a listpack up to 1,024 entries",
        &["--zset-max-listpack-entries", "1024"],
    ),
    (
        "offsets",
        "one string: 8-byte base, 4-byte ms offset a call, appended",
        &[],
    ),
    (
        "offsets+totals",
        "one string: 8-byte base, 4-byte offset and 4-byte running total a call",
        &[],
    ),
    (
        "hash",
        "a hash of time -> running total (a listpack while small)",
        &[],
    ),
];

/// Writes `ARGV[1]` users' logs of `ARGV[2]` calls each, in encoding `ARGV[3]`, calls 7 ms
/// apart, every key with a one-hour TTL.
const BUILD: &str = r"
local users, calls, kind = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local now = 1767225600000
for u = 1, users do
  local key = 'rl:{memory:user=' .. u .. '}:log'
  if kind == 'zset' then
    for c = 1, calls do
      local t = now + 7 * c
      redis.call('ZADD', key, t, string.format('%020d:1:%d', c, t))
    end
  elseif kind == 'hash' then
    for c = 1, calls do
      redis.call('HSET', key, now + 7 * c, c)
    end
  else
    redis.call('APPEND', key, struct.pack('<d', now))
    for c = 1, calls do
      if kind == 'offsets' then
        redis.call('APPEND', key, struct.pack('<I4', 7 * c))
      else
        redis.call('APPEND', key, struct.pack('<I4I4', 7 * c, c))
      end
    end
  end
  redis.call('PEXPIRE', key, 3600000)
end
return users
";

/// The candidate encodings' bytes per user, at each size.
fn formats() {
    println!(
        "\nCandidate encodings of the same logs (used_memory above the empty baseline, divided by the users; written by one EVAL each, calls 7 ms apart, each key with a TTL)\n"
    );
    println!("| users x calls | encoding | bytes per user | bytes per call |");
    println!("|---|---|---:|---:|");
    for (users, calls) in sizes() {
        for (kind, name, config) in FORMATS {
            let redis = redis_proc::RedisProcess::start(config);
            let before = used_memory(&redis);
            let out = Command::new("redis-cli")
                .args(["-p", &redis.port.to_string(), "EVAL", BUILD, "0"])
                .args([users.to_string(), calls.to_string(), kind.to_string()])
                .output()
                .expect("redis-cli");
            let made = String::from_utf8_lossy(&out.stdout);
            assert_eq!(made.trim(), users.to_string(), "{name}: {made}");
            let per_user = (used_memory(&redis) - before) / users as f64;
            println!(
                "| {users} x {calls} | {name} | {per_user:.0} | {:.1} |",
                per_user / calls as f64
            );
        }
    }
}
