//! `ShouldRateLimit` answered straight from the HTTP/2 stream: the one unary call Envoy makes,
//! read and written here rather than through tonic's generic unary machinery (its streaming
//! decoder, its encoding body and the layers of body adapters around both), which cost about a
//! tenth of a decision's instructions (`cargo bench --bench server_cost`). What it answers is
//! what tonic's generated server answers for the same bytes, errors included (a test compares
//! the two): the message with `grpc-status: 0` in the trailers, or a trailers-only response
//! with the status. Compression is not offered, as before: a compressed request is refused the
//! way tonic refuses it.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Frame, SizeHint};
use http_body_util::BodyExt as _;
use prost::Message as _;
use prost::bytes::{BufMut as _, Bytes, BytesMut};
use tonic::Status;
use tonic::codegen::http::header::CONTENT_TYPE;
use tonic::codegen::http::{HeaderMap, HeaderValue};

use super::{GrpcRequest, GrpcResponse, decide};
use crate::limiter::Limiter;
use crate::proto::{RateLimitRequest, RateLimitResponse};

/// The largest request message taken: tonic's default, which applied before.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// A gRPC message's prefix: the compressed flag and the length (big-endian `u32`).
const PREFIX: usize = 5;

/// Answers one `ShouldRateLimit` call.
pub async fn should_rate_limit(limiter: &Limiter, request: GrpcRequest) -> GrpcResponse {
    match answer(limiter, request).await {
        Ok(response) => response,
        Err(status) => status.into_http(),
    }
}

async fn answer(limiter: &Limiter, request: GrpcRequest) -> Result<GrpcResponse, Status> {
    if let Some(encoding) = request.headers().get("grpc-encoding")
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
    let message = read_message(request.into_body()).await?;
    // As tonic's protobuf codec maps a decoding error.
    let request = RateLimitRequest::decode(message).map_err(|e| Status::internal(e.to_string()))?;
    Ok(reply(&decide(limiter, request).await?))
}

/// The request's one message, without its prefix. Reads until the message is whole (a client
/// that keeps the stream open after it is not waited for) or the body ends.
async fn read_message(mut body: tonic::body::Body) -> Result<Bytes, Status> {
    // Nearly always the whole message arrives in one frame: it is used as it came, and only a
    // message spread over frames is copied together.
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers: tonic adds them to the metadata, which the service never reads
        };
        if first.is_none() && joined.is_empty() {
            first = Some(data);
        } else {
            if let Some(earlier) = first.take() {
                joined.extend_from_slice(&earlier);
            }
            joined.extend_from_slice(&data);
        }
        let seen = first.as_deref().unwrap_or(&joined);
        if let Some(length) = whole_message(seen)? {
            let message = match first.take() {
                Some(bytes) => bytes.slice(PREFIX..PREFIX + length),
                None => joined.freeze().slice(PREFIX..PREFIX + length),
            };
            return Ok(message);
        }
    }
    let seen = first.as_deref().unwrap_or(&joined);
    Err(if seen.is_empty() {
        Status::internal("Missing request message.")
    } else {
        Status::internal("Unexpected EOF decoding stream.")
    })
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
fn reply(message: &RateLimitResponse) -> GrpcResponse {
    let length = message.encoded_len();
    let Ok(prefix_length) = u32::try_from(length) else {
        return Status::internal("response too large").into_http();
    };
    let mut framed = BytesMut::with_capacity(PREFIX + length);
    framed.put_u8(0);
    framed.put_u32(prefix_length);
    // Into a growable buffer: encoding cannot run out of room.
    message.encode_raw(&mut framed);
    let mut response = GrpcResponse::new(tonic::body::Body::new(UnaryBody {
        message: Some(framed.freeze()),
        trailers: true,
    }));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    response
}

/// One message, then the OK trailers.
struct UnaryBody {
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
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }

    fn size_hint(&self) -> SizeHint {
        let length = self.message.as_ref().map_or(0, Bytes::len);
        SizeHint::with_exact(u64::try_from(length).unwrap_or(u64::MAX))
    }
}
