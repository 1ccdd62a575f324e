//! TLS on the gRPC port (the reference's `GRPC_SERVER_USE_TLS`): a certificate and key, and
//! with a client CA, mutual TLS (a client without a certificate that CA signed is refused during
//! the handshake; optionally its certificate must also name a given SAN). The files are checked
//! for changes every few seconds and a changed set is loaded for new connections; connections
//! already open keep the keys they were made with, and a set that does not load is logged and
//! the previous one kept.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::server::net::{GuardedListener, GuardedStream};
use crate::tls::{TlsError, read_certs, read_key};

/// The gRPC port's TLS files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its PEM private key.
    pub key: PathBuf,
    /// PEM CAs that sign client certificates; set, a client certificate is required.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: the client certificate must be valid for this name (DNS or IP SAN).
    pub client_san: Option<String>,
}

/// The serving TLS configuration, replaced when its files change.
pub struct ServerTls {
    files: ServerTlsFiles,
    /// Offer HTTP/1.1 as well as HTTP/2 (the admin listener; gRPC is HTTP/2 alone).
    http1: bool,
    client_san: Option<ServerName<'static>>,
    config: ArcSwap<ServerConfig>,
    /// The bytes of the files the current configuration was built from.
    loaded_from: Mutex<Vec<u8>>,
}

impl ServerTls {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: ServerTlsFiles) -> Result<ServerTls, TlsError> {
        ServerTls::load_with(files, false)
    }

    /// [`ServerTls::load`] for an HTTP listener, whose clients may speak HTTP/1.1.
    pub fn load_for_http(files: ServerTlsFiles) -> Result<ServerTls, TlsError> {
        ServerTls::load_with(files, true)
    }

    fn load_with(files: ServerTlsFiles, http1: bool) -> Result<ServerTls, TlsError> {
        let client_san = match &files.client_san {
            Some(san) => Some(
                ServerName::try_from(san.clone())
                    .map_err(|e| TlsError::Other(format!("client SAN '{san}': {e}")))?,
            ),
            None => None,
        };
        let (config, bytes) = build(&files, http1)?;
        Ok(ServerTls {
            files,
            http1,
            client_san,
            config: ArcSwap::from_pointee(config),
            loaded_from: Mutex::new(bytes),
        })
    }

    /// Re-reads the files; if they changed and load, new connections use them. `Ok(true)` when
    /// a new configuration was swapped in.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let bytes = file_bytes(&self.files);
        let Ok(mut loaded_from) = self.loaded_from.lock() else {
            return Err(TlsError::Other("TLS reload state poisoned".into()));
        };
        if *loaded_from == bytes {
            return Ok(false);
        }
        let (config, bytes) = build(&self.files, self.http1)?;
        self.config.store(Arc::new(config));
        *loaded_from = bytes;
        Ok(true)
    }

    /// Checks the files every `every` until the returned task is aborted.
    pub fn spawn_reloader(self: Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match self.reload_if_changed() {
                    Ok(true) => {
                        tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded")
                    }
                    Ok(false) => {}
                    // Often a rotation caught half-way (certificate new, key old): the next
                    // check sees the whole set.
                    Err(e) => tracing::warn!(
                        "TLS files of {} changed but do not load, keeping the previous ones: {e}",
                        self.files.cert.display()
                    ),
                }
            }
        })
    }

    /// The TLS handshake on an accepted connection, and the SAN check.
    async fn accept(&self, stream: GuardedStream) -> io::Result<TlsStream<GuardedStream>> {
        let acceptor = TlsAcceptor::from(self.config.load_full());
        let tls = acceptor.accept(stream).await?;
        if let Some(san) = &self.client_san {
            let (_, connection) = tls.get_ref();
            let valid = connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|leaf| webpki::EndEntityCert::try_from(leaf).ok())
                .is_some_and(|leaf| leaf.verify_is_valid_for_subject_name(san).is_ok());
            if !valid {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "client certificate does not name the required SAN",
                ));
            }
        }
        Ok(tls)
    }
}

