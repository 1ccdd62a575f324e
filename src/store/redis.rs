//! The Redis store: one Lua script (`lua/slidegate.lua`) per hash slot decides a request's
//! descriptors atomically. Works on standalone Redis and on Redis Cluster.
//!
//! * The script is a Redis function library, loaded once on every primary (`FUNCTION LOAD`) and
//!   called with `FCALL`; a missing function (restart, `FUNCTION FLUSH`, a node that never saw
//!   it) loads it again on every primary and retries. Where `FUNCTION LOAD` is refused, the same
//!   code goes by `EVALSHA` (`library.rs`).
//! * Requests that arrive while every call to a Redis is out go together in the next call
//!   (`batch.rs`): one `FCALL` decides tens of requests under load, each on its own. On a
//!   cluster each master batches its own, requests of many of its slots in one call
//!   (`nodes.rs`).
//! * A request whose descriptors sit in slots of one master is one call there, decided whole
//!   (the script's spread function reaches the keys of all its slots). One over several masters
//!   sends one call per master, concurrently, in tentative mode; if the combined answer is a
//!   rejection, members recorded by the calls that recorded are removed again. That can briefly
//!   make other requests see a fuller log (never an emptier one), so it can under-admit for a
//!   moment, never over-admit.
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
mod library;
mod nodes;
pub mod packed;
use batch::{Batcher, Request, Sender, Slots, not_served};
pub use library::Library;
use nodes::Nodes;

pub use crate::tls::TlsFiles;

use super::{
    Algorithm, CheckItem, CheckOutcome, ItemOutcome, Role, Store, StoreError, StoreFuture,
    WindowOutcome, admits,
};

type UndoFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send + 'a>>;

/// The script, embedded in the binary.
pub const SCRIPT: &str = include_str!("../../lua/slidegate.lua");

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
    /// Deadline for one decision, all slots included.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub clock: ClockSource,
    /// CA, client certificate and hostname policy for `rediss://`; empty: system CAs.
    pub tls: TlsFiles,
    /// Script calls out at once to a Redis (on a cluster, to each master):
    /// [`RedisOptions::CALLS_OUT`], or 1 for each of several stores that share a Redis
    /// (`--thread-per-core`).
    pub calls_out: usize,
}

impl RedisOptions {
    /// Script calls out at once from one store to a Redis, whatever the pool size. Redis runs
    /// one at a time, so a second keeps it busy while a reply travels back; more only queue
    /// inside Redis, where waiting counts against the store deadline (with four out, a Redis
    /// short of CPU for a few ms failed whole calls at the deadline in the benchmark; with two,
    /// none). The requests that arrive meanwhile wait here and go together in the next call.
    pub const CALLS_OUT: usize = 2;
}

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
    /// Standalone Redis: gathers requests that wait into one call (`batch.rs`).
    batcher: Option<Arc<Batcher>>,
    /// Redis Cluster: the same per master (`nodes.rs`).
    nodes: Option<Nodes>,
}

/// The longest a decision waits for its turn to be sent (a caller's own deadline, Envoy's
/// filter timeout sent as `grpc-timeout`, ends it sooner).
const QUEUED_AT_MOST: Duration = Duration::from_secs(1);

/// How a script call decides (a request's third argument in `lua/slidegate.lua`).
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
    /// The script's code for the mode (`lua/slidegate.lua`).
    fn code(self) -> u64 {
        match self {
            Mode::Tentative => 0,
            Mode::Final => 1,
            Mode::Rejected => 2,
        }
    }
}

/// How long every call may fail before the client pool is replaced: short, so a client left
/// unable to route resumes well within a second; a replacement costs one connection attempt.
const REPLACE_AFTER: Duration = Duration::from_millis(250);

/// The longest wait between replacement attempts while new clients cannot connect (Redis is
/// down: the old pool reconnects by itself, so trying often gains nothing).
const REPLACE_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// Whether calls have been failing, and since when.
struct Health {
    /// Since when calls have failed, counted afresh after each replacement attempt.
    failing_since: Option<Instant>,
    /// Since when calls have failed without a success in between.
    streak_since: Option<Instant>,
    /// The wait before the next replacement attempt.
    retry_after: Duration,
    replacing: bool,
    /// Fresh pools that connected, yet calls kept failing through them.
    replaced_in_vain: u32,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            failing_since: None,
            streak_since: None,
            retry_after: REPLACE_AFTER,
            replacing: false,
            replaced_in_vain: 0,
        }
    }
}

/// The store cannot recover by itself (`/healthz` says so) when this many fresh pools connected
/// and did not help, over at least [`HOPELESS_STREAK`] of failing calls: long enough that a
/// failover, where new clients connect before a replica is promoted, does not count.
const HOPELESS_AFTER: u32 = 3;
const HOPELESS_STREAK: Duration = Duration::from_secs(5);

fn lock(health: &Mutex<Health>) -> std::sync::MutexGuard<'_, Health> {
    // The state is two plain fields; one left by a panicking holder is still usable.
    health
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a pool is built from, kept to build a fresh one.
struct PoolRecipe {
    config: Config,
    options: RedisOptions,
}

