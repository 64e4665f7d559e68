//! From wire messages to the consumer's domain: catalog descriptors to pool entries (with
//! per-entry quarantine), load windows to samples, CBI1 views to `kvrelay-ckf` images.

use kvrelay_codec::v1::{
    CatalogUpdate, HashFormat, LoadWindow, PoolDescriptor, ProducerIdentity, WorkerRole,
};
use kvrelay_identity::{CkfFormat, KvQueryHashFormat};

use crate::catalog::{
    Coverage, PoolEntry, PoolKey, QuarantinedEntry, Registration, Roles, Target, TierLaneEntry,
};
use crate::load::LoadSample;

/// A descriptor that passed validation, ready to be admitted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AdmittedPool {
    pub(crate) producer: ProducerIdentity,
    /// The entry; its `key` and `relay` are assigned when admitted.
    pub(crate) entry: PoolEntry,
}

impl AdmittedPool {
    /// The producer whose stream the pool's replica follows: its format twin if the
    /// consumer adopted one, else the pool's own.
    pub(crate) fn replica_producer(&self) -> &ProducerIdentity {
        self.entry.format_twin.as_ref().unwrap_or(&self.producer)
    }
}

/// A catalog split into admitted entries and quarantined ones.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct ProjectedCatalog {
    pub(crate) admitted: Vec<AdmittedPool>,
    pub(crate) quarantined: Vec<QuarantinedEntry>,
}

/// Why a whole catalog was refused (the envelope cannot be trusted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DuplicatePool {
    pub(crate) pool: String,
}

/// Validates each descriptor on its own: failing ones (unsupported *or* malformed, each
/// still identified by its pool id) are quarantined and the rest admitted. Two entries
/// with one pool id make the envelope untrustworthy: the whole catalog is refused.
pub(crate) fn project_catalog(
    dc: &str,
    update: &CatalogUpdate,
) -> Result<ProjectedCatalog, DuplicatePool> {
    let mut out = ProjectedCatalog::default();
    for (idx, descriptor) in update.pools.iter().enumerate() {
        if update.pools[..idx]
            .iter()
            .any(|other| other.pool_id() == descriptor.pool_id())
        {
            return Err(DuplicatePool {
                pool: descriptor.pool_id().to_string(),
            });
        }
        match project_descriptor(descriptor) {
            Ok(mut entry) => {
                entry.coverage = update
                    .coverage
                    .iter()
                    .find(|coverage| &coverage.pool_id == descriptor.pool_id())
                    .map_or(Coverage::Complete, Coverage::from_wire);
                out.admitted.push(AdmittedPool {
                    producer: descriptor.producer,
                    entry,
                });
            }
            Err(reason) => out.quarantined.push(QuarantinedEntry {
                dc: dc.to_owned(),
                entry: descriptor.pool_id().to_string(),
                reason,
            }),
        }
    }
    Ok(out)
}

/// The domain format of a validated producer (`None` if the wire format is unusable).
pub(crate) fn domain_format(producer: &ProducerIdentity) -> Option<CkfFormat> {
    producer.ckf_format.domain().ok()
}

fn project_descriptor(descriptor: &PoolDescriptor) -> Result<PoolEntry, String> {
    descriptor.validate().map_err(|err| {
        let kind = if err.is_unsupported() {
            "unsupported"
        } else {
            "malformed"
        };
        format!("{kind}: {err}")
    })?;
    if domain_format(&descriptor.producer).is_none() {
        return Err(format!(
            "unsupported: ckf format {:?}",
            descriptor.producer.ckf_format
        ));
    }
    let hash_format = match descriptor.query_semantics.hash_format {
        HashFormat::DynamoStandardV1 => KvQueryHashFormat::DynamoStandardV1,
        HashFormat::DynamoEagleV1 => KvQueryHashFormat::DynamoEagleV1,
        other => return Err(format!("unsupported: hash format {other}")),
    };
    let mut roles = Roles::default();
    for role in &descriptor.pool_roles {
        match role {
            WorkerRole::Prefill => roles.prefill = true,
            WorkerRole::Decode => roles.decode = true,
            WorkerRole::Aggregated | WorkerRole::Legacy => roles.aggregated = true,
            WorkerRole::Encode => {}
            other => return Err(format!("unsupported: role {other}")),
        }
    }
    let registrations = descriptor
        .registrations
        .iter()
        .map(|reg| Registration {
            model: reg.model.clone(),
            target: match &reg.adapter {
                None => Target::Base,
                Some(adapter) => Target::Lora {
                    base_model: reg.base_model.clone(),
                    adapter: adapter.clone(),
                },
            },
            aliases: reg.aliases.clone(),
        })
        .collect();
    let endpoint = &descriptor.serving_endpoint;
    Ok(PoolEntry {
        key: PoolKey(0),
        pool_id: *descriptor.pool_id(),
        format_twin: None,
        relay: 0,
        pool_label: descriptor.pool_id().to_string().into(),
        namespace: endpoint.namespace.clone(),
        endpoint: format!(
            "{}.{}.{}",
            endpoint.namespace, endpoint.component, endpoint.name
        )
        .into(),
        registrations,
        block_size: descriptor.query_semantics.kv_block_size,
        hash_format,
        roles,
        coverage: Coverage::Complete,
        tier_lanes: Vec::new(),
    })
}

