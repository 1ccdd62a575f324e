//! The Redis backend: the conformance suite unchanged on standalone Redis and on a 3-master
//! Redis Cluster, plus what only Redis has, by topic: the script (`script.rs`), Redis Cluster's
//! slots (`slots.rs`), faults (`faults.rs`), many callers on one Redis (`sharing.rs`) and the
//! admin API's reads (`inspect.rs`). The helpers they share are here.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

#[path = "../common/mod.rs"]
mod common;
#[path = "../conformance/mod.rs"]
mod conformance;

mod faults;
mod inspect;
mod link;
mod moves;
mod script;
mod sharing;
mod slots;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{
    RedisCluster, RedisProcess, command, fcall_lines, make_certs, shared_cluster,
    shared_standalone, wait_until,
};
use common::*;
use conformance::{Backend, StoreFuture};
use slidegate::limiter::key::{self, Variant};
use slidegate::limiter::rules::Segment;
use slidegate::limiter::{FailurePolicy, LimiterOptions};
use slidegate::store::{ClockSource, RedisOptions, RedisStore, Store};

fn options(url: String, timeout: Duration) -> RedisOptions {
    RedisOptions {
        timeout,
        queue_timeout: Duration::from_secs(1),
        ..common::redis_options(url)
    }
}

async fn connect(url: String, timeout: Duration) -> Arc<dyn Store> {
    Arc::new(
        RedisStore::connect(options(url, timeout))
            .await
            .expect("connect to test Redis"),
    )
}

/// Tests run two at a time on two loaded cores: a generous deadline keeps them about behaviour.
const TEST_TIMEOUT: Duration = Duration::from_secs(5);

struct Standalone;

impl Backend for Standalone {
    fn store(&self) -> StoreFuture<'_> {
        Box::pin(connect(shared_standalone().url(), TEST_TIMEOUT))
    }
}

struct Cluster;

impl Backend for Cluster {
    fn store(&self) -> StoreFuture<'_> {
        Box::pin(connect(shared_cluster().url(), TEST_TIMEOUT))
    }
}

mod standalone {
    use super::*;
    conformance_suite!(Standalone);
}

mod cluster {
    use super::*;
    conformance_suite!(Cluster);
}

