//! TLS files and errors, and TLS as a client (Redis, the xDS server) in [`client`]. TLS on the
//! gRPC port, with certificate reload, is the server's: `server::grpc::tls`.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub mod client;

pub use client::{TlsFiles, client_config};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {reason}")]
    File {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error(transparent)]
    Rustls(#[from] rustls::Error),
    #[error("{0}")]
    Other(String),
}

impl TlsError {
    pub(crate) fn file(
        what: &'static str,
        path: &Path,
        reason: impl std::fmt::Display,
    ) -> TlsError {
        TlsError::File {
            what,
            path: path.display().to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Every PEM certificate in `path` (at least one).
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::file("cannot read the certificates in", path, e))?;
    if certs.is_empty() {
        return Err(TlsError::file("no certificate in", path, "empty"));
    }
    Ok(certs)
}

/// The PEM private key in `path`.
pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::file("cannot read the key", path, e))
}
