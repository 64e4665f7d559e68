//! `kvrelay inspect engine-batch`.

use anyhow::Result;

/// Arguments of `kvrelay inspect engine-batch`.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineBatchArgs {}

pub(crate) fn run(_args: &EngineBatchArgs) -> Result<()> {
    Err(crate::usage::usage(
        "kvrelay inspect engine-batch is not built yet",
    ))
}
