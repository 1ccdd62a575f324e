//! Errors that say what to do: each mistake a user was seen to make, run against the binary,
//! and the message it prints, word for word where the wording is the point (it names the flag
//! or variable, what was wrong and the form that works).
// Tests may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::{RedisProcess, command, free_port, wait_until};
use common::{KillOnDrop, temp_dir};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.yaml");

/// The binary with `args` and `env` (nothing else from this environment), its stderr in `log`.
fn spawn(args: &[&str], env: &[(&str, &str)], log: &Path) -> KillOnDrop {
    let mut command = Command::new(env!("CARGO_BIN_EXE_slidegate"));
    command.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        command.env("PATH", path);
    }
    KillOnDrop(
        command
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .expect("start slidegate"),
    )
}

/// Runs to its end (at most 20 s): the exit code and stderr.
fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = temp_dir("errors-run");
    let log = dir.0.join("stderr");
    let mut child = spawn(args, env, &log);
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < end, "{args:?} did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code(),
        std::fs::read_to_string(&log).unwrap_or_default(),
    )
}

/// Waits until the log at `log` holds `text`; its contents then.
fn log_shows(log: &Path, text: &str) -> String {
    let mut seen = String::new();
    wait_until(text, Duration::from_secs(20), || {
        seen = std::fs::read_to_string(log).unwrap_or_default();
        seen.contains(text)
    });
    seen
}

