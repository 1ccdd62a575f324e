//! A fault proxy: a TCP proxy over loopback that a test puts between slidegate and Redis to
//! degrade the link while traffic runs. Switched at any moment from the test:
//!
//! * [`FaultProxy::delay`]: every byte is held this long before it is passed on, each way
//!   (what a slow network does: a call takes twice the delay more);
//! * [`FaultProxy::stall`]: bytes are taken from both ends and passed on to neither, until
//!   [`FaultProxy::heal`] passes on what was held, in order (a partition that TCP outlives:
//!   connections stay open, nothing answers, and after it what was sent arrives);
//! * [`FaultProxy::reset`]: every open connection is reset (`RST`), as a middlebox or a
//!   restarted peer does; the next connections go through as set.
//!
//! It runs on a runtime of its own, so the test's runtime (and the slidegate in it) cannot hold
//! it up, and it stops, closing every connection, when dropped.
//!
//! **Redis Cluster.** slidegate learns the masters' addresses from the cluster itself
//! (`CLUSTER SLOTS`), not from its URL, so a proxy in front of one master is found only if the
//! cluster names the proxy as that master's address. [`FaultProxy::before_master`] does that
//! with the master's own settings: `cluster-announce-port` set to the proxy's port (every node
//! then gives it as the master's address in `CLUSTER SLOTS` and redirections), and
//! `cluster-announce-bus-port` kept at the real bus port, so that the nodes' gossip does not
//! go through the proxy and the cluster stays whole while the link from slidegate is cut.
//! The other masters are reached directly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::redis::{RedisCluster, command, free_port, wait_until};

/// What the test has switched on.
struct Faults {
    /// Held before passing on, in µs: towards Redis, and back.
    up_us: AtomicU64,
    down_us: AtomicU64,
    stalled: watch::Sender<bool>,
    /// Bumped by each reset: every connection open then resets.
    resets: watch::Sender<u64>,
    /// Connections accepted so far.
    accepted: AtomicU64,
    /// Reads taken from the clients so far (each a write of theirs, or part of one).
    taken: AtomicU64,
    /// When the proxy started, and when it last took or passed on bytes (µs after it).
    started: Instant,
    last_bytes_us: AtomicU64,
}

impl Faults {
    fn bytes_moved(&self) {
        let us = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.last_bytes_us.store(us, Ordering::SeqCst);
    }
}

