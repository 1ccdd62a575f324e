//! The Rate Limit Quota Service's scenarios, on every store: simulated Envoys that behave as
//! Envoy 1.40's `rate_limit_quota` filter does (a token bucket starts full and refills without
//! steps; a changed assignment keeps the fraction of tokens it had; the same one keeps its
//! tokens; a bucket's first request is decided by `no_assignment_behavior` and reported at once;
//! then every bucket every 5 s), sharing one limit through the limiter, on its injected clock.

use slidegate::limiter::{Assignment, BucketUsage};

use super::{Backend, start};
use crate::common::*;

/// `x-user` buckets, 30 a minute; `tenant` then `plan`; an unlimited `plan`.
const QUOTAS: &str = r#"
domain: DOMAIN
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: tenant
    descriptors:
      - key: plan
        value: free
        rate_limit: {unit: minute, requests_per_unit: 600}
      - key: plan
        value: gold
        rate_limit: {unlimited: true}
"#;

/// One simulated Envoy and its one bucket.
struct Envoy {
    holder: String,
    assignment: Option<Assignment>,
    /// When the assignment ends (its time to live), ms.
    expires_ms: u64,
    /// A token bucket's tokens, and when they were last counted.
    tokens: f64,
    counted_ms: u64,
    allowed: u64,
    denied: u64,
    reported_ms: Option<u64>,
    /// When each admitted request came.
    admitted: Vec<u64>,
}

impl Envoy {
    fn new(holder: String) -> Envoy {
        Envoy {
            holder,
            assignment: None,
            expires_ms: 0,
            tokens: 0.0,
            counted_ms: 0,
            allowed: 0,
            denied: 0,
            reported_ms: None,
            admitted: Vec::new(),
        }
    }

    fn rate(assignment: Option<Assignment>) -> f64 {
        match assignment {
            Some(Assignment::TokenBucket {
                tokens_per_fill,
                fill_interval_s,
                ..
            }) => f64::from(tokens_per_fill) / f64::from(fill_interval_s),
            _ => 0.0,
        }
    }

    /// One request at `now`: the assignment decides it (none or expired: DENY_ALL, the
    /// fallback these scenarios configure).
    fn request(&mut self, now: u64) -> bool {
        if now >= self.expires_ms {
            self.assignment = None;
        }
        let admitted = match self.assignment {
            Some(Assignment::AllowAll) => true,
            Some(Assignment::TokenBucket { max_tokens, .. }) => {
                let refill = (now - self.counted_ms) as f64 / 1000.0 * Envoy::rate(self.assignment);
                self.tokens = (self.tokens + refill).min(f64::from(max_tokens));
                self.counted_ms = now;
                let ok = self.tokens >= 1.0;
                if ok {
                    self.tokens -= 1.0;
                }
                ok
            }
            Some(Assignment::DenyAll) | None => false,
        };
        if admitted {
            self.allowed += 1;
            self.admitted.push(now);
        } else {
            self.denied += 1;
        }
        admitted
    }

    /// Takes an assignment at `now`, as Envoy 1.40 does.
    fn assign(&mut self, assignment: Assignment, now: u64, ttl_ms: u64) {
        if let Assignment::TokenBucket { max_tokens, .. } = assignment {
            let max = f64::from(max_tokens);
            match self.assignment {
                Some(Assignment::TokenBucket {
                    max_tokens: old, ..
                }) if now < self.expires_ms => {
                    // Refill to now under the old rate, then keep the fraction (the same
                    // assignment keeps its tokens: a fraction of one).
                    let refill =
                        (now - self.counted_ms) as f64 / 1000.0 * Envoy::rate(self.assignment);
                    let tokens = (self.tokens + refill).min(f64::from(old));
                    self.tokens = tokens / f64::from(old) * max;
                }
                _ => self.tokens = max,
            }
            self.counted_ms = now;
        }
        self.assignment = Some(assignment);
        self.expires_ms = now + ttl_ms;
    }

    /// The usage since the last report, as a report carries it.
    fn usage(&mut self, id: &[(&str, &str)], now: u64) -> BucketUsage {
        let elapsed = self.reported_ms.map_or(0, |at| (now - at) / 1000 * 1000);
        self.reported_ms = Some(now);
        let usage = BucketUsage {
            id: id
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            allowed: self.allowed,
            denied: self.denied,
            elapsed_ms: elapsed,
        };
        (self.allowed, self.denied) = (0, 0);
        usage
    }
}

