//! The decision log (`slidegate::decision`), read as a subscriber receives it. One test in a
//! binary of its own: tracing keeps which callsites are enabled, and the highest level wanted,
//! for the whole process, and a test's own subscriber set while another thread's test reaches a
//! callsite first can be missed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use slidegate::limiter::{Descriptor, Limiter, LimiterOptions, ManualClock, Request};
use slidegate::store::MemoryStore;

const T0: u64 = 1_767_225_600_000;

fn limiter(sources: &[(&str, &str)], options: LimiterOptions) -> Limiter {
    let sources: Vec<(String, String)> = sources
        .iter()
        .map(|(name, yaml)| (name.to_string(), yaml.to_string()))
        .collect();
    let limits = slidegate::config::compile_sources(&sources).expect("valid config");
    Limiter::new(
        limits,
        Arc::new(MemoryStore::new()),
        Arc::new(ManualClock::new(T0)),
        options,
    )
}

fn req(domain: &str, descriptors: &[&[(&str, &str)]]) -> Request {
    Request {
        domain: domain.into(),
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

fn decide(l: &Limiter, r: &Request) {
    futures_util::FutureExt::now_or_never(l.should_rate_limit(r))
        .expect("the memory store never waits")
        .expect("decided");
}

/// What a subscriber for the current thread writes, with `filter`, while `run` runs.
fn logged(filter: &str, run: impl FnOnce()) -> String {
    #[derive(Clone)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
            held.extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured(Arc::default());
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_env_filter(filter)
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, run);
    let bytes = captured.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
    String::from_utf8(bytes).expect("text")
}

/// The decision log at debug level: per descriptor the rule that matched, each window's
/// count of its limit, the code, the entries' values hashed (or shown, by option).
#[test]
fn the_decision_log_says_which_rule_and_window_decided() {
    let yaml = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {requests_per_unit: 2, unit: minute}\n";
    let l = limiter(&[("t.yaml", yaml)], LimiterOptions::default());
    let text = logged("slidegate::decision=debug", || {
        for _ in 0..3 {
            decide(&l, &req("d", &[&[("user", "alice")], &[("nobody", "x")]]));
        }
    });
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "one line per checked descriptor: {text}");
    assert!(
        lines[0].contains("code=\"OK\"") && lines[0].contains("windows=\"1/2 in 1m"),
        "{text}"
    );
    assert!(lines[1].contains("windows=\"2/2 in 1m"), "{text}");
    let last = lines[2];
    for part in [
        "domain=\"d\"",
        "descriptor=0",
        "rule=\"d.user\"",
        "code=\"OVER_LIMIT\"",
        "windows=\"2/2 in 1m, reset ",
        "recorded=false",
    ] {
        assert!(last.contains(part), "{part} in {last}");
    }
    assert!(!text.contains("alice"), "a value in the log: {text}");
    let hash = |line: &str| {
        line.split("entries=")
            .nth(1)
            .map(|e| e.split(' ').next().unwrap_or("").to_string())
    };
    assert_eq!(hash(lines[0]), hash(last), "one value, one hash");
    // Shown by option; and nothing at all at the info level.
    let shown = LimiterOptions {
        log_descriptor_values: true,
        ..LimiterOptions::default()
    };
    let l = limiter(&[("t.yaml", yaml)], shown);
    let text = logged("slidegate::decision=debug", || {
        decide(&l, &req("d", &[&[("user", "alice")]]));
    });
    assert!(text.contains("entries=\"user=alice\""), "{text}");
    let text = logged("info", || {
        decide(&l, &req("d", &[&[("user", "alice")]]));
    });
    assert_eq!(text, "", "the decision log is at debug level");
    a_domain_that_asks_has_its_decisions_logged_at_info();
}

/// A domain with `log_decisions: true` is logged at info level; the others are not.
fn a_domain_that_asks_has_its_decisions_logged_at_info() {
    let loud = "domain: loud\nlog_decisions: true\ndescriptors:\n  - key: user\n    rate_limit: {requests_per_unit: 2, unit: minute}\n";
    let quiet = "domain: quiet\ndescriptors:\n  - key: user\n    rate_limit: {requests_per_unit: 2, unit: minute}\n";
    let l = limiter(
        &[("loud.yaml", loud), ("quiet.yaml", quiet)],
        LimiterOptions::default(),
    );
    let text = logged("info", || {
        for domain in ["loud", "quiet"] {
            decide(&l, &req(domain, &[&[("user", "bob")]]));
        }
    });
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.contains(" INFO ") && text.contains("domain=\"loud\""),
        "{text}"
    );
}
