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
",
    );
    // 1,000 wildcard rules on one key: /svc<n>/* each with its own limit.
    for n in 0..1000 {
        yaml.push_str(&format!(
            "  - key: path\n    value: \"/svc{n}/*\"\n    rate_limit: {{unit: minute, requests_per_unit: 1000000}}\n"
        ));
    }
    yaml
}

/// The `grpc-timeout` value Envoy sends with every `ShouldRateLimit` call: its filter timeout
/// in milliseconds (20 ms by default), written as Envoy's `Grpc::Common::toGrpcTimeout` writes
/// it (the count and `m`; Envoy's larger units only start past 8 digits). The server reads it
/// and keeps a timer per call, so a load without it leaves out part of a real call's cost.
pub fn envoy_grpc_timeout(ms: u64) -> String {
    format!("{ms}m")
}

/// What one request of a scenario sends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Users,
    Attack,
    ThreeSlots,
    Wildcards,
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
    let user = n.wrapping_mul(2_654_435_761) % 100_000;
    let descriptors = match shape {
        Shape::Users => vec![one(vec![entry("user", format!("u{user}"))])],
        Shape::Attack => vec![one(vec![entry("attack", "hot".into())])],
        Shape::ThreeSlots => vec![
            one(vec![entry("user", format!("u{user}"))]),
            one(vec![entry("tenant", format!("t{}", user % 97))]),
            one(vec![entry("route", format!("r{}", user % 13))]),
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
