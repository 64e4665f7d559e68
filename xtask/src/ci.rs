//! `cargo xtask ci`: everything main must pass before a change lands.

use std::process::Command;

use anyhow::Result;

use crate::command::{self, cargo, cargo_bin};

/// Runs the checks in order, cheapest first, stopping at the first failure. The test
/// servers are found (or installed) first, so a missing one stops the run in seconds.
pub(crate) fn run() -> Result<()> {
    eprintln!("==> test services");
    crate::services::run()?;
    cargo(&["fmt", "--all", "--", "--check"])?;
    crate::tidy::run()?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ])?;
    // Tests run in the release profile: proptests and stress tests are much faster, and
    // `cargo xtask bench` reuses the same optimised dependency builds afterwards.
    if command::available(&cargo_bin(), "nextest") {
        cargo(&[
            "nextest",
            "run",
            "--workspace",
            "--release",
            "--locked",
            "--no-fail-fast",
        ])?;
    } else {
        cargo(&[
            "test",
            "--workspace",
            "--release",
            "--locked",
            "--no-fail-fast",
        ])?;
    }
    cargo(&["test", "--workspace", "--release", "--locked", "--doc"])?;
    command::run(
        Command::new(cargo_bin())
            .args(["doc", "--workspace", "--no-deps", "--locked"])
            .env("RUSTDOCFLAGS", "-D warnings")
            .current_dir(command::workspace_root()),
        "cargo doc --workspace --no-deps (RUSTDOCFLAGS=-D warnings)",
    )?;
    eprintln!("==> ci passed");
    Ok(())
}
