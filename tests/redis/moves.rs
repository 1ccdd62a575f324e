//! A slot moving between masters, and a master failing, under load: only the requests whose
//! keys live there may fail, and only while it lasts; every other slot, on every master (the two
//! a slot moves between included), is served throughout; nothing is admitted past a limit.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use slidegate::proto::RateLimitDescriptor;

use super::*;

/// What the callers of one group saw, by when: errors before the event, during it (from its
/// start to the settling time after its end), after; and the slowest answer.
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    /// Per item (the caller's call number modulo 200), the calls admitted.
    items: Vec<AtomicU64>,
    calls: AtomicU64,
    errors: [AtomicU64; 3],
    /// The slowest answer before, during and after, in us.
    slowest_us: [AtomicU64; 3],
    /// The first error after the event, and when (after its end).
    late: Mutex<Option<String>>,
}

impl Seen {
    fn errors(&self) -> [u64; 3] {
        self.errors.each_ref().map(|e| e.load(SeqCst))
    }
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} calls, {} admitted, errors before/during/after {:?}, slowest {:?} ms; first late error {:?}",
            self.calls.load(SeqCst),
            self.admitted.load(SeqCst),
            self.errors(),
            self.slowest_us.each_ref().map(|s| s.load(SeqCst) / 1_000),
            self.late.lock().expect("lock")
        )
    }
}

/// When the event (a move, a fault) started and ended, and how long after its end calls of
/// the slots it touched may still fail.
struct Window {
    started: Mutex<Option<Instant>>,
    ended: Mutex<Option<Instant>>,
    settle: Duration,
}

impl Window {
    /// 0 before the event, 1 during it (and `settle` after), 2 after.
    fn phase(&self) -> usize {
        let started = *self.started.lock().expect("lock");
        let ended = *self.ended.lock().expect("lock");
        match (started, ended) {
            (None, _) => 0,
            (Some(_), None) => 1,
            (Some(_), Some(end)) if end.elapsed() < self.settle => 1,
            _ => 2,
        }
    }
}

/// A descriptor for a caller's `n`th call.
type Make = Arc<dyn Fn(usize) -> RateLimitDescriptor + Send + Sync>;

/// Callers in groups, each calling as fast as it is answered until stopped.
struct Traffic {
    stop: Arc<AtomicBool>,
    window: Arc<Window>,
    seen: Arc<Vec<Seen>>,
    callers: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    /// `callers` callers per group, each group's descriptors made by its `Make`; the event's
    /// slots settle `settle` after it ends.
    async fn start(
        server: &TestServer,
        domain: &str,
        groups: Vec<(usize, Make)>,
        settle: Duration,
    ) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let window = Arc::new(Window {
            started: Mutex::new(None),
            ended: Mutex::new(None),
            settle,
        });
        let seen: Arc<Vec<Seen>> = Arc::new(
            groups
                .iter()
                .map(|_| Seen {
                    items: (0..200).map(|_| AtomicU64::new(0)).collect(),
                    ..Seen::default()
                })
                .collect(),
        );
        let mut callers = Vec::new();
        let mut n = 0;
        for (at, (count, make)) in groups.into_iter().enumerate() {
            for _ in 0..count {
                n += 1;
                let client = common::connect(server.grpc_addr).await;
                let (domain, stop, window, seen, make) = (
                    domain.to_string(),
                    stop.clone(),
                    window.clone(),
                    seen.clone(),
                    make.clone(),
                );
                callers.push(tokio::spawn(async move {
                    let mut i = n;
                    while !stop.load(SeqCst) {
                        i += 64;
                        let asked = Instant::now();
                        let answer = client
                            .clone()
                            .should_rate_limit(request(&domain, vec![make(i)]))
                            .await;
                        seen[at].note(i, asked, answer, &window);
                    }
                }));
            }
        }
        // Half a second of traffic before the event.
        tokio::time::sleep(Duration::from_millis(500)).await;
        *window.started.lock().expect("lock") = Some(Instant::now());
        Traffic {
            stop,
            window,
            seen,
            callers,
        }
    }

    /// The event ended: two seconds more of traffic after the settling time, then stop.
    async fn end(self) -> Arc<Vec<Seen>> {
        *self.window.ended.lock().expect("lock") = Some(Instant::now());
        tokio::time::sleep(self.window.settle + Duration::from_secs(2)).await;
        self.stop.store(true, SeqCst);
        for c in self.callers {
            c.await.expect("caller");
        }
        self.seen
    }
}

