//! The Python environment of the Dynamo-interop tests: a virtualenv at
//! `target/interop/venv` with `xtask/interop-requirements.txt` (Dynamo's runtime wheel and a
//! gRPC toolchain), created or refreshed by `cargo xtask services` (so by `cargo xtask ci`).
//!
//! The tests find its interpreter at that path (or `KVRELAY_INTEROP_PYTHON`) and fail with
//! this command when it is missing: an interop test is never skipped.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::workspace_root;

/// The pinned requirements, relative to the workspace.
const REQUIREMENTS: &str = "xtask/interop-requirements.txt";

/// The virtualenv, relative to the workspace.
pub(crate) const VENV: &str = "target/interop/venv";

/// Written into the venv once the requirements installed, holding the file they came from.
const STAMP: &str = "kvrelay-requirements.txt";

/// The venv's Python.
pub(crate) fn python() -> std::path::PathBuf {
    workspace_root().join(VENV).join("bin/python")
}

/// Creates or refreshes the venv when the requirements changed or it does not work.
pub(crate) fn ensure() -> Result<()> {
    let root = workspace_root();
    let venv = root.join(VENV);
    let requirements = root.join(REQUIREMENTS);
    let wanted = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let python = python();
    let stamp = venv.join(STAMP);
    let current = std::fs::read_to_string(&stamp).unwrap_or_default();
    if current == wanted && imports(&python) {
        eprintln!("    python interop venv ready ({VENV})");
        return Ok(());
    }
    let system_python = ["python3", "python"]
        .into_iter()
        .find(|candidate| crate::command::available(candidate, "--version"))
        .context(
            "no python3 on PATH: the Dynamo-interop tests need CPython >= 3.10 with venv and pip",
        )?;
    eprintln!("==> creating the python interop venv ({VENV}) from {REQUIREMENTS}");
    if venv.exists() {
        std::fs::remove_dir_all(&venv).with_context(|| format!("removing {}", venv.display()))?;
    }
    crate::command::run(
        Command::new(system_python).args(["-m", "venv"]).arg(&venv),
        "python3 -m venv target/interop/venv",
    )?;
    crate::command::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements),
        "pip install -r xtask/interop-requirements.txt",
    )?;
    if !imports(&python) {
        bail!("the interop venv installed but cannot import dynamo.llm, grpc and grpc_tools");
    }
    std::fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

/// Whether `python` imports everything the tests use.
fn imports(python: &Path) -> bool {
    python.exists()
        && Command::new(python)
            .args(["-c", "import dynamo.llm, grpc, grpc_tools.protoc"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
}
