//! The Redis store: one Lua function library (the parts in `lua/`, joined by `build.rs`) decides
//! a request's descriptors atomically, one call per hash slot or cluster master. Works on standalone Redis and on Redis Cluster.
//!
//! Where each part lives:
//! * `connection.rs`: the client configuration from the URL and TLS files, the first probe, the
//!   pool and its replacement when calls keep failing.
//! * `library.rs`: the script as a Redis function library, loaded once on every primary
//!   (`FUNCTION LOAD`) and called with `FCALL`; loaded again when a restart, `FUNCTION FLUSH` or a
//!   new master lost it; by `EVALSHA` where `FUNCTION LOAD` is refused.
//! * `encode.rs`: a request's `KEYS` and `ARGV`, and the reply split per request and read back
//!   (`packed.rs` reads the MessagePack string the reply comes in).
//! * `call.rs`: one script call: to a cluster master by name through the script's spread
//!   function, or with the keys declared (standalone Redis; on a cluster by the redirect client,
//!   or by `ASKING` to the master importing a slot); `TRYAGAIN` and a lost library handled.
//! * `batch.rs`: requests that arrive while every call to a Redis is out go together in the next
//!   call, each decided on its own; `nodes.rs` keeps one such batcher per cluster master, so a
//!   master's call carries requests of all its slots, with clients of that master's own
//!   (`master.rs`, which also follows how its calls go).
//! * `decide.rs`: a request grouped by master, one call per group; a request over several
//!   masters is sent as tentative calls, concurrently, and if the combined answer is a rejection
//!   the entries recorded are removed again. That can briefly make other requests see a fuller
//!   log (never an emptier one): it can under-admit for a moment, never over-admit.
//! * `take_back.rs`: what a call recorded for a request whose caller the deny policy already
//!   answered `OVER_LIMIT` (its reply came after the decision's moment), taken back; and the
//!   removal of one entry, which the undo of a rejected spread request shares.
//! * `operator_calls.rs`: the admin API's inspect and reset (the library's inspect and reset
//!   functions), and the read of a descriptor after an undo; `compact.rs` reads a compact log's
//!   bytes in Rust for them.
//! * Every call is bounded by a deadline: a slow or dead Redis becomes a fast error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use fred::bytes_utils::Str;
use fred::prelude::*;
use futures_util::future::join_all;

mod batch;
mod call;
pub mod compact;
mod connection;
mod decide;
mod encode;
mod library;
mod marker;
mod master;
mod nodes;
mod operator_calls;
pub mod packed;
mod quota_calls;
mod replicas;
mod take_back;

use batch::Batcher;
use call::{Request, Sender, Slots, not_served};
use connection::{
    HOPELESS_AFTER, HOPELESS_STREAK, Health, PoolRecipe, client_config, lock, probe, start_pool,
};
pub use connection::{normalize_url, redact};
use decide::{Call, Entry, Group, GroupReply};
use encode::call_failed;
pub use library::{Function, Library};
use nodes::Nodes;

pub use crate::tls::TlsFiles;

use super::{
    Algorithm, CheckItem, CheckOutcome, Deadlines, ItemOutcome, LogFormat, Store, StoreError,
    StoreFuture, Waited, WindowOutcome, admits, push_decimal, rule_text,
};

type UndoFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send + 'a>>;

/// The function library, embedded in the binary: `lua/`'s parts, joined by `build.rs`.
pub const SCRIPT: &str = include_str!(concat!(env!("OUT_DIR"), "/slidegate.lua"));

/// Where "now" comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockSource {
    /// The server's clock, sent with each call (the default; replicas' clocks must agree).
    Server,
    /// Redis `TIME`, read inside the script: one clock per key for every replica.
    Redis,
}

#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://`, `rediss://` (TLS), `redis-cluster://h1:p1,h2:p2`, `rediss-cluster://…`,
    /// user and password in the URL.
    pub url: String,
    pub pool_size: usize,
    /// How long a call sent to Redis is waited for (`--redis-timeout`; a caller's deadline may
    /// end it sooner).
    pub timeout: Duration,
    /// How long a decision whose caller sent no deadline may wait for its turn to call Redis
    /// (`--redis-queue-timeout`).
    pub queue_timeout: Duration,
    pub connect_timeout: Duration,
    pub clock: ClockSource,
    /// CA, client certificate and hostname policy for `rediss://`; empty: system CAs.
    pub tls: TlsFiles,
    /// Put before every key (the reference's `CACHE_KEY_PREFIX`), so installations sharing a
    /// Redis keep apart; it comes before the hash tag, so slots are as without it.
    pub key_prefix: String,
    /// Replicas that must hold a call's writes before its requests are answered (`WAIT`);
    /// 0: answered as soon as the master has them.
    pub wait_replicas: u32,
    /// How `sliding_log` logs are kept.
    pub log_format: LogFormat,
}

