//! Redis Cluster: which master serves each hash slot, and a [`Batcher`] per master, so that
//! requests of many slots go to a master together as they do to a standalone Redis.
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
    /// Per slot mid-migration, the master importing it (none: not migrating) and when that
    /// was read ([`Nodes::importer`]).
    importers: Mutex<HashMap<u16, (Option<Server>, Instant)>>,
}

/// How long what a master said of a slot's migration serves before it is asked again.
const IMPORTER_KEPT: Duration = Duration::from_millis(100);

impl Nodes {
    /// No routing yet: the first call reads the client's.
    pub fn new(calls_out: usize) -> Nodes {
        Nodes {
            routing: ArcSwap::from_pointee(Routing {
                owner: Vec::new(),
                masters: Vec::new(),
                read_at: Instant::now(),
            }),
            reading: Mutex::new(()),
            calls_out,
            importers: Mutex::new(HashMap::new()),
        }
    }

    /// The master importing `slot` from `source`, as `source` says (`CLUSTER NODES`: its own
    /// line holds `[<slot>->-<importer id>]` while the slot migrates), or `None` when it is
    /// not migrating or `source` cannot say by `until`.
    pub async fn importer(
        &self,
        slot: u16,
        source: &Server,
        sender: &Sender,
        until: Instant,
    ) -> Option<Server> {
        let known = lock(&self.importers).get(&slot).cloned();
        if let Some((importer, at)) = known
            && at.elapsed() < IMPORTER_KEPT
        {
            return importer;
        }
        let client = super::call::redirect_client(&sender.pool.load()).clone();
        let nodes = CustomCommand::new_static("CLUSTER", ClusterHash::Random, false);
        let client = client.with_options(&Options {
            cluster_node: Some(source.clone()),
            timeout: Some(until.saturating_duration_since(Instant::now())),
            ..Options::default()
        });
        let said: String = client.custom(nodes, vec!["NODES"]).await.ok()?;
        let importer = importer_in(&said, slot).map(|(host, port)| {
            // The server as the client knows it (its TLS name too), where it is a master.
            let routing = self.routing.load();
            routing
                .masters
                .iter()
                .map(|(server, _)| server)
                .find(|s| s.port == port && *s.host == *host)
                .cloned()
                .unwrap_or_else(|| Server::new(host, port))
        });
        let mut importers = lock(&self.importers);
        importers.retain(|_, (_, at)| at.elapsed() < IMPORTER_KEPT);
        importers.insert(slot, (importer.clone(), Instant::now()));
        importer
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
                    let batcher = known
                        .iter()
                        .find(|(s, _)| *s == range.primary)
                        .map(|(_, b)| b.clone())
                        .unwrap_or_else(|| {
                            Batcher::of(self.calls_out, Some(range.primary.clone()))
                        });
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
