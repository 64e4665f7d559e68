//! The consumer's view of the relays' catalogs: supported pool entries and quarantined ones.
//!
//! Entries are the consumer-side projection of catalog descriptors, reduced to what
//! scoring needs: where the pool lives (relay, namespace, endpoint), what it serves
//! (registrations), how its keys are hashed (query semantics) and which roles it plays.
//! A [`PoolKey`] names one producer generation inside this consumer; a new generation of
//! the same pool gets a new key, so nothing keyed by an old generation can leak into it.

use std::sync::Arc;

use kvrelay_identity::KvQueryHashFormat;

/// A consumer-local handle of one producer generation (one pool replica slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey(pub(crate) u64);

impl PoolKey {
    /// The raw key, for logs.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// What a registration serves: a base model or a LoRA adapter on a base model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Target {
    /// The base model itself.
    Base,
    /// A LoRA adapter on `base_model`; requests hash with the adapter name as salt.
    Lora { base_model: String, adapter: String },
}

/// One model a pool serves, under its canonical id and aliases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registration {
    pub(crate) model: String,
    pub(crate) target: Target,
    pub(crate) aliases: Vec<String>,
}

/// The roles a pool plays, as flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Roles {
    pub(crate) prefill: bool,
    pub(crate) decode: bool,
    /// Aggregated, or legacy (a card without a worker type serves whole requests).
    pub(crate) aggregated: bool,
}

/// One supported catalog entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PoolEntry {
    pub(crate) key: PoolKey,
    /// Index of the relay (in the configuration) that published it.
    pub(crate) relay: usize,
    /// The pool id as text, for output.
    pub(crate) pool_label: Arc<str>,
    /// The serving endpoint's namespace: prefill/decode pairs form within one namespace.
    pub(crate) namespace: String,
    /// The serving endpoint as `namespace.component.endpoint`.
    pub(crate) endpoint: Arc<str>,
    pub(crate) registrations: Vec<Registration>,
    pub(crate) block_size: u32,
    pub(crate) hash_format: KvQueryHashFormat,
    pub(crate) roles: Roles,
}

/// A catalog entry that was not admitted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedEntry {
    /// The relay's DC name.
    pub dc: String,
    /// The entry's pool id text when it could be read, else its position in the catalog.
    pub entry: String,
    /// Why it was quarantined.
    pub reason: String,
}
