//! Identity types, digests and reference-compatible token/block/sequence hashing.
//!
//! Pure: no tokio, no clock, no IO.

pub mod hashing;
pub mod query;

pub use query::KvQueryHashFormat;
