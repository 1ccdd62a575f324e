//! `ShouldRateLimit` answered straight from the HTTP/2 stream: the one unary call Envoy makes,
//! read and written here rather than through tonic's generic unary machinery (its streaming
//! decoder, its encoding body and the layers of body adapters around both), a share of every
//! decision worth saving (`docs/performance.md`, *The gRPC path*). What it answers is
//! what tonic's generated server answers for the same bytes, errors included (a test compares
//! the two): the message with `grpc-status: 0` in the trailers, or a trailers-only response
//! with the status. Compression is not offered: a compressed request is refused the way tonic
//! refuses it.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::Frame;
use http_body_util::BodyExt as _;
use prost::Message as _;
use prost::bytes::{BufMut as _, Bytes, BytesMut};
use tonic::Status;
use tonic::codegen::http::header::CONTENT_TYPE;
use tonic::codegen::http::{HeaderMap, HeaderName, HeaderValue, Request, Response};

use super::{BoxError, GrpcBody, decide};
use crate::limiter::Limiter;
use crate::proto::{RateLimitRequest, RateLimitResponse};
use crate::server::budget::{ConnectionBytes, Exhausted, Hold, RequestBytes};
use crate::server::net::ConnectionLimits;
use crate::store;

// The gRPC headers read or written on every call, as names made at compile time: looked up
// or inserted by a `&str`, a name would be parsed and checked on every call.
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
static GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// The largest request message taken: tonic's default, which applied before.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// A gRPC message's prefix: the compressed flag and the length (big-endian `u32`).
const PREFIX: usize = 5;

/// Answers one `ShouldRateLimit` call, within the caller's `grpc-timeout` when it sends one (as
/// Envoy does, with its filter timeout): past it the answer is `CANCELLED`, as tonic's server
/// answers, and whatever the decision still waited for is dropped.
pub async fn should_rate_limit<B>(
    limiter: &Limiter,
    bounds: &BodyBounds,
    request: Request<B>,
) -> Response<GrpcBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    // A timeout too far away to be a moment (8 digits of hours) is no deadline.
    let deadline = request
        .headers()
        .get(&GRPC_TIMEOUT)
        .and_then(grpc_timeout)
        .and_then(|timeout| tokio::time::Instant::now().checked_add(timeout));
    let caller = crate::traces::callers_context(request.headers());
    let answering = crate::traces::within(caller, answer(limiter, bounds, request));
    let answered = match deadline {
        None => answering.await,
        Some(deadline) => {
            let decided = store::with_caller_deadline(deadline, answering);
            let cancelled = || Err(Status::cancelled("Timeout expired"));
            match tokio::time::timeout_at(deadline, decided).await {
                // A networked store answers by the failure policy a little before the
                // caller's deadline (`store::answer_by`); a failure at or past it is the
                // deadline's, answered as tonic's server answers.
                Ok(Err(_)) if tokio::time::Instant::now() >= deadline => cancelled(),
                Ok(answered) => answered,
                Err(_) => cancelled(),
            }
        }
    };
    match answered {
        Ok(response) => response,
        Err(status) => status.into_http().map(GrpcBody::Other),
    }
}

/// A `grpc-timeout` header's value (<https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md>:
/// at most 8 digits and a unit). A malformed value is ignored, as tonic ignores it.
fn grpc_timeout(value: &HeaderValue) -> Option<Duration> {
    let value = value.to_str().ok()?;
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// What a connection's request bodies may hold ([`ConnectionBytes`]), and how long one may take
/// to arrive whole from its headers.
#[derive(Clone, Debug)]
pub struct BodyBounds {
    pub bytes: ConnectionBytes,
    pub timeout: Duration,
}

impl Default for BodyBounds {
    /// Bytes bounded only by each message's size; the default body timeout.
    fn default() -> Self {
        BodyBounds {
            bytes: RequestBytes::new(usize::MAX, usize::MAX).connection(),
            timeout: ConnectionLimits::default().body_timeout,
        }
    }
}

async fn answer<B>(
    limiter: &Limiter,
    bounds: &BodyBounds,
    request: Request<B>,
) -> Result<Response<GrpcBody>, Status>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if let Some(encoding) = request.headers().get(&GRPC_ENCODING)
        && encoding.as_bytes() != b"identity"
    {
        let mut status = Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            String::from_utf8_lossy(encoding.as_bytes())
        ));
        status.metadata_mut().insert(
            "grpc-accept-encoding",
            tonic::metadata::MetadataValue::from_static("identity"),
        );
        return Err(status);
    }
    let read = read_message(request.into_body(), bounds.bytes.hold());
    let message = match tokio::time::timeout(bounds.timeout, read).await {
        Ok(message) => message?,
        Err(_) => {
            return Err(Status::deadline_exceeded(format!(
                "the request's body did not arrive whole within {:?} (--body-timeout)",
                bounds.timeout
            )));
        }
    };
    // As tonic's protobuf codec maps a decoding error.
    let request = RateLimitRequest::decode(message).map_err(|e| Status::internal(e.to_string()))?;
    Ok(reply(&decide(limiter, request).await?))
}