/// Reports `envoy`'s bucket `id` at `now` and applies the answer.
async fn report(s: &TestServer, domain: &str, envoy: &mut Envoy, id: &[(&str, &str)], now: u64) {
    let usage = envoy.usage(id, now);
    let answers = s
        .limiter
        .quota_report(domain, &envoy.holder, std::slice::from_ref(&usage))
        .await;
    let ttl = u64::try_from(s.limiter.quota_ttl().as_millis()).unwrap();
    if let Some(Some(assignment)) = answers.first() {
        envoy.assign(*assignment, now, ttl);
    }
}

/// Runs `envoys` from `from` to `until` (ms from the start): each sends a request every 100 ms
/// while `sending(envoy, t)` says so, and reports every 5 s from its first request (which is
/// reported at once). The clock moves 100 ms a step.
async fn run(
    s: &TestServer,
    domain: &str,
    envoys: &mut [Envoy],
    id: &[(&str, &str)],
    (from, until): (u64, u64),
    sending: impl Fn(usize, u64) -> bool,
) {
    let mut t = from;
    while t < until {
        let now = T0 + t;
        for (e, envoy) in envoys.iter_mut().enumerate() {
            let due = envoy.reported_ms.is_some_and(|at| now >= at + 5_000);
            if sending(e, t) {
                let first = envoy.reported_ms.is_none();
                envoy.request(now);
                if first {
                    report(s, domain, envoy, id, now).await;
                    continue;
                }
            }
            if due {
                report(s, domain, envoy, id, now).await;
            }
        }
        s.clock.advance(100);
        t += 100;
    }
}

/// The most requests admitted, all Envoys together, in any `window_ms` interval.
fn most_in_any_window(envoys: &[Envoy], window_ms: u64) -> usize {
    let mut all: Vec<u64> = envoys.iter().flat_map(|e| e.admitted.clone()).collect();
    all.sort_unstable();
    let mut most = 0;
    for (i, &t) in all.iter().enumerate() {
        let inside = all[..=i].iter().filter(|&&a| a + window_ms > t).count();
        most = most.max(inside);
    }
    most
}

/// Three Envoys, 10 requests a second each for 90 s, on 30 a minute: in no minute do they
/// admit more than 30 together, each admits some, and after their last reports a check with
/// no hits sees what they admitted in the window.
pub async fn quota_fleet_shares_one_limit_exactly(b: &dyn Backend) {
    let (s, d) = start(b, "fleet", QUOTAS).await;
    let mut envoys: Vec<Envoy> = (0..3)
        .map(|_| Envoy::new(s.limiter.quota_holder()))
        .collect();
    let id = [("user", "alice")];
    // The Envoys start 1.3 s apart, so their reports do not come together.
    run(&s, &d, &mut envoys, &id, (0, 90_000), |e, t| {
        t >= 1_300 * e as u64
    })
    .await;
    let most = most_in_any_window(&envoys, 60_000);
    let each: Vec<usize> = envoys.iter().map(|e| e.admitted.len()).collect();
    eprintln!("admitted per Envoy {each:?}, at most {most} in a minute");
    assert!(
        most <= 30,
        "{most} admitted in one minute; per Envoy {each:?}"
    );
    assert!(each.iter().all(|&n| n > 0), "per Envoy {each:?}");
    // Over 90 s at most 60 fit (two windows' worth); the sharing leaves little unused.
    let total: usize = each.iter().sum();
    assert!(total >= 35, "{total} admitted in 90 s: {each:?}");
    // Their last usage reported (no more requests), the window holds what they admitted in it.
    run(&s, &d, &mut envoys, &id, (90_000, 96_000), |_, _| false).await;
    let now = T0 + 96_000;
    let admitted_in_window = envoys
        .iter()
        .flat_map(|e| e.admitted.iter())
        .filter(|&&t| t + 60_000 > now)
        .count();
    let r = s
        .call(request(
            &d,
            vec![with_hits(descriptor(&[("user", "alice")]), 0)],
        ))
        .await;
    // Usage is recorded when reported, which is no earlier than it happened: the window holds
    // at least what was admitted in it, and nothing that was not admitted.
    let remaining = r.statuses[0].limit_remaining as usize;
    let recorded_total: usize = 30 - remaining;
    assert!(
        recorded_total >= admitted_in_window && recorded_total <= total,
        "remaining {remaining}: {admitted_in_window} admitted in the window, {total} in all"
    );
    s.stop().await;
}

