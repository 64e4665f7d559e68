//! The relay's half of a pool's protocol without a network: a producer filter with its
//! descriptor and the relay's frame encoder, the catalog it belongs to, and the error
//! frames the relay ends streams with.

use bytes::BytesMut;
use kvrelay_ckf::stream::CutOff;
use kvrelay_ckf::{
    CkfConfig, Delta, EventPayload, FilterDensity, PoolFilter, RouterEvent, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_codec::Limits;
use kvrelay_codec::cbi1::snapshot_chunk_count;
use kvrelay_codec::session::PoolFrameEncoder;
use kvrelay_codec::v1::{
    CatalogUpdate, CkfFormat, DigestId, EndpointId, ErrorMessage, ErrorReason, HashFormat,
    IdentitySource, Message, ModelRegistration, PoolDescriptor, PoolId, ProducerIdentity,
    QuerySemantics, RelayIdentity, WorkerRole, decode_message, encode_message,
};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};

/// What a pool looks like in the fake catalog.
#[derive(Debug, Clone)]
pub(crate) struct PoolSpec {
    pub(crate) name: &'static str,
    pub(crate) namespace: &'static str,
    pub(crate) model: &'static str,
    pub(crate) aliases: Vec<&'static str>,
    pub(crate) adapter: Option<&'static str>,
    pub(crate) roles: Vec<WorkerRole>,
    pub(crate) block_size: u32,
    pub(crate) expected_blocks: u64,
}

impl PoolSpec {
    pub(crate) fn aggregated(name: &'static str, model: &'static str) -> Self {
        Self {
            name,
            namespace: "prod",
            model,
            aliases: Vec::new(),
            adapter: None,
            roles: vec![WorkerRole::Aggregated],
            block_size: 4,
            expected_blocks: 4096,
        }
    }
}

pub(crate) fn limits() -> Limits {
    Limits::default()
}

pub(crate) fn dc_id_of(name: &str) -> u64 {
    kvrelay_identity::DcId::from_dc_name(name).as_u64()
}

pub(crate) fn digest(text: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&dc_id_of(text).to_le_bytes());
    out[8..].copy_from_slice(&dc_id_of(&format!("{text}#")).to_le_bytes());
    out
}

/// Encodes and decodes `frame` bytes back into a pool frame message (for sans-IO tests).
pub(crate) fn decode_pool_frame(bytes: &mut BytesMut) -> kvrelay_codec::v1::PoolFrame {
    match decode_message(bytes, &limits())
        .expect("decode")
        .expect("complete")
    {
        Message::PoolFrame(frame) => frame,
        other => panic!("expected a pool frame, got {other:?}"),
    }
}

pub(crate) fn descriptor(
    spec: &PoolSpec,
    dc: &str,
    incarnation: u64,
    generation: u64,
    filter: &PoolFilter,
) -> PoolDescriptor {
    let format = filter.format();
    PoolDescriptor {
        producer: ProducerIdentity {
            pool_id: PoolId {
                identity_version: 1,
                cache_semantics: DigestId {
                    digest: digest(&format!("{}:{}", spec.model, spec.block_size)),
                    source: IdentitySource::DefaultDerived,
                },
                routing_scope: DigestId {
                    digest: digest(spec.name),
                    source: IdentitySource::DefaultDerived,
                },
                dc_id: dc_id_of(dc),
            },
            producer_incarnation: incarnation,
            layout_generation: generation,
            ckf_format: CkfFormat {
                format_version: u32::from(format.format_version()),
                seed: format.seed(),
                bucket_count: u64::from(format.bucket_count()),
                fingerprint_bits: 16,
                slots_per_bucket: 4,
            },
        },
        serving_endpoint: EndpointId {
            namespace: spec.namespace.to_owned(),
            component: spec.name.to_owned(),
            name: "generate".to_owned(),
        },
        registrations: {
            let mut regs = vec![ModelRegistration {
                model: spec.model.to_owned(),
                base_model: spec.model.to_owned(),
                adapter: None,
                aliases: spec.aliases.iter().map(|a| (*a).to_owned()).collect(),
            }];
            if let Some(adapter) = spec.adapter {
                regs.push(ModelRegistration {
                    model: format!("{}-{adapter}", spec.model),
                    base_model: spec.model.to_owned(),
                    adapter: Some(adapter.to_owned()),
                    aliases: Vec::new(),
                });
            }
            regs
        },
        query_semantics: QuerySemantics {
            kv_block_size: spec.block_size,
            hash_format: HashFormat::DynamoStandardV1,
        },
        pool_roles: spec.roles.clone(),
    }
}

/// The error a relay ends a cut-off subscriber's stream with.
pub(crate) fn cut_off_reason(cut: CutOff) -> ErrorReason {
    match cut {
        CutOff::Backlog { .. } => ErrorReason::SubscriberLagged,
        CutOff::SnapshotStalled { .. } => ErrorReason::SnapshotProgressTimeout,
    }
}

pub(crate) fn error_frame(reason: ErrorReason, message: &str) -> BytesMut {
    let mut frame = BytesMut::new();
    let error = Message::Error(ErrorMessage::new(reason, message));
    encode_message(&error, &limits(), &mut frame).expect("encode error");
    frame
}

