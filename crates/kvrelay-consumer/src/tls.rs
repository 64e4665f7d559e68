//! Secure transport to a relay: TLS (server verification against a CA bundle, optional
//! client certificate for mutual TLS) and the bearer token sent in every stream request.
//!
//! Both are per relay and off by default. PEM files are read when the configuration is
//! validated and again when the [`Consumer`](crate::Consumer) starts, so a bad file fails
//! the start instead of every connection epoch.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvrelay_codec::limits::MAX_AUTH_TOKEN_LEN;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::TlsConnector;

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

/// A bearer token presented to a relay. Held in memory only; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Arc<str>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

impl BearerToken {
    /// A token from its text, trimmed like the relay trims its own. Must be non-empty,
    /// at most the protocol's 4096 bytes and free of control characters.
    pub fn new(text: &str) -> Result<Self, TokenError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(TokenError::Empty);
        }
        if text.len() > MAX_AUTH_TOKEN_LEN {
            return Err(TokenError::TooLong {
                len: text.len(),
                max: MAX_AUTH_TOKEN_LEN,
            });
        }
        if text.chars().any(char::is_control) {
            return Err(TokenError::ControlCharacter);
        }
        Ok(Self(Arc::from(text)))
    }

    /// Reads a token from `path` (its trimmed contents).
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|err| TokenError::Read {
            path: path.to_path_buf(),
            message: err.to_string(),
        })?;
        Self::new(&text).map_err(|err| match err {
            TokenError::Read { .. } => err,
            other => TokenError::File {
                path: path.to_path_buf(),
                message: other.to_string(),
            },
        })
    }

    /// The token's text, to send it or to compare a presented token against it (in
    /// constant time); never log it.
    pub fn secret(&self) -> &str {
        &self.0
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// A bearer token that cannot be used. Never quotes the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The token is empty (after trimming).
    #[error("bearer token must not be empty")]
    Empty,
    /// The token is longer than the protocol allows.
    #[error("bearer token is {len} bytes, at most {max} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The protocol's bound.
        max: usize,
    },
    /// The token contains a control character.
    #[error("bearer token must not contain control characters")]
    ControlCharacter,
    /// The token file could not be read.
    #[error("reading token file {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The token file holds no usable token.
    #[error("token file {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with its contents.
        message: String,
    },
}

/// TLS material that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("reading {what} {path}: {message}")]
    Read {
        /// Which file (CA bundle, client certificate, client key).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A client certificate without its key, or a key without a certificate.
    #[error("a client certificate and its key must be given together")]
    IncompleteClientIdentity,
    /// The server name (given, or taken from the address) is not a DNS name or IP.
    #[error("server name {name:?} is not a valid DNS name or IP address")]
    ServerName {
        /// The rejected name.
        name: String,
    },
    /// rustls refused the material.
    #[error("building the TLS client configuration: {message}")]
    Build {
        /// rustls' message.
        message: String,
    },
}

/// A ready TLS connector for one relay.
#[derive(Clone)]
pub(crate) struct RelayConnector {
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

impl std::fmt::Debug for RelayConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConnector")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl RelayConnector {
    /// Loads the material named by `tls` for the relay at `addr`.
    pub(crate) fn load(addr: &str, tls: &RelayTls) -> Result<Self, TlsError> {
        let name = tls
            .server_name
            .clone()
            .unwrap_or_else(|| host_of(addr).to_owned());
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| TlsError::ServerName { name })?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in read_certs("CA bundle", &tls.ca)? {
            roots.add(cert).map_err(|err| TlsError::Read {
                what: "CA bundle",
                path: tls.ca.clone(),
                message: err.to_string(),
            })?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(build_error)?
            .with_root_certificates(roots);
        let config = match (&tls.cert, &tls.key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let chain = read_certs("client certificate", cert)?;
                let key = read_key(key)?;
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
}

/// The host part of `host:port`, without the brackets of an IPv6 literal.
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.strip_prefix('[')
        .and_then(|host| host.strip_suffix(']'))
        .unwrap_or(host)
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
        what: "client key",
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

    #[test]
    fn token_is_trimmed_bounded_and_never_printed() {
        let token = BearerToken::new("  s3cret\n").unwrap();
        assert_eq!(token.as_str(), "s3cret");
        assert!(!format!("{token:?}").contains("s3cret"));
        assert_eq!(BearerToken::new(" \n"), Err(TokenError::Empty));
        assert!(matches!(
            BearerToken::new(&"x".repeat(MAX_AUTH_TOKEN_LEN + 1)),
            Err(TokenError::TooLong { .. })
        ));
        assert_eq!(
            BearerToken::new("a\u{7}b"),
            Err(TokenError::ControlCharacter)
        );
    }

    #[test]
    fn token_file_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        assert!(matches!(
            BearerToken::from_file(&missing),
            Err(TokenError::Read { path, .. }) if path == missing
        ));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let err = BearerToken::from_file(&empty).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        assert!(matches!(err, TokenError::File { path, .. } if path == empty));
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
