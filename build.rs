//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so building slidegate needs no
//! `protoc` on the machine. The encoded descriptor set is kept for gRPC server reflection, and
//! pbjson generates the proto3 JSON mapping (`POST /json`) from the same descriptors, so the JSON
//! and the gRPC forms of a message cannot drift apart.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Reflection describes what slidegate serves: the rate-limit service and its types only.
    let served = protox::compile(["envoy/service/ratelimit/v3/rls.proto"], ["proto"])?;
    std::fs::write(
        out.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&served),
    )?;
    // Code for everything: also the xDS client's stream (ADS) and the config resource it carries.
    let files = protox::compile(
        [
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/service/discovery/v3/ads.proto",
            "ratelimit/config/ratelimit/v3/rls_conf.proto",
        ],
        ["proto"],
    )?;
    let encoded = prost::Message::encode_to_vec(&files);
    tonic_prost_build::configure()
        .build_client(true)
        // Well-known types with their proto3 JSON mapping (Duration as "1.5s", wrappers as
        // numbers or strings).
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(files)?;
    pbjson_build::Builder::new()
        .register_descriptors(&encoded)?
        .build(&[".envoy", ".google.rpc", ".ratelimit"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
