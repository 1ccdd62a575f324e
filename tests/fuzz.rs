//! Bounded fuzzing with proptest: random and half-valid config files, protobuf bytes and JSON
//! bodies go through the config loader and the request path. Nothing may panic; every input is
//! either accepted or refused with an error (a config error with file and line, or
//! `INVALID_ARGUMENT`). A few thousand cases per run keep it to seconds in CI.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

use std::sync::Arc;

use proptest::prelude::*;
use slidegate::limiter::{Limiter, LimiterError, LimiterOptions, ManualClock};
use slidegate::proto::RateLimitRequest;
use slidegate::store::MemoryStore;

/// YAML-ish text from the pieces a config is made of, so most cases get past the parser.
fn config_text() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("domain: d\n".to_string()),
        Just("descriptors:\n".to_string()),
        Just("  - key: k\n".to_string()),
        Just("    value: v*\n".to_string()),
        Just("    rate_limit: {unit: second, requests_per_unit: 5}\n".to_string()),
        Just("    rate_limits: [{window: 90s, requests_per_unit: 1}, {unit: day}]\n".to_string()),
        Just("    ban: 1.5m\n".to_string()),
        Just("    debit: true\n".to_string()),
        Just("    algorithm: sliding_counter\n    buckets: 7\n".to_string()),
        Just("    shadow_mode: true\n".to_string()),
        Just("    descriptors:\n      - key: inner\n".to_string()),
        Just("    replaces: [{name: x}]\n".to_string()),
        Just("store_failure: allow\n".to_string()),
        "[a-z_:{}\\[\\]\\-\n \"'*0-9.]{0,20}",
    ];
    prop::collection::vec(token, 0..14).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_config_loader_never_panics(text in config_text(), raw in "\\PC{0,200}") {
        for source in [text, raw] {
            match slidegate::config::compile_sources(&[("f.yaml".into(), source.clone())]) {
                Ok(_) => {}
                Err(errors) => prop_assert!(!errors.0.is_empty(), "an error without a cause: {source:?}"),
            }
        }
    }

    #[test]
    fn protobuf_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let limiter = limiter();
        if let Ok(request) = prost::Message::decode(bytes.as_slice()) {
            decide(&limiter, request)?;
        }
    }

    #[test]
    fn json_bodies_never_panic(body in "\\PC{0,160}", domain in "[a-z]{0,3}", value in "\\PC{0,8}", hits in any::<u64>(), unit in -2i32..10) {
        let limiter = limiter();
        let structured = format!(
            r#"{{"domain":"{domain}","descriptors":[{{"entries":[{{"key":"k","value":{}}}],"hitsAddend":"{hits}","limit":{{"requestsPerUnit":3,"unit":{unit}}}}}]}}"#,
            serde_json::Value::String(value)
        );
        for text in [body, structured] {
            if let Ok(request) = serde_json::from_str::<RateLimitRequest>(&text) {
                decide(&limiter, request)?;
            }
        }
    }
}

const CONFIG: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limits: [{unit: second, requests_per_unit: 3}, {window: 2s, requests_per_unit: 4}]\n    ban: 1s\n  - key: t\n    debit: true\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

fn limiter() -> Limiter {
    let limits =
        slidegate::config::compile_sources(&[("f.yaml".into(), CONFIG.into())]).expect("valid");
    Limiter::new(
        limits,
        Arc::new(MemoryStore::bounded(4_096)),
        Arc::new(ManualClock::new(1_767_225_600_000)),
        LimiterOptions {
            response_headers: true,
            dynamic_metadata: true,
            ..LimiterOptions::default()
        },
    )
}

/// Decides a request: an answer for every descriptor, or a refusal; never a panic.
fn decide(limiter: &Limiter, request: RateLimitRequest) -> Result<(), TestCaseError> {
    let request = slidegate::wire::from_proto(request);
    let answer = futures_util::FutureExt::now_or_never(limiter.should_rate_limit(&request))
        .expect("the embedded store never waits");
    match answer {
        Ok(decision) => {
            prop_assert_eq!(decision.statuses.len(), request.descriptors.len());
            let _ = slidegate::wire::to_proto(&request, decision);
        }
        Err(LimiterError::InvalidRequest(message)) => prop_assert!(!message.is_empty()),
        Err(LimiterError::Store(e)) => prop_assert!(false, "the embedded store failed: {e}"),
        Err(LimiterError::NoConfig(e)) => prop_assert!(false, "a config is loaded: {e}"),
    }
    Ok(())
}
