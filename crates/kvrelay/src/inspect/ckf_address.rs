//! `kvrelay inspect ckf-address`.

use anyhow::Result;

/// Arguments of `kvrelay inspect ckf-address`.
#[derive(Debug, clap::Args)]
pub(crate) struct CkfAddressArgs {}

pub(crate) fn run(_args: &CkfAddressArgs) -> Result<()> {
    Err(crate::usage::usage(
        "kvrelay inspect ckf-address is not built yet",
    ))
}
