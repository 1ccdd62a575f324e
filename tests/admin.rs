//! The admin API (`--admin-addr`) and `slidegate admin`, against the real binary on each store:
//! embedded, standalone Redis and a 3-master Redis Cluster. Inspect reads without changing
//! anything (Redis keys, their TTLs), reset lets a banned, over-limit user through at once and
//! clears every slot of a cross-slot request, and a call without the token gets 401 and
//! changes nothing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::redis::{RedisCluster, RedisProcess, free_port, make_certs, wait_until};
use common::{KillOnDrop, TempDir, http, http_with, spawn_slidegate_logged, temp_dir};
use serde_json::Value;

const CONFIG: &str = r"
domain: login
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
    ban: 30s
  - key: ip
    rate_limit: {unit: hour, requests_per_unit: 100}
    algorithm: sliding_counter
";

const TOKEN: &str = "0123456789abcdef-admin";

/// A slidegate binary serving the admin API, its log written to a file.
struct Admin {
    http: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    dir: TempDir,
    _process: KillOnDrop,
}

impl Admin {
    fn start(name: &str, store: &[String]) -> Admin {
        let dir = temp_dir(name);
        std::fs::write(dir.0.join("tokens"), format!("# admins\nalice {TOKEN}\n")).expect("tokens");
        let mut flags = vec![
            "--admin-token-file".to_string(),
            dir.0.join("tokens").display().to_string(),
        ];
        flags.extend_from_slice(store);
        Admin::start_in(dir, &flags)
    }

    /// The server in `dir`, with these admin and store flags.
    fn start_in(dir: TempDir, flags: &[String]) -> Admin {
        std::fs::write(dir.0.join("login.yaml"), CONFIG).expect("config");
        let admin = free_port();
        let admin_addr = format!("127.0.0.1:{admin}");
        let mut extra = vec!["--admin-addr", admin_addr.as_str()];
        extra.extend(flags.iter().map(String::as_str));
        let (_, http, process) =
            spawn_slidegate_logged(&dir.0.join("login.yaml"), &extra, &dir.0.join("log"));
        let http = std::net::SocketAddr::from(([127, 0, 0, 1], http));
        let runtime = tokio::runtime::Handle::current();
        wait_until("slidegate ready", Duration::from_secs(20), || {
            tokio::task::block_in_place(|| {
                runtime.block_on(async {
                    tokio::time::timeout(Duration::from_secs(2), http_ready(http))
                        .await
                        .unwrap_or(false)
                })
            })
        });
        Admin {
            http,
            admin: std::net::SocketAddr::from(([127, 0, 0, 1], admin)),
            dir,
            _process: process,
        }
    }

    async fn decide(&self, descriptors: &[&[(&str, &str)]]) -> u16 {
        http(self.http, "POST", "/json", &body(descriptors)).await.0
    }

    async fn call(
        &self,
        action: &str,
        token: Option<&str>,
        descriptors: &[&[(&str, &str)]],
    ) -> (u16, String) {
        admin_http(
            self.admin,
            &format!("/admin/v1/{action}"),
            token,
            &body(descriptors),
        )
        .await
    }

