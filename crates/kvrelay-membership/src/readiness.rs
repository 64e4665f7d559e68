//! The readiness evaluator: can a set of worker units serve a request?
//!
//! Same rules as the reference frontend's namespace evaluation: a legacy unit anywhere
//! switches to "ready iff anything is live"; otherwise every declared role must have a live
//! worker, and every live unit's needs (disjunctive normal form) must be met by present roles.

use std::collections::BTreeSet;

use kvrelay_identity::WorkerRole;

use crate::card::WorkerType;
use crate::membership::role_of;

/// Workers of one kind: same role, same needs (and surface), with how many are live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadinessUnit {
    /// The units' role; `None` for legacy workers.
    pub worker_type: Option<WorkerType>,
    /// How many of the unit's workers are live.
    pub n_live: usize,
    /// Roles the unit needs live, in disjunctive normal form.
    pub needs: Vec<Vec<WorkerType>>,
}

/// The verdict of [`evaluate_readiness`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readiness {
    /// Some unit is live and nothing is missing (or legacy fallback with a live unit).
    pub ready: bool,
    /// Roles with at least one live worker, sorted.
    pub present: Vec<WorkerRole>,
    /// Declared or needed roles without a live worker, sorted.
    pub missing: Vec<WorkerRole>,
    /// A legacy unit switched evaluation to "ready iff anything is live".
    pub legacy_fallback: bool,
}

/// Evaluates units; an empty list is not ready and not legacy.
///
/// ```
/// use kvrelay_membership::{evaluate_readiness, ReadinessUnit, WorkerType};
/// let units = [ReadinessUnit { worker_type: Some(WorkerType::Aggregated), n_live: 1, needs: vec![] }];
/// assert!(evaluate_readiness(&units).ready);
/// ```
pub fn evaluate_readiness(units: &[ReadinessUnit]) -> Readiness {
    let present: BTreeSet<WorkerType> = units
        .iter()
        .filter(|unit| unit.n_live > 0)
        .filter_map(|unit| unit.worker_type)
        .collect();
    let has_live = units.iter().any(|unit| unit.n_live > 0);
    let has_legacy = units.iter().any(|unit| unit.worker_type.is_none());
    let present_roles = roles(present.iter().copied());
    if has_legacy {
        return Readiness {
            ready: has_live,
            present: present_roles,
            missing: Vec::new(),
            legacy_fallback: true,
        };
    }
    let mut missing = BTreeSet::new();
    for unit in units {
        let Some(worker_type) = unit.worker_type else {
            continue;
        };
        if !present.contains(&worker_type) {
            missing.insert(worker_type);
        }
        if unit.n_live == 0 || unit.needs.is_empty() {
            continue;
        }
        let satisfied = unit
            .needs
            .iter()
            .any(|alternative| alternative.iter().all(|need| present.contains(need)));
        if !satisfied {
            missing.extend(
                unit.needs
                    .iter()
                    .flatten()
                    .filter(|need| !present.contains(need)),
            );
        }
    }
    Readiness {
        ready: has_live && missing.is_empty(),
        present: present_roles,
        missing: roles(missing.into_iter()),
        legacy_fallback: false,
    }
}

fn roles(types: impl Iterator<Item = WorkerType>) -> Vec<WorkerRole> {
    types
        .map(|worker_type| role_of(Some(worker_type)))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use WorkerType::{Aggregated, Decode, Encode, Prefill};

    fn unit(worker_type: WorkerType, n_live: usize, needs: Vec<Vec<WorkerType>>) -> ReadinessUnit {
        ReadinessUnit {
            worker_type: Some(worker_type),
            n_live,
            needs,
        }
    }

    #[test]
    fn aggregated_alone_is_ready() {
        let verdict = evaluate_readiness(&[unit(Aggregated, 1, vec![])]);
        assert!(verdict.ready);
        assert_eq!(verdict.present, [WorkerRole::Aggregated]);
    }

    #[test]
    fn prefill_and_decode_needing_each_other_are_ready_when_both_live() {
        let verdict = evaluate_readiness(&[
            unit(Prefill, 1, vec![vec![Decode]]),
            unit(Decode, 2, vec![vec![Prefill]]),
        ]);
        assert!(verdict.ready);
        assert!(verdict.missing.is_empty());
    }

    #[test]
    fn any_satisfied_alternative_meets_the_needs() {
        let verdict = evaluate_readiness(&[
            unit(Encode, 1, vec![vec![Prefill, Decode], vec![Aggregated]]),
            unit(Prefill, 1, vec![]),
            unit(Decode, 1, vec![]),
        ]);
        assert!(verdict.ready);
    }

    #[test]
    fn dead_decode_is_missing() {
        let verdict = evaluate_readiness(&[
            unit(Prefill, 1, vec![vec![Decode]]),
            unit(Decode, 0, vec![vec![Prefill]]),
        ]);
        assert!(!verdict.ready);
        assert_eq!(verdict.missing, [WorkerRole::Decode]);
    }

    #[test]
    fn dead_units_needs_are_ignored() {
        let verdict = evaluate_readiness(&[
            unit(Aggregated, 1, vec![]),
            unit(Encode, 0, vec![vec![Prefill]]),
        ]);
        assert!(!verdict.ready);
        assert_eq!(verdict.missing, [WorkerRole::Encode]);
    }

    #[test]
    fn unsatisfied_needs_report_every_absent_alternative_role() {
        let verdict = evaluate_readiness(&[unit(
            Encode,
            1,
            vec![vec![Prefill, Decode], vec![Aggregated]],
        )]);
        assert_eq!(
            verdict.missing,
            [
                WorkerRole::Prefill,
                WorkerRole::Decode,
                WorkerRole::Aggregated
            ]
        );
    }

    #[test]
    fn legacy_unit_falls_back_to_any_live_worker() {
        let legacy = ReadinessUnit {
            worker_type: None,
            n_live: 0,
            needs: vec![],
        };
        let verdict = evaluate_readiness(&[legacy.clone(), unit(Prefill, 1, vec![vec![Decode]])]);
        assert!(verdict.ready);
        assert!(verdict.legacy_fallback);
        assert!(verdict.missing.is_empty());
        assert!(!evaluate_readiness(&[legacy]).ready);
    }

    #[test]
    fn no_units_is_not_ready_and_not_legacy() {
        assert_eq!(evaluate_readiness(&[]), Readiness::default());
    }
}
