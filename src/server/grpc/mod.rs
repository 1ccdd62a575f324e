//! The gRPC port: `envoy.service.ratelimit.v3.RateLimitService` answered by [`direct`] on the
//! HTTP/2 stream (protobuf in, [`Limiter`] decides, protobuf out, conversions in
//! [`crate::wire`]), ahead of tonic's router, which serves health and reflection
//! ([`GrpcService`]). A test holds [`direct`] to what tonic's generated server would answer,
//! byte for byte; `docs/performance.md` (*The gRPC path*) has what the direct path saves.
//!
//! [`to_status`] is the only place a failure becomes a gRPC status; see its table.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prost::bytes::Bytes;
use tonic::codegen::http::{Request, Response};

use crate::limiter::{Limiter, LimiterError};
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::server::budget::ConnectionBytes;
use crate::wire;

pub mod direct;
pub mod quota_streams;
pub mod streams;
pub mod tls;

/// One `ShouldRateLimit`: the request into the domain, the decision, the answer back.
async fn decide(
    limiter: &Limiter,
    request: RateLimitRequest,
) -> Result<RateLimitResponse, tonic::Status> {
    let request = wire::from_proto(request);
    match limiter.should_rate_limit(&request).await {
        Ok(decision) => Ok(wire::to_proto(&request, decision)),
        Err(e) => Err(to_status(&e)),
    }
}

/// The one path Envoy calls.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The gRPC port's service: `ShouldRateLimit` calls are answered at once by [`direct`], and only
/// the other paths (health, reflection, unknown) go to the router (`S`, tonic's `Routes`). The
/// router matches a path against every service's pattern, captures and percent-decodes the
/// method as a URL parameter, and boxes the call; tonic's unary machinery then reads and writes
/// the message through layers of adapters, all for a path known in advance
/// (`docs/performance.md`, *The gRPC path*). It is hyper's service
/// itself (`crate::server` serves connections with hyper directly): tonic's server would add a
/// clone of the service, its timeout, error and connection-info layers, and two body adapters
/// around each call.
#[derive(Clone)]
pub struct GrpcService<S> {
    /// What answering `ShouldRateLimit` needs, in one shared piece: a call clones one `Arc`.
    direct: Arc<Direct>,
    router: S,
}

/// The limiter, and what the connection's request bodies may hold and how long one may take
/// to arrive.
struct Direct {
    limiter: Arc<Limiter>,
    bounds: direct::BodyBounds,
}

impl<S> GrpcService<S> {
    /// A service whose request bodies are bounded only by their message size.
    pub fn new(limiter: Arc<Limiter>, router: S) -> Self {
        GrpcService {
            direct: Arc::new(Direct {
                limiter,
                bounds: direct::BodyBounds::default(),
            }),
            router,
        }
    }

    /// With `bytes` as the account of the connections it serves and `timeout` for a body.
    pub fn with_bounds(self, bytes: ConnectionBytes, timeout: Duration) -> Self {
        GrpcService {
            direct: Arc::new(Direct {
                limiter: self.direct.limiter.clone(),
                bounds: direct::BodyBounds { bytes, timeout },
            }),
            router: self.router,
        }
    }
}

impl<S: Clone> GrpcService<S> {
    /// The service for one new connection: its own account of request bytes, under the
    /// server's.
    pub fn for_connection(&self) -> Self {
        let bounds = &self.direct.bounds;
        let bytes = bounds.bytes.server().connection();
        self.clone().with_bounds(bytes, bounds.timeout)
    }
}

pub type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;
pub type GrpcResponse = tonic::codegen::http::Response<tonic::body::Body>;
type ServiceFuture = Pin<Box<dyn Future<Output = Result<Response<GrpcBody>, Infallible>> + Send>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S, B> hyper::service::Service<Request<B>> for GrpcService<S>
where
    S: tower::Service<GrpcRequest, Response = GrpcResponse, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<GrpcBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, request: Request<B>) -> Self::Future {
        if request.uri().path() == SHOULD_RATE_LIMIT_PATH {
            let direct = self.direct.clone();
            Box::pin(async move {
                Ok(direct::should_rate_limit(&direct.limiter, &direct.bounds, request).await)
            })
        } else {
            let router = self.router.clone();
            Box::pin(async move {
                let request = request.map(tonic::body::Body::new);
                let response = tower::ServiceExt::oneshot(router, request).await?;
                Ok(response.map(GrpcBody::Other))
            })
        }
    }
}

