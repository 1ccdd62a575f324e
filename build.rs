//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so building slidegate needs no
//! `protoc` on the machine. The encoded descriptor set is kept for gRPC server reflection, and
//! pbjson generates the proto3 JSON mapping (`POST /json`) from the same descriptors, so the JSON
//! and the gRPC forms of a message cannot drift apart.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The parts of the Redis function library, in the order they are joined (`lua/contract.lua`
/// says what each holds and why the order).
const LUA_PARTS: [&str; 15] = [
    "contract",
    "arguments",
    "sorted_log",
    "compact_layout",
    "compact_log",
    "compact_in_place",
    "convert",
    "counter",
    "request",
    "decide",
    "paths",
    "call",
    "undo_inspect_reset",
    "quota",
    "register",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    commit();
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    join_library(&out)?;
    // Reflection describes what slidegate serves: the two rate-limit services and their types.
    let served = protox::compile(
        [
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/service/rate_limit_quota/v3/rlqs.proto",
        ],
        ["proto"],
    )?;
    std::fs::write(
        out.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&served),
    )?;
    // Code for everything: also the xDS client's stream (ADS) and the config resource it carries.
    let files = protox::compile(
        [
            "envoy/service/ratelimit/v3/rls.proto",
            "envoy/service/rate_limit_quota/v3/rlqs.proto",
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

/// Joins `lua/`'s parts into the one library text Redis loads (`OUT_DIR/slidegate.lua`): each
/// part as it is, after a line naming it, so that a line number in a Lua error leads to its
/// part. The library's version is the SHA-1 of this joined text (`store::redis::Library`).
fn join_library(out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut library = String::new();
    for part in LUA_PARTS {
        let path = format!("lua/{part}.lua");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        if !library.is_empty() {
            library.push_str(&format!("-- lua/{part}.lua\n"));
        }
        library.push_str(&text);
        if !text.ends_with('\n') {
            library.push('\n');
        }
    }
    std::fs::write(out.join("slidegate.lua"), library)?;
    println!("cargo:rerun-if-changed=lua");
    Ok(())
}

/// The commit slidegate is built from, for `--version` and `slidegate_build_info`:
/// `SLIDEGATE_COMMIT` where the build sets it (the container build, which has no `.git`), else
/// what git says, else `unknown`.
fn commit() {
    println!("cargo:rerun-if-env-changed=SLIDEGATE_COMMIT");
    let git = |args: &[&str]| {
        let out = Command::new("git").args(args).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
    };
    let commit = std::env::var("SLIDEGATE_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SLIDEGATE_COMMIT={commit}");
    // Built again when the commit moves: HEAD, and the branch it names (only files that exist,
    // as cargo reruns every time for one that does not).
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = Path::new(&dir);
        let head = dir.join("HEAD");
        let branch = std::fs::read_to_string(&head)
            .ok()
            .and_then(|h| h.strip_prefix("ref: ").map(|r| dir.join(r.trim())));
        for path in [Some(head), branch, Some(dir.join("packed-refs"))]
            .into_iter()
            .flatten()
            .filter(|p| p.exists())
        {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
