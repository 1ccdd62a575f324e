//! A management server written for the tests: ADS (state of the world) serving
//! `RateLimitConfig` snapshots the way Envoy Gateway's xDS server does, over mutual TLS, and
//! recording every request slidegate sends (subscriptions, ACKs, NACKs). It can be stopped
//! (every stream ends, the port closes) and started again on the same port.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use slidegate::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use slidegate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use slidegate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use slidegate::server::grpc::tls::{ServerTls, ServerTlsFiles};
use slidegate::server::net::{ConnectionLimits, GuardedListener};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use super::KillOnDrop;
use super::redis::{command, free_port, make_certs, wait_until};
use std::process::{Command, Stdio};

pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// What the server hands out: a version and its resources.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub version: String,
    pub configs: Vec<RateLimitConfig>,
}

#[derive(Default)]
struct Shared {
    requests: Vec<DiscoveryRequest>,
    /// (nonce, version) of every response sent.
    sent: Vec<(String, String)>,
    nonce: u64,
}

/// The running server.
pub struct XdsServer {
    pub addr: SocketAddr,
    snapshot: watch::Sender<Option<Snapshot>>,
    shared: Arc<Mutex<Shared>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    tls: Option<ServerTlsFiles>,
}

#[derive(Clone)]
struct Ads {
    snapshot: watch::Receiver<Option<Snapshot>>,
    shared: Arc<Mutex<Shared>>,
    stop: watch::Receiver<bool>,
}

type ResponseStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ResponseStream;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<DiscoveryResponse, Status>>(16);
        let (mut snapshots, shared, mut stop) = (
            self.snapshot.clone(),
            self.shared.clone(),
            self.stop.clone(),
        );
        tokio::spawn(async move {
            let mut subscribed = false;
            loop {
                let push = tokio::select! {
                    message = incoming.message() => match message {
                        Ok(Some(request)) => {
                            let first = !subscribed && request.response_nonce.is_empty();
                            shared.lock().unwrap().requests.push(request);
                            subscribed |= first;
                            first
                        }
                        _ => return,
                    },
                    changed = snapshots.changed(), if subscribed => {
                        if changed.is_err() { return; }
                        true
                    }
                    // Dropping `tx` ends the stream.
                    _ = stop.wait_for(|s| *s) => return,
                };
                let current = snapshots.borrow_and_update().clone();
                if let (true, Some(snapshot)) = (push, current) {
                    let response = {
                        let mut shared = shared.lock().unwrap();
                        shared.nonce += 1;
                        let nonce = format!("n{}", shared.nonce);
                        shared.sent.push((nonce.clone(), snapshot.version.clone()));
                        response(&snapshot, nonce)
                    };
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

fn response(snapshot: &Snapshot, nonce: String) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: snapshot.version.clone(),
        resources: snapshot
            .configs
            .iter()
            .map(|c| pbjson_types::Any {
                type_url: TYPE_URL.into(),
                value: c.encode_to_vec().into(),
            })
            .collect(),
        canary: false,
        type_url: TYPE_URL.into(),
        nonce,
    }
}

/// Mutual TLS with `<name>.crt`/`.key` and `ca.crt` of `dir` (see `make_certs`).
pub fn mtls_files(dir: &Path, name: &str) -> ServerTlsFiles {
    ServerTlsFiles {
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
        client_ca: Some(dir.join("ca.crt")),
        client_san: None,
    }
}

impl XdsServer {
    /// Serves on `addr` (port 0 for any), with mutual TLS when `tls` is given.
    pub async fn start(addr: SocketAddr, tls: Option<ServerTlsFiles>) -> XdsServer {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind xDS");
        let addr = listener.local_addr().expect("xDS address");
        let (snapshot, snapshot_rx) = watch::channel(None);
        let (stop, stop_rx) = watch::channel(false);
        let shared = Arc::new(Mutex::new(Shared::default()));
        let ads = Ads {
            snapshot: snapshot_rx,
            shared: shared.clone(),
            stop: stop_rx.clone(),
        };
        let server_tls = tls
            .clone()
            .map(|files| Arc::new(ServerTls::load(files).expect("xDS server TLS")));
        let incoming = slidegate::server::grpc::tls::incoming(
            GuardedListener::new(listener, ConnectionLimits::default()),
            server_tls,
            Duration::from_secs(5),
        );
        let mut stopped = stop_rx;
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(ads))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        });
        XdsServer {
            addr,
            snapshot,
            shared,
            stop,
            task,
            tls,
        }
    }

    /// Hands out `snapshot` to every subscriber, now and to later ones.
    pub fn push(&self, snapshot: Snapshot) {
        self.snapshot.send_replace(Some(snapshot));
    }

    pub fn requests(&self) -> Vec<DiscoveryRequest> {
        self.shared.lock().unwrap().requests.clone()
    }

    /// The nonce of the last response that carried `version`.
    pub fn nonce_of(&self, version: &str) -> Option<String> {
        let shared = self.shared.lock().unwrap();
        shared
            .sent
            .iter()
            .rev()
            .find(|(_, v)| v == version)
            .map(|(n, _)| n.clone())
    }

    /// Waits until a request satisfies `check`; returns it.
    pub async fn wait_for_request(
        &self,
        what: &str,
        check: impl Fn(&DiscoveryRequest) -> bool,
    ) -> DiscoveryRequest {
        let end = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(found) = self.requests().into_iter().find(|r| check(r)) {
                return found;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "no {what}; requests seen: {:#?}",
                self.requests()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the ACK of `version`.
    pub async fn wait_for_ack(&self, version: &str) -> DiscoveryRequest {
        self.wait_for_request(&format!("ACK of version {version}"), |r| {
            r.version_info == version
                && r.error_detail.is_none()
                && Some(&r.response_nonce) == self.nonce_of(version).as_ref()
        })
        .await
    }

    /// Ends every stream, closes the port, and starts again on the same port with nothing
    /// recorded; the snapshot is kept.
    pub async fn restart(self) -> XdsServer {
        let (addr, tls, snapshot) = (self.addr, self.tls.clone(), self.snapshot.borrow().clone());
        self.stop.send_replace(true);
        let mut this = self;
        let _ = (&mut this.task).await;
        drop(this);
        let server = XdsServer::start(addr, tls).await;
        if let Some(snapshot) = snapshot {
            server.push(snapshot);
        }
        server
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        self.task.abort();
    }
}

/// The config Envoy Gateway's translator (internal/xds/translator/ratelimit.go) makes for a
/// BackendTrafficPolicy on one HTTPRoute rule with one distinct header match: domain = the
/// listener's name, an outer descriptor whose key and value are the route's name, and inside it
/// `rule-<rule>-match-<match>` (key only, for a distinct header) with the limit.
pub fn gateway_config(
    domain: &str,
    route: &str,
    header_limit: u32,
    unit: RateLimitUnit,
) -> RateLimitConfig {
    RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: route.into(),
            value: route.into(),
            descriptors: vec![RateLimitDescriptor {
                key: "rule-0-match-0".into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: unit.into(),
                    requests_per_unit: header_limit,
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// A TLS client trusting `dir/ca.crt`, presenting `dir/<client>.crt` when given.
fn client_tls(dir: &Path, client: Option<&str>) -> rustls::ClientConfig {
    let files = slidegate::tls::TlsFiles {
        ca: Some(dir.join("ca.crt")),
        cert: client.map(|c| dir.join(format!("{c}.crt"))),
        key: client.map(|c| dir.join(format!("{c}.key"))),
        skip_hostname_verification: false,
    };
    slidegate::tls::client_config(&files).expect("client TLS")
}

/// A gRPC channel over TLS to `addr`, trusting `dir/ca.crt`, presenting `dir/<client>.crt` when
/// given.
pub async fn tls_channel(
    addr: SocketAddr,
    dir: &Path,
    client: Option<&str>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let mut config = client_tls(dir, client);
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let connect = tower::service_fn(move |_: tonic::transport::Uri| {
        let connector = connector.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
            let tls = connector.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(connect)
        .await
}

/// The DER of the certificate a TLS server at `addr` presents.
pub async fn presented_certificate(addr: SocketAddr, dir: &Path, client: &str) -> Vec<u8> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls(dir, Some(client))));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let tls = connector.connect(name, tcp).await.expect("handshake");
    tls.get_ref().1.peer_certificates().expect("a certificate")[0].to_vec()
}

/// Where the certificate files of a test live, for the environment of the binary.
pub fn file(dir: &Path, name: &str) -> String {
    PathBuf::from(dir).join(name).display().to_string()
}

/// Starts the binary with the environment Envoy Gateway gives its rate-limit container
/// (internal/infrastructure/kubernetes/ratelimit), its files and ports pointing at the test's,
/// plus `extra_env` (e.g. REDIS_URL); (gRPC port, HTTP port, child).
pub fn start_as_gateway_ratelimit(
    dir: &Path,
    xds: &XdsServer,
    node_id: &str,
    force_start: bool,
    log: &Path,
    extra_env: &[(&str, String)],
) -> (u16, u16, KillOnDrop) {
    let (grpc, http) = (free_port(), free_port());
    let log_file = std::fs::File::create(log).expect("log file");
    // The container: the image's ENV, the binary as /bin/ratelimit, Envoy Gateway's variables.
    let ratelimit = dir.join("ratelimit");
    if !ratelimit.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_slidegate"), &ratelimit)
            .expect("link ratelimit");
    }
    let child = Command::new(&ratelimit)
        .env_clear()
        .envs(dockerfile_env())
        .envs([
            ("RUNTIME_ROOT", "/data".to_string()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit".to_string()),
            ("RUNTIME_IGNOREDOTFILES", "true".to_string()),
            ("RUNTIME_WATCH_ROOT", "false".to_string()),
            ("LOG_LEVEL", "info".to_string()),
            ("USE_STATSD", "false".to_string()),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_string()),
            ("CONFIG_GRPC_XDS_SERVER_URL", xds.addr.to_string()),
            ("CONFIG_GRPC_XDS_NODE_ID", node_id.to_string()),
            ("GRPC_SERVER_USE_TLS", "true".to_string()),
            ("GRPC_SERVER_TLS_CERT", file(dir, "ratelimit.crt")),
            ("GRPC_SERVER_TLS_KEY", file(dir, "ratelimit.key")),
            ("GRPC_SERVER_TLS_CA_CERT", file(dir, "ca.crt")),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_string()),
            (
                "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
                file(dir, "ratelimit.crt"),
            ),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", file(dir, "ratelimit.key")),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", file(dir, "ca.crt")),
            (
                "FORCE_START_WITHOUT_INITIAL_CONFIG",
                force_start.to_string(),
            ),
            // The test's own ports and quick reconnects; the rest is Envoy Gateway's.
            ("GRPC_HOST", "127.0.0.1".to_string()),
            ("GRPC_PORT", grpc.to_string()),
            ("HOST", "127.0.0.1".to_string()),
            ("PORT", http.to_string()),
            (
                "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
                "100ms".to_string(),
            ),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "400ms".to_string()),
            ("SLIDEGATE_TLS_RELOAD_INTERVAL", "100ms".to_string()),
        ])
        .envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .expect("start slidegate");
    wait_until("HTTP port", Duration::from_secs(20), || {
        command(http, "GET /healthz HTTP/1.0\r\n").is_ok_and(|r| r.contains("200"))
    });
    (grpc, http, KillOnDrop(child))
}

