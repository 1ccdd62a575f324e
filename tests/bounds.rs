//! What one client can hold of the server: streams per HTTP/2 connection, request bytes per
//! connection and in total, and the time a request's body may take, on the binary as it runs,
//! with its memory read from `/proc` while a hostile peer does its worst and another client
//! is served.
// Tests and benchmarks may panic on a broken set-up, read the wall clock and run long.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::redis::{command, wait_until};
use common::*;

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.yaml");

/// The server's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

fn start(extra: &[&str]) -> (u16, u16, KillOnDrop) {
    let (grpc, http, child) = spawn_slidegate(Path::new(EXAMPLE), extra);
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    (grpc, http, child)
}

/// One HTTP/2 frame: length, type, flags, stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).unwrap();
    let mut out = length.to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

const HEADERS: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// The request headers of a `ShouldRateLimit` call, HPACK-encoded without the dynamic table:
/// `:method POST` and `:scheme http` by their static indexes, `:path` and `content-type` as
/// literals with an indexed name.
fn call_headers() -> Vec<u8> {
    let path = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let mut block = vec![0x83, 0x86, 0x04, u8::try_from(path.len()).unwrap()];
    block.extend(path);
    block.extend([0x0f, 0x10, 16]);
    block.extend(b"application/grpc");
    block
}

/// A raw HTTP/2 connection that does not follow the server's settings: it opens streams past
/// the server's cap and sends what it likes. What the server writes back is read and dropped
/// by a thread of its own, so the server is never held up writing to it.
struct HostilePeer {
    socket: TcpStream,
    _reader: std::thread::JoinHandle<()>,
}

impl HostilePeer {
    fn open(port: u16) -> HostilePeer {
        let mut socket = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        socket
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .unwrap();
        // Its own settings: none changed; and a large connection window for what it sends.
        socket.write_all(&frame(0x4, 0, 0, &[])).unwrap();
        let mut reader = socket.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut sink = vec![0u8; 1 << 16];
            while reader.read(&mut sink).is_ok_and(|n| n > 0) {}
        });
        HostilePeer {
            socket,
            _reader: reader,
        }
    }

    /// Opens `count` streams from `first` (odd ids), headers only, in large writes: how many
    /// were written before the server closed the connection, if it did.
    fn open_streams(&mut self, first: u32, count: u32) -> u32 {
        let headers = call_headers();
        let mut batch = Vec::with_capacity(1 << 20);
        let mut written = 0;
        for n in 0..count {
            batch.extend(frame(HEADERS, END_HEADERS, first + 2 * n, &headers));
            if batch.len() > (1 << 20) - 200 || n + 1 == count {
                if self.socket.write_all(&batch).is_err() {
                    return written;
                }
                written = n + 1;
                batch.clear();
            }
        }
        written
    }
}

/// A call on a fresh connection of a well-behaved client answers OK.
async fn served(grpc: u16) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], grpc));
    let mut client = connect(addr).await;
    let call = client.should_rate_limit(request(
        "example",
        vec![descriptor(&[("to_number", "bounds")])],
    ));
    matches!(
        tokio::time::timeout(Duration::from_secs(5), call).await,
        Ok(Ok(answer)) if answer.get_ref().overall_code == 1
    )
}

/// The most memory the tests let the hostile peers take from the server, above what it held
/// before: the default bounds allow far less (docs/operations.md, *Bounds per client*).
const GROWTH_AT_MOST: u64 = 64 << 20;

/// One connection opening 200,000 streams (headers only, never a body): past the cap of 100 the
/// server refuses them (and closes a connection that keeps making it refuse), its memory stays
/// within [`GROWTH_AT_MOST`] of where it was, and a well-behaved client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_opening_200000_streams_holds_a_bounded_share() {
    let (grpc, _http, child) = start(&[]);
    assert!(served(grpc).await);
    let before = rss(child.0.id());
    let mut peer = HostilePeer::open(grpc);
    let flood = std::thread::spawn(move || {
        let written = peer.open_streams(1, 200_000);
        (peer, written)
    });
    let mut peak = before;
    let mut served_during = false;
    while !flood.is_finished() {
        peak = peak.max(rss(child.0.id()));
        served_during |= served(grpc).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_peer, written) = flood.join().expect("the flood ran");
    peak = peak.max(rss(child.0.id()));
    eprintln!(
        "{written} streams written before the server closed the connection; grew by {} KiB",
        (peak - before) >> 10
    );
    assert!(
        peak - before <= GROWTH_AT_MOST,
        "grew by {} MiB (from {} MiB)",
        (peak - before) >> 20,
        before >> 20
    );
    assert!(
        served_during || served(grpc).await,
        "another client was not served"
    );
    assert!(
        served(grpc).await,
        "another client is served after the flood"
    );
}

