//! Behaviour of the producer filter: ownership transitions, validation, omissions, resets
//! and publication.

use kvrelay_ckf::{
    ApplyError, CkfConfig, EventPayload, PoolFilter, RemovedBlocks, Replica, RouterEvent, SourceId,
    StoredBlock, StoredBlocks,
};
use kvrelay_identity::hashing::{canonical_child, canonical_root};

const A: SourceId = SourceId::new(1, 0);
const B: SourceId = SourceId::new(2, 0);
const A1: SourceId = SourceId::new(1, 1);

fn stored(source: SourceId, parent: Option<u64>, blocks: &[(u64, u64)]) -> RouterEvent {
    RouterEvent {
        source,
        event_id: 0,
        payload: EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: parent,
            blocks: blocks
                .iter()
                .map(|&(engine_block_id, token_hash)| StoredBlock {
                    engine_block_id,
                    token_hash,
                })
                .collect(),
        }),
    }
}

fn removed(source: SourceId, ids: &[u64]) -> RouterEvent {
    RouterEvent {
        source,
        event_id: 0,
        payload: EventPayload::Removed(RemovedBlocks {
            engine_block_ids: ids.to_vec(),
        }),
    }
}

fn cleared(source: SourceId) -> RouterEvent {
    RouterEvent {
        source,
        event_id: 0,
        payload: EventPayload::AllCleared,
    }
}

fn filter(n: u64) -> PoolFilter {
    PoolFilter::new(CkfConfig::new(n)).unwrap()
}

#[test]
fn stored_chain_is_keyed_by_canonical_sequence_hashes() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(100, 11), (101, 22)])).unwrap();
    f.apply(&stored(A, Some(101), &[(102, 33)])).unwrap();
    let root = canonical_root(11);
    let second = canonical_child(root, 22);
    let third = canonical_child(second, 33);
    assert_eq!(second, 750_553_365_844_651_409);
    assert_eq!(third, 3_257_565_445_809_651_757);
    for (id, canonical) in [(100, root), (101, second), (102, third)] {
        assert_eq!(f.canonical_of(A, id), Some(canonical));
        assert!(f.contains(canonical));
        assert!(f.is_resident(canonical));
    }
}

#[test]
fn different_engine_ids_for_the_same_tokens_share_one_fingerprint() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(5_151_625_331_053_002_286, 7)]))
        .unwrap();
    f.apply(&stored(B, None, &[(16_481_235_979_017_058_908, 7)]))
        .unwrap();
    assert_eq!(f.owner_count(7), 2);
    assert_eq!(f.count_occupied_slots(), 1);
    f.apply(&cleared(A)).unwrap();
    assert!(f.contains(7));
    f.apply(&removed(B, &[16_481_235_979_017_058_908])).unwrap();
    assert!(!f.contains(7));
    assert_eq!(f.count_occupied_slots(), 0);
}

#[test]
fn unknown_removal_is_a_counted_noop() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let before = f.words().to_vec();
    let outcome = f.apply(&removed(A, &[2, 3])).unwrap();
    let outcome_other = f.apply(&removed(B, &[1])).unwrap();
    assert_eq!(outcome.unknown_removals + outcome_other.unknown_removals, 3);
    assert_eq!(f.counters().unknown_removals, 3);
    assert_eq!(f.words(), &before[..]);
    assert!(f.contains(11));
}

#[test]
fn missing_parent_rejects_the_whole_event_unchanged() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let before = f.words().to_vec();
    // The parent exists in another source only: still not found for B.
    let err = f.apply(&stored(B, Some(1), &[(2, 22)])).unwrap_err();
    assert_eq!(
        err,
        ApplyError::ParentNotFound {
            source_id: B,
            parent_engine_block_id: 1
        }
    );
    assert_eq!(f.words(), &before[..]);
    assert_eq!(f.n_mappings(), 1);
    assert_eq!(f.counters().parent_not_found, 1);
    assert_eq!(f.counters().events_rejected, 1);
}

#[test]
fn contradictory_engine_id_rejects_the_whole_event_unchanged() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let before = f.words().to_vec();
    // Block 9 is new, block 1 is remapped to another hash: nothing may be stored.
    let err = f.apply(&stored(A, None, &[(9, 99), (1, 12)])).unwrap_err();
    assert!(matches!(
        err,
        ApplyError::ContradictoryBlockId {
            engine_block_id: 1,
            ..
        }
    ));
    // The same id twice in one batch with different hashes is contradictory too.
    let err = f.apply(&stored(A, None, &[(7, 70), (7, 71)])).unwrap_err();
    assert!(matches!(
        err,
        ApplyError::ContradictoryBlockId {
            engine_block_id: 7,
            ..
        }
    ));
    assert_eq!(f.words(), &before[..]);
    assert_eq!(f.canonical_of(A, 9), None);
    assert_eq!(f.counters().contradictory_block_ids, 2);
}

