//! Redis Cluster: which master serves each hash slot, and a [`Batcher`] per master, so that
//! requests of many slots go to a master together as they do to a standalone Redis.
//!
//! Each master has clients of its own ([`Master`]), connected to it alone: a client of the
//! whole cluster is one task for every master, and while it reconnects to one (a master
//! killed, restarting) it sends nothing to any, so every slot would wait for the one that
//! failed.
//!
//! The routing is the redirect client's view of the cluster (it re-reads the slots when Redis
//! redirects a command: `call.rs`), copied here at most every [`ROUTING_KEPT`], and at once
//! after a master refused a request. A copy that is out of date costs a round trip, never a
//! wrong answer: a master asked about a slot it no longer serves fails those requests before
//! they record anything, and they go again on their own by the redirect client, which follows
//! the redirection.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::collections::HashMap;

use arc_swap::ArcSwap;
use fred::prelude::*;
use fred::types::cluster::ClusterRouting;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand};
use tokio::time::Instant;

use super::batch::Batcher;
use super::call::Sender;
use super::connection::PoolRecipe;

/// How long a copy of the client's routing serves before it is read again.
const ROUTING_KEPT: Duration = Duration::from_secs(1);

/// Redis Cluster's hash slots.
const SLOTS: usize = 16_384;

/// A slot whose master is not known (the client has not read the slots yet).
const UNKNOWN: u16 = u16::MAX;

struct Routing {
    /// Per slot, its master's place in `masters`, or [`UNKNOWN`].
    owner: Vec<u16>,
    masters: Vec<(Server, Arc<Batcher>)>,
    read_at: Instant,
}

/// A cluster master and its own clients (`--redis-pool-size` of them), and how its calls go.
pub(super) struct Master {
    pub server: Server,
    pub pool: ArcSwap<Pool>,
    rate: Mutex<Rate>,
    recipe: Arc<PoolRecipe>,
}

/// How long a master's calls are counted together ([`Rate`]).
const RATE_WINDOW: Duration = Duration::from_millis(250);

/// The fewest calls in a window that can show a master failing.
const RATE_MIN_CALLS: u32 = 4;

/// How long a master may keep failing before its clients are replaced, at first; doubled after
/// each replacement while it keeps failing, up to [`REPLACE_AT_MOST_EVERY`].
const REPLACE_AFTER: Duration = Duration::from_millis(500);
const REPLACE_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// A master's calls over the current window, and since when its windows have been failing:
/// half its calls or more failed (a timeout, or the master unreachable), of at least
/// [`RATE_MIN_CALLS`]. Other masters' calls do not count: one master failing while the rest
/// answer is found as soon as it fails alone.
struct Rate {
    since: Option<Instant>,
    calls: u32,
    failed: u32,
    failing_since: Option<Instant>,
    replace_after: Duration,
    replacing: bool,
}

/// What a master's failing windows call for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Remedy {
    /// Nothing: the window is not over, or it went well.
    None,
    /// Read the cluster's slots again: a master that fails may have been failed over.
    Refresh,
    /// That, and replace its clients: it has kept failing for a while.
    Replace,
}

impl Rate {
    fn new() -> Rate {
        Rate {
            since: None,
            calls: 0,
            failed: 0,
            failing_since: None,
            replace_after: REPLACE_AFTER,
            replacing: false,
        }
    }

    /// Counts a call at `now`, and says what a window that closed calls for.
    fn note(&mut self, now: Instant, failed: bool) -> Remedy {
        let since = *self.since.get_or_insert(now);
        let mut remedy = Remedy::None;
        if now.saturating_duration_since(since) >= RATE_WINDOW {
            let failing = self.calls >= RATE_MIN_CALLS && self.failed * 2 >= self.calls;
            (self.since, self.calls, self.failed) = (Some(now), 0, 0);
            if failing {
                let failing_since = *self.failing_since.get_or_insert(since);
                let due = now.saturating_duration_since(failing_since) >= self.replace_after;
                remedy = if due && !self.replacing {
                    self.replacing = true;
                    Remedy::Replace
                } else {
                    Remedy::Refresh
                };
            } else {
                self.failing_since = None;
                self.replace_after = REPLACE_AFTER;
            }
        }
        self.calls += 1;
        self.failed += u32::from(failed);
        remedy
    }

    /// A replacement ended: the next one waits twice as long (counted from now) while the
    /// master keeps failing.
    fn replaced(&mut self, now: Instant) {
        self.replacing = false;
        self.replace_after = (self.replace_after * 2).min(REPLACE_AT_MOST_EVERY);
        if self.failing_since.is_some() {
            self.failing_since = Some(now);
        }
    }
}

