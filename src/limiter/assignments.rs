//! Envoy's Rate Limit Quota Service, in the domain: a report's buckets matched to rules (a
//! bucket id matches the rule the descriptor of its entries would match, in whichever order the
//! tree has them), their usage handed to the store with the stream that reports it, and each
//! outcome turned into an assignment. The store shares each limit among the Envoys that report
//! it (`store::shares`); the transport (`server/grpc/quota_streams.rs`) reads the stream and writes the
//! assignments. Rules are the same as `ShouldRateLimit`'s, and so is a bucket's window: what
//! the Envoys admit is counted where a `ShouldRateLimit` check reads it.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::Instrument as _;

use super::clock::Stopwatch;
use super::engine::Limiter;
use super::key::{self, Variant};
use super::rules::{Domain, FailurePolicy, Limit, Match};
use super::why;
use crate::store::{Grant, QuotaItem, QuotaOutcome};

/// How long an assignment lives: Envoy reports every 5 s, so an assignment outlives one late
/// report, and the share of an Envoy that stops reporting returns to the others within it.
pub const QUOTA_TTL: Duration = Duration::from_secs(10);

/// One bucket's usage, as an Envoy reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BucketUsage {
    /// The bucket id's entries, in no particular order.
    pub id: Vec<(String, String)>,
    pub allowed: u64,
    pub denied: u64,
    /// Since the bucket's last report on this stream (0 in its first).
    pub elapsed_ms: u64,
}

/// What an Envoy is told to do with a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// No rule limits it (none matches, it is `unlimited`, or in shadow mode).
    AllowAll,
    /// Its limit is used up, or held by other Envoys; or the store failed and the domain's
    /// policy is `deny`.
    DenyAll,
    /// Its share: a token bucket of `max_tokens`, refilled by `tokens_per_fill` every
    /// `fill_interval_s` seconds.
    TokenBucket {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_interval_s: u32,
    },
}

impl Assignment {
    /// The kind, for metrics and logs.
    pub fn kind(self) -> &'static str {
        match self {
            Assignment::AllowAll => "allow_all",
            Assignment::DenyAll => "deny_all",
            Assignment::TokenBucket { .. } => "token_bucket",
        }
    }
}

/// A report's bucket as the limiter plans it: its rule's match, and its store item if the rule
/// limits it.
struct Planned<'a> {
    found: Option<Match<'a>>,
    item: Option<usize>,
}

