//! Replica behaviour: chunk assembly checks and strict delta sequencing.

use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};

use super::*;
use crate::image::BucketImage;

fn format(bucket_count: u32) -> CkfFormat {
    CkfFormat::v1(DEFAULT_CKF_SEED, bucket_count).unwrap()
}

fn chunk(sequence: u64, index: u32, count: u32, first: u64, words: Vec<u64>) -> SnapshotChunk {
    SnapshotChunk {
        sequence,
        bucket_count: 8,
        chunk_index: index,
        chunk_count: count,
        first_bucket: first,
        words,
    }
}

fn ready_replica() -> Replica {
    let mut replica = Replica::new(format(8)).unwrap();
    assert_eq!(
        replica.install_chunk(&chunk(5, 0, 2, 0, vec![1; 4])),
        Ok(false)
    );
    assert_eq!(replica.status(), ReplicaStatus::Assembling { sequence: 5 });
    assert_eq!(replica.words(), None);
    assert_eq!(
        replica.install_chunk(&chunk(5, 1, 2, 4, vec![2; 4])),
        Ok(true)
    );
    assert_eq!(replica.status(), ReplicaStatus::Ready { sequence: 5 });
    replica
}

fn delta(base: u64, images: &[(u32, u64)]) -> Delta {
    Delta {
        base_sequence: base,
        sequence: base + 1,
        images: images
            .iter()
            .map(|&(bucket_idx, word)| BucketImage { bucket_idx, word })
            .collect(),
    }
}

/// Applies `bad` to a ready replica and checks it is refused, marks the replica invalid
/// and writes nothing.
fn check_delta_refused(bad: Delta) {
    let mut replica = ready_replica();
    let before = replica.words.clone();
    assert!(replica.apply_delta(&bad).is_err(), "{bad:?}");
    assert_eq!(replica.status(), ReplicaStatus::Invalid);
    assert_eq!(replica.words, before);
    assert_eq!(replica.words(), None);
}

#[test]
fn snapshot_then_contiguous_deltas_apply() {
    let mut replica = ready_replica();
    replica.apply_delta(&delta(5, &[(0, 9), (7, 0)])).unwrap();
    replica.apply_delta(&delta(6, &[(3, 4)])).unwrap();
    assert_eq!(replica.status(), ReplicaStatus::Ready { sequence: 7 });
    assert_eq!(replica.words().unwrap(), &[9, 1, 1, 4, 2, 2, 2, 0]);
}

#[test]
fn out_of_order_or_malformed_deltas_invalidate_without_writing() {
    check_delta_refused(delta(6, &[(0, 9)])); // gap
    check_delta_refused(delta(4, &[(0, 9)])); // stale
    check_delta_refused(Delta {
        base_sequence: 5,
        sequence: 5,
        images: vec![BucketImage {
            bucket_idx: 0,
            word: 9,
        }],
    }); // does not advance
    check_delta_refused(delta(5, &[])); // empty
    check_delta_refused(delta(5, &[(0, 9), (8, 1)])); // out of range, first image valid
    check_delta_refused(delta(5, &[(3, 9), (1, 1), (3, 2)])); // repeated bucket
}

#[test]
fn a_coalesced_delta_spanning_several_sequences_is_accepted() {
    let mut replica = ready_replica();
    replica
        .apply_delta(&Delta {
            base_sequence: 5,
            sequence: 9,
            images: vec![BucketImage {
                bucket_idx: 2,
                word: 4,
            }],
        })
        .unwrap();
    assert_eq!(replica.status(), ReplicaStatus::Ready { sequence: 9 });
    assert_eq!(replica.words().unwrap()[2], 4);
}

#[test]
fn unsorted_distinct_images_are_accepted() {
    let mut replica = ready_replica();
    replica.apply_delta(&delta(5, &[(6, 3), (1, 4)])).unwrap();
    assert_eq!(replica.words().unwrap()[6], 3);
}

#[test]
fn delta_before_snapshot_is_refused() {
    let mut replica = Replica::new(format(8)).unwrap();
    assert_eq!(
        replica.apply_delta(&delta(0, &[(0, 1)])),
        Err(ReplicaError::NotReady {
            base_sequence: 0,
            sequence: 1
        })
    );
    assert_eq!(replica.status(), ReplicaStatus::Invalid);
}

#[test]
fn invalid_replica_recovers_only_through_a_new_snapshot() {
    let mut replica = ready_replica();
    assert!(replica.apply_delta(&delta(9, &[(0, 1)])).is_err());
    assert!(replica.apply_delta(&delta(5, &[(0, 1)])).is_err());
    replica
        .install_chunk(&chunk(9, 0, 1, 0, vec![3; 8]))
        .unwrap();
    replica.apply_delta(&delta(9, &[(0, 1)])).unwrap();
    assert_eq!(replica.status(), ReplicaStatus::Ready { sequence: 10 });
}

#[test]
fn chunk_assembly_checks_refuse_and_invalidate() {
    let cases = [
        // Wrong bucket count.
        vec![SnapshotChunk {
            bucket_count: 16,
            ..chunk(1, 0, 1, 0, vec![0; 8])
        }],
        // Index not below count; zero count; more chunks than buckets (each chunk holds
        // at least one bucket, so such a snapshot could only assemble forever).
        vec![chunk(1, 1, 1, 0, vec![0; 8])],
        vec![chunk(1, 0, 0, 0, vec![0; 8])],
        vec![chunk(1, 0, 9, 0, vec![0; 1])],
        vec![chunk(1, 0, u32::MAX, 0, vec![0; 1])],
        // Empty chunk, chunk past the end.
        vec![chunk(1, 0, 2, 0, vec![])],
        vec![chunk(1, 0, 1, 4, vec![0; 8])],
        // Chunk 0 must start at bucket 0.
        vec![chunk(1, 0, 2, 2, vec![0; 4])],
        // Skipped index, changed count, changed sequence, gap in buckets.
        vec![chunk(1, 0, 3, 0, vec![0; 3]), chunk(1, 2, 3, 3, vec![0; 3])],
        vec![chunk(1, 0, 2, 0, vec![0; 4]), chunk(1, 1, 3, 4, vec![0; 4])],
        vec![chunk(1, 0, 2, 0, vec![0; 4]), chunk(2, 1, 2, 4, vec![0; 4])],
        vec![chunk(1, 0, 2, 0, vec![0; 4]), chunk(1, 1, 2, 5, vec![0; 3])],
        // Last chunk short of full coverage.
        vec![chunk(1, 0, 2, 0, vec![0; 4]), chunk(1, 1, 2, 4, vec![0; 3])],
        // Later chunk with no assembly in progress.
        vec![chunk(1, 1, 2, 4, vec![0; 4])],
    ];
    for chunks in cases {
        let mut replica = Replica::new(format(8)).unwrap();
        let (last, head) = chunks.split_last().unwrap();
        for chunk in head {
            replica.install_chunk(chunk).unwrap();
        }
        assert!(replica.install_chunk(last).is_err(), "{chunks:?}");
        assert_eq!(replica.status(), ReplicaStatus::Invalid, "{chunks:?}");
    }
}

#[test]
fn replica_serves_its_own_snapshot() {
    let replica = ready_replica();
    let chunks = replica
        .snapshot(NonZeroU32::new(3).unwrap())
        .unwrap()
        .unwrap();
    let mut copy = Replica::new(format(8)).unwrap();
    for chunk in &chunks {
        copy.install_chunk(chunk).unwrap();
    }
    assert_eq!(copy.words(), replica.words());
    assert_eq!(copy.status(), replica.status());
}
