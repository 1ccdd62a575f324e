//! What the limiter tells an observer (metrics) about each decision. The limiter knows nothing
//! of how it is exported.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::rules::{Rule, Segment};

/// One limited descriptor of a decided request. Hits are split the way the reference server's
/// stats split them: `over` when the descriptor was over its limit; otherwise `near` for the hits
/// that landed above the near-limit threshold of the binding window and `within` for the rest.
#[derive(Debug)]
pub struct DescriptorReport<'a> {
    pub domain: &'a str,
    /// The matched rule; `None` for a request override.
    pub rule: Option<&'a Rule>,
    /// How the descriptor matched, level by level (concrete values), for detailed metrics.
    pub segments: &'a [Segment<'a>],
    pub hits: u64,
    pub within: u64,
    pub near: u64,
    pub over: u64,
    /// Hits over the limit of a shadow-mode rule (they were let through).
    pub shadow: u64,
    /// This request set a ban.
    pub ban_set: bool,
    /// Answered over the limit from the over-limit cache, without the store.
    pub from_cache: bool,
}

/// What an observer keeps in a rule to count its decisions there, without a lookup by labels
/// (the metrics: the rule's series).
pub trait RuleCounts: Send + Sync {
    /// The observer that made it: a rule observed by several (tests make several) keeps the
    /// first one's, and the others count elsewhere.
    fn owner(&self) -> u64;
    /// Counts one decided descriptor of the rule.
    fn count(&self, report: &DescriptorReport<'_>);
}

/// A rule's room for its [`RuleCounts`], filled when its config is handed to the limiter (see
/// [`Observer::rule_counts`]) and kept as long as the rule (a reload makes new rules). Not part
/// of the rule: any two compare equal, and a clone starts empty.
#[derive(Default)]
pub struct ObserverSlot(OnceLock<Arc<dyn RuleCounts>>);

impl ObserverSlot {
    /// Fills the slot; a slot already filled (by another observer of the same rules) keeps its
    /// counts.
    pub fn fill(&self, counts: Arc<dyn RuleCounts>) {
        let _ = self.0.set(counts);
    }

    pub fn get(&self) -> Option<&dyn RuleCounts> {
        self.0.get().map(|counts| &**counts)
    }
}

impl Clone for ObserverSlot {
    fn clone(&self) -> Self {
        ObserverSlot::default()
    }
}

impl PartialEq for ObserverSlot {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ObserverSlot {}

impl std::fmt::Debug for ObserverSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "ObserverSlot(filled)"
        } else {
            "ObserverSlot(empty)"
        })
    }
}

/// How a whole call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallResult {
    Ok,
    OverLimit,
    Invalid,
    StoreError,
    /// Refused: no config has arrived yet.
    NoConfig,
}

impl CallResult {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CallResult::Ok => "ok",
            CallResult::OverLimit => "over_limit",
            CallResult::Invalid => "invalid",
            CallResult::StoreError => "store_error",
            CallResult::NoConfig => "no_config",
        }
    }
}

/// Told about every call, whichever transport it came by; the metrics implement it.
pub trait Observer: Send + Sync + 'static {
    /// A call ended, after `elapsed` (validation, matching, the store and shaping the answer).
    fn call(&self, result: CallResult, elapsed: Duration);
    fn descriptor(&self, report: &DescriptorReport<'_>);
    /// A request named a domain with no config.
    fn unknown_domain(&self);
    /// Global shadow mode turned an OVER_LIMIT answer into OK.
    fn global_shadow(&self);
    fn store_call(&self, store: &'static str, elapsed: Duration, ok: bool);
    /// A Rate Limit Quota Service stream opened (`true`) or ended.
    fn quota_stream(&self, opened: bool) {
        let _ = opened;
    }
    /// The buckets the open quota streams report, changed by `delta`.
    fn quota_buckets(&self, delta: i64) {
        let _ = delta;
    }
    /// The usage a report's buckets reported, together.
    fn quota_usage(&self, domain: &str, allowed: u64, denied: u64) {
        let _ = (domain, allowed, denied);
    }
    /// `count` buckets of a report assigned `kind` (`token_bucket`, `deny_all`, `allow_all`,
    /// or `none` when the store failed under the `error` policy).
    fn quota_assignments(&self, domain: &str, kind: &'static str, count: u64) {
        let _ = (domain, kind, count);
    }
    /// What to keep in `rule` to count its decisions there, made when its config is handed to
    /// the limiter; `None` to keep nothing.
    fn rule_counts(&self, rule: &Rule) -> Option<Arc<dyn RuleCounts>> {
        let _ = rule;
        None
    }
}

/// Observes nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObserver;

impl Observer for NoObserver {
    fn call(&self, _: CallResult, _: Duration) {}
    fn descriptor(&self, _: &DescriptorReport<'_>) {}
    fn unknown_domain(&self) {}
    fn global_shadow(&self) {}
    fn store_call(&self, _: &'static str, _: Duration, _: bool) {}
}
