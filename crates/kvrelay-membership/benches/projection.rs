//! Membership projection benchmarks (filled in below).

fn main() {}
