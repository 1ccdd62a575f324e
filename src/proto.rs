//! Generated protobuf types and gRPC stubs for `proto/`, and the descriptor set that server
//! reflection serves.

#[allow(clippy::all, missing_docs)] // generated code
mod generated {
    include!(concat!(env!("OUT_DIR"), "/rls_includes.rs"));
}

pub use generated::envoy;

/// The encoded `FileDescriptorSet` of `proto/`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rls_descriptor");

pub use generated::envoy::config::core::v3::HeaderValue;
pub use generated::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor,
};
pub use generated::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse, rate_limit_response, rate_limit_service_client,
    rate_limit_service_server,
};