/// Slot of a key as Redis Cluster computes it (CRC16 of the hash tag, mod 16384).
fn slot(key: &str) -> u16 {
    let tag = match (key.find('{'), key.find('}')) {
        (Some(open), Some(close)) if close > open + 1 => &key[open + 1..close],
        _ => key,
    };
    let mut crc: u16 = 0;
    for byte in tag.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// A command on the cluster through `redis-cli -c`, which follows redirects to the key's owner.
fn cluster_cli(cluster: &RedisCluster, args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-c", "-p", &cluster.nodes[0].port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Reads a log in either format (docs/redis.md's layouts, read here on their own, not by the
/// script's code) as its entries: time, weight, time, weight...
const LOG_ENTRIES: &str = r"
local kind, out = redis.call('TYPE', KEYS[1]).ok, {}
if kind == 'zset' then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local weight, time = string.match(m, '^%d+:(%d+):(%d+)')
    out[#out + 1], out[#out + 2] = tonumber(time), tonumber(weight)
  end
elseif kind == 'string' then
  local s = redis.call('GET', KEYS[1])
  local w = string.byte(s, 1) % 16
  local function num(at, n)
    local v = 0
    for i = at, at + n - 1 do v = v * 256 + string.byte(s, i) end
    return v
  end
  local base, top = num(2, 6), 2 ^ (8 * w - 1)
  local at = string.byte(s, 1) >= 16 and 14 or 8
  while at <= #s do
    local v = num(at, w)
    if v >= top then
      out[#out + 1], out[#out + 2], at = base + v - top, num(at + w, w), at + 2 * w
    else
      out[#out + 1], out[#out + 2], at = base + v, 1, at + w
    end
  end
end
return out
";

/// A log's entries as (time, weight), oldest first, from the lines of `LOG_ENTRIES`'s reply.
fn entries_of(lines: &[String]) -> Vec<(u64, u64)> {
    lines
        .chunks(2)
        .filter(|pair| pair.len() == 2 && !pair[0].is_empty())
        .map(|pair| {
            let number = |text: &str| text.parse::<u64>().expect("a number");
            (number(&pair[0]), number(&pair[1]))
        })
        .collect()
}

/// The entries of a log on a standalone Redis.
fn log_entries(port: u16, key: &str) -> Vec<(u64, u64)> {
    entries_of(&node_cli(port, &["EVAL", LOG_ENTRIES, "1", key]))
}

/// The number of entries in a log on the cluster.
fn entries_in(cluster: &RedisCluster, key: &str) -> i64 {
    let entries = entries_of(&cluster_cli(cluster, &["EVAL", LOG_ENTRIES, "1", key]));
    i64::try_from(entries.len()).expect("a count")
}

/// Hits held in a descriptor's sliding_counter buckets.
fn bucket_hits(cluster: &RedisCluster, key: &str) -> i64 {
    cluster_cli(cluster, &["HVALS", key])
        .iter()
        .map(|v| v.parse::<i64>().expect("integer"))
        .sum()
}

/// An HTTP/2 connection to `addr` from hyper's client, with `ShouldRateLimit` calls of
/// `message` written by hand, `grpc-timeout` only where given: tonic's client would also end a
/// call itself at its deadline, hiding whether the server did.
struct RawCaller {
    send: hyper::client::conn::http2::SendRequest<http_body_util::Full<prost::bytes::Bytes>>,
    addr: std::net::SocketAddr,
    body: prost::bytes::Bytes,
}

impl RawCaller {
    async fn connect(
        addr: std::net::SocketAddr,
        message: &slidegate::proto::RateLimitRequest,
    ) -> RawCaller {
        use prost::Message as _;
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // As Envoy does: a request's HEADERS and DATA frames are two writes, and Nagle's
        // algorithm would hold the second for the server's delayed ACK (40 ms).
        tcp.set_nodelay(true).expect("TCP_NODELAY");
        let (send, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let message = message.encode_to_vec();
        let mut body = vec![0u8];
        body.extend(u32::try_from(message.len()).expect("small").to_be_bytes());
        body.extend(message);
        RawCaller {
            send,
            addr,
            body: body.into(),
        }
    }

    /// One call: its `grpc-status` (in the trailers, or the headers of a trailers-only
    /// answer), the headers it came with, and how long it took.
    async fn call(
        &mut self,
        timeout: Option<&'static str>,
    ) -> (Option<String>, hyper::HeaderMap, Duration) {
        let (status, headers, _, waited) = self.exchange(timeout).await;
        (status, headers, waited)
    }

    /// One call: its `grpc-status`, the response's `overall_code` where it carried a message,
    /// and how long it took.
    async fn decide(
        &mut self,
        timeout: Option<&'static str>,
    ) -> (Option<String>, Option<i32>, Duration) {
        use prost::Message as _;
        let (status, _, body, waited) = self.exchange(timeout).await;
        let code = body.get(5..).and_then(|message| {
            slidegate::proto::RateLimitResponse::decode(message)
                .ok()
                .map(|r| r.overall_code)
        });
        (status, code, waited)
    }

    async fn exchange(
        &mut self,
        timeout: Option<&'static str>,
    ) -> (
        Option<String>,
        hyper::HeaderMap,
        prost::bytes::Bytes,
        Duration,
    ) {
        use http_body_util::BodyExt as _;
        let mut call = hyper::Request::post(format!(
            "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            self.addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
        if let Some(timeout) = timeout {
            call = call.header("grpc-timeout", timeout);
        }
        let call = call
            .body(http_body_util::Full::new(self.body.clone()))
            .expect("a request");
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), self.send.send_request(call))
            .await
            .expect("answered within 5 s")
            .expect("an answer");
        let headers = answer.headers().clone();
        let body = answer.into_body().collect().await.expect("a body");
        let waited = started.elapsed();
        let status = body
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| headers.get("grpc-status"))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        (status, headers, body.to_bytes(), waited)
    }
}

/// A Redis of its own, a server on it whose store waits `timeout` for a caller without a
/// deadline, and a [`RawCaller`] whose first call shows the path works (the script loaded).
async fn raw_caller_on_redis(timeout: Duration) -> (RedisProcess, TestServer, RawCaller) {
    raw_caller_by_policy(timeout, FailurePolicy::Error).await
}

/// [`raw_caller_on_redis`] with `policy` for store failures.
async fn raw_caller_by_policy(
    timeout: Duration,
    policy: FailurePolicy,
) -> (RedisProcess, TestServer, RawCaller) {
    let redis = RedisProcess::start(&[]);
    let store = RedisStore::connect(options(redis.url(), timeout))
        .await
        .expect("the store starts");
    let domain = unique_domain("deadline");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 10}}\n"
    );
    let options = LimiterOptions {
        failure_policy: policy,
        ..LimiterOptions::default()
    };
    let server = TestServer::start(&config, Arc::new(store), options).await;
    let message = request(&domain, vec![descriptor(&[("k", "v")])]);
    let mut caller = RawCaller::connect(server.grpc_addr, &message).await;
    let (status, _, _) = caller.call(None).await;
    assert_eq!(status.as_deref(), Some("0"), "Redis answers while it runs");
    (redis, server, caller)
}

/// slidegate's library loaded into the shared standalone Redis, and a `redis-cli` there that
/// takes built strings (its replies one per line).
fn library_on_shared_redis() -> (
    slidegate::store::redis::Library,
    impl Fn(&[String]) -> String,
) {
    let port = shared_standalone().port;
    let library = slidegate::store::redis::Library::new();
    let cli = move |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node_cli(port, &args).join("\n")
    };
    let loaded = cli(&[
        "FUNCTION".into(),
        "LOAD".into(),
        "REPLACE".into(),
        library.code.to_string(),
    ]);
    assert_eq!(loaded, &*library.function);
    (library, cli)
}

/// A script reply to `requests` requests of one descriptor each, admitted, split per request:
/// flags, entry, count, reset (each after its length, 4; the call's time first).
fn one_descriptor_answers(reply: &str, requests: usize) -> Vec<Vec<&str>> {
    let lines: Vec<&str> = reply.lines().collect();
    let head = &reply[..reply.len().min(400)];
    assert_eq!(lines.len(), 1 + requests * 5, "{head}");
    lines[1..]
        .chunks(5)
        .map(|answer| {
            assert_eq!(answer[0], "4", "{head}");
            answer[1..].to_vec()
        })
        .collect()
}

fn budget_item(
    key: &slidegate::store::StoreKey,
    hits: u64,
    limit: u32,
) -> slidegate::store::CheckItem<'static> {
    slidegate::store::CheckItem {
        key: key.clone(),
        windows: std::borrow::Cow::Owned(vec![slidegate::store::Window {
            limit,
            length_ms: 3_600_000,
        }]),
        algorithm: slidegate::store::Algorithm::SlidingLog,
        ban_ms: None,
        hits,
        role: slidegate::store::Role::Enforce,
        debit: true,
        text: None,
    }
}

