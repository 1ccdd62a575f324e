//! A slot moving between masters under load: only the requests whose keys live in it may
//! fail, and only while it moves; every other slot, on every master (the two the slot moves
//! between included), is served throughout; nothing is admitted past a limit.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use super::*;

/// How the slot moves.
#[derive(Clone, Copy, Debug)]
enum Move {
    /// `redis-cli --cluster reshard` of one slot (the source's lowest), as an operator runs it.
    Reshard,
    /// IMPORTING and MIGRATING set, the slot's keys migrated one at a time over `spread`, then
    /// the slot given to the target on every master.
    Manual { spread: Duration },
}

/// One caller's traffic: the hot slot's users, or one master's other slot.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    Hot,
    Elsewhere(usize),
}

/// What the callers saw, by when: errors before the move, during it (from its start to
/// `SETTLE` after its end), after; and the slowest answer.
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    /// Per hot item, the calls admitted.
    items: Vec<AtomicU64>,
    calls: AtomicU64,
    errors: [AtomicU64; 3],
    slowest_us: AtomicU64,
    /// The first error after the move, and when (ms after its end).
    late: Mutex<Option<String>>,
}

/// After the move's last step, how long the moving slot's requests may still fail: the
/// clients learn the new owner from Redis's redirection (the routing copy is kept up to a
/// second, `nodes.rs`).
const SETTLE: Duration = Duration::from_secs(1);

struct Window {
    started: Mutex<Option<Instant>>,
    ended: Mutex<Option<Instant>>,
}

