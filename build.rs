//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so building slidegate needs no
//! `protoc` on the machine. The encoded descriptor set is kept for gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let files = protox::compile(["envoy/service/ratelimit/v3/rls.proto"], ["proto"])?;
    std::fs::write(
        out.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&files),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .include_file("rls_includes.rs")
        .compile_fds(files)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
