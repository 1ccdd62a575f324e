//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`: protobuf in, [`Decision`] out.
//!
//! [`to_status`] is the only place a failure becomes a gRPC status; see its table.

use std::sync::Arc;
use std::time::Instant;

use prost_types::value::Kind;
use tonic::{Request, Response};

use crate::limiter::{self, Code, Decision, Limiter, LimiterError};
use crate::metrics::{CallResult, Metrics};
use crate::proto::rate_limit_response::{self as resp, DescriptorStatus};
use crate::proto::rate_limit_service_server::RateLimitService;
use crate::proto::{HeaderValue, RateLimitRequest, RateLimitResponse};

/// Serves `ShouldRateLimit` from a [`Limiter`].
#[derive(Clone)]
pub struct RateLimitGrpc {
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
}

impl RateLimitGrpc {
    pub fn new(limiter: Arc<Limiter>, metrics: Arc<Metrics>) -> RateLimitGrpc {
        RateLimitGrpc { limiter, metrics }
    }
}

/// Decides one request and records it: the call counter and latency, and a debug-level span
/// with the domain, descriptor count, decision and latency. gRPC and `POST /json` both come here.
#[tracing::instrument(
    name = "should_rate_limit",
    level = "debug",
    skip_all,
    fields(
        domain = %request.domain,
        descriptors = request.descriptors.len(),
        decision = tracing::field::Empty,
        latency_us = tracing::field::Empty,
    )
)]
pub async fn decide(
    limiter: &Limiter,
    metrics: &Metrics,
    request: &limiter::Request,
) -> Result<Decision, LimiterError> {
    let started = Instant::now();
    let result = limiter.should_rate_limit(request).await;
    let elapsed = started.elapsed();
    let call = match &result {
        Ok(d) if d.overall == Code::Ok => CallResult::Ok,
        Ok(_) => CallResult::OverLimit,
        Err(LimiterError::InvalidRequest(_)) => CallResult::Invalid,
        Err(LimiterError::Store(_)) => CallResult::StoreError,
    };
    metrics.request(call, elapsed);
    let span = tracing::Span::current();
    span.record("decision", tracing::field::debug(call));
    span.record("latency_us", elapsed.as_micros() as u64);
    tracing::debug!("decided");
    result
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, tonic::Status> {
        let request = from_proto(request.into_inner());
        match decide(&self.limiter, &self.metrics, &request).await {
            Ok(decision) => Ok(Response::new(to_proto(decision))),
            Err(e) => Err(to_status(&e)),
        }
    }
}

/// Maps a limiter failure to a gRPC status:
///
/// | failure | status | why |
/// |---|---|---|
/// | malformed request (empty domain, no descriptors, empty key, unknown override unit) | `INVALID_ARGUMENT` | the caller must fix the request; retrying cannot help |
/// | store timeout or error | `UNAVAILABLE` | transient; Envoy applies `failure_mode_deny` (some clients treat `UNKNOWN` as a bug, not an outage) |
///
/// Messages say what is wrong without internals (no addresses, no credentials).
pub fn to_status(error: &LimiterError) -> tonic::Status {
    match error {
        LimiterError::InvalidRequest(message) => tonic::Status::invalid_argument(message.clone()),
        LimiterError::Store(e) => tonic::Status::unavailable(e.to_string()),
    }
}

/// Protobuf request to domain request. Never fails: checks belong to the limiter.
pub fn from_proto(request: RateLimitRequest) -> limiter::Request {
    limiter::Request {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(|d| limiter::Descriptor {
                entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                limit: d.limit.map(|l| limiter::Override {
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit,
                }),
                hits_addend: d.hits_addend,
            })
            .collect(),
    }
}

fn code(code: Code) -> i32 {
    match code {
        Code::Ok => resp::Code::Ok as i32,
        Code::OverLimit => resp::Code::OverLimit as i32,
    }
}

fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        // Below 1e9, so it fits an i32.
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// Domain decision to protobuf response.
pub fn to_proto(decision: Decision) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code(decision.overall),
        statuses: decision
            .statuses
            .into_iter()
            .map(|s| DescriptorStatus {
                code: code(s.code),
                current_limit: s.current_limit.map(|l| resp::RateLimit {
                    name: l.name.as_deref().unwrap_or_default().to_string(),
                    requests_per_unit: l.requests_per_unit,
                    // limiter::Unit's discriminants are the proto values.
                    unit: l.unit as i32,
                }),
                limit_remaining: s.limit_remaining,
                duration_until_reset: s.duration_until_reset_ms.map(duration),
                quota: None,
            })
            .collect(),
        response_headers_to_add: decision
            .response_headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        dynamic_metadata: decision.dynamic_metadata.map(json_struct),
        ..Default::default()
    }
}

fn json_struct(map: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: map.into_iter().map(|(k, v)| (k, json_value(v))).collect(),
    }
}

fn json_value(value: serde_json::Value) -> prost_types::Value {
    use serde_json::Value;
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        Value::String(s) => Kind::StringValue(s),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.into_iter().map(json_value).collect(),
        }),
        Value::Object(map) => Kind::StructValue(json_struct(map)),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_keep_milliseconds() {
        assert_eq!(
            duration(1_500),
            prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000
            }
        );
        assert_eq!(
            duration(0),
            prost_types::Duration {
                seconds: 0,
                nanos: 0
            }
        );
    }

    #[test]
    fn errors_map_to_the_documented_codes() {
        let invalid = to_status(&LimiterError::InvalidRequest("x".into()));
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
        let store = to_status(&LimiterError::Store(crate::store::StoreError::Timeout(15)));
        assert_eq!(store.code(), tonic::Code::Unavailable);
    }
}
