//! Test harness: starts the real slidegate server on `127.0.0.1:0` and talks to it with a tonic
//! client, as Envoy would.
#![allow(dead_code)] // each test binary uses a different part of the harness

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use slidegate::config;
use slidegate::limiter::{Limiter, LimiterOptions, ManualClock};
use slidegate::metrics::Metrics;
use slidegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use slidegate::proto::rate_limit_response::{Code, DescriptorStatus};
use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use slidegate::proto::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use slidegate::server::{App, ServerOptions};
use slidegate::store::{ClockSource, RedisOptions, Store};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

pub mod envoy;
pub mod otlp;
pub mod proxy;
pub mod redis;
pub mod xds;

/// A running server and a client connected to it.
pub struct TestServer {
    pub grpc_addr: std::net::SocketAddr,
    pub http_addr: std::net::SocketAddr,
    pub clock: ManualClock,
    pub client: RateLimitServiceClient<Channel>,
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<()>>,
}

/// A fixed start time well after the epoch (2026-01-01T00:00:00Z), so windows never reach
/// before zero.
pub const T0: u64 = 1_767_225_600_000;

impl TestServer {
    pub async fn start(
        config_yaml: &str,
        store: Arc<dyn Store>,
        options: LimiterOptions,
    ) -> TestServer {
        let limits = config::compile_sources(&[("test.yaml".to_string(), config_yaml.to_string())])
            .unwrap_or_else(|e| panic!("test config rejected:\n{e}"));
        let clock = ManualClock::new(T0);
        let metrics = Arc::new(Metrics::new());
        let limiter = Arc::new(
            Limiter::new(limits, store, Arc::new(clock.clone()), options)
                .with_observer(metrics.clone()),
        );
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind gRPC");
        let http = TcpListener::bind("127.0.0.1:0").await.expect("bind HTTP");
        let grpc_addr = grpc.local_addr().expect("gRPC address");
        let http_addr = http.local_addr().expect("HTTP address");
        let (stop, stopped) = oneshot::channel::<()>();
        let app = App {
            limiter: limiter.clone(),
            metrics: metrics.clone(),
            options: ServerOptions::default(),
        };
        let join = tokio::spawn(async move {
            slidegate::server::run(slidegate::server::Listeners::new(grpc, http), app, async {
                let _ = stopped.await;
            })
            .await
            .expect("server failed");
        });
        let client = connect(grpc_addr).await;
        TestServer {
            grpc_addr,
            http_addr,
            clock,
            client,
            limiter,
            metrics,
            stop: Some(stop),
            join: Some(join),
        }
    }

    pub async fn call(&self, request: RateLimitRequest) -> RateLimitResponse {
        self.client
            .clone()
            .should_rate_limit(request)
            .await
            .unwrap_or_else(|status| panic!("call failed: {status:?}"))
            .into_inner()
    }

    pub async fn call_err(&self, request: RateLimitRequest) -> tonic::Status {
        match self.client.clone().should_rate_limit(request).await {
            Ok(r) => panic!("expected an error, got {:?}", r.into_inner()),
            Err(status) => status,
        }
    }

    /// Stops the server and waits for it, so a panic inside it fails the test.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            join.await.expect("server task panicked");
        }
    }
}

/// `.venv/bin/python`, where tests/run.sh installs the Python clients' packages from PyPI.
pub fn venv_python() -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(
        path.exists(),
        "no {}: run tests/run.sh, which installs grpcio, opentelemetry-proto and prometheus-client there",
        path.display()
    );
    path
}

/// Runs the client `tests/clients/<script>` with `args` and reads what it prints as JSON; a
/// client that fails fails the test with its stderr.
pub async fn python_client(script: &str, args: Vec<String>) -> serde_json::Value {
    let python = venv_python();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(script);
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .args(args)
            .output()
            .expect("run the Python client")
    })
    .await
    .expect("joined");
    assert!(
        output.status.success(),
        "the Python client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the Python client's output is JSON")
}

/// Options for a test's store on the Redis at `url`: timeouts long enough that a slow, shared
/// machine never has a call answered by the failure policy. A test that needs other values sets
/// those fields (`RedisOptions { timeout, ..redis_options(url) }`).
pub fn redis_options(url: String) -> RedisOptions {
    RedisOptions {
        url,
        pool_size: 2,
        timeout: Duration::from_secs(5),
        queue_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        clock: ClockSource::Server,
        tls: Default::default(),
        key_prefix: String::new(),
        wait_replicas: 0,
        log_format: Default::default(),
    }
}

