//! What goes wrong in a pool actor, counted by how bad it is and so who acts on it.

use kvrelay_ckf::SourceId;

use crate::error::PoolFault;

/// How bad a fault is, and so who acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FaultCategory {
    /// The filter could not allocate; nothing changed and a later attempt may succeed.
    Resource,
    /// The source sent an event that contradicts its own history (contradictory block
    /// ids, owner overflow); contradictory ids reset that source.
    SourceProtocol,
    /// The filter's own invariants broke (sequence exhausted); the generation is rebuilt.
    ProducerInvariant,
}

impl FaultCategory {
    /// Every category, in label order.
    pub const ALL: [Self; 3] = [
        Self::Resource,
        Self::SourceProtocol,
        Self::ProducerInvariant,
    ];

    /// The metric label value (`kvrelay_pool_faults_total{category}`).
    pub fn label(self) -> &'static str {
        match self {
            Self::Resource => "resource",
            Self::SourceProtocol => "source_protocol",
            Self::ProducerInvariant => "producer_invariant",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Self::Resource => 0,
            Self::SourceProtocol => 1,
            Self::ProducerInvariant => 2,
        }
    }
}

/// Faults counted by category.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultCounts {
    by_category: [u64; 3],
}

impl FaultCounts {
    /// Faults of `category`.
    pub fn get(&self, category: FaultCategory) -> u64 {
        self.by_category[category.index()]
    }

    /// Faults of every category.
    pub fn total(&self) -> u64 {
        self.by_category.iter().sum()
    }

    pub(super) fn count(&mut self, category: FaultCategory) -> u64 {
        let slot = &mut self.by_category[category.index()];
        *slot = slot.saturating_add(1);
        *slot
    }
}

/// One fault of a pool actor, with the filter's typed error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorFault {
    /// The source whose event or operation failed; `None` for a fault of the pool as a
    /// whole, which no one source sent: a publication, or a format twin's membership log
    /// (the pool's changes from all its sources).
    pub source: Option<SourceId>,
    /// The event's id (0 for source operations and publications).
    pub event_id: u64,
    /// What happened.
    pub fault: PoolFault,
}

impl ActorFault {
    /// How bad it is.
    pub fn category(&self) -> FaultCategory {
        self.fault.category()
    }
}
