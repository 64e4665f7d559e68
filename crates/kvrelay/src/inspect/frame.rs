//! `kvrelay inspect frame FILE`: decode one WAN frame file and print it as JSON.
//!
//! Prints one JSON object: `frame` (header fields), `message` (the decoded body; a pool
//! frame's CBI1 payload is summarised: type, checksum, counts, non-empty buckets) and
//! `validation` (`"ok"`, or the error and whether it is merely unsupported). A file that is
//! not exactly one decodable frame is a usage error (exit code 2).

use std::path::PathBuf;

use anyhow::Result;
use kvrelay_codec::cbi1::{self, Cbi1Error, Cbi1Payload};
use kvrelay_codec::frame::{self, RawFrame};
use kvrelay_codec::v1::{
    CollectionCheck, EntryError, Message, PoolFrame, PoolPayload, ValidationError,
};
use kvrelay_codec::{Limits, PROTOCOL_MAJOR};
use serde_json::{Value, json};

use crate::usage::usage;

/// Images listed in full in a delta summary; the rest are only counted.
const LISTED_IMAGES: usize = 8;

/// Arguments of `kvrelay inspect frame`.
#[derive(Debug, clap::Args)]
pub(crate) struct FrameArgs {
    /// A file holding exactly one frame (header and body).
    #[arg(value_name = "FILE")]
    file: PathBuf,
}

pub(crate) fn run(args: &FrameArgs) -> Result<()> {
    let bytes = std::fs::read(&args.file).map_err(|err| {
        usage(format!(
            "cannot read frame file {}: {err}",
            args.file.display()
        ))
    })?;
    let output = describe(&bytes)
        .map_err(|err| usage(format!("frame file {}: {err}", args.file.display())))?;
    println!("{}", serde_json::to_string_pretty(&output)?);
    Ok(())
}

/// The JSON description of one frame, or why the bytes are not one decodable frame.
fn describe(bytes: &[u8]) -> Result<Value, String> {
    let raw =
        frame::decode_frame_exact(bytes, &Limits::default()).map_err(|err| err.to_string())?;
    let message = Message::from_frame(&raw).map_err(|err| err.to_string())?;
    let (body, validation) = match &message {
        Message::StreamRequest(request) => (to_json(request)?, verdict(request.validate())),
        Message::RelayInfo(info) => (to_json(info)?, json!("ok")),
        Message::CatalogUpdate(update) => (to_json(update)?, collection(update.validate())),
        Message::LoadWindow(window) => (to_json(window)?, collection(window.validate())),
        Message::TopologyUpdate(update) => (to_json(update)?, collection(update.validate())),
        Message::Error(error) => (to_json(error)?, verdict(error.validate())),
        Message::PoolFrame(pool) => pool_frame(pool)?,
    };
    Ok(json!({
        "frame": header_json(&raw, bytes.len()),
        "message": body,
        "validation": validation,
    }))
}

fn header_json(raw: &RawFrame, len: usize) -> Value {
    json!({
        "major": PROTOCOL_MAJOR,
        "minor": raw.minor,
        "kind": raw.kind().map(|kind| kind.name()),
        "kind_code": raw.kind_code,
        "len": len,
        "body_len": raw.body.len(),
    })
}

fn pool_frame(pool: &PoolFrame) -> Result<(Value, Value), String> {
    let checked = pool.check(&pool.header.producer);
    let payload = match &checked {
        Ok(PoolPayload::Heartbeat) => json!({ "len": 0 }),
        Ok(PoolPayload::SnapshotChunk(_) | PoolPayload::Delta(_)) | Err(_) => payload_summary(pool),
    };
    let validation = match checked {
        Ok(_) => json!("ok"),
        Err(err) => error_json(&err.to_string(), err.is_unsupported()),
    };
    let message = json!({ "header": to_json(&pool.header)?, "payload": payload });
    Ok((message, validation))
}

/// Summarises the CBI1 payload against the frame's own producer format.
fn payload_summary(pool: &PoolFrame) -> Value {
    let len = pool.payload.len();
    let layout = match pool.header.producer.ckf_format.layout() {
        Ok(layout) => layout,
        Err(err) => return json!({ "len": len, "cbi1_error": err.to_string() }),
    };
    match cbi1::decode_cbi1(&pool.payload, &layout) {
        Ok(Cbi1Payload::Chunk(chunk)) => {
            let non_empty = chunk.words().filter(|word| *word != 0).count();
            let occupied_slots: u32 = chunk.words().map(occupied_slots).sum();
            json!({
                "len": len,
                "type": "snapshot_chunk",
                "checksum_ok": true,
                "dc_id": format!("{:016x}", chunk.header().dc_id),
                "epoch": chunk.header().epoch,
                "chunk_index": chunk.chunk_index(),
                "chunk_count": chunk.chunk_count(),
                "bucket_offset": chunk.bucket_offset(),
                "n_words": chunk.n_words(),
                "non_empty_buckets": non_empty,
                "occupied_slots": occupied_slots,
            })
        }
        Ok(Cbi1Payload::Delta(delta)) => {
            let listed: Vec<Value> = delta
                .images()
                .take(LISTED_IMAGES)
                .map(|image| json!({ "bucket_idx": image.bucket_idx, "word": format!("{:016x}", image.word) }))
                .collect();
            json!({
                "len": len,
                "type": "delta",
                "checksum_ok": true,
                "dc_id": format!("{:016x}", delta.header().dc_id),
                "epoch": delta.header().epoch,
                "base_epoch": delta.base_epoch(),
                "n_images": delta.n_images(),
                "non_empty_buckets": delta.images().filter(|image| image.word != 0).count(),
                "images": listed,
            })
        }
        Err(err) => json!({
            "len": len,
            "checksum_ok": !matches!(err, Cbi1Error::ChecksumMismatch { .. }),
            "cbi1_error": err.to_string(),
        }),
    }
}

