//! TLS towards a relay: server verification against a CA bundle (the system roots are
//! never consulted) and an optional client certificate for mutual TLS.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::TlsError;
use crate::pem::{provider, read_certs, read_key, read_roots};

/// TLS towards one relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayTls {
    /// CA bundle (PEM) the relay's certificate must chain to. Only these CAs are trusted:
    /// the system roots are not consulted.
    pub ca: PathBuf,
    /// Client certificate chain (PEM) presented for mutual TLS; needs `key`.
    pub cert: Option<PathBuf>,
    /// Private key (PEM) of `cert`.
    pub key: Option<PathBuf>,
    /// Name the relay's certificate must carry; by default the host part of the
    /// relay's address (a DNS name or an IP address).
    pub server_name: Option<String>,
}

impl RelayTls {
    /// TLS trusting the CAs in `ca`, no client certificate, default server name.
    pub fn new(ca: impl Into<PathBuf>) -> Self {
        Self {
            ca: ca.into(),
            cert: None,
            key: None,
            server_name: None,
        }
    }
}

/// A ready TLS connector for one relay.
#[derive(Clone)]
pub struct RelayConnector {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for RelayConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConnector")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl RelayConnector {
    /// Loads the material named by `tls` for the relay at `addr` (`host:port`).
    pub fn load(addr: &str, tls: &RelayTls) -> Result<Self, TlsError> {
        let build_error = |err: rustls::Error| TlsError::Build {
            side: "client",
            message: err.to_string(),
        };
        let name = tls
            .server_name
            .clone()
            .unwrap_or_else(|| host_of(addr).to_owned());
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName { name })?;
        let roots = read_roots("CA bundle", &tls.ca)?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(build_error)?
            .with_root_certificates(roots);
        let config = match (&tls.cert, &tls.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let chain = read_certs("client certificate", cert)?;
                let key = read_key("client key", key)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(build_error)?
            }
            _ => return Err(TlsError::IncompleteClientIdentity),
        };
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
        })
    }

    /// Runs the TLS handshake on a connected socket (the caller bounds it in time).
    pub async fn connect(&self, stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.connector
            .connect(self.server_name.clone(), stream)
            .await
    }
}

/// The host part of `host:port`, without the brackets of an IPv6 literal.
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|host| host.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_server_name_is_the_address_host() {
        assert_eq!(host_of("relay.example:7400"), "relay.example");
        assert_eq!(host_of("127.0.0.1:7400"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7400"), "::1");
    }

    #[test]
    fn missing_ca_bundle_names_the_path() {
        let err =
            RelayConnector::load("localhost:1", &RelayTls::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("reading CA bundle /nonexistent/ca.pem"),
            "{err}"
        );
    }

    #[test]
    fn file_without_certificates_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a pem").unwrap();
        let err = RelayConnector::load("localhost:1", &RelayTls::new(&ca)).unwrap_err();
        assert!(
            matches!(&err, TlsError::Read { what: "CA bundle", path, .. } if *path == ca),
            "{err}"
        );
    }

    #[test]
    fn bad_client_key_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPairPem::generate();
        let ca = dir.path().join("ca.pem");
        let cert = dir.path().join("client.pem");
        let bad_key = dir.path().join("client.key");
        std::fs::write(&ca, &key.cert_pem).unwrap();
        std::fs::write(&cert, &key.cert_pem).unwrap();
        std::fs::write(&bad_key, "garbage").unwrap();
        let tls = RelayTls {
            cert: Some(cert),
            key: Some(bad_key.clone()),
            ..RelayTls::new(&ca)
        };
        let err = RelayConnector::load("localhost:1", &tls).unwrap_err();
        assert!(
            matches!(&err, TlsError::Read { what: "client key", path, .. } if *path == bad_key),
            "{err}"
        );
        let only_cert = RelayTls {
            key: None,
            ..tls.clone()
        };
        assert_eq!(
            RelayConnector::load("localhost:1", &only_cert).unwrap_err(),
            TlsError::IncompleteClientIdentity
        );
        let good_key = dir.path().join("good.key");
        std::fs::write(&good_key, &key.key_pem).unwrap();
        let mutual = RelayTls {
            key: Some(good_key),
            ..tls
        };
        assert!(RelayConnector::load("localhost:1", &mutual).is_ok());
    }

    #[test]
    fn invalid_server_name_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, KeyPairPem::generate().cert_pem).unwrap();
        let tls = RelayTls {
            server_name: Some("not a name!".into()),
            ..RelayTls::new(&ca)
        };
        assert!(matches!(
            RelayConnector::load("localhost:1", &tls),
            Err(TlsError::ServerName { .. })
        ));
    }

    struct KeyPairPem {
        cert_pem: String,
        key_pem: String,
    }

    impl KeyPairPem {
        fn generate() -> Self {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            Self {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
            }
        }
    }
}
