//! The publication stream of one producer generation, sans-IO.
//!
//! A [`Publisher`] owns everything a relay decides about a pool's stream: the mirror of
//! the producer's table, delta sequencing, one cursor per subscriber (snapshot in
//! progress, pending deltas, heartbeat and progress deadlines), backlog accounting in
//! bytes, and a retained window of recent deltas for resumption. It does no IO and reads
//! no clock: inputs arrive through `handle_*` with the caller's `now`, outputs leave
//! through [`Publisher::poll_transmit`] and [`Publisher::poll_timeout`], like
//! `quinn-proto`. The async hub and subscriptions of `kvrelay-pool` only drive it.
//!
//! # Lag is absorbed, not punished
//!
//! Deltas carry absolute bucket images, so the deltas pending for a subscriber coalesce
//! losslessly into one delta `S → S+k` (a later image of a bucket replaces the earlier,
//! [`coalesce`]). A subscriber that falls behind gets fewer, larger deltas; it is cut off
//! only when its coalesced backlog exceeds [`StreamLimits::max_backlog_bytes`] (by
//! default one snapshot's size: beyond that a snapshot is cheaper) or its snapshot stops
//! progressing. Subscribers that cannot take coalesced deltas (protocol minor 0, and
//! Dynamo's relay contract) get every delta one by one; their backlog cannot shrink by
//! coalescing, so they are cut off only past the larger of that bound and
//! [`StreamLimits::min_uncoalesced_backlog_bytes`] (by default 16 MiB, the queue bound of
//! Dynamo's own relay, so a contract follower lags out no sooner than it would there).
//!
//! # Resumption
//!
//! A subscriber may name the last sequence it applied. When the retained window (bounded
//! by [`StreamLimits::resume_window_bytes`]) still reaches back to it, the stream resumes
//! with the missing deltas (coalesced into one) instead of a snapshot; when it is already
//! current, with a heartbeat. Otherwise it starts with a snapshot.
//!
//! # Invariant
//!
//! For every subscriber, the frames handed out are a snapshot at `S` (or a resume point
//! `S` it named), then deltas whose bases chain exactly (`base == previous sequence`);
//! applied in order to a replica they reproduce the mirror at each delta's sequence.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::image::{BucketImage, Delta, SNAPSHOT_CHUNK_BUCKETS};

/// Wire bytes charged per delta image (a `u32` bucket index and a `u64` word).
pub const IMAGE_WIRE_BYTES: u64 = 12;
/// Bytes charged per delta frame on top of its images (header, identity, checksum).
pub const DELTA_FRAME_OVERHEAD: u64 = 256;
/// The smallest backlog bound used when it defaults to one snapshot's size (1 MiB), so
/// a tiny table does not cut a subscriber off after a handful of frames.
pub const MIN_DEFAULT_BACKLOG_BYTES: u64 = 1 << 20;
/// Default [`StreamLimits::min_uncoalesced_backlog_bytes`] (16 MiB): the default
/// `publication_queue_bytes` of Dynamo's relay, whose contract has no coalesced delta.
pub const DEFAULT_MIN_UNCOALESCED_BACKLOG_BYTES: u64 = 16 << 20;
/// Default bytes of recent deltas retained for resumption (16 MiB).
pub const DEFAULT_RESUME_WINDOW_BYTES: u64 = 16 << 20;
/// Default [`StreamLimits::max_delta_images`]: 349,525, what one CBI1 delta payload
/// carries (`kvrelay_codec::cbi1::MAX_DELTA_IMAGES`; the codec tests that they agree).
pub const DEFAULT_MAX_DELTA_IMAGES: usize = 349_525;
/// Default quiet time after which a subscriber gets a heartbeat (10 s).
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// Default longest time between two snapshot chunks handed to one subscriber (60 s).
pub const DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(60);
/// Default subscribers of one publisher.
pub const DEFAULT_MAX_SUBSCRIBERS: usize = 64;
/// Default table versions snapshots in flight may hold besides the mirror (2): each is
/// one whole table (`bucket_count × 8` bytes).
pub const DEFAULT_MAX_PINNED_SNAPSHOTS: usize = 2;

/// The bytes a delta is charged in backlogs and the retained window.
pub fn delta_wire_bytes(delta: &Delta) -> u64 {
    DELTA_FRAME_OVERHEAD
        .saturating_add((delta.images.len() as u64).saturating_mul(IMAGE_WIRE_BYTES))
}

