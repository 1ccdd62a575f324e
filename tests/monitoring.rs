//! The monitoring bundle (`deploy/monitoring/`) against the real thing: Debian's Prometheus
//! scrapes a running slidegate under a little load, with the bundle's alert rules loaded;
//! every dashboard panel's query and every alert's expression (without its threshold) is
//! evaluated through Prometheus's HTTP API and must return series; `promtool` checks the rules
//! and runs their unit tests; the monitors select what `deploy/kubernetes/` deploys.
// Tests may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::{command, free_port, wait_until};
use common::{KillOnDrop, descriptor, request, temp_dir};
use serde_json::Value;

const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

fn yaml(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(format!("{MANIFEST}/{file}")).expect(file);
    serde_saphyr::from_multiple(&text).expect("YAML")
}

fn tool(name: &str) -> &'static str {
    let path = match name {
        "prometheus" => "/usr/bin/prometheus",
        _ => "/usr/bin/promtool",
    };
    assert!(
        Path::new(path).exists(),
        "no {path}: run tests/run.sh, which installs Debian's prometheus package"
    );
    path
}

/// The PrometheusRule's spec as a rules file (JSON is YAML) in `dir`.
fn rules_file(dir: &Path) -> std::path::PathBuf {
    let rule = yaml("deploy/monitoring/prometheusrule.yaml").remove(0);
    assert_eq!(rule["kind"], "PrometheusRule");
    let path = dir.join("slidegate-rules.yaml");
    std::fs::write(&path, serde_json::to_string_pretty(&rule["spec"]).unwrap()).unwrap();
    path
}

/// Every alert of the bundle: (name, expression).
fn alerts() -> Vec<(String, String)> {
    let rule = yaml("deploy/monitoring/prometheusrule.yaml").remove(0);
    rule["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .map(|r| {
            (
                r["alert"].as_str().expect("alert").to_string(),
                r["expr"].as_str().expect("expr").to_string(),
            )
        })
        .collect()
}

