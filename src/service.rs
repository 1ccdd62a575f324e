//! The gRPC `envoy.service.ratelimit.v3.RateLimitService`: protobuf in, [`Limiter`] decides,
//! protobuf out (conversions in [`crate::wire`]).
//!
//! [`to_status`] is the only place a failure becomes a gRPC status; see its table.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::Either;
use tonic::{Request, Response};

use crate::limiter::{Limiter, LimiterError};
use crate::proto::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
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

/// The one path Envoy calls.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Wraps the router of every gRPC service (`S`) so that `ShouldRateLimit` calls go straight to
/// the rate-limit service, and only the other paths (health, reflection, unknown) through the
/// router. The router matches a path against every service's pattern, captures and
/// percent-decodes the method as a URL parameter, and boxes the call: about 3% of the
/// instructions of a decision (`cargo bench --bench server_cost`), for a path known in advance.
/// The rate-limit service is the same one the router holds, so the call is served alike.
#[derive(Clone)]
pub struct ShouldRateLimitFirst<S> {
    rate_limit: RateLimitServiceServer<RateLimitGrpc>,
    inner: S,
}

/// The [`tower::Layer`] that makes [`ShouldRateLimitFirst`] around the router.
#[derive(Clone)]
pub struct ShouldRateLimitFirstLayer {
    rate_limit: RateLimitServiceServer<RateLimitGrpc>,
}

impl ShouldRateLimitFirstLayer {
    pub fn new(rate_limit: RateLimitServiceServer<RateLimitGrpc>) -> Self {
        ShouldRateLimitFirstLayer { rate_limit }
    }
}

impl<S> tower::Layer<S> for ShouldRateLimitFirstLayer {
    type Service = ShouldRateLimitFirst<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ShouldRateLimitFirst {
            rate_limit: self.rate_limit.clone(),
            inner,
        }
    }
}

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;
type GrpcResponse = tonic::codegen::http::Response<tonic::body::Body>;

impl<S> tower::Service<GrpcRequest> for ShouldRateLimitFirst<S>
where
    S: tower::Service<GrpcRequest, Response = GrpcResponse, Error = Infallible>,
{
    type Response = GrpcResponse;
    type Error = Infallible;
    type Future = Either<
        <RateLimitServiceServer<RateLimitGrpc> as tower::Service<GrpcRequest>>::Future,
        S::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The rate-limit service is always ready (it takes calls as they come); the router
        // says for itself.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: GrpcRequest) -> Self::Future {
        if request.uri().path() == SHOULD_RATE_LIMIT_PATH {
            Either::Left(tower::Service::call(&mut self.rate_limit, request))
        } else {
            Either::Right(self.inner.call(request))
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

    /// The rate-limit service answers `ShouldRateLimit` itself; the router (a stand-in here,
    /// answering 404) gets every other path.
    #[tokio::test]
    async fn should_rate_limit_skips_the_router_and_other_paths_reach_it() {
        use prost::Message as _;
        use tower::{Layer as _, Service as _};

        use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
        use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

        let limits = crate::config::compile_sources(&[(
            "t.yaml".into(),
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n"
                .into(),
        )])
        .expect("valid config");
        let limiter = Arc::new(Limiter::new(
            limits,
            Arc::new(crate::store::MemoryStore::new()),
            Arc::new(crate::limiter::SystemClock),
            crate::limiter::LimiterOptions::default(),
        ));
        let layer = ShouldRateLimitFirstLayer::new(RateLimitServiceServer::new(
            RateLimitGrpc::new(limiter),
        ));
        let router = tower::service_fn(|_: GrpcRequest| async {
            let mut response = GrpcResponse::new(tonic::body::Body::empty());
            *response.status_mut() = tonic::codegen::http::StatusCode::NOT_FOUND;
            Ok::<_, Infallible>(response)
        });
        let mut service = layer.layer(router);
        let call = |path: &str| {
            let message = RateLimitRequest {
                domain: "d".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "k".into(),
                        value: "v".into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            }
            .encode_to_vec();
            // A gRPC message: not compressed, its length, its bytes.
            let mut body = vec![0u8];
            body.extend(u32::try_from(message.len()).expect("small").to_be_bytes());
            body.extend(message);
            let mut request =
                GrpcRequest::new(tonic::body::Body::new(axum::body::Body::from(body)));
            *request.method_mut() = tonic::codegen::http::Method::POST;
            *request.uri_mut() = format!("http://slidegate{path}").parse().expect("uri");
            request.headers_mut().insert(
                "content-type",
                tonic::codegen::http::HeaderValue::from_static("application/grpc"),
            );
            request
        };

        let answer = service
            .call(call(SHOULD_RATE_LIMIT_PATH))
            .await
            .expect("infallible");
        assert_eq!(answer.status(), 200);
        let body = axum::body::to_bytes(axum::body::Body::new(answer.into_body()), 1 << 16)
            .await
            .expect("body");
        let decoded = RateLimitResponse::decode(body.get(5..).expect("a gRPC message"))
            .expect("a RateLimitResponse");
        assert_eq!(decoded.overall_code, 1, "OK: the first of one a minute");

        let other = service
            .call(call("/grpc.health.v1.Health/Check"))
            .await
            .expect("infallible");
        assert_eq!(other.status(), 404, "the router answered");
    }

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