/// Merges consecutive deltas (each one's base is the previous one's sequence) into one
/// delta from the first base to the last sequence; a later image of a bucket replaces an
/// earlier one. `None` for an empty slice.
pub fn coalesce<'a>(deltas: impl IntoIterator<Item = &'a Delta>) -> Option<Delta> {
    let mut deltas = deltas.into_iter().peekable();
    let base_sequence = deltas.peek()?.base_sequence;
    let mut sequence = base_sequence;
    let mut all: Vec<BucketImage> = Vec::new();
    for delta in deltas {
        sequence = delta.sequence;
        all.extend_from_slice(&delta.images);
    }
    // Stable: within one bucket, earlier deltas stay first, so the last image wins.
    all.sort_by_key(|image| image.bucket_idx);
    let mut images: Vec<BucketImage> = Vec::with_capacity(all.len());
    for image in all {
        match images.last_mut() {
            Some(last) if last.bucket_idx == image.bucket_idx => *last = image,
            _ => images.push(image),
        }
    }
    Some(Delta {
        base_sequence,
        sequence,
        images,
    })
}

/// Every bound of one publisher. Plain data; [`StreamLimits::validate`] rejects zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLimits {
    /// Subscribers at once ([`DEFAULT_MAX_SUBSCRIBERS`]).
    pub max_subscribers: usize,
    /// Bytes of deltas pending for one subscriber, after coalescing, before it is cut off.
    /// `None` (the default): one snapshot's size (`bucket_count × 8`), at least
    /// [`MIN_DEFAULT_BACKLOG_BYTES`].
    pub max_backlog_bytes: Option<u64>,
    /// The backlog bound of a subscriber that takes every delta one by one (no
    /// coalescing) is at least this ([`DEFAULT_MIN_UNCOALESCED_BACKLOG_BYTES`]): its
    /// backlog is a sum of deltas that cannot fold, so a bound of one snapshot would cut
    /// it off after a short burst. 0: the same bound as a coalescing subscriber. The
    /// pending deltas are shared with the retained window and the other subscribers.
    pub min_uncoalesced_backlog_bytes: u64,
    /// Bytes of recent deltas retained for resumption ([`DEFAULT_RESUME_WINDOW_BYTES`];
    /// 0 disables resumption).
    pub resume_window_bytes: u64,
    /// Quiet time after which a subscriber gets a heartbeat ([`DEFAULT_HEARTBEAT_INTERVAL`]).
    pub heartbeat_interval: Duration,
    /// Longest time between two snapshot chunks of one subscriber
    /// ([`DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT`]).
    pub snapshot_progress_timeout: Duration,
    /// Buckets per snapshot chunk ([`SNAPSHOT_CHUNK_BUCKETS`]).
    pub chunk_buckets: NonZeroU32,
    /// Table versions that snapshots in flight may pin ([`DEFAULT_MAX_PINNED_SNAPSHOTS`]).
    /// A snapshot pins the mirror as it was when it started; once a delta arrives, that
    /// version is a copy of the whole table until its last snapshot is sent. At the
    /// bound, a new subscriber starts on the newest pinned version and gets the deltas
    /// since from the resume window; if the window no longer reaches it, it is refused
    /// ([`SubscribeRefused::SnapshotLimit`]) and retries later.
    pub max_pinned_snapshots: usize,
    /// Bucket images one delta handed out may carry ([`DEFAULT_MAX_DELTA_IMAGES`], what
    /// one frame holds). A lagging subscriber's backlog is coalesced in runs that each fit;
    /// a published delta must fit on its own.
    pub max_delta_images: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            max_subscribers: DEFAULT_MAX_SUBSCRIBERS,
            max_backlog_bytes: None,
            min_uncoalesced_backlog_bytes: DEFAULT_MIN_UNCOALESCED_BACKLOG_BYTES,
            resume_window_bytes: DEFAULT_RESUME_WINDOW_BYTES,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            snapshot_progress_timeout: DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT,
            chunk_buckets: NonZeroU32::MIN.saturating_add(SNAPSHOT_CHUNK_BUCKETS - 1),
            max_pinned_snapshots: DEFAULT_MAX_PINNED_SNAPSHOTS,
            max_delta_images: DEFAULT_MAX_DELTA_IMAGES,
        }
    }
}

/// A stream bound that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamLimitsError {
    /// A capacity or duration is zero.
    #[error("stream limit {field} must be greater than zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
}

impl StreamLimits {
    /// Rejects zero capacities and durations, naming the field.
    pub fn validate(&self) -> Result<(), StreamLimitsError> {
        if self.max_subscribers == 0 {
            return Err(StreamLimitsError::Zero {
                field: "max_subscribers",
            });
        }
        if self.max_pinned_snapshots == 0 {
            return Err(StreamLimitsError::Zero {
                field: "max_pinned_snapshots",
            });
        }
        if self.max_delta_images == 0 {
            return Err(StreamLimitsError::Zero {
                field: "max_delta_images",
            });
        }
        if self.max_backlog_bytes == Some(0) {
            return Err(StreamLimitsError::Zero {
                field: "max_backlog_bytes",
            });
        }
        if self.heartbeat_interval.is_zero() {
            return Err(StreamLimitsError::Zero {
                field: "heartbeat_interval",
            });
        }
        if self.snapshot_progress_timeout.is_zero() {
            return Err(StreamLimitsError::Zero {
                field: "snapshot_progress_timeout",
            });
        }
        Ok(())
    }

