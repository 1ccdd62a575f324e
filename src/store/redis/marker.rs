//! Knowing when Redis forgot: a marker key on every master, written once (by whichever
//! slidegate comes first) and never expiring. When it is gone (a Redis restarted without
//! persistence, a `FLUSHALL`, an eviction) or holds another value than the one seen before
//! (another slidegate found it gone and wrote it again), every window on that master was
//! forgotten: a second replica would admit their requests again. Checked with readiness
//! (every couple of seconds); what follows is each domain's `store_reset`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use fred::prelude::*;
use fred::types::cluster::ClusterRouting;
use fred::types::{ClusterHash, CustomCommand};

/// The markers' name, before any `--redis-key-prefix`.
const NAME: &str = "slidegate:marker";

pub(super) struct Markers {
    /// Per master (one on standalone Redis): the marker's key and the value last seen.
    seen: Mutex<Vec<(String, Option<String>)>>,
    /// Losses found since the start.
    pub(super) losses: AtomicU64,
    /// What a marker is written as: unique to this process and start, and to each write (so a
    /// marker written again after a loss differs from the one every replica saw before).
    token: String,
    writes: AtomicU64,
}

impl Markers {
    pub(super) fn new(token: String) -> Markers {
        Markers {
            seen: Mutex::new(Vec::new()),
            losses: AtomicU64::new(0),
            token,
            writes: AtomicU64::new(0),
        }
    }

    /// Checks (and writes where missing) the marker of every master `client` reaches; counts a
    /// loss where one was seen before and is now gone or changed. A marker that cannot be read
    /// is left for the next check. Returns false when a master refuses the write because it
    /// takes no writes now (full, read-only): the check is also a write probe.
    pub(super) async fn check(&self, client: &Client, prefix: &str, cluster: bool) -> bool {
        let keys = if cluster {
            match client.cached_cluster_state() {
                Some(routing) => keys_per_master(&routing, prefix),
                None => return true,
            }
        } else {
            vec![format!("{prefix}{NAME}")]
        };
        let mut writable = true;
        for key in keys {
            let write = self.writes.fetch_add(1, Ordering::Relaxed);
            let mine = format!("{}-{write}", self.token);
            let command = CustomCommand::new_static("SET", ClusterHash::FirstKey, false);
            let set: Result<Option<String>, Error> = client
                .custom(command, vec![key.as_str(), mine.as_str(), "NX", "GET"])
                .await;
            // SET NX GET: the value there before, or nil when it was missing (now ours).
            let before = match set {
                Ok(before) => before,
                Err(e) => {
                    writable &= !super::connection::refuses_writes(e.details());
                    continue;
                }
            };
            let now = before.unwrap_or(mine);
            let mut seen = self
                .seen
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match seen.iter_mut().find(|(k, _)| *k == key) {
                Some((_, last)) => {
                    if last.as_ref().is_some_and(|l| *l != now) {
                        self.losses.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(marker = %key, "Redis lost its data (the marker slidegate keeps there was gone or written again: restarted without persistence, flushed or evicted); windows on it were forgotten; domains with store_reset: closed answer by their failure policy for one longest window");
                    }
                    *last = Some(now);
                }
                None => seen.push((key, Some(now))),
            }
        }
        writable
    }
}

/// A marker key for every master of `routing`: the name with a hash tag chosen to fall in a
/// slot that master serves.
fn keys_per_master(routing: &ClusterRouting, prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut masters: Vec<&Server> = Vec::new();
    for range in routing.slots() {
        if masters.contains(&&range.primary) {
            continue;
        }
        masters.push(&range.primary);
        let found = (0u32..200_000).find_map(|n| {
            let key = format!("{prefix}{NAME}:{{m{n}}}");
            let slot = fred::util::redis_keyslot(format!("m{n}").as_bytes());
            (range.start..=range.end).contains(&slot).then_some(key)
        });
        keys.extend(found);
    }
    keys
}
