//! `kvrelay inspect ckf-address`: the CKF address (format 1, or the dense format 2) of one
//! 64-bit hash.
//!
//! Prints one JSON line `{"fingerprint":F,"primary":A,"alternate":B}`.

use anyhow::Result;
use kvrelay_ckf::Addressing;
use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};
use serde::Serialize;

use crate::usage::usage;

/// Arguments of `kvrelay inspect ckf-address`.
#[derive(Debug, clap::Args)]
pub(crate) struct CkfAddressArgs {
    /// Buckets in the filter: in 2..=16777216, a power of two for format 1.
    #[arg(long, value_name = "N")]
    bucket_count: String,
    /// The filter's CKF format: `v1` (the reference's) or `dense` (format 2).
    #[arg(long, value_name = "FORMAT", default_value = "v1")]
    format: String,
    /// Addressing seed (decimal or 0x-prefixed hex); defaults to the reference seed.
    #[arg(long, value_name = "S")]
    seed: Option<String>,
    /// The 64-bit (canonical sequence) hash, decimal or 0x-prefixed hex.
    #[arg(value_name = "HASH")]
    hash: String,
}

/// The JSON printed by `kvrelay inspect ckf-address`.
#[derive(Debug, Serialize)]
struct CkfAddressOutput {
    fingerprint: u16,
    primary: u32,
    alternate: u32,
}

pub(crate) fn run(args: &CkfAddressArgs) -> Result<()> {
    let bucket_count = parse_u64("bucket count", &args.bucket_count)?;
    let seed = match &args.seed {
        Some(seed) => parse_u64("seed", seed)?,
        None => DEFAULT_CKF_SEED,
    };
    let hash = parse_u64("hash", &args.hash)?;
    let (build, rule): (fn(u64, u32) -> _, _) = match args.format.as_str() {
        "v1" => (CkfFormat::v1, "a power of two in 2..=16777216"),
        "dense" => (CkfFormat::dense, "in 2..=16777216"),
        other => return Err(usage(format!("format {other:?} is not v1 or dense"))),
    };
    let format = u32::try_from(bucket_count)
        .ok()
        .and_then(|bucket_count| build(seed, bucket_count).ok())
        .ok_or_else(|| usage(format!("bucket count {bucket_count} must be {rule}")))?;
    let address = Addressing::new(format).address(hash);
    let output = CkfAddressOutput {
        fingerprint: address.fingerprint,
        primary: address.primary,
        alternate: address.alternate,
    };
    println!("{}", serde_json::to_string(&output)?);
    Ok(())
}

/// Parses decimal or `0x`-prefixed hexadecimal `text` as a `u64`.
fn parse_u64(what: &str, text: &str) -> Result<u64> {
    let trimmed = text.trim();
    let parsed = match trimmed
        .strip_prefix("0x")
        .or_else(|| trimmed.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
        None => trimmed.replace('_', "").parse(),
    };
    parsed.map_err(|_| usage(format!("{what} {text:?} is not a u64 (decimal or 0x hex)")))
}
