//! The Rate Limit Quota Service on the gRPC port (`StreamRateLimitQuotas`): Envoy's
//! `rate_limit_quota` filter opens one stream per server and domain, reports a bucket's first
//! request at once and every bucket's usage every 5 s; each report is answered with its buckets'
//! assignments ([`Limiter::quota_report`]). Each stream is served by a task of its own, so a
//! slow store call holds up that stream alone.
//!
//! What one stream may ask, past which it ends with `RESOURCE_EXHAUSTED` and other streams go on:
//! [`MOST_BUCKETS_PER_REPORT`] buckets in a report, [`MOST_BUCKETS_PER_STREAM`] distinct buckets,
//! the request bounds' entries, key and value sizes for a bucket id; and the server as a whole
//! serves at most `--rlqs-max-streams` streams at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::limiter::{Assignment, BucketUsage, Limiter, RequestBounds};
use crate::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
    rate_limit_quota_response::{BucketAction, bucket_action},
    rate_limit_quota_service_server::RateLimitQuotaService,
};
use crate::proto::envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};

/// The most buckets one report may hold (Envoy reports every bucket it has at once).
pub const MOST_BUCKETS_PER_REPORT: usize = 1_000;
/// The most distinct buckets one stream may report.
pub const MOST_BUCKETS_PER_STREAM: usize = 10_000;
/// The most streams at once, by default (`--rlqs-max-streams`).
pub const DEFAULT_MAX_STREAMS: usize = 10_000;

/// The service: the limiter, and the streams open now.
pub struct QuotaService {
    limiter: Arc<Limiter>,
    open: Arc<AtomicUsize>,
    max_streams: usize,
}

impl QuotaService {
    pub fn new(limiter: Arc<Limiter>, max_streams: usize) -> QuotaService {
        QuotaService {
            limiter,
            open: Arc::new(AtomicUsize::new(0)),
            max_streams,
        }
    }
}

/// One open stream's place among the server's streams, given back when the stream ends.
struct Opened {
    open: Arc<AtomicUsize>,
    limiter: Arc<Limiter>,
}

impl Drop for Opened {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.limiter.observer().quota_stream(false);
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        if self.open.fetch_add(1, Ordering::Relaxed) >= self.max_streams {
            self.open.fetch_sub(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "slidegate serves at most {} quota streams at once (--rlqs-max-streams)",
                self.max_streams
            )));
        }
        self.limiter.observer().quota_stream(true);
        let opened = Opened {
            open: self.open.clone(),
            limiter: self.limiter.clone(),
        };
        let (answers, rx) = mpsc::channel(4);
        let stream = Stream {
            limiter: self.limiter.clone(),
            holder: self.limiter.quota_holder(),
            domain: None,
            buckets: HashSet::new(),
            answers,
        };
        tokio::spawn(stream.serve(request.into_inner(), opened));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// One stream: its holder name, domain (from its first report), the buckets it reported, and
/// where its answers go.
struct Stream {
    limiter: Arc<Limiter>,
    holder: String,
    domain: Option<String>,
    buckets: HashSet<Vec<(String, String)>>,
    answers: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
}

impl Stream {
    /// Answers each report until the Envoy ends the stream, stops reading it, or sends what
    /// ends it (the error is its last answer).
    async fn serve(mut self, mut reports: Streaming<RateLimitQuotaUsageReports>, opened: Opened) {
        loop {
            let report = tokio::select! {
                report = reports.message() => report,
                () = self.answers.closed() => break,
            };
            let Ok(Some(report)) = report else {
                break;
            };
            let answer = match self.read(report) {
                Ok((ids, usages)) => Ok(self.answer(ids, usages).await),
                Err(status) => Err(status),
            };
            let last = answer.is_err();
            if matches!(&answer, Ok(r) if r.bucket_action.is_empty()) {
                continue;
            }
            if self.answers.send(answer).await.is_err() || last {
                break;
            }
        }
        let held = i64::try_from(self.buckets.len()).unwrap_or(i64::MAX);
        self.limiter.observer().quota_buckets(-held);
        drop(opened);
    }

