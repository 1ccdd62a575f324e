//! The store contract: what the limiter hands a store, what a store answers, and the one rule
//! both stores decide by. Everything a store needs is defined here, so `store/` depends on
//! nothing in `limiter/` (the limiter depends on this contract, never the other way round).
//!
//! Both stores take the same batch and decide it the same way, atomically: a request's
//! descriptors are admitted all together or not at all. The embedded store ([`MemoryStore`])
//! decides under in-process locks; the Redis store decides inside one Lua function per hash slot
//! or cluster master (the library in `lua/`, whose `contract.lua` documents `KEYS`, `ARGV` and
//! the reply). The conformance
//! suite in `tests/` runs the same scenarios against each.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

mod deadline;
pub mod memory;
pub mod redis;
pub mod shares;

pub use deadline::{
    ANSWER_MARGIN, Bound, Deadlines, Waited, caller_deadline, with_caller_deadline,
};

pub use memory::MemoryStore;
pub use redis::{ClockSource, RedisOptions, RedisStore};
pub use shares::{Grant, QuotaFuture, QuotaItem, QuotaOutcome};

/// One window as a store counts it: at most `limit` hits in any interval of `length_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub limit: u32,
    pub length_ms: u64,
}

impl Window {
    /// For `sliding_counter`: the bucket length, and the oldest bucket that overlaps the window
    /// ending at `now_ms`. Every bucket from there on counts in full.
    pub fn bucket_span(&self, buckets: u32, now_ms: u64) -> (u64, u64) {
        let size = (self.length_ms / u64::from(buckets.max(1))).max(1);
        let oldest = now_ms.saturating_sub(self.length_ms) / size;
        (size, oldest)
    }
}

/// The longest of some windows: a log is trimmed by it.
pub fn longest_ms(windows: &[Window]) -> u64 {
    windows.iter().map(|w| w.length_ms).max().unwrap_or(0)
}

/// How a rule counts hits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// Exact: one log entry per admitted hit; memory grows with the limit.
    #[default]
    SlidingLog,
    /// Constant memory: each window is cut into `buckets` counters, and every bucket that
    /// overlaps the window counts in full. The count is never below the true one, so it never
    /// admits more than the limit in any window; it may reject for up to one bucket
    /// (window / buckets) longer than the exact log would.
    SlidingCounter { buckets: u32 },
}

/// The keys of one descriptor in the store: `rl:{<tag>}<rest>` plus a suffix per structure.
/// Redis Cluster hashes only the tag, so every key of one descriptor shares a slot.
/// `limiter::key::build` decides the tag (and escapes braces out of it); this type only lays
/// the key out.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreKey {
    base: String,
    tag_len: usize,
}

impl StoreKey {
    /// `tag` must hold no `{` or `}` (the builder escapes them), or the slot would move.
    pub fn new(tag: &str, rest: &str) -> StoreKey {
        debug_assert!(
            !tag.contains(['{', '}']),
            "unescaped brace in hash tag {tag:?}"
        );
        let mut base = String::with_capacity(tag.len() + rest.len() + 5);
        base.push_str("rl:{");
        base.push_str(tag);
        let tag_len = base.len();
        base.push('}');
        base.push_str(rest);
        StoreKey { base, tag_len }
    }

    /// The sorted-set log of admitted hits.
    pub fn log(&self) -> String {
        self.with_suffix(":log")
    }

    /// The bucket counters of `sliding_counter` rules: a hash, field `<bucket_ms>:<bucket>`.
    pub fn counters(&self) -> String {
        self.with_suffix(":cnt")
    }

    /// Where a rule of `algorithm` keeps its counts: the log, or the counters' hash.
    pub fn data(&self, algorithm: Algorithm) -> String {
        match algorithm {
            Algorithm::SlidingLog => self.log(),
            Algorithm::SlidingCounter { .. } => self.counters(),
        }
    }

    /// The ban marker, present (with a TTL) while the descriptor is banned.
    pub fn ban(&self) -> String {
        self.with_suffix(":ban")
    }

    /// The Envoys that hold a share of the descriptor's limit (Rate Limit Quota Service): a
    /// hash, field per holder.
    pub fn holders(&self) -> String {
        self.with_suffix(":hold")
    }

    /// Built for every descriptor of every Redis call: sized once and copied, without the
    /// formatting machinery `format!` runs.
    fn with_suffix(&self, suffix: &str) -> String {
        let mut key = String::with_capacity(self.base.len() + suffix.len());
        key.push_str(&self.base);
        key.push_str(suffix);
        key
    }