impl Limiter {
    /// A holder name for one stream: unique to this process (its random instance) and stream,
    /// so that holders of several slidegate replicas sharing a Redis never mix.
    pub fn quota_holder(&self) -> String {
        let n = self.quota_streams.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.instance)
    }

    /// How long the assignments live.
    pub fn quota_ttl(&self) -> Duration {
        self.options.quota_ttl
    }

    /// One report of `holder`'s stream in `domain`: each bucket's assignment, in order. `None`
    /// for a bucket whose store call failed under the `error` policy: no answer, so the Envoy
    /// keeps what it was assigned until its time to live, then its own fallback decides (as
    /// Envoy's `failure_mode_deny` decides a failed `ShouldRateLimit`). As a trace's span
    /// (`--tracing`): the domain, the buckets and the assignments by kind.
    pub async fn quota_report(
        &self,
        domain: &str,
        holder: &str,
        usages: &[BucketUsage],
    ) -> Vec<Option<Assignment>> {
        let span = if crate::traces::spans_wanted() {
            tracing::debug_span!(
                "quota_report",
                otel.name = "StreamRateLimitQuotas report",
                otel.kind = "server",
                domain,
                buckets = usages.len(),
                store = self.store.name(),
                assignments = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let report = self.assign(domain, holder, usages);
        let assignments = if span.is_disabled() {
            report.await
        } else {
            report.instrument(span.clone()).await
        };
        if !span.is_disabled() {
            let kinds: Vec<&str> = assignments
                .iter()
                .map(|a| a.map_or("none", Assignment::kind))
                .collect();
            span.record("assignments", kinds.join(",").as_str());
        }
        assignments
    }

    async fn assign(
        &self,
        domain_name: &str,
        holder: &str,
        usages: &[BucketUsage],
    ) -> Vec<Option<Assignment>> {
        let limits = self.limits.load_full();
        let now_ms = self.clock.now_ms();
        let domain = limits.domain(domain_name);
        // Metrics name a configured domain only: a client cannot grow the series.
        let label = if domain.is_some() {
            domain_name
        } else {
            "unknown"
        };
        // Counted once a report, not once a bucket: a report may hold a thousand.
        let (allowed, denied) = usages.iter().fold((0u64, 0u64), |(a, d), usage| {
            (
                a.saturating_add(usage.allowed),
                d.saturating_add(usage.denied),
            )
        });
        self.observer.quota_usage(label, allowed, denied);
        let Some(domain) = domain else {
            self.observer.unknown_domain();
            return self.assigned(label, vec![Some(Assignment::AllowAll); usages.len()]);
        };
        let mut items = Vec::with_capacity(usages.len());
        let planned: Vec<Planned<'_>> = usages
            .iter()
            .map(|usage| plan_bucket(domain_name, domain, holder, usage, &mut items))
            .collect();
        let outcomes = self.quota_outcomes(domain, &items, now_ms).await;
        let assignments = planned
            .iter()
            .zip(usages)
            .map(|(p, usage)| {
                let assignment = self.assignment(p, &outcomes);
                if why::wanted(domain.log_decisions) {
                    let outcome = p.item.and_then(|i| outcomes.as_ref().ok()?.get(i));
                    why::log_assignment(why::Assigned {
                        domain: domain_name,
                        rule: p.found.as_ref().map(|m| &**m.rule),
                        usage,
                        outcome,
                        assignment,
                        values: self.options.log_descriptor_values,
                        loud: domain.log_decisions,
                    });
                }
                assignment
            })
            .collect();
        self.assigned(domain_name, assignments)
    }

    /// Tells the observer what was assigned.
    fn assigned(
        &self,
        domain: &str,
        assignments: Vec<Option<Assignment>>,
    ) -> Vec<Option<Assignment>> {
        // By kind, once a report: a report may hold a thousand buckets, of four kinds at most.
        let mut kinds: Vec<(&'static str, u64)> = Vec::with_capacity(4);
        for assignment in &assignments {
            let kind = assignment.map_or("none", Assignment::kind);
            match kinds.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, count)) => *count += 1,
                None => kinds.push((kind, 1)),
            }
        }
        for (kind, count) in kinds {
            self.observer.quota_assignments(domain, kind, count);
        }
        assignments
    }

    /// The store's outcomes for a report's items, or why there are none: the store failed, or
    /// lost its data less than a window ago in a domain with `store_reset: closed`.
    async fn quota_outcomes(
        &self,
        domain: &Domain,
        items: &[QuotaItem<'_>],
        now_ms: u64,
    ) -> Result<Vec<QuotaOutcome>, FailurePolicy> {
        let policy = domain.store_failure.unwrap_or(self.options.failure_policy);
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let error = match self.closed_after_reset(domain, now_ms) {
            Some(error) => error,
            None => {
                let started = Stopwatch::start();
                let ttl_ms = u64::try_from(self.options.quota_ttl.as_millis()).unwrap_or(u64::MAX);
                let result = self.store.quota(items, ttl_ms, now_ms).await;
                self.observer
                    .store_call(self.store.name(), started.elapsed(), result.is_ok());
                match result {
                    Ok(outcomes) if outcomes.len() == items.len() => return Ok(outcomes),
                    Ok(outcomes) => crate::store::StoreError::Protocol(format!(
                        "{} quota outcomes for {} buckets",
                        outcomes.len(),
                        items.len()
                    )),
                    Err(error) => error,
                }
            }
        };
        self.note_store_error(&error, now_ms, policy);
        Err(policy)
    }

    /// A planned bucket's assignment, from its item's outcome.
    fn assignment(
        &self,
        planned: &Planned<'_>,
        outcomes: &Result<Vec<QuotaOutcome>, FailurePolicy>,
    ) -> Option<Assignment> {
        let Some(item) = planned.item else {
            return Some(Assignment::AllowAll);
        };
        let outcome = match outcomes {
            Ok(outcomes) => outcomes.get(item)?,
            Err(FailurePolicy::Allow) => return Some(Assignment::AllowAll),
            Err(FailurePolicy::Deny) => return Some(Assignment::DenyAll),
            Err(FailurePolicy::Error) => return None,
        };
        let shadow = self.options.global_shadow_mode
            || planned.found.as_ref().is_some_and(|m| m.rule.shadow_mode);
        Some(match outcome.grant {
            _ if shadow => Assignment::AllowAll,
            Grant::Full | Grant::Held => Assignment::DenyAll,
            Grant::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval_s,
            } => Assignment::TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval_s,
            },
        })
    }
}

/// Matches one bucket, and adds its store item to `items` when its rule limits it.
fn plan_bucket<'a>(
    domain_name: &str,
    domain: &'a Domain,
    holder: &'a str,
    usage: &'a BucketUsage,
    items: &mut Vec<QuotaItem<'a>>,
) -> Planned<'a> {
    let Some(found) = domain.root.find_bucket(&usage.id) else {
        return Planned {
            found: None,
            item: None,
        };
    };
    let Limit::Windows {
        counted, algorithm, ..
    } = &found.rule.limit
    else {
        return Planned {
            found: Some(found),
            item: None,
        };
    };
    items.push(QuotaItem {
        key: key::build(
            domain_name,
            &found.segments,
            Variant::Configured,
            found.rule.tag_by.as_deref(),
        ),
        windows: Cow::Borrowed(counted),
        algorithm: *algorithm,
        holder,
        allowed: usage.allowed,
        denied: usage.denied,
        elapsed_ms: usage.elapsed_ms,
    });
    Planned {
        found: Some(found),
        item: Some(items.len() - 1),
    }
}