/// Non-zero 16-bit slots in a bucket word.
fn occupied_slots(word: u64) -> u32 {
    (0..4)
        .map(|slot| u32::from((word >> (16 * slot)) & 0xffff != 0))
        .sum()
}

fn verdict(result: Result<(), ValidationError>) -> Value {
    match result {
        Ok(()) => json!("ok"),
        Err(err) => error_json(&err.to_string(), err.is_unsupported()),
    }
}

fn collection(result: Result<CollectionCheck, EntryError>) -> Value {
    match result {
        Ok(check) if check.quarantined.is_empty() => json!("ok"),
        Ok(check) => json!({
            "accepted": check.accepted.len(),
            "quarantined": check
                .quarantined
                .iter()
                .map(|entry| json!({ "index": entry.index, "reason": entry.error.to_string() }))
                .collect::<Vec<_>>(),
        }),
        Err(err) => error_json(&err.to_string(), false),
    }
}

fn error_json(message: &str, unsupported: bool) -> Value {
    json!({ "error": message, "unsupported": unsupported })
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<Value, String> {
    serde_json::to_value(value).map_err(|err| err.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use kvrelay_ckf::BucketImage;
    use kvrelay_codec::v1::{
        self, CkfFormat, DigestId, ErrorMessage, ErrorReason, IdentitySource, PoolFrameHeader,
        PoolFrameKind, PoolId, ProducerIdentity, RelayIdentity,
    };

    use super::*;

    fn header() -> PoolFrameHeader {
        let digest = DigestId {
            digest: [7; 16],
            source: IdentitySource::DefaultDerived,
        };
        PoolFrameHeader {
            relay: RelayIdentity {
                drt_instance_id: 1,
                relay_incarnation: 2,
            },
            producer: ProducerIdentity {
                pool_id: PoolId {
                    identity_version: 1,
                    cache_semantics: digest,
                    routing_scope: digest,
                    dc_id: 0xab,
                },
                producer_incarnation: 2,
                layout_generation: 1,
                ckf_format: CkfFormat {
                    format_version: 1,
                    seed: 3,
                    bucket_count: 16,
                    fingerprint_bits: 16,
                    slots_per_bucket: 4,
                },
            },
            base_sequence: 4,
            sequence: 5,
            kind: PoolFrameKind::Delta,
            sent_unix_us: 0,
        }
    }

    #[test]
    fn delta_frame_is_summarised() {
        let images = [
            BucketImage {
                bucket_idx: 2,
                word: 0x0001_0002,
            },
            BucketImage {
                bucket_idx: 9,
                word: 0,
            },
        ];
        let mut bytes = Default::default();
        v1::encode_delta_frame(&header(), &images, &Limits::default(), &mut bytes).unwrap();
        let output = describe(&bytes).unwrap();
        assert_eq!(output["frame"]["kind"], "pool_frame");
        assert_eq!(output["message"]["header"]["kind"], "delta");
        assert_eq!(output["message"]["payload"]["n_images"], 2);
        assert_eq!(output["message"]["payload"]["non_empty_buckets"], 1);
        assert_eq!(output["message"]["payload"]["checksum_ok"], true);
        assert_eq!(output["validation"], "ok");
    }

    #[test]
    fn snapshot_chunk_counts_non_empty_buckets() {
        let mut header = header();
        header.kind = PoolFrameKind::SnapshotChunk;
        header.base_sequence = 5;
        let mut table = [0u64; 16];
        table[3] = 0x0001_0000_0000_0001;
        let mut bytes = Default::default();
        v1::encode_chunk_frame(&header, &table, 0, &Limits::default(), &mut bytes).unwrap();
        let output = describe(&bytes).unwrap();
        assert_eq!(output["message"]["payload"]["non_empty_buckets"], 1);
        assert_eq!(output["message"]["payload"]["occupied_slots"], 2);
    }

    #[test]
    fn corrupted_payload_reports_a_bad_checksum() {
        let mut bytes = Default::default();
        let images = [BucketImage {
            bucket_idx: 2,
            word: 1,
        }];
        v1::encode_delta_frame(&header(), &images, &Limits::default(), &mut bytes).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        let output = describe(&bytes).unwrap();
        assert_eq!(output["message"]["payload"]["checksum_ok"], false);
        assert_eq!(output["validation"]["unsupported"], false);
    }

    #[test]
    fn error_frame_prints_its_reason() {
        let mut bytes = Default::default();
        let message = Message::Error(ErrorMessage::new(
            ErrorReason::SubscriberLagged,
            "queue full",
        ));
        v1::encode_message(&message, &Limits::default(), &mut bytes).unwrap();
        let output = describe(&bytes).unwrap();
        assert_eq!(output["message"]["reason"], "subscriber_lagged");
    }

    #[test]
    fn truncated_file_is_refused() {
        let mut bytes = Default::default();
        let message = Message::Error(ErrorMessage::new(ErrorReason::Internal, "x"));
        v1::encode_message(&message, &Limits::default(), &mut bytes).unwrap();
        assert!(describe(&bytes[..bytes.len() - 1]).is_err());
    }
}