    /// The backlog bound for a table of `bucket_count` buckets.
    pub fn backlog_bound(&self, bucket_count: usize) -> u64 {
        self.max_backlog_bytes.unwrap_or_else(|| {
            ((bucket_count as u64).saturating_mul(8)).max(MIN_DEFAULT_BACKLOG_BYTES)
        })
    }

    /// The backlog bound of a subscriber that does not take coalesced deltas.
    pub fn uncoalesced_backlog_bound(&self, bucket_count: usize) -> u64 {
        self.backlog_bound(bucket_count)
            .max(self.min_uncoalesced_backlog_bytes)
    }
}

/// A delta that does not follow the publisher's mirror; nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The delta's base is not the publisher's sequence.
    #[error("delta {base_sequence}->{sequence} does not follow the publisher at {current}")]
    SequenceGap {
        /// The publisher's sequence.
        current: u64,
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// The delta does not advance the sequence.
    #[error("delta {base_sequence}->{sequence} does not advance")]
    NotAdvancing {
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// The delta has no images.
    #[error("delta {base_sequence}->{sequence} has no images")]
    Empty {
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// An image names a bucket outside the table.
    #[error("delta image for bucket {bucket_idx} outside the table of {bucket_count} buckets")]
    OutOfRange {
        /// The bucket named.
        bucket_idx: u32,
        /// The table's bucket count.
        bucket_count: usize,
    },
    /// Images are not sorted by strictly increasing bucket.
    #[error("delta images are not sorted by strictly increasing bucket")]
    Unsorted,
}

/// Why a subscription could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeRefused {
    /// The publisher already has its maximum of subscribers.
    #[error("publisher already has {limit} subscribers")]
    SubscriberLimit {
        /// The limit.
        limit: usize,
    },
    /// Snapshots in flight already pin the maximum of table versions, and the resume
    /// window no longer reaches the newest of them.
    #[error("snapshots in flight already pin {limit} table versions")]
    SnapshotLimit {
        /// The limit ([`StreamLimits::max_pinned_snapshots`]).
        limit: usize,
    },
}

/// Why a subscriber was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutOff {
    /// Its coalesced backlog exceeded the bound.
    Backlog {
        /// Bytes the backlog would have held.
        bytes: u64,
        /// The bound.
        limit: u64,
    },
    /// Its snapshot made no progress within the timeout.
    SnapshotStalled {
        /// The timeout.
        timeout: Duration,
    },
}

impl CutOff {
    /// A stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            CutOff::Backlog { .. } => "backlog",
            CutOff::SnapshotStalled { .. } => "snapshot_stalled",
        }
    }
}

/// A subscriber of one publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubscriberId(u64);

/// How a new subscription starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// With a snapshot at `sequence`.
    Snapshot {
        /// The snapshot's sequence.
        sequence: u64,
    },
    /// From the sequence the subscriber named; no snapshot.
    Resume {
        /// The subscriber's sequence.
        from: u64,
    },
}

/// One thing to send to a subscriber.
#[derive(Debug, Clone)]
pub enum Transmit<T> {
    /// Snapshot chunk `chunk_index` of `chunk_count` at `sequence`, cut from `words`
    /// (pinned: later deltas do not change it) in chunks of
    /// [`StreamLimits::chunk_buckets`].
    SnapshotChunk {
        /// The pinned table.
        words: Arc<Vec<u64>>,
        /// The snapshot's sequence.
        sequence: u64,
        /// This chunk.
        chunk_index: u32,
        /// The snapshot's chunks.
        chunk_count: u32,
    },
    /// A delta, with the caller's encoding of it when it was not coalesced.
    Delta {
        /// The delta.
        delta: Arc<Delta>,
        /// The encoding passed to [`Publisher::handle_delta`]; `None` when coalesced.
        encoded: Option<T>,
        /// How many published deltas it covers (1 unless coalesced).
        covers: usize,
    },
    /// Nothing changed; the subscriber is at `sequence`.
    Heartbeat {
        /// The subscriber's sequence.
        sequence: u64,
    },
}

/// What [`Publisher::poll_transmit`] has for a subscriber.
#[derive(Debug, Clone)]
pub enum Poll<T> {
    /// Send this.
    Transmit(Transmit<T>),
    /// Nothing now; poll again after new input or at [`Publisher::poll_timeout`].
    Idle,
    /// The subscriber was cut off (it stays so until unsubscribed).
    CutOff(CutOff),
    /// No such subscriber.
    Unknown,
}