impl Seen {
    fn note(
        &self,
        i: usize,
        asked: Instant,
        answer: Result<tonic::Response<slidegate::proto::RateLimitResponse>, tonic::Status>,
        window: &Window,
    ) {
        let took = u64::try_from(asked.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.slowest_us[window.phase()].fetch_max(took, SeqCst);
        self.calls.fetch_add(1, SeqCst);
        match answer {
            Ok(r) if r.get_ref().overall_code == ok() => {
                self.admitted.fetch_add(1, SeqCst);
                self.items[i % 200].fetch_add(1, SeqCst);
            }
            Ok(_) => {}
            Err(e) => {
                let phase = window.phase();
                self.errors[phase].fetch_add(1, SeqCst);
                if phase == 2 {
                    let ended = window.ended.lock().expect("lock").map(|at| at.elapsed());
                    let mut late = self.late.lock().expect("lock");
                    late.get_or_insert_with(|| format!("{ended:?} after: {e}"));
                }
            }
        }
    }
}

/// A server on its own cluster with one pool connection, a store deadline of 250 ms and no
/// over-limit cache (every call goes to Redis).
async fn server_without_cache(cluster: &RedisCluster, config: &str) -> TestServer {
    server_as(cluster.url(), config).await
}

/// The same at `url` (a cluster's, with a user, say).
async fn server_as(url: String, config: &str) -> TestServer {
    let mut opts = options(url, Duration::from_millis(250));
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    let limiter = LimiterOptions {
        over_limit_cache: 0,
        ..LimiterOptions::default()
    };
    TestServer::start(config, store, limiter).await
}

/// How the slot moves.
#[derive(Clone, Copy, Debug)]
enum Move {
    /// `redis-cli --cluster reshard` of one slot (the source's lowest), as an operator runs it.
    Reshard,
    /// IMPORTING and MIGRATING set, the slot's keys migrated one at a time over `spread`, then
    /// the slot given to the target on every master.
    Manual { spread: Duration },
}

/// The hot descriptors' tag: a user whose logs (kept in one slot by `tag_by`) sit in the
/// lowest slot of their master, the slot `redis-cli --cluster reshard` moves first.
fn hot_user(domain: &str, cluster: &RedisCluster) -> (String, u16) {
    let owner = owners(cluster);
    (0..1_000_000)
        .map(|n| format!("u{n}"))
        .find_map(|user| {
            let slot = slot(&hot_key(domain, &user, "0").log());
            let lowest = slot == 0 || owner(slot - 1) != owner(slot);
            lowest.then_some((user, slot))
        })
        .expect("a user in a master's lowest slot")
}

fn hot_key(domain: &str, user: &str, item: &str) -> slidegate::store::StoreKey {
    key::build(
        domain,
        &[
            Segment::Value {
                key: "user",
                value: user,
            },
            Segment::Value {
                key: "item",
                value: item,
            },
        ],
        Variant::Configured,
        Some("user"),
    )
}

/// Per master, a value of `other` whose log sits there, in a slot other than `hot`.
fn other_values(domain: &str, cluster: &RedisCluster, hot: u16) -> Vec<(u16, String)> {
    let owner = owners(cluster);
    cluster
        .nodes
        .iter()
        .map(|node| {
            let value = (0..100_000)
                .map(|n| format!("o{n}"))
                .find(|v| {
                    let s = slot(&log_of(domain, "other", v));
                    s != hot && owner(s) == node.port
                })
                .expect("a value on every master");
            (node.port, value)
        })
        .collect()
}

/// Moves `slot` from its master to the next one, as `how` says; the ports (from, to).
fn move_slot(cluster: &RedisCluster, slot: u16, how: Move) -> (u16, u16) {
    match how {
        Move::Manual { spread } => migrate_slot_over(cluster, slot, spread),
        Move::Reshard => {
            let from = owner_of(cluster, slot);
            let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
            let to = *ports.iter().find(|p| **p != from).expect("another master");
            let id = |port: u16| node_cli(port, &["CLUSTER", "MYID"])[0].clone();
            let out = std::process::Command::new("redis-cli")
                .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
                .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
                .args(["--cluster-slots", "1", "--cluster-yes"])
                .output()
                .expect("run redis-cli --cluster reshard");
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "reshard failed: {said}");
            assert!(
                said.contains(&format!("Moving slot {slot} from")),
                "reshard moved another slot than {slot}: {said}"
            );
            (from, to)
        }
    }
}

