//! Complete load windows: per pool KV occupancy against capacity.

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{DecodeError, EncodeError, decode_body, encode_body};
use super::identity::{ProducerIdentity, RelayIdentity};
use super::validation::{
    CollectionCheck, EntryError, ValidationError, check_collection, first_duplicate,
};
use crate::frame::MessageKind;

/// The load of every pool over one window. Each window replaces the previous one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadWindow {
    /// The relay process.
    pub relay: RelayIdentity,
    /// Strictly increases from window to window (0 is the initial, empty window).
    pub window_sequence: u64,
    /// When the window closed, Unix time in ms (supplied by the relay's clock).
    pub observed_unix_ms: u64,
    /// Window length in ms.
    pub window_ms: u64,
    /// Every pool with a load record.
    pub pools: Vec<PoolLoad>,
}

/// One pool's KV occupancy. Unknown values are `None`, never 0: missing is not idle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolLoad {
    /// The producer generation.
    pub producer: ProducerIdentity,
    /// KV blocks in use, summed over ranks; `None` until every expected rank reported.
    pub kv_used_blocks: Option<u64>,
    /// KV block capacity, summed over ranks; `None` until every rank's capacity is known.
    pub total_kv_blocks: Option<u64>,
    /// Ranks that reported usage.
    pub kv_observed_ranks: u32,
    /// Ranks with a known capacity.
    pub kv_capacity_ranks: u32,
    /// Ranks the pool's workers declare.
    pub kv_expected_ranks: u32,
    /// True when every expected rank reported and every capacity is known.
    pub authoritative: bool,
}

impl PoolLoad {
    /// Checks the producer and that the counters agree.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.producer.validate()?;
        let inconsistent = |detail: String| ValidationError::Inconsistent {
            field: "pool_load",
            detail,
        };
        if self.kv_observed_ranks > self.kv_expected_ranks
            || self.kv_capacity_ranks > self.kv_expected_ranks
        {
            return Err(inconsistent(format!(
                "observed ranks {} or capacity ranks {} exceed expected ranks {}",
                self.kv_observed_ranks, self.kv_capacity_ranks, self.kv_expected_ranks
            )));
        }
        let complete = self.kv_expected_ranks > 0
            && self.kv_observed_ranks == self.kv_expected_ranks
            && self.kv_capacity_ranks == self.kv_expected_ranks
            && self.kv_used_blocks.is_some()
            && self.total_kv_blocks.is_some();
        if self.authoritative && !complete {
            return Err(inconsistent(format!(
                "authoritative with {} of {} ranks observed, {} with capacity",
                self.kv_observed_ranks, self.kv_expected_ranks, self.kv_capacity_ranks
            )));
        }
        Ok(())
    }
}

impl LoadWindow {
    /// Checks every pool and that no producer appears twice. Malformed data fails the
    /// whole window; pools with an unsupported producer are listed for quarantine.
    pub fn validate(&self) -> Result<CollectionCheck, EntryError> {
        let verdict = check_collection("pools", &self.pools, PoolLoad::validate)?;
        let pool_ids = self.pools.iter().map(|pool| &pool.producer.pool_id);
        if let Some((index, pool_id)) = first_duplicate(pool_ids) {
            return Err(EntryError {
                collection: "pools",
                index,
                error: ValidationError::DuplicateEntry {
                    field: "pools",
                    key: pool_id.to_string(),
                },
            });
        }
        Ok(verdict)
    }

    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        encode_body(MessageKind::LoadWindow, self, dst)
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        decode_body(MessageKind::LoadWindow, body, minor)
    }
}
