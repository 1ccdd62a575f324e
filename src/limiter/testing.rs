//! What the limiter's unit tests share: a limiter on the embedded store under a manual clock,
//! a config with two rules, and requests built from entry pairs.

use std::sync::Arc;

use super::{Decision, Descriptor, Limiter, LimiterOptions, ManualClock, Request};
use crate::store::MemoryStore;

pub(super) const T0: u64 = 1_767_225_600_000;

pub(super) const CONFIG: &str = "domain: d\ndescriptors:\n  - key: user\n    rate_limits:\n      - {requests_per_unit: 2, unit: second, name: per_second}\n      - {requests_per_unit: 5, unit: minute, name: per_minute}\n  - key: ip\n    rate_limit: {requests_per_unit: 3, window: 90s}\n    metadata: {team: edge}\n";

pub(super) fn limiter(yaml: &str, options: LimiterOptions) -> (Limiter, ManualClock) {
    let limits =
        crate::config::compile_sources(&[("t.yaml".into(), yaml.into())]).expect("valid config");
    let clock = ManualClock::new(T0);
    let limiter = Limiter::new(
        limits,
        Arc::new(MemoryStore::new()),
        Arc::new(clock.clone()),
        options,
    );
    (limiter, clock)
}

pub(super) fn req(descriptors: &[&[(&str, &str)]]) -> Request {
    Request {
        domain: "d".into(),
        descriptors: descriptors
            .iter()
            .map(|entries| Descriptor {
                entries: entries
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Descriptor::default()
            })
            .collect(),
        hits_addend: 0,
    }
}

pub(super) fn decide(l: &Limiter, r: &Request) -> Decision {
    futures_util::FutureExt::now_or_never(l.should_rate_limit(r))
        .expect("the memory store never waits")
        .expect("decided")
}
