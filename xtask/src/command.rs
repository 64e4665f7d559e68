//! Running cargo and other commands with progress lines and error context.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The workspace root (the parent of `xtask/`).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_path_buf(), Path::to_path_buf)
}

/// The cargo binary that invoked us (`$CARGO`), falling back to `cargo` on PATH.
pub(crate) fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Runs `cargo ARGS` in the workspace root, failing when it fails.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    run(
        Command::new(cargo_bin())
            .args(args)
            .current_dir(workspace_root()),
        &format!("cargo {}", args.join(" ")),
    )
}

/// Runs a prepared command, echoing `label` as a progress line and its duration after.
pub(crate) fn run(command: &mut Command, label: &str) -> Result<()> {
    eprintln!("==> {label}");
    let started = std::time::Instant::now();
    let status = command
        .status()
        .with_context(|| format!("failed to start `{label}`"))?;
    eprintln!("    ({label}: {:.1} s)", started.elapsed().as_secs_f64());
    if !status.success() {
        bail!("`{label}` failed with {status}");
    }
    Ok(())
}

/// Whether `program --version` runs successfully.
pub(crate) fn available(program: &str, version_arg: &str) -> bool {
    Command::new(program)
        .arg(version_arg)
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false)
}
