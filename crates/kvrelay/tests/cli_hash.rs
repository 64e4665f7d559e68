//! `kvrelay hash`, `kvrelay inspect dc-id` and `kvrelay inspect ckf-address` run as a
//! binary against the reference vectors, and reject bad input with exit code 2.

use std::io::Write;
use std::process::{Command, Output};

use serde::Deserialize;
use serde_json::Value;

const HASHING_JSON: &str = include_str!("../../kvrelay-identity/tests/vectors/hashing.json");

#[derive(Deserialize)]
struct Vectors {
    hashing: Vec<HashingVector>,
    dc_id: Vec<DcIdVector>,
}

#[derive(Deserialize)]
struct HashingVector {
    tokens: Vec<u32>,
    block_size: u32,
    format: String,
    lora: Option<String>,
    namespace: Option<String>,
    block_hashes: Vec<u64>,
    sequence_hashes: Vec<u64>,
}

#[derive(Deserialize)]
struct DcIdVector {
    text: String,
    dc_id: u64,
}

fn vectors() -> Vectors {
    serde_json::from_str(HASHING_JSON).unwrap()
}

fn kvrelay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .output()
        .expect("run kvrelay")
}

/// Runs a successful command and parses its single stdout line as JSON.
fn json_line(args: &[&str]) -> Value {
    let output = kvrelay(args);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "kvrelay {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "stdout {stdout:?}");
    serde_json::from_str(&stdout).unwrap()
}

fn hash_args(vector: &HashingVector, tokens: &str) -> Vec<String> {
    let mut args = vec![
        "hash".to_owned(),
        "--block-size".to_owned(),
        vector.block_size.to_string(),
        "--format".to_owned(),
        vector.format.clone(),
        "--tokens".to_owned(),
        tokens.to_owned(),
    ];
    if let Some(lora) = &vector.lora {
        args.extend(["--lora".to_owned(), lora.clone()]);
    }
    if let Some(namespace) = &vector.namespace {
        args.extend(["--namespace".to_owned(), namespace.clone()]);
    }
    args
}

fn expected_json(vector: &HashingVector) -> Value {
    serde_json::json!({
        "block_hashes": vector.block_hashes,
        "sequence_hashes": vector.sequence_hashes,
    })
}

/// Asserts a command fails with exit code 2 and a one-line error on stderr.
fn assert_usage_error(args: &[&str], expected_fragment: &str) {
    let output = kvrelay(args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "kvrelay {args:?}: {stderr}");
    assert!(
        output.stdout.is_empty(),
        "kvrelay {args:?} printed to stdout"
    );
    assert_eq!(stderr.lines().count(), 1, "stderr {stderr:?}");
    assert!(stderr.contains(expected_fragment), "stderr {stderr:?}");
}

#[test]
fn hash_reproduces_every_vector() {
    for vector in vectors().hashing {
        let tokens: Vec<String> = vector.tokens.iter().map(u32::to_string).collect();
        let args = hash_args(&vector, &tokens.join(","));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(json_line(&args), expected_json(&vector), "args {args:?}");
    }
}

#[test]
fn hash_reads_a_whitespace_and_comma_separated_tokens_file() {
    let vector = vectors().hashing.into_iter().nth(2).unwrap();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    for (idx, token) in vector.tokens.iter().enumerate() {
        let separator = if idx % 3 == 0 {
            "\n"
        } else if idx % 2 == 0 {
            ", "
        } else {
            " "
        };
        write!(file, "{token}{separator}").unwrap();
    }
    let mut args = hash_args(&vector, "");
    // Swap `--tokens ""` for `--tokens-file <path>`.
    let at = args.iter().position(|arg| arg == "--tokens").unwrap();
    args[at] = "--tokens-file".to_owned();
    args[at + 1] = file.path().display().to_string();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_eq!(json_line(&args), expected_json(&vector));
}

#[test]
fn hash_defaults_to_the_standard_format() {
    let value = json_line(&["hash", "--block-size", "4", "--tokens", "0,1,2,3,4,5,6,7"]);
    let first = &vectors().hashing[0];
    assert_eq!(value, expected_json(first));
}