    async fn inspect(&self, descriptors: &[&[(&str, &str)]]) -> Value {
        let (code, text) = self.call("inspect", Some(TOKEN), descriptors).await;
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).expect("inspect answers JSON")
    }

    async fn reset(&self, descriptors: &[&[(&str, &str)]]) -> Value {
        let (code, text) = self.call("reset", Some(TOKEN), descriptors).await;
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).expect("reset answers JSON")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("log")).unwrap_or_default()
    }

    /// `slidegate admin <action> ...` against this server: (exit code, stdout, stderr).
    fn cli(&self, action: &str, token_file: &Path, descriptors: &[&str]) -> (i32, String, String) {
        let credentials = vec!["--token-file".to_string(), token_file.display().to_string()];
        self.cli_with(action, &credentials, descriptors)
    }

    /// `slidegate admin <action>` with these credential flags.
    fn cli_with(
        &self,
        action: &str,
        credentials: &[String],
        descriptors: &[&str],
    ) -> (i32, String, String) {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"));
        command
            .args(["admin", action, "--addr", &self.admin.to_string()])
            .args(credentials)
            .args(["--domain", "login"]);
        for d in descriptors {
            command.args(["--descriptor", d]);
        }
        let out = command.output().expect("run slidegate admin");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

async fn http_ready(addr: std::net::SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok()
        && http(addr, "GET", "/readyz", "").await.0 == 200
}

fn body(descriptors: &[&[(&str, &str)]]) -> String {
    let descriptors: Vec<Value> = descriptors
        .iter()
        .map(|entries| {
            let entries: Vec<Value> = entries
                .iter()
                .map(|(k, v)| serde_json::json!({"key": k, "value": v}))
                .collect();
            serde_json::json!({ "entries": entries })
        })
        .collect();
    serde_json::json!({"domain": "login", "descriptors": descriptors}).to_string()
}

/// A POST to the admin listener with an optional bearer token: (status, body).
async fn admin_http(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    http_with(addr, "POST", path, token, body).await
}

/// A duration as the API writes it (`41.2s`), in ms.
fn ms(text: &Value) -> u64 {
    let text = text.as_str().expect("a duration");
    let seconds = text.strip_suffix('s').expect("ends in s");
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    let fraction = format!("{fraction:0<3}");
    whole.parse::<u64>().expect("seconds") * 1000 + fraction.parse::<u64>().expect("ms")
}

/// Every slidegate key on these Redis nodes, with its PTTL and content (what an inspection
/// must leave as it was).
fn redis_state(ports: &[u16]) -> Vec<(String, i64, String)> {
    let mut state = Vec::new();
    for &port in ports {
        let keys = redis_cli(port, &["KEYS", "rl:*"]);
        for key in keys.lines().filter(|k| k.starts_with("rl:")) {
            let pttl: i64 = redis_cli(port, &["PTTL", key])
                .trim()
                .parse()
                .expect("a PTTL");
            let dump = redis_cli(port, &["DUMP", key]);
            state.push((key.to_string(), pttl, dump));
        }
    }
    state.sort();
    state
}

/// `redis-cli --raw` on one node: its output.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "--raw"])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const ALICE: &[(&str, &str)] = &[("user", "alice")];
const IP: &[(&str, &str)] = &[("ip", "10.0.0.1")];

/// The whole story on one store; `ports`: the Redis nodes to look at, if any.
async fn story(admin: &Admin, ports: &[u16]) {
    // Two calls of alice, one of her address.
    assert_eq!(admin.decide(&[ALICE, IP]).await, 200);
    assert_eq!(admin.decide(&[ALICE]).await, 200);
    let before = redis_state(ports);
    let found = admin.inspect(&[ALICE, IP, &[("nothing", "here")]]).await;
    let d = &found["descriptors"];
    assert_eq!(d[0]["rule"], "login.user", "{found}");
    let w = &d[0]["windows"][0];
    assert_eq!(
        (
            w["limit"].as_u64(),
            w["used"].as_u64(),
            w["remaining"].as_u64()
        ),
        (Some(3), Some(2), Some(1)),
        "{found}"
    );
    assert_eq!(w["window"], "60s");
    let reset = ms(&w["reset"]);
    assert!(
        (50_000..=60_000).contains(&reset),
        "the first call leaves the window in about a minute: {found}"
    );
    assert_eq!(d[0]["ban"], Value::Null);
    assert_eq!(d[0]["entries"], 2, "{found}");
    assert_eq!(d[1]["rule"], "login.ip");
    assert_eq!(d[1]["windows"][0]["used"], 1);
    assert_eq!(d[1]["entries"], Value::Null, "a counter has no entries");
    assert_eq!(d[2]["rule"], Value::Null);
    assert_eq!(d[2]["windows"], serde_json::json!([]));

    // Inspecting changes nothing: the same answer again, the keys and their TTLs as they were.
    let again = admin.inspect(&[ALICE, IP, &[("nothing", "here")]]).await;
    assert_eq!(again["descriptors"][0]["windows"][0]["used"], 2, "{again}");
    assert_eq!(again["descriptors"][0]["entries"], 2);
    assert_eq!(again["descriptors"][1]["windows"][0]["used"], 1);
    let after = redis_state(ports);
    assert_eq!(before.len(), after.len(), "{before:?} / {after:?}");
    for ((key, ttl_before, dump_before), (key_after, ttl_after, dump_after)) in
        before.iter().zip(&after)
    {
        assert_eq!(key, key_after);
        assert_eq!(dump_before, dump_after, "{key} changed");
        assert!(
            ttl_after <= ttl_before,
            "{key}'s TTL was touched: {ttl_before} then {ttl_after}"
        );
    }
    if !ports.is_empty() {
        assert!(!before.is_empty(), "the decisions wrote keys");
    }

    // Over the limit: banned.
    assert_eq!(admin.decide(&[ALICE]).await, 200);
    assert_eq!(admin.decide(&[ALICE]).await, 429);
    assert_eq!(admin.decide(&[ALICE]).await, 429, "banned");
    let banned = admin.inspect(&[ALICE]).await;
    let ban = ms(&banned["descriptors"][0]["ban"]["remaining"]);
    assert!((20_000..=30_000).contains(&ban), "{banned}");

    // Without the token, or with a wrong one: 401, and nothing changes.
    for token in [None, Some("0123456789abcdef-wrong")] {
        let (code, text) = admin.call("reset", token, &[ALICE]).await;
        assert_eq!(code, 401, "{text}");
        assert_eq!(text.trim(), "unauthorized");
    }
    assert_eq!(admin.decide(&[ALICE]).await, 429, "still banned");

    // Reset: through at once.
    let cleared = admin.reset(&[ALICE, &[("nothing", "here")]]).await;
    assert_eq!(
        cleared["descriptors"][0],
        serde_json::json!({"rule": "login.user", "cleared": true}),
        "{cleared}"
    );
    assert_eq!(
        cleared["descriptors"][1],
        serde_json::json!({"rule": null, "cleared": false})
    );
    assert_eq!(
        admin.decide(&[ALICE]).await,
        200,
        "a reset user is let through at once"
    );
    let fresh = admin.inspect(&[ALICE]).await;
    assert_eq!(fresh["descriptors"][0]["windows"][0]["used"], 1, "{fresh}");
    assert_eq!(fresh["descriptors"][0]["ban"], Value::Null);
    let again = admin.reset(&[IP]).await;
    assert_eq!(again["descriptors"][0]["cleared"], true);
    let nothing = admin.reset(&[IP]).await;
    assert_eq!(
        nothing["descriptors"][0]["cleared"], false,
        "nothing left to clear"
    );

    // Bad input says what was wrong.
    let (code, text) = admin_http(admin.admin, "/admin/v1/inspect", Some(TOKEN), "{not json").await;
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("RateLimitRequest JSON"), "{text}");

    // The admin paths are not on the HTTP port.
    let (code, _) = http(admin.http, "POST", "/admin/v1/reset", &body(&[ALICE])).await;
    assert_eq!(code, 404);

    // The command-line client prints a table, and says what to do about a refused token.
    let (status, out, err) = admin.cli(
        "inspect",
        &admin.dir.0.join("tokens"),
        &["user=alice", "ip=10.0.0.1"],
    );
    assert_eq!(status, 0, "{err}");
    let alice = out
        .lines()
        .find(|l| l.starts_with("user=alice"))
        .unwrap_or_else(|| panic!("{out}"));
    let cells: Vec<&str> = alice.split_whitespace().collect();
    assert_eq!(
        &cells[..5],
        &["user=alice", "login.user", "60s", "1", "3"],
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("ip=10.0.0.1") && l.contains("login.ip")),
        "{out}"
    );
    let wrong = admin.dir.0.join("wrong");
    std::fs::write(&wrong, "0123456789abcdef-wrong\n").unwrap();
    let (status, _, err) = admin.cli("reset", &wrong, &["user=alice"]);
    assert_eq!(status, 1);
    assert!(err.contains("401") && err.contains("--token-file"), "{err}");
    let (status, out, err) = admin.cli("reset", &admin.dir.0.join("tokens"), &["user=alice"]);
    assert_eq!(status, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("user=alice") && l.trim_end().ends_with("true")),
        "{out}"
    );

    // Logged, with who, and counted.
    let log = admin.log();
    assert!(
        log.lines().any(|l| l.contains("admin call")
            && l.contains("who=alice")
            && l.contains("action=\"reset\"")
            && l.contains("result=\"ok\"")),
        "{log}"
    );
    assert!(log.contains("admin call refused"), "{log}");
    let (_, metrics) = http(admin.http, "GET", "/metrics", "").await;
    let count = |labels: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with("slidegate_admin_calls_total{") && l.contains(labels))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        count("action=\"inspect\",result=\"ok\"") >= 5.0,
        "{metrics}"
    );
    assert_eq!(
        count("action=\"reset\",result=\"unauthorized\""),
        3.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_embedded_store() {
    let admin = Admin::start("admin-memory", &[]);
    story(&admin, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_standalone_redis() {
    let redis = RedisProcess::start(&[]);
    let admin = Admin::start("admin-redis", &["--redis".into(), redis.url()]);
    story(&admin, &[redis.port]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_cluster_a_reset_clears_every_slot() {
    let cluster = RedisCluster::start();
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let admin = Admin::start("admin-cluster", &["--redis".into(), cluster.url()]);
    story(&admin, &ports).await;

    // A request over many slots (every user value its own tag): each slot's keys go.
    let users: Vec<String> = (0..12).map(|n| format!("u{n}")).collect();
    let descriptors: Vec<Vec<(&str, &str)>> =
        users.iter().map(|u| vec![("user", u.as_str())]).collect();
    let refs: Vec<&[(&str, &str)]> = descriptors.iter().map(Vec::as_slice).collect();
    assert_eq!(admin.decide(&refs).await, 200);
    let held = |ports: &[u16]| {
        redis_state(ports)
            .into_iter()
            .filter(|(key, _, _)| users.iter().any(|u| key.contains(&format!("user={u}}}"))))
            .count()
    };
    let keys_before = held(&ports);
    let masters_holding = ports
        .iter()
        .filter(|&&p| redis_cli(p, &["KEYS", "rl:{login:user=u*"]).lines().count() > 0)
        .count();
    assert_eq!(
        masters_holding, 3,
        "twelve users spread over the three masters"
    );
    assert!(keys_before >= 12, "{keys_before} keys");
    let cleared = admin.reset(&refs).await;
    let all: Vec<bool> = cleared["descriptors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["cleared"] == true)
        .collect();
    assert_eq!(all, vec![true; 12], "{cleared}");
    let found = admin.inspect(&refs).await;
    for d in found["descriptors"].as_array().unwrap() {
        assert_eq!(d["windows"][0]["used"], 0, "{found}");
    }
    wait_until("keys gone", Duration::from_secs(1), || held(&ports) == 0);
}

/// Mutual TLS alone admits a caller by its client certificate, named in the log; a caller
/// without one, or with one of another CA, gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_by_client_certificate() {
    let dir = temp_dir("admin-mtls");
    make_certs(
        &dir.0,
        &[("server", "IP:127.0.0.1"), ("ops", "DNS:ops.example")],
    );
    let stranger = temp_dir("admin-mtls-stranger");
    make_certs(&stranger.0, &[("ops", "DNS:ops.example")]);
    let file = |d: &TempDir, name: &str| d.0.join(name).display().to_string();
    let flags = vec![
        "--admin-tls-cert".to_string(),
        file(&dir, "server.crt"),
        "--admin-tls-key".into(),
        file(&dir, "server.key"),
        "--admin-tls-client-ca".into(),
        file(&dir, "ca.crt"),
    ];
    let admin = Admin::start_in(temp_dir("admin-mtls-server"), &flags);
    let ops = vec![
        "--tls-ca".to_string(),
        file(&dir, "ca.crt"),
        "--tls-cert".into(),
        file(&dir, "ops.crt"),
        "--tls-key".into(),
        file(&dir, "ops.key"),
    ];
    for _ in 0..4 {
        admin.decide(&[ALICE]).await;
    }
    let (status, out, err) = admin.cli_with("inspect", &ops, &["user=alice"]);
    assert_eq!(status, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("user=alice"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(row.split_whitespace().nth(3) == Some("3"), "{out}");

    // No client certificate, or one another CA signed: refused in the handshake.
    let anonymous = vec!["--tls-ca".to_string(), file(&dir, "ca.crt")];
    let (status, _, err) = admin.cli_with("reset", &anonymous, &["user=alice"]);
    assert_eq!(status, 1, "{err}");
    let foreign = vec![
        "--tls-ca".to_string(),
        file(&dir, "ca.crt"),
        "--tls-cert".into(),
        file(&stranger, "ops.crt"),
        "--tls-key".into(),
        file(&stranger, "ops.key"),
    ];
    let (status, _, err) = admin.cli_with("reset", &foreign, &["user=alice"]);
    assert_eq!(status, 1, "{err}");
    assert_eq!(admin.decide(&[ALICE]).await, 429, "nothing was reset");
    // Plain HTTP is not served there: the TLS listener answers no HTTP status.
    let answer = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(admin.admin).await.unwrap();
        let request = "POST /admin/v1/reset HTTP/1.0\r\nContent-Length: 0\r\n\r\n";
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    };
    assert!(!answer.starts_with("HTTP/"), "{answer}");

    let (status, out, err) = admin.cli_with("reset", &ops, &["user=alice"]);
    assert_eq!(status, 0, "{err}");
    assert!(out.contains("true"), "{out}");
    assert_eq!(admin.decide(&[ALICE]).await, 200);
    let log = admin.log();
    assert!(
        log.lines().any(|l| l.contains("admin call")
            && l.contains("who=ops.example")
            && l.contains("action=\"reset\"")),
        "{log}"
    );
}

/// The admin API without any credential is refused at start, saying which flags give one.
#[test]
fn an_admin_api_without_a_credential_does_not_start() {
    let dir = temp_dir("admin-none");
    std::fs::write(dir.0.join("login.yaml"), CONFIG).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("--config")
        .arg(dir.0.join("login.yaml"))
        .args(["--admin-addr", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--admin-token-file") && err.contains("--admin-tls-client-ca"),
        "{err}"
    );
}
