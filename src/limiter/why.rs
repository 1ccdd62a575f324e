//! The decision log: one line per decided descriptor, saying why it got its code: the domain,
//! the rule that matched (its path), each window's count, limit and reset, the ban, and the
//! entries, their values hashed unless `--log-descriptor-values` shows them (they can be user
//! ids), and the trace id where traces are on. Logged under the target [`TARGET`] at debug level, or at info level for a domain that
//! asks (`log_decisions: true`). Nothing is built unless a line is written.

use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};

use super::assignments::{Assignment, BucketUsage};
use super::rules::{Rule, human_ms};
use super::{Code, Descriptor};
use crate::store::{CheckItem, ItemOutcome, QuotaOutcome};

/// The decision log's target: `RUST_LOG=slidegate::decision=debug` turns it on alone.
pub const TARGET: &str = "slidegate::decision";

/// One decided descriptor, as the log tells it.
pub(super) struct Why<'a> {
    pub domain: &'a str,
    /// Its place in the request.
    pub index: usize,
    pub descriptor: &'a Descriptor,
    /// The rule that matched; `None` for a limit the request carried itself.
    pub rule: Option<&'a Rule>,
    pub item: &'a CheckItem<'a>,
    pub outcome: &'a ItemOutcome,
    pub code: Code,
    /// Answered from the over-limit cache, without the store.
    pub from_cache: bool,
    /// The trace the call belongs to, where traces are on.
    pub trace_id: Option<&'a str>,
}

/// Whether a line would be written: at debug level for every domain, or at info level for a
/// domain that asks (`loud`).
pub(super) fn wanted(loud: bool) -> bool {
    if loud {
        tracing::enabled!(target: TARGET, tracing::Level::INFO)
    } else {
        tracing::enabled!(target: TARGET, tracing::Level::DEBUG)
    }
}

impl Why<'_> {
    /// Writes the line; `values`: the entries' values as they came, not hashed.
    pub fn log(&self, loud: bool, values: bool) {
        let entries = entries(&self.descriptor.entries, values);
        let windows = windows(self.item, self.outcome);
        let rule = self
            .rule
            .map_or("(the request's own limit)", |r| r.path.as_str());
        let code = match self.code {
            Code::Ok => "OK",
            Code::OverLimit => "OVER_LIMIT",
        };
        let ban = if self.outcome.ban_remaining_ms > 0 {
            human_ms(self.outcome.ban_remaining_ms)
        } else {
            "none".to_string()
        };
        let shadow = self.rule.is_some_and(|r| r.shadow_mode);
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    target: TARGET,
                    domain = self.domain,
                    descriptor = self.index,
                    entries = ?entries,
                    rule,
                    code,
                    windows = ?windows,
                    ban = %ban,
                    hits = self.item.hits,
                    recorded = self.outcome.recorded,
                    cached = self.from_cache,
                    shadow,
                    trace_id = self.trace_id.unwrap_or("none"),
                    "descriptor decided"
                )
            };
        }
        if loud {
            line!(info);
        } else {
            line!(debug);
        }
    }
}

/// One bucket of a Rate Limit Quota Service report, as the log tells it.
pub(super) struct Assigned<'a> {
    pub domain: &'a str,
    /// The rule its id matched, if any.
    pub rule: Option<&'a Rule>,
    pub usage: &'a BucketUsage,
    /// The store's outcome, where the store was asked and answered.
    pub outcome: Option<&'a QuotaOutcome>,
    /// `None`: the store failed under the `error` policy, and nothing was answered.
    pub assignment: Option<Assignment>,
    /// The id's values as they came, not hashed.
    pub values: bool,
    /// Logged at info level (`log_decisions: true`), else at debug.
    pub loud: bool,
}

