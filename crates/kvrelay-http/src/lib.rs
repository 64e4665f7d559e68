//! Hardened HTTP/1.1 serving shared by kvrelay's HTTP listeners (the relay's admin API and
//! the router's API), plus the accept-loop backoff every listener uses.
//!
//! One place for the rules every listener must keep: bounded connections, a request-head
//! deadline that also bounds idle keep-alives, a lifetime per connection, accept errors
//! that back off instead of spinning, and refusals that are counted and logged at most once
//! per interval. The owner of a listener counts events in its own metrics through
//! [`ListenerEvents`].

mod accept;
mod admission;
mod serve;

pub use accept::{
    ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, AcceptBackoff, AcceptErrorKind, ConnectionOutcome,
    ListenerEvents, classify,
};
pub use admission::{ConnectionAdmission, ConnectionPermit, ConnectionRefusal};
pub use serve::{Handshake, HttpBounds, Plaintext, serve, serve_with};

/// Waits for SIGINT or SIGTERM (SIGINT only where SIGTERM does not exist, or when its
/// handler cannot be installed): the cue for a service's graceful shutdown.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
