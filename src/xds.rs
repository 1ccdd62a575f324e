//! The xDS config source (`CONFIG_TYPE=GRPC_XDS_SOTW`): slidegate subscribes to
//! `RateLimitConfig` resources on a management server's aggregated discovery stream (ADS, state
//! of the world), the way Envoy Gateway configures its rate-limit service.
//!
//! Each response carries every resource; it is compiled by the file compiler
//! ([`crate::config::xds_resources`]) and swapped in atomically, then ACKed (its version and
//! nonce). A resource that does not compile is left out (keeping the rules it had) while the others take
//! effect, and the response is NACKed with the errors in `error_detail`; errors between
//! resources (one domain twice) refuse the whole response, and the rules already serving stay. When the stream ends or cannot be opened, slidegate reconnects after a delay that
//! starts at `retry_initial`, doubles up to `retry_max` and is randomised by `jitter`, and
//! re-subscribes with the version it last applied; a stream that delivered a response resets
//! the delay.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::config::ConfigErrors;
use crate::config::LoadOptions;
use crate::config::xds_resources::{RATE_LIMIT_CONFIG_TYPE, compile_update};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::proto::envoy::config::core::v3::{Node, node};
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::google::rpc::Status;
use crate::tls::TlsFiles;

/// How to reach the management server and who to say slidegate is.
#[derive(Clone, Debug)]
pub struct XdsOptions {
    /// `host:port` (the reference's `CONFIG_GRPC_XDS_SERVER_URL`).
    pub server: String,
    pub node_id: String,
    /// String fields of the node's metadata.
    pub node_metadata: Vec<(String, String)>,
    /// Extra gRPC metadata on the stream (e.g. an authorization header).
    pub headers: Vec<(String, String)>,
    /// TLS to the server; `None` is plaintext.
    pub tls: Option<XdsTls>,
    pub connect_timeout: Duration,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Each delay is multiplied by a random factor in `1 ± jitter`.
    pub jitter: f64,
    /// How resources combine (several for one domain need `merge_domains`).
    pub load: LoadOptions,
}

