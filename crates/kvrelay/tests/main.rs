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

#[path = "../../kvrelay-dynamo/tests/interop/mod.rs"]
mod interop;
mod support;

mod cli_hash;
mod consumer_relay;
mod consumer_tls;
mod demo;
mod dynamo_contract;
mod dynamo_relay;
mod faults;
mod fd_limit;
mod format_twins;
mod relay_logs;
mod relay_pair;
mod router;
mod router_hostile_relay;
mod tiers;
mod warm_restart;
