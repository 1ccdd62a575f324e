//! Knowing when Redis forgot: a marker key on every master, written once (by whichever
//! slidegate comes first) and never expiring. When it is gone (a Redis restarted without
//! persistence, a `FLUSHALL`, an eviction) or holds another value than the one seen before
//! (another slidegate found it gone and wrote it again), every window on that master was
//! forgotten: a second replica would admit their requests again. Checked with readiness
//! (every couple of seconds); what follows is each domain's `store_reset`.
//!
//! The marker says when a loss was found, so that every replica knows it, one started after it
//! too: a replica that writes it again after finding it gone or replaced writes the time
//! (Redis's clock, `TIME`) in it, `<writer>;lost=<ms>`. A marker written where none was, by a
//! replica that had never seen one there, says no loss: such a Redis is taken as fresh (nothing
//! was counted there that could have been forgotten, as far as any replica that checked it
//! knows). Where that was wrong (a replica started against a Redis another one had counted in
//! before it was emptied, before that one checked it), the replica that knew the old marker
//! finds it replaced, and writes it again with the time it found the loss: from their next
//! check every replica knows it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use fred::prelude::*;
use fred::types::cluster::ClusterRouting;
use fred::types::{ClusterHash, CustomCommand};

/// The markers' name, before any `--redis-key-prefix`.
const NAME: &str = "slidegate:marker";

/// What a marker written after a loss holds after its writer: the time the loss was found.
const LOST: &str = ";lost=";

pub(super) struct Markers {
    /// Per master (one on standalone Redis): the marker's key and the value last seen.
    seen: Mutex<Vec<(String, String)>>,
    /// Losses found since the start.
    pub(super) losses: AtomicU64,
    /// When the latest loss a marker told of was found, ms since the epoch by Redis's clock (0:
    /// none).
    pub(super) lost_at_ms: AtomicU64,
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
            lost_at_ms: AtomicU64::new(0),
            token,
            writes: AtomicU64::new(0),
        }
    }

    /// Checks (and writes where missing) the marker of every master `client` reaches; counts a
    /// loss where one was seen before and is now gone or changed, and learns when a loss was
    /// found from a marker that says so. A marker that cannot be read is left for the next
    /// check. Returns false when a master refuses the write because it takes no writes now
    /// (full, read-only): the check is also a write probe.
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
            match self.check_one(client, &key).await {
                Ok(()) => {}
                Err(e) => writable &= !super::connection::refuses_writes(e.details()),
            }
        }
        writable
    }

    /// [`Markers::check`] for the marker `key`.
    async fn check_one(&self, client: &Client, key: &str) -> Result<(), Error> {
        let last = self.last_seen(key);
        let found_ms = redis_time_ms(client, key).await?;
        let write = self.writes.fetch_add(1, Ordering::Relaxed);
        // Where this replica saw a marker before, a missing one is a loss found now.
        let mine = match last {
            Some(_) => format!("{}-{write}{LOST}{found_ms}", self.token),
            None => format!("{}-{write}", self.token),
        };
        let command = CustomCommand::new_static("SET", ClusterHash::FirstKey, false);
        // SET NX GET: the value there before, or nil when it was missing (now ours).
        let before: Option<String> = client
            .custom(command, vec![key, mine.as_str(), "NX", "GET"])
            .await?;
        let mut now = before.unwrap_or(mine);
        if last.as_ref().is_some_and(|last| *last != now) {
            self.losses.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(marker = %key, "Redis lost its data (the marker slidegate keeps there was gone or written again: restarted without persistence, flushed or evicted); windows on it were forgotten; domains with store_reset: closed answer by their failure policy for one longest window");
            if lost_at(&now).is_none() {
                // Written by a replica that took this Redis as fresh: the others learn of the
                // loss from the marker written again, with when it was found.
                let told = format!("{}-{write}{LOST}{found_ms}", self.token);
                let command = CustomCommand::new_static("SET", ClusterHash::FirstKey, false);
                let set: Result<Value, Error> = client.custom(command, vec![key, &told]).await;
                if set.is_ok() {
                    now = told;
                }
            }
        }
        if let Some(at) = lost_at(&now) {
            let before = self.lost_at_ms.fetch_max(at, Ordering::Relaxed);
            if last.is_none() && at > before {
                tracing::warn!(marker = %key, lost_ms_ago = found_ms.saturating_sub(at), "Redis lost its data before this replica started (another found it): domains with store_reset: closed answer by their failure policy until one longest window has passed from then");
            }
        }
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match seen.iter_mut().find(|(k, _)| *k == key) {
            Some((_, value)) => *value = now,
            None => seen.push((key.to_string(), now)),
        }
        Ok(())
    }

    /// The value of the marker `key` this replica saw last, if it saw one.
    fn last_seen(&self, key: &str) -> Option<String> {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        seen.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }
}

/// When the loss a marker's value tells of was found (ms since the epoch), if it tells of one.
fn lost_at(value: &str) -> Option<u64> {
    value.split_once(LOST)?.1.parse().ok()
}

/// Redis's clock on the master that holds `key`, in ms since the epoch.
async fn redis_time_ms(client: &Client, key: &str) -> Result<u64, Error> {
    let slot = fred::util::redis_keyslot(key.as_bytes());
    let command = CustomCommand::new_static("TIME", ClusterHash::Custom(slot), false);
    let time: Vec<String> = client.custom(command, Vec::<String>::new()).await?;
    let number = |i: usize| time.get(i).and_then(|n| n.parse::<u64>().ok());
    let ms = match (number(0), number(1)) {
        (Some(seconds), Some(micros)) => seconds
            .checked_mul(1_000)
            .and_then(|ms| ms.checked_add(micros / 1_000)),
        _ => None,
    };
    match ms {
        Some(ms) => Ok(ms),
        None => Err(Error::new(
            ErrorKind::Protocol,
            format!("TIME answered {time:?}"),
        )),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_says_when_a_loss_was_found() {
        assert_eq!(
            lost_at("0a1b-7;lost=1767225600123"),
            Some(1_767_225_600_123)
        );
        assert_eq!(lost_at("0a1b-7"), None, "written on a Redis taken as fresh");
        assert_eq!(lost_at("0a1b-7;lost=soon"), None);
    }
}
