//! `kvrelay inspect frame`.

use anyhow::Result;

/// Arguments of `kvrelay inspect frame`.
#[derive(Debug, clap::Args)]
pub(crate) struct FrameArgs {}

pub(crate) fn run(_args: &FrameArgs) -> Result<()> {
    Err(crate::usage::usage(
        "kvrelay inspect frame is not built yet",
    ))
}
