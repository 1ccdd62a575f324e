//! Accepting connections on both ports: a cap on how many are open at once, TCP_NODELAY, and an
//! idle timeout that closes a connection nothing has been read from for a while (half a request,
//! only an HTTP/2 preface, a peer gone silent). Healthy idle connections are kept: the servers
//! send HTTP/2 keep-alive pings well inside the idle timeout, and answering one counts as a read.
//! The HTTP port's accept loop also bounds the time to send a request's headers.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// What one port accepts, and what one connection may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once; past it, new ones wait in the kernel's backlog.
    pub max_connections: usize,
    /// A connection nothing has been read from for this long is closed.
    pub idle_timeout: Duration,
    /// Streams open at once on one HTTP/2 connection (`SETTINGS_MAX_CONCURRENT_STREAMS`); a
    /// client that opens more has them refused, and Envoy opens another connection instead.
    pub max_streams: u32,
    /// How long a request's body may take to arrive whole, from its headers.
    pub body_timeout: Duration,
    /// Request bytes held at once for one connection's bodies that are still arriving.
    pub max_buffered_per_connection: usize,
    /// The same over the whole server (every connection of every port).
    pub max_buffered: usize,
    /// A gRPC connection this old is asked to finish (`GOAWAY`), so that clients reconnect and
    /// spread over replicas added since; `None`: kept for as long as the client likes.
    pub max_connection_age: Option<Duration>,
    /// How long such a connection may still serve its open calls before it is closed.
    pub max_connection_age_grace: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 10_000,
            idle_timeout: Duration::from_secs(25),
            max_streams: 100,
            body_timeout: Duration::from_secs(10),
            max_buffered_per_connection: 8 << 20,
            max_buffered: 64 << 20,
            max_connection_age: None,
            max_connection_age_grace: Duration::from_secs(3600),
        }
    }
}

impl ConnectionLimits {
    /// How often an HTTP/2 connection is pinged, and how long the answer may take: a third of
    /// the idle timeout each, so a live peer always answers before it would count as idle.
    pub fn keep_alive(&self) -> Duration {
        (self.idle_timeout / 3).max(Duration::from_millis(100))
    }

    /// How long a client may take to send a request's headers.
    pub fn header_timeout(&self) -> Duration {
        self.idle_timeout
    }
}

/// A listener that hands out [`GuardedStream`]s.
pub struct GuardedListener {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
}

impl GuardedListener {
    pub fn new(listener: TcpListener, limits: ConnectionLimits) -> GuardedListener {
        GuardedListener {
            listener,
            permits: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits,
        }
    }

    /// The next connection, once fewer than the cap are open.
    pub async fn next(&mut self) -> (GuardedStream, SocketAddr) {
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            // The semaphore is never closed; if it were, accept nothing more.
            return std::future::pending().await;
        };
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (
                        GuardedStream::new(stream, permit, self.limits.idle_timeout),
                        addr,
                    );
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait a moment rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// The connections as a stream, for tonic.
    pub fn into_stream(self) -> impl futures_util::Stream<Item = io::Result<GuardedStream>> {
        futures_util::stream::unfold(self, |mut listener| async move {
            let (stream, _) = listener.next().await;
            Some((Ok(stream), listener))
        })
    }
}

impl axum::serve::Listener for GuardedListener {
    type Io = GuardedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.next().await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// A connection that holds one of the listener's permits and closes itself when idle.
pub struct GuardedStream {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
    idle: Duration,
    /// When data was last read. Reads only note the time; the timer is moved when it fires
    /// early, at most once per idle period, rather than on every read of a busy connection.
    last_read: Instant,
    deadline: Pin<Box<Sleep>>,
}

impl GuardedStream {
    fn new(inner: TcpStream, permit: OwnedSemaphorePermit, idle: Duration) -> GuardedStream {
        GuardedStream {
            inner,
            _permit: permit,
            idle,
            last_read: Instant::now(),
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.last_read = Instant::now();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => loop {
                if self.deadline.as_mut().poll(cx).is_pending() {
                    break Poll::Pending;
                }
                let due = self.last_read + self.idle;
                if due <= Instant::now() {
                    break Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "connection idle too long",
                    )));
                }
                // Read from since the timer was set: wait out the rest from the last read
                // (polled again at once, so the moved timer registers this task).
                self.deadline.as_mut().reset(due);
            },
            other => other,
        }
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for GuardedStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Serves `router` on `listener` until `shutdown`, then lets open requests finish. HTTP/1
/// requests must send their headers within [`ConnectionLimits::header_timeout`]; HTTP/2
/// connections are pinged.
pub async fn serve_http(
    listener: GuardedListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()>,
) {
    let limits = listener.limits;
    let connections = futures_util::StreamExt::map(listener.into_stream(), |c| c);
    serve_http_on(
        Box::pin(connections),
        limits,
        move |_| router.clone(),
        shutdown,
    )
    .await;
}

/// [`serve_http`] on connections from elsewhere (a TLS acceptor), with a router made for each
/// (`router_for` sees the connection: who is at the other end).
pub async fn serve_http_on<IO>(
    mut connections: Pin<Box<dyn futures_util::Stream<Item = io::Result<IO>> + Send>>,
    limits: ConnectionLimits,
    router_for: impl Fn(&IO) -> axum::Router,
    shutdown: impl Future<Output = ()>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use futures_util::StreamExt as _;
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout());
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams)
        .keep_alive_interval(limits.keep_alive())
        .keep_alive_timeout(limits.keep_alive());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = connections.next() => match accepted {
                Some(Ok(stream)) => {
                    let service = TowerToHyperService::new(router_for(&stream));
                    let connection = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .into_owned();
                    let connection = graceful.watch(connection);
                    tokio::spawn(async move {
                        let _ = connection.await;
                    });
                }
                Some(Err(e)) => tracing::debug!("HTTP connection not accepted: {e}"),
                None => break,
            },
            () = &mut shutdown => break,
        }
    }
    graceful.shutdown().await;
}