/// [`migrate_slot`] with the keys migrated one at a time, evenly over `spread`.
pub(super) fn migrate_slot_over(cluster: &RedisCluster, slot: u16, spread: Duration) -> (u16, u16) {
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let id = |port: u16| node_cli(port, &["CLUSTER", "MYID"])[0].clone();
    let owner = owner_of(cluster, slot);
    let target = *ports.iter().find(|p| **p != owner).expect("another master");
    let (owner_id, target_id) = (id(owner), id(target));
    let s = slot.to_string();
    node_cli(target, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &owner_id]);
    node_cli(owner, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &target_id]);
    let keys = node_cli(owner, &["CLUSTER", "GETKEYSINSLOT", &s, "100000"]);
    let keys: Vec<&str> = keys
        .iter()
        .map(String::as_str)
        .filter(|k| !k.is_empty())
        .collect();
    let start = Instant::now();
    let target_port = target.to_string();
    let migrate = |keys: &[&str]| {
        let mut args = vec![
            "MIGRATE",
            "127.0.0.1",
            &target_port,
            "",
            "0",
            "5000",
            "KEYS",
        ];
        args.extend_from_slice(keys);
        node_cli(owner, &args);
    };
    for (n, key) in keys.iter().enumerate() {
        let at = spread.mul_f64(n as f64 / keys.len() as f64);
        std::thread::sleep(at.saturating_sub(start.elapsed()));
        migrate(&[key]);
    }
    // Keys the callers made meanwhile in the source (none should be: new keys of a migrating
    // slot go to the target).
    loop {
        let left = node_cli(owner, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]);
        let left: Vec<&str> = left
            .iter()
            .map(String::as_str)
            .filter(|k| !k.is_empty())
            .collect();
        if left.is_empty() {
            break;
        }
        migrate(&left);
    }
    std::thread::sleep(spread.saturating_sub(start.elapsed()));
    for port in &ports {
        node_cli(*port, &["CLUSTER", "SETSLOT", &s, "NODE", &target_id]);
    }
    (owner, target)
}