    /// The hash tag, without braces: keys with equal tags share a Redis Cluster slot.
    pub fn tag(&self) -> &str {
        &self.base["rl:{".len()..self.tag_len]
    }

    pub fn as_str(&self) -> &str {
        &self.base
    }
}

/// How a descriptor takes part in the admission decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Over limit rejects the request.
    Enforce,
    /// Observed only (`shadow_mode`): never rejects.
    Shadow,
    /// `quota_mode`: rejects only when every quota descriptor of the request is over.
    Quota,
}

impl Role {
    /// The role's number in the script's rule text.
    fn code(self) -> u64 {
        match self {
            Role::Enforce => 0,
            Role::Shadow => 1,
            Role::Quota => 2,
        }
    }
}

/// How the Redis store keeps a `sliding_log`: one compact string per log (the default, for
/// rules whose log holds at most [`COMPACT_LOG_MAX_ENTRIES`]), or a sorted set for every rule
/// (`docs/redis.md#the-compact-log`). Either reads a log written in the other, rewriting it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Compact,
    SortedSet,
}

/// The most entries a rule's log may hold (its longest window's limit) for the log to be kept
/// compact: a compact log is read and written whole by every call that changes it, a sorted
/// set by the entry, so past this a sorted set costs Redis less per decision
/// (`docs/performance.md#large-logs`), and a rule whose log can grow larger keeps one.
pub const COMPACT_LOG_MAX_ENTRIES: u32 = 1_000;

/// Whether a `sliding_log` rule of these windows keeps its log compact under `format`.
fn compact_log(windows: &[Window], format: LogFormat) -> bool {
    format == LogFormat::Compact
        && windows
            .iter()
            .max_by_key(|w| (w.length_ms, w.limit))
            .is_none_or(|w| w.limit <= COMPACT_LOG_MAX_ENTRIES)
}

/// A configured rule as the Redis script reads it, made once when the config compiles: one text
/// per role, debit and log format, since the global quota mode and the domains that take debits
/// can give a rule another role or debit than its own. The layout (`role:ban_ms:buckets:flags`,
/// flags 1 debit and 2 sorted-set log, then `limit:window_ms` per window) is the script's; the
/// embedded store has no use for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleText(Box<[Bytes; 12]>);

impl RuleText {
    pub fn new(windows: &[Window], algorithm: Algorithm, ban_ms: Option<u64>) -> RuleText {
        let text = |i: usize| {
            let role = [Role::Enforce, Role::Shadow, Role::Quota][i / 4];
            let format = [LogFormat::Compact, LogFormat::SortedSet][i % 2];
            Bytes::from(rule_text(
                windows,
                algorithm,
                ban_ms.unwrap_or(0),
                role,
                i / 2 % 2 == 1,
                format,
            ))
        };
        RuleText(Box::new(std::array::from_fn(text)))
    }

    /// The text for a request that gives the rule `role` and `debit`, for logs in `format`.
    pub fn get(&self, role: Role, debit: bool, format: LogFormat) -> &Bytes {
        let role = match role {
            Role::Enforce => 0,
            Role::Shadow => 1,
            Role::Quota => 2,
        };
        &self.0[role * 4 + usize::from(debit) * 2 + usize::from(format == LogFormat::SortedSet)]
    }
}

/// A rule as the Redis script reads it (see [`RuleText`]).
pub fn rule_text(
    windows: &[Window],
    algorithm: Algorithm,
    ban_ms: u64,
    role: Role,
    debit: bool,
    format: LogFormat,
) -> String {
    let buckets = match algorithm {
        Algorithm::SlidingLog => 0,
        Algorithm::SlidingCounter { buckets } => buckets,
    };
    let sorted = matches!(algorithm, Algorithm::SlidingLog) && !compact_log(windows, format);
    let flags = u64::from(debit) + 2 * u64::from(sorted);
    let mut text = String::with_capacity(16 + windows.len() * 20);
    push_decimal(&mut text, role.code());
    for n in [ban_ms, u64::from(buckets), flags] {
        text.push(':');
        push_decimal(&mut text, n);
    }
    for w in windows {
        text.push(':');
        push_decimal(&mut text, u64::from(w.limit));
        text.push(':');
        push_decimal(&mut text, w.length_ms);
    }
    text
}

