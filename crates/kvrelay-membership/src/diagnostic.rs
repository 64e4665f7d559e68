//! Soft discovery errors: inputs the projection skips without fencing anything.
//!
//! Each distinct cause is reported once while it persists (again only after it went away
//! and came back), drained by the caller with [`crate::MembershipProjection::poll_diagnostic`]
//! and counted in [`ProjectionStats`].

use std::fmt;

use crate::instance::ModelCardInstanceId;

/// A soft error found while reading or projecting cards.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Diagnostic {
    /// The card JSON does not decode as a model deployment card; the card is skipped.
    MalformedCard {
        /// Which card.
        card: ModelCardInstanceId,
        /// The decoder's message.
        reason: String,
    },
    /// The card's namespace, component or endpoint is empty or padded; the card is skipped.
    InvalidEndpoint {
        /// Which card.
        card: ModelCardInstanceId,
    },
    /// A model, served adapter or runtime adapter name is invalid, or the card's LoRA
    /// identity and metadata disagree; the binding is skipped.
    InvalidModel {
        /// Which card.
        card: ModelCardInstanceId,
        /// The rejected name.
        name: String,
    },
    /// The card's KV query semantics are invalid (block size 0); its pool is fenced.
    InvalidQuerySemantics {
        /// Which card.
        card: ModelCardInstanceId,
        /// The card's block size.
        kv_block_size: u32,
    },
    /// An alias is invalid and was dropped.
    InvalidAlias {
        /// Which card.
        card: ModelCardInstanceId,
        /// The rejected alias.
        alias: String,
    },
    /// An adapter card whose worker publishes no base card; ignored.
    OrphanAdapter {
        /// Which card.
        card: ModelCardInstanceId,
    },
    /// A request-facing name claimed by different targets in the watch scope; omitted from
    /// every endpoint (names must be unique across all watched namespaces).
    AmbiguousName {
        /// The name.
        name: String,
    },
    /// A taint update for a card the projection does not hold; ignored.
    UnknownTaintTarget {
        /// Which card.
        card: ModelCardInstanceId,
    },
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MalformedCard { card, reason } => {
                write!(f, "card {card} is malformed and ignored: {reason}")
            }
            Self::InvalidEndpoint { card } => {
                write!(f, "card {card} names an invalid endpoint and is ignored")
            }
            Self::InvalidModel { card, name } => {
                write!(
                    f,
                    "card {card} has invalid model identity {name:?}; binding ignored"
                )
            }
            Self::InvalidQuerySemantics {
                card,
                kv_block_size,
            } => write!(
                f,
                "card {card} has kv block size {kv_block_size}, expected nonzero; pool fenced"
            ),
            Self::InvalidAlias { card, alias } => {
                write!(f, "card {card} has invalid alias {alias:?}; alias ignored")
            }
            Self::OrphanAdapter { card } => {
                write!(
                    f,
                    "adapter card {card} has no base card on its worker; ignored"
                )
            }
            Self::AmbiguousName { name } => write!(
                f,
                "request-facing name {name:?} resolves to conflicting targets; omitted everywhere"
            ),
            Self::UnknownTaintTarget { card } => {
                write!(f, "taint update for unknown card {card} ignored")
            }
        }
    }
}

/// Counters of the projection's work and of soft errors (each distinct cause counted once
/// per appearance).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProjectionStats {
    /// Endpoints re-projected from their cards (the incremental unit of work).
    pub endpoint_projections: u64,
    /// Calls to `project` that found work to do.
    pub projections: u64,
    /// Malformed cards seen.
    pub malformed_cards: u64,
    /// Cards with an invalid endpoint triple.
    pub invalid_endpoints: u64,
    /// Invalid model or adapter names (and LoRA shape mismatches).
    pub invalid_models: u64,
    /// Cards with invalid query semantics.
    pub invalid_query_semantics: u64,
    /// Invalid aliases dropped.
    pub invalid_aliases: u64,
    /// Orphan adapter cards.
    pub orphan_adapters: u64,
    /// Ambiguous request-facing names.
    pub ambiguous_names: u64,
    /// Taint updates for unknown cards.
    pub unknown_taint_targets: u64,
    /// Diagnostics dropped because the caller did not drain them (bounded queue).
    pub diagnostics_dropped: u64,
}

impl ProjectionStats {
    pub(crate) fn count(&mut self, diagnostic: &Diagnostic) {
        let counter = match diagnostic {
            Diagnostic::MalformedCard { .. } => &mut self.malformed_cards,
            Diagnostic::InvalidEndpoint { .. } => &mut self.invalid_endpoints,
            Diagnostic::InvalidModel { .. } => &mut self.invalid_models,
            Diagnostic::InvalidQuerySemantics { .. } => &mut self.invalid_query_semantics,
            Diagnostic::InvalidAlias { .. } => &mut self.invalid_aliases,
            Diagnostic::OrphanAdapter { .. } => &mut self.orphan_adapters,
            Diagnostic::AmbiguousName { .. } => &mut self.ambiguous_names,
            Diagnostic::UnknownTaintTarget { .. } => &mut self.unknown_taint_targets,
        };
        *counter = counter.saturating_add(1);
    }
}