/// Counters of one publisher (monotonic, except the gauges marked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Deltas accepted.
    pub deltas: u64,
    /// Subscriptions started with a snapshot.
    pub snapshots: u64,
    /// Subscriptions resumed without a snapshot.
    pub resumes: u64,
    /// Resumptions asked for but served with a snapshot (the window no longer reached).
    pub resume_misses: u64,
    /// Delta frames handed out.
    pub delta_frames: u64,
    /// Delta frames handed out that coalesced two or more deltas.
    pub coalesced_frames: u64,
    /// Deltas merged into coalesced frames.
    pub coalesced_deltas: u64,
    /// Heartbeats handed out.
    pub heartbeats: u64,
    /// Subscribers cut off for their backlog.
    pub cut_offs_backlog: u64,
    /// Subscribers cut off for a stalled snapshot.
    pub cut_offs_snapshot_stalled: u64,
    /// Snapshots started on an older pinned version (the pin bound was reached).
    pub snapshots_shared: u64,
    /// Subscriptions refused because the pin bound was reached and the window did not
    /// reach the newest pinned version.
    pub snapshot_refusals: u64,
    /// Gauge: table versions pinned by snapshots in flight that are copies (no longer
    /// the mirror).
    pub pinned_copies: u64,
    /// Gauge: bytes of those copies.
    pub pinned_copy_bytes: u64,
    /// Gauge: deltas in the resume window.
    pub retained_deltas: u64,
    /// Gauge: bytes in the resume window.
    pub retained_bytes: u64,
    /// Gauge: bytes pending across subscribers (a delta pending for several is counted
    /// for each, though they share it: an upper bound).
    pub pending_bytes: u64,
    /// Gauge: bytes of the mirror (the table as last published).
    pub mirror_bytes: u64,
}

impl StreamStats {
    /// Follows one publisher from its `before` reading to `current` in `self`, a sum over
    /// publishers: each counter gains what it gained (never less), each gauge drops
    /// `before`'s value and takes `current`'s.
    pub fn advance(&mut self, before: &StreamStats, current: &StreamStats) {
        let gained = |total: &mut u64, before: u64, current: u64| {
            *total = total.saturating_add(current.saturating_sub(before));
        };
        gained(&mut self.deltas, before.deltas, current.deltas);
        gained(&mut self.snapshots, before.snapshots, current.snapshots);
        gained(&mut self.resumes, before.resumes, current.resumes);
        gained(
            &mut self.resume_misses,
            before.resume_misses,
            current.resume_misses,
        );
        gained(
            &mut self.delta_frames,
            before.delta_frames,
            current.delta_frames,
        );
        gained(
            &mut self.coalesced_frames,
            before.coalesced_frames,
            current.coalesced_frames,
        );
        gained(
            &mut self.coalesced_deltas,
            before.coalesced_deltas,
            current.coalesced_deltas,
        );
        gained(&mut self.heartbeats, before.heartbeats, current.heartbeats);
        gained(
            &mut self.cut_offs_backlog,
            before.cut_offs_backlog,
            current.cut_offs_backlog,
        );
        gained(
            &mut self.cut_offs_snapshot_stalled,
            before.cut_offs_snapshot_stalled,
            current.cut_offs_snapshot_stalled,
        );
        gained(
            &mut self.snapshots_shared,
            before.snapshots_shared,
            current.snapshots_shared,
        );
        gained(
            &mut self.snapshot_refusals,
            before.snapshot_refusals,
            current.snapshot_refusals,
        );
        let moved = |total: &mut u64, before: u64, current: u64| {
            *total = total.saturating_sub(before).saturating_add(current);
        };
        moved(
            &mut self.pinned_copies,
            before.pinned_copies,
            current.pinned_copies,
        );
        moved(
            &mut self.pinned_copy_bytes,
            before.pinned_copy_bytes,
            current.pinned_copy_bytes,
        );
        moved(
            &mut self.retained_deltas,
            before.retained_deltas,
            current.retained_deltas,
        );
        moved(
            &mut self.retained_bytes,
            before.retained_bytes,
            current.retained_bytes,
        );
        moved(
            &mut self.pending_bytes,
            before.pending_bytes,
            current.pending_bytes,
        );
        moved(
            &mut self.mirror_bytes,
            before.mirror_bytes,
            current.mirror_bytes,
        );
    }
}

#[derive(Debug)]
struct Pending<T> {
    delta: Arc<Delta>,
    encoded: Option<T>,
    bytes: u64,
    /// Published deltas it stands for (more than 1 once coalesced in place).
    covers: usize,
}

#[derive(Debug)]
struct SnapshotCursor {
    words: Arc<Vec<u64>>,
    sequence: u64,
    next_chunk: u32,
    chunk_count: u32,
}