/// Script calls out at once from the store to a Redis (on a cluster, to each master), whatever
/// the pool size. Redis runs one at a time, so a second keeps it busy while a reply travels back;
/// more only queue inside Redis, where waiting counts against the callers' deadlines. The
/// requests that arrive meanwhile wait here and go together in the next call.
const CALLS_OUT: usize = 2;

pub struct RedisStore {
    /// The client pool (replaced whole when it stays broken, see [`RedisStore::note`]) and the
    /// script: what sends a call, shared with the batcher's tasks.
    sender: Sender,
    recipe: Arc<PoolRecipe>,
    health: Arc<Mutex<Health>>,
    /// Whether the last noted call failed: lets a success skip the lock on the hot path.
    failing: std::sync::atomic::AtomicBool,
    cluster: bool,
    clock: ClockSource,
    /// Makes members unique across replicas: a random id per process plus a call counter.
    instance: String,
    calls: AtomicU64,
    /// Redis's `maxmemory-policy` when it evicts keys, as read at connect.
    evicting: Option<String>,
    /// The markers that tell when Redis lost its data.
    markers: marker::Markers,
    /// Standalone Redis: gathers requests that wait into one call (`batch.rs`).
    batcher: Option<Arc<Batcher>>,
    /// Redis Cluster: the same per master (`nodes.rs`).
    nodes: Option<Nodes>,
}

/// How a script call decides (a request's shape in `lua/contract.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// One slot of a request spread over several: record if this slot fits; the caller
    /// combines the slots and removes the entries of a rejected request.
    Tentative,
    /// The whole request in one call: admit and record, or record nothing.
    Final,
    /// The request is already rejected (a descriptor known to be over): record nothing but
    /// debits, set bans, report.
    Rejected,
}

impl Mode {
    /// The library's code for the mode (`lua/contract.lua`).
    fn code(self) -> u64 {
        match self {
            Mode::Tentative => 0,
            Mode::Final => 1,
            Mode::Rejected => 2,
        }
    }
}

impl RedisStore {
    /// Connects and loads the script. A Redis that is not reachable yet is connected to in the
    /// background (calls answer by the failure policy and readiness is off until then); one that
    /// refuses the credentials or the TLS set-up fails here.
    pub async fn connect(options: RedisOptions) -> Result<RedisStore, StoreError> {
        let mut config = client_config(&options)?;
        let cluster = config.server.is_clustered();
        let reachable = probe(&config, options.connect_timeout).await?;
        // Not reachable yet (not started, a cluster still forming): the pool keeps trying, as it
        // does after losing a connection, and calls answer by the failure policy meanwhile.
        config.fail_fast = false;
        let recipe = Arc::new(PoolRecipe {
            config,
            options: options.clone(),
        });
        let library = Library::new();
        let pool = start_pool(&recipe, &library, reachable).await?;
        let evicting = if reachable {
            evicting_policy(pool.next()).await
        } else {
            None
        };
        let store = RedisStore {
            sender: Sender {
                pool: Arc::new(ArcSwap::from_pointee(pool)),
                library,
                load_timeout: options.connect_timeout,
                resent: Arc::default(),
                timeout: options.timeout,
                wait_replicas: options.wait_replicas,
                redirect: cluster,
                stale: Arc::default(),
                read_at: Arc::default(),
            },
            batcher: (!cluster).then(|| Batcher::new(CALLS_OUT)),
            nodes: cluster.then(|| Nodes::new(CALLS_OUT, recipe.clone())),
            recipe,
            health: Arc::new(Mutex::new(Health::default())),
            failing: std::sync::atomic::AtomicBool::new(false),
            cluster,
            clock: options.clock,
            instance: format!(
                "{:016x}",
                std::hash::BuildHasher::hash_one(
                    &std::collections::hash_map::RandomState::new(),
                    std::process::id()
                )
            ),
            calls: AtomicU64::new(0),
            evicting,
            markers: marker::Markers::new(format!(
                "{:016x}",
                std::hash::BuildHasher::hash_one(
                    &std::collections::hash_map::RandomState::new(),
                    "marker"
                )
            )),
        };
        if let (Some(nodes), true) = (&store.nodes, reachable) {
            nodes.connect(&store.sender, options.connect_timeout).await;
        }
        Ok(store)
    }

    /// A client of the pool, for tests and tools that look at the keys directly.
    pub fn client(&self) -> Client {
        self.sender.pool.load().next().clone()
    }
}

