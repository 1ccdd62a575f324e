//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`: protobuf in, [`Limiter`] decides,
//! protobuf out (conversions in [`crate::wire`]).
//!
//! [`to_status`] is the only place a failure becomes a gRPC status; see its table.

use std::sync::Arc;

use tonic::{Request, Response};

use crate::limiter::{Limiter, LimiterError};
use crate::proto::rate_limit_service_server::RateLimitService;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::wire;

/// Serves `ShouldRateLimit` from a [`Limiter`].
#[derive(Clone)]
pub struct RateLimitGrpc {
    limiter: Arc<Limiter>,
}

impl RateLimitGrpc {
    pub fn new(limiter: Arc<Limiter>) -> RateLimitGrpc {
        RateLimitGrpc { limiter }
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitGrpc {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, tonic::Status> {
        let request = wire::from_proto(request.into_inner());
        match self.limiter.should_rate_limit(&request).await {
            Ok(decision) => Ok(Response::new(wire::to_proto(&request, decision))),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn errors_map_to_the_documented_codes() {
        let invalid = to_status(&LimiterError::InvalidRequest("x".into()));
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
        let store = to_status(&LimiterError::Store(crate::store::StoreError::Timeout(
            Duration::from_millis(15),
        )));
        assert_eq!(store.code(), tonic::Code::Unavailable);
        assert_eq!(store.message(), "store timed out after 15 ms");
    }
}