/// Whether `update`'s lanes may be used: none, or all valid. A catalog whose lanes break
/// the rules (an unlisted pool, a tier twice, a block size that is not a multiple of the
/// pool's) keeps its pools and loses every lane, with one quarantine entry saying why:
/// pools score as device-only, each in its own format.
pub(crate) fn lanes_usable(dc: &str, update: &CatalogUpdate, out: &mut ProjectedCatalog) -> bool {
    if update.tier_lanes.is_empty() {
        return false;
    }
    match update.validate_tier_lanes() {
        Ok(()) => true,
        Err(err) => {
            out.quarantined.push(QuarantinedEntry {
                dc: dc.to_owned(),
                entry: "tier_lanes".to_owned(),
                reason: format!(
                    "malformed: {err}; pools scored on device memory only, in their own format"
                ),
            });
            false
        }
    }
}

/// Gives each admitted pool the format twin `update` names for it, when the twin is worth
/// following: a device lane (tier 0) of the pool's block size, in a replica format this
/// consumer speaks, whose replica is smaller than the pool's (a dense twin of a v1
/// pool). The pool is then subscribed to through its twin; everything else about it (its
/// load, coverage, lanes, identity in status) stays the pool's. `update`'s lanes must
/// have passed [`lanes_usable`].
pub(crate) fn adopt_format_twins(update: &CatalogUpdate, out: &mut ProjectedCatalog) {
    let device = kvrelay_ckf::CacheTier::Device.code();
    for pool in &mut out.admitted {
        let pool_bytes = crate::budget::replica_bytes(&pool.producer);
        pool.entry.format_twin = update
            .tier_lanes
            .iter()
            .find(|lane| lane.pool_id == pool.producer.pool_id && lane.tier == device)
            .filter(|twin| {
                twin.block_size == pool.entry.block_size
                    && domain_format(&twin.producer).is_some()
                    && crate::budget::replica_bytes(&twin.producer) < pool_bytes
            })
            .map(|twin| twin.producer);
    }
}

/// Attaches to each admitted pool the lanes `update` names for it that this consumer can
/// follow: a known lower tier (host, disk; a newer relay's tiers, and device lanes, which
/// are format twins, are skipped) whose replica format it speaks. `update`'s lanes must
/// have passed [`lanes_usable`].
pub(crate) fn attach_lanes(update: &CatalogUpdate, out: &mut ProjectedCatalog) {
    for pool in &mut out.admitted {
        let pool_id = pool.producer.pool_id;
        let block_size = pool.entry.block_size.max(1);
        let mut lanes: Vec<TierLaneEntry> = update
            .tier_lanes
            .iter()
            .filter(|lane| lane.pool_id == pool_id)
            .filter_map(|lane| {
                let tier = kvrelay_ckf::CacheTier::from_code(lane.tier)
                    .filter(|tier| *tier != kvrelay_ckf::CacheTier::Device)?;
                domain_format(&lane.producer)?;
                Some(TierLaneEntry {
                    tier,
                    stride: lane.block_size / block_size,
                    producer: lane.producer,
                    key: PoolKey(0),
                })
            })
            .collect();
        lanes.sort_by_key(|lane| lane.tier);
        pool.entry.tier_lanes = lanes;
    }
}

/// The load samples of a window, by producer (entries failing validation are skipped).
pub(crate) fn project_load(window: &LoadWindow) -> Vec<(ProducerIdentity, LoadSample)> {
    window
        .pools
        .iter()
        .filter(|pool| pool.validate().is_ok())
        .map(|pool| {
            let sample = match (pool.kv_used_blocks, pool.total_kv_blocks) {
                (Some(used), Some(total)) => LoadSample {
                    kv_used_blocks: used,
                    total_kv_blocks: total,
                    observed_ranks: pool.kv_observed_ranks,
                    expected_ranks: pool.kv_expected_ranks,
                },
                // Partial aggregates are unknown, never zero.
                _ => LoadSample {
                    expected_ranks: pool.kv_expected_ranks,
                    ..LoadSample::default()
                },
            };
            (pool.producer, sample)
        })
        .collect()
}
