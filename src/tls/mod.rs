//! TLS: as a client (Redis, the xDS server) in [`client`], and on the gRPC port in [`server`],
//! where the certificate files are re-read when they change (Kubernetes rotates a mounted
//! secret by swapping its files) without touching established connections.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub mod client;
pub mod server;

pub use client::{TlsFiles, client_config};
pub use server::{GrpcConn, ServerTls, ServerTlsFiles};

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
    fn file(what: &'static str, path: &Path, reason: impl std::fmt::Display) -> TlsError {
        TlsError::File {
            what,
            path: path.display().to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Every PEM certificate in `path` (at least one).
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::file("cannot read the certificates in", path, e))?;
    if certs.is_empty() {
        return Err(TlsError::file("no certificate in", path, "empty"));
    }
    Ok(certs)
}

/// The PEM private key in `path`.
fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::file("cannot read the key", path, e))
}
