//! Optional response headers for the client: the IETF `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers, structured-field form) and `Retry-After` when the
//! request is rejected. Envoy adds them to the downstream response via `response_headers_to_add`.

use super::rules::Window;
use super::{Code, Status};

/// Builds the headers from the statuses. The descriptor they describe is the one that decides
/// the request: when rejected, the over-limit descriptor with the longest wait (its reset is the
/// exact time after which the request fits); otherwise the one with the least remaining.
pub fn build<'w>(
    statuses: &[Status],
    windows_of: impl Fn(usize) -> Option<&'w [Window]>,
    overall: Code,
) -> Vec<(String, String)> {
    let limited = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.current_limit.is_some());
    let binding = if overall == Code::OverLimit {
        limited
            .filter(|(_, s)| s.code == Code::OverLimit)
            .max_by_key(|(_, s)| s.duration_until_reset_ms)
    } else {
        limited.min_by_key(|(_, s)| s.limit_remaining)
    };
    let Some((index, status)) = binding else {
        return Vec::new();
    };
    let (Some(windows), Some(current)) = (windows_of(index), status.current_limit.as_ref()) else {
        return Vec::new();
    };
    let policy_name = |w: &Window| match &w.name {
        Some(name) => sf_string(name),
        None => sf_string(&format!("{}-per-{}s", w.limit, seconds_up(w.length_ms))),
    };
    let policy = windows
        .iter()
        .map(|w| {
            format!(
                "{};q={};w={}",
                policy_name(w),
                w.limit,
                seconds_up(w.length_ms)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let reset_s = seconds_up(status.duration_until_reset_ms.unwrap_or(0));
    let binding_window = windows
        .iter()
        .find(|w| w.length_ms == current.window_ms && w.limit == current.requests_per_unit)
        .unwrap_or(&windows[0]);
    let mut headers = vec![
        ("RateLimit-Policy".to_string(), policy),
        (
            "RateLimit".to_string(),
            format!(
                "{};r={};t={}",
                policy_name(binding_window),
                status.limit_remaining,
                reset_s
            ),
        ),
    ];
    if overall == Code::OverLimit {
        headers.push(("Retry-After".to_string(), reset_s.max(1).to_string()));
    }
    headers
}

/// Names of the reference server's response headers: limit, remaining, reset (seconds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitHeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
}

impl Default for LimitHeaderNames {
    fn default() -> Self {
        LimitHeaderNames {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// The reference server's headers (`LIMIT_RESPONSE_HEADERS_ENABLED`): the limit, remaining and
/// reset in seconds of one status: the limited one with the least remaining, or the last one
/// over the limit. The reset is the rolling window's (the reference's is the fixed window's).
pub fn reference(statuses: &[Status], names: &LimitHeaderNames) -> Vec<(String, String)> {
    let mut chosen: Option<&Status> = None;
    for status in statuses.iter().filter(|s| s.current_limit.is_some()) {
        // An over-limit status has 0 remaining, so only a later over-limit one displaces it.
        let fewer = chosen.is_none_or(|c| status.limit_remaining < c.limit_remaining);
        if status.code == Code::OverLimit || fewer {
            chosen = Some(status);
        }
    }
    let Some((status, limit)) = chosen.and_then(|s| Some((s, s.current_limit.as_ref()?))) else {
        return Vec::new();
    };
    vec![
        (names.limit.clone(), limit.requests_per_unit.to_string()),
        (names.remaining.clone(), status.limit_remaining.to_string()),
        (
            names.reset.clone(),
            seconds_up(status.duration_until_reset_ms.unwrap_or(0)).to_string(),
        ),
    ]
}

/// Whole seconds, rounded up: a client that waits this long is never early.
fn seconds_up(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// An RFC 8941 string: quoted, with `"` and `\` escaped; other non-printable characters dropped.
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => {}
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_headers_follow_the_least_remaining_or_the_last_over_limit() {
        let names = LimitHeaderNames::default();
        let w5 = window(5, 60_000, None);
        let w9 = window(9, 1_000, None);
        let ok = status(Code::Ok, &w5, 3, 1_500);
        let tight = status(Code::Ok, &w9, 1, 400);
        let over = status(Code::OverLimit, &w9, 0, 2_001);
        assert_eq!(
            reference(&[ok.clone(), tight.clone()], &names),
            [
                ("RateLimit-Limit".to_string(), "9".to_string()),
                ("RateLimit-Remaining".to_string(), "1".to_string()),
                ("RateLimit-Reset".to_string(), "1".to_string()),
            ]
        );
        let chosen = reference(&[over, ok.clone(), tight], &names);
        assert_eq!(chosen[1].1, "0");
        assert_eq!(chosen[2].1, "3", "the over-limit status stays chosen");
        assert!(reference(&[Status::unlimited_by_config()], &names).is_empty());
    }
    use crate::limiter::{ReportedLimit, Unit};

    fn window(limit: u32, length_ms: u64, name: Option<&str>) -> Window {
        Window {
            limit,
            length_ms,
            unit: Unit::nearest(length_ms),
            name: name.map(Into::into),
        }
    }

    fn status(code: Code, w: &Window, remaining: u32, reset_ms: u64) -> Status {
        Status {
            code,
            current_limit: Some(ReportedLimit {
                name: w.name.clone(),
                requests_per_unit: w.limit,
                unit: w.unit,
                window_ms: w.length_ms,
            }),
            limit_remaining: remaining,
            duration_until_reset_ms: Some(reset_ms),
        }
    }

    #[test]
    fn over_limit_headers_carry_the_exact_retry_after() {
        let windows = [
            window(3, 60_000, Some("burst")),
            window(10, 3_600_000, None),
        ];
        let statuses = vec![status(Code::OverLimit, &windows[1], 0, 1_200_500)];
        let headers = build(&statuses, |_| Some(&windows[..]), Code::OverLimit);
        assert_eq!(
            headers,
            vec![
                (
                    "RateLimit-Policy".into(),
                    "\"burst\";q=3;w=60, \"10-per-3600s\";q=10;w=3600".into()
                ),
                ("RateLimit".into(), "\"10-per-3600s\";r=0;t=1201".into()),
                ("Retry-After".into(), "1201".into()),
            ]
        );
    }

    #[test]
    fn ok_headers_describe_the_least_remaining_descriptor() {
        let a = [window(100, 1_000, Some("a\"b"))];
        let b = [window(5, 90_000, None)];
        let statuses = vec![
            status(Code::Ok, &a[0], 50, 10),
            status(Code::Ok, &b[0], 2, 30_000),
        ];
        let headers = build(
            &statuses,
            |n| Some(if n == 0 { &a[..] } else { &b[..] }),
            Code::Ok,
        );
        assert_eq!(headers[0].1, "\"5-per-90s\";q=5;w=90");
        assert_eq!(headers[1].1, "\"5-per-90s\";r=2;t=30");
        assert_eq!(headers.len(), 2);
        let quoted = build(&statuses[..1], |_| Some(&a[..]), Code::Ok);
        assert_eq!(quoted[0].1, "\"a\\\"b\";q=100;w=1");
    }
}
