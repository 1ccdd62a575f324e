//! Operations: metrics with exact values and bounded cardinality, hot reload (in place, rename,
//! ConfigMap symlink swap, broken file, SIGHUP, under concurrent load), health, logs and
//! graceful shutdown.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::redis::{RedisProcess, command, free_port, wait_until};
use common::*;
use slidegate::limiter::LimiterOptions;
use slidegate::store::{MemoryStore, RedisOptions, RedisStore, Store};

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http(addr, "GET", path, "").await
}

/// The value of one sample line (`name{labels} value`) in an exposition.
fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
}

const METRICS_CONFIG: &str = "domain: m
descriptors:
  - key: api
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: login
    rate_limit: {unit: minute, requests_per_unit: 1}
    ban: 1m
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 100}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_known_traffic_exactly() {
    let s = TestServer::start(
        METRICS_CONFIG,
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await;
    for _ in 0..12 {
        s.call(request("m", vec![descriptor(&[("api", "a")])]))
            .await;
    }
    for _ in 0..3 {
        s.call(request("m", vec![descriptor(&[("shadowed", "x")])]))
            .await;
    }
    for _ in 0..3 {
        s.call(request("m", vec![descriptor(&[("login", "bob")])]))
            .await;
    }
    s.call(request("nowhere", vec![descriptor(&[("a", "b")])]))
        .await;
    s.call_err(request("", vec![descriptor(&[("a", "b")])]))
        .await;

    let (code, text) = http_get(s.http_addr, "/metrics").await;
    assert_eq!(code, 200);
    let rule = |stat: &str, key1: &str| {
        sample(
            &text,
            &format!(
                "ratelimit_service_rate_limit_{stat}_total{{domain=\"m\",key1=\"{key1}\",key2=\"\"}}"
            ),
        )
    };
    // api: 10 admitted (all within the limit, those at counts 9..10 also near the 0.8 ratio),
    // 2 over: the reference's meaning (`base_limiter.go`).
    assert_eq!(rule("total_hits", "api"), Some(12.0));
    assert_eq!(rule("within_limit", "api"), Some(10.0));
    assert_eq!(rule("near_limit", "api"), Some(2.0));
    assert_eq!(rule("over_limit", "api"), Some(2.0));
    // shadowed (limit 1, near threshold 0): 1 near, 2 over and let through.
    assert_eq!(rule("near_limit", "shadowed"), Some(1.0));
    assert_eq!(rule("over_limit", "shadowed"), Some(2.0));
    assert_eq!(rule("shadow_mode", "shadowed"), Some(2.0));
    // login: 1 admitted, then over (ban set once), then banned.
    assert_eq!(rule("over_limit", "login"), Some(2.0));
    assert_eq!(rule("bans", "login"), Some(1.0));
    // The second over-limit call of api and the banned call of login were answered by the
    // over-limit cache, without the store (the shadow rule is never cached).
    assert_eq!(rule("over_limit_with_local_cache", "api"), Some(1.0));
    assert_eq!(rule("over_limit_with_local_cache", "login"), Some(1.0));
    assert_eq!(rule("over_limit_with_local_cache", "shadowed"), None);
    assert_eq!(
        sample(&text, "slidegate_requests_total{result=\"ok\"}"),
        Some(15.0)
    );
    assert_eq!(
        sample(&text, "slidegate_requests_total{result=\"over_limit\"}"),
        Some(4.0)
    );
    assert_eq!(
        sample(&text, "slidegate_requests_total{result=\"invalid\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, "ratelimit_service_rate_limit_domain_not_found_total"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            &format!(
                "slidegate_build_info{{version=\"{}\",commit=\"{}\"}}",
                env!("CARGO_PKG_VERSION"),
                slidegate::COMMIT
            )
        ),
        Some(1.0)
    );
    assert_ne!(slidegate::COMMIT, "unknown", "built from a git checkout");
    assert_eq!(
        sample(&text, "slidegate_request_duration_seconds_count"),
        Some(20.0)
    );
    assert_eq!(
        sample(
            &text,
            "slidegate_store_duration_seconds_count{store=\"memory\"}"
        ),
        Some(16.0),
        "18 calls reached the limiter with a rule, 2 answered from the over-limit cache"
    );
    s.stop().await;
}