/// TLS to the management server.
#[derive(Clone, Debug, Default)]
pub struct XdsTls {
    /// CA (else the system's), and a client certificate for mutual TLS.
    pub files: TlsFiles,
    /// The name the server's certificate must carry; default: the host of `server`.
    pub server_name: Option<String>,
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("xDS server address '{0}' is not host:port")]
    Address(String),
    #[error("xDS TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("cannot connect to the xDS server (--xds-server, CONFIG_GRPC_XDS_SERVER_URL): {}; slidegate keeps trying", causes(.0))]
    Connect(#[from] tonic::transport::Error),
    #[error("xDS stream: {0}")]
    Stream(#[from] tonic::Status),
    #[error("xDS header '{0}' is not valid gRPC metadata")]
    Header(String),
    #[error("the xDS server closed the stream")]
    Closed,
}

/// An error and what caused it, down to the root ("transport error: ... Connection refused"),
/// where the error alone names only its kind.
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// The running client; dropping it stops it.
pub struct XdsClient {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for XdsClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts subscribing. Nothing is applied until the server answers; `received` turns true once
/// a config from it has been applied.
pub fn spawn(
    options: XdsOptions,
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
    received: Arc<AtomicBool>,
) -> XdsClient {
    let state = Subscription {
        options,
        limiter,
        metrics,
        received,
        applied_version: String::new(),
        applied: Vec::new(),
    };
    XdsClient {
        task: tokio::spawn(state.run()),
    }
}

struct Subscription {
    options: XdsOptions,
    limiter: Arc<Limiter>,
    metrics: Arc<Metrics>,
    received: Arc<AtomicBool>,
    /// The version of the last config applied, sent again after a reconnect.
    applied_version: String,
    /// Each resource's document as last applied: what a resource that a later response
    /// breaks keeps serving.
    applied: Vec<(String, String)>,
}

impl Subscription {
    async fn run(mut self) {
        let mut delay = self.options.retry_initial;
        loop {
            let mut answered = false;
            match self.stream(&mut answered).await {
                Ok(()) => {}
                Err(e) => tracing::warn!(server = %self.options.server, "{e}"),
            }
            if answered {
                delay = self.options.retry_initial;
            }
            let wait = jittered(delay, self.options.jitter);
            tracing::info!(server = %self.options.server, "reconnecting to the xDS server in {wait:?}");
            tokio::time::sleep(wait).await;
            delay = (delay * 2).min(self.options.retry_max.max(self.options.retry_initial));
        }
    }

    /// One stream, from connecting to its end. `answered` is set once a response arrived.
    async fn stream(&mut self, answered: &mut bool) -> Result<(), XdsError> {
        let channel = connect(&self.options).await?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024);
        let (requests, outgoing) = mpsc::channel::<DiscoveryRequest>(4);
        // The first request subscribes; it says which version this replica already has.
        let subscribe = self.request(self.applied_version.clone(), String::new(), None);
        let _ = requests.send(subscribe).await;
        let outgoing = futures_util::stream::unfold(outgoing, |mut rx| async move {
            rx.recv().await.map(|request| (request, rx))
        });
        let mut call = tonic::Request::new(outgoing);
        for (name, value) in &self.options.headers {
            let key = tonic::metadata::MetadataKey::from_bytes(name.as_bytes())
                .map_err(|_| XdsError::Header(name.clone()))?;
            let value = value.parse().map_err(|_| XdsError::Header(name.clone()))?;
            call.metadata_mut().insert(key, value);
        }
        let mut responses = client.stream_aggregated_resources(call).await?.into_inner();
        tracing::info!(server = %self.options.server, node = %self.options.node_id, "subscribed to rate-limit configs over xDS");
        while let Some(response) = responses.message().await? {
            *answered = true;
            let reply = self.apply(response).await;
            if requests.send(reply).await.is_err() {
                break;
            }
        }
        Err(XdsError::Closed)
    }

    /// Applies a response if it compiles; the ACK or NACK to send back.
    async fn apply(&mut self, response: DiscoveryResponse) -> DiscoveryRequest {
        let DiscoveryResponse {
            version_info,
            resources,
            type_url,
            nonce,
            ..
        } = response;
        if type_url != RATE_LIMIT_CONFIG_TYPE {
            let message =
                format!("slidegate subscribes to {RATE_LIMIT_CONFIG_TYPE} only, not {type_url}");
            tracing::warn!("{message}");
            return self.request(self.applied_version.clone(), nonce, Some(message));
        }
        let load = self.options.load;
        let previous = self.applied.clone();
        let compiled =
            tokio::task::spawn_blocking(move || compile_update(&resources, load, &previous)).await;
        match compiled {
            Ok(Ok(update)) => {
                let domains = update.limits.domains.len();
                self.limiter.replace_limits(update.limits);
                self.applied = update.sources;
                self.received.store(true, Ordering::SeqCst);
                if !update.rejected.is_empty() {
                    // The others serve; the NACK tells the management server which failed.
                    self.metrics.config_loaded(false);
                    let errors = ConfigErrors(update.rejected).to_string();
                    tracing::error!(version = %version_info, domains, "xDS config rejected for the resources that do not compile, which keep their previous rules; the others apply:\n{errors}");
                    return self.request(self.applied_version.clone(), nonce, Some(errors));
                }
                self.metrics.config_loaded(true);
                tracing::info!(version = %version_info, domains, "config applied from xDS");
                self.applied_version = version_info.clone();
                self.request(version_info, nonce, None)
            }
            Ok(Err(errors)) => {
                self.metrics.config_loaded(false);
                tracing::error!(version = %version_info, "xDS config rejected, the previous config keeps serving:\n{errors}");
                self.request(
                    self.applied_version.clone(),
                    nonce,
                    Some(errors.to_string()),
                )
            }
            Err(e) => {
                self.metrics.config_loaded(false);
                let message = format!("config compilation failed: {e}");
                self.request(self.applied_version.clone(), nonce, Some(message))
            }
        }
    }

    /// A request on the stream: a subscription (empty nonce), an ACK, or with an error a NACK.
    fn request(&self, version: String, nonce: String, error: Option<String>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version,
            node: Some(self.node()),
            resource_names: Vec::new(),
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            response_nonce: nonce,
            error_detail: error.map(|message| Status {
                // INVALID_ARGUMENT: the resources, not the transport, are at fault.
                code: 3,
                message,
                details: Vec::new(),
            }),
        }
    }

    fn node(&self) -> Node {
        let fields = self
            .options
            .node_metadata
            .iter()
            .map(|(k, v)| {
                let value = pbjson_types::Value {
                    kind: Some(pbjson_types::value::Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Node {
            id: self.options.node_id.clone(),
            cluster: String::new(),
            metadata: Some(pbjson_types::Struct { fields }),
            user_agent_name: "slidegate".into(),
            user_agent_version_type: Some(node::UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            )),
        }
    }
}

/// `delay` times a random factor in `1 ± jitter`.
fn jittered(delay: Duration, jitter: f64) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let jitter = jitter.clamp(0.0, 1.0);
    if jitter == 0.0 {
        return delay;
    }
    // A fresh RandomState is randomly keyed: enough randomness to spread reconnects.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    #[allow(clippy::cast_precision_loss)] // 53 bits of a random number are plenty
    let unit = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    delay.mul_f64(1.0 - jitter + 2.0 * jitter * unit)
}

/// A channel to the server, with TLS when configured.
async fn connect(options: &XdsOptions) -> Result<Channel, XdsError> {
    let (host, port) = split_host_port(&options.server)?;
    // The scheme only names the transport to tonic; TLS, if any, is the connector's.
    let uri: Uri = format!("http://{}", options.server)
        .parse()
        .map_err(|_| XdsError::Address(options.server.clone()))?;
    let endpoint = Endpoint::from(uri)
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true);
    let Some(tls) = &options.tls else {
        return Ok(endpoint.connect().await?);
    };
    let mut config = crate::tls::client_config(&tls.files)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = tls.server_name.clone().unwrap_or_else(|| host.clone());
    let server_name = rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|e| crate::tls::TlsError::Other(format!("server name '{name}': {e}")))?;
    let address = format!("{host}:{port}");
    let connect = tower::service_fn(move |_: Uri| {
        let connector = connector.clone();
        let server_name = server_name.clone();
        let address = address.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(address).await?;
            tcp.set_nodelay(true)?;
            let tls = connector.connect(server_name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    Ok(endpoint.connect_with_connector(connect).await?)
}

/// `host:port`, `[v6]:port` or `v4:port`.
fn split_host_port(server: &str) -> Result<(String, u16), XdsError> {
    if let Ok(addr) = server.parse::<SocketAddr>() {
        return Ok((addr.ip().to_string(), addr.port()));
    }
    let (host, port) = server
        .rsplit_once(':')
        .ok_or_else(|| XdsError::Address(server.into()))?;
    let port = port.parse().map_err(|_| XdsError::Address(server.into()))?;
    if host.is_empty() {
        return Err(XdsError::Address(server.into()));
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            split_host_port("envoy-gateway:18001").unwrap(),
            ("envoy-gateway".into(), 18001)
        );
        assert_eq!(
            split_host_port("127.0.0.1:9").unwrap(),
            ("127.0.0.1".into(), 9)
        );
        assert_eq!(split_host_port("[::1]:9").unwrap(), ("::1".into(), 9));
        assert!(split_host_port("no-port").is_err());
        assert!(split_host_port(":9").is_err());
        assert!(split_host_port("host:http").is_err());
    }

    #[test]
    fn jitter_stays_within_its_bounds() {
        let base = Duration::from_secs(10);
        assert_eq!(jittered(base, 0.0), base);
        let seen: Vec<Duration> = (0..200).map(|_| jittered(base, 0.5)).collect();
        assert!(seen.iter().all(|d| *d >= base / 2 && *d <= base * 3 / 2));
        // Not one value over and over.
        assert!(seen.iter().any(|d| *d != seen[0]));
    }
}