impl PoolRecipe {
    fn build(&self) -> Result<Pool, StoreError> {
        let options = &self.options;
        Builder::from_config(self.config.clone())
            .with_connection_config(|c| {
                c.connection_timeout = options.connect_timeout;
                // Small commands, sent as they come: Nagle's algorithm would hold one back
                // waiting for the ACK of the previous (and delayed ACKs make that tens of ms).
                c.tcp.nodelay = Some(true);
                // Cluster topology changes (a slot moved, a failover) need room: a MOVED makes
                // the client re-read the slots and send again, and a connection that stops
                // answering is replaced rather than waited on.
                c.max_command_attempts = 5;
                c.max_redirections = 10;
                c.internal_command_timeout = options.connect_timeout;
                c.unresponsive.max_timeout = Some(options.connect_timeout);
                c.unresponsive.interval = options.connect_timeout / 4;
            })
            // The client gives a command up at the store deadline and marks it so, which keeps
            // it from being sent after a reconnection once its call has failed (see
            // `RedisStore::checked`).
            .with_performance_config(|p| p.default_command_timeout = options.timeout)
            // Retries at most every half second, so calls resume soon after Redis returns.
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 500, 2))
            .build_pool(options.pool_size.max(1))
            .map_err(|e| unavailable(&e))
    }

    /// A new pool, connected and with the script loaded, or why not.
    async fn fresh(&self, library: &Library) -> Result<Pool, StoreError> {
        let pool = self.build()?;
        let deadline = self.options.connect_timeout;
        let connect = async {
            pool.init().await?;
            library
                .load(pool.next(), self.options.connect_timeout)
                .await
        };
        match tokio::time::timeout(deadline, connect).await {
            Ok(Ok(())) => Ok(pool),
            Ok(Err(e)) => {
                let _ = pool.quit().await;
                Err(unavailable(&e))
            }
            Err(_) => {
                let _ = pool.quit().await;
                Err(StoreError::Timeout(deadline))
            }
        }
    }
}

/// The URL with any password (in the user info or a `sentinelPassword` parameter) replaced,
/// safe for logs.
pub fn redact(url: &str) -> String {
    let url = match url.split_once("sentinelPassword=") {
        Some((before, after)) => {
            let rest = after.find('&').map_or("", |at| &after[at..]);
            format!("{before}sentinelPassword=***{rest}")
        }
        None => url.to_string(),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return url;
    };
    // The last `@` ends the user info, as the client reads it: a password may hold an `@`.
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url,
    }
}

