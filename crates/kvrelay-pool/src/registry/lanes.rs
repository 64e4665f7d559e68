//! Lower-tier lanes of a pool: what an attach asks for, what it returns, and the checks
//! a request's lanes pass before anything is reserved.

use kvrelay_ckf::{CacheTier, CkfConfig, FilterDensity};
use kvrelay_identity::PoolId;

use kvrelay_identity::ProducerIdentity;

use super::core::Reserved;
use super::{AttachRequest, PoolRegistry};
use crate::actor::PoolActorHandle;
use crate::error::AttachError;
use crate::filter::FilterState;

/// One lane of a pool to attach: a filter of what the pool's workers hold on `tier`.
///
/// A lower tier's lane (host, disk) is fed the tier events the pool's actor resolves and
/// forwards. A **device** lane is the pool's *format twin*: the same blocks as the pool's
/// own filter, in another format (a dense twin of a v1 pool), fed the pool filter's
/// membership log (`kvrelay_ckf::MembershipFilter`: no lineage or owner counts of its
/// own), so consumers that read the other format can follow it while older ones keep the
/// pool's ([`LaneRequest::format_twin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneRequest {
    /// The tier: host or disk, or device for a format twin.
    pub tier: CacheTier,
    /// Filter sizing: expected unique blocks resident on the tier (> 0).
    pub expected_unique_blocks: u64,
    /// Tokens per lane block: a positive multiple of the pool's block size (a twin's is
    /// the pool's).
    pub block_size: u32,
    /// The lane filter's format: v1 for lower tiers; a twin's differs from its pool's.
    pub density: FilterDensity,
}

impl LaneRequest {
    /// The format twin of a pool of `block_size`-token blocks sized for `expected` blocks:
    /// a device lane in `density`.
    pub fn format_twin(
        block_size: u32,
        expected_unique_blocks: u64,
        density: FilterDensity,
    ) -> Self {
        Self {
            tier: CacheTier::Device,
            expected_unique_blocks,
            block_size,
            density,
        }
    }
}

/// An attached lane of a pool generation (retired with it).
#[derive(Debug)]
pub struct LaneAttachment {
    /// The lane's tier.
    pub tier: CacheTier,
    /// The lane's pool id ([`PoolId::tier_lane`]).
    pub pool: PoolId,
    /// Its layout generation.
    pub generation: u64,
    /// The lane's actor (fed by the pool's actor; read its stats and health here).
    pub actor: PoolActorHandle,
}

/// Checks a request's lanes and sizes their filters: each tier at most once, a lower tier
/// with a block size that is a positive multiple of the pool's, a device lane (the format
/// twin) with the pool's block size in a format other than the pool's.
pub(super) fn validate_lanes(
    request: &AttachRequest,
) -> Result<Vec<(LaneRequest, u64)>, AttachError> {
    let pool_block_size = request.query_semantics.kv_block_size();
    let mut lanes = Vec::with_capacity(request.tier_lanes.len());
    for (index, lane) in request.tier_lanes.iter().enumerate() {
        let invalid = |reason| AttachError::InvalidLane {
            pool: request.pool,
            tier: lane.tier,
            reason,
        };
        if lane.tier == CacheTier::Device {
            if lane.density == request.filter_density {
                return Err(invalid(
                    "a device lane is a format twin: its format must differ from the pool's",
                ));
            }
            if lane.block_size != pool_block_size {
                return Err(invalid("a format twin's block size is the pool's"));
            }
        }
        if request.tier_lanes[..index]
            .iter()
            .any(|earlier| earlier.tier == lane.tier)
        {
            return Err(invalid("tier listed twice"));
        }
        if lane.block_size == 0 || lane.block_size % pool_block_size != 0 {
            return Err(invalid(
                "block size is not a positive multiple of the pool's",
            ));
        }
        let lane_pool = request.pool.tier_lane(lane.tier.code());
        let bytes = lane_config(lane)
            .format()
            .map_err(|error| AttachError::Filter {
                pool: lane_pool,
                error,
            })
            .map(|format| u64::from(format.bucket_count()).saturating_mul(8))?;
        lanes.push((*lane, bytes));
    }
    lanes.sort_by_key(|(lane, _)| lane.tier);
    Ok(lanes)
}

/// How a lane's filter is sized.
fn lane_config(lane: &LaneRequest) -> CkfConfig {
    CkfConfig::new(lane.expected_unique_blocks).with_density(lane.density)
}

/// A lane built and named, waiting for its commit.
pub(super) type BuiltLane = (LaneRequest, FilterState, ProducerIdentity, Reserved);

impl PoolRegistry {
    /// Builds each reserved lane's filter and forms its producer identity.
    pub(super) async fn build_lanes(
        &self,
        lanes: &[(LaneRequest, u64)],
        reserved: &[Reserved],
    ) -> Result<Vec<BuiltLane>, AttachError> {
        let mut built = Vec::with_capacity(lanes.len());
        for ((lane, _), reserved) in lanes.iter().zip(reserved) {
            // A format twin is fed its pool's membership log (no exact index of its own);
            // a lower tier's lane is fed events.
            let builder = if lane.tier == CacheTier::Device {
                FilterState::build_twin
            } else {
                FilterState::build
            };
            let state = self
                .build_filter(reserved.pool, lane_config(lane), builder)
                .await?;
            let identity = self.producer_identity(*reserved, &state)?;
            built.push((*lane, state, identity, *reserved));
        }
        Ok(built)
    }

    /// Builds a filter for `expected` blocks with `builder` on a blocking thread, at most
    /// `allocation_concurrency` at once (pools and lanes alike).
    pub(super) async fn build_filter<B>(
        &self,
        pool: PoolId,
        config: kvrelay_ckf::CkfConfig,
        builder: B,
    ) -> Result<FilterState, AttachError>
    where
        B: FnOnce(kvrelay_ckf::CkfConfig) -> Result<FilterState, kvrelay_ckf::ConfigError>
            + Send
            + 'static,
    {
        let permit = self
            .inner
            .allocation
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| AttachError::ShuttingDown)?;
        self.inner
            .tracker
            .spawn_blocking(move || {
                let result = builder(config);
                drop(permit);
                result
            })
            .await
            .map_err(|_| AttachError::FilterTask { pool })?
            .map_err(|error| AttachError::Filter { pool, error })
    }

    /// The producer identity of the reserved generation whose filter is `state`.
    pub(super) fn producer_identity(
        &self,
        reserved: Reserved,
        state: &FilterState,
    ) -> Result<ProducerIdentity, AttachError> {
        ProducerIdentity::new(
            reserved.pool,
            self.relay().relay_incarnation(),
            reserved.generation,
            state.format(),
        )
        .map_err(|error| AttachError::Identity {
            pool: reserved.pool,
            error,
        })
    }
}