/// Appends `n` in decimal, without the formatting machinery of `write!` (the Redis store writes
/// a number into every call's member prefix).
pub fn push_decimal(text: &mut String, mut n: u64) {
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

/// One descriptor of a request, as the store sees it.
#[derive(Clone, Debug)]
pub struct CheckItem<'a> {
    pub key: StoreKey,
    pub windows: Cow<'a, [Window]>,
    pub algorithm: Algorithm,
    pub ban_ms: Option<u64>,
    /// Hits to record if admitted; 0 checks without recording.
    pub hits: u64,
    pub role: Role,
    /// Usage already spent (a token debit): the hits are recorded even when they cross the
    /// limit, as long as every window had room for one more hit before; a check (0 hits) fits
    /// only while every window has room for one more.
    pub debit: bool,
    /// The configured rule as the Redis script reads it, when the item is that rule as
    /// configured (its windows, algorithm and ban); else the store makes the text itself.
    pub text: Option<&'a RuleText>,
}

impl CheckItem<'_> {
    /// What the item must fit: its hits, or 1 for a debit rule's check.
    pub fn size(&self) -> u64 {
        if self.debit && self.hits == 0 {
            1
        } else {
            self.hits
        }
    }
}

/// What the store found and did for one descriptor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ItemOutcome {
    /// This descriptor's hits were recorded.
    pub recorded: bool,
    /// Time left on a ban (0: not banned). A request that just triggered a ban sees the full ban.
    pub ban_remaining_ms: u64,
    /// This request went over and set the ban.
    pub ban_set: bool,
    /// Every window had room for the hits (and no ban).
    pub fits: bool,
    /// Per window, in the rule's order; empty when banned.
    pub windows: Vec<WindowOutcome>,
}

/// The state of one window after the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowOutcome {
    /// Hits inside the window, including this request's if they were recorded.
    pub count: u64,
    /// For a fitting item: time until the oldest entry in the window ages out (0 if empty).
    /// For an item that does not fit: time until this request's hits would fit in this window
    /// (0 if this window has room; the window's length if the hits exceed its limit).
    pub reset_ms: u64,
}

/// The whole decision for a batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckOutcome {
    pub admitted: bool,
    pub items: Vec<ItemOutcome>,
}

/// A store failure. Messages never carry credentials; the client's own error is kept as the
/// source, for logs.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The store gave the decision up: what it waited for, and how long.
    #[error("{0}")]
    Timeout(Waited),
    #[error("store unavailable: {context}")]
    Unavailable {
        context: String,
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// The store answered, but not in the agreed shape (a script error reply, a short reply).
    #[error("store answered something unexpected: {0}")]
    Protocol(String),
}

impl StoreError {
    /// A short name of the failure, for spans and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Protocol(_) => "protocol_error",
        }
    }

    /// Unavailable for a reason with no underlying error.
    pub fn unavailable(context: impl Into<String>) -> StoreError {
        StoreError::Unavailable {
            context: context.into(),
            source: None,
        }
    }
}

pub type StoreFuture<'a> =
    Pin<Box<dyn Future<Output = Result<CheckOutcome, StoreError>> + Send + 'a>>;
pub type InspectFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<ItemState>, StoreError>> + Send + 'a>>;
pub type ResetFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<bool>, StoreError>> + Send + 'a>>;

/// How one descriptor stands, as an inspection reads it: nothing recorded, no TTL touched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ItemState {
    /// Time left on a ban (0: not banned).
    pub ban_remaining_ms: u64,
    /// Per window, in the rule's order: the hits inside it, and until the oldest of them
    /// leaves it (0 when it holds none).
    pub windows: Vec<WindowOutcome>,
    /// A sliding log's entries inside its longest window; `None` for `sliding_counter`.
    pub entries: Option<u64>,
}
pub type ReadyFuture<'a> = Pin<Box<dyn Future<Output = bool> + Send + 'a>>;

