//! `kvrelay inspect dc-id`.

use anyhow::Result;

/// Arguments of `kvrelay inspect dc-id`.
#[derive(Debug, clap::Args)]
pub(crate) struct DcIdArgs {}

pub(crate) fn run(_args: &DcIdArgs) -> Result<()> {
    Err(crate::usage::usage(
        "kvrelay inspect dc-id is not built yet",
    ))
}
