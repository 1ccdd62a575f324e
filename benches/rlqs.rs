//! What the Rate Limit Quota Service costs: a fleet of Envoys' streams, each reporting its
//! buckets every 5 s as Envoy 1.40 does, against the slidegate binary on a Redis of its own (or
//! the embedded store), and slidegate's and Redis's CPU per report and Redis's memory per bucket.
//!
//!     cargo bench --bench rlqs
//!     SLIDEGATE_RLQS_STREAMS=200 SLIDEGATE_RLQS_BUCKETS=50 cargo bench --bench rlqs
//!     SLIDEGATE_RLQS_STORE=embedded cargo bench --bench rlqs
//!     SLIDEGATE_BENCH_BINARY=/tmp/old-slidegate cargo bench --bench rlqs   # another build
//!
//! 1,000 streams (over 20 HTTP/2 connections, 50 streams each, as many Envoys would open them)
//! report 100 buckets each (`{user: <stream>-<bucket>}`, a rule of 600 a minute), every 5 s,
//! spread over the 5 s; one round fills the buckets, then three rounds are measured. Each
//! report carries what an Envoy admitting a request a second per bucket would report. Prints
//! slidegate's and Redis's CPU microseconds per report (and per bucket), Redis's memory per
//! bucket, and that every report was answered with an assignment for each of its buckets.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines,
    clippy::cast_precision_loss
)]

#[allow(dead_code)] // shared with the tests; the bench uses part of it
#[path = "../tests/common/redis.rs"]
mod redis_proc;

#[path = "common/usage.rs"]
mod usage;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use slidegate::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaUsageReports,
    rate_limit_quota_service_client::RateLimitQuotaServiceClient,
    rate_limit_quota_usage_reports::BucketQuotaUsage,
};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use usage::{cpu_s, env_number, info_field, redis_cpu};

const ROUND: Duration = Duration::from_secs(5);
const CONNECTIONS: usize = 20;

fn redis_memory(port: u16) -> f64 {
    let info = redis_proc::command(port, "INFO memory").unwrap_or_default();
    info_field(&info, "used_memory:")
}

struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One stream's report of its buckets: each a second's worth of requests per second of the
/// round, one in ten denied.
fn report(stream: usize, buckets: usize, first: bool) -> RateLimitQuotaUsageReports {
    let usage = (0..buckets)
        .map(|b| BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("user".to_string(), format!("s{stream}-b{b}"))]
                    .into_iter()
                    .collect(),
            }),
            time_elapsed: Some(pbjson_types::Duration {
                seconds: if first { 0 } else { 5 },
                nanos: 0,
            }),
            num_requests_allowed: if first { 1 } else { 4 },
            num_requests_denied: if first { 0 } else { 1 },
            last_report: None,
        })
        .collect();
    RateLimitQuotaUsageReports {
        domain: "bench".into(),
        bucket_quota_usages: usage,
    }
}

