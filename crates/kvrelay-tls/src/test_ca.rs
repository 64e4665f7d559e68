//! A throwaway certificate authority for tests and the demo (feature `test-support`).
//! Keys are generated in memory; nothing here is fit for production.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// What a test certificate authority could not do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestCaError {
    /// rcgen refused to generate or sign.
    #[error("generating test certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// Writing PEM files failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What an issued certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A server (relay) certificate.
    Server,
    /// A client certificate for mutual TLS.
    Client,
}

/// A certificate and its key, issued by a [`TestAuthority`].
#[derive(Debug)]
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The private key, PEM (PKCS#8).
    pub key_pem: String,
    /// The certificate, DER.
    pub cert_der: CertificateDer<'static>,
    /// The private key, DER.
    pub key_der: PrivateKeyDer<'static>,
}

/// A self-signed CA that issues certificates.
pub struct TestAuthority {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl std::fmt::Debug for TestAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestAuthority").finish_non_exhaustive()
    }
}

impl TestAuthority {
    /// A new CA with common name `name`.
    pub fn new(name: &str) -> Result<Self, TestCaError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self { cert, key })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// Writes the CA certificate to `dir/<stem>.pem`.
    pub fn write(&self, dir: &Path, stem: &str) -> Result<PathBuf, TestCaError> {
        let path = dir.join(format!("{stem}.pem"));
        write(&path, &self.cert.pem())?;
        Ok(path)
    }

    /// Issues a certificate for `names` (DNS names or IP addresses).
    pub fn issue(&self, names: &[&str], purpose: Purpose) -> Result<Issued, TestCaError> {
        let names = names
            .iter()
            .map(|name| (*name).to_owned())
            .collect::<Vec<_>>();
        let mut params = CertificateParams::new(names)?;
        params.extended_key_usages = vec![match purpose {
            Purpose::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Purpose::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            key_der: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }

    /// Issues a certificate for `names` and writes it and its key to `dir/<stem>.pem` and
    /// `dir/<stem>.key`; returns the two paths.
    pub fn issue_to(
        &self,
        dir: &Path,
        stem: &str,
        names: &[&str],
        purpose: Purpose,
    ) -> Result<(PathBuf, PathBuf), TestCaError> {
        let issued = self.issue(names, purpose)?;
        let cert = dir.join(format!("{stem}.pem"));
        let key = dir.join(format!("{stem}.key"));
        write(&cert, &issued.cert_pem)?;
        write(&key, &issued.key_pem)?;
        Ok((cert, key))
    }
}

fn write(path: &Path, text: &str) -> Result<(), TestCaError> {
    std::fs::write(path, text).map_err(|source| TestCaError::Write {
        path: path.to_path_buf(),
        source,
    })
}
