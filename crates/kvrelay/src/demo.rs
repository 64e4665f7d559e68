//! `kvrelay demo`: Run the one-command demo (stub wired by the lead; its owner replaces the body).

use anyhow::Result;

/// Arguments of `kvrelay demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {}

/// Runs the command, building its own tokio runtime where it needs one.
pub(crate) fn run(_args: DemoArgs) -> Result<()> {
    Err(crate::usage::usage("kvrelay demo is not built yet"))
}
