//! TLS and bearer tokens for every kvrelay connection, in one place: PEM loading, the WAN
//! listener's acceptor ([`ServerTls`]), the consumer's connector towards a relay
//! ([`RelayTls`] → [`RelayConnector`]), and the one [`BearerToken`] with its rules
//! (trimmed, non-empty, at most the protocol's 4,096 bytes, no control characters,
//! compared in constant time, never printed). The relay's WAN and admin listeners, the
//! router's API and the consumer all use these, so a token one side accepts the other
//! side can send.
//!
//! With the `test-support` feature, [`test_ca`] issues throwaway certificates for tests
//! and the demo.

mod client;
mod pem;
mod server;
#[cfg(feature = "test-support")]
pub mod test_ca;
mod token;

pub use client::{RelayConnector, RelayTls};
pub use server::{ListenerTls, ServerTls, ServerTlsStream};
pub use token::{BearerToken, TokenError, bearer_of};

use std::path::PathBuf;

/// TLS material that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("reading {what} {path}: {message}")]
    Read {
        /// Which file (certificate, private key, client CA, CA bundle, client
        /// certificate, client key).
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
    #[error("building the TLS {side} configuration: {message}")]
    Build {
        /// `server` or `client`.
        side: &'static str,
        /// rustls' message.
        message: String,
    },
}
