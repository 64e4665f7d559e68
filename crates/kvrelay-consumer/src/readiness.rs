//! Serving readiness from the relays' topology streams: whether a candidate's serving
//! entry (namespace, canonical base model, and LoRA adapter if any) can take requests.
//!
//! The rule, per candidate (both legs of a pair share a relay and a namespace):
//! - the relay's topology entry for (pool namespace, base model) is `unavailable`, or
//!   the adapter's entry under it is: the candidate is **excluded**;
//! - both are `ready`: the candidate is [`CandidateReadiness::Ready`];
//! - anything else (no topology from that relay yet or any more, no entry for the key,
//!   an entry or adapter in state `unknown`, an entry that failed validation): the
//!   candidate is kept and marked [`CandidateReadiness::Unknown`]. Topology and catalog arrive on
//!   separate streams, so a missing entry is treated as not known, never as not ready.

use hashbrown::HashMap;
use kvrelay_codec::v1::{ReadinessState, TopologyUpdate};

/// Whether a ranked candidate's serving entry is known to be ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CandidateReadiness {
    /// The relay's topology says the entry (and adapter, if any) is ready.
    Ready,
    /// Not known: no topology yet, no entry, or an entry in state unknown.
    #[default]
    Unknown,
}

impl CandidateReadiness {
    /// The snake_case name used in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Unknown => "unknown",
        }
    }
}

/// The verdict of the readiness rule for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Keep, marked with this readiness.
    Keep(CandidateReadiness),
    /// Exclude: the topology says it cannot serve.
    Exclude,
}

/// One relay's last topology, reduced to states by (namespace, base model).
#[derive(Debug, Default)]
pub(crate) struct TopologyView {
    /// Namespace → base model → entry readiness; `None` marks a key that failed
    /// validation or appeared twice (unknown).
    by_namespace: HashMap<String, HashMap<String, Option<EntryReadiness>>>,
}

#[derive(Debug)]
struct EntryReadiness {
    state: ReadinessState,
    /// Adapter canonical model id → state.
    adapters: Vec<(String, ReadinessState)>,
}

impl TopologyView {
    /// Builds the view of `update`; returns it with the number of entries that failed
    /// validation (they read as unknown).
    pub(crate) fn from_update(update: &TopologyUpdate) -> (Self, usize) {
        let mut view = Self::default();
        let mut n_invalid = 0;
        for entry in &update.entries {
            let valid = entry.validate().is_ok();
            if !valid {
                n_invalid += 1;
            }
            let models = view
                .by_namespace
                .entry(entry.namespace.clone())
                .or_default();
            let readiness = valid.then(|| EntryReadiness {
                state: entry.state,
                adapters: entry
                    .adapters
                    .iter()
                    .map(|a| (a.canonical_model.clone(), a.state))
                    .collect(),
            });
            match models.entry(entry.canonical_model.clone()) {
                hashbrown::hash_map::Entry::Vacant(slot) => {
                    slot.insert(readiness);
                }
                // A repeated key is not trustworthy: unknown.
                hashbrown::hash_map::Entry::Occupied(mut slot) => {
                    slot.insert(None);
                }
            }
        }
        (view, n_invalid)
    }

    /// The rule (see the module docs) for `namespace` and `base_model`, with the LoRA
    /// adapter's canonical model id when the request targets one.
    pub(crate) fn verdict(
        &self,
        namespace: &str,
        base_model: &str,
        adapter: Option<&str>,
    ) -> Verdict {
        let Some(Some(entry)) = self
            .by_namespace
            .get(namespace)
            .and_then(|models| models.get(base_model))
        else {
            return Verdict::Keep(CandidateReadiness::Unknown);
        };
        let adapter_state = match adapter {
            None => Some(ReadinessState::Ready),
            Some(model) => entry
                .adapters
                .iter()
                .find(|(name, _)| name == model)
                .map(|(_, state)| *state),
        };
        combine(entry.state, adapter_state)
    }
}

/// The verdict for a candidate of `view`'s relay (`None`: no topology from it).
pub(crate) fn verdict_of(
    view: Option<&TopologyView>,
    namespace: &str,
    base_model: &str,
    adapter: Option<&str>,
) -> Verdict {
    match view {
        Some(view) => view.verdict(namespace, base_model, adapter),
        None => Verdict::Keep(CandidateReadiness::Unknown),
    }
}