/// Reads all of the files (unreadable ones count as empty: a change either way).
fn file_bytes(files: &ServerTlsFiles) -> Vec<u8> {
    let mut bytes = Vec::new();
    for path in [
        Some(&files.cert),
        Some(&files.key),
        files.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        bytes.extend(std::fs::read(path).unwrap_or_default());
        // A separator, so moving bytes from one file to the next still counts as a change.
        bytes.push(0);
    }
    bytes
}

fn build(files: &ServerTlsFiles, http1: bool) -> Result<(ServerConfig, Vec<u8>), TlsError> {
    // Read the bytes first: if the files change while building, the next check sees it.
    let bytes = file_bytes(files);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let roots = crate::tls::client::root_store(Some(ca))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::file("cannot use the client CA", ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(read_certs(&files.cert)?, read_key(&files.key)?)
        .map_err(|e| TlsError::file("the certificate does not fit its key", &files.cert, e))?;
    // gRPC is HTTP/2; clients that insist on ALPN get it.
    config.alpn_protocols = vec![b"h2".to_vec()];
    if http1 {
        config.alpn_protocols.push(b"http/1.1".to_vec());
    }
    Ok((config, bytes))
}

/// The name the client's certificate gives (its first DNS name), on a connection with one.
pub fn peer_name(conn: &GrpcConn) -> Option<String> {
    let GrpcConn::Tls(tls) = conn else {
        return None;
    };
    let (_, connection) = tls.get_ref();
    let leaf = connection.peer_certificates()?.first()?;
    let cert = webpki::EndEntityCert::try_from(leaf).ok()?;
    let name = cert.valid_dns_names().next().map(str::to_string);
    Some(name.unwrap_or_else(|| "a client certificate without a DNS name".into()))
}

/// One gRPC connection, with or without TLS.
pub enum GrpcConn {
    Plain(GuardedStream),
    Tls(Box<TlsStream<GuardedStream>>),
}

/// The gRPC port's connections. With TLS, handshakes run concurrently (a slow client does not
/// hold up the others) and at most `handshake_timeout` each; failed ones are logged at debug
/// and dropped.
pub fn incoming(
    mut listener: GuardedListener,
    tls: Option<Arc<ServerTls>>,
    handshake_timeout: Duration,
) -> Pin<Box<dyn futures_util::Stream<Item = io::Result<GrpcConn>> + Send>> {
    let Some(tls) = tls else {
        return Box::pin(futures_util::StreamExt::map(listener.into_stream(), |s| {
            s.map(GrpcConn::Plain)
        }));
    };
    let (tx, rx) = mpsc::channel::<GrpcConn>(64);
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.next() => accepted,
                // The server stopped taking connections: stop accepting them.
                () = tx.closed() => return,
            };
            let tls = tls.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Some(conn) = handshake(&tls, stream, peer, handshake_timeout).await {
                    let _ = tx.send(conn).await;
                }
            });
        }
    });
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|conn| (Ok(conn), rx))
    }))
}

/// One connection's TLS handshake, at most `timeout`; a failed one is logged at debug.
async fn handshake(
    tls: &ServerTls,
    stream: GuardedStream,
    peer: SocketAddr,
    timeout: Duration,
) -> Option<GrpcConn> {
    match tokio::time::timeout(timeout, tls.accept(stream)).await {
        Ok(Ok(conn)) => Some(GrpcConn::Tls(Box::new(conn))),
        Ok(Err(e)) => {
            tracing::debug!(%peer, "TLS handshake refused: {e}");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            GrpcConn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            GrpcConn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            GrpcConn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            GrpcConn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            GrpcConn::Plain(s) => Pin::new(s).poll_flush(cx),
            GrpcConn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            GrpcConn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            GrpcConn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            GrpcConn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            GrpcConn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            GrpcConn::Plain(s) => s.is_write_vectored(),
            GrpcConn::Tls(s) => s.is_write_vectored(),
        }
    }
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            GrpcConn::Plain(s) => s.connect_info(),
            GrpcConn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}