    /// A report read and checked: its buckets' ids as they came, and their usage.
    fn read(
        &mut self,
        report: RateLimitQuotaUsageReports,
    ) -> Result<(Vec<BucketId>, Vec<BucketUsage>), Status> {
        match &self.domain {
            None if report.domain.is_empty() => {
                return Err(Status::invalid_argument(
                    "domain: a stream's first report names its domain (the filter's `domain`); it was empty",
                ));
            }
            None => self.domain = Some(report.domain.clone()),
            Some(domain) if !report.domain.is_empty() && report.domain != *domain => {
                return Err(Status::invalid_argument(format!(
                    "domain: a stream keeps the domain of its first report ({domain:?}); this report names {:?}: open a stream per domain",
                    report.domain
                )));
            }
            Some(_) => {}
        }
        let count = report.bucket_quota_usages.len();
        if count > MOST_BUCKETS_PER_REPORT {
            return Err(Status::resource_exhausted(format!(
                "bucket_quota_usages: a report holds at most {MOST_BUCKETS_PER_REPORT} buckets; this one held {count}"
            )));
        }
        let bounds = self.limiter.bounds();
        let mut ids = Vec::with_capacity(count);
        let mut usages = Vec::with_capacity(count);
        for (i, usage) in report.bucket_quota_usages.into_iter().enumerate() {
            let id = usage.bucket_id.unwrap_or_default();
            let entries = bucket_entries(&id, i, bounds)?;
            if !self.buckets.contains(&entries) {
                if self.buckets.len() >= MOST_BUCKETS_PER_STREAM {
                    return Err(Status::resource_exhausted(format!(
                        "bucket_quota_usages[{i}]: a stream reports at most {MOST_BUCKETS_PER_STREAM} distinct buckets"
                    )));
                }
                self.buckets.insert(entries.clone());
                self.limiter.observer().quota_buckets(1);
            }
            usages.push(BucketUsage {
                id: entries,
                allowed: usage.num_requests_allowed,
                denied: usage.num_requests_denied,
                elapsed_ms: usage
                    .time_elapsed
                    .map_or(0, |d| elapsed_ms(d.seconds, d.nanos)),
            });
            ids.push(id);
        }
        Ok((ids, usages))
    }

    /// The report's answer: one action per bucket the limiter answered.
    async fn answer(&self, ids: Vec<BucketId>, usages: Vec<BucketUsage>) -> RateLimitQuotaResponse {
        let domain = self.domain.as_deref().unwrap_or_default();
        let assignments = self
            .limiter
            .quota_report(domain, &self.holder, &usages)
            .await;
        let ttl = self.limiter.quota_ttl();
        let bucket_action = ids
            .into_iter()
            .zip(assignments)
            .filter_map(|(id, assignment)| Some(action(id, assignment?, ttl)))
            .collect();
        RateLimitQuotaResponse { bucket_action }
    }
}

/// A bucket id's entries, sorted by key; an id without entries, or with an empty key or value,
/// is refused (`INVALID_ARGUMENT`), one past the request bounds too (`RESOURCE_EXHAUSTED`).
fn bucket_entries(
    id: &BucketId,
    i: usize,
    bounds: &RequestBounds,
) -> Result<Vec<(String, String)>, Status> {
    // Named only in an error: most ids have none.
    let field = || format!("bucket_quota_usages[{i}].bucket_id");
    if id.bucket.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{}: a bucket id needs at least one entry",
            field()
        )));
    }
    if id.bucket.len() > bounds.entries {
        return Err(Status::resource_exhausted(format!(
            "{}: a bucket id holds at most {} entries (--max-entries); this one held {}",
            field(),
            bounds.entries,
            id.bucket.len()
        )));
    }
    let mut entries = Vec::with_capacity(id.bucket.len());
    for (key, value) in &id.bucket {
        if key.is_empty() || value.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{}: every entry needs a key and a value; {key:?} = {value:?} lacks one",
                field()
            )));
        }
        if key.len() > bounds.key_bytes || value.len() > bounds.value_bytes {
            return Err(Status::resource_exhausted(format!(
                "{}: keys hold at most {} bytes (--max-key-bytes) and values {} (--max-value-bytes); {key:?} is past them",
                field(),
                bounds.key_bytes,
                bounds.value_bytes
            )));
        }
        entries.push((key.clone(), value.clone()));
    }
    entries.sort();
    Ok(entries)
}