/// A response body: the one message and OK trailers of [`direct`] without a box around them,
/// or whatever the router answered.
pub enum GrpcBody {
    Unary(direct::UnaryBody),
    Other(tonic::body::Body),
}

impl http_body::Body for GrpcBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        match self.get_mut() {
            GrpcBody::Unary(body) => match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            GrpcBody::Other(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GrpcBody::Unary(body) => body.is_end_stream(),
            GrpcBody::Other(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            GrpcBody::Unary(body) => body.size_hint(),
            GrpcBody::Other(body) => body.size_hint(),
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
        LimiterError::NoConfig(message) => tonic::Status::unavailable(message.clone()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt as _;
    use prost::Message as _;
    use prost::bytes::Bytes;
    use tonic::codegen::http::{HeaderMap, HeaderValue, Method, StatusCode};
    use tower::Service as _;

    use super::*;
    use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use crate::proto::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};

    /// tonic's generated server for the same service: the reference `direct` is held to.
    #[derive(Clone)]
    struct RateLimitGrpc {
        limiter: Arc<Limiter>,
    }

    #[tonic::async_trait]
    impl RateLimitService for RateLimitGrpc {
        async fn should_rate_limit(
            &self,
            request: tonic::Request<RateLimitRequest>,
        ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
            decide(&self.limiter, request.into_inner())
                .await
                .map(tonic::Response::new)
        }
    }

    /// One a minute for `k`, on a clock that stands still (two limiters answer alike).
    fn limiter() -> Arc<Limiter> {
        let limits = crate::config::compile_sources(&[(
            "t.yaml".into(),
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n"
                .into(),
        )])
        .expect("valid config");
        Arc::new(Limiter::new(
            limits,
            Arc::new(crate::store::MemoryStore::new()),
            Arc::new(crate::limiter::ManualClock::new(1_767_225_600_000)),
            crate::limiter::LimiterOptions::default(),
        ))
    }

    fn message(domain: &str) -> Vec<u8> {
        RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 0,
        }
        .encode_to_vec()
    }

    /// `payload` behind a gRPC prefix with `flag` and `length`.
    fn framed(flag: u8, length: usize, payload: &[u8]) -> Vec<u8> {
        let mut body = vec![flag];
        body.extend(u32::try_from(length).expect("small").to_be_bytes());
        body.extend(payload);
        body
    }

    /// A header's name and value.
    type Header = (&'static str, &'static str);

    /// A named request: its body's frames and extra headers.
    type Case = (&'static str, Vec<Vec<u8>>, &'static [Header]);

    /// A gRPC request to `path` whose body arrives as `frames`, with `headers` added.
    fn request(path: &str, frames: Vec<Vec<u8>>, headers: &[Header]) -> GrpcRequest {
        let frames = frames
            .into_iter()
            .map(|f| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(f))));
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let mut request = GrpcRequest::new(tonic::body::Body::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = format!("http://slidegate{path}").parse().expect("uri");
        request
            .headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        for (name, value) in headers {
            request
                .headers_mut()
                .insert(*name, HeaderValue::from_static(value));
        }
        request
    }

    /// What a client sees of a response: HTTP status, content type, gRPC status and message
    /// (from the headers of a trailers-only response, or the trailers), and the body.
    #[derive(Debug, PartialEq)]
    struct Seen {
        http: StatusCode,
        content_type: Option<HeaderValue>,
        grpc_status: Option<HeaderValue>,
        grpc_message: Option<HeaderValue>,
        accept_encoding: Option<HeaderValue>,
        body: Bytes,
    }