impl RedisStore {
    /// [`RedisStore::decide`] when its turn comes, and the health note of how it went. A
    /// decision waits for its turn (the batchers' queues, one per master on a cluster:
    /// `batch.rs`) and then for Redis, each within its own bound ([`Deadlines`]). A call's
    /// commands are bounded by the client's own timeout, which also marks a command so that it
    /// is never sent after a reconnection once its caller was told it failed (a timer of ours
    /// dropping the call would leave it unmarked, and Redis would record hits for a call long
    /// answered with an error). A decision that never had its turn says nothing of the client.
    async fn checked(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        rejected: bool,
        take_back: bool,
    ) -> Result<CheckOutcome, StoreError> {
        let groups = self.groups(items);
        let result = self
            .decide(items, groups, now_ms, rejected, take_back)
            .await;
        // A protocol error is an answer: the client works.
        self.note(!matches!(
            result,
            Err(StoreError::Timeout(Waited::Redis(..)) | StoreError::Unavailable { .. })
        ));
        result
    }
}

/// Redis's `maxmemory-policy` if it evicts keys (anything but `noeviction`), warned about: an
/// evicted log forgets its window, and a second replica admits its requests again. `None` too
/// where `CONFIG GET` is refused (managed Redis often renames it): nothing is known then.
async fn evicting_policy(client: &Client) -> Option<String> {
    let config =
        fred::types::CustomCommand::new_static("CONFIG", fred::types::ClusterHash::Random, false);
    let reply: Result<Vec<String>, Error> =
        client.custom(config, vec!["GET", "maxmemory-policy"]).await;
    let policy = reply.ok()?.get(1)?.to_ascii_lowercase();
    if policy == "noeviction" {
        return None;
    }
    tracing::warn!(
        policy = %policy,
        "Redis evicts keys under memory pressure (maxmemory-policy {policy}): an evicted window is forgotten and its requests admitted again; set maxmemory-policy noeviction"
    );
    Some(policy)
}

impl Store for RedisStore {
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        Box::pin(self.checked(items, now_ms, false, false))
    }

    fn check_or_take_back<'a>(
        &'a self,
        items: &'a [CheckItem<'a>],
        now_ms: u64,
    ) -> StoreFuture<'a> {
        Box::pin(self.checked(items, now_ms, false, true))
    }

    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        Box::pin(self.checked(items, now_ms, true, false))
    }

    fn inspect<'a>(
        &'a self,
        items: &'a [CheckItem<'a>],
        now_ms: u64,
    ) -> crate::store::InspectFuture<'a> {
        self.inspect_items(items, now_ms)
    }

    fn reset<'a>(&'a self, keys: &'a [crate::store::StoreKey]) -> crate::store::ResetFuture<'a> {
        self.reset_keys(keys)
    }

    fn quota<'a>(
        &'a self,
        items: &'a [crate::store::QuotaItem<'a>],
        ttl_ms: u64,
        now_ms: u64,
    ) -> crate::store::QuotaFuture<'a> {
        self.quota_items(items, ttl_ms, now_ms)
    }

    fn name(&self) -> &'static str {
        if self.cluster {
            "redis-cluster"
        } else {
            "redis"
        }
    }

    fn resent(&self) -> Option<u64> {
        self.cluster
            .then(|| self.sender.resent.load(Ordering::Relaxed))
    }

    fn evicting(&self) -> Option<String> {
        self.evicting.clone()
    }

    fn alive(&self) -> bool {
        let health = lock(&self.health);
        let streak = health
            .streak_since
            .map_or(Duration::ZERO, |at| at.elapsed());
        health.replaced_in_vain < HOPELESS_AFTER || streak < HOPELESS_STREAK
    }

    fn ready(&self) -> super::ReadyFuture<'_> {
        Box::pin(async move {
            let wait = self.sender.timeout.max(Duration::from_millis(200));
            let client = self.sender.pool.load().next().clone();
            let masters = match &self.nodes {
                Some(nodes) => nodes.any_answers(wait).await,
                None => None,
            };
            match masters {
                Some(answered) if !answered => return false,
                Some(_) => {}
                None => {
                    let ping: Result<Result<String, Error>, _> =
                        tokio::time::timeout(wait, client.ping(None)).await;
                    if !matches!(ping, Ok(Ok(_))) {
                        return false;
                    }
                }
            }
            // The markers' check writes: a Redis that answers PING but takes no writes (full,
            // read-only) cannot decide, and is not ready.
            let prefix = &self.recipe.options.key_prefix;
            let check = self.markers.check(&client, prefix, self.cluster);
            tokio::time::timeout(wait, check).await.unwrap_or(true)
        })
    }

    fn data_losses(&self) -> Option<u64> {
        Some(self.markers.losses.load(Ordering::Relaxed))
    }

    fn data_lost_at(&self) -> Option<u64> {
        Some(self.markers.lost_at_ms.load(Ordering::Relaxed)).filter(|&at| at > 0)
    }

    fn silent(&self) -> Vec<String> {
        self.nodes.as_ref().map(Nodes::silent).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_header_documents_keys_and_argv() {
        assert!(SCRIPT.contains("-- KEYS"));
        assert!(SCRIPT.contains("-- ARGV"));
        assert!(
            !SCRIPT.contains("..\"rl:"),
            "the script never builds key names"
        );
    }
}
