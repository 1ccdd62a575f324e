//! The rate-limit domain: rules and matching, store keys, and the decision for a request.
//! Nothing here knows about gRPC, HTTP or Redis: the transports turn their requests into
//! [`Request`] and [`Decision`] back, and the limiter asks a [`crate::store::Store`] (the
//! contract below it) to decide its batch.
//!
//! Where each part lives:
//! * `engine.rs`: [`Limiter`] and its options; [`Limiter::should_rate_limit`], the one request
//!   path, step by step.
//! * `bounds.rs`: what one request may ask for, checked before anything is read.
//! * `plan.rs`: a request's descriptors matched to rules (`rules.rs`, the compiled rule tree),
//!   and the store's items built, keyed by `key.rs`.
//! * `ask_store.rs`: the over-limit cache (`cache.rs`) first, then the store, or the failure
//!   policy when the store fails or lost its data; store errors counted.
//! * `answer.rs`: the statuses, the response headers (`headers.rs`) and the rules' metadata.
//! * `report.rs`: what the observer (`observe.rs`, the metrics' side), the decision log
//!   (`why.rs`) and a trace's span are told of a decision.
//! * `inspect_reset.rs`: the admin API's inspect and reset, a request planned as a decision
//!   plans it.
//! * `assignments.rs`: Envoy's Rate Limit Quota Service: a report's buckets matched to rules, their
//!   usage and shares asked of the store, each answered with an assignment.
//! * `clock.rs`: time as an input; `unit.rs`: the config's and the proto's time units.

mod answer;
mod ask_store;
pub mod assignments;
pub mod bounds;
pub mod cache;
pub mod clock;
pub mod engine;
pub mod headers;
pub mod inspect_reset;
pub mod key;
pub mod observe;
mod plan;
mod report;
pub mod rules;
#[cfg(test)]
mod testing;
pub mod unit;
pub mod why;

pub use assignments::{Assignment, BucketUsage};
pub use bounds::RequestBounds;
pub use clock::{Clock, ManualClock, SystemClock};
pub use engine::{DEFAULT_OVER_LIMIT_CACHE, Limiter, LimiterOptions};
pub use headers::LimitHeaderNames;
pub use observe::{CallResult, DescriptorReport, NoObserver, Observer};
pub use rules::FailurePolicy;
pub use unit::Unit;

/// A `ShouldRateLimit` request in domain terms.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// The request-wide hits; 0 is read as 1.
    pub hits_addend: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<(String, String)>,
    pub limit: Option<Override>,
    /// When present, this descriptor's hits (0: check only), winning over the request's.
    pub hits_addend: Option<u64>,
}

/// A limit sent by the caller. `unit` is the raw proto value, checked by the limiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Override {
    pub requests_per_unit: u32,
    pub unit: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

/// The limit a status reports: the binding window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportedLimit {
    pub name: Option<std::sync::Arc<str>>,
    pub requests_per_unit: u32,
    pub unit: Unit,
    /// The exact window, which `unit` may only approximate.
    pub window_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub current_limit: Option<ReportedLimit>,
    pub limit_remaining: u32,
    pub duration_until_reset_ms: Option<u64>,
}

impl Status {
    /// No rule applies (or it was replaced): OK, no limit.
    pub fn unlimited_by_config() -> Status {
        Status {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset_ms: None,
        }
    }
}

/// The answer to a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub overall: Code,
    /// One per request descriptor, in request order.
    pub statuses: Vec<Status>,
    pub response_headers: Vec<(String, String)>,
    /// The matched rules' metadata, when `dynamic_metadata` is switched on. The transports
    /// shape the response field from it and the request.
    pub dynamic_metadata: Option<RuleMetadata>,
}

/// The `metadata` of the rules a request matched, merged (the first value of a field wins).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RuleMetadata(pub serde_json::Map<String, serde_json::Value>);

/// Why a request was not decided.
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// No config has arrived yet from where the config comes from (an xDS server), and the
    /// server was not told to serve without one.
    #[error("{0}")]
    NoConfig(String),
}