/// A `time_elapsed` in ms: negative reads as 0, and any length saturates.
fn elapsed_ms(seconds: i64, nanos: i32) -> u64 {
    let seconds = u64::try_from(seconds).unwrap_or(0);
    let nanos = u64::try_from(nanos).unwrap_or(0);
    seconds
        .saturating_mul(1000)
        .saturating_add(nanos / 1_000_000)
}

/// A bucket's action: an assignment that lives `ttl`, in whole seconds (Envoy 1.40 reads no
/// fraction of one). A token bucket's fill interval also carries its seconds as nanoseconds:
/// Envoy sees a changed assignment only by `max_tokens`, `tokens_per_fill` or the interval's
/// nanoseconds, so a change of the interval's seconds alone would keep the old rate.
fn action(id: BucketId, assignment: Assignment, ttl: Duration) -> BucketAction {
    use rate_limit_strategy::{BlanketRule, Strategy};
    let strategy = match assignment {
        Assignment::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Assignment::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Assignment::TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval_s,
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(pbjson_types::UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(pbjson_types::Duration {
                seconds: i64::from(fill_interval_s),
                nanos: i32::try_from(fill_interval_s).unwrap_or(i32::MAX),
            }),
            name: String::new(),
        }),
    };
    let seconds = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            bucket_action::QuotaAssignmentAction {
                assignment_time_to_live: Some(pbjson_types::Duration { seconds, nanos: 0 }),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_ids_are_checked_and_sorted() {
        let bounds = RequestBounds::default();
        let id = |pairs: &[(&str, &str)]| BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        };
        let entries = bucket_entries(&id(&[("tenant", "acme"), ("plan", "free")]), 0, &bounds)
            .expect("a good id");
        assert_eq!(
            entries,
            [
                ("plan".to_string(), "free".to_string()),
                ("tenant".to_string(), "acme".to_string())
            ]
        );
        let empty = bucket_entries(&id(&[]), 3, &bounds).expect_err("empty");
        assert_eq!(empty.code(), tonic::Code::InvalidArgument);
        assert!(
            empty
                .message()
                .starts_with("bucket_quota_usages[3].bucket_id:"),
            "{empty:?}"
        );
        let blank = bucket_entries(&id(&[("user", "")]), 0, &bounds).expect_err("blank value");
        assert_eq!(blank.code(), tonic::Code::InvalidArgument);
        let many: Vec<(String, String)> = (0..=bounds.entries)
            .map(|n| (format!("k{n}"), "v".to_string()))
            .collect();
        let many = BucketId {
            bucket: many.into_iter().collect(),
        };
        let past = bucket_entries(&many, 0, &bounds).expect_err("too many entries");
        assert_eq!(past.code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn elapsed_time_is_bounded_either_way() {
        assert_eq!(elapsed_ms(5, 0), 5_000);
        assert_eq!(elapsed_ms(0, 0), 0);
        assert_eq!(elapsed_ms(-3, -1), 0);
        assert_eq!(elapsed_ms(i64::MAX, i32::MAX), u64::MAX);
    }

    /// A token bucket's interval carries its seconds as nanoseconds too, so that Envoy sees a
    /// change of the interval alone; the time to live is whole seconds, at least one.
    #[test]
    fn actions_carry_what_envoy_reads() {
        let bucket = action(
            BucketId::default(),
            Assignment::TokenBucket {
                max_tokens: 5,
                tokens_per_fill: 2,
                fill_interval_s: 3,
            },
            Duration::from_millis(10_500),
        );
        let Some(bucket_action::BucketAction::QuotaAssignmentAction(assignment)) =
            bucket.bucket_action
        else {
            panic!("an assignment");
        };
        assert_eq!(
            assignment.assignment_time_to_live.map(|d| d.seconds),
            Some(10)
        );
        let Some(rate_limit_strategy::Strategy::TokenBucket(tb)) =
            assignment.rate_limit_strategy.and_then(|s| s.strategy)
        else {
            panic!("a token bucket");
        };
        assert_eq!(tb.fill_interval.map(|d| (d.seconds, d.nanos)), Some((3, 3)));
        assert_eq!(tb.tokens_per_fill.map(|t| t.value), Some(2));
    }
}
