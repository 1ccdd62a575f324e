//! Redis Cluster: which master serves each hash slot, and a [`Batcher`] per master, so that
//! requests of many slots go to a master together as they do to a standalone Redis.
//!
//! The routing is the client's own view of the cluster (it re-reads the slots when Redis
//! redirects a command), copied here at most every [`ROUTING_KEPT`]. A copy that is out of date
//! costs a round trip, never a wrong answer: a master asked about a slot it no longer serves
//! fails those requests before they record anything, and they go again on their own
//! (`batch.rs`), where the client follows the redirection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::prelude::*;
use fred::types::cluster::ClusterRouting;
use tokio::time::Instant;

use super::batch::Batcher;

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
}

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
        }
    }

    /// The batcher of the master serving `slot`, or `None` while the client does not know it.
    pub fn batcher(&self, slot: u16, client: &Client) -> Option<Arc<Batcher>> {
        let mut routing = self.routing.load();
        if routing.owner.is_empty() || routing.read_at.elapsed() >= ROUTING_KEPT {
            self.read_again(client);
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
                        .unwrap_or_else(|| Batcher::new(self.calls_out));
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
