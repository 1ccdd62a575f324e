//! TLS as a client (to Redis, to the xDS server) beyond the system's CAs: a CA file, a client
//! certificate (mutual TLS), and optionally no hostname check (the reference's
//! `REDIS_TLS_CACERT`, `REDIS_TLS_CLIENT_CERT`, `REDIS_TLS_CLIENT_KEY`,
//! `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`, and the `CONFIG_GRPC_XDS_*` twins).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use super::{TlsError, read_certs, read_key};

/// The TLS material of a client; empty means the system's CAs only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates that may sign Redis' certificate (instead of the system's).
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain and key, for Redis that asks for one.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Accept a certificate that the CA signed for another name (the chain is still checked).
    pub skip_hostname_verification: bool,
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        *self == TlsFiles::default()
    }
}

/// A rustls client configuration from the files.
pub fn client_config(files: &TlsFiles) -> Result<ClientConfig, TlsError> {
    let roots = Arc::new(root_store(files.ca.as_deref())?);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?;
    let builder = if files.skip_hostname_verification {
        let inner = WebPkiServerVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| TlsError::Other(e.to_string()))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyName(inner)))
    } else {
        builder.with_root_certificates(roots)
    };
    match (&files.cert, &files.key) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| TlsError::file("the certificate does not fit its key", cert, e)),
        _ => Err(TlsError::Other(
            "a client certificate needs both the certificate and the key".into(),
        )),
    }
}

/// The CAs in `ca`, or the system's.
pub(crate) fn root_store(ca: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            let (added, _) = roots.add_parsable_certificates(read_certs(path)?);
            if added == 0 {
                return Err(TlsError::file("no CA certificate in", path, "empty"));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
        }
    }
    Ok(roots)
}

/// Checks the chain as usual but accepts any name in the certificate.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
