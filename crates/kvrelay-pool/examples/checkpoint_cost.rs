//! What a checkpoint costs at a large pool (`cargo xtask bench checkpoint`, after the
//! `publication` criterion bench): a pool actor holding `--blocks` (1 M; 200 k with
//! `--quick`) mappings from 8 sources exports them (the actor applies nothing meanwhile),
//! the checkpoint is encoded, written and synced to a temporary directory, read back,
//! decoded, and restored into a fresh generation. Prints one JSON object of figures
//! (milliseconds, bytes); each step is the median of 5 turns.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark example fails loudly"
)]

use std::io::Write;
use std::time::{Duration, Instant};

use kvrelay_ckf::{EventPayload, RouterEvent, SourceId, StoredBlock, StoredBlocks};
use kvrelay_identity::*;
use kvrelay_pool::{
    AttachRequest, Limits, PoolAttachment, PoolCheckpoint, PoolRegistry, RegistryConfig,
    SourceCheckpoint,
};

const SOURCES: u64 = 8;
const BLOCKS_PER_EVENT: u64 = 64;
const TURNS: usize = 5;

async fn attach(registry: &PoolRegistry, name: &str, blocks: u64) -> PoolAttachment {
    let semantics = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).unwrap();
    let endpoint: EndpointId = format!("prod.{name}.generate").parse().unwrap();
    let domain = resolve_indexer_domain(
        "meta/llama",
        &IndexerIdentitySpec::default(),
        semantics,
        &endpoint,
    );
    registry
        .attach(AttachRequest {
            pool: PoolId {
                indexer_domain: domain,
                dc_id: DcId::from_dc_name("dc-a"),
            },
            endpoint,
            registrations: vec![CanonicalModelRegistration::base(
                CanonicalModelId::new("llama").unwrap(),
                vec![],
            )],
            query_semantics: semantics,
            roles: vec![WorkerRole::Aggregated],
            expected_unique_blocks: blocks,
            filter_density: kvrelay_ckf::FilterDensity::V1,
            load_capacity: None,
            tier_lanes: Vec::new(),
        })
        .await
        .unwrap()
}

fn median(mut samples: Vec<Duration>) -> f64 {
    samples.sort_unstable();
    samples[samples.len() / 2].as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let blocks: u64 = if quick { 200_000 } else { 1_000_000 };
    let registry = PoolRegistry::new(RegistryConfig {
        relay: DcRelayIdentity::new(1, 42),
        limits: Limits::default(),
    })
    .unwrap();
    let live = attach(&registry, "live", blocks).await;
    // Chains of 64 blocks per event, round robin over the sources; distinct hashes.
    let mut next_id = 1u64;
    while next_id <= blocks {
        let source = SourceId::new((next_id / BLOCKS_PER_EVENT) % SOURCES, 0);
        let chain: Vec<StoredBlock> = (next_id..next_id + BLOCKS_PER_EVENT)
            .map(|id| StoredBlock {
                engine_block_id: id,
                token_hash: id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            })
            .collect();
        next_id += BLOCKS_PER_EVENT;
        live.actor
            .submit(RouterEvent {
                source,
                event_id: next_id,
                payload: EventPayload::Stored(StoredBlocks {
                    parent_engine_block_id: None,
                    blocks: chain,
                }),
            })
            .await
            .unwrap();
    }
    live.actor.flush().await.unwrap();
    let resident = live.actor.stats().await.unwrap().filter.resident_blocks;

    let dir = tempfile_dir();
    let path = dir.join("pool.ckpt");
    let (mut export, mut encode, mut write, mut read, mut decode, mut restore) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut file_bytes = 0;
    let mut restored = 0;
    for turn in 0..TURNS {
        let started = Instant::now();
        let exported = live.actor.export_mappings().await.unwrap();
        export.push(started.elapsed());
        let checkpoint = PoolCheckpoint {
            identity: "checkpoint_cost".to_owned(),
            written_unix_ms: 0,
            sources: exported
                .into_iter()
                .map(|s| SourceCheckpoint {
                    source: s.source,
                    last_sequence: 1,
                    last_digest: 0,
                    mappings: s.mappings,
                })
                .collect(),
        };
        let started = Instant::now();
        let bytes = checkpoint.encode().unwrap();
        encode.push(started.elapsed());
        file_bytes = bytes.len();
        let started = Instant::now();
        let tmp = path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp).unwrap();
        file.write_all(&bytes).unwrap();
        file.sync_all().unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        write.push(started.elapsed());
        drop((bytes, checkpoint));
        let started = Instant::now();
        let bytes = std::fs::read(&path).unwrap();
        read.push(started.elapsed());
        let started = Instant::now();
        let decoded = PoolCheckpoint::decode(&bytes).unwrap();
        decode.push(started.elapsed());
        let fresh = attach(&registry, &format!("fresh{turn}"), blocks).await;
        let sources = decoded
            .sources
            .into_iter()
            .map(|s| kvrelay_pool::SourceMappings {
                source: s.source,
                mappings: s.mappings,
            })
            .collect();
        let started = Instant::now();
        restored = fresh.actor.restore(sources).await.unwrap();
        restore.push(started.elapsed());
        registry.detach(fresh).await;
    }
    std::fs::remove_dir_all(&dir).unwrap();
    registry.detach(live).await;
    registry.shutdown().await;
    let export_ms = median(export);
    let figures = serde_json::json!({
        "blocks": blocks,
        "resident_blocks": resident,
        "restored_mappings": restored,
        "file_bytes": file_bytes,
        "bytes_per_mapping": file_bytes as f64 / blocks as f64,
        "export_ms (actor)": export_ms,
        "encode_ms": median(encode),
        "write_fsync_ms": median(write),
        "read_ms": median(read),
        "decode_ms": median(decode),
        "restore_ms (actor)": median(restore),
        "actor_share_at_10s_interval": export_ms / 10_000.0,
    });
    println!("{figures}");
}

/// A fresh directory under the system temp dir.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvrelay-checkpoint-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