#[test]
fn reoffer_of_a_known_block_adds_no_owner() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let outcome = f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    assert_eq!(outcome.blocks_reoffered, 1);
    assert_eq!(f.owner_count(11), 1);
    f.apply(&removed(A, &[1])).unwrap();
    assert!(!f.contains(11));
}

#[test]
fn two_engine_ids_of_one_source_for_one_hash_count_twice() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    f.apply(&stored(A, None, &[(2, 11)])).unwrap();
    assert_eq!(f.owner_count(11), 2);
    f.apply(&removed(A, &[1])).unwrap();
    assert!(f.contains(11));
    f.apply(&removed(A, &[2])).unwrap();
    assert!(!f.contains(11));
}

/// Two distinct hashes with the same fingerprint and the same bucket pair.
fn colliding_pair(f: &PoolFilter) -> (u64, u64) {
    let mut seen = std::collections::HashMap::new();
    for hash in 0u64.. {
        let a = f.address(hash);
        let key = (a.fingerprint, a.primary.min(a.alternate));
        if let Some(&other) = seen.get(&key) {
            return (other, hash);
        }
        seen.insert(key, hash);
    }
    unreachable!()
}

#[test]
fn colliding_hashes_stay_visible_until_both_are_removed() {
    // spec: colliding hashes stay visible until both are removed
    let mut f = filter(1);
    let (x, y) = colliding_pair(&f);
    f.apply(&stored(A, None, &[(1, x)])).unwrap();
    f.apply(&stored(B, None, &[(2, y)])).unwrap();
    assert_eq!(f.count_occupied_slots(), 2);
    f.apply(&removed(A, &[1])).unwrap();
    assert!(f.contains(y) && f.contains(x), "one copy remains for y");
    f.apply(&removed(B, &[2])).unwrap();
    assert!(!f.contains(y));
    assert_eq!(f.count_occupied_slots(), 0);
}

#[test]
fn capacity_omission_keeps_ownership_and_is_readmitted_later() {
    // 2 buckets × 4 slots: the ninth distinct hash cannot fit.
    let mut f = filter(1);
    let blocks: Vec<(u64, u64)> = (0..9).map(|i| (i, 1000 + i)).collect();
    let mut omitted = 0;
    for &block in &blocks {
        omitted += f
            .apply(&stored(A, None, &[block]))
            .unwrap()
            .capacity_omissions;
    }
    assert_eq!(omitted, 1);
    assert_eq!(f.counters().capacity_omissions, 1);
    assert_eq!(f.n_mappings(), 9);
    let lost: Vec<u64> = f.omitted_canonicals().collect();
    assert_eq!(lost.len(), 1);
    let lost_id = lost[0] - 1000;
    assert!(!f.is_resident(lost[0]));
    assert_eq!(f.owner_count(lost[0]), 1);
    // A re-offer while still full misses without counting another omission.
    f.apply(&stored(A, None, &[(lost_id, lost[0])])).unwrap();
    assert_eq!(f.counters().capacity_omissions, 1);
    assert_eq!(f.counters().reoffer_misses, 1);
    // Free a slot in one of its buckets, then re-offer: admitted without relocation.
    let address = f.address(lost[0]);
    let victim = blocks
        .iter()
        .find(|&&(_, hash)| {
            let a = f.address(hash);
            hash != lost[0] && (a.primary == address.primary || a.alternate == address.primary)
        })
        .unwrap();
    f.apply(&removed(A, &[victim.0])).unwrap();
    f.apply(&stored(A, None, &[(lost_id, lost[0])])).unwrap();
    assert!(f.is_resident(lost[0]));
    assert!(f.contains(lost[0]));
    assert_eq!(f.counters().late_admissions, 1);
}

#[test]
fn removing_an_omitted_hash_touches_no_fingerprint() {
    let mut f = filter(1);
    for i in 0..9u64 {
        f.apply(&stored(A, None, &[(i, 1000 + i)])).unwrap();
    }
    let lost = f.omitted_canonicals().next().unwrap();
    let before = f.words().to_vec();
    f.apply(&removed(A, &[lost - 1000])).unwrap();
    assert_eq!(f.words(), &before[..]);
    assert_eq!(f.counters().invariant_violations, 0);
}