/// The per-rule counters mean what the reference's mean, case by case from its own tests
/// (`test/redis/fixed_cache_impl_test.go`, `TestNearLimit`, with the near-limit ratio 0.8):
/// a window already holding `before` hits takes a request of `hits`, and the scrape's
/// difference is (total, over, near, within). slidegate records nothing for a rejected
/// request, so a window is at most full: the reference's "27 before, limit 10" is "10 before".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_counters_mean_what_the_references_mean() {
    // (limit, before, hits) -> (total_hits, over_limit, near_limit, within_limit)
    type Case = (u32, u64, u64);
    type Counts = (f64, f64, f64, f64);
    let cases: [(Case, Counts); 6] = [
        ((20, 2, 3), (3.0, 0.0, 0.0, 3.0)),
        ((8, 5, 2), (2.0, 0.0, 1.0, 2.0)),
        ((20, 16, 3), (3.0, 0.0, 3.0, 3.0)),
        ((20, 19, 3), (3.0, 2.0, 1.0, 0.0)),
        ((20, 15, 7), (7.0, 2.0, 4.0, 0.0)),
        ((10, 10, 3), (3.0, 3.0, 0.0, 0.0)),
    ];
    let mut config = String::from("domain: r\ndescriptors:\n");
    for (n, ((limit, _, _), _)) in cases.iter().enumerate() {
        config.push_str(&format!(
            "  - key: case{n}\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
        ));
    }
    let s = TestServer::start(
        &config,
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await;
    let scrape = || async { http_get(s.http_addr, "/metrics").await.1 };
    let counters = |text: &str, n: usize| {
        let stat = |name: &str| {
            sample(
                text,
                &format!(
                    "ratelimit_service_rate_limit_{name}_total{{domain=\"r\",key1=\"case{n}\",key2=\"\"}}"
                ),
            )
            .unwrap_or(0.0)
        };
        (
            stat("total_hits"),
            stat("over_limit"),
            stat("near_limit"),
            stat("within_limit"),
        )
    };
    for (n, ((_, before, hits), expected)) in cases.iter().enumerate() {
        let call = |hits: u64| {
            let mut r = request("r", vec![descriptor(&[(&format!("case{n}"), "v")])]);
            r.hits_addend = u32::try_from(hits).unwrap();
            r
        };
        if *before > 0 {
            assert_eq!(s.call(call(*before)).await.overall_code, ok(), "case {n}");
        }
        let was = counters(&scrape().await, n);
        s.call(call(*hits)).await;
        let now = counters(&scrape().await, n);
        let delta = (now.0 - was.0, now.1 - was.1, now.2 - was.2, now.3 - was.3);
        assert_eq!(
            delta, *expected,
            "case {n}: limit, before, hits {:?}",
            cases[n].0
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_values_do_not_grow_series() {
    let s = TestServer::start(
        METRICS_CONFIG,
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await;
    let series = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("ratelimit_service_rate_limit_"))
            .count()
    };
    s.call(request("m", vec![descriptor(&[("user", "first")])]))
        .await;
    let before = series(&s.metrics.render().1);
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let client = s.client.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..625 {
                let value = format!("u{worker}-{n}");
                client
                    .clone()
                    .should_rate_limit(request("m", vec![descriptor(&[("user", &value)])]))
                    .await
                    .expect("call");
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let text = s.metrics.render().1;
    assert_eq!(
        series(&text),
        before,
        "10,000 distinct values of a plain rule add no series"
    );
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_rate_limit_total_hits_total{domain=\"m\",key1=\"user\",key2=\"\"}"
        ),
        Some(10_001.0)
    );

    // A detailed rule shows values, up to the cap; beyond it hits land on the rule's path.
    let cap = slidegate::metrics::DETAILED_SERIES_CAP;
    for n in 0..cap + 500 {
        s.call(request(
            "m",
            vec![descriptor(&[("tenant", &format!("t{n}"))])],
        ))
        .await;
    }
    let text = s.metrics.render().1;
    let detailed: HashSet<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with(
                "ratelimit_service_rate_limit_total_hits_total{domain=\"m\",key1=\"tenant_",
            )
        })
        .collect();
    assert_eq!(detailed.len(), cap);
    assert_eq!(
        sample(
            &text,
            "ratelimit_service_rate_limit_total_hits_total{domain=\"m\",key1=\"tenant\",key2=\"\"}"
        ),
        Some(500.0)
    );
    s.stop().await;
}

fn limits(name1: &str, name2: &str) -> String {
    format!(
        "domain: r\ndescriptors:\n  - key: k1\n    rate_limit: {{unit: minute, requests_per_unit: 1000000, name: {name1}}}\n  - key: k2\n    rate_limit: {{unit: minute, requests_per_unit: 1000000, name: {name2}}}\n"
    )
}

