//! The per-relay replica memory budget: which validated catalog entries fit.
//!
//! A replica takes one 64-bit word per bucket of its producer's filter, so an entry costs
//! `bucket_count × 8` bytes. [`admit_within`] admits a relay's entries while their sum
//! stays within [`crate::Limits::max_replica_bytes_per_relay`] and quarantines the rest.
//! Entries the relay's previous catalog admitted go first (so a new entry never evicts a
//! working replica), then new ones, each group in catalog order. The outcome depends
//! only on the catalog and on what was admitted before, and a repeated catalog gives the
//! same outcome and the same reasons (so a heartbeat revision still compares equal).

use kvrelay_codec::v1::ProducerIdentity;

use crate::catalog::QuarantinedEntry;
use crate::projection::ProjectedCatalog;

/// Bytes of bucket words a replica of `producer` needs.
pub(crate) fn replica_bytes(producer: &ProducerIdentity) -> u64 {
    producer.ckf_format.bucket_count.saturating_mul(8)
}

/// Moves the entries of `projected.admitted` that do not fit in `budget` bytes to
/// `projected.quarantined` (after the entries quarantined by validation, in catalog
/// order); `was_admitted` tells which producers the relay's previous catalog admitted.
/// Returns how many entries were over budget.
pub(crate) fn admit_within(
    projected: &mut ProjectedCatalog,
    dc: &str,
    budget: u64,
    was_admitted: impl Fn(&ProducerIdentity) -> bool,
) -> usize {
    let mut fits = vec![false; projected.admitted.len()];
    let mut taken = 0u64;
    for kept_first in [true, false] {
        for (idx, pool) in projected.admitted.iter().enumerate() {
            if was_admitted(&pool.producer) != kept_first {
                continue;
            }
            let bytes = replica_bytes(pool.replica_producer());
            if let Some(total) = taken.checked_add(bytes)
                && total <= budget
            {
                taken = total;
                fits[idx] = true;
            }
        }
    }
    let n_over = fits.iter().filter(|fit| !**fit).count();
    if n_over == 0 {
        return 0;
    }
    let admitted = std::mem::take(&mut projected.admitted);
    for (pool, fit) in admitted.into_iter().zip(fits) {
        if fit {
            projected.admitted.push(pool);
            continue;
        }
        let replica = pool.replica_producer();
        let bucket_count = replica.ckf_format.bucket_count;
        projected.quarantined.push(QuarantinedEntry {
            dc: dc.to_owned(),
            entry: pool.entry.pool_label.to_string(),
            reason: format!(
                "over budget: replica of {bucket_count} buckets needs {} bytes, more than \
                 remains of max_replica_bytes_per_relay {budget}",
                replica_bytes(replica)
            ),
        });
    }
    n_over
}

/// Drops the lanes of admitted pools that do not fit in what `budget` leaves after the
/// pools themselves (lanes never displace a pool), in catalog order, each named in
/// `projected.quarantined`. Returns how many lanes were dropped.
pub(crate) fn admit_lanes_within(projected: &mut ProjectedCatalog, dc: &str, budget: u64) -> usize {
    let mut taken = projected
        .admitted
        .iter()
        .map(|pool| replica_bytes(pool.replica_producer()))
        .fold(0u64, u64::saturating_add);
    let mut dropped = Vec::new();
    for pool in &mut projected.admitted {
        pool.entry.tier_lanes.retain(|lane| {
            let bytes = replica_bytes(&lane.producer);
            match taken.checked_add(bytes) {
                Some(total) if total <= budget => {
                    taken = total;
                    true
                }
                _ => {
                    dropped.push(QuarantinedEntry {
                        dc: dc.to_owned(),
                        entry: format!("{} {} lane", pool.entry.pool_label, lane.tier),
                        reason: format!(
                            "over budget: lane replica needs {bytes} bytes, more than remains \
                             of max_replica_bytes_per_relay {budget}"
                        ),
                    });
                    false
                }
            }
        });
    }
    let n_dropped = dropped.len();
    projected.quarantined.extend(dropped);
    n_dropped
}