#[derive(Debug)]
struct Cursor<T> {
    snapshot: Option<SnapshotCursor>,
    pending: VecDeque<Pending<T>>,
    pending_bytes: u64,
    coalesce: bool,
    /// The subscriber's sequence once it applied everything handed out.
    sent_sequence: u64,
    /// When something was last handed out (heartbeat clock); `None`: a heartbeat is due.
    last_sent: Option<Instant>,
    /// When the snapshot last progressed.
    last_progress: Instant,
    cut_off: Option<CutOff>,
}

/// A publisher's backlog bounds, by whether the subscriber coalesces.
#[derive(Debug, Clone, Copy)]
struct BacklogBounds {
    coalesced: u64,
    /// Never below `coalesced`.
    uncoalesced: u64,
}

impl BacklogBounds {
    fn of(self, coalesce: bool) -> u64 {
        if coalesce {
            self.coalesced
        } else {
            self.uncoalesced
        }
    }
}

/// The publication state machine of one producer generation: see the module docs.
#[derive(Debug)]
pub struct Publisher<T> {
    limits: StreamLimits,
    backlog: BacklogBounds,
    sequence: u64,
    mirror: Arc<Vec<u64>>,
    /// Recent deltas (with their encodings) for resumption, oldest first.
    window: VecDeque<Pending<T>>,
    window_bytes: u64,
    cursors: HashMap<SubscriberId, Cursor<T>>,
    next_id: u64,
    stats: StreamStats,
}

impl<T: Clone> Publisher<T> {
    /// A publisher whose mirror is `words` at `sequence`.
    pub fn new(
        sequence: u64,
        words: Vec<u64>,
        limits: StreamLimits,
    ) -> Result<Self, StreamLimitsError> {
        limits.validate()?;
        Ok(Self {
            backlog: BacklogBounds {
                coalesced: limits.backlog_bound(words.len()),
                uncoalesced: limits.uncoalesced_backlog_bound(words.len()),
            },
            limits,
            sequence,
            mirror: Arc::new(words),
            window: VecDeque::new(),
            window_bytes: 0,
            cursors: HashMap::new(),
            next_id: 0,
            stats: StreamStats::default(),
        })
    }

    /// The mirror's sequence.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The mirror (the producer's table at [`Publisher::sequence`]).
    pub fn words(&self) -> &[u64] {
        &self.mirror
    }

    /// The counters.
    pub fn stats(&self) -> StreamStats {
        let mut stats = self.stats;
        stats.retained_deltas = self.window.len() as u64;
        stats.retained_bytes = self.window_bytes;
        stats.pending_bytes = self.cursors.values().map(|c| c.pending_bytes).sum();
        let copies = self
            .pinned_versions()
            .into_iter()
            .filter(|(words, _)| !Arc::ptr_eq(words, &self.mirror))
            .count() as u64;
        stats.pinned_copies = copies;
        stats.pinned_copy_bytes = copies.saturating_mul(self.mirror.len() as u64 * 8);
        stats.mirror_bytes = self.mirror.len() as u64 * 8;
        stats
    }

    /// The distinct table versions held by snapshots in flight, with their sequences
    /// (the mirror included when a snapshot shares it).
    fn pinned_versions(&self) -> Vec<(&Arc<Vec<u64>>, u64)> {
        let mut versions: Vec<(&Arc<Vec<u64>>, u64)> = Vec::new();
        for snapshot in self.cursors.values().filter_map(|c| c.snapshot.as_ref()) {
            if !versions
                .iter()
                .any(|(words, _)| Arc::ptr_eq(words, &snapshot.words))
            {
                versions.push((&snapshot.words, snapshot.sequence));
            }
        }
        versions
    }

    /// Subscribers (cut-off ones included, until unsubscribed).
    pub fn subscriber_count(&self) -> usize {
        self.cursors.len()
    }

    /// Subscribers still being served (not cut off).
    pub fn live_subscriber_count(&self) -> usize {
        self.cursors
            .values()
            .filter(|c| c.cut_off.is_none())
            .count()
    }

    /// The backlog bound in effect for subscribers that coalesce.
    pub fn backlog_bound(&self) -> u64 {
        self.backlog.coalesced
    }

    /// The backlog bound in effect for subscribers that take every delta one by one.
    pub fn uncoalesced_backlog_bound(&self) -> u64 {
        self.backlog.uncoalesced
    }

