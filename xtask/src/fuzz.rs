//! `cargo xtask fuzz [SECONDS]`: runs every cargo-fuzz target of every crate briefly.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::{self, workspace_root};

/// Default seconds per target when none is given.
const DEFAULT_SECONDS: u64 = 60;

/// Runs each target in each `crates/*/fuzz` project for the given number of seconds.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let seconds = match args.first() {
        Some(text) => text
            .parse::<u64>()
            .with_context(|| format!("fuzz seconds must be a number, got {text:?}"))?,
        None => DEFAULT_SECONDS,
    };
    if !command::available("cargo-fuzz", "--version") {
        bail!("cargo-fuzz is not installed; run `cargo install cargo-fuzz`");
    }
    let projects = fuzz_projects()?;
    if projects.is_empty() {
        bail!("no fuzz projects found under crates/*/fuzz");
    }
    // One target directory for every project: the dependencies they share (the ckf and
    // identity crates, serde, bytes, ...) are built once, with the same flags.
    let target_dir = workspace_root().join("target").join("fuzz");
    let target_dir = target_dir.display().to_string();
    for project in projects {
        let output = Command::new("cargo")
            .args(["+nightly", "fuzz", "list"])
            .current_dir(&project)
            .output()
            .with_context(|| format!("listing fuzz targets in {}", project.display()))?;
        if !output.status.success() {
            bail!("`cargo fuzz list` failed in {}", project.display());
        }
        let targets = String::from_utf8_lossy(&output.stdout).to_string();
        for target in targets.lines().map(str::trim).filter(|t| !t.is_empty()) {
            let max_time = format!("-max_total_time={seconds}");
            command::run(
                Command::new("cargo")
                    .args([
                        "+nightly",
                        "fuzz",
                        "run",
                        "--target-dir",
                        &target_dir,
                        target,
                    ])
                    .args(["--", &max_time])
                    .current_dir(&project),
                &format!("fuzz {target} for {seconds} s ({})", project.display()),
            )?;
        }
    }
    Ok(())
}

fn fuzz_projects() -> Result<Vec<PathBuf>> {
    let crates_dir = workspace_root().join("crates");
    let mut projects = Vec::new();
    let entries = std::fs::read_dir(&crates_dir)
        .with_context(|| format!("reading {}", crates_dir.display()))?;
    for entry in entries {
        let fuzz_dir = entry
            .with_context(|| format!("reading {}", crates_dir.display()))?
            .path()
            .join("fuzz");
        if fuzz_dir.join("Cargo.toml").is_file() {
            projects.push(fuzz_dir);
        }
    }
    projects.sort();
    Ok(projects)
}