/// Shares follow demand, with nothing admitted (so the window stays empty): two Envoys that
/// report equal demand get equal shares; a third that starts is assigned a share by its second
/// report, and the others' shares shrink; when the first stops reporting, its share returns to
/// the other two once its assignment's time to live has passed.
pub async fn quota_shares_move_with_demand(b: &dyn Backend) {
    let (s, d) = start(b, "move", QUOTAS).await;
    let ttl = u64::try_from(s.limiter.quota_ttl().as_millis()).unwrap();
    let id = vec![
        ("tenant".to_string(), "acme".to_string()),
        ("plan".to_string(), "free".to_string()),
    ];
    let holders: Vec<String> = (0..3).map(|_| s.limiter.quota_holder()).collect();
    let rate = |a: Option<Assignment>| match a {
        Some(Assignment::TokenBucket {
            tokens_per_fill,
            fill_interval_s,
            ..
        }) => f64::from(tokens_per_fill) / f64::from(fill_interval_s),
        _ => 0.0,
    };
    // Rounds 5 s apart; each active Envoy reports 50 denied requests (10 a second).
    let mut rates: Vec<Vec<f64>> = Vec::new();
    let mut first = [true; 3];
    for round in 0..14u64 {
        let active: Vec<usize> = match round {
            0..4 => vec![0, 1],
            4..8 => vec![0, 1, 2],
            _ => vec![1, 2],
        };
        let mut row = vec![0.0; 3];
        for &h in &active {
            let usage = BucketUsage {
                id: id.clone(),
                allowed: 0,
                denied: if first[h] { 1 } else { 50 },
                elapsed_ms: if first[h] { 0 } else { 5_000 },
            };
            first[h] = false;
            let answer = s.limiter.quota_report(&d, &holders[h], &[usage]).await;
            row[h] = rate(answer[0]);
        }
        rates.push(row);
        s.clock.advance(5_000);
    }
    eprintln!("rates by round: {rates:?}");
    let r = |round: usize, h: usize| rates[round][h];
    assert!(
        (r(3, 0) - r(3, 1)).abs() <= 1.0,
        "equal demand, equal shares: {rates:?}"
    );
    // The third starts in round 4: assigned by its second report.
    assert!(r(5, 2) > 0.0, "the third Envoy's second report: {rates:?}");
    assert!(r(7, 1) < r(3, 1), "three share what two did: {rates:?}");
    // The first's last report is in round 7; its assignment lives `ttl` (and a second).
    let gone = 8 + usize::try_from(ttl.div_ceil(5_000)).unwrap() + 1;
    assert!(r(gone, 1) > r(7, 1), "two share what three did: {rates:?}");
    s.stop().await;
}

/// A used-up window: every Envoy is denied, a new one first of all, until the window frees.
/// An id matches its rule in any order; no rule, or an unlimited one, is allowed outright.
pub async fn quota_denies_a_used_up_window_and_matches_any_order(b: &dyn Backend) {
    let (s, d) = start(b, "used-up", QUOTAS).await;
    for _ in 0..30 {
        let r = s
            .call(request(&d, vec![descriptor(&[("user", "bob")])]))
            .await;
        assert_eq!(r.overall_code, ok());
    }
    let usage = |id: &[(&str, &str)]| BucketUsage {
        id: id
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        allowed: 0,
        denied: 1,
        elapsed_ms: 0,
    };
    let holder = s.limiter.quota_holder();
    let answers = s
        .limiter
        .quota_report(
            &d,
            &holder,
            &[
                usage(&[("user", "bob")]),
                usage(&[("plan", "free"), ("tenant", "acme")]),
                usage(&[("plan", "gold"), ("tenant", "acme")]),
                usage(&[("nothing", "matches")]),
            ],
        )
        .await;
    assert_eq!(answers[0], Some(Assignment::DenyAll));
    assert!(
        matches!(answers[1], Some(Assignment::TokenBucket { .. })),
        "{:?}",
        answers[1]
    );
    assert_eq!(answers[2], Some(Assignment::AllowAll));
    assert_eq!(answers[3], Some(Assignment::AllowAll));
    // A minute later the window has room again: a share.
    s.clock.advance(60_000);
    let again = s
        .limiter
        .quota_report(&d, &holder, &[usage(&[("user", "bob")])])
        .await;
    assert!(
        matches!(again[0], Some(Assignment::TokenBucket { .. })),
        "{again:?}"
    );
    s.stop().await;
}
