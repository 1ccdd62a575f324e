//! Where the logs live. Both stores take the same batch and decide it the same way, atomically:
//! a request's descriptors are admitted all together or not at all.
//!
//! The embedded store ([`MemoryStore`]) decides under in-process locks; the Redis store decides
//! inside one Lua script per hash slot. The conformance suite in `tests/` runs the same scenarios
//! against each.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use crate::limiter::key::StoreKey;
use crate::limiter::rules::{Algorithm, Window};

mod memory;
pub mod redis;

pub use memory::MemoryStore;
pub use redis::{ClockSource, RedisOptions, RedisStore};

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
}

/// What the store found and did for one descriptor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ItemOutcome {
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

/// A store failure. The message never carries credentials.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("store timed out after {0} ms")]
    Timeout(u64),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store answered something unexpected: {0}")]
    Protocol(String),
}

pub type StoreFuture<'a> =
    Pin<Box<dyn Future<Output = Result<CheckOutcome, StoreError>> + Send + 'a>>;
pub type ReadyFuture<'a> = Pin<Box<dyn Future<Output = bool> + Send + 'a>>;

/// The one interface the limiter needs from a store.
pub trait Store: Send + Sync + 'static {
    /// Decides a batch at time `now_ms` (milliseconds since the Unix epoch): an item fits if it
    /// is not banned and every window has room for its hits; the batch is admitted per
    /// [`admits`]; if admitted, hits are recorded in every item that fits, otherwise nowhere.
    /// Items that do not fit and have a ban get banned.
    fn check<'a>(&'a self, items: &'a [CheckItem<'a>], now_ms: u64) -> StoreFuture<'a>;

    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Whether the store answers now (for readiness); the embedded store always does.
    fn ready(&self) -> ReadyFuture<'_> {
        Box::pin(async { true })
    }

    /// Drops state that no window or ban needs any more. The server calls it periodically; the
    /// Redis store has nothing to do (keys expire by TTL).
    fn sweep(&self, _now_ms: u64) {}
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