/// The one interface the limiter needs from a store.
pub trait Store: Send + Sync + 'static {
    /// Decides a batch at time `now_ms` (milliseconds since the Unix epoch): an item fits if it
    /// is not banned and every window has room for its [`CheckItem::size`]; the batch is
    /// admitted per [`admits`]; if admitted, hits are recorded in every item that fits,
    /// otherwise nowhere, except a debit's, which is recorded whatever the decision while every
    /// window had room for one more hit. Items that do not fit and have a ban get banned.
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a>;

    /// Decides as [`Store::check`], for a request whose caller is answered `OVER_LIMIT` (the
    /// deny policy) if the store gives up on it: hits a reply shows recorded after the store
    /// gave up are taken back, since the request never passed. A store that cannot answer late
    /// decides as `check` does.
    fn check_or_take_back<'a>(
        &'a self,
        items: &'a [CheckItem<'a>],
        now_ms: u64,
    ) -> StoreFuture<'a> {
        self.check(items, now_ms)
    }

    /// Decides a batch whose request is already rejected by a descriptor known to be over (not
    /// among `items`; the limiter's over-limit cache): as [`Store::check`] with one more
    /// enforcing item that does not fit. Nothing is recorded but debits, and items that do not
    /// fit and have a ban get banned; the outcome says how the others stand.
    fn check_rejected<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a>;

    /// How each item stands at `now_ms`, recording nothing and touching no key's TTL (the
    /// admin API's inspect). The items' hits are not looked at.
    fn inspect<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> InspectFuture<'a>;

    /// Forgets every window and ban of each key (the admin API's reset), atomically per key
    /// as a decision sees it; answers, per key, whether it held anything.
    fn reset<'a>(&'a self, keys: &'a [StoreKey]) -> ResetFuture<'a>;

    /// Records each bucket's reported usage in its window, whatever the counts, and shares what
    /// is left of its limit among the Envoys that report it ([`shares`]); their assignments live
    /// `ttl_ms` from `now_ms`. Each bucket is decided on its own, atomically.
    fn quota<'a>(
        &'a self,
        items: &'a [QuotaItem<'a>],
        ttl_ms: u64,
        now_ms: u64,
    ) -> QuotaFuture<'a> {
        let _ = (items, ttl_ms, now_ms);
        Box::pin(async { Err(StoreError::unavailable("this store keeps no quotas")) })
    }

    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Whether the store answers now (for readiness); the embedded store always does.
    fn ready(&self) -> ReadyFuture<'_> {
        Box::pin(async { true })
    }

    /// Whether the store can still recover by itself. False when it has tried what it can
    /// (fresh connections that reach Redis) and calls still fail: a restart is the next step,
    /// so `/healthz` reports it. An unreachable Redis is not this: waiting fixes that.
    fn alive(&self) -> bool {
        true
    }

    /// Descriptors holding state now, where the store counts them (the embedded store).
    fn live_keys(&self) -> Option<u64> {
        None
    }

    /// Requests sent again since the start because a Redis Cluster master refused them (it no
    /// longer served their slot: resharding), where the store counts them.
    fn resent(&self) -> Option<u64> {
        None
    }

    /// How many times the store was found to have lost its data (a Redis restarted without
    /// persistence, or flushed), where the store can tell.
    fn data_losses(&self) -> Option<u64> {
        None
    }

    /// When the store's latest loss of its data was found (ms since the epoch), by this replica
    /// or another that left word of it in the store; `None` where it can tell of none.
    fn data_lost_at(&self) -> Option<u64> {
        None
    }

    /// The `maxmemory-policy` of a store that evicts keys under memory pressure (which forgets
    /// windows and lets their requests through again), where the store knows it.
    fn evicting(&self) -> Option<String> {
        None
    }

    /// Parts of the store that did not answer its last readiness check while others did (a
    /// Redis Cluster master down): their keys' requests are answered by the failure policy.
    fn silent(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The admission rule both stores share: every enforcing item fits, and if there are quota
/// items, at least one of them fits. Shadow items never block.
pub fn admits(items: impl IntoIterator<Item = (Role, bool)>) -> bool {
    let mut quota_seen = false;
    let mut quota_fits = false;
    for (role, fits) in items {
        match role {
            Role::Enforce if !fits => return false,
            Role::Quota => {
                quota_seen = true;
                quota_fits |= fits;
            }
            _ => {}
        }
    }
    !quota_seen || quota_fits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_rule() {
        use Role::*;
        assert!(admits([]));
        assert!(admits([(Enforce, true), (Shadow, false)]));
        assert!(!admits([(Enforce, false), (Shadow, true)]));
        assert!(admits([(Quota, false), (Quota, true)]));
        assert!(!admits([(Quota, false), (Quota, false)]));
        assert!(!admits([(Quota, true), (Enforce, false)]));
    }
}
