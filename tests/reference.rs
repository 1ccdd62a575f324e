//! slidegate started the way envoyproxy/ratelimit is started: only the reference's environment
//! variables, no flags and no `SLIDEGATE_*`, a config directory laid out as the reference reads
//! it (`$RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/config`, a Kubernetes ConfigMap with its `..data`
//! symlink), against standalone Redis, a 3-master cluster and a Redis Sentinel. Decisions, the
//! reference's response headers and its metric names (parsed by the Prometheus text parser of
//! PyPI's `prometheus-client`, installed into `.venv` by tests/run.sh) are checked.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::{
    RedisProcess, RedisSentinel, free_port, make_certs, shared_cluster, shared_standalone,
};
use common::{
    KillOnDrop, TempDir, connect, descriptor, http, ok, over, request, unique_domain, venv_python,
};
use slidegate::proto::RateLimitResponse;

/// A config directory as a ConfigMap mounts it: `<dir>/..<version>/limits.yaml`, `<dir>/..data`
/// linking to the current version, and `<dir>/limits.yaml` linking through `..data`.
struct ConfigMap {
    dir: PathBuf,
    version: u32,
}

impl ConfigMap {
    fn create(dir: PathBuf, yaml: &str) -> ConfigMap {
        std::fs::create_dir_all(&dir).expect("config dir");
        let mut map = ConfigMap { dir, version: 0 };
        map.publish(yaml);
        std::os::unix::fs::symlink("..data/limits.yaml", map.dir.join("limits.yaml"))
            .expect("link limits.yaml");
        map
    }

    /// Writes a new version and swaps `..data` to it in one rename, as the kubelet does.
    fn publish(&mut self, yaml: &str) {
        self.version += 1;
        let version = format!("..v{}", self.version);
        std::fs::create_dir_all(self.dir.join(&version)).expect("version dir");
        std::fs::write(self.dir.join(&version).join("limits.yaml"), yaml).expect("write");
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&version, &tmp).expect("link");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
    }
}

fn limits(domain: &str, per_minute: u32) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {per_minute}}}\n"
    )
}

struct Running {
    grpc: SocketAddr,
    http: SocketAddr,
    metrics: SocketAddr,
    log: PathBuf,
    _child: KillOnDrop,
}

/// Runs `binary` with no arguments and exactly `env` (plus PATH).
fn run_with_env(binary: &Path, env: &[(&str, String)], log: PathBuf) -> std::process::Child {
    let mut command = Command::new(binary);
    command.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        command.env("PATH", path);
    }
    command
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("start slidegate")
}