/// `ca.crt` and the certificates of the three parties: slidegate, the xDS server, Envoy.
pub fn gateway_certs(dir: &Path) {
    // Envoy Gateway uses one certificate for both ends of each connection.
    make_certs(
        dir,
        &[
            ("ratelimit", "DNS:localhost,IP:127.0.0.1"),
            ("xds", "DNS:localhost,IP:127.0.0.1"),
            ("envoy", "DNS:envoy"),
        ],
    );
}

/// The `ENV` of deploy/Dockerfile's final stage, as a container started from the image has it.
pub fn dockerfile_env() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/Dockerfile"))
        .expect("read Dockerfile");
    let joined = text.replace("\\\n", " ");
    let last_stage = joined.rsplit("\nFROM ").next().unwrap_or_default();
    last_stage
        .lines()
        .filter_map(|line| line.strip_prefix("ENV "))
        .flat_map(|vars| vars.split_whitespace())
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
        .collect()
}

/// slidegate in this process with mutual TLS on its gRPC port (`ratelimit.crt` of
/// [`gateway_certs`] in `dir`, clients signed by `ca.crt` and named `envoy`), the rules `yaml`
/// on `store`; the gRPC address.
pub async fn start_mtls_server(
    dir: &Path,
    yaml: &str,
    store: Arc<dyn slidegate::store::Store>,
    options: slidegate::server::ServerOptions,
) -> SocketAddr {
    use slidegate::limiter::{Limiter, LimiterOptions, SystemClock};
    use slidegate::server::{App, Listeners};

    let tls = ServerTls::load(ServerTlsFiles {
        cert: dir.join("ratelimit.crt"),
        key: dir.join("ratelimit.key"),
        client_ca: Some(dir.join("ca.crt")),
        client_san: Some("envoy".into()),
    })
    .expect("TLS files load");
    let limits = slidegate::config::compile_sources(&[("t.yaml".into(), yaml.into())]).unwrap();
    let limiter = Arc::new(Limiter::new(
        limits,
        store,
        Arc::new(SystemClock),
        LimiterOptions::default(),
    ));
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    let mut listeners = Listeners::new(grpc, http);
    listeners.grpc_tls = Some(Arc::new(tls));
    let app = App {
        limiter,
        metrics: Arc::new(slidegate::metrics::Metrics::new()),
        options,
    };
    tokio::spawn(slidegate::server::run(
        listeners,
        app,
        std::future::pending(),
    ));
    grpc_addr
}

/// Whether a client presenting `dir/<client>.crt` is refused: at the handshake, or its first
/// call (TLS 1.3 may finish the client's side of the handshake before the server checks it).
pub async fn refused_as(addr: SocketAddr, dir: &Path, client: &str) -> bool {
    use slidegate::proto::rate_limit_service_client::RateLimitServiceClient;

    let Ok(channel) = tls_channel(addr, dir, Some(client)).await else {
        return true;
    };
    RateLimitServiceClient::new(channel)
        .should_rate_limit(super::request("d", vec![super::descriptor(&[("k", "v")])]))
        .await
        .is_err()
}