fn main() {
    let streams = env_number("SLIDEGATE_RLQS_STREAMS", 1_000);
    let buckets = env_number("SLIDEGATE_RLQS_BUCKETS", 100);
    let embedded = std::env::var("SLIDEGATE_RLQS_STORE").is_ok_and(|s| s == "embedded");
    let dir = std::env::temp_dir().join(format!("slidegate-rlqs-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let config = dir.join("limits.yaml");
    std::fs::write(
        &config,
        "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .expect("write limits");
    let redis = (!embedded).then(|| redis_proc::RedisProcess::start(&[]));
    let (grpc, http) = (redis_proc::free_port(), redis_proc::free_port());
    let binary = std::env::var_os("SLIDEGATE_BENCH_BINARY").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_slidegate")),
        PathBuf::from,
    );
    let mut command = Command::new(binary);
    command
        .arg("--config")
        .arg(&config)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--http-addr", &format!("127.0.0.1:{http}")])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(redis) = &redis {
        command.args(["--redis", &redis.url()]);
    }
    let server = Stopped(command.spawn().expect("start slidegate"));
    redis_proc::wait_until("slidegate ready", Duration::from_secs(20), || {
        redis_proc::command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200"))
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let answered = Arc::new(AtomicU64::new(0));
    let actions = Arc::new(AtomicU64::new(0));
    let pid = server.0.id();
    let redis_port = redis.as_ref().map(|r| r.port);
    // Redis's memory with the library loaded and no bucket yet.
    let base_memory = redis_port.map_or(0.0, redis_memory);
    let (before, after) = runtime.block_on(async {
        let mut channels = Vec::new();
        for _ in 0..CONNECTIONS {
            let channel =
                tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
                    .expect("endpoint")
                    .connect()
                    .await
                    .expect("connect");
            channels.push(channel);
        }
        let start = Instant::now();
        let mut tasks = Vec::new();
        for s in 0..streams {
            let channel = channels[s % CONNECTIONS].clone();
            let (answered, actions) = (answered.clone(), actions.clone());
            // Spread over the round: stream s reports at s/streams of it.
            let offset = ROUND.mul_f64(s as f64 / streams as f64);
            tasks.push(tokio::spawn(async move {
                let mut client = RateLimitQuotaServiceClient::new(channel);
                let (tx, rx) = mpsc::channel(2);
                tokio::time::sleep_until((start + offset).into()).await;
                tx.send(report(s, buckets, true)).await.expect("send");
                let mut answers = client
                    .stream_rate_limit_quotas(ReceiverStream::new(rx))
                    .await
                    .expect("open the stream")
                    .into_inner();
                for round in 0..=4u32 {
                    let answer = answers
                        .message()
                        .await
                        .expect("an answer")
                        .expect("a message");
                    answered.fetch_add(1, Ordering::Relaxed);
                    actions.fetch_add(answer.bucket_action.len() as u64, Ordering::Relaxed);
                    if round == 4 {
                        break;
                    }
                    tokio::time::sleep_until((start + offset + ROUND * (round + 1)).into()).await;
                    tx.send(report(s, buckets, false)).await.expect("send");
                }
            }));
        }
        // Measure rounds 1 to 3 (the first filled the buckets), from just before the first of
        // their reports to just after the last.
        tokio::time::sleep_until((start + ROUND - Duration::from_millis(100)).into()).await;
        let before = (
            cpu_s(pid),
            redis_port.map_or(0.0, redis_cpu),
            answered.load(Ordering::Relaxed),
        );
        tokio::time::sleep_until((start + ROUND * 4 - Duration::from_millis(100)).into()).await;
        let after = (
            cpu_s(pid),
            redis_port.map_or(0.0, redis_cpu),
            answered.load(Ordering::Relaxed),
        );
        for task in tasks {
            task.await.expect("stream task");
        }
        (before, after)
    });
    let reports = (after.2 - before.2) as f64;
    let all_reports = streams as u64 * 5;
    assert_eq!(
        answered.load(Ordering::Relaxed),
        all_reports,
        "every report answered"
    );
    assert_eq!(
        actions.load(Ordering::Relaxed),
        all_reports * buckets as u64,
        "an assignment for every bucket"
    );
    println!(
        "{streams} streams x {buckets} buckets, a report every 5 s each ({} store)",
        if embedded { "embedded" } else { "Redis" }
    );
    println!(
        "slidegate: {:.0} us of CPU per report ({:.2} per bucket)",
        (after.0 - before.0) * 1e6 / reports,
        (after.0 - before.0) * 1e6 / reports / buckets as f64
    );
    if let Some(port) = redis_port {
        println!(
            "Redis: {:.0} us of CPU per report ({:.2} per bucket)",
            (after.1 - before.1) * 1e6 / reports,
            (after.1 - before.1) * 1e6 / reports / buckets as f64
        );
        println!(
            "Redis: {:.0} bytes per bucket ({} buckets, their windows and holders)",
            (redis_memory(port) - base_memory) / (streams * buckets) as f64,
            streams * buckets
        );
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
