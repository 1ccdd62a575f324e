//! Redis Cluster: which master serves each hash slot, and a [`Batcher`] per master, so that
//! requests of many slots go to a master together as they do to a standalone Redis.
//!
//! Each master has clients of its own ([`Master`]), connected to it alone: a client of the
//! whole cluster is one task for every master, and while it reconnects to one (a master
//! killed, restarting) it sends nothing to any, so every slot would wait for the one that
//! failed.
//!
//! The routing is the redirect client's view of the cluster, copied here at most every
//! [`ROUTING_KEPT`], and at once after a master refused a request and the slot map was read
//! again. A copy that is out of date costs a round trip, never a wrong answer: a master asked
//! about a slot it no longer serves fails those requests before they record anything, and they
//! go where the slot went (`decide.rs`).

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
use super::master::Master;

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
    /// The masters that did not answer the last readiness check ([`Nodes::any_answers`]).
    silent: Mutex<Vec<String>>,
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
            silent: Mutex::new(Vec::new()),
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
    /// master down still decides every other master's slots, so it stays ready. The masters
    /// that did not answer are kept for [`Nodes::silent`]. `None` while no master is known.
    pub async fn any_answers(&self, wait: Duration) -> Option<bool> {
        let routing = self.routing.load_full();
        let pings = routing
            .masters
            .iter()
            .filter_map(|(_, batcher)| batcher.master())
            .map(|master| {
                let client = master.pool.load().next().clone();
                async move {
                    let ping = tokio::time::timeout(wait, client.ping::<String>(None)).await;
                    (master.server.to_string(), matches!(ping, Ok(Ok(_))))
                }
            })
            .collect::<Vec<_>>();
        if pings.is_empty() {
            return None;
        }
        let answers = futures_util::future::join_all(pings).await;
        let silent: Vec<String> = answers
            .iter()
            .filter(|(_, answered)| !answered)
            .map(|(server, _)| format!("Redis Cluster master {server}"))
            .collect();
        let any = silent.len() < answers.len();
        *lock(&self.silent) = if any { silent } else { Vec::new() };
        Some(any)
    }

    /// The masters that did not answer the last readiness check while others did.
    pub fn silent(&self) -> Vec<String> {
        lock(&self.silent).clone()
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
    use super::importer_in;

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
