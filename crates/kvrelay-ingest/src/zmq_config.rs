//! What a ZMQ source is told: where its publisher is, what it sends, the pool's hashing
//! rules, its bounds and the byte budget it shares, and (tests) which faults to suffer.
//! [`crate::spawn_zmq_source`] runs it.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::canonical::CanonicalConfig;
use crate::engine::EngineKind;
use crate::limits::Limits;
use crate::metered::QueueBudget;
use crate::sequence::ResumePoint;

/// Where and how to subscribe to one engine publisher (one DP rank's PUB socket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqSourceConfig {
    /// The worker the publisher belongs to.
    pub worker_id: u64,
    /// The rank used when a batch names none.
    pub dp_rank: u32,
    /// The ranks the source's card declares (`data_parallel_start_rank` ..
    /// `+data_parallel_size`); batches naming any other rank are rejected and counted.
    pub declared_ranks: Range<u32>,
    /// What the publisher sends: an engine's batches, or Dynamo's event plane.
    pub wire: ZmqWire,
    /// The PUB endpoint to connect to, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The ROUTER replay endpoint, if the engine has one, e.g. `tcp://10.0.0.5:5558`.
    pub replay_endpoint: Option<String>,
    /// The subscription topic prefix (`""` for all).
    pub topic: String,
    /// The pool's hashing rules.
    pub canonical: CanonicalConfig,
    /// Bounds and timeouts.
    pub limits: Limits,
    /// Fault injection for tests; the default injects nothing.
    pub fault: FaultInjection,
    /// The last batch already applied, when the owner restored the source's state (a
    /// checkpoint): the source continues after it (see [`crate::SequenceTracker::resumed`])
    /// instead of treating its first batch as a join, once the engine's replay of that
    /// batch matched its digest.
    pub resume_after: Option<ResumePoint>,
    /// The budget this source shares with others (a relay makes one of
    /// `Limits::max_queued_bytes_total` for all); `None`: its own bound only.
    pub queue_budget: Option<QueueBudget>,
}

/// What a ZMQ publisher sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZmqWire {
    /// An engine's own batches, `[topic, seq, msgpack batch]`, in vLLM's or SGLang's
    /// positional layout; token ids are hashed with the pool's rules.
    Engine(EngineKind),
    /// Dynamo's event plane, as a Dynamo worker's `KvEventPublisher` publishes it on the
    /// channel it advertises ([`crate::parse_event_plane`]): only events of the source's
    /// worker and declared ranks are applied. Dynamo hashes the blocks itself (XXH3, seed
    /// 1337, no salt), so the pool's hash format must be the default one for its answers to
    /// match Dynamo's.
    DynamoEventPlane {
        /// The advertised publisher id (the `EventSource` record's `publisher_id`):
        /// messages of any other publisher are rejected.
        publisher_id: u64,
    },
}

/// Test-only faults a source can be told to suffer (the default injects none).
#[derive(Debug, Clone, Default)]
pub struct FaultInjection {
    panic_reader: Arc<AtomicBool>,
}

impl FaultInjection {
    /// Makes the source's reader panic once, at its next poll.
    pub fn panic_reader_once(&self) {
        self.panic_reader.store(true, Ordering::Relaxed);
    }

    /// Panics if a reader panic was requested (and clears the request).
    #[allow(clippy::panic)]
    pub(crate) fn check_reader(&self) {
        if self.panic_reader.swap(false, Ordering::Relaxed) {
            panic!("injected reader panic");
        }
    }
}

impl PartialEq for FaultInjection {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.panic_reader, &other.panic_reader)
    }
}

impl Eq for FaultInjection {}
