//! Test support for the consumer: the relay's half of the protocol without a network
//! (`producer`: a producer filter and the relay's frame encoder), the sans-IO pair built
//! on it (`pair`), and a fake relay that serves the same producers over loopback TCP
//! (`fake_relay`: transport and connection faults only).

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the fake"
)]
#![allow(
    clippy::expect_used,
    clippy::panic,
    clippy::unwrap_used,
    reason = "test support: a broken fixture must fail the test loudly"
)]

use std::time::Duration;

mod fake_relay;
pub(crate) mod pair;
mod producer;

#[allow(unused_imports, reason = "the sans-IO test binaries use no socket")]
pub(crate) use fake_relay::{FakeRelay, Faults};
pub(crate) use producer::*;

/// Waits with a deadline; panics with `what` on timeout.
pub(crate) async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}