/// The request's one message, without its prefix. Reads until the message is whole (a client
/// that keeps the stream open after it is not waited for) or the body ends. A message spread
/// over frames is copied together, charged to `hold`.
async fn read_message<B>(body: B, mut hold: Hold<'_>) -> Result<Bytes, Status>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut joined = BytesMut::new();
    let exhausted = |e: Exhausted| Status::resource_exhausted(e.to_string());
    while let Some(frame) = body.frame().await {
        // As tonic maps a body's error (a reset stream's reason becomes its status).
        let frame = frame.map_err(|e| Status::from_error(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: tonic adds them to the metadata, which the service never reads
        };
        if joined.is_empty() {
            // Nearly always the whole message arrives in one frame: it is used where it lies.
            if let Some(length) = whole_message(&data)? {
                return Ok(data.slice(PREFIX..PREFIX + length));
            }
            if data.is_empty() {
                continue;
            }
            // A message spread over frames is copied out at once: kept, a frame would pin
            // the connection's whole read buffer behind it while the rest arrives. Its declared
            // size is charged, and its buffer made, up front, so a slow sender holds no more
            // than it said and nothing regrows.
            let declared = declared_length(&data).map_or(0, |length| PREFIX + length);
            let size = declared.max(data.len());
            hold.grow(size).map_err(exhausted)?;
            joined = BytesMut::with_capacity(size);
            joined.extend_from_slice(&data);
            continue;
        }
        let past = (joined.len() + data.len()).saturating_sub(joined.capacity());
        if past > 0 {
            hold.grow(past).map_err(exhausted)?;
        }
        joined.extend_from_slice(&data);
        if let Some(length) = whole_message(&joined)? {
            return Ok(joined.freeze().slice(PREFIX..PREFIX + length));
        }
    }
    Err(if joined.is_empty() {
        Status::internal("Missing request message.")
    } else {
        Status::internal("Unexpected EOF decoding stream.")
    })
}

/// The length the message `seen` starts with declares, when its prefix is there and the
/// length within [`MAX_REQUEST_BYTES`] (a longer one is refused by [`whole_message`]).
fn declared_length(seen: &[u8]) -> Option<usize> {
    let &[_, a, b, c, d] = seen.get(..PREFIX)? else {
        return None;
    };
    let length = usize::try_from(u32::from_be_bytes([a, b, c, d])).ok()?;
    (length <= MAX_REQUEST_BYTES).then_some(length)
}

/// The length of the message `seen` starts with, once all of it is there.
fn whole_message(seen: &[u8]) -> Result<Option<usize>, Status> {
    let Some(&[flag, a, b, c, d]) = seen.get(..PREFIX) else {
        return Ok(None);
    };
    match flag {
        0 => {}
        // https://grpc.github.io/grpc/core/md_doc_compression.html: INTERNAL.
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        f => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
            )));
        }
    }
    let length = usize::try_from(u32::from_be_bytes([a, b, c, d])).unwrap_or(usize::MAX);
    if length > MAX_REQUEST_BYTES {
        return Err(Status::out_of_range(format!(
            "Error, decoded message length too large: found {length} bytes, the limit is: {MAX_REQUEST_BYTES} bytes"
        )));
    }
    Ok((seen.len() - PREFIX >= length).then_some(length))
}

