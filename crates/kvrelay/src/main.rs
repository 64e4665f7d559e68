//! The kvrelay command-line tool.

fn main() {}
