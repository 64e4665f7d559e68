//! `kvrelay inspect membership`.

use anyhow::Result;

/// Arguments of `kvrelay inspect membership`.
#[derive(Debug, clap::Args)]
pub(crate) struct MembershipArgs {}

pub(crate) fn run(_args: &MembershipArgs) -> Result<()> {
    Err(crate::usage::usage(
        "kvrelay inspect membership is not built yet",
    ))
}