impl Window {
    /// 0 before the move, 1 during it (and `SETTLE` after), 2 after.
    fn phase(&self) -> usize {
        let started = *self.started.lock().expect("lock");
        let ended = *self.ended.lock().expect("lock");
        match (started, ended) {
            (None, _) => 0,
            (Some(_), None) => 1,
            (Some(_), Some(end)) if end.elapsed() < SETTLE => 1,
            _ => 2,
        }
    }
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
/// master's other slot, with a store deadline of 250 ms and no over-limit cache (every call
/// goes to Redis); the hot slot moves half a second in. The test's log has the counts.
async fn moving_slot_under_load(how: Move) {
    let domain = unique_domain("moves");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    descriptors:\n      - key: item\n        tag_by: user\n        rate_limit: {{unit: hour, requests_per_unit: 5}}\n  - key: other\n    rate_limit: {{unit: hour, requests_per_unit: 1000000}}\n"
    );
    let cluster = RedisCluster::start();
    let mut opts = options(cluster.url(), Duration::from_millis(250));
    opts.pool_size = 1;
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(opts).await.expect("connect"));
    // Every call asks Redis: none is answered from the over-limit cache.
    let limiter = LimiterOptions {
        over_limit_cache: 0,
        ..LimiterOptions::default()
    };
    let server = TestServer::start(&config, store, limiter).await;
    let (user, hot) = hot_user(&domain, &cluster);
    let others = other_values(&domain, &cluster, hot);
    let stop = Arc::new(AtomicBool::new(false));
    let window = Arc::new(Window {
        started: Mutex::new(None),
        ended: Mutex::new(None),
    });
    let lanes: Vec<Lane> = (0..24)
        .map(|_| Lane::Hot)
        .chain((0..8 * others.len()).map(|n| Lane::Elsewhere(n % others.len())))
        .collect();
    let seen: Arc<Vec<Seen>> = Arc::new(
        (0..=others.len())
            .map(|_| Seen {
                items: (0..200).map(|_| AtomicU64::new(0)).collect(),
                ..Seen::default()
            })
            .collect(),
    );
    let mut callers = Vec::new();
    for (n, lane) in lanes.into_iter().enumerate() {
        let client = common::connect(server.grpc_addr).await;
        let (d, user, stop, window, seen) = (
            domain.clone(),
            user.clone(),
            stop.clone(),
            window.clone(),
            seen.clone(),
        );
        let other = match lane {
            Lane::Elsewhere(m) => others[m].1.clone(),
            Lane::Hot => String::new(),
        };
        callers.push(tokio::spawn(async move {
            let at = match lane {
                Lane::Hot => 0,
                Lane::Elsewhere(m) => m + 1,
            };
            let mut i = n;
            while !stop.load(SeqCst) {
                i += 64;
                let item = (i % 200).to_string();
                let descriptor = match lane {
                    Lane::Hot => descriptor(&[("user", &user), ("item", &item)]),
                    Lane::Elsewhere(_) => descriptor(&[("other", &other)]),
                };
                let asked = Instant::now();
                let answer = client
                    .clone()
                    .should_rate_limit(request(&d, vec![descriptor]))
                    .await;
                let took = u64::try_from(asked.elapsed().as_micros()).unwrap_or(u64::MAX);
                seen[at].slowest_us.fetch_max(took, SeqCst);
                seen[at].calls.fetch_add(1, SeqCst);
                match answer {
                    Ok(r) if r.get_ref().overall_code == ok() => {
                        seen[at].admitted.fetch_add(1, SeqCst);
                        seen[at].items[i % 200].fetch_add(1, SeqCst);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let phase = window.phase();
                        seen[at].errors[phase].fetch_add(1, SeqCst);
                        if phase == 2 {
                            let ended = window.ended.lock().expect("lock").map(|at| at.elapsed());
                            let mut late = seen[at].late.lock().expect("lock");
                            late.get_or_insert_with(|| format!("{ended:?} after: {e}"));
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    *window.started.lock().expect("lock") = Some(Instant::now());
    let cluster_ref = &cluster;
    let (from, to) = tokio::task::block_in_place(|| move_slot(cluster_ref, hot, how));
    *window.ended.lock().expect("lock") = Some(Instant::now());
    // Two seconds of traffic after the settling time.
    tokio::time::sleep(SETTLE + Duration::from_secs(2)).await;
    stop.store(true, SeqCst);
    for c in callers {
        c.await.expect("caller");
    }
    let count = |s: &Seen| {
        let e = s.errors.each_ref().map(|e| e.load(SeqCst));
        format!(
            "{} calls, errors before/during/after {e:?}, slowest {} ms; first late error {:?}",
            s.calls.load(SeqCst),
            s.slowest_us.load(SeqCst) / 1_000,
            s.late.lock().expect("lock")
        )
    };
    eprintln!("{how:?}: slot {hot} moved {from} -> {to}");
    eprintln!(
        "  moving slot: {}, {} admitted",
        count(&seen[0]),
        seen[0].admitted.load(SeqCst)
    );
    for (m, (port, _)) in others.iter().enumerate() {
        eprintln!("  master {port}'s other slot: {}", count(&seen[m + 1]));
    }
    for (item, admitted) in seen[0].items.iter().enumerate() {
        let admitted = admitted.load(SeqCst);
        assert!(admitted <= 5, "item {item} over-admitted: {admitted}");
    }
    // The moving slot's requests that a master refused went where the slot went; during a
    // migration, by ASKING to the importing master.
    assert!(resent(&server).await > 0, "no request followed the slot");
    if let Move::Manual { .. } = how {
        let importer = cluster.nodes.iter().find(|n| n.port == to).expect("target");
        assert!(calls_of(importer, "asking") > 0, "nothing went by ASKING");
    }
    assert_eq!(
        seen[0].errors[0].load(SeqCst),
        0,
        "moving slot, errors before the move"
    );
    assert_eq!(
        seen[0].errors[2].load(SeqCst),
        0,
        "moving slot, errors after the move"
    );
    for (m, (port, _)) in others.iter().enumerate() {
        let errors = seen[m + 1].errors.each_ref().map(|e| e.load(SeqCst));
        assert_eq!(errors, [0, 0, 0], "master {port}'s other slot, errors");
        assert!(
            seen[m + 1].calls.load(SeqCst) > 0,
            "master {port}'s other slot called"
        );
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
    moving_slot_under_load(Move::Reshard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrated_over_three_seconds_stalls_only_itself() {
    moving_slot_under_load(Move::Manual {
        spread: Duration::from_secs(3),
    })
    .await;
}
