//! Workspace automation for kvrelay, run through the `cargo xtask` alias.
//!
//! - `cargo xtask ci`: rustfmt check, clippy `-D warnings`, tidy checks (layering, purity,
//!   docs, hygiene, manifests), the whole test suite, rustdoc `-D warnings`.
//! - `cargo xtask tidy`: only the tidy checks.
//! - `cargo xtask codegen`: regenerates the checked-in protobuf code (no `protoc` needed).
//! - `cargo xtask bench [--quick] [BENCH]`: criterion benchmarks, then a summary table of
//!   figures and same-run ratios against each group's baseline, then the figures examples
//!   (`ckf-figures`, `growth-stall`, `checkpoint`, `e2e`; each can be named alone as
//!   BENCH). `cargo xtask bench stream
//!   [--quick]`: the multi-process stream benchmark of `benches/` (docs/benchmarks.md);
//!   `cargo xtask bench dynamo [--quick]`: its runs against Dynamo's relay.
//! - `cargo xtask fuzz [SECONDS]`: every cargo-fuzz target for SECONDS each (nightly).
//! - `cargo xtask demo`: the one-command demo (`kvrelay demo`) in release mode.
//! - `cargo xtask services`: finds the external servers the tests start, installing them
//!   when it can (root with apt-get), else naming the command, then creates the Python venv
//!   of the Dynamo-interop tests (`target/interop/venv`, pinned wheels from PyPI); `ci`
//!   runs it first.

use std::process::ExitCode;

mod bench;
mod ci;
mod codegen;
mod command;
mod fuzz;
mod interop;
mod services;
mod tidy;

const USAGE: &str = "usage: cargo xtask <ci | tidy | codegen | bench [--quick] [BENCH | stream | dynamo] | fuzz [SECONDS] | demo | services>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci::run(),
        Some("tidy") => tidy::run(),
        Some("codegen") => codegen::run(),
        Some("bench") => bench::run(&args[1..]),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("demo") => command::cargo(&["run", "--release", "-p", "kvrelay", "--", "demo"]),
        Some("services") => services::run(),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