/// Accepts the comma form `redis-cluster://h1:p1,h2:p2` and turns it into the client's
/// `redis-cluster://h1:p1?node=h2:p2` form.
fn client_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    if !scheme.ends_with("-cluster") {
        return url.to_string();
    }
    let (authority, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut hosts = hosts.trim_end_matches('/').split(',');
    let first = hosts.next().unwrap_or_default();
    let mut out = format!("{scheme}://");
    if let Some(u) = userinfo {
        out.push_str(u);
        out.push('@');
    }
    out.push_str(first);
    let extra: Vec<String> = hosts
        .filter(|h| !h.is_empty())
        .map(|h| format!("node={h}"))
        .collect();
    let mut params: Vec<String> = query.into_iter().map(str::to_string).collect();
    params.extend(extra);
    if !params.is_empty() {
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

/// The error code the script puts first in its error replies (Redis error replies start with a
/// code, like `WRONGTYPE` or `NOSCRIPT`).
const SCRIPT_ERROR_CODE: &str = "SLIDEGATE";

fn unavailable(e: &Error) -> StoreError {
    // fred's messages carry the error kind and the server's reply text, never the URL.
    StoreError::Unavailable {
        context: format!("{:?}: {}", e.kind(), e.details()),
        source: Some(std::sync::Arc::new(e.clone())),
    }
}

/// Whether an error text is the script's own (its error code first): the call or request was
/// malformed, a protocol error, not the store being unavailable.
fn is_script_error(text: &str) -> bool {
    text.split_whitespace().next() == Some(SCRIPT_ERROR_CODE)
}

/// A script call's failure: the script's own error reply is a protocol error; anything else is
/// the store being unavailable.
fn call_failed(e: &Error) -> StoreError {
    if is_script_error(e.details()) {
        StoreError::Protocol(e.details().to_string())
    } else {
        unavailable(e)
    }
}

/// One request of a call failed inside the script: what Redis said (a key of another type, say)
/// or the script's own error.
fn request_failed(message: &str) -> StoreError {
    if is_script_error(message) {
        StoreError::Protocol(message.to_string())
    } else {
        StoreError::unavailable(format!("script: {message}"))
    }
}

/// Tries one connection with `config`: `Ok(true)` when Redis answers, `Ok(false)` when it cannot
/// be reached yet (refused, timed out, a cluster not ready), and an error for what waiting will
/// not fix (a wrong password, a bad TLS set-up, a bad URL).
async fn probe(config: &Config, deadline: Duration) -> Result<bool, StoreError> {
    let client = Builder::from_config(config.clone())
        .with_connection_config(|c| c.connection_timeout = deadline)
        .build()
        .map_err(|e| unavailable(&e))?;
    let outcome = tokio::time::timeout(deadline, client.init()).await;
    match outcome {
        Ok(Ok(_)) => {
            let _ = client.quit().await;
            Ok(true)
        }
        Ok(Err(e)) if !transient(&e) => Err(unavailable(&e)),
        Ok(Err(e)) => {
            tracing::warn!(error = %unavailable(&e), "Redis is not reachable yet; serving by the store-failure policy until it is");
            Ok(false)
        }
        Err(_) => {
            tracing::warn!(
                "Redis did not answer within {deadline:?}; serving by the store-failure policy until it does"
            );
            Ok(false)
        }
    }
}

/// Errors that go away by themselves: Redis not up yet, a network blip, a cluster forming. A
/// TLS handshake refused (an alert, a certificate for another name) arrives as an I/O error of
/// kind `InvalidData`, and waiting will not fix it.
fn transient(e: &Error) -> bool {
    match e.kind() {
        ErrorKind::IO => !e.details().contains("InvalidData"),
        ErrorKind::Timeout | ErrorKind::Canceled | ErrorKind::Cluster => true,
        _ => false,
    }
}

/// The client's configuration from the URL and the TLS files.
fn client_config(options: &RedisOptions) -> Result<Config, StoreError> {
    let url = client_url(&options.url);
    let mut config = Config::from_url(&url).map_err(|e| {
        StoreError::unavailable(format!(
            "invalid Redis URL {}: {}",
            redact(&options.url),
            e.details()
        ))
    })?;
    if !options.tls.is_empty() {
        if config.tls.is_none() {
            return Err(StoreError::unavailable(
                "Redis TLS files were given for a URL without TLS: use rediss:// (or REDIS_TLS=true)",
            ));
        }
        config.tls = Some(
            fred::types::config::TlsConnector::from(
                crate::tls::client_config(&options.tls)
                    .map_err(|e| StoreError::unavailable(format!("Redis TLS: {e}")))?,
            )
            .into(),
        );
    }
    Ok(config)
}

/// The pool: connected and with the script loaded when Redis is reachable, else connecting in
/// the background. Redis answered the probe, yet the pool's connections or the script may take
/// longer than `--redis-connect-timeout` on a busy machine: then the connections keep coming up
/// in the background and the first call loads the script (as after a `FUNCTION FLUSH`), rather
/// than slidegate refusing to start over what waiting fixes. What waiting will not fix (a
/// refused password, a script Redis rejects) still stops the start.
async fn start_pool(
    recipe: &PoolRecipe,
    library: &Library,
    reachable: bool,
) -> Result<Pool, StoreError> {
    let pool = recipe.build()?;
    let deadline = recipe.options.connect_timeout;
    if reachable {
        match tokio::time::timeout(deadline, pool.init()).await {
            Ok(Ok(_)) => match library.load(pool.next(), deadline).await {
                Ok(()) => {}
                Err(e) if transient(&e) => tracing::warn!(
                    error = %unavailable(&e),
                    "the script was not loaded into Redis at start; the first call loads it"
                ),
                Err(e) => return Err(unavailable(&e)),
            },
            Ok(Err(e)) => return Err(unavailable(&e)),
            // The connections keep coming up: dropping the wait does not stop them.
            Err(_) => tracing::warn!(
                "Redis answered, but the connections were not all up within {deadline:?}; they keep connecting, and calls answer by the store-failure policy until they are"
            ),
        }
    } else {
        let connecting = pool.clone();
        tokio::spawn(async move {
            match connecting.init().await {
                Ok(_) => tracing::info!("connected to Redis"),
                Err(e) => tracing::error!(error = %unavailable(&e), "cannot connect to Redis"),
            }
        });
    }
    Ok(pool)
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
        Ok(RedisStore {
            sender: Sender {
                pool: Arc::new(ArcSwap::from_pointee(pool)),
                library,
                load_timeout: options.connect_timeout,
                resent: Arc::default(),
                timeout: options.timeout,
            },
            batcher: (!cluster).then(|| Batcher::new(options.calls_out, QUEUED_AT_MOST)),
            nodes: cluster.then(|| Nodes::new(options.calls_out, QUEUED_AT_MOST)),
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
        })
    }

    /// A client of the pool, for tests and tools that look at the keys directly.
    pub fn client(&self) -> Client {
        self.sender.pool.load().next().clone()
    }

    /// Follows how calls go. A pool whose calls have all failed for [`REPLACE_AFTER`] is
    /// replaced by a fresh one (in the background; calls go on meanwhile): a cluster client can
    /// be left unable to route after its topology changed under it (a slot migrated), and a new
    /// client reads the topology afresh. If the new pool cannot connect either (Redis is down),
    /// the old one stays and keeps reconnecting, and the next try waits twice as long, up to
    /// [`REPLACE_AT_MOST_EVERY`].
    fn note(&self, ok: bool) {
        // A success while nothing failed (nearly every call) changes nothing. A failure noted
        // concurrently may be missed by this read; the next success clears it.
        if ok && !self.failing.load(Ordering::Relaxed) {
            return;
        }
        let mut health = lock(&self.health);
        // Written under the lock, so the flag is set whenever `failing_since` is.
        self.failing.store(!ok, Ordering::Relaxed);
        if ok {
            if health.failing_since.is_some() {
                *health = Health {
                    replacing: health.replacing,
                    ..Health::default()
                };
            }
            return;
        }
        let now = Instant::now();
        health.streak_since.get_or_insert(now);
        let since = *health.failing_since.get_or_insert(now);
        if since.elapsed() < health.retry_after || health.replacing {
            return;
        }
        health.replacing = true;
        drop(health);
        let (pool, recipe, health) = (
            self.sender.pool.clone(),
            self.recipe.clone(),
            self.health.clone(),
        );
        let library = self.sender.library.clone();
        tokio::spawn(async move {
            let replaced = recipe.fresh(&library).await;
            let mut state = lock(&health);
            state.replacing = false;
            // Calls that succeeded meanwhile ended the streak: nothing more to count.
            let still_failing = state.failing_since.is_some();
            if still_failing {
                state.failing_since = Some(Instant::now());
            }
            match replaced {
                Ok(fresh) => {
                    tracing::warn!("Redis calls kept failing: replaced the client pool");
                    let old = pool.swap(Arc::new(fresh));
                    state.replaced_in_vain += u32::from(still_failing);
                    state.retry_after = REPLACE_AFTER;
                    tokio::spawn(async move {
                        let _ = old.quit().await;
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Redis calls keep failing and a new client cannot connect either");
                    state.retry_after = (state.retry_after * 2).min(REPLACE_AT_MOST_EVERY);
                }
            }
        });
    }

    async fn call_group(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> Result<GroupReply, StoreError> {
        let request = self.script_input(items, group, now_ms, call, mode);
        let batcher = self.batcher.as_ref().or(group.master.as_ref());
        let answer = match batcher {
            Some(batcher) => batcher.submit(request, &self.sender).await,
            // A cluster whose slots the client has not read yet, or a slot sent again after
            // its master refused it: the client routes it alone.
            None => self.sender.call_one(request).await,
        };
        parse_reply(&answer?, items, &group.items, mode == Mode::Tentative)
    }

    /// The script's `KEYS` and `ARGV` for the items of `group`, as one request of a call
    /// (layout in `lua/slidegate.lua`).
    fn script_input(
        &self,
        items: &[CheckItem<'_>],
        group: &Group,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> Request {
        let (group, slots) = (&group.items, group.slots);
        let mut keys = Vec::with_capacity(group.len() * 2);
        let mut args: Vec<Value> = Vec::with_capacity(2 + group.len() * 2);
        // The request's shape: its descriptor count and mode in one argument.
        args.push(batch::number(4 * group.len() as u64 + mode.code()));
        for &i in group {
            let item = &items[i];
            let ban_ms = item.ban_ms.unwrap_or(0);
            keys.push(Key::from(match item.algorithm {
                Algorithm::SlidingLog => item.key.log(),
                Algorithm::SlidingCounter { .. } => item.key.counters(),
            }));
            if ban_ms > 0 {
                keys.push(Key::from(item.key.ban()));
            }
            args.push(batch::number(item.hits));
            args.push(Value::String(rule_arg(item, ban_ms)));
        }
        // The prefix names a tentative request's entries, for their removal (`undo`); the
        // script writes the others' without it, so they send none.
        if mode == Mode::Tentative {
            args.push(Value::String(self.prefix(call).into()));
        }
        let now_ms = match self.clock {
            ClockSource::Server => Some(now_ms),
            ClockSource::Redis => None,
        };
        Request {
            now_ms,
            keys,
            args,
            slots,
            lane: call.lane,
            deadline: super::caller_deadline(),
        }
    }

    /// The member prefix of a request's tentative log entries: unique to this process (its
    /// instance) and request.
    fn prefix(&self, call: &Call) -> String {
        let mut prefix = String::with_capacity(self.instance.len() + 21);
        prefix.push_str(&self.instance);
        prefix.push('-');
        push_decimal(&mut prefix, call.number);
        prefix
    }

    /// With `rejected`, the request is already rejected elsewhere (`Store::check_rejected`).
    async fn decide(
        &self,
        items: &[CheckItem<'_>],
        groups: Vec<Group>,
        now_ms: u64,
        rejected: bool,
    ) -> Result<CheckOutcome, StoreError> {
        let number = self.calls.fetch_add(1, Ordering::Relaxed);
        let call = Call {
            number,
            // Requests take the pool's clients in turn, as `Pool::next` would hand them out
            // (the low 32 bits: a `usize` on every target).
            lane: usize::try_from(number & u64::from(u32::MAX)).unwrap_or(0),
        };
        let mode = match (rejected, groups.len()) {
            (true, _) => Mode::Rejected,
            (false, 1) => Mode::Final,
            (false, _) => Mode::Tentative,
        };
        // One group (standalone Redis, or one slot) is awaited as it is: collecting its large
        // future into a list for `join_all` would copy it for nothing.
        let replies = match groups.as_slice() {
            [group] => vec![self.call_group(items, group, now_ms, &call, mode).await],
            _ => {
                join_all(
                    groups
                        .iter()
                        .map(|g| self.call_group(items, g, now_ms, &call, mode)),
                )
                .await
            }
        };
        let (groups, replies, mode) = if replies.iter().any(not_served) {
            // Boxed: rare, and its future would otherwise enlarge every decision's.
            Box::pin(self.per_slot(items, groups, replies, now_ms, &call, mode)).await
        } else {
            (groups, replies, mode)
        };
        let mut outcomes = vec![ItemOutcome::default(); items.len()];
        let mut recorded_groups: Vec<(&[usize], u64, Vec<Entry>)> = Vec::new();
        let mut first_error = None;
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(reply) => {
                    if reply.recorded() {
                        recorded_groups.push((&group.items, reply.now_ms, reply.entries));
                    }
                    for (&i, outcome) in group.items.iter().zip(reply.items) {
                        outcomes[i] = outcome;
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let admitted = first_error.is_none()
            && !rejected
            && admits(items.iter().zip(&outcomes).map(|(i, o)| (i.role, o.fits)));
        if mode == Mode::Tentative && !admitted && !recorded_groups.is_empty() {
            // Boxed: rare, and its future would otherwise enlarge every decision's.
            Box::pin(self.undo(items, &recorded_groups, &call, &mut outcomes)).await;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(CheckOutcome {
                admitted,
                items: outcomes,
            }),
        }
    }

    /// The groups of several slots whose master refused one of their keys (it no longer serves
    /// that slot), sent again as a call per slot, where the client follows the cluster's
    /// redirections: tentatively, as the request now spans several calls, unless it was already
    /// rejected. Such a group recorded nothing (see the end of `lua/slidegate.lua`); the other
    /// groups' replies stand (they were tentative, as the request had several groups).
    async fn per_slot(
        &self,
        items: &[CheckItem<'_>],
        groups: Vec<Group>,
        replies: Vec<Result<GroupReply, StoreError>>,
        now_ms: u64,
        call: &Call,
        mode: Mode,
    ) -> (Vec<Group>, Vec<Result<GroupReply, StoreError>>, Mode) {
        let mut kept = Vec::with_capacity(groups.len() + 2);
        let mut again = Vec::new();
        for (group, reply) in groups.into_iter().zip(replies) {
            if group.slots == Slots::Several && not_served(&reply) {
                again.extend(self.slot_groups(items, &group.items));
            } else {
                kept.push((group, reply));
            }
        }
        tracing::debug!(
            calls = again.len(),
            "a master no longer serves every slot of a request: a call per slot"
        );
        self.sender.resent.fetch_add(1, Ordering::Relaxed);
        let mode = if mode == Mode::Rejected {
            mode
        } else {
            Mode::Tentative
        };
        let replies = join_all(
            again
                .iter()
                .map(|g| self.call_group(items, g, now_ms, call, mode)),
        )
        .await;
        kept.extend(again.into_iter().zip(replies));
        let (groups, replies) = kept.into_iter().unzip();
        (groups, replies, mode)
    }

    /// Removes the entries a rejected request recorded in the slots that admitted it (debits
    /// stay: that usage happened). A removed log entry leaves the running totals of later
    /// entries as they were, so windows that still hold an earlier entry count its hits until
    /// that entry ages out: stricter for a while, never looser.
    async fn undo(
        &self,
        items: &[CheckItem<'_>],
        groups: &[(&[usize], u64, Vec<Entry>)],
        call: &Call,
        outcomes: &mut [ItemOutcome],
    ) {
        let prefix = self.prefix(call);
        let mut removals = Vec::new();
        for (group, now_ms, entries) in groups {
            for (position, (&i, &Entry { cum, at_ms })) in group.iter().zip(entries).enumerate() {
                let item = &items[i];
                if !outcomes[i].recorded || item.debit {
                    continue;
                }
                outcomes[i].recorded = false;
                for w in outcomes[i].windows.iter_mut() {
                    w.count = w.count.saturating_sub(item.hits);
                }
                let client = batch::client_of(&self.sender.pool.load(), call.lane).clone();
                match item.algorithm {
                    Algorithm::SlidingLog => {
                        // The member as the script wrote it for a tentative request:
                        // "<cum>:<weight>:<time>:<prefix>:<i>", i 1-based per call.
                        let member =
                            format!("{cum:020}:{}:{at_ms}:{prefix}:{}", item.hits, position + 1);
                        removals.push(Box::pin(async move {
                            client
                                .zrem::<i64, _, _>(item.key.log(), member)
                                .await
                                .map(|_| ())
                        }) as UndoFuture<'_>);
                    }
                    Algorithm::SlidingCounter { buckets } => {
                        // The script added the hits once to the current bucket of every
                        // distinct bucket length.
                        let hits = i64::try_from(item.hits).unwrap_or(i64::MAX);
                        let mut sizes: Vec<u64> = item
                            .windows
                            .iter()
                            .map(|w| w.bucket_span(buckets, *now_ms).0)
                            .collect();
                        sizes.sort_unstable();
                        sizes.dedup();
                        for size in sizes {
                            let field = format!("{size}:{}", now_ms / size);
                            let client = client.clone();
                            removals.push(Box::pin(async move {
                                client
                                    .hincrby::<i64, _, _>(item.key.counters(), field, -hits)
                                    .await
                                    .map(|_| ())
                            }));
                        }
                    }
                }
            }
        }
        for result in join_all(removals).await {
            if let Err(e) = result {
                // The members stay until they age out: stricter, never looser.
                tracing::warn!(error = %unavailable(&e), "could not remove hits of a rejected cross-slot request");
            }
        }
    }

    /// A single group on standalone Redis. On a cluster, one group per master that serves
    /// the items' slots (a call of the spread function reaches them all: see *The script* in
    /// the README), or, while the masters are not known or the script goes by `EVALSHA`, one
    /// per slot.
    fn groups(&self, items: &[CheckItem<'_>]) -> Vec<Group> {
        let Some(nodes) = &self.nodes else {
            return vec![Group {
                items: (0..items.len()).collect(),
                slots: Slots::Standalone,
                master: None,
            }];
        };
        let mut groups = self.slot_groups(items, &(0..items.len()).collect::<Vec<_>>());
        let pool = self.sender.pool.load();
        for group in &mut groups {
            if let Slots::One(slot) = group.slots {
                group.master = nodes.batcher(slot, pool.next());
            }
        }
        if groups.len() == 1 || !self.sender.library.spreads() {
            return groups;
        }
        // Slots of one master in one group.
        let mut merged: Vec<Group> = Vec::with_capacity(groups.len());
        for group in groups {
            let same = merged
                .iter_mut()
                .find(|m| match (&m.master, &group.master) {
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    _ => false,
                });
            match same {
                Some(m) => {
                    m.items.extend(group.items);
                    m.slots = Slots::Several;
                }
                None => merged.push(group),
            }
        }
        merged
    }

    /// One group per hash slot of the items at `members`, each with no master chosen.
    fn slot_groups(&self, items: &[CheckItem<'_>], members: &[usize]) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for &i in members {
            let slot = Slots::One(fred::util::redis_keyslot(items[i].key.tag().as_bytes()));
            match groups.iter_mut().find(|g| g.slots == slot) {
                Some(group) => group.items.push(i),
                None => groups.push(Group {
                    items: vec![i],
                    slots: slot,
                    master: None,
                }),
            }
        }
        groups
    }
}

/// What the calls of one request share: its number in this process, which names its
/// tentative log entries ([`RedisStore::prefix`]), and the client that carries them
/// ([`Request::lane`]).
struct Call {
    number: u64,
    lane: usize,
}

/// Items of a request that go in one script call.
struct Group {
    items: Vec<usize>,
    slots: Slots,
    /// On a cluster, the batcher of the master that serves them, when known.
    master: Option<Arc<Batcher>>,
}

struct GroupReply {
    now_ms: u64,
    items: Vec<ItemOutcome>,
    /// Per item, the log entry it recorded (zeros: none).
    entries: Vec<Entry>,
}

/// A log entry a request recorded: its running total and, in a tentative request, its time,
/// which with the request's prefix name it, for its removal ([`RedisStore::undo`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    cum: u64,
    at_ms: u64,
}

impl GroupReply {
    /// Whether the call recorded anything (a descriptor's entry or hits) for its request.
    fn recorded(&self) -> bool {
        self.items.iter().any(|o| o.recorded)
    }
}

/// A configured rule as the script reads it, per role and debit (the global quota mode and the
/// domains that take debits make those differ from the rule's own), each made the first time it
/// is sent and kept in the rule's memo.
#[derive(Default)]
struct RuleTexts([std::sync::OnceLock<Str>; 6]);

/// The item's rule as the script reads it, from its rule's memo when it has one: building the
/// text was about 700 instructions and an allocation per descriptor per call (`cargo bench
/// --bench server_cost`).
fn rule_arg(item: &CheckItem<'_>, ban_ms: u64) -> Str {
    let make = || Str::from(rule_text(item, ban_ms));
    match item
        .memo
        .and_then(|memo| memo.get_or_init(RuleTexts::default))
    {
        Some(texts) => {
            let role = match item.role {
                Role::Enforce => 0,
                Role::Shadow => 1,
                Role::Quota => 2,
            };
            texts.0[role * 2 + usize::from(item.debit)]
                .get_or_init(make)
                .clone()
        }
        None => make(),
    }
}

/// An item's rule as the script reads it: `role:ban_ms:buckets:debit`, then `limit:window_ms`
/// per window (layout in `lua/slidegate.lua`).
fn rule_text(item: &CheckItem<'_>, ban_ms: u64) -> String {
    let role = match item.role {
        Role::Enforce => 0,
        Role::Shadow => 1,
        Role::Quota => 2,
    };
    let buckets = match item.algorithm {
        Algorithm::SlidingLog => 0,
        Algorithm::SlidingCounter { buckets } => buckets,
    };
    let mut text = String::with_capacity(16 + item.windows.len() * 20);
    push_decimal(&mut text, role);
    for n in [ban_ms, u64::from(buckets), u64::from(item.debit)] {
        text.push(':');
        push_decimal(&mut text, n);
    }
    for w in item.windows.iter() {
        text.push(':');
        push_decimal(&mut text, u64::from(w.limit));
        text.push(':');
        push_decimal(&mut text, w.length_ms);
    }
    text
}

/// Appends `n` in decimal. The rule text and the member prefix are made for every call:
/// `write!` would run the formatting machinery, several times the work, for each number.
fn push_decimal(text: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + u8::try_from(n % 10).unwrap_or(0);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[at..] {
        text.push(char::from(d));
    }
}

/// The flags of a descriptor in the script's reply (layout in `lua/slidegate.lua`).
const FITS: u64 = 1;
const BAN_SET: u64 = 2;
const RECORDED: u64 = 4;
const BANNED: u64 = 8;

/// Reads the script's reply (layout in `lua/slidegate.lua`); anything else is a protocol error.
fn parse_reply(
    reply: &[i64],
    items: &[CheckItem<'_>],
    group: &[usize],
    tentative: bool,
) -> Result<GroupReply, StoreError> {
    let bad = |what: &str| StoreError::Protocol(format!("script reply {what}"));
    let mut values = reply.iter().copied();
    let mut next = |what: &str| -> Result<u64, StoreError> {
        let v = values
            .next()
            .ok_or_else(|| bad(&format!("ended before {what}")))?;
        u64::try_from(v).map_err(|_| bad(&format!("has a negative {what}")))
    };
    let now_ms = next("now")?;
    let mut outcomes = Vec::with_capacity(group.len());
    let mut entries = Vec::with_capacity(group.len());
    for &i in group {
        let flags = next("flags")?;
        if flags >= BANNED * 2 {
            return Err(bad("has unknown flags"));
        }
        let has = |flag: u64| flags & flag != 0;
        let ban_remaining_ms = if has(BANNED) { next("ban")? } else { 0 };
        if has(BANNED) == (ban_remaining_ms == 0) {
            return Err(bad("has a ban flag and time that disagree"));
        }
        // A tentative request's entry is named by its time too.
        entries.push(match (has(RECORDED), tentative) {
            (true, true) => Entry {
                cum: next("entry")?,
                at_ms: next("entry's time")?,
            },
            (true, false) => Entry {
                cum: next("entry")?,
                at_ms: 0,
            },
            (false, _) => Entry::default(),
        });
        // A banned item reports no windows; the others one pair per window of their rule.
        let m = if has(BANNED) {
            0
        } else {
            items[i].windows.len()
        };
        let mut windows = Vec::with_capacity(m);
        for _ in 0..m {
            windows.push(WindowOutcome {
                count: next("count")?,
                reset_ms: next("reset")?,
            });
        }
        outcomes.push(ItemOutcome {
            recorded: has(RECORDED),
            ban_remaining_ms,
            ban_set: has(BAN_SET),
            fits: has(FITS),
            windows,
        });
    }
    if values.next().is_some() {
        return Err(bad("is longer than expected"));
    }
    Ok(GroupReply {
        now_ms,
        items: outcomes,
        entries,
    })
}

impl RedisStore {
    /// [`RedisStore::decide`] when its turn comes, and the health note of how it went.
    /// `--redis-timeout` bounds each command from the moment it is handed to the client: the
    /// client's own timeout, which also marks the command so that it is never sent after a
    /// reconnection once its caller was told it failed (a timer of ours dropping the call would
    /// leave it unmarked, and Redis would record hits for a call long answered with an error).
    /// Under load, decisions wait for their turn inside slidegate, where waiting sends nothing,
    /// up to [`QUEUED_AT_MOST`]: time spent behind other calls is not Redis being slow. The
    /// batchers' queues are the wait (`batch.rs`), one per master on a cluster.
    async fn checked(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        rejected: bool,
    ) -> Result<CheckOutcome, StoreError> {
        let groups = self.groups(items);
        let result = self.decide(items, groups, now_ms, rejected).await;
        // A protocol error is an answer: the client works.
        self.note(!matches!(
            result,
            Err(StoreError::Timeout(_) | StoreError::Unavailable { .. })
        ));
        result
    }
}

impl Store for RedisStore {
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        Box::pin(self.checked(items, now_ms, false))
    }

    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a> {
        Box::pin(self.checked(items, now_ms, true))
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

    fn alive(&self) -> bool {
        let health = lock(&self.health);
        let streak = health
            .streak_since
            .map_or(Duration::ZERO, |at| at.elapsed());
        health.replaced_in_vain < HOPELESS_AFTER || streak < HOPELESS_STREAK
    }

    fn ready(&self) -> super::ReadyFuture<'_> {
        Box::pin(async move {
            let ping: Result<Result<String, Error>, _> = tokio::time::timeout(
                self.sender.timeout.max(Duration::from_millis(200)),
                self.sender.pool.load().next().ping(None),
            )
            .await;
            matches!(ping, Ok(Ok(_)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(
            redact("redis://:secret@host:6379"),
            "redis://:***@host:6379"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        // The client reads user info up to the last `@`, so the password may hold one.
        assert_eq!(
            redact("redis://u:p@ss@host:6379"),
            "redis://u:***@host:6379"
        );
        assert_eq!(
            redact("redis-sentinel://h:26379?sentinelServiceName=m&sentinelPassword=pw&node=x:1"),
            "redis-sentinel://h:26379?sentinelServiceName=m&sentinelPassword=***&node=x:1"
        );
    }

    #[test]
    fn replies_that_do_not_match_the_request_are_protocol_errors() {
        let key = crate::store::StoreKey::new("d:k=v", "");
        let items = [CheckItem {
            key,
            windows: std::borrow::Cow::Owned(vec![crate::store::Window {
                limit: 5,
                length_ms: 1000,
            }]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits: 1,
            role: Role::Enforce,
            debit: false,
            memo: None,
        }];
        // now, flags (fits, recorded), entry, count, reset.
        let good = [1_000, 5, 7, 1, 999];
        let reply = parse_reply(&good, &items, &[0], false).expect("well-formed");
        assert!(reply.recorded() && reply.items[0].fits && reply.items[0].recorded);
        assert_eq!(reply.items[0].windows[0].count, 1);
        assert_eq!(reply.items[0].windows[0].reset_ms, 999);
        assert_eq!(reply.entries, [Entry { cum: 7, at_ms: 0 }]);
        // Tentative: the entry's time follows its running total.
        let tentative =
            parse_reply(&[1_000, 5, 7, 990, 1, 999], &items, &[0], true).expect("well-formed");
        assert_eq!(tentative.entries, [Entry { cum: 7, at_ms: 990 }]);
        assert_eq!(tentative.items[0].windows[0].reset_ms, 999);
        assert!(parse_reply(&good, &items, &[0], true).is_err(), "no time");
        // Rejected: no entry, so the count follows the flags.
        let rejected = parse_reply(&[1_000, 0, 5, 400], &items, &[0], false).expect("well-formed");
        assert!(!rejected.recorded() && !rejected.items[0].fits);
        assert_eq!(
            (rejected.items[0].windows[0].count, rejected.entries[0]),
            (5, Entry::default())
        );
        // Banned by this request: the ban's time, and no windows.
        let banned =
            parse_reply(&[1_000, 2 | 8, 900_000], &items, &[0], false).expect("well-formed");
        assert!(banned.items[0].ban_set && banned.items[0].windows.is_empty());
        assert_eq!(banned.items[0].ban_remaining_ms, 900_000);
        for wrong in [
            &good[..4],                // ends early
            &[1_000, 5, 7, 1, 999, 0], // longer
            &[1_000, 16, 7, 1, 999],   // unknown flag
            &[1_000, 8, 0],            // banned for no time
            &[1_000, 5, -7, 1, 999],   // negative
        ] {
            assert!(
                matches!(
                    parse_reply(wrong, &items, &[0], false),
                    Err(StoreError::Protocol(_))
                ),
                "{wrong:?}"
            );
        }
    }

    #[test]
    fn numbers_in_the_rule_text_and_prefix_are_plain_decimal() {
        for n in [0, 7, 10, 99, 1_000_000, u64::from(u32::MAX), u64::MAX] {
            let mut text = String::from("x");
            push_decimal(&mut text, n);
            assert_eq!(text, format!("x{n}"));
        }
        let item = CheckItem {
            key: crate::store::StoreKey::new("d:k=v", ""),
            windows: std::borrow::Cow::Owned(vec![
                crate::store::Window {
                    limit: 5,
                    length_ms: 1000,
                },
                crate::store::Window {
                    limit: u32::MAX,
                    length_ms: 86_400_000,
                },
            ]),
            algorithm: Algorithm::SlidingCounter { buckets: 12 },
            ban_ms: Some(900_000),
            hits: 1,
            role: Role::Quota,
            debit: true,
            memo: None,
        };
        assert_eq!(
            rule_text(&item, 900_000),
            "2:900000:12:1:5:1000:4294967295:86400000"
        );
    }

    #[test]
    fn a_rules_text_is_made_once_per_role_and_debit() {
        let memo = crate::store::Memo::default();
        let windows = [crate::store::Window {
            limit: 5,
            length_ms: 1000,
        }];
        let item = |role, debit, memo| CheckItem {
            key: crate::store::StoreKey::new("d:k=v", ""),
            windows: std::borrow::Cow::Borrowed(&windows[..]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: Some(60_000),
            hits: 1,
            role,
            debit,
            memo,
        };
        for role in [Role::Enforce, Role::Shadow, Role::Quota] {
            for debit in [false, true] {
                let first = rule_arg(&item(role, debit, Some(&memo)), 60_000);
                let again = rule_arg(&item(role, debit, Some(&memo)), 60_000);
                let built = rule_arg(&item(role, debit, None), 60_000);
                assert_eq!(first, built, "{role:?} {debit}");
                assert_eq!(&*first, rule_text(&item(role, debit, None), 60_000));
                // Kept: the same text, not a copy.
                assert_eq!(first.as_ptr(), again.as_ptr(), "{role:?} {debit}");
                assert_ne!(first.as_ptr(), built.as_ptr());
            }
        }
    }

    #[test]
    fn cluster_urls_accept_a_comma_list() {
        assert_eq!(
            client_url("redis-cluster://a:1,b:2,c:3"),
            "redis-cluster://a:1?node=b:2&node=c:3"
        );
        assert_eq!(
            client_url("rediss-cluster://u:p@a:1,b:2?foo=1"),
            "rediss-cluster://u:p@a:1?foo=1&node=b:2"
        );
        assert_eq!(client_url("redis://a:1"), "redis://a:1");
    }

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