/// Connects, retrying until the server accepts (bounded by a deadline, never a blind sleep).
pub async fn connect(addr: std::net::SocketAddr) -> RateLimitServiceClient<Channel> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match RateLimitServiceClient::connect(format!("http://{addr}")).await {
            Ok(client) => return client,
            Err(e) if tokio::time::Instant::now() > deadline => {
                panic!("server at {addr} never accepted: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// A unique domain name per test, so tests sharing one Redis never see each other's keys.
pub fn unique_domain(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{name}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// A descriptor from `(key, value)` pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        limit: None,
        hits_addend: None,
    }
}

pub fn with_override(
    mut d: RateLimitDescriptor,
    requests_per_unit: u32,
    unit: i32,
) -> RateLimitDescriptor {
    d.limit = Some(RateLimitOverride {
        requests_per_unit,
        unit,
    });
    d
}

pub fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
    d.hits_addend = Some(hits.into());
    d
}

pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    }
}

pub fn ok() -> i32 {
    Code::Ok as i32
}

pub fn over() -> i32 {
    Code::OverLimit as i32
}

/// `duration_until_reset` in milliseconds.
pub fn reset_ms(status: &DescriptorStatus) -> Option<u64> {
    status
        .duration_until_reset
        .as_ref()
        .map(|d| d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000)
}

/// `(requests_per_unit, unit, name)` of `current_limit`.
pub fn limit_of(status: &DescriptorStatus) -> Option<(u32, i32, String)> {
    status
        .current_limit
        .as_ref()
        .map(|l| (l.requests_per_unit, l.unit, l.name.clone()))
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing behind.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory removed when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(unique_domain(name));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    TempDir(dir)
}

/// A minimal HTTP/1.0 exchange: (status code, body).
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    http_with(addr, method, path, None, body).await
}

/// [`http`] with an `Authorization: Bearer` token, where given.
pub async fn http_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect HTTP");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: test\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.read_to_string(&mut response),
    )
    .await
    .expect("HTTP answer in time")
    .expect("read");
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// 64 clients, each on its own connection to one of `servers` (round robin), send 10 calls each
/// for one descriptor `[key=k]`, all at once. Returns how many were admitted.
pub async fn hammer(servers: &[std::net::SocketAddr], domain: &str, key: &str) -> u32 {
    let mut tasks = Vec::new();
    for n in 0..64 {
        let client = connect(servers[n % servers.len()]).await;
        let (domain, key) = (domain.to_string(), key.to_string());
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u32;
            for _ in 0..10 {
                let r = client
                    .clone()
                    .should_rate_limit(request(&domain, vec![descriptor(&[(&key, "k")])]))
                    .await
                    .expect("call")
                    .into_inner();
                admitted += u32::from(r.overall_code == ok());
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("client task");
    }
    total
}

/// Starts the slidegate binary on the config at `config` with `extra` flags, gRPC and HTTP on
/// free ports, its output discarded; does not wait for it. (gRPC port, HTTP port, process.)
pub fn spawn_slidegate(config: &std::path::Path, extra: &[&str]) -> (u16, u16, KillOnDrop) {
    spawn_slidegate_to(config, extra, std::process::Stdio::null())
}

/// [`spawn_slidegate`] with its log (stderr) written to the file `log`.
pub fn spawn_slidegate_logged(
    config: &std::path::Path,
    extra: &[&str],
    log: &std::path::Path,
) -> (u16, u16, KillOnDrop) {
    let file = std::fs::File::create(log).expect("log file");
    spawn_slidegate_to(config, extra, file.into())
}

fn spawn_slidegate_to(
    config: &std::path::Path,
    extra: &[&str],
    stderr: std::process::Stdio,
) -> (u16, u16, KillOnDrop) {
    let (grpc, http) = (redis::free_port(), redis::free_port());
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("--config")
        .arg(config)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--http-addr", &format!("127.0.0.1:{http}")])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start slidegate");
    (grpc, http, KillOnDrop(child))
}

/// Threads of process `pid` whose name (as the kernel keeps it, 15 bytes at most) starts with
/// `prefix`.
pub fn threads_named(pid: u32, prefix: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("threads of the server")
        .filter(|task| {
            let comm = task.as_ref().map(|t| t.path().join("comm")).ok();
            comm.and_then(|c| std::fs::read_to_string(c).ok())
                .is_some_and(|name| name.trim().starts_with(prefix))
        })
        .count()
}

/// Sends signal `name` (`TERM`, `HUP`) to `child`.
pub fn signal(child: &std::process::Child, name: &str) {
    redis::signal(child.id(), name);
}

/// A raw gRPC channel, for the health and reflection clients.
pub async fn channel(addr: std::net::SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}
