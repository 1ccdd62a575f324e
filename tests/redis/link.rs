//! The link between slidegate and Redis degraded by the fault proxy (`tests/common/proxy.rs`).

use super::*;
use common::proxy::FaultProxy;

/// The proxy does what it says: a round trip through it takes its delay twice; a stall holds a
/// command until it heals, then passes it on; a reset breaks the connection.
#[test]
fn the_fault_proxy_delays_stalls_and_resets() {
    use std::io::{Read as _, Write as _};
    let redis = shared_standalone();
    let proxy = FaultProxy::start(redis.port);
    let mut link = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).expect("connect");
    link.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let ping = |link: &mut std::net::TcpStream| {
        let started = Instant::now();
        link.write_all(b"PING\r\n")?;
        let mut reply = [0u8; 7];
        link.read_exact(&mut reply).map(|()| started.elapsed())
    };
    assert!(ping(&mut link).expect("a reply") < Duration::from_millis(500));
    proxy.delay(Duration::from_millis(40));
    let delayed = ping(&mut link).expect("a reply");
    assert!(delayed >= Duration::from_millis(80), "{delayed:?}");
    proxy.delay(Duration::ZERO);
    proxy.stall();
    link.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    assert!(ping(&mut link).is_err(), "answered through a stall");
    proxy.heal();
    link.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut held = [0u8; 7];
    link.read_exact(&mut held)
        .expect("the held reply after healing");
    assert_eq!(&held, b"+PONG\r\n");
    proxy.reset();
    let broken = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        ping(&mut link).is_err()
    });
    assert!(broken, "the connection survived a reset");
    let mut again = std::net::TcpStream::connect(("127.0.0.1", proxy.port)).expect("connect");
    again
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    assert!(ping(&mut again).is_ok(), "a new connection after a reset");
    assert_eq!(proxy.accepted(), 2);
}
