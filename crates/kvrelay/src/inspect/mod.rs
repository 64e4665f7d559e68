//! `kvrelay inspect ...`: one module per inspected thing.

use anyhow::Result;
use clap::Subcommand;

mod ckf_address;
mod dc_id;
mod engine_batch;
mod frame;
mod membership;

/// What to inspect.
#[derive(Debug, Subcommand)]
pub(crate) enum InspectCommand {
    /// Print the stable DcId derived from an operator's dc-id text.
    DcId(dc_id::DcIdArgs),
    /// Print the filter address (fingerprint, primary and alternate bucket) of a hash.
    CkfAddress(ckf_address::CkfAddressArgs),
    /// Decode one WAN frame file and print it as JSON.
    Frame(frame::FrameArgs),
    /// Project a directory of model cards into endpoint memberships.
    Membership(membership::MembershipArgs),
    /// Decode one engine KV-event msgpack payload and print its logical events.
    EngineBatch(engine_batch::EngineBatchArgs),
}

pub(crate) fn run(command: InspectCommand) -> Result<()> {
    match command {
        InspectCommand::DcId(args) => dc_id::run(&args),
        InspectCommand::CkfAddress(args) => ckf_address::run(&args),
        InspectCommand::Frame(args) => frame::run(&args),
        InspectCommand::Membership(args) => membership::run(&args),
        InspectCommand::EngineBatch(args) => engine_batch::run(&args),
    }
}
