//! Scoring past the device: a pool's prefix continued in its lower-tier lanes (host
//! memory, then disk), and the tokens a request is credited for at the tiers' weights.

use std::time::Instant;

use crate::catalog::PoolEntry;
use crate::scoring::{DepthProbe, ReplicaDepth, ReplicaState, prefix_tokens};
use crate::store::ProbeScratch;
use crate::weights::ScoreWeights;

/// Blocks found past `device` in each of `entry`'s lanes, in tier order: a lane of stride
/// `k` holds every `k`-th prefix position, so it is probed from the chunk holding the
/// first block the device lacks, one hash per chunk; whatever it finds extends the reach
/// the next tier continues from. A lane that cannot answer finds nothing (`None`).
pub(crate) fn continue_in_lanes(
    entry: &PoolEntry,
    device: u32,
    hashes: &[u64],
    now: Instant,
    depths: &dyn DepthProbe,
    strided: &mut Vec<u64>,
    probe: &mut ProbeScratch,
) -> [Option<u32>; 2] {
    let mut found = [None; 2];
    let mut reached = device;
    for lane in &entry.tier_lanes {
        let Some(slot) = tier_slot(lane.tier) else {
            continue;
        };
        let stride = lane.stride.max(1) as usize;
        let first_chunk = reached as usize / stride;
        strided.clear();
        strided.extend(
            hashes
                .iter()
                .skip((first_chunk + 1) * stride - 1)
                .step_by(stride),
        );
        let mut out = [ReplicaDepth::Unusable(ReplicaState::Missing)];
        depths.probe(&[lane.key], strided, now, &mut out, probe);
        let ReplicaDepth::Current(chunks) = out[0] else {
            continue;
        };
        let continued = u32::try_from((first_chunk + chunks as usize) * stride).unwrap_or(u32::MAX);
        let gained = continued.saturating_sub(reached);
        found[slot] = Some(gained);
        reached += gained;
    }
    found
}

/// Where a lower tier's blocks are kept per entry (`None` for the device).
fn tier_slot(tier: kvrelay_ckf::CacheTier) -> Option<usize> {
    match tier {
        kvrelay_ckf::CacheTier::Device => None,
        kvrelay_ckf::CacheTier::Host => Some(0),
        kvrelay_ckf::CacheTier::Disk => Some(1),
    }
}

/// The prefix `entry` holds for a request of `n_tokens` tokens, in tokens credited:
/// device tokens count whole, host and disk tokens (past the device prefix, clamped to
/// the prompt) at their tier weights. `None` when the device replica cannot answer.
pub(crate) fn credited_tokens(
    entry: &PoolEntry,
    depth: ReplicaDepth,
    lower: [Option<u32>; 2],
    weights: &ScoreWeights,
    n_tokens: usize,
) -> Option<f64> {
    let device = prefix_tokens(entry, depth, n_tokens)?;
    let n_tokens = u32::try_from(n_tokens).unwrap_or(u32::MAX);
    let mut blocks = match depth {
        ReplicaDepth::Current(blocks) => blocks,
        ReplicaDepth::Unusable(_) => 0,
    };
    let mut counted = device;
    let mut credited = f64::from(device);
    for (found, weight) in lower
        .into_iter()
        .zip([weights.host_tier, weights.disk_tier])
    {
        blocks = blocks.saturating_add(found.unwrap_or(0));
        let reach = blocks.saturating_mul(entry.block_size).min(n_tokens);
        credited += weight * f64::from(reach.saturating_sub(counted));
        counted = counted.max(reach);
    }
    Some(credited)
}