#[test]
fn clearing_one_rank_keeps_sibling_ranks_and_shared_hashes() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11), (2, 22)])).unwrap();
    f.apply(&stored(A1, None, &[(1, 11)])).unwrap();
    f.apply(&cleared(A)).unwrap();
    assert!(f.contains(11));
    assert!(!f.contains(canonical_child(11, 22)));
    assert_eq!(f.sources().collect::<Vec<_>>(), vec![A1]);
    f.apply(&stored(A, None, &[(3, 33)])).unwrap();
    f.remove_worker(1).unwrap();
    assert_eq!(f.n_mappings(), 0);
    assert_eq!(f.count_occupied_slots(), 0);
}

#[test]
fn reset_source_replaces_its_blocks_without_touching_kept_hashes() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11), (2, 22)])).unwrap();
    f.apply(&stored(B, None, &[(9, 99)])).unwrap();
    f.take_delta().unwrap();
    let kept = canonical_root(11);
    let dropped = canonical_child(kept, 22);
    let chains = [
        StoredBlocks {
            parent_engine_block_id: None,
            blocks: vec![StoredBlock {
                engine_block_id: 1,
                token_hash: 11,
            }],
        },
        StoredBlocks {
            parent_engine_block_id: Some(1),
            blocks: vec![StoredBlock {
                engine_block_id: 3,
                token_hash: 33,
            }],
        },
    ];
    let outcome = f.reset_source(A, &chains).unwrap();
    assert_eq!(outcome.fingerprints_inserted, 1);
    assert_eq!(outcome.fingerprints_removed, 1);
    assert!(f.contains(kept) && !f.contains(dropped));
    assert!(f.contains(canonical_child(kept, 33)));
    assert!(f.contains(99));
    assert_eq!(f.canonical_of(A, 2), None);
}

#[test]
fn reset_source_with_a_bad_dump_changes_nothing() {
    let mut f = filter(64);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let before = f.words().to_vec();
    let chains = [StoredBlocks {
        parent_engine_block_id: Some(1), // only in the old lineage, not in the dump
        blocks: vec![StoredBlock {
            engine_block_id: 2,
            token_hash: 22,
        }],
    }];
    assert!(matches!(
        f.reset_source(A, &chains),
        Err(ApplyError::ParentNotFound { .. })
    ));
    assert_eq!(f.words(), &before[..]);
    assert_eq!(f.canonical_of(A, 1), Some(11));
}

#[test]
fn deltas_are_sequenced_and_never_empty() {
    let mut f = filter(64);
    assert_eq!(f.take_delta().unwrap(), None);
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let first = f.take_delta().unwrap().unwrap();
    assert_eq!((first.base_sequence, first.sequence), (0, 1));
    // Store then remove inside one window: the bucket reverts, no delta, no sequence.
    f.apply(&stored(A, None, &[(2, 22)])).unwrap();
    f.apply(&removed(A, &[2])).unwrap();
    assert_eq!(f.take_delta().unwrap(), None);
    assert_eq!(f.sequence(), 1);
    assert_eq!(f.counters().net_reverted_buckets, 1);
    // A final remove publishes the absolute (possibly zero) word.
    f.apply(&removed(A, &[1])).unwrap();
    let last = f.take_delta().unwrap().unwrap();
    assert_eq!((last.base_sequence, last.sequence), (1, 2));
    assert!(last.images.iter().all(|image| image.word == 0));
}

#[test]
fn barrier_snapshot_publishes_the_tail_first_and_deltas_follow_it() {
    let mut f = filter(256);
    let mut old = Replica::new(f.format()).unwrap();
    for chunk in f.snapshot().unwrap().chunks {
        old.install_chunk(&chunk).unwrap();
    }
    f.apply(&stored(A, None, &[(1, 11)])).unwrap();
    let barrier = f
        .snapshot_with_chunk_buckets(std::num::NonZeroU32::new(16).unwrap())
        .unwrap();
    let tail = barrier.tail.unwrap();
    assert_eq!((tail.base_sequence, tail.sequence), (0, 1));
    assert_eq!(barrier.chunks.len(), 8);
    assert!(barrier.chunks.iter().all(|c| c.sequence == 1));
    old.apply_delta(&tail).unwrap();
    let mut new = Replica::new(f.format()).unwrap();
    for chunk in &barrier.chunks {
        new.install_chunk(chunk).unwrap();
    }
    f.apply(&stored(A, Some(1), &[(2, 22)])).unwrap();
    let next = f.take_delta().unwrap().unwrap();
    old.apply_delta(&next).unwrap();
    new.apply_delta(&next).unwrap();
    assert_eq!(old.words().unwrap(), f.words());
    assert_eq!(new.words().unwrap(), f.words());
}