/// 24 callers on one user's 200 items (5 an hour each, one slot by `tag_by`) and 8 on each
/// master's other slot; the hot slot moves half a second in. The test's log has the counts.
async fn moving_slot_under_load(how: Move, by_script: bool) {
    let domain = unique_domain("moves");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: item\n        tag_by: user\n        rate_limit: {{unit: hour, requests_per_unit: 5}}\n  - key: other\n    rate_limit: {{unit: hour, requests_per_unit: 1000000}}\n"
    );
    let cluster = RedisCluster::start();
    let server = if by_script {
        // A user refused FUNCTION: the script goes by EVALSHA, one slot per call.
        for node in &cluster.nodes {
            let made = node.cmd("ACL SETUSER limited on >secret ~* +@all -function");
            assert!(made.starts_with("+OK"), "{made}");
        }
        let url = cluster
            .url()
            .replacen("redis-cluster://", "redis-cluster://limited:secret@", 1);
        server_as(url, &config).await
    } else {
        server_without_cache(&cluster, &config).await
    };
    let (user, hot) = hot_user(&domain, &cluster);
    let others = other_values(&domain, &cluster, hot);
    let hot_user_name = user.clone();
    let hot_items: Make = Arc::new(move |i| {
        descriptor(&[("user", &hot_user_name), ("item", &(i % 200).to_string())])
    });
    let mut groups = vec![(24, hot_items)];
    for (_, value) in &others {
        let value = value.clone();
        groups.push((
            8,
            Arc::new(move |_| descriptor(&[("other", &value)])) as Make,
        ));
    }
    // After the move's last step, the moving slot's requests may fail for a second more: the
    // clients learn the new owner from Redis's refusal.
    let traffic = Traffic::start(&server, &domain, groups, Duration::from_secs(1)).await;
    let cluster_ref = &cluster;
    let (from, to) = tokio::task::block_in_place(|| move_slot(cluster_ref, hot, how));
    let seen = traffic.end().await;
    eprintln!("{how:?}: slot {hot} moved {from} -> {to}");
    eprintln!("  moving slot: {}", seen[0]);
    for (m, (port, _)) in others.iter().enumerate() {
        eprintln!("  master {port}'s other slot: {}", seen[m + 1]);
    }
    for (item, admitted) in seen[0].items.iter().enumerate() {
        let admitted = admitted.load(SeqCst);
        assert!(admitted <= 5, "item {item} over-admitted: {admitted}");
    }
    let [before, _, after] = seen[0].errors();
    assert_eq!(
        (before, after),
        (0, 0),
        "moving slot, errors before and after the move"
    );
    for (m, (port, _)) in others.iter().enumerate() {
        assert_eq!(
            seen[m + 1].errors(),
            [0, 0, 0],
            "master {port}'s other slot, errors"
        );
        assert!(
            seen[m + 1].calls.load(SeqCst) > 0,
            "master {port}'s other slot called"
        );
    }
    // The moving slot's requests that a master refused went where the slot went; during a
    // migration, by ASKING to the importing master.
    assert!(resent(&server).await > 0, "no request followed the slot");
    if let (Move::Manual { .. }, false) = (how, by_script) {
        let importer = cluster.nodes.iter().find(|n| n.port == to).expect("target");
        assert!(calls_of(importer, "asking") > 0, "nothing went by ASKING");
    }
    // The moved logs are where the cluster says: a new call finds them full.
    let r = server
        .call(request(
            &domain,
            vec![descriptor(&[("user", &user), ("item", "7")])],
        ))
        .await;
    assert_eq!(r.overall_code, over(), "the moved log kept its entries");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_resharded_under_load_stalls_only_itself() {
    moving_slot_under_load(Move::Reshard, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrated_over_three_seconds_stalls_only_itself() {
    moving_slot_under_load(
        Move::Manual {
            spread: Duration::from_secs(3),
        },
        false,
    )
    .await;
}

/// By `EVALSHA` (`FUNCTION` refused) each call keeps to one slot and a master refuses it whole
/// (`MOVED`, `ASK`); those calls follow the slot as the function's do, and during a migration
/// the requests whose keys have left are answered by the policy (no `ASKING` by script).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_evalsha_a_slot_migrated_under_load_stalls_only_itself() {
    moving_slot_under_load(
        Move::Manual {
            spread: Duration::from_secs(3),
        },
        true,
    )
    .await;
}

/// How a master fails.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Killed, and its replica made master at once (`CLUSTER FAILOVER TAKEOVER`); back when
    /// the replica says it is master.
    FailedOver,
    /// Handed over to its replica (`CLUSTER FAILOVER`): it serves on as a replica.
    HandedOver,
    /// Killed, and started again (same port and node file) after `down`; back when it says
    /// its cluster state is ok.
    Killed { down: Duration },
    /// Frozen (`SIGSTOP`) for `down`: connections open, nothing answered.
    Frozen { down: Duration },
}