impl Drop for Master {
    /// A master no longer in the routing (failed over, removed): its clients stop, or they
    /// would try to reconnect to it for ever.
    fn drop(&mut self) {
        let pool = self.pool.load_full();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), pool.quit()).await;
            });
        }
    }
}

impl Master {
    fn new(server: Server, pool: Pool, recipe: Arc<PoolRecipe>) -> Master {
        Master {
            server,
            pool: ArcSwap::from_pointee(pool),
            rate: Mutex::new(Rate::new()),
            recipe,
        }
    }

    /// Counts a call to this master, and reads the cluster's slots again, or replaces its
    /// clients, when its calls keep failing.
    pub fn note(self: &Arc<Self>, failed: bool, sender: &Sender) {
        let remedy = lock(&self.rate).note(Instant::now(), failed);
        if remedy == Remedy::None {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let sender = sender.clone();
        runtime.spawn(async move {
            sender
                .refresh(Instant::now() + sender.timeout.max(RATE_WINDOW))
                .await;
        });
        if remedy == Remedy::Replace {
            runtime.spawn(self.clone().replace());
        }
    }

    /// New clients for this master, swapped in once connected (the old ones close); kept as
    /// they are if the new ones cannot connect either.
    async fn replace(self: Arc<Self>) {
        let deadline = self.recipe.options.connect_timeout;
        match self.recipe.master(&self.server) {
            Ok(fresh) => match tokio::time::timeout(deadline, fresh.wait_for_connect()).await {
                Ok(Ok(())) => {
                    tracing::warn!(master = %self.server, "a Redis Cluster master's calls kept failing: replaced its clients");
                    let old = self.pool.swap(Arc::new(fresh));
                    let _ = old.quit().await;
                }
                _ => {
                    tracing::warn!(master = %self.server, "a Redis Cluster master's calls keep failing and new clients cannot connect to it either");
                    let _ = fresh.quit().await;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, master = %self.server, "cannot make clients for a cluster master")
            }
        }
        lock(&self.rate).replaced(Instant::now());
    }
}

pub(super) struct Nodes {
    routing: ArcSwap<Routing>,
    /// Held by the one caller reading the routing again; the others use the copy they have.
    reading: Mutex<()>,
    calls_out: usize,
    /// How a master's clients are made.
    recipe: Arc<PoolRecipe>,
    /// Per slot mid-migration, the master importing it (none: not migrating) and when that
    /// was read ([`Nodes::importer`]).
    importers: Mutex<HashMap<u16, (Option<Server>, Instant)>>,
}

/// How long what a master said of a slot's migration serves before it is asked again.
const IMPORTER_KEPT: Duration = Duration::from_millis(100);

impl Nodes {
    /// No routing yet: the first call reads the client's.
    pub fn new(calls_out: usize, recipe: Arc<PoolRecipe>) -> Nodes {
        Nodes {
            routing: ArcSwap::from_pointee(Routing {
                owner: Vec::new(),
                masters: Vec::new(),
                read_at: Instant::now(),
            }),
            reading: Mutex::new(()),
            calls_out,
            recipe,
            importers: Mutex::new(HashMap::new()),
        }
    }

    /// The batcher of the master importing `slot` from `source`, as `source` says (`CLUSTER
    /// NODES`: its own line holds `[<slot>->-<importer id>]` while the slot migrates), or
    /// `None` when it is not migrating, the importer is not a master known here, or `source`
    /// cannot say by `until`.
    pub async fn importer(
        &self,
        slot: u16,
        source: &Master,
        until: Instant,
    ) -> Option<Arc<Batcher>> {
        let known = lock(&self.importers).get(&slot).cloned();
        let importer = match known {
            Some((importer, at)) if at.elapsed() < IMPORTER_KEPT => importer,
            _ => {
                let client = source.pool.load().next().clone();
                let nodes = CustomCommand::new_static("CLUSTER", ClusterHash::Random, false);
                let client = client.with_options(&Options {
                    timeout: Some(until.saturating_duration_since(Instant::now())),
                    ..Options::default()
                });
                let said: String = client.custom(nodes, vec!["NODES"]).await.ok()?;
                let importer = importer_in(&said, slot).map(|(host, port)| Server::new(host, port));
                let mut importers = lock(&self.importers);
                importers.retain(|_, (_, at)| at.elapsed() < IMPORTER_KEPT);
                importers.insert(slot, (importer.clone(), Instant::now()));
                importer
            }
        }?;
        let routing = self.routing.load();
        routing
            .masters
            .iter()
            .find(|(server, _)| server.port == importer.port && server.host == importer.host)
            .map(|(_, batcher)| batcher.clone())
    }