/// Starts a server on the config at `path` and a watcher on it.
async fn watched(path: &Path) -> (TestServer, slidegate::config::watch::ConfigWatch) {
    let loaded = slidegate::config::load_path(path).expect("initial config");
    let text = std::fs::read_to_string(loaded.files.first().expect("a file")).expect("read");
    let s = TestServer::start(
        &text,
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await;
    let watch = slidegate::config::watch::spawn(
        path.to_path_buf(),
        slidegate::config::LoadOptions::default(),
        s.limiter.clone(),
        s.metrics.clone(),
        loaded.fingerprint,
        Duration::from_millis(20),
        true,
    )
    .expect("watch");
    (s, watch)
}

async fn names(s: &TestServer) -> (String, String) {
    let r = s
        .call(request(
            "r",
            vec![descriptor(&[("k1", "x")]), descriptor(&[("k2", "x")])],
        ))
        .await;
    let name = |i: usize| {
        r.statuses[i]
            .current_limit
            .as_ref()
            .map(|l| l.name.clone())
            .unwrap_or_default()
    };
    (name(0), name(1))
}

async fn wait_for_names(s: &TestServer, expected: (&str, &str)) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = names(s).await;
        if now == (expected.0.to_string(), expected.1.to_string()) {
            return;
        }
        assert!(
            Instant::now() < end,
            "config never switched to {expected:?}; still {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn counter(s: &TestServer, name: &str) -> f64 {
    sample(&s.metrics.render().1, name).unwrap_or(0.0)
}

/// A directory holding `limits.yaml` with the rules named a1 and a2, served and watched.
async fn watched_limits(
    name: &str,
) -> (
    TempDir,
    std::path::PathBuf,
    TestServer,
    slidegate::config::watch::ConfigWatch,
) {
    let dir = temp_dir(name);
    let file = dir.0.join("limits.yaml");
    std::fs::write(&file, limits("a1", "a2")).expect("write");
    let (s, watch) = watched(&dir.0).await;
    assert_eq!(names(&s).await, ("a1".into(), "a2".into()));
    (dir, file, s, watch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_in_place_by_rename_and_broken() {
    let (dir, file, s, _watch) = watched_limits("reload").await;

    std::fs::write(&file, limits("b1", "b2")).expect("rewrite in place");
    wait_for_names(&s, ("b1", "b2")).await;

    let tmp = dir.0.join(".limits.yaml.swp");
    std::fs::write(&tmp, limits("c1", "c2")).expect("write temp");
    std::fs::rename(&tmp, &file).expect("rename over");
    wait_for_names(&s, ("c1", "c2")).await;
    let successes = counter(&s, "ratelimit_service_config_load_success_total");
    assert!(successes >= 2.0, "{successes}");

    std::fs::write(
        &file,
        "domain: r\ndescriptors:\n  - key: k1\n    rate_limit: {unit: fortnight}\n",
    )
    .expect("break");
    wait_until(
        "the broken config is counted",
        Duration::from_secs(10),
        || counter(&s, "ratelimit_service_config_load_error_total") >= 1.0,
    );
    assert_eq!(
        names(&s).await,
        ("c1".into(), "c2".into()),
        "the old config keeps serving"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_on_configmap_symlink_swap() {
    let dir = temp_dir("configmap");
    let root = &dir.0;
    let version = |n: u32, text: String| {
        let v = root.join(format!("..2026_11_30_v{n}"));
        std::fs::create_dir_all(&v).expect("mkdir");
        std::fs::write(v.join("limits.yaml"), text).expect("write");
        format!("..2026_11_30_v{n}")
    };
    let v1 = version(1, limits("v1a", "v1b"));
    std::os::unix::fs::symlink(&v1, root.join("..data")).expect("..data");
    std::os::unix::fs::symlink("..data/limits.yaml", root.join("limits.yaml")).expect("link");
    let (s, _watch) = watched(root).await;
    assert_eq!(names(&s).await, ("v1a".into(), "v1b".into()));

    // What the kubelet does: a new version folder, a temporary link, renamed over ..data.
    let v2 = version(2, limits("v2a", "v2b"));
    std::os::unix::fs::symlink(&v2, root.join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap");
    std::fs::remove_dir_all(root.join(&v1)).expect("remove old version");
    wait_for_names(&s, ("v2a", "v2b")).await;
    s.stop().await;
}

/// A file beside the config that changes all the time (a log written into the same directory)
/// does not hold a reload back: the change is applied while the other file keeps changing,
/// a few debounces after it (the directory is never quiet for one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_while_a_file_beside_the_config_keeps_changing() {
    let (dir, file, s, _watch) = watched_limits("noisy").await;

    // Appends a line every 5 ms, well inside the watcher's 20 ms debounce.
    let stop = Arc::new(AtomicBool::new(false));
    let noise = {
        let (stop, log) = (stop.clone(), dir.0.join("noise.log"));
        std::thread::spawn(move || {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&log).expect("noise.log");
            while !stop.load(Ordering::Relaxed) {
                writeln!(f, "a line of noise").expect("append");
                f.flush().expect("flush");
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let noise_len = || std::fs::metadata(dir.0.join("noise.log")).map_or(0, |m| m.len());
    // Give the noise a head start, so that the change lands in the middle of it.
    wait_until("the noise has begun", Duration::from_secs(5), || {
        noise_len() > 100
    });
    std::fs::write(&file, limits("b1", "b2")).expect("rewrite in place");
    let at_change = noise_len();
    wait_for_names(&s, ("b1", "b2")).await;
    assert!(
        noise_len() > at_change && !noise.is_finished(),
        "the noise went on while the change was waiting to be applied"
    );
    stop.store(true, Ordering::Relaxed);
    noise.join().expect("noise thread");
    s.stop().await;
}

/// A config that breaks or empties never fails open: a dangling link or a link loop is a load
/// error (the old rules keep serving, `check` fails), an emptied directory is refused, and a
/// directory replaced as a whole is watched again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_or_emptied_configs_keep_the_old_rules() {
    let parent = temp_dir("broken");
    let dir = parent.0.join("limits");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("limits.yaml"), limits("b1", "b2")).expect("write");
    let (s, _watch) = watched(&dir).await;
    assert_eq!(names(&s).await, ("b1".into(), "b2".into()));
    let errors_before = config_errors(&s);
    let wait_for_errors = |n: f64| {
        let end = Instant::now() + Duration::from_secs(10);
        let s = &s;
        async move {
            while config_errors(s) < n {
                assert!(Instant::now() < end, "the broken config was not rejected");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // A dangling link, then a loop: rejected, the old rules stay.
    std::os::unix::fs::symlink(dir.join("gone.yaml"), dir.join("extra.yaml")).expect("link");
    wait_for_errors(errors_before + 1.0).await;
    assert_eq!(names(&s).await, ("b1".into(), "b2".into()));
    let check = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("check")
        .arg(&dir)
        .output()
        .expect("check");
    assert!(!check.status.success(), "check fails on a dangling link");
    assert!(String::from_utf8_lossy(&check.stderr).contains("extra.yaml: cannot read"));
    std::fs::remove_file(dir.join("extra.yaml")).expect("unlink");
    std::os::unix::fs::symlink(dir.join("loop.yaml"), dir.join("loop.yaml")).expect("loop");
    wait_for_errors(errors_before + 2.0).await;
    std::fs::remove_file(dir.join("loop.yaml")).expect("unlink");

    // Emptied by mistake: refused, every limit stays.
    std::fs::remove_file(dir.join("limits.yaml")).expect("empty the directory");
    wait_for_errors(errors_before + 3.0).await;
    assert_eq!(names(&s).await, ("b1".into(), "b2".into()));

    // The directory replaced as a whole (a new one renamed over it): watched again.
    let fresh = parent.0.join("fresh");
    std::fs::create_dir_all(&fresh).expect("mkdir");
    std::fs::write(fresh.join("limits.yaml"), limits("n1", "n2")).expect("write");
    std::fs::remove_dir(&dir).expect("remove the emptied directory");
    std::fs::rename(&fresh, &dir).expect("replace the directory");
    wait_for_names(&s, ("n1", "n2")).await;
    std::fs::write(dir.join("limits.yaml"), limits("m1", "m2")).expect("edit in the new one");
    wait_for_names(&s, ("m1", "m2")).await;
    s.stop().await;
}

fn config_errors(s: &TestServer) -> f64 {
    sample(
        &s.metrics.render().1,
        "ratelimit_service_config_load_error_total",
    )
    .unwrap_or(0.0)
}

/// Started before its Redis: slidegate serves (alive, not ready, calls answered by the failure
/// policy) and connects once Redis appears, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_redis_and_connects_when_it_appears() {
    starts_before_redis(&[]).await;
}

async fn starts_before_redis(extra: &[&str]) {
    let dir = temp_dir("before-redis");
    std::fs::write(dir.0.join("limits.yaml"), limits("e1", "e2")).expect("write");
    let redis_port = free_port();
    let redis_url = format!("redis://127.0.0.1:{redis_port}");
    let (grpc, http, _child) = spawn_slidegate(
        &dir.0,
        &[
            "--redis",
            &redis_url,
            "--redis-connect-timeout",
            "300ms",
            "--redis-timeout",
            "200ms",
        ]
        .iter()
        .chain(extra)
        .copied()
        .collect::<Vec<_>>(),
    );
    let started = Instant::now();
    wait_until("alive", Duration::from_secs(20), || {
        command(http, "GET /healthz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    eprintln!("alive {:?} after the start", started.elapsed());
    assert!(
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains(" 503 ")),
        "not ready without Redis"
    );
    let client = connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let call = || {
        let mut client = client.clone();
        async move {
            client
                .should_rate_limit(request("r", vec![descriptor(&[("k1", "x")])]))
                .await
        }
    };
    let status = call().await.expect_err("no store yet");
    assert_eq!(status.code(), tonic::Code::Unavailable);

    let _redis = RedisProcess::start_on(redis_port);
    let appeared = Instant::now();
    wait_until("ready once Redis is up", Duration::from_secs(10), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(reply) = call().await {
            assert_eq!(reply.into_inner().overall_code, ok());
            break;
        }
        assert!(Instant::now() < end, "calls never resumed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("resumed {:?} after Redis appeared", appeared.elapsed());
}

/// The embedded store's size is a metric: three descriptors with state, three keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_size_is_scraped() {
    let s = TestServer::start(
        &limits("s1", "s2"),
        Arc::new(MemoryStore::new()),
        LimiterOptions::default(),
    )
    .await;
    for value in ["a", "b", "c"] {
        s.call(request("r", vec![descriptor(&[("k1", value)])]))
            .await;
    }
    let (code, text) = http(s.http_addr, "GET", "/metrics", "").await;
    assert_eq!(code, 200);
    assert_eq!(sample(&text, "slidegate_store_keys"), Some(3.0), "{text}");
    s.stop().await;
}

/// Starts the binary on the example config with `extra` flags; (gRPC port, HTTP port, child).
fn start_binary(extra: &[&str]) -> (u16, u16, KillOnDrop) {
    let example = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.yaml"));
    let (grpc, http, child) = spawn_slidegate(example, extra);
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    (grpc, http, child)
}

/// Threads of process `pid` named as tokio names its workers.
fn worker_threads(pid: u32) -> usize {
    threads_named(pid, "tokio-rt-worker")
}

/// `--worker-threads` sets how many threads serve calls (one per CPU without it); zero is
/// refused with a message that names the flag.
#[test]
fn worker_threads_are_as_many_as_asked() {
    for asked in [1, 3] {
        let (_, _, child) = start_binary(&["--worker-threads", &asked.to_string()]);
        assert_eq!(
            worker_threads(child.0.id()),
            asked,
            "--worker-threads {asked}"
        );
    }
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let (_, _, child) = start_binary(&[]);
    assert_eq!(worker_threads(child.0.id()), cpus, "one per CPU by default");
    let refused = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .args(["--worker-threads", "0"])
        .output()
        .expect("run slidegate");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("--worker-threads"), "{stderr}");
}

/// Whether the server has closed `stream` (a read ends or fails, rather than waiting).
fn closed_by_server(stream: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    let _ = stream.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// Connections that send half a request, or only the HTTP/2 preface, are closed once idle;
/// a client that keeps using its connection is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_are_closed() {
    use std::io::Write;
    let (grpc, http, _child) = start_binary(&["--idle-timeout", "1s"]);
    let mut held = Vec::new();
    for n in 0..100 {
        let (port, bytes): (u16, &[u8]) = if n % 2 == 0 {
            (http, b"GET /healthz HTTP/1.1\r\nHo")
        } else {
            (grpc, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        };
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.write_all(bytes).expect("send");
        held.push(stream);
    }
    let end = Instant::now() + Duration::from_secs(15);
    while !held.is_empty() {
        held.retain_mut(|s| !closed_by_server(s));
        assert!(
            Instant::now() < end,
            "{} connections still open",
            held.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A client that talks keeps being answered across several idle timeouts.
    let client = connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    for _ in 0..3 {
        let reply = client
            .clone()
            .should_rate_limit(request(
                "example",
                vec![descriptor(&[("remote_address", "x")])],
            ))
            .await
            .expect("answered");
        assert_eq!(reply.into_inner().overall_code, ok());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
}

/// With `--max-connections`, a connection past the cap waits until one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait() {
    use std::io::{Read, Write};
    let (_grpc, http, _child) = start_binary(&["--max-connections", "4", "--idle-timeout", "30s"]);
    // The readiness probes above have closed; hold four connections open.
    let mut held: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", http)).expect("connect"))
        .collect();
    let mut fifth = std::net::TcpStream::connect(("127.0.0.1", http)).expect("connect");
    fifth
        .write_all(b"GET /healthz HTTP/1.0\r\n\r\n")
        .expect("send");
    fifth
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    assert!(fifth.read(&mut buf).is_err(), "served past the cap");
    held.pop();
    fifth
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let n = fifth.read(&mut buf).expect("served once one closed");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200"));
}

/// 50 reloads while callers keep asking with two descriptors: every answer comes from one
/// config, never half of each, and never from no config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_never_see_a_mixed_config() {
    let dir = temp_dir("mixed");
    let file = dir.0.join("limits.yaml");
    std::fs::write(&file, limits("g0", "g0")).expect("write");
    let (s, _watch) = watched(&dir.0).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for _ in 0..4 {
        let client = s.client.clone();
        let stop = stop.clone();
        callers.push(tokio::spawn(async move {
            let mut seen = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let r = client
                    .clone()
                    .should_rate_limit(request(
                        "r",
                        vec![descriptor(&[("k1", "x")]), descriptor(&[("k2", "x")])],
                    ))
                    .await
                    .expect("call")
                    .into_inner();
                let name = |i: usize| r.statuses[i].current_limit.as_ref().map(|l| l.name.clone());
                let (a, b) = (name(0), name(1));
                assert!(
                    a.is_some() && a == b,
                    "mixed or missing config: {a:?} / {b:?}"
                );
                seen += 1;
            }
            seen
        }));
    }
    for generation in 1..=50 {
        let start = counter(&s, "ratelimit_service_config_load_success_total");
        let name = format!("g{generation}");
        std::fs::write(&file, limits(&name, &name)).expect("rewrite");
        wait_until("reload applied", Duration::from_secs(10), || {
            counter(&s, "ratelimit_service_config_load_success_total") > start
        });
    }
    stop.store(true, Ordering::SeqCst);
    let mut total = 0;
    for c in callers {
        total += c.await.expect("caller kept consistent answers");
    }
    assert!(total > 50, "callers ran during the reloads ({total} calls)");
    wait_for_names(&s, ("g50", "g50")).await;
    s.stop().await;
}

/// The binary: SIGHUP reloads with file watching off; `/config` and `slidegate check` list the
/// rules; debug logs carry one span per call, in JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_config_listing_and_debug_logs() {
    let dir = temp_dir("sighup");
    let file = dir.0.join("limits.yaml");
    std::fs::write(&file, limits("h1", "h2")).expect("write");
    let log = dir.0.join("stderr.log");
    let (grpc, http) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("--config")
        .arg(&dir.0)
        .args([
            "--no-watch",
            "--log-format",
            "json",
            "--log-level",
            "slidegate=debug",
        ])
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--http-addr",
            &format!("127.0.0.1:{http}"),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start slidegate");
    let child = KillOnDrop(child);
    let http_addr = std::net::SocketAddr::from(([127, 0, 0, 1], http));
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let (_, listing) = http_get(http_addr, "/config").await;
    assert!(listing.contains("r.k1: 1000000/1m (h1) ("), "{listing}");
    assert_eq!(listing.lines().count(), 2, "{listing}");

    std::fs::write(&file, limits("h3", "h4")).expect("rewrite");
    let (_, unchanged) = http_get(http_addr, "/config").await;
    assert!(
        unchanged.contains("(h1)"),
        "--no-watch: nothing changes before SIGHUP"
    );
    signal(&child.0, "HUP");
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, listing) = http_get(http_addr, "/config").await;
        if listing.contains("(h3)") {
            break;
        }
        assert!(Instant::now() < end, "SIGHUP did not reload: {listing}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let client = connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    client
        .clone()
        .should_rate_limit(request("r", vec![descriptor(&[("k1", "x")])]))
        .await
        .expect("call");
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        let span_line = logged.lines().find(|l| l.contains("\"decided\""));
        if let Some(line) = span_line {
            let json: serde_json::Value = serde_json::from_str(line).expect("JSON log line");
            let span = &json["span"];
            assert_eq!(span["name"], "should_rate_limit", "{line}");
            assert_eq!(span["domain"], "r");
            assert_eq!(span["descriptors"], 1);
            assert_eq!(span["decision"], "Ok");
            assert!(span["latency_us"].is_u64(), "{line}");
            break;
        }
        assert!(Instant::now() < end, "no debug span logged:\n{logged}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let check = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("check")
        .arg("--config")
        .arg(&dir.0)
        .output()
        .expect("check");
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(
        out.contains("r.k1: 1000000/1m (h3)") && out.contains("r.k2: 1000000/1m (h4)"),
        "{out}"
    );
}

/// SIGTERM: readiness and gRPC health turn off first, the call in flight (held up by a sleeping
/// Redis) still completes, and the process exits 0 within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_calls() {
    let redis = RedisProcess::start(&["--enable-debug-command", "yes"]);
    let dir = temp_dir("shutdown");
    std::fs::write(dir.0.join("limits.yaml"), limits("s1", "s2")).expect("write");
    let (grpc, http) = (free_port(), free_port());
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .arg("--config")
            .arg(&dir.0)
            .args(["--redis", &redis.url(), "--redis-timeout", "10s"])
            .args(["--shutdown-delay", "1s", "--shutdown-grace", "10s"])
            .args([
                "--grpc-addr",
                &format!("127.0.0.1:{grpc}"),
                "--http-addr",
                &format!("127.0.0.1:{http}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let client = connect(std::net::SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    client
        .clone()
        .should_rate_limit(request("r", vec![descriptor(&[("k1", "warm")])]))
        .await
        .expect("warm-up call");

    // Put Redis to sleep, and make sure it is asleep: a PING then gets no answer.
    let port = redis.port;
    let sleeper = std::thread::spawn(move || command(port, "DEBUG SLEEP 3"));
    wait_until("Redis asleep", Duration::from_secs(10), || {
        let mut s = match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => s,
            Err(_) => return false,
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
        let _ = std::io::Write::write_all(&mut s, b"PING\r\n");
        let mut buf = [0u8; 16];
        std::io::Read::read(&mut s, &mut buf).is_err()
    });
    let in_flight = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .clone()
                .should_rate_limit(request("r", vec![descriptor(&[("k1", "x")])]))
                .await
        }
    });
    signal(&child.0, "TERM");
    let http_addr = std::net::SocketAddr::from(([127, 0, 0, 1], http));
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        if http_get(http_addr, "/readyz").await.0 == 503 {
            break;
        }
        assert!(Instant::now() < end, "readiness never turned off");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !in_flight.is_finished(),
        "the call is still waiting on Redis while readiness is off"
    );
    let answer = in_flight
        .await
        .expect("task")
        .expect("the in-flight call completed");
    assert_eq!(answer.into_inner().overall_code, ok());
    let _ = sleeper.join();
    let end = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < end,
            "slidegate did not exit within the grace period"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
}

/// gRPC health follows the store: NOT_SERVING while Redis is down, SERVING again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_store() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let mut redis = RedisProcess::start(&[]);
    let store: Arc<dyn Store> = Arc::new(
        RedisStore::connect(RedisOptions {
            pool_size: 1,
            timeout: Duration::from_millis(200),
            queue_timeout: Duration::from_secs(1),
            ..redis_options(redis.url())
        })
        .await
        .expect("connect"),
    );
    let s = TestServer::start(&limits("x", "y"), store, LimiterOptions::default()).await;
    let channel = channel(s.grpc_addr).await;
    let mut health = HealthClient::new(channel);
    let mut status_is = async |want: ServingStatus| {
        let end = Instant::now() + Duration::from_secs(15);
        loop {
            let got = health
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map(|r| r.into_inner().status);
            if got.as_ref().is_ok_and(|s| *s == want as i32) {
                return;
            }
            assert!(
                Instant::now() < end,
                "health never became {want:?} (last {got:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    status_is(ServingStatus::Serving).await;
    assert_eq!(http_get(s.http_addr, "/readyz").await.0, 200);
    redis.stop();
    status_is(ServingStatus::NotServing).await;
    assert_eq!(http_get(s.http_addr, "/readyz").await.0, 503);
    redis.restart();
    status_is(ServingStatus::Serving).await;
    s.stop().await;
}

/// Runs the binary with `args` until it exits, at most `within`: whether it succeeded, and its
/// stderr and stdout. A run that does not end in time fails the test (it would hang a real
/// start).
fn run_within(args: &[&std::ffi::OsStr], within: Duration) -> (bool, String, String) {
    let out = temp_dir("run-within");
    let stdout = std::fs::File::create(out.0.join("stdout")).expect("stdout file");
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .args(args)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("run slidegate"),
    );
    let end = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < end,
            "slidegate {args:?} did not end within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.0.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("stderr");
    }
    let stdout = std::fs::read_to_string(out.0.join("stdout")).expect("stdout");
    (status.success(), stderr, stdout)
}

/// The arguments that serve `config` on free loopback ports, and the HTTP port.
fn serve_args(config: &Path) -> (u16, Vec<std::ffi::OsString>) {
    let (grpc, http) = (free_port(), free_port());
    let args = [
        "--config".into(),
        config.as_os_str().to_owned(),
        "--grpc-addr".into(),
        format!("127.0.0.1:{grpc}").into(),
        "--http-addr".into(),
        format!("127.0.0.1:{http}").into(),
    ];
    (http, args.into())
}

fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(made.success(), "mkfifo {}", path.display());
}

/// A FIFO named `*.yaml` (in a directory, or as the config itself) is an error named for what
/// it is, without being opened: `check` and the server's start end at once, and on hot reload
/// it is rejected while a later change to a real file is still applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_the_config_is_an_error_not_a_hang() {
    let dir = temp_dir("fifo");
    std::fs::write(dir.0.join("b.yaml"), limits("f1", "f2")).expect("write");
    mkfifo(&dir.0.join("a.yaml"));
    let within = Duration::from_secs(20);
    let (ok, stderr, _) = run_within(&["check".as_ref(), dir.0.as_os_str()], within);
    assert!(!ok, "check passed a FIFO");
    assert!(
        stderr.contains("a.yaml") && stderr.contains("is a FIFO, not read"),
        "{stderr}"
    );
    let alone = dir.0.join("a.yaml");
    let (ok, stderr, _) = run_within(&["check".as_ref(), alone.as_os_str()], within);
    assert!(!ok && stderr.contains("is a FIFO, not read"), "{stderr}");
    let (_, serve) = serve_args(&dir.0);
    let serve: Vec<&std::ffi::OsStr> = serve.iter().map(AsRef::as_ref).collect();
    let (ok, stderr, _) = run_within(&serve, within);
    assert!(!ok && stderr.contains("is a FIFO, not read"), "{stderr}");

    // Hot reload: the FIFO arrives after the start; rejected, and the watcher goes on.
    let live = temp_dir("fifo-reload");
    std::fs::write(live.0.join("b.yaml"), limits("r1", "r2")).expect("write");
    let (s, _watch) = watched(&live.0).await;
    let errors = config_errors(&s);
    mkfifo(&live.0.join("a.yaml"));
    let end = Instant::now() + Duration::from_secs(10);
    while config_errors(&s) < errors + 1.0 {
        assert!(Instant::now() < end, "the FIFO was not rejected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::remove_file(live.0.join("a.yaml")).expect("remove the FIFO");
    std::fs::write(live.0.join("b.yaml"), limits("r3", "r4")).expect("edit");
    wait_for_names(&s, ("r3", "r4")).await;
    s.stop().await;
}

/// A config that defines no domain is refused at start (it would limit nothing and report
/// ready) and by `check`, with a message naming the flag that starts anyway; with the
/// reference's `FORCE_START_WITHOUT_INITIAL_CONFIG=true` the server starts and is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_config_is_refused_unless_forced() {
    let dir = temp_dir("empty-config");
    let within = Duration::from_secs(20);
    let (ok, stderr, _) = run_within(&["check".as_ref(), dir.0.as_os_str()], within);
    assert!(!ok, "check passed an empty directory");
    assert!(stderr.contains("no domain defined"), "{stderr}");
    let (http, serve) = serve_args(&dir.0);
    let serve: Vec<&std::ffi::OsStr> = serve.iter().map(AsRef::as_ref).collect();
    let (ok, stderr, _) = run_within(&serve, within);
    assert!(!ok, "started on an empty config");
    assert!(
        stderr.contains("no domain defined")
            && stderr.contains("--force-start-without-initial-config")
            && stderr.contains("FORCE_START_WITHOUT_INITIAL_CONFIG=true"),
        "{stderr}"
    );
    let _forced = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .args(&serve)
            .env("FORCE_START_WITHOUT_INITIAL_CONFIG", "true")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    wait_until("the forced start ready", within, || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
}

/// One file of 100,000 rules loads: the parser's limits grow with the file.
#[test]
fn a_file_of_100000_rules_loads() {
    let dir = temp_dir("many-rules");
    let mut text = String::from("domain: many\ndescriptors:\n");
    for i in 0..100_000 {
        text.push_str(&format!(
            "  - key: k\n    value: v{i}\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n"
        ));
    }
    let file = dir.0.join("many.yaml");
    std::fs::write(&file, text).expect("write");
    let (ok, stderr, stdout) = run_within(
        &["check".as_ref(), file.as_os_str()],
        Duration::from_secs(120),
    );
    assert!(ok, "{stderr}");
    assert!(stdout.contains("1 file(s), 100000 rule(s), OK"), "{stderr}");
}
