//! `kvrelay route`: Rank pools of remote relays for a request (consumer client) (stub wired by the lead; its owner replaces the body).

use anyhow::Result;

/// Arguments of `kvrelay route`.
#[derive(Debug, clap::Args)]
pub(crate) struct RouteArgs {}

/// Runs the command, building its own tokio runtime where it needs one.
pub(crate) fn run(_args: RouteArgs) -> Result<()> {
    Err(crate::usage::usage("kvrelay route is not built yet"))
}