/// A producer without a network, for sans-IO tests: a filter plus the relay's frame
/// encoder.
pub(crate) struct Producer {
    pub(crate) filter: PoolFilter,
    pub(crate) descriptor: PoolDescriptor,
    pub(crate) encoder: PoolFrameEncoder,
    block_size: u32,
    next_engine_id: u64,
}

impl Producer {
    pub(crate) fn new(spec: &PoolSpec, dc: &str, relay: RelayIdentity, generation: u64) -> Self {
        Self::with_density(spec, dc, relay, generation, FilterDensity::V1)
    }

    /// A producer whose filter is built in `density` (v1 or dense).
    pub(crate) fn with_density(
        spec: &PoolSpec,
        dc: &str,
        relay: RelayIdentity,
        generation: u64,
        density: FilterDensity,
    ) -> Self {
        let config = CkfConfig::new(spec.expected_blocks).with_density(density);
        let filter = PoolFilter::new(config).expect("filter");
        let descriptor = descriptor(spec, dc, relay.relay_incarnation, generation, &filter);
        Self {
            encoder: PoolFrameEncoder::new(relay, descriptor.producer, limits()),
            descriptor,
            filter,
            block_size: spec.block_size,
            next_engine_id: 1,
        }
    }

    /// Stores `tokens` as one chain of `worker`; returns the canonical hashes and the
    /// delta frame, if any bucket changed.
    pub(crate) fn store(
        &mut self,
        worker: u64,
        tokens: &[u32],
        salt: HashSalt<'_>,
    ) -> (Vec<u64>, Option<kvrelay_codec::v1::PoolFrame>) {
        let (hashes, delta) = self.store_delta(worker, tokens, salt);
        (hashes, delta.map(|delta| self.delta_frame(&delta)))
    }

    /// [`Producer::store`], handing out the delta itself.
    pub(crate) fn store_delta(
        &mut self,
        worker: u64,
        tokens: &[u32],
        salt: HashSalt<'_>,
    ) -> (Vec<u64>, Option<Delta>) {
        let hashes = block_hashes(
            tokens,
            self.block_size,
            KvQueryHashFormat::DynamoStandardV1,
            salt,
        );
        let blocks = hashes
            .iter()
            .map(|&token_hash| {
                let engine_block_id = self.next_engine_id;
                self.next_engine_id += 1;
                StoredBlock {
                    engine_block_id,
                    token_hash,
                }
            })
            .collect();
        let event = RouterEvent {
            source: SourceId::new(worker, 0),
            event_id: self.next_engine_id,
            payload: EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks,
            }),
        };
        self.filter.apply(&event).expect("apply");
        (
            sequence_hashes(&hashes),
            self.filter.take_delta().expect("delta"),
        )
    }

    /// Clears `worker`'s blocks; returns the delta frame, if any.
    pub(crate) fn clear(&mut self, worker: u64) -> Option<kvrelay_codec::v1::PoolFrame> {
        self.clear_delta(worker)
            .map(|delta| self.delta_frame(&delta))
    }

    /// [`Producer::clear`], handing out the delta itself.
    pub(crate) fn clear_delta(&mut self, worker: u64) -> Option<Delta> {
        let event = RouterEvent {
            source: SourceId::new(worker, 0),
            event_id: 0,
            payload: EventPayload::AllCleared,
        };
        self.filter.apply(&event).expect("apply");
        self.filter.take_delta().expect("delta")
    }

    fn delta_frame(&self, delta: &Delta) -> kvrelay_codec::v1::PoolFrame {
        let bytes = self.encoder.delta(delta, 0).expect("encode delta");
        decode_pool_frame(&mut BytesMut::from(&bytes[..]))
    }

    /// The snapshot chunk frames at the current sequence (pending changes must have been
    /// taken as deltas already).
    pub(crate) fn snapshot_frames(&mut self) -> Vec<kvrelay_codec::v1::PoolFrame> {
        assert!(
            self.filter.take_delta().expect("tail").is_none(),
            "pending changes"
        );
        let sequence = self.filter.sequence();
        let table = self.filter.words().to_vec();
        (0..snapshot_chunk_count(table.len() as u64))
            .map(|chunk_index| {
                let bytes = self
                    .encoder
                    .snapshot_chunk(sequence, &table, chunk_index, 0)
                    .expect("chunk");
                decode_pool_frame(&mut BytesMut::from(&bytes[..]))
            })
            .collect()
    }

    /// A heartbeat at `sequence`.
    pub(crate) fn heartbeat(&self, sequence: u64) -> kvrelay_codec::v1::PoolFrame {
        let bytes = self.encoder.heartbeat(sequence, 0).expect("heartbeat");
        decode_pool_frame(&mut BytesMut::from(&bytes[..]))
    }
}

/// A relay identity for sans-IO tests.
pub(crate) fn relay_identity(incarnation: u64) -> RelayIdentity {
    RelayIdentity {
        drt_instance_id: 7,
        relay_incarnation: incarnation,
    }
}

/// The catalog of `producers` at `revision`.
pub(crate) fn catalog_of(
    relay: RelayIdentity,
    revision: u64,
    producers: &[&Producer],
) -> CatalogUpdate {
    CatalogUpdate {
        relay,
        revision,
        pools: producers.iter().map(|p| p.descriptor.clone()).collect(),
        coverage: Vec::new(),
        stalled: Vec::new(),
        tier_lanes: Vec::new(),
    }
}
