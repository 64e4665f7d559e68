//! TLS on the WAN listener: loads PEM material and builds the rustls server configuration.
//!
//! Off by default. With a `client_ca`, every client must present a certificate chaining to
//! one of those CAs (mutual TLS); without it, any client may connect and the bearer token
//! (if configured) authenticates it.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::TlsConfig;

/// TLS material that failed to load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("reading {what} {path}: {message}")]
    Read {
        /// Which file (certificate, key, client CA).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// rustls refused the material.
    #[error("building the TLS server configuration: {message}")]
    Build {
        /// rustls' message.
        message: String,
    },
}

/// A ready TLS acceptor for the WAN listener.
#[derive(Clone)]
pub struct WanTls {
    acceptor: TlsAcceptor,
    client_auth: bool,
}

impl std::fmt::Debug for WanTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WanTls")
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

impl WanTls {
    /// Loads the certificate, key and optional client CA named by `config`.
    pub fn load(config: &TlsConfig) -> Result<Self, TlsError> {
        let certs = read_certs("certificate", &config.cert)?;
        let key = read_key(&config.key)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(build_error)?;
        let builder = match &config.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca_path) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in read_certs("client CA", ca_path)? {
                    roots.add(cert).map_err(build_error)?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(build_error)?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let server = builder.with_single_cert(certs, key).map_err(build_error)?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            client_auth: config.client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_certificate(&self) -> bool {
        self.client_auth
    }

    pub(crate) async fn accept(&self, stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.acceptor.accept(stream).await
    }
}

fn build_error(err: impl std::fmt::Display) -> TlsError {
    TlsError::Build {
        message: err.to_string(),
    }
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read_error = |message: String| TlsError::Read {
        what,
        path: path.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|err| read_error(err.to_string()))?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(file))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| read_error(err.to_string()))?;
    if certs.is_empty() {
        return Err(read_error("no PEM certificate found".to_owned()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let read_error = |message: String| TlsError::Read {
        what: "private key",
        path: path.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|err| read_error(err.to_string()))?;
    rustls_pemfile::private_key(&mut BufReader::new(file))
        .map_err(|err| read_error(err.to_string()))?
        .ok_or_else(|| read_error("no PEM private key found".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_certificate_file_names_the_path() {
        let config = TlsConfig {
            cert: PathBuf::from("/nonexistent/server.pem"),
            key: PathBuf::from("/nonexistent/server.key"),
            client_ca: None,
        };
        let err = WanTls::load(&config).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("reading certificate /nonexistent/server.pem"),
            "{err}"
        );
    }

    #[test]
    fn file_without_certificates_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("empty.pem");
        std::fs::write(&cert, "not a pem").unwrap();
        let config = TlsConfig {
            cert: cert.clone(),
            key: cert,
            client_ca: None,
        };
        assert!(matches!(
            WanTls::load(&config),
            Err(TlsError::Read {
                what: "certificate",
                ..
            })
        ));
    }
}