    /// Accepts the producer's next delta: checks it against the mirror, applies it, keeps
    /// it for resumption and queues it for every subscriber. `encode` is called at most
    /// once, only when a subscriber is live, and its result is handed out with the delta
    /// when it is sent alone. On `Err` nothing changed.
    pub fn handle_delta(
        &mut self,
        delta: Delta,
        now: Instant,
        encode: impl FnOnce(&Delta) -> T,
    ) -> Result<(), PublishError> {
        self.check(&delta)?;
        let mirror = Arc::make_mut(&mut self.mirror);
        for image in &delta.images {
            mirror[image.bucket_idx as usize] = image.word;
        }
        self.sequence = delta.sequence;
        self.stats.deltas += 1;
        let bytes = delta_wire_bytes(&delta);
        let delta = Arc::new(delta);
        let encoded = if self.live_subscriber_count() > 0 {
            Some(encode(&delta))
        } else {
            None
        };
        if self.limits.resume_window_bytes > 0 {
            self.window.push_back(Pending {
                delta: delta.clone(),
                encoded: encoded.clone(),
                bytes,
                covers: 1,
            });
            self.window_bytes = self.window_bytes.saturating_add(bytes);
            while self.window_bytes > self.limits.resume_window_bytes {
                let Some(evicted) = self.window.pop_front() else {
                    break;
                };
                self.window_bytes -= evicted.bytes;
            }
        }
        let backlog = self.backlog;
        let max_images = self.limits.max_delta_images;
        for cursor in self.cursors.values_mut() {
            if cursor.cut_off.is_some() {
                continue;
            }
            cursor.pending.push_back(Pending {
                delta: delta.clone(),
                encoded: encoded.clone(),
                bytes,
                covers: 1,
            });
            cursor.pending_bytes = cursor.pending_bytes.saturating_add(bytes);
            if let Err(cut) = cursor.fit_backlog(backlog.of(cursor.coalesce), max_images) {
                self.stats.cut_offs_backlog += 1;
                cursor.cut(cut);
            }
        }
        self.handle_timeout(now);
        Ok(())
    }

