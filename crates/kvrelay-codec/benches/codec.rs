//! Codec benchmarks (placeholder created by the lead so the workspace manifest parses; the codec owner replaces it).

fn main() {}