#[test]
fn hash_of_fewer_tokens_than_a_block_is_empty() {
    let value = json_line(&["hash", "--block-size", "4", "--tokens", "1,2,3"]);
    assert_eq!(
        value,
        serde_json::json!({"block_hashes": [], "sequence_hashes": []})
    );
}

#[test]
fn inspect_dc_id_reproduces_every_vector() {
    for vector in vectors().dc_id {
        let value = json_line(&["inspect", "dc-id", &vector.text]);
        assert_eq!(value["dc_id"], serde_json::json!(vector.dc_id));
        assert_eq!(
            value["hex"],
            serde_json::json!(format!("{:016x}", vector.dc_id))
        );
    }
}

#[test]
fn inspect_dc_id_prints_the_documented_example() {
    assert_eq!(
        json_line(&["inspect", "dc-id", "dc-a"]),
        serde_json::json!({"dc_id": 356_084_303_347_317_832_u64, "hex": "04f110c98b1bfc48"})
    );
}

#[test]
fn zero_block_size_exits_with_code_2() {
    assert_usage_error(
        &["hash", "--block-size", "0", "--tokens", "1"],
        "block size",
    );
}

#[test]
fn non_numeric_token_exits_with_code_2() {
    assert_usage_error(&["hash", "--block-size", "4", "--tokens", "1,x"], "\"x\"");
}

#[test]
fn token_above_u32_exits_with_code_2() {
    assert_usage_error(
        &["hash", "--block-size", "4", "--tokens", "4294967296"],
        "4294967296",
    );
}

#[test]
fn missing_tokens_file_exits_with_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.txt");
    let path = path.display().to_string();
    assert_usage_error(
        &["hash", "--block-size", "4", "--tokens-file", &path],
        &path,
    );
}

#[test]
fn bad_tokens_file_content_exits_with_code_2() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "1 2 three").unwrap();
    let path = file.path().display().to_string();
    assert_usage_error(
        &["hash", "--block-size", "4", "--tokens-file", &path],
        "\"three\"",
    );
}

#[test]
fn empty_dc_id_text_exits_with_code_2() {
    assert_usage_error(&["inspect", "dc-id", ""], "dc-id");
}

#[test]
fn unknown_format_exits_with_code_2() {
    let output = kvrelay(&[
        "hash",
        "--block-size",
        "4",
        "--format",
        "foo",
        "--tokens",
        "1",
    ]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn hash_without_tokens_exits_with_code_2() {
    let output = kvrelay(&["hash", "--block-size", "4"]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn ckf_address_prints_v1_and_dense_addresses_and_refuses_bad_counts() {
    // The worked example of docs/ckf.md (format 1, default seed).
    let v1 = json_line(&["inspect", "ckf-address", "--bucket-count", "524288", "11"]);
    assert_eq!(
        v1,
        serde_json::json!({"fingerprint": 0xD6F8, "primary": 410_005, "alternate": 65_990})
    );
    let dense = json_line(&[
        "inspect",
        "ckf-address",
        "--format",
        "dense",
        "--bucket-count",
        "263158",
        "11",
    ]);
    // Same fingerprint, the dense format's own buckets, each the other's alternate.
    assert_eq!(dense["fingerprint"], 0xD6F8);
    let (primary, alternate) = (
        dense["primary"].as_u64().unwrap(),
        dense["alternate"].as_u64().unwrap(),
    );
    assert!(primary < 263_158 && alternate < 263_158, "{dense}");
    assert_ne!((primary, alternate), (410_005, 65_990));
    assert_usage_error(
        &["inspect", "ckf-address", "--bucket-count", "263158", "11"],
        "a power of two",
    );
    assert_usage_error(
        &[
            "inspect",
            "ckf-address",
            "--format",
            "sparse",
            "--bucket-count",
            "8",
            "11",
        ],
        "not v1 or dense",
    );
}