    fn check(&self, delta: &Delta) -> Result<(), PublishError> {
        if delta.base_sequence != self.sequence {
            return Err(PublishError::SequenceGap {
                current: self.sequence,
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        }
        if delta.sequence <= delta.base_sequence {
            return Err(PublishError::NotAdvancing {
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        }
        if delta.images.is_empty() {
            return Err(PublishError::Empty {
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        }
        let bucket_count = self.mirror.len();
        if let Some(image) = delta
            .images
            .iter()
            .find(|image| image.bucket_idx as usize >= bucket_count)
        {
            return Err(PublishError::OutOfRange {
                bucket_idx: image.bucket_idx,
                bucket_count,
            });
        }
        if delta
            .images
            .windows(2)
            .any(|pair| pair[0].bucket_idx >= pair[1].bucket_idx)
        {
            return Err(PublishError::Unsorted);
        }
        Ok(())
    }

    /// Starts a subscription. With `resume_from = Some(S)` and `S` still reachable from
    /// the retained window, the subscriber gets the deltas after `S` (coalesced when
    /// `coalesce`) instead of a snapshot. `coalesce` says whether the subscriber accepts
    /// deltas spanning several sequences.
    pub fn handle_subscribe(
        &mut self,
        resume_from: Option<u64>,
        coalesce: bool,
        now: Instant,
    ) -> Result<(SubscriberId, Start), SubscribeRefused> {
        if self.cursors.len() >= self.limits.max_subscribers {
            return Err(SubscribeRefused::SubscriberLimit {
                limit: self.limits.max_subscribers,
            });
        }
        let id = SubscriberId(self.next_id);
        self.next_id += 1;
        let mut cursor = Cursor {
            snapshot: None,
            pending: VecDeque::new(),
            pending_bytes: 0,
            coalesce,
            sent_sequence: self.sequence,
            last_sent: Some(now),
            last_progress: now,
            cut_off: None,
        };
        let resumed = resume_from.and_then(|from| self.resume(&mut cursor, from));
        let start = match resumed {
            Some(from) => {
                self.stats.resumes += 1;
                Start::Resume { from }
            }
            None => {
                let sequence = self.start_snapshot(&mut cursor, now)?;
                if resume_from.is_some() {
                    self.stats.resume_misses += 1;
                }
                self.stats.snapshots += 1;
                Start::Snapshot { sequence }
            }
        };
        self.cursors.insert(id, cursor);
        Ok((id, start))
    }

    /// Points `cursor` at a snapshot: the mirror as it is now, unless that would pin one
    /// table version more than the bound allows; then the newest pinned version and the
    /// deltas since it from the window. Returns the snapshot's sequence.
    fn start_snapshot(
        &mut self,
        cursor: &mut Cursor<T>,
        now: Instant,
    ) -> Result<u64, SubscribeRefused> {
        let chunk_len = self.limits.chunk_buckets.get() as usize;
        // Bucket counts are at most 2^24, so chunk counts fit in u32.
        let chunk_count = self.mirror.len().div_ceil(chunk_len).max(1) as u32;
        let versions = self.pinned_versions();
        let mirror_pinned = versions
            .iter()
            .any(|(words, _)| Arc::ptr_eq(words, &self.mirror));
        let (words, sequence) =
            if mirror_pinned || versions.len() < self.limits.max_pinned_snapshots {
                cursor.pending.clear();
                cursor.pending_bytes = 0;
                (self.mirror.clone(), self.sequence)
            } else {
                // At the bound, and every pinned version is an older copy: share the newest.
                let newest = versions
                    .iter()
                    .max_by_key(|(_, sequence)| *sequence)
                    .map(|(words, sequence)| (Arc::clone(words), *sequence));
                let shared = newest.and_then(|(words, sequence)| {
                    self.queue_window_after(cursor, sequence)
                        .map(|()| (words, sequence))
                });
                match shared {
                    Some(shared) => {
                        self.stats.snapshots_shared += 1;
                        shared
                    }
                    None => {
                        self.stats.snapshot_refusals += 1;
                        return Err(SubscribeRefused::SnapshotLimit {
                            limit: self.limits.max_pinned_snapshots,
                        });
                    }
                }
            };
        cursor.sent_sequence = sequence;
        cursor.last_sent = Some(now);
        cursor.snapshot = Some(SnapshotCursor {
            words,
            sequence,
            next_chunk: 0,
            chunk_count,
        });
        Ok(sequence)
    }

    /// Fills `cursor` with what a subscriber at `from` misses; `None` when the window
    /// does not reach back to `from` or the missed deltas exceed the backlog bound.
    fn resume(&self, cursor: &mut Cursor<T>, from: u64) -> Option<u64> {
        if from == self.sequence {
            // Current already: a heartbeat tells it so at once.
            cursor.last_sent = None;
            cursor.sent_sequence = from;
            return Some(from);
        }
        self.queue_window_after(cursor, from)?;
        Some(from)
    }

    /// Queues on `cursor` the retained deltas after `from` (which must be older than the
    /// mirror); `None`, with `cursor`'s queue emptied, when the window does not reach back
    /// to `from` or they exceed the backlog bound.
    fn queue_window_after(&self, cursor: &mut Cursor<T>, from: u64) -> Option<()> {
        cursor.pending.clear();
        cursor.pending_bytes = 0;
        let start = self
            .window
            .iter()
            .position(|pending| pending.delta.base_sequence == from)?;
        cursor.sent_sequence = from;
        for pending in self.window.iter().skip(start) {
            cursor.pending.push_back(Pending {
                delta: pending.delta.clone(),
                encoded: pending.encoded.clone(),
                bytes: pending.bytes,
                covers: 1,
            });
            cursor.pending_bytes = cursor.pending_bytes.saturating_add(pending.bytes);
        }
        if cursor
            .fit_backlog(
                self.backlog.of(cursor.coalesce),
                self.limits.max_delta_images,
            )
            .is_err()
        {
            cursor.pending.clear();
            cursor.pending_bytes = 0;
            return None;
        }
        Some(())
    }

    /// Forgets a subscriber.
    pub fn handle_unsubscribe(&mut self, id: SubscriberId) {
        self.cursors.remove(&id);
    }

    /// Cuts off subscribers whose snapshot stopped progressing.
    pub fn handle_timeout(&mut self, now: Instant) {
        let timeout = self.limits.snapshot_progress_timeout;
        for cursor in self.cursors.values_mut() {
            if cursor.cut_off.is_none()
                && cursor.snapshot.is_some()
                && now.saturating_duration_since(cursor.last_progress) > timeout
            {
                self.stats.cut_offs_snapshot_stalled += 1;
                cursor.cut(CutOff::SnapshotStalled { timeout });
            }
        }
    }

    /// The next thing to send to `id` at `now`.
    pub fn poll_transmit(&mut self, id: SubscriberId, now: Instant) -> Poll<T> {
        self.handle_timeout(now);
        let heartbeat_interval = self.limits.heartbeat_interval;
        let Some(cursor) = self.cursors.get_mut(&id) else {
            return Poll::Unknown;
        };
        if let Some(cut) = cursor.cut_off {
            return Poll::CutOff(cut);
        }
        if let Some(snapshot) = &mut cursor.snapshot {
            let transmit = Transmit::SnapshotChunk {
                words: snapshot.words.clone(),
                sequence: snapshot.sequence,
                chunk_index: snapshot.next_chunk,
                chunk_count: snapshot.chunk_count,
            };
            snapshot.next_chunk += 1;
            if snapshot.next_chunk >= snapshot.chunk_count {
                cursor.snapshot = None;
            }
            cursor.last_progress = now;
            cursor.last_sent = Some(now);
            return Poll::Transmit(transmit);
        }
        if !cursor.pending.is_empty() {
            let transmit = cursor.take_run(self.limits.max_delta_images).map(|run| {
                if run.covers > 1 {
                    self.stats.coalesced_frames += 1;
                    self.stats.coalesced_deltas += run.covers as u64;
                }
                Transmit::Delta {
                    delta: run.delta,
                    encoded: run.encoded,
                    covers: run.covers,
                }
            });
            if let Some(Transmit::Delta { delta, .. }) = &transmit {
                cursor.sent_sequence = delta.sequence;
                cursor.last_sent = Some(now);
                self.stats.delta_frames += 1;
            }
            if let Some(transmit) = transmit {
                return Poll::Transmit(transmit);
            }
        }
        let due = cursor
            .last_sent
            .is_none_or(|last| now.saturating_duration_since(last) >= heartbeat_interval);
        if due {
            cursor.last_sent = Some(now);
            self.stats.heartbeats += 1;
            return Poll::Transmit(Transmit::Heartbeat {
                sequence: cursor.sent_sequence,
            });
        }
        Poll::Idle
    }

    /// When `id` next needs a poll without new input (its heartbeat or snapshot
    /// deadline); `None` for an unknown or cut-off subscriber.
    pub fn poll_timeout(&self, id: SubscriberId) -> Option<Instant> {
        let cursor = self.cursors.get(&id)?;
        if cursor.cut_off.is_some() {
            return None;
        }
        if cursor.snapshot.is_some() {
            return Some(cursor.last_progress + self.limits.snapshot_progress_timeout);
        }
        match cursor.last_sent {
            Some(last) => Some(last + self.limits.heartbeat_interval),
            None => Some(cursor.last_progress),
        }
    }

    /// True when `id` has something to send now (a chunk, a delta or a due heartbeat).
    pub fn has_transmit(&self, id: SubscriberId) -> bool {
        self.cursors.get(&id).is_some_and(|cursor| {
            cursor.cut_off.is_none()
                && (cursor.snapshot.is_some()
                    || !cursor.pending.is_empty()
                    || cursor.last_sent.is_none())
        })
    }
}

impl<T> Cursor<T> {
    /// Keeps the backlog within `bound`, coalescing it (in runs of at most `max_images`
    /// images each) when the subscriber accepts that.
    fn fit_backlog(&mut self, bound: u64, max_images: usize) -> Result<(), CutOff> {
        if self.pending_bytes <= bound {
            return Ok(());
        }
        if self.coalesce && self.pending.len() > 1 {
            let mut runs = VecDeque::new();
            while let Some(run) = self.take_run(max_images) {
                runs.push_back(run);
            }
            self.pending_bytes = runs.iter().map(|run: &Pending<T>| run.bytes).sum();
            self.pending = runs;
            if self.pending_bytes <= bound {
                return Ok(());
            }
        }
        Err(CutOff::Backlog {
            bytes: self.pending_bytes,
            limit: bound,
        })
    }

    /// Takes what is handed out next: with coalescing, the pending deltas merged into one;
    /// without, the first. `None` when nothing waits. A merge must fit `max_images`: when
    /// the pending images, counted before merging, are at most twice that, the whole
    /// backlog is merged and used if it fits (overlap usually folds it); otherwise, or if
    /// it does not fit, the longest run at the front whose images fit before merging is
    /// (a bound that needs no merge to check, so a long backlog costs one merge per run,
    /// not a merge of everything per run). A run of one is handed out as it is (a
    /// published delta fits on its own).
    fn take_run(&mut self, max_images: usize) -> Option<Pending<T>> {
        let mut run_len = 1;
        let mut merged = None;
        if self.coalesce && self.pending.len() > 1 {
            let total: usize = self.pending.iter().map(|p| p.delta.images.len()).sum();
            if total <= max_images.saturating_mul(2) {
                merged = coalesce(self.pending.iter().map(|p| &*p.delta))
                    .filter(|whole| whole.images.len() <= max_images);
                if merged.is_some() {
                    run_len = self.pending.len();
                }
            }
            if merged.is_none() {
                let mut images = self.pending.front()?.delta.images.len();
                for pending in self.pending.iter().skip(1) {
                    images += pending.delta.images.len();
                    if images > max_images {
                        break;
                    }
                    run_len += 1;
                }
                if run_len > 1 {
                    merged = coalesce(self.pending.iter().take(run_len).map(|p| &*p.delta));
                }
            }
        }
        let Some(merged) = merged else {
            let first = self.pending.pop_front()?;
            self.pending_bytes = self.pending_bytes.saturating_sub(first.bytes);
            return Some(first);
        };
        let mut covers = 0;
        for pending in self.pending.drain(..run_len) {
            covers += pending.covers;
            self.pending_bytes = self.pending_bytes.saturating_sub(pending.bytes);
        }
        Some(Pending {
            bytes: delta_wire_bytes(&merged),
            delta: Arc::new(merged),
            encoded: None,
            covers,
        })
    }

    fn cut(&mut self, cut: CutOff) {
        self.cut_off = Some(cut);
        self.pending.clear();
        self.pending_bytes = 0;
        self.snapshot = None;
    }
}

#[cfg(test)]
mod tests;
