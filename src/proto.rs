//! Generated protobuf types, gRPC stubs and proto3 JSON mapping (pbjson) for `proto/`, and the
//! descriptor set that server reflection serves.

/// Includes one generated package: its prost types and its serde (proto3 JSON) impls.
macro_rules! package {
    ($name:literal) => {
        include!(concat!(env!("OUT_DIR"), "/", $name, ".rs"));
        include!(concat!(env!("OUT_DIR"), "/", $name, ".serde.rs"));
    };
}

#[allow(clippy::all, clippy::pedantic, missing_docs)] // generated code
pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                package!("envoy.config.core.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    package!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            package!("envoy.r#type.v3");
        }
    }
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                package!("envoy.service.ratelimit.v3");
            }
        }
        pub mod discovery {
            pub mod v3 {
                package!("envoy.service.discovery.v3");
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                package!("envoy.service.rate_limit_quota.v3");
            }
        }
    }
}

#[allow(clippy::all, clippy::pedantic, missing_docs)] // generated code
pub mod google {
    pub mod rpc {
        package!("google.rpc");
    }
}

/// The config resource of the xDS config source (`CONFIG_TYPE=GRPC_XDS_SOTW`).
#[allow(clippy::all, clippy::pedantic, missing_docs)] // generated code
pub mod ratelimit {
    pub mod config {
        pub mod ratelimit {
            pub mod v3 {
                package!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

/// The encoded `FileDescriptorSet` of `proto/`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rls_descriptor");

pub use envoy::config::core::v3::HeaderValue;
pub use envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor};
pub use envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse, rate_limit_response, rate_limit_service_client,
    rate_limit_service_server,
};