fn serve_args(extra: &[&'static str]) -> (u16, Vec<String>) {
    let (grpc, http) = (free_port(), free_port());
    let mut args = vec![
        "--config".to_string(),
        EXAMPLE.to_string(),
        "--grpc-addr".into(),
        format!("127.0.0.1:{grpc}"),
        "--http-addr".into(),
        format!("127.0.0.1:{http}"),
    ];
    args.extend(extra.iter().map(|s| (*s).to_string()));
    (http, args)
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn a_log_level_that_means_nothing_is_refused() {
    let (_, args) = serve_args(&["--log-level", "verbose"]);
    let (code, stderr) = run(&strs(&args), &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr.trim(),
        "error: --log-level=\"verbose\": not a log level; write error, warn, info, debug or trace, or a filter such as slidegate=debug,fred=info"
    );
    let (_, args) = serve_args(&[]);
    let (code, stderr) = run(&strs(&args), &[("RUST_LOG", "verbose")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("RUST_LOG=\"verbose\": not a log level"),
        "{stderr}"
    );
}

#[test]
fn zero_worker_threads_says_what_to_give() {
    let (_, args) = serve_args(&["--worker-threads", "0"]);
    let (code, stderr) = run(&strs(&args), &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("invalid value '0' for '--worker-threads <WORKER_THREADS>': '0' is not a thread count: give 1 or more, or leave the flag out for one per CPU"),
        "{stderr}"
    );
}

#[test]
fn a_number_that_is_not_one_is_named_with_the_accepted_range() {
    let dir = temp_dir("errors-config");
    std::fs::write(
        dir.0.join("a.yaml"),
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: five\n",
    )
    .unwrap();
    std::fs::write(
        dir.0.join("b.yaml"),
        "domain: b\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: -1}\n",
    )
    .unwrap();
    let path = dir.0.display().to_string();
    let (code, stderr) = run(&["check", &path], &[]);
    assert_eq!(code, Some(1), "{stderr}");
    for expected in [
        format!(
            "{path}/a.yaml:6: descriptors[0].rate_limit.requests_per_unit: expected a whole number from 0 to 4294967295, found `five`"
        ),
        format!(
            "{path}/b.yaml:4: descriptors[0].rate_limit.requests_per_unit: expected a whole number from 0 to 4294967295, found `-1`"
        ),
    ] {
        assert!(stderr.contains(&expected), "{expected}\nin\n{stderr}");
    }
}

#[test]
fn redis_urls_are_read_as_the_reference_writes_them_or_refused_with_the_forms() {
    for scheme in ["foo", "redis-clustr"] {
        let url = format!("{scheme}://127.0.0.1:6379");
        let (_, mut args) = serve_args(&[]);
        args.extend(["--redis".to_string(), url.clone()]);
        let (code, stderr) = run(&strs(&args), &[]);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("--redis {url}: `{scheme}://` is not a Redis URL slidegate reads; write redis://host:port (rediss:// for TLS), redis-cluster://h1:port,h2:port, redis-sentinel://host:port?sentinelServiceName=NAME, or host:port")),
            "{stderr}"
        );
    }
    // host:port, as REDIS_URL is written for the reference: redis://host:port.
    let redis = RedisProcess::start(&[]);
    let (http, mut args) = serve_args(&[]);
    args.extend(["--redis".to_string(), format!("127.0.0.1:{}", redis.port)]);
    let dir = temp_dir("errors-hostport");
    let _child = spawn(&strs(&args), &[], &dir.0.join("log"));
    wait_until("ready on host:port", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
}

/// `rediss://` pointed at a plaintext Redis: the message says TLS is what does not answer,
/// whether Redis waits for the rest of the hello (a warning, serving by the policy) or answers
/// it with an error line (the start fails).
#[test]
fn tls_to_a_plaintext_redis_says_so() {
    let redis = RedisProcess::start(&[]);
    let (_, mut args) = serve_args(&["--redis-connect-timeout", "500ms"]);
    args.extend([
        "--redis".to_string(),
        format!("rediss://127.0.0.1:{}", redis.port),
    ]);
    let dir = temp_dir("errors-tls");
    let log = dir.0.join("log");
    let _child = spawn(&strs(&args), &[], &log);
    log_shows(
        &log,
        "the URL asks for TLS (rediss://): if this Redis does not serve TLS, use redis:// (or REDIS_TLS=false)",
    );
}

/// An xDS server nobody listens at: the cause and the variable, not "transport error".
#[test]
fn an_unreachable_xds_server_names_the_cause() {
    let port = free_port();
    let (grpc, http) = (free_port(), free_port());
    let dir = temp_dir("errors-xds");
    let log = dir.0.join("log");
    let args = [
        "--xds-server".to_string(),
        format!("127.0.0.1:{port}"),
        "--grpc-addr".into(),
        format!("127.0.0.1:{grpc}"),
        "--http-addr".into(),
        format!("127.0.0.1:{http}"),
    ];
    let _child = spawn(&strs(&args), &[], &log);
    let seen = log_shows(&log, "cannot connect to the xDS server");
    assert!(
        seen.contains("(--xds-server, CONFIG_GRPC_XDS_SERVER_URL): transport error: tcp connect error: Connection refused"),
        "{seen}"
    );
}

/// The reference's `LOG_LEVEL=debug` is slidegate's own debug log: a decision is logged, and
/// nothing of the HTTP/2 frames or the Redis client's internals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_debug_level_is_slidegates_own() {
    let redis = RedisProcess::start(&[]);
    let root = temp_dir("errors-debug");
    let config = root.0.join("ratelimit/config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::copy(EXAMPLE, config.join("config.yaml")).unwrap();
    let (grpc, http) = (free_port(), free_port());
    let log: PathBuf = root.0.join("log");
    let redis_url = format!("127.0.0.1:{}", redis.port);
    let env = [
        ("RUNTIME_ROOT", root.0.to_str().unwrap()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("REDIS_URL", redis_url.as_str()),
        ("LOG_LEVEL", "debug"),
        ("HOST", "127.0.0.1"),
        ("GRPC_HOST", "127.0.0.1"),
    ];
    let (grpc_port, http_port) = (grpc.to_string(), http.to_string());
    let mut env = env.to_vec();
    env.extend([
        ("GRPC_PORT", grpc_port.as_str()),
        ("PORT", http_port.as_str()),
    ]);
    let _child = spawn(&[], &env, &log);
    wait_until("healthy", Duration::from_secs(20), || {
        command(http, "GET /healthcheck HTTP/1.0\r\n").is_ok_and(|r| r.contains(" 200 "))
    });
    let client = common::connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    for _ in 0..3 {
        client
            .clone()
            .should_rate_limit(common::request(
                "example",
                vec![common::descriptor(&[("to_number", "debug")])],
            ))
            .await
            .expect("a call");
    }
    let seen = log_shows(&log, "DEBUG");
    let foreign: Vec<&str> = seen
        .lines()
        .filter(|l| (l.contains("DEBUG") || l.contains("TRACE")) && !l.contains(" slidegate"))
        .collect();
    assert!(
        foreign.is_empty(),
        "other crates' debug lines: {foreign:#?}"
    );
}
