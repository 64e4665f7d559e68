//! `kvrelay inspect dc-id`: the stable `DcId` of an operator's dc-id text.
//!
//! Prints one JSON line `{"dc_id":N,"hex":"<16 hex digits>"}`.

use anyhow::Result;
use kvrelay_identity::DcId;
use serde::Serialize;

use crate::usage::usage;

/// Arguments of `kvrelay inspect dc-id`.
#[derive(Debug, clap::Args)]
pub(crate) struct DcIdArgs {
    /// The operator's dc-id text (what `--dc-id` / `DYN_DC_ID` is set to).
    #[arg(value_name = "TEXT", allow_hyphen_values = true)]
    text: String,
}

/// The JSON printed by `kvrelay inspect dc-id`.
#[derive(Debug, Serialize)]
struct DcIdOutput {
    dc_id: u64,
    hex: String,
}

pub(crate) fn run(args: &DcIdArgs) -> Result<()> {
    if args.text.is_empty() {
        return Err(usage("dc-id text must not be empty"));
    }
    let dc_id = DcId::from_dc_name(&args.text);
    let output = DcIdOutput {
        dc_id: dc_id.as_u64(),
        hex: dc_id.to_string(),
    };
    println!("{}", serde_json::to_string(&output)?);
    Ok(())
}