/// slidegate as the reference is deployed: listeners, runtime directory, Prometheus, headers,
/// one variable slidegate has no use for; `redis` adds the store's variables.
fn start(binary: &Path, root: &Path, redis: &[(&str, String)]) -> Running {
    let (grpc, http, metrics) = (free_port(), free_port(), free_port());
    let mut env = vec![
        ("HOST", "127.0.0.1".to_string()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".to_string()),
        ("GRPC_PORT", grpc.to_string()),
        ("RUNTIME_ROOT", root.display().to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_string()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_string()),
        ("RUNTIME_WATCH_ROOT", "false".to_string()),
        ("USE_STATSD", "false".to_string()),
        ("USE_PROMETHEUS", "true".to_string()),
        ("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics}")),
        ("PROMETHEUS_PATH", "/prom".to_string()),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true".to_string()),
        ("LOG_LEVEL", "info".to_string()),
        ("REDIS_PIPELINE_WINDOW", "150us".to_string()),
    ];
    env.extend(redis.iter().cloned());
    let log = root.join("slidegate.log");
    let child = KillOnDrop(run_with_env(binary, &env, log.clone()));
    let running = Running {
        grpc: SocketAddr::from(([127, 0, 0, 1], grpc)),
        http: SocketAddr::from(([127, 0, 0, 1], http)),
        metrics: SocketAddr::from(([127, 0, 0, 1], metrics)),
        log,
        _child: child,
    };
    let end = Instant::now() + Duration::from_secs(20);
    while !common::redis::command(http, "GET /healthcheck HTTP/1.0\r\n")
        .is_ok_and(|r| r.contains(" 200 "))
    {
        assert!(
            Instant::now() < end,
            "not healthy in time:\n{}",
            std::fs::read_to_string(&running.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    running
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// (family, type, labels, value) of every sample, as the Prometheus client library parses them.
/// (The parser names a counter's samples `<family>_total` whatever the exposition says; the
/// family is what the exposition's `# TYPE` line and sample names gave.)
fn parse_prometheus(text: &str) -> Vec<(String, String, serde_json::Value, f64)> {
    let python = venv_python();
    let script = "import sys, json\nfrom prometheus_client.parser import text_string_to_metric_families\nout = []\nfor f in text_string_to_metric_families(sys.stdin.read()):\n    for s in f.samples:\n        out.append([f.name, f.type, s.labels, s.value])\nprint(json.dumps(out))\n";
    let mut child = Command::new(&python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {} ({e})", python.display()));
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write metrics");
    let out = child.wait_with_output().expect("parser");
    assert!(
        out.status.success(),
        "the Prometheus parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(String, String, serde_json::Value, f64)> =
        serde_json::from_slice(&out.stdout).expect("parser output");
    rows
}

fn sample(
    rows: &[(String, String, serde_json::Value, f64)],
    name: &str,
    labels: serde_json::Value,
) -> Option<f64> {
    rows.iter()
        .find(|(n, _, l, _)| n == name && *l == labels)
        .map(|(_, _, _, v)| *v)
}

/// One call for `[user=u]` in `domain`.
async fn call_user(
    client: &slidegate::proto::rate_limit_service_client::RateLimitServiceClient<
        tonic::transport::Channel,
    >,
    domain: &str,
) -> RateLimitResponse {
    client
        .clone()
        .should_rate_limit(request(domain, vec![descriptor(&[("user", "u")])]))
        .await
        .expect("call")
        .into_inner()
}

/// The whole check for one Redis set-up.
async fn behaves_as_the_reference(binary: &Path, redis: &[(&str, String)]) {
    let scratch = common::temp_dir("reference");
    let domain = unique_domain("rl");
    let mut config = ConfigMap::create(scratch.0.join("ratelimit/config"), &limits(&domain, 3));
    let s = start(binary, &scratch.0, redis);
    let client = connect(s.grpc).await;
    let call = || call_user(&client, &domain);
    for remaining in [2, 1, 0] {
        let r = call().await;
        assert_eq!(r.overall_code, ok());
        assert_eq!(header(&r, "RateLimit-Limit"), Some("3"));
        assert_eq!(
            header(&r, "RateLimit-Remaining"),
            Some(remaining.to_string().as_str())
        );
        assert_eq!(header(&r, "RateLimit-Reset"), Some("60"));
    }
    let fourth = call().await;
    assert_eq!(fourth.overall_code, over());
    assert_eq!(header(&fourth, "RateLimit-Remaining"), Some("0"));

    let (code, text) = http(s.metrics, "GET", "/prom", "").await;
    assert_eq!(code, 200, "{text}");
    let rows = parse_prometheus(&text);
    let rule = serde_json::json!({"domain": domain, "key1": "user", "key2": ""});
    assert_eq!(
        sample(
            &rows,
            "ratelimit_service_rate_limit_total_hits",
            rule.clone()
        ),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &rows,
            "ratelimit_service_rate_limit_over_limit",
            rule.clone()
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &rows,
            "ratelimit_service_rate_limit_within_limit",
            rule.clone()
        ),
        Some(3.0),
        "every admitted hit, as the reference counts it"
    );
    assert_eq!(
        sample(
            &rows,
            "slidegate_build_info",
            serde_json::json!({"version": env!("CARGO_PKG_VERSION"), "commit": slidegate::COMMIT})
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&rows, "ratelimit_service_rate_limit_near_limit", rule),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &rows,
            "ratelimit_service_total_requests",
            serde_json::json!({"grpc_method": "ShouldRateLimit"})
        ),
        Some(4.0)
    );
    assert_eq!(
        sample(
            &rows,
            "ratelimit_service_config_load_success",
            serde_json::json!({})
        ),
        Some(1.0)
    );
    assert!(
        rows.iter()
            .any(|(n, t, _, _)| n == "ratelimit_service_rate_limit_over_limit" && t == "counter")
    );
    // Dashboards select the series by this exact name (the parser above reads both spellings).
    assert!(
        text.lines()
            .any(|l| l.starts_with("ratelimit_service_rate_limit_over_limit{")),
        "{text}"
    );
    assert!(
        sample(
            &rows,
            "process_resident_memory_bytes",
            serde_json::json!({})
        )
        .is_some_and(|v| v > 0.0)
    );
    // The same series on the HTTP port.
    let (code, _) = http(s.http, "GET", "/metrics", "").await;
    assert_eq!(code, 200);

    // A ConfigMap update swaps `..data`: the new limit applies to the same log.
    config.publish(&limits(&domain, 10));
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let r = call().await;
        if r.overall_code == ok() {
            assert_eq!(header(&r, "RateLimit-Limit"), Some("10"));
            assert_eq!(
                header(&r, "RateLimit-Remaining"),
                Some("6"),
                "3 recorded before, plus this one"
            );
            break;
        }
        assert!(Instant::now() < end, "the ConfigMap swap was not picked up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(&s.log).unwrap_or_default();
    assert!(
        log.contains("REDIS_PIPELINE_WINDOW is set but slidegate does not use it"),
        "a reference variable slidegate ignores is named in the log:\n{log}"
    );
}

/// The binary under the reference's name, as Envoy Gateway starts `/bin/ratelimit`.
fn as_ratelimit(scratch: &TempDir) -> PathBuf {
    let link = scratch.0.join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_slidegate"), &link).expect("link ratelimit");
    link
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_environment_with_standalone_redis() {
    let redis = shared_standalone();
    let scratch = common::temp_dir("as-ratelimit");
    let binary = as_ratelimit(&scratch);
    behaves_as_the_reference(
        &binary,
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
            ("REDIS_POOL_SIZE", "2".to_string()),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_environment_with_redis_cluster() {
    let hosts: Vec<String> = shared_cluster()
        .nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    behaves_as_the_reference(
        Path::new(env!("CARGO_BIN_EXE_slidegate")),
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_TYPE", "cluster".to_string()),
            ("REDIS_URL", hosts.join(",")),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_environment_with_redis_sentinel() {
    let master = RedisProcess::start_with(
        |_| vec!["--requirepass".into(), "s3cr@t".into()],
        |port| common::redis::command(port, "PING").is_ok_and(|r| r.starts_with("-NOAUTH")),
    );
    let sentinel = RedisSentinel::start(&master, Some("s3cr@t"));
    behaves_as_the_reference(
        Path::new(env!("CARGO_BIN_EXE_slidegate")),
        &[
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_TYPE", "sentinel".to_string()),
            ("REDIS_URL", format!("mymaster,127.0.0.1:{}", sentinel.port)),
            ("REDIS_AUTH", "s3cr@t".to_string()),
        ],
    )
    .await;
}

/// What would be wrong if ignored stops the start with a message naming the variable; a plain
/// `slidegate` with nothing to go on prints its usage.
#[test]
fn refusals_and_usage() {
    let scratch = common::temp_dir("refusals");
    let binary = Path::new(env!("CARGO_BIN_EXE_slidegate"));
    let root = ("RUNTIME_ROOT", scratch.0.display().to_string());
    for (env, expected) in [
        (
            vec![
                root.clone(),
                (
                    "REDIS_URL",
                    "/var/run/nutcracker/ratelimit.sock".to_string(),
                ),
            ],
            "REDIS_SOCKET_TYPE=unix",
        ),
        (
            vec![root.clone(), ("GRPC_SERVER_USE_TLS", "true".to_string())],
            "GRPC_SERVER_USE_TLS=true",
        ),
        (
            vec![root.clone(), ("SHADOW_MODE", "maybe".to_string())],
            "SHADOW_MODE=\"maybe\" is not a boolean",
        ),
        (vec![], "Usage: slidegate"),
    ] {
        let log = scratch.0.join("refusal.log");
        let mut child = run_with_env(binary, &env, log.clone());
        let status = child.wait().expect("exit");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(status.code(), Some(2), "{env:?}: {text}");
        assert!(
            text.contains(expected),
            "{env:?}: expected {expected:?} in:\n{text}"
        );
    }
}

/// `REDIS_TLS` with the reference's CA, client certificate and hostname variables, against a
/// real Redis that requires client certificates and presents a certificate for another name.
/// Without the client certificate, or without skipping the hostname check, slidegate does not
/// start (and says why).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_environment_with_redis_mutual_tls() {
    let scratch = common::temp_dir("mtls");
    make_certs(
        &scratch.0,
        &[
            ("server", "DNS:redis.internal"),
            ("client", "DNS:slidegate"),
        ],
    );
    let file = |name: &str| scratch.0.join(name).display().to_string();
    let ca = file("ca.crt");
    let (client_cert, client_key) = (file("client.crt"), file("client.key"));
    let redis = RedisProcess::start_tls(&scratch.0, Some("client"), &[]);
    let tls = |with_client: bool, skip: bool| {
        let mut env = vec![
            ("REDIS_SOCKET_TYPE", "tcp".to_string()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
            ("REDIS_TLS", "true".to_string()),
            ("REDIS_TLS_CACERT", ca.clone()),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", skip.to_string()),
        ];
        if with_client {
            env.push(("REDIS_TLS_CLIENT_CERT", client_cert.clone()));
            env.push(("REDIS_TLS_CLIENT_KEY", client_key.clone()));
        }
        env
    };
    std::fs::create_dir_all(scratch.0.join("config")).expect("config dir");
    std::fs::write(scratch.0.join("config/limits.yaml"), limits("mtls", 1)).expect("limits");
    for (env, why) in [
        (tls(false, true), "no client certificate"),
        (tls(true, false), "a certificate for another name"),
    ] {
        let mut full = env.clone();
        full.push(("RUNTIME_ROOT", scratch.0.display().to_string()));
        let log = scratch.0.join("refused.log");
        let mut child = KillOnDrop(run_with_env(
            Path::new(env!("CARGO_BIN_EXE_slidegate")),
            &full,
            log.clone(),
        ));
        let end = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.0.try_wait().expect("wait") {
                break status;
            }
            assert!(
                Instant::now() < end,
                "{why}: slidegate should not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(25));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(!status.success(), "{why}: {text}");
        assert!(text.contains("cannot use Redis"), "{why}: {text}");
    }
    behaves_as_the_reference(Path::new(env!("CARGO_BIN_EXE_slidegate")), &tls(true, true)).await;
}

/// The reference's variables for a config under `root/config` and listeners on loopback.
fn runtime_env(root: &Path, grpc: u16, http: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RUNTIME_ROOT", root.display().to_string()),
        ("HOST", "127.0.0.1".to_string()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".to_string()),
        ("GRPC_PORT", grpc.to_string()),
    ]
}

/// gRPC health as a client sees it, from the moment the port accepts.
struct GrpcHealth(tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>);

impl GrpcHealth {
    /// Connects to `addr` as soon as it accepts (within 20 s).
    async fn connect(addr: SocketAddr) -> GrpcHealth {
        let accept_by = Instant::now() + Duration::from_secs(20);
        let channel = loop {
            if let Ok(c) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
            {
                break c;
            }
            assert!(Instant::now() < accept_by, "the gRPC port never accepted");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        GrpcHealth(tonic_health::pb::health_client::HealthClient::new(channel))
    }

    async fn status(&self, service: &str) -> Result<i32, tonic::Code> {
        let request = tonic_health::pb::HealthCheckRequest {
            service: service.to_string(),
        };
        self.0
            .clone()
            .check(request)
            .await
            .map(|r| r.into_inner().status)
            .map_err(|e| e.code())
    }

    /// Waits (within 10 s: its interval is 2 s) until every name of the service reports
    /// `status`.
    async fn wait_for(&self, status: ServingStatus) {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let ratelimit = self.status("ratelimit").await;
            if ratelimit == Ok(status as i32) && self.status("").await == Ok(status as i32) {
                return;
            }
            assert!(
                Instant::now() < end,
                "gRPC health never turned {status:?}: {ratelimit:?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

use tonic_health::pb::health_check_response::ServingStatus;

/// The HTTP status `path` answers on `port` (0 when it does not answer).
fn http_status(port: u16, path: &str) -> u16 {
    common::redis::command(port, &format!("GET {path} HTTP/1.0\r\n"))
        .ok()
        .and_then(|r| r.split_whitespace().nth(1).and_then(|c| c.parse().ok()))
        .unwrap_or(0)
}

/// `FORCE_START_WITHOUT_INITIAL_CONFIG` with a broken config: slidegate serves, answering OK
/// without a limit, and `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED` keeps `/healthcheck` at 500;
/// once a valid config is published it applies, and the health check turns 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_start_without_a_valid_config() {
    let scratch = common::temp_dir("force");
    let domain = unique_domain("forced");
    let mut config = ConfigMap::create(scratch.0.join("config"), "domain: [not, a, string]\n");
    let (grpc, http) = (free_port(), free_port());
    let mut env = runtime_env(&scratch.0, grpc, http);
    env.extend([
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".to_string()),
        (
            "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
            "true".to_string(),
        ),
    ]);
    let log = scratch.0.join("force.log");
    let _child = KillOnDrop(run_with_env(
        Path::new(env!("CARGO_BIN_EXE_slidegate")),
        &env,
        log.clone(),
    ));
    // From the moment the gRPC port accepts, gRPC health knows the service: NOT_SERVING (no
    // config loaded, with HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED), never NOT_FOUND.
    let grpc_health = GrpcHealth::connect(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let not_serving = ServingStatus::NotServing as i32;
    for _ in 0..20 {
        for service in ["ratelimit", ""] {
            assert_eq!(
                grpc_health.status(service).await,
                Ok(not_serving),
                "{service:?}"
            );
        }
    }
    let health = || {
        common::redis::command(http, "GET /healthcheck HTTP/1.0\r\n")
            .ok()
            .and_then(|r| r.split_whitespace().nth(1).map(str::to_string))
    };
    let end = Instant::now() + Duration::from_secs(20);
    while health().as_deref() != Some("500") {
        assert!(
            Instant::now() < end,
            "not serving: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    let client = connect(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let call = || call_user(&client, &domain);
    for _ in 0..3 {
        let r = call().await;
        assert_eq!(r.overall_code, ok(), "no config yet: no limit");
        assert_eq!(r.statuses[0].current_limit, None);
    }
    config.publish(&limits(&domain, 1));
    let end = Instant::now() + Duration::from_secs(10);
    while health().as_deref() != Some("200") {
        assert!(Instant::now() < end, "the valid config never loaded");
        std::thread::sleep(Duration::from_millis(25));
    }
    // gRPC health follows within its interval (2 s).
    grpc_health.wait_for(ServingStatus::Serving).await;
    assert_eq!(call().await.overall_code, ok());
    assert_eq!(
        call().await.overall_code,
        over(),
        "the published limit applies"
    );
}

/// An empty config directory at start, with `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED` (and no
/// `FORCE_START_WITHOUT_INITIAL_CONFIG`): the reference starts, unhealthy, and so does
/// slidegate (a pod whose ConfigMap or sidecar fills the directory later does not crash-loop):
/// gRPC health NOT_SERVING, `/healthcheck` 500, `/readyz` 503. The first domain makes it
/// ready; a reload that empties the directory again makes it unready, where without the
/// setting it would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_config_directory_waits_for_a_domain() {
    let scratch = common::temp_dir("empty-start");
    let domain = unique_domain("filled");
    let dir = scratch.0.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let (grpc, http) = (free_port(), free_port());
    let mut env = runtime_env(&scratch.0, grpc, http);
    env.push((
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        "true".to_string(),
    ));
    let log = scratch.0.join("empty.log");
    let mut child = KillOnDrop(run_with_env(
        Path::new(env!("CARGO_BIN_EXE_slidegate")),
        &env,
        log.clone(),
    ));
    let grpc_health = GrpcHealth::connect(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let unready = || async {
        grpc_health.wait_for(ServingStatus::NotServing).await;
        common::redis::wait_until("unhealthy over HTTP", Duration::from_secs(10), || {
            http_status(http, "/healthcheck") == 500 && http_status(http, "/readyz") == 503
        });
    };
    unready().await;
    assert!(
        child.0.try_wait().expect("the process").is_none(),
        "exited on an empty directory: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    let config = ConfigMap::create(dir.clone(), &limits(&domain, 1));
    grpc_health.wait_for(ServingStatus::Serving).await;
    common::redis::wait_until("healthy over HTTP", Duration::from_secs(10), || {
        http_status(http, "/healthcheck") == 200 && http_status(http, "/readyz") == 200
    });
    let client = connect(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    assert_eq!(call_user(&client, &domain).await.overall_code, ok());
    assert_eq!(
        call_user(&client, &domain).await.overall_code,
        over(),
        "the loaded limit applies"
    );

    // The ConfigMap emptied: only its dotfiles (`..data`, `..v1`) are left, which are skipped.
    std::fs::remove_file(config.dir.join("limits.yaml")).expect("empty the directory");
    unready().await;
}

/// The reference's own integration tests start it with a relative runtime root
/// (`RUNTIME_ROOT=runtime/current`, from the directory they run in): a file added to the config
/// directory after the start is picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_runtime_root_reloads() {
    let scratch = common::temp_dir("relative-root");
    let config = scratch.0.join("runtime/current/ratelimit/config");
    std::fs::create_dir_all(&config).expect("config dir");
    std::fs::write(
        config.join("basic.yaml"),
        limits(&unique_domain("basic"), 5),
    )
    .unwrap();
    let (grpc, http) = (free_port(), free_port());
    let env = [
        ("RUNTIME_ROOT", "runtime/current".to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_string()),
        ("HOST", "127.0.0.1".to_string()),
        ("PORT", http.to_string()),
        ("GRPC_HOST", "127.0.0.1".to_string()),
        ("GRPC_PORT", grpc.to_string()),
    ];
    let mut command = Command::new(env!("CARGO_BIN_EXE_slidegate"));
    command.env_clear().current_dir(&scratch.0);
    let _child = KillOnDrop(
        command
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    let end = Instant::now() + Duration::from_secs(20);
    while !common::redis::command(http, "GET /healthcheck HTTP/1.0\r\n")
        .is_ok_and(|r| r.contains(" 200 "))
    {
        assert!(Instant::now() < end, "not healthy in time");
        std::thread::sleep(Duration::from_millis(25));
    }
    let added = unique_domain("added");
    std::fs::write(config.join("another.yaml"), limits(&added, 1)).unwrap();
    let client = connect(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let first = call_user(&client, &added).await;
        if first.statuses[0].current_limit.is_some() {
            assert_eq!(call_user(&client, &added).await.overall_code, over());
            break;
        }
        assert!(Instant::now() < end, "the added file was never loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
