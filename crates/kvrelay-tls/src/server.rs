//! TLS on the relay's WAN listener.
//!
//! With a client CA, every client must present a certificate chaining to one of those CAs
//! (mutual TLS); without it, any client may connect and the bearer token (if configured)
//! authenticates it.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::TlsError;
use crate::pem::{provider, read_certs, read_key, read_roots};

/// A TLS stream accepted by a [`ServerTls`].
pub type ServerTlsStream = TlsStream<TcpStream>;

/// A TLS listener's files: the `[wan.tls]` table of the relay and the `[tls]` table of the
/// router (one table, one rule).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM, PKCS#8, PKCS#1 or SEC1) of `cert`.
    pub key: PathBuf,
    /// When set, clients must present a certificate chaining to one of these CAs (PEM):
    /// mutual TLS.
    pub client_ca: Option<PathBuf>,
}

/// A ready TLS acceptor for the WAN listener.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
    client_auth: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the certificate, key and optional client CA named by `files`.
    pub fn load(files: &ListenerTls) -> Result<Self, TlsError> {
        let build_error = |err: rustls::Error| TlsError::Build {
            side: "server",
            message: err.to_string(),
        };
        let certs = read_certs("certificate", &files.cert)?;
        let key = read_key("private key", &files.key)?;
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(build_error)?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca_path) => {
                let roots = read_roots("client CA", ca_path)?;
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|err| TlsError::Build {
                    side: "server",
                    message: err.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let server = builder.with_single_cert(certs, key).map_err(build_error)?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            client_auth: files.client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_certificate(&self) -> bool {
        self.client_auth
    }

    /// Runs the TLS handshake on an accepted socket (the caller bounds it in time).
    pub async fn accept(&self, stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.acceptor.accept(stream).await
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn files(cert: &Path, key: &Path) -> ListenerTls {
        ListenerTls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            client_ca: None,
        }
    }

    #[test]
    fn missing_certificate_file_names_the_path() {
        let cert = PathBuf::from("/nonexistent/server.pem");
        let key = PathBuf::from("/nonexistent/server.key");
        let err = ServerTls::load(&files(&cert, &key)).unwrap_err();
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
        assert!(matches!(
            ServerTls::load(&files(&cert, &cert)),
            Err(TlsError::Read {
                what: "certificate",
                ..
            })
        ));
    }

    #[test]
    fn key_without_a_pem_key_names_the_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let key_pair = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key_pair)
            .unwrap();
        let cert_path = dir.path().join("server.pem");
        let key_path = dir.path().join("server.key");
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, "garbage").unwrap();
        assert!(matches!(
            ServerTls::load(&files(&cert_path, &key_path)),
            Err(TlsError::Read { what: "private key", path, .. }) if path == key_path
        ));
        std::fs::write(&key_path, key_pair.serialize_pem()).unwrap();
        let tls = ServerTls::load(&files(&cert_path, &key_path)).unwrap();
        assert!(!tls.requires_client_certificate());
    }
}