/// A running proxy: clients connect to `port`, and reach `upstream` through it.
pub struct FaultProxy {
    pub port: u16,
    pub upstream: u16,
    faults: Arc<Faults>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FaultProxy {
    /// A proxy on a free loopback port to the server on `upstream`.
    pub fn start(upstream: u16) -> FaultProxy {
        let port = free_port();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("the proxy's runtime");
        let faults = Arc::new(Faults {
            up_us: AtomicU64::new(0),
            down_us: AtomicU64::new(0),
            stalled: watch::channel(false).0,
            resets: watch::channel(0).0,
            accepted: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            started: Instant::now(),
            last_bytes_us: AtomicU64::new(0),
        });
        // Bound here, so that the port takes connections once this returns; served on the
        // proxy's runtime (this may run inside a test's, which must not be blocked on).
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("the proxy cannot listen on {port}: {e}"));
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let serving = faults.clone();
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).expect("the listener on the runtime");
            accept(listener, upstream, serving).await;
        });
        FaultProxy {
            port,
            upstream,
            faults,
            runtime: Some(runtime),
        }
    }

    /// A proxy in front of master `i` of `cluster`, which the cluster then names by the proxy's
    /// address (see the module's notes); waits until every node does.
    pub fn before_master(cluster: &RedisCluster, i: usize) -> FaultProxy {
        let master = cluster.nodes[i].port;
        let proxy = FaultProxy::start(master);
        for setting in [
            format!("CONFIG SET cluster-announce-bus-port {}", master + 10_000),
            format!("CONFIG SET cluster-announce-port {}", proxy.port),
        ] {
            let reply = command(master, &setting).unwrap_or_default();
            assert!(reply.starts_with("+OK"), "{setting}: {reply}");
        }
        let announced = format!(":{}\r\n", proxy.port);
        for node in &cluster.nodes {
            wait_until(
                &format!("node {} naming the proxy {}", node.port, proxy.port),
                Duration::from_secs(20),
                || {
                    let slots = command(node.port, "CLUSTER SLOTS").unwrap_or_default();
                    slots.contains(&announced) && !slots.contains(&format!(":{master}\r\n"))
                },
            );
        }
        proxy
    }

    /// `redis://` to the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Holds every byte `each_way` before passing it on, in both directions (zero: none).
    pub fn delay(&self, each_way: Duration) {
        let us = u64::try_from(each_way.as_micros()).unwrap_or(u64::MAX);
        self.faults.up_us.store(us, Ordering::SeqCst);
        self.faults.down_us.store(us, Ordering::SeqCst);
    }

    /// Takes bytes from both ends and passes on none, until [`FaultProxy::heal`].
    pub fn stall(&self) {
        self.faults.stalled.send_replace(true);
    }

    /// Passes on what the stall held, in order, and whatever comes after.
    pub fn heal(&self) {
        self.faults.stalled.send_replace(false);
    }

    /// Resets every connection open now.
    pub fn reset(&self) {
        self.faults.resets.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.faults.accepted.load(Ordering::SeqCst)
    }

    /// Reads taken from the clients so far: a command sent is at least one.
    pub fn taken(&self) -> u64 {
        self.faults.taken.load(Ordering::SeqCst)
    }

    /// Whether no byte has been taken or passed on for `quiet`: nothing is in flight through
    /// the proxy, nor was lately.
    pub fn quiet_for(&self, quiet: Duration) -> bool {
        let last = Duration::from_micros(self.faults.last_bytes_us.load(Ordering::SeqCst));
        self.faults.started.elapsed().saturating_sub(last) >= quiet
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Stops the runtime without waiting on it: a test's own runtime may be dropping it.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn accept(listener: TcpListener, upstream: u16, faults: Arc<Faults>) {
    while let Ok((client, _)) = listener.accept().await {
        faults.accepted.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(relay(client, upstream, faults.clone()));
    }
}

/// One connection, both ways, until either end closes it or a reset comes.
async fn relay(mut client: TcpStream, upstream: u16, faults: Arc<Faults>) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut resets = faults.resets.subscribe();
    resets.borrow_and_update();
    let reset = {
        let (from_client, to_client) = client.split();
        let (from_server, to_server) = server.split();
        let up = pump(
            from_client,
            to_server,
            &faults,
            &faults.up_us,
            Some(&faults.taken),
        );
        let down = pump(from_server, to_client, &faults, &faults.down_us, None);
        tokio::select! {
            _ = async { tokio::join!(up, down) } => false,
            _ = resets.changed() => true,
        }
    };
    if reset {
        reset_on_close(&client);
        reset_on_close(&server);
    }
}

/// Makes closing `stream` a reset, not an orderly end: no linger. (tokio deprecates setting a
/// linger because a lingering close blocks the thread; a zero linger does not wait.)
#[allow(deprecated)]
fn reset_on_close(stream: &TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
}

/// Passes what `from` sends on to `to`, each read held `delay` (µs, read when it arrives), and
/// nothing while stalled, counting its reads in `reads` where given; ends when `from` ends or
/// `to` fails.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    faults: &Faults,
    delay: &AtomicU64,
    reads: Option<&AtomicU64>,
) {
    let mut stalled = faults.stalled.subscribe();
    let (held, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buffer).await {
            if n == 0 {
                break;
            }
            faults.bytes_moved();
            if let Some(reads) = reads {
                reads.fetch_add(1, Ordering::SeqCst);
            }
            let at = Instant::now() + Duration::from_micros(delay.load(Ordering::SeqCst));
            if held.send((at, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if stalled.wait_for(|stalled| !*stalled).await.is_err()
                || to.write_all(&bytes).await.is_err()
            {
                return;
            }
            faults.bytes_moved();
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
