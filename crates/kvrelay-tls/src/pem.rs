//! Reading PEM certificates and keys, naming the file and its role in every error.

use std::io::BufReader;
use std::path::Path;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::TlsError;

/// Every certificate in the PEM file at `path` (at least one); `what` names its role in
/// errors ("certificate", "CA bundle", ...).
pub(crate) fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
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

/// The first private key in the PEM file at `path`.
pub(crate) fn read_key(
    what: &'static str,
    path: &Path,
) -> Result<PrivateKeyDer<'static>, TlsError> {
    let read_error = |message: String| TlsError::Read {
        what,
        path: path.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|err| read_error(err.to_string()))?;
    rustls_pemfile::private_key(&mut BufReader::new(file))
        .map_err(|err| read_error(err.to_string()))?
        .ok_or_else(|| read_error("no PEM private key found".to_owned()))
}

/// A trust store holding every certificate of the PEM file at `path`.
pub(crate) fn read_roots(
    what: &'static str,
    path: &Path,
) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in read_certs(what, path)? {
        roots.add(cert).map_err(|err| TlsError::Read {
            what,
            path: path.to_path_buf(),
            message: err.to_string(),
        })?;
    }
    Ok(roots)
}

/// The ring provider every kvrelay TLS configuration uses.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
