//! `kvrelay relay`: Run the relay service (stub wired by the lead; its owner replaces the body).

use anyhow::Result;

/// Arguments of `kvrelay relay`.
#[derive(Debug, clap::Args)]
pub(crate) struct RelayArgs {}

/// Runs the command, building its own tokio runtime where it needs one.
pub(crate) fn run(_args: RelayArgs) -> Result<()> {
    Err(crate::usage::usage("kvrelay relay is not built yet"))
}