/// The values of the script's packed reply (a bulk string), as fred values.
fn unpacked(reply: &fred::types::Value) -> Vec<fred::types::Value> {
    use slidegate::store::redis::packed::{self, Item};
    let Some(bytes) = reply.as_bytes() else {
        panic!("not a packed reply: {reply:?}");
    };
    let items = packed::read_all(bytes).unwrap_or_else(|e| panic!("{e}: {reply:?}"));
    items
        .into_iter()
        .map(|item| match item {
            Item::Int(n) => fred::types::Value::Integer(n),
            Item::Text(text) => {
                fred::types::Value::from(String::from_utf8_lossy(text).into_owned())
            }
        })
        .collect()
}

/// A standalone Redis of the test's own with the script's library loaded.
fn redis_with_library() -> (RedisProcess, slidegate::store::redis::Library) {
    let redis = RedisProcess::start(&[]);
    let library = slidegate::store::redis::Library::new();
    assert_eq!(
        node_cli(redis.port, &["FUNCTION", "LOAD", &library.code]),
        [library.function.to_string()]
    );
    (redis, library)
}

/// One final request of one descriptor on `key` (`hits`, `rule` as the script reads them) at
/// `now`, by `FCALL`: the reply's values, one a line.
fn one_request(
    port: u16,
    library: &slidegate::store::redis::Library,
    key: &str,
    now: &str,
    hits: &str,
    rule: &str,
) -> Vec<String> {
    node_cli(
        port,
        &[
            "FCALL",
            &library.function,
            "1",
            key,
            "1",
            now,
            "5",
            hits,
            rule,
        ],
    )
}

/// `redis-cli` against one node, whole reply lines; a script call's packed reply one value a
/// line, as `redis-cli` printed the script's RESP array ([`fcall_lines`]).
fn node_cli(port: u16, args: &[&str]) -> Vec<String> {
    if args
        .first()
        .is_some_and(|a| a.eq_ignore_ascii_case("FCALL"))
    {
        return fcall_lines(port, args);
    }
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// A cluster of the test's own and a server on it with `config` (see [`server_on`]).
async fn on_own_cluster(config: &str, timeout: Duration) -> (RedisCluster, TestServer) {
    let cluster = RedisCluster::start();
    let server = server_on(cluster.url(), config, timeout).await;
    (cluster, server)
}

/// A server on the Redis at `url` with `config`, one pool connection (the store's calls share
/// it) and `timeout` per call.
async fn server_on(url: String, config: &str, timeout: Duration) -> TestServer {
    let mut opts = options(url, timeout);
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    TestServer::start(config, store, LimiterOptions::default()).await
}

/// Sends `requests` all at once, each on its own task: their overall codes, in order. Every one
/// must be answered (an error fails the test).
fn all_at_once(
    server: &TestServer,
    requests: Vec<slidegate::proto::RateLimitRequest>,
) -> impl std::future::Future<Output = Vec<i32>> + use<> {
    let calls: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let mut client = server.client.clone();
            tokio::spawn(async move { client.should_rate_limit(request).await })
        })
        .collect();
    async move {
        let mut codes = Vec::new();
        for call in calls {
            let answer = call.await.expect("task").expect("an answer, not an error");
            codes.push(answer.get_ref().overall_code);
        }
        codes
    }
}