    async fn seen<B>(response: Response<B>) -> Seen
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.expect("a body");
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let either = |name: &str, headers: &HeaderMap| {
            headers.get(name).or_else(|| trailers.get(name)).cloned()
        };
        Seen {
            http: parts.status,
            content_type: parts.headers.get("content-type").cloned(),
            grpc_status: either("grpc-status", &parts.headers),
            grpc_message: either("grpc-message", &parts.headers),
            accept_encoding: either("grpc-accept-encoding", &parts.headers),
            body: collected.to_bytes(),
        }
    }

    /// `service::direct` answers every request as tonic's generated server does: the same
    /// HTTP status, content type, gRPC status and message, and the same message bytes, for
    /// good requests, requests the limiter refuses and requests broken at the gRPC layer.
    #[tokio::test]
    async fn direct_answers_as_tonics_generated_server_does() {
        let ok = message("d");
        let cases: Vec<Case> = vec![
            ("admitted", vec![framed(0, ok.len(), &ok)], &[]),
            (
                "over the limit (second of one a minute)",
                vec![framed(0, ok.len(), &ok)],
                &[],
            ),
            (
                "in two frames",
                vec![framed(0, ok.len(), &ok[..3]), ok[3..].to_vec()],
                &[],
            ),
            (
                "prefix split",
                vec![vec![0, 0], framed(0, ok.len(), &ok)[2..].to_vec()],
                &[],
            ),
            (
                "empty domain",
                vec![framed(0, message("").len(), &message(""))],
                &[],
            ),
            ("not protobuf", vec![framed(0, 3, &[0xff, 0xff, 0xff])], &[]),
            ("no message", vec![], &[]),
            ("ends early", vec![framed(0, ok.len(), &ok[..3])], &[]),
            ("prefix only in part", vec![vec![0, 0, 0]], &[]),
            ("compressed flag", vec![framed(1, ok.len(), &ok)], &[]),
            ("unknown flag", vec![framed(7, ok.len(), &ok)], &[]),
            (
                "too large",
                vec![framed(0, direct::MAX_REQUEST_BYTES + 1, &[])],
                &[],
            ),
            (
                "gzip",
                vec![framed(1, ok.len(), &ok)],
                &[("grpc-encoding", "gzip")],
            ),
            (
                "identity",
                vec![framed(0, ok.len(), &ok)],
                &[("grpc-encoding", "identity")],
            ),
        ];
        let (direct_limiter, tonic_limiter) = (limiter(), limiter());
        let mut tonic_server = RateLimitServiceServer::new(RateLimitGrpc {
            limiter: tonic_limiter,
        });
        for (name, frames, headers) in cases {
            let ours = seen(
                direct::should_rate_limit(
                    &direct_limiter,
                    &direct::BodyBounds::default(),
                    request(SHOULD_RATE_LIMIT_PATH, frames.clone(), headers),
                )
                .await,
            )
            .await;
            let theirs = seen(
                tonic_server
                    .call(request(SHOULD_RATE_LIMIT_PATH, frames, headers))
                    .await
                    .expect("infallible"),
            )
            .await;
            assert_eq!(ours, theirs, "{name}");
        }
    }

    /// The rate-limit call is answered ahead of the router; the router (a stand-in here,
    /// answering 404) gets every other path.
    #[tokio::test]
    async fn should_rate_limit_skips_the_router_and_other_paths_reach_it() {
        let router = tower::service_fn(|_: GrpcRequest| async {
            let mut response = GrpcResponse::new(tonic::body::Body::empty());
            *response.status_mut() = StatusCode::NOT_FOUND;
            Ok::<_, Infallible>(response)
        });
        let service = GrpcService::new(limiter(), router);
        let ok = message("d");
        let call = |path: &str| request(path, vec![framed(0, ok.len(), &ok)], &[]);
        let answer = seen(
            hyper::service::Service::call(&service, call(SHOULD_RATE_LIMIT_PATH))
                .await
                .expect("infallible"),
        )
        .await;
        assert_eq!(answer.http, StatusCode::OK);
        assert_eq!(answer.grpc_status, Some(HeaderValue::from_static("0")));
        let decoded = RateLimitResponse::decode(answer.body.get(5..).expect("a gRPC message"))
            .expect("a RateLimitResponse");
        assert_eq!(decoded.overall_code, 1, "OK: the first of one a minute");
        let other = hyper::service::Service::call(&service, call("/grpc.health.v1.Health/Check"))
            .await
            .expect("infallible");
        assert_eq!(other.status(), StatusCode::NOT_FOUND, "the router answered");
    }

    #[test]
    fn errors_map_to_the_documented_codes() {
        let invalid = to_status(&LimiterError::InvalidRequest("x".into()));
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
        let waited = crate::store::Waited::Redis(
            Duration::from_millis(15),
            crate::store::Bound::RedisTimeout,
        );
        let store = to_status(&LimiterError::Store(crate::store::StoreError::Timeout(
            waited,
        )));
        assert_eq!(store.code(), tonic::Code::Unavailable);
        assert_eq!(
            store.message(),
            "Redis did not answer within 15 ms (--redis-timeout)"
        );
    }
}
