//! `kvrelay hash`: block and sequence hashes of a token sequence.
//!
//! Prints one JSON line `{"block_hashes":[..],"sequence_hashes":[..]}` with decimal `u64`s,
//! computed with the reference-compatible hashing of `kvrelay_identity::hashing`.

use std::path::PathBuf;

use anyhow::Result;
use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};
use kvrelay_identity::{KvQueryHashFormat, KvQuerySemantics};
use serde::Serialize;

use crate::usage::usage;

/// Arguments of `kvrelay hash`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["tokens", "tokens_file"])))]
pub(crate) struct HashArgs {
    /// Tokens per KV block (at least 1).
    #[arg(long, value_name = "N")]
    block_size: u32,
    /// Hash format: standard windows, or Eagle windows of block_size + 1 tokens.
    #[arg(long, value_enum, default_value_t = FormatArg::Standard)]
    format: FormatArg,
    /// LoRA adapter name salting the block hashes.
    #[arg(long, value_name = "NAME")]
    lora: Option<String>,
    /// Cache namespace salting the block hashes.
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// Token ids, comma or whitespace separated (e.g. `1,2,3`).
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    tokens: Option<String>,
    /// File of token ids, comma or whitespace separated.
    #[arg(long, value_name = "FILE")]
    tokens_file: Option<PathBuf>,
}

/// The `--format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FormatArg {
    /// `dynamo_standard_v1`.
    Standard,
    /// `dynamo_eagle_v1`.
    Eagle,
}

impl From<FormatArg> for KvQueryHashFormat {
    fn from(format: FormatArg) -> Self {
        match format {
            FormatArg::Standard => Self::DynamoStandardV1,
            FormatArg::Eagle => Self::DynamoEagleV1,
        }
    }
}

/// The JSON printed by `kvrelay hash`.
#[derive(Debug, Serialize)]
struct HashOutput {
    block_hashes: Vec<u64>,
    sequence_hashes: Vec<u64>,
}

pub(crate) fn run(args: &HashArgs) -> Result<()> {
    let semantics = KvQuerySemantics::new(args.block_size, args.format.into())
        .map_err(|err| usage(format!("--block-size: {err}")))?;
    let tokens = match (&args.tokens, &args.tokens_file) {
        (Some(list), _) => parse_tokens(list).map_err(|err| usage(format!("--tokens: {err}")))?,
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|err| {
                usage(format!(
                    "--tokens-file: cannot read {}: {err}",
                    path.display()
                ))
            })?;
            parse_tokens(&text)
                .map_err(|err| usage(format!("--tokens-file {}: {err}", path.display())))?
        }
        (None, None) => return Err(usage("one of --tokens or --tokens-file is required")),
    };
    let salt = HashSalt {
        lora_name: args.lora.as_deref(),
        cache_namespace: args.namespace.as_deref(),
    };
    let blocks = block_hashes(
        &tokens,
        semantics.kv_block_size(),
        semantics.hash_format(),
        salt,
    );
    let output = HashOutput {
        sequence_hashes: sequence_hashes(&blocks),
        block_hashes: blocks,
    };
    println!("{}", serde_json::to_string(&output)?);
    Ok(())
}

/// Parses comma- or whitespace-separated `u32` token ids.
fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|piece| !piece.is_empty())
        .map(|piece| {
            piece
                .parse::<u32>()
                .map_err(|_| format!("token {piece:?} is not a u32 token id"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_on_commas_and_whitespace() {
        assert_eq!(parse_tokens("1,2 3\n4,\t5 "), Ok(vec![1, 2, 3, 4, 5]));
    }

    #[test]
    fn non_numeric_token_names_the_token() {
        assert_eq!(
            parse_tokens("1,x"),
            Err("token \"x\" is not a u32 token id".to_owned())
        );
    }
}
