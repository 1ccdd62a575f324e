//! Asking the store about a planned request. The over-limit cache answers first: a descriptor
//! known to be over rejects the request without a store call, and the store is asked about the
//! others recording nothing. Each store call is timed for the observer. When the store fails, or
//! lost its data less than a window ago in a domain with `store_reset: closed`, the domain's
//! failure policy answers; store errors are counted, and logged once per burst rather than per
//! call.

use std::sync::atomic::Ordering;

use tracing::Instrument as _;

use super::LimiterError;
use super::clock::Stopwatch;
use super::engine::Limiter;
use super::rules::{Domain, FailurePolicy};
use crate::store::{CheckItem, CheckOutcome, ItemOutcome, StoreError};

/// Store errors are logged at most this often.
const ERROR_LOG_EVERY_MS: u64 = 10_000;

impl Limiter {
    /// The store's outcome for a planned request's items, and which of them the over-limit
    /// cache answered. A request without items needs no store, and is admitted.
    pub(super) async fn store_outcome(
        &self,
        domain: &Domain,
        items: &[CheckItem<'_>],
        now_ms: u64,
    ) -> Result<(CheckOutcome, Vec<bool>), LimiterError> {
        if items.is_empty() {
            let none = CheckOutcome {
                admitted: true,
                items: Vec::new(),
            };
            return Ok((none, Vec::new()));
        }
        let policy = domain.store_failure.unwrap_or(self.options.failure_policy);
        match self.closed_after_reset(domain, now_ms) {
            Some(error) => {
                let outcome = self.by_policy(items, error, now_ms, policy)?;
                Ok((outcome, vec![false; items.len()]))
            }
            None => self.check_cached(items, now_ms, policy).await,
        }
    }

    /// Asks the store, unless a descriptor is known to be over (the over-limit cache): then the
    /// request is rejected without sending that descriptor, and the store is asked only about
    /// the others, recording nothing. Returns the outcome and which items the cache answered.
    async fn check_cached(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        policy: FailurePolicy,
    ) -> Result<(CheckOutcome, Vec<bool>), LimiterError> {
        let generation = self.cache.generation();
        // A debit records even when its request is rejected: such requests always go to the
        // store.
        let known: Vec<Option<ItemOutcome>> =
            if self.cache.is_empty() || items.iter().any(|i| i.debit) {
                Vec::new()
            } else {
                items.iter().map(|i| self.cache.get(i, now_ms)).collect()
            };
        if !known.iter().any(Option::is_some) {
            let outcome = self.check(items, now_ms, policy).await?;
            self.remember(items, &outcome.items, now_ms, generation);
            return Ok((outcome, vec![false; items.len()]));
        }
        let rest: Vec<CheckItem<'_>> = items
            .iter()
            .zip(&known)
            .filter(|(_, k)| k.is_none())
            .map(|(i, _)| i.clone())
            .collect();
        let mut rest_outcomes = if rest.is_empty() {
            Vec::new()
        } else {
            match self.ask_store(&rest, now_ms, true, policy).await {
                Ok(outcome) => {
                    self.remember(&rest, &outcome.items, now_ms, generation);
                    outcome.items
                }
                // The request is over whatever the store says about the others.
                Err(e) => {
                    self.note_store_error(&e, now_ms, policy);
                    vec![ItemOutcome::default(); rest.len()]
                }
            }
        }
        .into_iter();
        let cached: Vec<bool> = known.iter().map(Option::is_some).collect();
        let outcomes = known
            .into_iter()
            .map(|k| k.or_else(|| rest_outcomes.next()).unwrap_or_default())
            .collect();
        let outcome = CheckOutcome {
            admitted: false,
            items: outcomes,
        };
        Ok((outcome, cached))
    }

    /// Caches the items the store found over.
    fn remember(
        &self,
        items: &[CheckItem<'_>],
        outcomes: &[ItemOutcome],
        now_ms: u64,
        generation: u64,
    ) {
        if !self.cache.enabled() {
            return;
        }
        for (item, outcome) in items.iter().zip(outcomes) {
            self.cache.insert(item, outcome, now_ms, generation);
        }
    }

    /// One store call, timed for the observer; `rejected`: the request is already rejected
    /// (`Store::check_rejected`). Where the store failing means the deny policy answers
    /// `OVER_LIMIT`, the store takes back what it records after giving up
    /// (`Store::check_or_take_back`): such a request never passed. Under the other policies
    /// what it records stands: with `allow` the request passed, and with `error` Envoy's
    /// `failure_mode_deny` decided.
    async fn ask_store(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        rejected: bool,
        policy: FailurePolicy,
    ) -> Result<CheckOutcome, StoreError> {
        let started = Stopwatch::start();
        // A trace's child span per store call (made only as the call's own span is).
        let span = if crate::traces::spans_wanted() {
            tracing::debug_span!(
                "store_call",
                otel.name = "store",
                store = self.store.name(),
                items = items.len(),
                rejected,
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let asked = if rejected {
            self.store.check_rejected(items, now_ms)
        } else if policy == FailurePolicy::Deny {
            self.store.check_or_take_back(items, now_ms)
        } else {
            self.store.check(items, now_ms)
        };
        let result = asked.instrument(span.clone()).await;
        span.record(
            "outcome",
            result.as_ref().map_or_else(StoreError::kind, |_| "ok"),
        );
        self.observer
            .store_call(self.store.name(), started.elapsed(), result.is_ok());
        result
    }

    /// Asks the store; a failure answers per the failure policy.
    async fn check(
        &self,
        items: &[CheckItem<'_>],
        now_ms: u64,
        policy: FailurePolicy,
    ) -> Result<CheckOutcome, LimiterError> {
        match self.ask_store(items, now_ms, false, policy).await {
            Ok(outcome) => Ok(outcome),
            Err(error) => self.by_policy(items, error, now_ms, policy),
        }
    }

    /// Why a domain with `store_reset: closed` is not decided by the store now: the store lost
    /// its data less than one longest window of the domain's rules before (from when the loss
    /// was found, by this replica or another).
    pub(super) fn closed_after_reset(&self, domain: &Domain, now_ms: u64) -> Option<StoreError> {
        if !domain.store_reset_closed {
            return None;
        }
        let lost_at = self.store.data_lost_at()?;
        (now_ms < lost_at.saturating_add(domain.longest_window_ms)).then(|| {
            StoreError::unavailable(format!(
                "the store lost its data {} ms ago; store_reset: closed answers by the failure policy until {} ms have passed",
                now_ms.saturating_sub(lost_at),
                domain.longest_window_ms
            ))
        })
    }

    /// The answer of the failure policy for a store failure.
    fn by_policy(
        &self,
        items: &[CheckItem<'_>],
        error: StoreError,
        now_ms: u64,
        policy: FailurePolicy,
    ) -> Result<CheckOutcome, LimiterError> {
        self.note_store_error(&error, now_ms, policy);
        let admitted = match policy {
            FailurePolicy::Error => return Err(error.into()),
            FailurePolicy::Allow => true,
            FailurePolicy::Deny => false,
        };
        Ok(CheckOutcome {
            admitted,
            items: items
                .iter()
                .map(|_| ItemOutcome {
                    fits: admitted,
                    ..ItemOutcome::default()
                })
                .collect(),
        })
    }

    /// Counts a store error, and logs it unless one was logged less than
    /// [`ERROR_LOG_EVERY_MS`] before.
    pub(super) fn note_store_error(&self, error: &StoreError, now_ms: u64, policy: FailurePolicy) {
        let total = self.store_errors.fetch_add(1, Ordering::Relaxed) + 1;
        let last = self.last_error_log_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= ERROR_LOG_EVERY_MS;
        if due
            && self
                .last_error_log_ms
                .compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::error!(%error, store = self.store.name(), total_errors = total, policy = ?policy, "store call failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::testing::{CONFIG, T0, req};
    use super::super::{Code, LimiterOptions, ManualClock, Status};
    use super::*;
    use crate::store::{Store, StoreFuture};

    struct Broken;

    impl Store for Broken {
        fn check<'a>(&'a self, _: &'a [CheckItem<'a>], _: u64) -> StoreFuture<'a> {
            Box::pin(async { Err(StoreError::unavailable("down")) })
        }
        fn check_rejected<'a>(&'a self, _: &'a [CheckItem<'a>], _: u64) -> StoreFuture<'a> {
            Box::pin(async { Err(StoreError::unavailable("down")) })
        }
        fn inspect<'a>(
            &'a self,
            _: &'a [CheckItem<'a>],
            _: u64,
        ) -> crate::store::InspectFuture<'a> {
            Box::pin(async { Err(StoreError::unavailable("down")) })
        }
        fn reset<'a>(&'a self, _: &'a [crate::store::StoreKey]) -> crate::store::ResetFuture<'a> {
            Box::pin(async { Err(StoreError::unavailable("down")) })
        }
        fn name(&self) -> &'static str {
            "broken"
        }
    }

    #[test]
    fn failure_policy_decides_what_a_store_error_answers() {
        let limits =
            crate::config::compile_sources(&[("t.yaml".into(), CONFIG.into())]).expect("valid");
        let answer = |policy| {
            let options = LimiterOptions {
                failure_policy: policy,
                ..LimiterOptions::default()
            };
            let l = Limiter::new(
                limits.clone(),
                Arc::new(Broken),
                Arc::new(ManualClock::new(T0)),
                options,
            );
            let result = futures_util::FutureExt::now_or_never(
                l.should_rate_limit(&req(&[&[("ip", "f")], &[("none", "x")]])),
            )
            .expect("ready");
            assert_eq!(l.store_errors(), 1);
            result
        };
        assert!(matches!(
            answer(FailurePolicy::Error),
            Err(LimiterError::Store(_))
        ));
        // A domain's own store_failure wins over the server's policy.
        let open = CONFIG.replace("domain: d\n", "domain: d\nstore_failure: allow\n");
        let limits_open =
            crate::config::compile_sources(&[("t.yaml".into(), open)]).expect("valid");
        let l = Limiter::new(
            limits_open,
            Arc::new(Broken),
            Arc::new(ManualClock::new(T0)),
            LimiterOptions::default(),
        );
        let d = futures_util::FutureExt::now_or_never(l.should_rate_limit(&req(&[&[("ip", "f")]])))
            .expect("ready")
            .expect("the domain fails open");
        assert_eq!(d.overall, Code::Ok);
        let allow = answer(FailurePolicy::Allow).expect("answered");
        assert_eq!(allow.overall, Code::Ok);
        let deny = answer(FailurePolicy::Deny).expect("answered");
        assert_eq!(deny.overall, Code::OverLimit);
        assert_eq!(deny.statuses[0].code, Code::OverLimit);
        assert_eq!(
            deny.statuses[1],
            Status::unlimited_by_config(),
            "unlimited descriptors never reach the store"
        );
    }
}