    /// The batcher of the master serving `slot`, or `None` while the client does not know it.
    pub fn batcher(&self, slot: u16, sender: &Sender) -> Option<Arc<Batcher>> {
        let mut routing = self.routing.load();
        let stale =
            sender.stale.load(Ordering::Relaxed) && sender.stale.swap(false, Ordering::Relaxed);
        if stale || routing.owner.is_empty() || routing.read_at.elapsed() >= ROUTING_KEPT {
            self.read_again(super::call::redirect_client(&sender.pool.load()));
            routing = self.routing.load();
        }
        let owner = *routing.owner.get(usize::from(slot))?;
        routing
            .masters
            .get(usize::from(owner))
            .map(|(_, b)| b.clone())
    }

    /// Reads the slot map and waits, until `deadline` at most, for every master's clients to
    /// connect: at start, so that the first calls do not wait for connections.
    pub async fn connect(&self, sender: &Sender, deadline: Duration) {
        self.read_again(super::call::redirect_client(&sender.pool.load()));
        let routing = self.routing.load();
        let pools: Vec<Arc<Pool>> = routing
            .masters
            .iter()
            .filter_map(|(_, batcher)| batcher.master().map(|m| m.pool.load_full()))
            .collect();
        let connected = futures_util::future::join_all(pools.iter().map(|p| p.wait_for_connect()));
        if tokio::time::timeout(deadline, connected).await.is_err() {
            tracing::warn!(
                "the clients of some Redis Cluster masters did not connect within {deadline:?}; they keep connecting, and calls answer by the store-failure policy until they are"
            );
        }
    }

    /// Whether any master answers a `PING` by its own clients within `wait`: a cluster with a
    /// master down still decides every other master's slots, so it stays ready. `None` while
    /// no master is known.
    pub async fn any_answers(&self, wait: Duration) -> Option<bool> {
        let routing = self.routing.load_full();
        let pings = routing
            .masters
            .iter()
            .filter_map(|(_, batcher)| batcher.master())
            .map(|master| {
                let client = master.pool.load().next().clone();
                Box::pin(async move {
                    let ping = tokio::time::timeout(wait, client.ping::<String>(None)).await;
                    if matches!(ping, Ok(Ok(_))) {
                        Ok(())
                    } else {
                        Err(())
                    }
                })
            })
            .collect::<Vec<_>>();
        if pings.is_empty() {
            return None;
        }
        Some(futures_util::future::select_ok(pings).await.is_ok())
    }

    /// Copies the client's routing, keeping the batchers of masters it already knew (their
    /// calls out and queues go on).
    fn read_again(&self, client: &Client) {
        let Ok(_reading) = self.reading.try_lock() else {
            return; // another caller is at it
        };
        let old = self.routing.load();
        let Some(cluster) = client.cached_cluster_state() else {
            // Not known yet: try again on the next call.
            return;
        };
        let routing = self.routing_from(&cluster, &old.masters);
        self.routing.store(Arc::new(routing));
    }