/// The response: headers, the message, and `grpc-status: 0` in the trailers.
fn reply(message: &RateLimitResponse) -> Response<GrpcBody> {
    let length = message.encoded_len();
    let Ok(prefix_length) = u32::try_from(length) else {
        return Status::internal("response too large")
            .into_http()
            .map(GrpcBody::Other);
    };
    let mut framed = BytesMut::with_capacity(PREFIX + length);
    framed.put_u8(0);
    framed.put_u32(prefix_length);
    // Into a growable buffer: encoding cannot run out of room.
    message.encode_raw(&mut framed);
    let mut response = Response::new(GrpcBody::Unary(UnaryBody {
        message: Some(framed.freeze()),
        trailers: true,
    }));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    response
}

/// One message, then the OK trailers.
pub struct UnaryBody {
    message: Option<Bytes>,
    trailers: bool,
}

impl http_body::Body for UnaryBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        if std::mem::take(&mut self.trailers) {
            let mut trailers = HeaderMap::with_capacity(1);
            trailers.insert(GRPC_STATUS.clone(), HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }

    // No `size_hint`: with an exact one hyper adds `content-length`, a header gRPC does not use
    // (its messages carry their own length) and every response would encode.
}

#[cfg(test)]
mod tests {
    use http_body::Body as _;

    use super::*;

    #[test]
    fn grpc_timeout_reads_every_unit_and_ignores_what_is_malformed() {
        let read = |v: &'static str| grpc_timeout(&HeaderValue::from_static(v));
        assert_eq!(read("20m"), Some(Duration::from_millis(20)));
        assert_eq!(read("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(read("2M"), Some(Duration::from_secs(120)));
        assert_eq!(read("3S"), Some(Duration::from_secs(3)));
        assert_eq!(read("250u"), Some(Duration::from_micros(250)));
        assert_eq!(read("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for malformed in ["", "m", "20", "20x", "-5m", "123456789m", "1.5S", " 5m"] {
            assert_eq!(read(malformed), None, "{malformed:?}");
        }
    }

    /// A body that never sends anything: the decision waits until the caller's deadline.
    struct Silent;

    impl http_body::Body for Silent {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    fn limiter() -> Limiter {
        Limiter::new(
            crate::config::compile_sources(&[]).expect("no config"),
            std::sync::Arc::new(crate::store::MemoryStore::new()),
            std::sync::Arc::new(crate::limiter::ManualClock::new(1_767_225_600_000)),
            crate::limiter::LimiterOptions::default(),
        )
    }

    fn silent_call(timeout: Option<&'static str>) -> Request<Silent> {
        let mut request = Request::new(Silent);
        if let Some(timeout) = timeout {
            request
                .headers_mut()
                .insert("grpc-timeout", HeaderValue::from_static(timeout));
        }
        request
    }

    /// tonic's server ended a call at the caller's `grpc-timeout` with `CANCELLED`; serving
    /// connections with hyper directly must keep that.
    #[tokio::test(start_paused = true)]
    async fn a_call_ends_cancelled_at_its_grpc_timeout() {
        let limiter = limiter();
        let started = tokio::time::Instant::now();
        let response =
            should_rate_limit(&limiter, &BodyBounds::default(), silent_call(Some("20m"))).await;
        assert_eq!(started.elapsed(), Duration::from_millis(20));
        let (head, body) = response.into_parts();
        assert_eq!(head.status, tonic::codegen::http::StatusCode::OK);
        // Trailers-only: the status is in the headers and the body is empty.
        assert_eq!(
            head.headers.get("grpc-status").map(HeaderValue::as_bytes),
            Some(&b"1"[..])
        );
        assert_eq!(
            head.headers.get("grpc-message").map(HeaderValue::as_bytes),
            Some(&b"Timeout%20expired"[..]), // percent-encoded, as gRPC sends a message
        );
        assert!(body.is_end_stream());
    }

    /// Without the header, a body that does not come ends the call at the body timeout
    /// (`--body-timeout`), `DEADLINE_EXCEEDED`, and not before.
    #[tokio::test(start_paused = true)]
    async fn a_call_without_grpc_timeout_ends_at_the_body_timeout() {
        let limiter = limiter();
        let bounds = BodyBounds::default();
        let started = tokio::time::Instant::now();
        let response = should_rate_limit(&limiter, &bounds, silent_call(None)).await;
        assert_eq!(started.elapsed(), bounds.timeout);
        assert_eq!(
            response
                .headers()
                .get("grpc-status")
                .map(HeaderValue::as_bytes),
            Some(&b"4"[..])
        );
    }
}