/// The log key of descriptor `key=value` under a configured rule of `domain`, untagged.
fn log_of(domain: &str, key: &str, value: &str) -> String {
    key::build(
        domain,
        &[Segment::Value { key, value }],
        Variant::Configured,
        None,
    )
    .log()
}

/// `ERR` error replies a node has counted. A key a script reaches for on a master that does not
/// serve its slot counts as one, even when the script catches the error.
fn err_replies(port: u16) -> u64 {
    node_cli(port, &["INFO", "errorstats"])
        .iter()
        .find_map(|l| l.strip_prefix("errorstat_ERR:count="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Which master (its port) serves each slot, as the cluster's first node sees it now.
fn owners(cluster: &RedisCluster) -> impl Fn(u16) -> u16 {
    // "<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <state> <ranges...>"
    let ranges: Vec<(u16, u16, u16)> = node_cli(cluster.nodes[0].port, &["CLUSTER", "NODES"])
        .iter()
        .flat_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("a port");
            fields[8..]
                .iter()
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    Some((a.parse().ok()?, b.parse().ok()?, port))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    move |slot| {
        ranges
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|r| r.2)
            .expect("an owner")
    }
}

/// The port of the master that serves `slot`, as it says itself.
fn owner_of(cluster: &RedisCluster, slot: u16) -> u16 {
    cluster
        .nodes
        .iter()
        .map(|n| n.port)
        .find(|p| {
            node_cli(*p, &["CLUSTER", "NODES"]).iter().any(|line| {
                line.contains("myself")
                    && line.split_whitespace().skip(8).any(|range| {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        match (a.parse::<u16>(), b.parse::<u16>()) {
                            (Ok(a), Ok(b)) => (a..=b).contains(&slot),
                            _ => false,
                        }
                    })
            })
        })
        .expect("an owner")
}

/// Moves `slot` from the master that holds it to another, the way `redis-cli --cluster
/// reshard` does: IMPORTING, MIGRATING, MIGRATE of its keys, then SETSLOT NODE on every master.
/// Returns the ports (from, to).
fn migrate_slot(cluster: &RedisCluster, slot: u16) -> (u16, u16) {
    moves::migrate_slot_over(cluster, slot, Duration::ZERO)
}

/// `slidegate_redis_cluster_resent_total` as the server's metrics say it.
async fn resent(server: &TestServer) -> u64 {
    let (status, metrics) = http(server.http_addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("slidegate_redis_cluster_resent_total "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the resent counter")
}

/// Calls every 50 ms until `done` holds or `deadline` passes; whether it held.
async fn call_until(
    server: &TestServer,
    domain: &str,
    deadline: Duration,
    mut done: impl FnMut() -> bool,
) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if done() {
            return true;
        }
        let _ = server
            .client
            .clone()
            .should_rate_limit(request(domain, vec![descriptor(&[("k", "v")])]))
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done()
}

/// Calls of a command Redis has run (`fcall`, `evalsha`), from `INFO commandstats`.
fn calls_of(redis: &RedisProcess, command: &str) -> u64 {
    let stats = redis.cmd("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn fcall_calls(redis: &RedisProcess) -> u64 {
    calls_of(redis, "fcall")
}

/// A Redis of the test's own and a server on it with one pool connection (the store's calls
/// share it), with `descriptors` (YAML list items) in a fresh domain.
async fn on_one_connection(name: &str, descriptors: &str) -> (RedisProcess, TestServer, String) {
    let redis = RedisProcess::start(&[]);
    let mut opts = options(redis.url(), TEST_TIMEOUT);
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    let domain = unique_domain(name);
    let config = format!("domain: {domain}\ndescriptors:\n{descriptors}");
    let server = TestServer::start(&config, store, LimiterOptions::default()).await;
    (redis, server, domain)
}