    fn routing_from(&self, cluster: &ClusterRouting, known: &[(Server, Arc<Batcher>)]) -> Routing {
        let mut owner = vec![UNKNOWN; SLOTS];
        let mut masters: Vec<(Server, Arc<Batcher>)> = Vec::new();
        for range in cluster.slots() {
            let at = match masters.iter().position(|(s, _)| *s == range.primary) {
                Some(at) => at,
                None => {
                    let known = known.iter().find(|(s, _)| *s == range.primary);
                    let batcher = match known {
                        Some((_, batcher)) => batcher.clone(),
                        None => match self.recipe.master(&range.primary) {
                            Ok(pool) => Batcher::of(
                                self.calls_out,
                                Some(Arc::new(Master::new(
                                    range.primary.clone(),
                                    pool,
                                    self.recipe.clone(),
                                ))),
                            ),
                            Err(e) => {
                                // Its slots stay unknown: their requests go by the redirect
                                // client.
                                tracing::warn!(error = %e, master = %range.primary, "cannot make clients for a cluster master");
                                continue;
                            }
                        },
                    };
                    masters.push((range.primary.clone(), batcher));
                    masters.len() - 1
                }
            };
            // Fewer masters than u16::MAX: a cluster has at most 16,384 slots to spread.
            let at = u16::try_from(at).unwrap_or(UNKNOWN);
            let (start, end) = (usize::from(range.start), usize::from(range.end));
            if let Some(slots) = owner.get_mut(start..=end.min(SLOTS - 1)) {
                slots.fill(at);
            }
        }
        Routing {
            owner,
            masters,
            read_at: Instant::now(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain values: one left by a panicking holder is still usable.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// From `CLUSTER NODES` as a master said it, the address (host, port) of the master its own
/// line says `slot` migrates to.
fn importer_in(nodes: &str, slot: u16) -> Option<(String, u16)> {
    let mine = nodes.lines().find(|line| {
        line.split_whitespace()
            .nth(2)
            .is_some_and(|flags| flags.split(',').any(|f| f == "myself"))
    })?;
    let migrating = format!("[{slot}->-");
    let id = mine
        .split_whitespace()
        .skip(8)
        .find_map(|range| range.strip_prefix(migrating.as_str()))?
        .strip_suffix(']')?;
    let line = nodes
        .lines()
        .find(|line| line.split_whitespace().next() == Some(id))?;
    // "<ip>:<port>@<cluster port>[,<hostname>]"
    let address = line.split_whitespace().nth(1)?;
    let (host, rest) = address.rsplit_once(':')?;
    let port = rest.split(['@', ',']).next()?.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls at `every` ms from `start`, each failing as `fails` says; the remedies asked for.
    fn remedies(rate: &mut Rate, start: Instant, every: u64, fails: &[bool]) -> Vec<Remedy> {
        fails
            .iter()
            .enumerate()
            .map(|(n, &failed)| {
                let at = start + Duration::from_millis(every * n as u64);
                rate.note(at, failed)
            })
            .filter(|r| *r != Remedy::None)
            .collect()
    }

    /// A master whose calls fail: each failing window (250 ms) asks for the slots to be read
    /// again, and once it has failed for half a second, for its clients to be replaced, one
    /// replacement at a time and the next twice as late; a window that goes well clears it;
    /// too few calls show nothing.
    #[test]
    fn a_master_failing_is_refreshed_then_replaced() {
        use Remedy::{Refresh, Replace};
        let ms = |n: u64| Duration::from_millis(n);
        let start = Instant::now();
        let mut rate = Rate::new();
        // Calls 50 ms apart, all failing: windows close at 250 (failing for 250 ms), 500 (for
        // 500 ms: replace), 750 (replacing already).
        let failing = remedies(&mut rate, start, 50, &[true; 16]);
        assert_eq!(failing, [Refresh, Replace, Refresh]);
        let more = remedies(&mut rate, start + ms(800), 50, &[true; 11]);
        assert_eq!(
            more,
            [Refresh, Refresh],
            "no second replacement while one runs"
        );
        // Replaced at 1400 and still failing: the next replacement a second later, no sooner.
        rate.replaced(start + ms(1_400));
        let again = remedies(&mut rate, start + ms(1_400), 50, &[true; 21]);
        assert_eq!(again, [Refresh; 4]);
        let more = remedies(&mut rate, start + ms(2_450), 50, &[true; 6]);
        assert_eq!(more, [Replace]);

        // Two failures of four calls in a window: failing.
        let mut half = Rate::new();
        let mixed = remedies(&mut half, start, 70, &[true, false, true, false, false]);
        assert_eq!(mixed, [Refresh]);
        // A window that goes well clears it.
        let mut cleared = Rate::new();
        assert_eq!(remedies(&mut cleared, start, 50, &[true; 6]), [Refresh]);
        assert!(cleared.failing_since.is_some());
        assert_eq!(remedies(&mut cleared, start + ms(300), 50, &[false; 6]), []);
        assert_eq!(cleared.failing_since, None);
        // Too few calls in a window: nothing, however they went.
        let mut quiet = Rate::new();
        assert_eq!(remedies(&mut quiet, start, 100, &[true; 20]), []);
    }

    #[test]
    fn the_importer_is_read_from_the_migrating_masters_own_line() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460 [5461->-c3] [17-<-b2]
b2 127.0.0.1:7002@17002 master - 0 1 2 connected 5461-10922
c3 10.0.0.3:7003@17003,redis-c master - 0 1 3 connected 10923-16383
";
        assert_eq!(importer_in(nodes, 5461), Some(("10.0.0.3".into(), 7003)));
        // An importing slot, a slot not migrating, an id with no line: none.
        assert_eq!(importer_in(nodes, 17), None);
        assert_eq!(importer_in(nodes, 0), None);
        let lost = nodes.replace("c3 10.0.0.3", "d4 10.0.0.3");
        assert_eq!(importer_in(&lost, 5461), None);
        // Another node's migration is not this master's.
        let other = nodes
            .replace(" [5461->-c3]", "")
            .replace("5461-10922", "5461-10922 [5462->-c3]");
        assert_eq!(importer_in(&other, 5462), None);
        assert_eq!(importer_in("", 5461), None);
        let v6 = nodes.replace("10.0.0.3:7003", "[::1]:7003");
        assert_eq!(importer_in(&v6, 5461), Some(("::1".into(), 7003)));
    }
}