fn succeeded(run: &std::process::Output) {
    assert!(
        run.status.success(),
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

#[test]
fn promtool_checks_the_rules_and_runs_a_test_per_alert() {
    let dir = temp_dir("promtool");
    let rules = rules_file(&dir.0);
    let check = Command::new(tool("promtool"))
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .expect("promtool");
    succeeded(&check);
    let tests = std::fs::read_to_string(format!("{MANIFEST}/deploy/monitoring/alerts-test.yaml"))
        .expect("alerts-test.yaml");
    for (alert, _) in alerts() {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "no promtool test for {alert}"
        );
    }
    std::fs::write(dir.0.join("alerts-test.yaml"), &tests).unwrap();
    let test = Command::new(tool("promtool"))
        .args(["test", "rules", "alerts-test.yaml"])
        .current_dir(&dir.0)
        .output()
        .expect("promtool");
    succeeded(&test);
}

#[test]
fn the_monitors_select_what_deploy_kubernetes_deploys() {
    let service_monitor = yaml("deploy/monitoring/servicemonitor.yaml").remove(0);
    let shared = yaml("deploy/kubernetes/shared.yaml");
    let service = shared
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("Service");
    for (k, v) in service_monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(&service["metadata"]["labels"][k], v, "{k}");
    }
    let port = &service_monitor["spec"]["endpoints"][0]["port"];
    assert!(
        service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == *port),
        "the Service has no port {port}"
    );
    let pod_monitor = yaml("deploy/monitoring/podmonitor.yaml").remove(0);
    let sidecar = yaml("deploy/kubernetes/sidecar.yaml");
    let pod = &sidecar
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("Deployment")["spec"]["template"];
    for (k, v) in pod_monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(&pod["metadata"]["labels"][k], v, "{k}");
    }
    let port = &pod_monitor["spec"]["podMetricsEndpoints"][0]["port"];
    let slidegate = pod["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == "slidegate")
        .expect("slidegate container");
    assert!(
        slidegate["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == *port),
        "the sidecar has no port {port}"
    );
}

/// `query` percent-encoded for a URL.
fn encoded(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus's answer to an instant query.
fn query(port: u16, promql: &str) -> Value {
    let reply = command(
        port,
        &format!("GET /api/v1/query?query={} HTTP/1.0\r\n", encoded(promql)),
    )
    .expect("query Prometheus");
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{promql}: {e}: {reply}"))
}

fn series(answer: &Value) -> usize {
    answer["data"]["result"].as_array().map_or(0, Vec::len)
}

/// An alert's expression without its threshold: what it compares, which must have series.
fn compared(expr: &str) -> &str {
    [" > ", " == ", " < "]
        .iter()
        .filter_map(|op| expr.rfind(op))
        .max()
        .map_or(expr, |at| &expr[..at])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_every_panel_and_alert_on_a_live_slidegate() {
    let dir = temp_dir("monitoring");
    let limits = dir.0.join("limits");
    std::fs::create_dir_all(&limits).unwrap();
    std::fs::write(
        limits.join("limits.yaml"),
        "domain: mon\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .unwrap();
    let (grpc, http) = (free_port(), free_port());
    let _slidegate = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .arg("--config")
            .arg(&limits)
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--http-addr", &format!("127.0.0.1:{http}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    wait_until("slidegate ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });

    let rules = rules_file(&dir.0);
    let prom = free_port();
    let config = dir.0.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{}]\nscrape_configs:\n  - job_name: slidegate\n    static_configs: [{{targets: [\"127.0.0.1:{http}\"]}}]\n",
            rules.display()
        ),
    )
    .unwrap();
    let _prometheus = KillOnDrop(
        Command::new(tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus"),
    );
    wait_until("Prometheus ready", Duration::from_secs(30), || {
        command(prom, "GET /-/ready HTTP/1.0\r\n").is_ok_and(|r| r.contains(" 200 "))
    });

    // A little load for some seconds of scrapes: most calls over the limit (answered from the
    // over-limit cache after the first refusal), and one config reload.
    let client = common::connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let started = Instant::now();
    let mut reloaded = false;
    loop {
        for user in ["a", "b", "c"] {
            let mut caller = client.clone();
            let call = request("mon", vec![descriptor(&[("k", user)])]);
            caller.should_rate_limit(call).await.expect("a call");
        }
        if !reloaded && started.elapsed() > Duration::from_secs(2) {
            std::fs::write(
                limits.join("limits.yaml"),
                "domain: mon\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
            )
            .unwrap();
            reloaded = true;
        }
        let scraped = series(&query(prom, "count_over_time(slidegate_ready[1m]) >= 6"));
        if scraped > 0 && started.elapsed() > Duration::from_secs(6) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "Prometheus did not scrape slidegate six times"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{MANIFEST}/deploy/monitoring/grafana-dashboard.json"
        ))
        .expect("dashboard"),
    )
    .expect("the dashboard is JSON");
    let mut empty = Vec::new();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            // Grafana's variables as a short dashboard range would give them.
            let promql = expr
                .replace("$__rate_interval", "10s")
                .replace("$__range", "1m");
            let answer = query(prom, &promql);
            assert_eq!(answer["status"], "success", "{promql}: {answer}");
            queries += 1;
            if series(&answer) == 0 {
                empty.push(format!("{}: {promql}", panel["title"]));
            }
        }
    }
    for (alert, expr) in alerts() {
        let promql = compared(&expr);
        let answer = query(prom, promql);
        assert_eq!(answer["status"], "success", "{alert}: {answer}");
        queries += 1;
        if series(&answer) == 0 {
            empty.push(format!("{alert}: {promql}"));
        }
    }
    assert!(empty.is_empty(), "queries without series: {empty:#?}");
    assert!(queries >= 20, "{queries} queries");
    // Prometheus loaded every rule and evaluates it without error.
    let prom_addr = std::net::SocketAddr::from(([127, 0, 0, 1], prom));
    let (code, reply) = common::http(prom_addr, "GET", "/api/v1/rules", "").await;
    assert_eq!(code, 200, "{reply}");
    let body: Value =
        serde_json::from_str(reply.split("\r\n\r\n").nth(1).unwrap_or(&reply)).expect("JSON");
    let loaded: Vec<&Value> = body["data"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(loaded.len(), alerts().len());
    assert!(loaded.iter().all(|r| r["health"] == "ok"), "{loaded:#?}");
}

#[test]
fn an_alert_is_split_at_its_threshold() {
    assert_eq!(compared("up{job=\"x\"} == 0"), "up{job=\"x\"}");
    assert_eq!(
        compared("(a or vector(0)) / b > 0.5"),
        "(a or vector(0)) / b"
    );
    assert_eq!(compared("a"), "a");
}