/// 8 callers on a key of each master of a cluster that serves what it can with a master down
/// (`cluster-require-full-coverage no`); the first master fails half a second in, as `fault`
/// says, and comes back (or its replica serves). The other masters' keys: no error at any time;
/// the failed master's: answered (by the failure policy while down) within a second, and
/// served again within two seconds of its return.
async fn failing_master_under_load(fault: Fault) {
    let domain = unique_domain("failing");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: other\n    rate_limit: {{unit: hour, requests_per_unit: 1000000}}\n"
    );
    let mut cluster = RedisCluster::start_with(&["--cluster-require-full-coverage", "no"]);
    let values = other_values(&domain, &cluster, u16::MAX);
    let failed = values[0].0;
    let replica = match fault {
        Fault::FailedOver | Fault::HandedOver => Some(tokio::task::block_in_place(|| {
            add_replica(&cluster, failed)
        })),
        Fault::Killed { .. } | Fault::Frozen { .. } => None,
    };
    let server = server_without_cache(&cluster, &config).await;
    let groups = values
        .iter()
        .map(|(_, value)| {
            let value = value.clone();
            (
                8,
                Arc::new(move |_| descriptor(&[("other", &value)])) as Make,
            )
        })
        .collect();
    let traffic = Traffic::start(&server, &domain, groups, Duration::from_secs(2)).await;
    let node = cluster
        .nodes
        .iter_mut()
        .find(|n| n.port == failed)
        .expect("node");
    let promote = |how: &str| {
        let replica = replica.as_ref().expect("a replica");
        let mut args = vec!["CLUSTER", "FAILOVER"];
        args.extend(how.split_whitespace());
        node_cli(replica.port, &args);
        wait_until(
            "the replica serving as master",
            Duration::from_secs(20),
            || command(replica.port, "ROLE").is_ok_and(|r| r.contains("master")),
        );
    };
    match fault {
        Fault::FailedOver => {
            node.stop();
            tokio::task::block_in_place(|| promote("TAKEOVER"));
        }
        Fault::HandedOver => tokio::task::block_in_place(|| promote("")),
        Fault::Killed { down } => {
            node.stop();
            tokio::time::sleep(down / 2).await;
            // Still ready: every other master's slots are decided; and it says which is not.
            let (status, body) = http(server.http_addr, "GET", "/readyz", "").await;
            assert_eq!(status, 200, "not ready with one master down: {body}");
            assert!(
                body.contains(&format!(":{failed} does not answer")),
                "the silent master named: {body}"
            );
            tokio::time::sleep(down / 2).await;
            // Back once it serves again: a restarted node answers CLUSTERDOWN until it has
            // heard from the others.
            tokio::task::block_in_place(|| {
                node.restart();
                let port = node.port;
                wait_until(
                    "the restarted master's cluster state ok",
                    Duration::from_secs(20),
                    || command(port, "CLUSTER INFO").is_ok_and(|r| r.contains("cluster_state:ok")),
                );
            });
        }
        Fault::Frozen { down } => {
            node.freeze();
            tokio::time::sleep(down).await;
            node.thaw();
        }
    }
    let seen = traffic.end().await;
    eprintln!("{fault:?}: master {failed}");
    for (m, (port, _)) in values.iter().enumerate() {
        eprintln!("  master {port}: {}", seen[m]);
    }
    let [before, during, after] = seen[0].errors();
    assert_eq!(
        (before, after),
        (0, 0),
        "the failed master's key, errors before and after"
    );
    match fault {
        // Handed over, the old master refuses writes as a replica and its requests follow the
        // slots to the new one: no error need be seen at all.
        Fault::HandedOver => assert!(resent(&server).await > 0, "no request followed"),
        _ => assert!(during > 0, "the fault was felt"),
    }
    let slowest = seen[0]
        .slowest_us
        .each_ref()
        .map(|s| s.load(SeqCst) / 1_000);
    let slowest = slowest.into_iter().max().unwrap_or(0);
    assert!(
        slowest < 1_000,
        "the failed master's key waited {slowest} ms for an answer"
    );
    for (m, (port, _)) in values.iter().enumerate().skip(1) {
        assert_eq!(seen[m].errors(), [0, 0, 0], "master {port}'s key, errors");
    }
    server.stop().await;
}

/// A replica of the master at `port`, in sync, and known to every master.
fn add_replica(cluster: &RedisCluster, port: u16) -> RedisProcess {
    let replica = RedisProcess::start(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes-replica.conf",
        "--cluster-node-timeout",
        "5000",
    ]);
    let master_id = node_cli(port, &["CLUSTER", "MYID"])[0].clone();
    node_cli(
        replica.port,
        &["CLUSTER", "MEET", "127.0.0.1", &port.to_string()],
    );
    wait_until(
        "the replica meeting the master",
        Duration::from_secs(20),
        || command(replica.port, "CLUSTER NODES").is_ok_and(|r| r.contains(&master_id)),
    );
    node_cli(replica.port, &["CLUSTER", "REPLICATE", &master_id]);
    wait_until("the replica in sync", Duration::from_secs(20), || {
        command(replica.port, "INFO replication").is_ok_and(|r| r.contains("master_link_status:up"))
    });
    let id = node_cli(replica.port, &["CLUSTER", "MYID"])[0].clone();
    for node in &cluster.nodes {
        wait_until(
            "the masters knowing the replica",
            Duration::from_secs(20),
            || command(node.port, "CLUSTER NODES").is_ok_and(|r| r.contains(&id)),
        );
    }
    replica
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failed_over_costs_only_its_slots_until_its_replica_serves() {
    failing_master_under_load(Fault::FailedOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_handed_over_costs_only_its_slots() {
    failing_master_under_load(Fault::HandedOver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_costs_only_its_slots() {
    failing_master_under_load(Fault::Killed {
        down: Duration::from_secs(3),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_costs_only_its_slots() {
    failing_master_under_load(Fault::Frozen {
        down: Duration::from_secs(8),
    })
    .await;
}