fn combine(base: ReadinessState, adapter: Option<ReadinessState>) -> Verdict {
    let unavailable = |state: ReadinessState| state == ReadinessState::Unavailable;
    if unavailable(base) || adapter.is_some_and(unavailable) {
        return Verdict::Exclude;
    }
    if base == ReadinessState::Ready && adapter == Some(ReadinessState::Ready) {
        Verdict::Keep(CandidateReadiness::Ready)
    } else {
        Verdict::Keep(CandidateReadiness::Unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_base_or_adapter_excludes() {
        assert_eq!(
            combine(ReadinessState::Unavailable, Some(ReadinessState::Ready)),
            Verdict::Exclude
        );
        assert_eq!(
            combine(ReadinessState::Ready, Some(ReadinessState::Unavailable)),
            Verdict::Exclude
        );
        assert_eq!(
            combine(ReadinessState::Unknown, Some(ReadinessState::Unavailable)),
            Verdict::Exclude
        );
    }

    #[test]
    fn ready_needs_both_ready_else_unknown() {
        assert_eq!(
            combine(ReadinessState::Ready, Some(ReadinessState::Ready)),
            Verdict::Keep(CandidateReadiness::Ready)
        );
        assert_eq!(
            combine(ReadinessState::Unknown, Some(ReadinessState::Ready)),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
        assert_eq!(
            combine(ReadinessState::Ready, Some(ReadinessState::Unknown)),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
        assert_eq!(
            combine(ReadinessState::Ready, None),
            Verdict::Keep(CandidateReadiness::Unknown),
            "an unlisted adapter is unknown"
        );
    }

    #[test]
    fn no_topology_or_no_entry_is_unknown() {
        assert_eq!(
            verdict_of(None, "ns", "m", None),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
        let view = TopologyView::default();
        assert_eq!(
            view.verdict("ns", "m", None),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
    }

    fn update(entries: Vec<kvrelay_codec::v1::TopologyEntry>) -> TopologyUpdate {
        TopologyUpdate {
            relay: kvrelay_codec::v1::RelayIdentity {
                drt_instance_id: 1,
                relay_incarnation: 1,
            },
            revision: 1,
            entries,
        }
    }

    fn entry(
        namespace: &str,
        model: &str,
        state: ReadinessState,
        adapters: &[(&str, ReadinessState)],
    ) -> kvrelay_codec::v1::TopologyEntry {
        kvrelay_codec::v1::TopologyEntry {
            namespace: namespace.to_owned(),
            canonical_model: model.to_owned(),
            state,
            present_roles: Vec::new(),
            missing_roles: Vec::new(),
            members: Vec::new(),
            duplicate_role_endpoints: Vec::new(),
            legacy_fallback_active: false,
            adapters: adapters
                .iter()
                .map(|&(name, state)| kvrelay_codec::v1::AdapterReadiness {
                    canonical_model: name.to_owned(),
                    state,
                    missing_roles: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn adapter_state_is_looked_up_under_its_base_entry() {
        let (view, n_invalid) = TopologyView::from_update(&update(vec![entry(
            "prod",
            "m",
            ReadinessState::Ready,
            &[
                ("m-sql", ReadinessState::Ready),
                ("m-law", ReadinessState::Unavailable),
            ],
        )]));
        assert_eq!(n_invalid, 0);
        assert_eq!(
            view.verdict("prod", "m", None),
            Verdict::Keep(CandidateReadiness::Ready)
        );
        assert_eq!(
            view.verdict("prod", "m", Some("m-sql")),
            Verdict::Keep(CandidateReadiness::Ready)
        );
        assert_eq!(view.verdict("prod", "m", Some("m-law")), Verdict::Exclude);
        assert_eq!(
            view.verdict("prod", "m", Some("m-x")),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
        assert_eq!(
            view.verdict("other", "m", None),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
    }

    #[test]
    fn invalid_or_repeated_entries_read_as_unknown() {
        let mut inconsistent = entry("bad", "m", ReadinessState::Ready, &[]);
        inconsistent.missing_roles = vec![kvrelay_codec::v1::WorkerRole::Decode];
        let (view, n_invalid) = TopologyView::from_update(&update(vec![
            inconsistent,
            entry("twice", "m", ReadinessState::Unavailable, &[]),
            entry("twice", "m", ReadinessState::Unavailable, &[]),
        ]));
        assert_eq!(n_invalid, 1);
        assert_eq!(
            view.verdict("bad", "m", None),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
        assert_eq!(
            view.verdict("twice", "m", None),
            Verdict::Keep(CandidateReadiness::Unknown)
        );
    }
}
