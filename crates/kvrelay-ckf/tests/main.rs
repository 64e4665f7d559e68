//! Every integration test of this crate, in one test binary: each file beside this one is
//! a module (they were binaries of their own). One binary links the crate and its
//! dependencies once instead of once per file, which is most of a cold test build
//! (ARCHITECTURE.md, Testing). cargo-nextest still runs every test in its own process.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests and their helpers fail loudly"
)]

mod dense;
mod joint;
mod model;
mod ownership;
mod query;
mod tiers;
mod vectors;
