//! `--thread-per-core`: connections spread over the cells, TLS handshakes inside them, each
//! cell's decisions made on its own thread with its own Redis client, and never more admitted
//! than the limit across cells.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::redis::{RedisProcess, command, shared_cluster, wait_until};
use common::xds::{gateway_certs, start_mtls_server, tls_channel};
use common::{TempDir, descriptor, hammer, ok, request, spawn_slidegate, temp_dir, threads_named};
use slidegate::cells::{self, Cells};
use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;
use slidegate::server::ServerOptions;
use slidegate::store::{CheckItem, MemoryStore, Store, StoreFuture};

/// The embedded store, noting which cell each decision was asked from.
struct NotesCells {
    inner: MemoryStore,
    asked_from: Mutex<Vec<Option<usize>>>,
}

impl Store for NotesCells {
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        self.asked_from.lock().unwrap().push(cells::current());
        self.inner.check(items, now_ms)
    }

    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        self.asked_from.lock().unwrap().push(cells::current());
        self.inner.check_rejected(items, now_ms)
    }

    fn name(&self) -> &'static str {
        "notes cells"
    }
}

/// With TLS on the gRPC port (mutual, with a client name), each connection's handshake and calls
/// run in a cell: two connections, two cells, each decision made on its connection's cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn mtls_connections_are_served_each_in_its_cell() {
    let scratch = temp_dir("cells-tls");
    let dir = scratch.0.as_path();
    gateway_certs(dir);
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
    let store = Arc::new(NotesCells {
        inner: MemoryStore::new(),
        asked_from: Mutex::new(Vec::new()),
    });
    let options = ServerOptions {
        cells: Some(Arc::new(Cells::start(2).expect("cells start"))),
        ..ServerOptions::default()
    };
    let grpc_addr = start_mtls_server(dir, yaml, store.clone(), options).await;

    // One connection at a time, so that the first goes to cell 0 and the second to cell 1.
    for expected_cell in [0, 1] {
        let channel = tls_channel(grpc_addr, dir, Some("envoy"))
            .await
            .expect("the named client connects");
        let mut client = RateLimitServiceClient::new(channel);
        for _ in 0..3 {
            let answer = client
                .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
                .await
                .expect("the named client is served");
            assert_eq!(answer.into_inner().overall_code, ok());
        }
        let asked_from = store.asked_from.lock().unwrap().clone();
        assert_eq!(
            asked_from[asked_from.len() - 3..],
            [Some(expected_cell); 3],
            "calls of connection {expected_cell}: {asked_from:?}"
        );
    }
    assert!(
        common::xds::refused_as(grpc_addr, dir, "ratelimit").await,
        "a certificate for another name was served"
    );
}

/// A config directory: domain `cells`, descriptor `user` limited to 20 a minute.
fn user_limit_of_20(name: &str) -> TempDir {
    let scratch = temp_dir(name);
    std::fs::write(
        scratch.0.join("limits.yaml"),
        "domain: cells\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
    )
    .unwrap();
    scratch
}

/// The binary with `--thread-per-core --worker-threads 3` on `redis_url`: three cells; 64 connections (spread over the cells) send 640 calls at once for one
/// descriptor limited to 20 a minute, and exactly 20 are admitted; a cell sees what the client
/// outside the cells recorded. Then SIGTERM ends it cleanly.
async fn exact_across_cells(redis_url: &str) {
    let scratch = user_limit_of_20("cells-redis");
    let (grpc, http, mut child) = spawn_slidegate(
        &scratch.0,
        &[
            "--redis",
            redis_url,
            "--redis-timeout",
            "2s",
            "--thread-per-core",
            "--worker-threads",
            "3",
        ],
    );
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let pid = child.0.id();
    assert_eq!(threads_named(pid, "sg-cell-"), 3, "one thread per cell");

    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], grpc));
    assert_eq!(hammer(&[addr], "cells", "user").await, 20);

    // Threads outside the cells (here `POST /json`) have a Redis client of their own, on the
    // same Redis: 20 admitted there leave nothing for a cell.
    let http_addr = std::net::SocketAddr::from(([127, 0, 0, 1], http));
    let body = r#"{"domain":"cells","descriptors":[{"entries":[{"key":"user","value":"other"}]}]}"#;
    for n in 0..20 {
        let (code, answer) = common::http(http_addr, "POST", "/json", body).await;
        assert_eq!(code, 200, "call {n}: {answer}");
    }
    let answer = common::connect(addr)
        .await
        .should_rate_limit(request("cells", vec![descriptor(&[("user", "other")])]))
        .await
        .expect("call")
        .into_inner();
    assert_eq!(answer.overall_code, common::over());

    common::signal(&child.0, "TERM");
    let end = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < end, "slidegate did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_redis_admits_exactly_the_limit_across_cells() {
    let redis = RedisProcess::start(&[]);
    exact_across_cells(&redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_admits_exactly_the_limit_across_cells() {
    exact_across_cells(&shared_cluster().url()).await;
}

/// Start-up waits for a Redis that does not answer once (`--redis-connect-timeout`), not once
/// per cell: the cells' clients and the one outside them connect at the same time. (A bound on
/// start-up, which readiness probes and restarts depend on; the margin is seconds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_a_silent_redis_once_not_once_per_cell() {
    // Connections complete in the kernel's backlog and nothing ever answers them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let scratch = user_limit_of_20("cells-silent");
    let started = Instant::now();
    let (_, http, _child) = spawn_slidegate(
        &scratch.0,
        &[
            "--redis",
            &url,
            "--redis-connect-timeout",
            "1s",
            "--thread-per-core",
            "--worker-threads",
            "4",
        ],
    );
    wait_until("alive", Duration::from_secs(20), || {
        command(http, "GET /healthz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "alive after {took:?}, before the connect timeout: was the silent Redis waited for?"
    );
    assert!(
        took < Duration::from_secs(3),
        "alive after {took:?}; five clients connecting one after another take 5 s"
    );
    drop(silent);
}
