//! Decode + canonicalize throughput (placeholder until the benchmark lands).
fn main() {}
