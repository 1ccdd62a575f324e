//! Kuadrant's limitador for a side by side run (`limitador-server`, built elsewhere: nothing of
//! it is in this repository), in its `redis` mode.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis_proc;

/// Starts `binary` with the limits file `limits` on the Redis at `redis_url`, once its gRPC
/// port accepts; the process and that port.
pub fn start(binary: &Path, limits: &Path, redis_url: &str) -> (Child, u16) {
    let (grpc, http) = (redis_proc::free_port(), redis_proc::free_port());
    let child = Command::new(binary)
        .args(["--rls-ip", "127.0.0.1", "--rls-port", &grpc.to_string()])
        .args(["--http-ip", "127.0.0.1", "--http-port", &http.to_string()])
        .arg(limits)
        .args(["redis", redis_url])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start limitador-server");
    redis_proc::wait_until("limitador ready", Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", grpc)).is_ok()
    });
    (child, grpc)
}