/// 60 calls on one connection (a client that keeps to HTTP/2's flow control), each sending a
/// message just under the 4 MiB cap and then holding its last byte back, twice over: the
/// connection's bodies hold at most `--max-buffered-per-connection` (8 MiB), so past two the
/// calls are refused `RESOURCE_EXHAUSTED` as their data arrives and the rest end at
/// `--body-timeout`; the server's memory stays within [`GROWTH_AT_MOST`], the second
/// flood reuses what the first left (it does not add up), and a well-behaved client is served
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_on_one_connection_hold_a_bounded_share() {
    let (grpc, _http, child) = start(&["--body-timeout", "3s"]);
    let before = rss(child.0.id());
    let mut peaks = Vec::new();
    for _ in 0..2 {
        let (statuses, peak, served_during) = large_message_flood(grpc, child.0.id()).await;
        let grown = peak.saturating_sub(before);
        eprintln!("statuses {statuses:?}; grew by {} KiB", grown >> 10);
        // Refused past the bound, or (a stream whose data had not come yet while the client
        // sent the others') ended at the body timeout: never read whole, never left open.
        let exhausted = statuses.get("Ok(Some(\"8\"))").copied().unwrap_or(0);
        let timed_out = statuses.get("Ok(Some(\"4\"))").copied().unwrap_or(0);
        assert!(
            exhausted >= 1 && exhausted + timed_out == 60,
            "{statuses:?}"
        );
        assert!(served_during, "another client was not served meanwhile");
        peaks.push(grown);
    }
    assert!(
        peaks.iter().all(|&p| p <= GROWTH_AT_MOST),
        "grew by {:?} MiB (from {} MiB)",
        peaks.iter().map(|p| p >> 20).collect::<Vec<_>>(),
        before >> 20
    );
    assert!(
        peaks[1] <= peaks[0] + (16 << 20),
        "the second flood added up: {:?} MiB",
        peaks.iter().map(|p| p >> 20).collect::<Vec<_>>()
    );
}

/// One flood of [`large_messages_on_one_connection_hold_a_bounded_share`]: the calls' statuses,
/// the server's peak memory, and whether another client was served meanwhile.
async fn large_message_flood(
    grpc: u16,
    pid: u32,
) -> (std::collections::BTreeMap<String, usize>, u64, bool) {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", grpc))
        .await
        .expect("connect");
    let (send, connection) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(64 << 20)
            .handshake::<_, HeldBody>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(connection);
    let size: u32 = (4 << 20) - 64;
    let mut message = vec![0u8];
    message.extend(size.to_be_bytes());
    message.resize(5 + size as usize - 1, b'x');
    let message = prost::bytes::Bytes::from(message);
    let mut keep_open = Vec::new();
    let mut calls = Vec::new();
    for _ in 0..60 {
        let (more, body) = tokio::sync::mpsc::channel(1);
        more.send(Ok(http_body::Frame::data(message.clone())))
            .await
            .unwrap();
        keep_open.push(more);
        let body = http_body_util::StreamBody::new(tokio_stream_of(body));
        let call = hyper::Request::post(format!(
            "http://127.0.0.1:{grpc}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
        let mut send = send.clone();
        calls.push(tokio::spawn(async move {
            let answer = send.send_request(call).await.map_err(|e| e.to_string())?;
            let status = answer
                .headers()
                .get("grpc-status")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            Ok::<_, String>(status)
        }));
    }
    let started = Instant::now();
    let mut peak = rss(pid);
    let mut served_during = false;
    while !calls.iter().all(tokio::task::JoinHandle::is_finished) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "calls still open after 20 s"
        );
        peak = peak.max(rss(pid));
        served_during |= served(grpc).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    peak = peak.max(rss(pid));
    let mut statuses = std::collections::BTreeMap::new();
    for call in calls {
        let status = call.await.unwrap();
        *statuses.entry(format!("{status:?}")).or_insert(0) += 1;
    }
    (statuses, peak, served_during)
}

type HeldBody = http_body_util::StreamBody<
    futures_util::stream::BoxStream<
        'static,
        Result<http_body::Frame<prost::bytes::Bytes>, std::io::Error>,
    >,
>;

/// The frames a channel sends, as a body's stream; it ends when the sender is dropped.
fn tokio_stream_of(
    mut frames: tokio::sync::mpsc::Receiver<
        Result<http_body::Frame<prost::bytes::Bytes>, std::io::Error>,
    >,
) -> futures_util::stream::BoxStream<
    'static,
    Result<http_body::Frame<prost::bytes::Bytes>, std::io::Error>,
> {
    use futures_util::StreamExt as _;
    futures_util::stream::poll_fn(move |cx| frames.poll_recv(cx)).boxed()
}

/// A `POST /json` body sent a byte at a time is answered 408 and its connection closed at
/// `--body-timeout`, not held for as long as the bytes keep coming.
#[test]
fn a_slow_json_body_is_closed_at_the_body_timeout() {
    let (_grpc, http, _child) = start(&["--body-timeout", "1s"]);
    let mut socket = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    socket
        .write_all(b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
        .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "still open after 8 s: {}",
            String::from_utf8_lossy(&answer)
        );
        // One byte every 200 ms keeps the connection from ever being idle.
        if socket.write_all(b" ").is_err() {
            break;
        }
        match socket.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--body-timeout"), "{answer}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "closed after {waited:?}"
    );
}