/// Writes one bucket's line: its id, the rule, the usage reported, each window's count after
/// it, and what was assigned (a token bucket as `max_tokens+tokens_per_fill/fill_interval`).
pub(super) fn log_assignment(a: Assigned<'_>) {
    let bucket = entries(&a.usage.id, a.values);
    let rule = a.rule.map_or("(none)", |r| r.path.as_str());
    let counts = a.outcome.map_or_else(String::new, |o| {
        let counts: Vec<String> = o.counts.iter().map(u64::to_string).collect();
        counts.join(",")
    });
    let assigned = match a.assignment {
        None => "none (store failed)".to_string(),
        Some(Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval_s,
        }) => format!("token_bucket {max_tokens}+{tokens_per_fill}/{fill_interval_s}s"),
        Some(other) => other.kind().to_string(),
    };
    macro_rules! line {
        ($level:ident) => {
            tracing::$level!(
                target: TARGET,
                domain = a.domain,
                bucket = %bucket,
                rule,
                allowed = a.usage.allowed,
                denied = a.usage.denied,
                counts = %counts,
                assigned = %assigned,
                "bucket assigned"
            )
        };
    }
    if a.loud {
        line!(info);
    } else {
        line!(debug);
    }
}

/// `key=value,key=value`, each value hashed (`#` and 8 hex digits) unless `values`.
fn entries(entries: &[(String, String)], values: bool) -> String {
    let mut out = String::new();
    for (n, (key, value)) in entries.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(key);
        out.push('=');
        if values {
            out.push_str(value);
        } else {
            let _ = write!(out, "#{:08x}", hashed(value));
        }
    }
    out
}

/// A value's hash: SipHash with fixed keys, the same in every replica and every start, so that
/// one user's lines can be followed across them without the log holding the value; the low 32
/// bits are shown.
fn hashed(value: &str) -> u32 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    // The low bits of a 64-bit hash.
    u32::try_from(hasher.finish() & u64::from(u32::MAX)).unwrap_or(u32::MAX)
}

/// Each window: `count/limit in <length>, reset <time>`, `; ` between them; `banned` where the
/// ban answered without the windows.
fn windows(item: &CheckItem<'_>, outcome: &ItemOutcome) -> String {
    if outcome.windows.is_empty() {
        return "banned".to_string();
    }
    let mut out = String::new();
    for (n, (window, state)) in item.windows.iter().zip(&outcome.windows).enumerate() {
        if n > 0 {
            out.push_str("; ");
        }
        let _ = write!(
            out,
            "{}/{} in {}, reset {}",
            state.count,
            window.limit,
            human_ms(window.length_ms),
            human_ms(state.reset_ms)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use crate::store::{Algorithm, Role, StoreKey, Window, WindowOutcome};

    fn descriptor(entries: &[(&str, &str)]) -> Descriptor {
        Descriptor {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Descriptor::default()
        }
    }

    #[test]
    fn values_are_hashed_alike_everywhere_unless_shown() {
        let d = descriptor(&[("user", "alice"), ("path", "/login")]);
        let hidden = entries(&d.entries, false);
        assert!(
            !hidden.contains("alice") && !hidden.contains("/login"),
            "{hidden}"
        );
        assert!(
            hidden.starts_with("user=#") && hidden.contains(",path=#"),
            "{hidden}"
        );
        assert_eq!(
            hidden,
            entries(&d.entries, false),
            "the same value, the same hash"
        );
        let other = entries(
            &descriptor(&[("user", "bob"), ("path", "/login")]).entries,
            false,
        );
        assert_ne!(hidden[..14], other[..14], "another value, another hash");
        assert_eq!(hidden[14..], other[14..]);
        assert_eq!(entries(&d.entries, true), "user=alice,path=/login");
    }

    #[test]
    fn windows_read_as_count_of_limit_with_their_reset() {
        let item = CheckItem {
            key: StoreKey::new("t", "k"),
            windows: Cow::Owned(vec![
                Window {
                    limit: 3,
                    length_ms: 60_000,
                },
                Window {
                    limit: 10,
                    length_ms: 3_600_000,
                },
            ]),
            algorithm: Algorithm::SlidingLog,
            ban_ms: None,
            hits: 1,
            role: Role::Enforce,
            debit: false,
            text: None,
        };
        let mut outcome = ItemOutcome {
            fits: false,
            windows: vec![
                WindowOutcome {
                    count: 3,
                    reset_ms: 41_200,
                },
                WindowOutcome {
                    count: 7,
                    reset_ms: 0,
                },
            ],
            ..ItemOutcome::default()
        };
        assert_eq!(
            windows(&item, &outcome),
            "3/3 in 1m, reset 41s200ms; 7/10 in 1h, reset 0s"
        );
        outcome.windows.clear();
        assert_eq!(windows(&item, &outcome), "banned");
    }
}
