//! `kvrelay hash`: block and sequence hashes of a token sequence.

use anyhow::Result;

/// Arguments of `kvrelay hash`.
#[derive(Debug, clap::Args)]
pub(crate) struct HashArgs {}

pub(crate) fn run(_args: &HashArgs) -> Result<()> {
    Err(crate::usage::usage("kvrelay hash is not built yet"))
}