/// A `POST /json` body past 2 MiB is refused 413 before it is read whole.
#[test]
fn a_json_body_past_its_cap_is_refused() {
    let (_grpc, http, _child) = start(&[]);
    let mut socket = TcpStream::connect(("127.0.0.1", http)).expect("connect");
    let size = 3 << 20;
    let head = format!(
        "POST /json HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
    );
    socket.write_all(head.as_bytes()).unwrap();
    // The server may answer and close before the whole body is written.
    let _ = socket.write_all(&vec![b' '; size]);
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = socket.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("passes 2097152 bytes"), "{answer}");
}

/// Reads one HTTP/2 frame: (type, flags, stream, payload).
fn read_frame(socket: &mut TcpStream) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    socket.read_exact(&mut head)?;
    let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; length];
    socket.read_exact(&mut payload)?;
    Ok((head[3], head[4], stream, payload))
}

/// `GRPC_MAX_CONNECTION_AGE=2s` (the reference's variable): a connection receives GOAWAY about
/// 2 s after it opened (10% either way), and a call in flight on it then still completes.
#[test]
fn an_old_connection_is_asked_to_go_and_its_calls_complete() {
    let (grpc, http) = (common::redis::free_port(), common::redis::free_port());
    let _child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_slidegate"))
            .args(["--config", EXAMPLE])
            .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
            .args(["--http-addr", &format!("127.0.0.1:{http}")])
            .env("GRPC_MAX_CONNECTION_AGE", "2s")
            .env("GRPC_MAX_CONNECTION_AGE_GRACE", "20s")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start slidegate"),
    );
    wait_until("ready", Duration::from_secs(20), || {
        command(http, "GET /readyz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200 OK"))
    });
    let mut socket = TcpStream::connect(("127.0.0.1", grpc)).expect("connect");
    let opened = Instant::now();
    socket
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    socket.write_all(&frame(0x4, 0, 0, &[])).unwrap();
    // A call in flight: its headers now, its message only after the GOAWAY.
    socket
        .write_all(&frame(HEADERS, END_HEADERS, 1, &call_headers()))
        .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let goaway_after = loop {
        let (kind, flags, _, _) = read_frame(&mut socket).expect("a frame before GOAWAY");
        match kind {
            0x4 if flags & 0x1 == 0 => socket.write_all(&frame(0x4, 0x1, 0, &[])).unwrap(),
            0x6 if flags & 0x1 == 0 => {} // a ping: the server's keep-alive, unanswered here
            0x7 => break opened.elapsed(),
            _ => {}
        }
    };
    assert!(
        goaway_after >= Duration::from_millis(1_700) && goaway_after < Duration::from_secs(4),
        "GOAWAY after {goaway_after:?}"
    );
    use prost::Message as _;
    let message = request("example", vec![descriptor(&[("to_number", "aged")])]).encode_to_vec();
    let mut body = vec![0u8];
    body.extend(u32::try_from(message.len()).unwrap().to_be_bytes());
    body.extend(message);
    socket.write_all(&frame(0x0, 0x1, 1, &body)).unwrap();
    let answered = loop {
        match read_frame(&mut socket) {
            Ok((0x0, _, 1, payload)) if payload.len() > 5 => break true,
            Ok(_) => {}
            Err(_) => break false,
        }
    };
    assert!(
        answered,
        "the call in flight got no answer after the GOAWAY"
    );
}
