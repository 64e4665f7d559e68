//! Which pools can serve a request: model-name resolution and candidate formation.
//!
//! A request names a model by canonical id or alias, optionally a LoRA adapter. The name
//! is resolved against the registrations of every supported entry of every relay; a name
//! that binds to more than one (model, target) pair anywhere is ambiguous and the request
//! gets no candidates (fail closed: we never guess which model a user meant).
//!
//! Candidates, per matching pool:
//! - a pool with the aggregated (or legacy) role is an **aggregated** candidate;
//! - a pool with the decode role pairs with every prefill-only pool serving the same
//!   target in the same relay and namespace, one **disaggregated** candidate per pair;
//!   without such a prefill pool it is a **decode-only** candidate (decode workers
//!   prefill locally);
//! - prefill-only pools are never candidates alone; encode-only pools are ignored.

use crate::catalog::{PoolEntry, Target};
use crate::scoring::ScoreError;

/// The resolved request target: what pools must register, and the LoRA hashing salt.
/// Borrows from the catalog entries and the request, so resolving allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved<'a> {
    /// Canonical model id of the base model (for a LoRA: its base).
    pub(crate) base_model: &'a str,
    /// The target pools must register.
    pub(crate) target: Wanted<'a>,
    /// The adapter name salting the block hashes, for LoRA targets.
    pub(crate) lora_salt: Option<&'a str>,
}

/// A borrowed [`Target`]: the registration a serving pool must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wanted<'a> {
    /// The base model itself.
    Base,
    /// A LoRA adapter on a base model.
    Lora {
        base_model: &'a str,
        adapter: &'a str,
    },
}

impl Wanted<'_> {
    /// Whether `target` is this one.
    pub(crate) fn is(self, target: &Target) -> bool {
        match (self, target) {
            (Self::Base, Target::Base) => true,
            (
                Self::Lora {
                    base_model,
                    adapter,
                },
                Target::Lora {
                    base_model: b,
                    adapter: a,
                },
            ) => base_model == b && adapter == a,
            _ => false,
        }
    }
}

/// The shape of a candidate deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CandidateShape {
    /// One pool serves whole requests.
    Aggregated,
    /// A prefill pool and a decode pool of one namespace serve the request together.
    Disaggregated,
    /// A decode pool without a prefill pool: it prefills locally.
    DecodeOnly,
}

impl CandidateShape {
    /// The snake_case name used in JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Aggregated => "aggregated",
            Self::Disaggregated => "disaggregated",
            Self::DecodeOnly => "decode_only",
        }
    }
}

/// One candidate: indices into the entry slice it was formed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) shape: CandidateShape,
    /// The aggregated, prefill or decode-only pool: the leg whose prefix is credited fully.
    pub(crate) first: usize,
    /// The decode pool of a disaggregated pair.
    pub(crate) decode: Option<usize>,
}

/// Resolves `model` (canonical id or alias) and optional `lora` against `entries`.
pub(crate) fn resolve<'a>(
    entries: &'a [PoolEntry],
    model: &str,
    lora: Option<&'a str>,
) -> Result<Resolved<'a>, ScoreError> {
    // Distinct bindings are one unless the name is ambiguous: remember the first and
    // collect the full list only on the (cold) ambiguous path.
    let mut first: Option<(&str, &Target)> = None;
    let mut ambiguous = false;
    for binding in bindings_of(entries, model) {
        match first {
            None => first = Some(binding),
            Some(seen) if seen != binding => ambiguous = true,
            Some(_) => {}
        }
    }
    let Some((canonical, target)) = first else {
        return Err(ScoreError::UnknownModel {
            model: model.to_owned(),
        });
    };
    if ambiguous {
        let mut bindings: Vec<(&str, &Target)> = Vec::new();
        for binding in bindings_of(entries, model) {
            if !bindings.contains(&binding) {
                bindings.push(binding);
            }
        }
        bindings.sort_unstable();
        return Err(ScoreError::AmbiguousModel {
            model: model.to_owned(),
            bindings: bindings.iter().map(|(m, t)| describe(m, t)).collect(),
        });
    }
    match (target, lora.filter(|name| !name.is_empty())) {
        (Target::Base, None) => Ok(Resolved {
            base_model: canonical,
            target: Wanted::Base,
            lora_salt: None,
        }),
        (Target::Base, Some(adapter)) => {
            let target = Wanted::Lora {
                base_model: canonical,
                adapter,
            };
            let served = entries
                .iter()
                .flat_map(|entry| &entry.registrations)
                .any(|reg| target.is(&reg.target));
            if !served {
                return Err(ScoreError::UnknownAdapter {
                    model: canonical.to_owned(),
                    adapter: adapter.to_owned(),
                });
            }
            Ok(Resolved {
                base_model: canonical,
                target,
                lora_salt: Some(adapter),
            })
        }
        (
            Target::Lora {
                base_model,
                adapter,
            },
            None,
        ) => Ok(Resolved {
            base_model,
            target: Wanted::Lora {
                base_model,
                adapter,
            },
            lora_salt: Some(adapter),
        }),
        (Target::Lora { .. }, Some(adapter)) => Err(ScoreError::AdapterOnAdapter {
            model: canonical.to_owned(),
            adapter: adapter.to_owned(),
        }),
    }
}

/// Whether `entry` registers the resolved target.
pub(crate) fn serves(entry: &PoolEntry, resolved: &Resolved<'_>) -> bool {
    entry.registrations.iter().any(|reg| match resolved.target {
        Wanted::Base => reg.target == Target::Base && reg.model == resolved.base_model,
        lora @ Wanted::Lora { .. } => lora.is(&reg.target),
    })
}

/// Forms the candidates for `resolved` from `entries`, in a deterministic order.
#[cfg(test)]
pub(crate) fn candidates(entries: &[PoolEntry], resolved: &Resolved<'_>) -> Vec<Candidate> {
    let mut out = Vec::new();
    candidates_into(entries, resolved, &mut Vec::new(), &mut out);
    out
}

/// Clears `out` and fills it with the candidates for `resolved` from `entries`, in a
/// deterministic order; `serving` is scratch space.
pub(crate) fn candidates_into(
    entries: &[PoolEntry],
    resolved: &Resolved<'_>,
    serving: &mut Vec<usize>,
    out: &mut Vec<Candidate>,
) {
    serving.clear();
    serving.extend((0..entries.len()).filter(|&idx| serves(&entries[idx], resolved)));
    out.clear();
    for &idx in serving.iter() {
        let entry = &entries[idx];
        if entry.roles.aggregated {
            out.push(Candidate {
                shape: CandidateShape::Aggregated,
                first: idx,
                decode: None,
            });
        } else if entry.roles.decode {
            let mut paired = false;
            for &other in serving.iter() {
                let prefill = &entries[other];
                let prefill_only =
                    prefill.roles.prefill && !prefill.roles.decode && !prefill.roles.aggregated;
                if prefill_only
                    && prefill.relay == entry.relay
                    && prefill.namespace == entry.namespace
                {
                    out.push(Candidate {
                        shape: CandidateShape::Disaggregated,
                        first: other,
                        decode: Some(idx),
                    });
                    paired = true;
                }
            }
            if !paired {
                out.push(Candidate {
                    shape: CandidateShape::DecodeOnly,
                    first: idx,
                    decode: None,
                });
            }
        }
    }
}

/// Every (canonical model, target) binding of `model` as a name or alias, with repeats.
fn bindings_of<'a>(
    entries: &'a [PoolEntry],
    model: &str,
) -> impl Iterator<Item = (&'a str, &'a Target)> {
    entries
        .iter()
        .flat_map(|entry| &entry.registrations)
        .filter(move |reg| reg.model == model || reg.aliases.iter().any(|alias| alias == model))
        .map(|reg| (reg.model.as_str(), &reg.target))
}

fn describe(model: &str, target: &Target) -> String {
    match target {
        Target::Base => model.to_owned(),
        Target::Lora {
            base_model,
            adapter,
        } => format!("{model} (lora {adapter} on {base_model})"),
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_identity::KvQueryHashFormat;

    use super::*;
    use crate::catalog::{PoolKey, Registration, Roles};

    pub(crate) fn entry(
        key: u64,
        relay: usize,
        ns: &str,
        roles: Roles,
        regs: Vec<Registration>,
    ) -> PoolEntry {
        PoolEntry {
            key: PoolKey(key),
            pool_id: crate::catalog::test_pool_id(key),
            format_twin: None,
            relay,
            pool_label: format!("pool-{key}").into(),
            namespace: ns.to_owned(),
            endpoint: format!("{ns}.worker.generate").into(),
            registrations: regs,
            block_size: 4,
            hash_format: KvQueryHashFormat::DynamoStandardV1,
            roles,
            coverage: crate::catalog::Coverage::Complete,
            tier_lanes: Vec::new(),
        }
    }

    fn base(model: &str, aliases: &[&str]) -> Registration {
        Registration {
            model: model.to_owned(),
            target: Target::Base,
            aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    fn lora(model: &str, base_model: &str, adapter: &str) -> Registration {
        Registration {
            model: model.to_owned(),
            target: Target::Lora {
                base_model: base_model.to_owned(),
                adapter: adapter.to_owned(),
            },
            aliases: Vec::new(),
        }
    }

    const AGG: Roles = Roles {
        prefill: false,
        decode: false,
        aggregated: true,
    };
    const PREFILL: Roles = Roles {
        prefill: true,
        decode: false,
        aggregated: false,
    };
    const DECODE: Roles = Roles {
        prefill: false,
        decode: true,
        aggregated: false,
    };

    #[test]
    fn alias_resolves_to_its_canonical_model() {
        let entries = vec![entry(1, 0, "a", AGG, vec![base("llama-8b", &["llama"])])];
        let resolved = resolve(&entries, "llama", None).unwrap();
        assert_eq!(resolved.base_model, "llama-8b");
        assert_eq!(resolved.target, Wanted::Base);
        assert_eq!(resolved.lora_salt, None);
    }

    #[test]
    fn alias_bound_to_two_models_across_relays_is_ambiguous() {
        let entries = vec![
            entry(1, 0, "a", AGG, vec![base("llama-8b", &["llama"])]),
            entry(2, 1, "b", AGG, vec![base("llama-70b", &["llama"])]),
        ];
        let err = resolve(&entries, "llama", None).unwrap_err();
        assert!(
            matches!(err, ScoreError::AmbiguousModel { ref bindings, .. } if bindings.len() == 2)
        );
        // The canonical names themselves stay usable.
        assert!(resolve(&entries, "llama-70b", None).is_ok());
    }

    #[test]
    fn name_that_is_a_model_and_another_models_alias_is_ambiguous() {
        let entries = vec![
            entry(1, 0, "a", AGG, vec![base("qwen", &[])]),
            entry(2, 1, "b", AGG, vec![base("qwen-7b", &["qwen"])]),
        ];
        assert!(matches!(
            resolve(&entries, "qwen", None),
            Err(ScoreError::AmbiguousModel { .. })
        ));
    }

    #[test]
    fn unknown_model_is_reported() {
        let entries = vec![entry(1, 0, "a", AGG, vec![base("m", &[])])];
        assert_eq!(
            resolve(&entries, "other", None),
            Err(ScoreError::UnknownModel {
                model: "other".into()
            })
        );
    }

    #[test]
    fn lora_flag_selects_the_adapter_registration_on_its_base_pool() {
        let entries = vec![
            entry(
                1,
                0,
                "a",
                AGG,
                vec![base("m", &[]), lora("m-sql", "m", "sql")],
            ),
            entry(2, 1, "b", AGG, vec![base("m", &[])]),
        ];
        let resolved = resolve(&entries, "m", Some("sql")).unwrap();
        assert_eq!(resolved.lora_salt, Some("sql"));
        let cands = candidates(&entries, &resolved);
        assert_eq!(
            cands.len(),
            1,
            "only the pool registering the adapter serves it"
        );
        assert_eq!(cands[0].first, 0);
    }

    #[test]
    fn lora_model_name_resolves_to_its_adapter_and_base() {
        let entries = vec![entry(
            1,
            0,
            "a",
            AGG,
            vec![base("m", &[]), lora("m-sql", "m", "sql")],
        )];
        let resolved = resolve(&entries, "m-sql", None).unwrap();
        assert_eq!(resolved.base_model, "m");
        assert_eq!(resolved.lora_salt, Some("sql"));
        assert_eq!(candidates(&entries, &resolved).len(), 1);
    }

    #[test]
    fn unknown_adapter_is_reported() {
        let entries = vec![entry(1, 0, "a", AGG, vec![base("m", &[])])];
        assert_eq!(
            resolve(&entries, "m", Some("sql")),
            Err(ScoreError::UnknownAdapter {
                model: "m".into(),
                adapter: "sql".into()
            })
        );
    }

    #[test]
    fn adapter_on_an_adapter_is_rejected() {
        let entries = vec![entry(1, 0, "a", AGG, vec![lora("m-sql", "m", "sql")])];
        assert!(matches!(
            resolve(&entries, "m-sql", Some("x")),
            Err(ScoreError::AdapterOnAdapter { .. })
        ));
    }

    #[test]
    fn prefill_and_decode_pools_of_one_namespace_pair_up() {
        let entries = vec![
            entry(1, 0, "ns", PREFILL, vec![base("m", &[])]),
            entry(2, 0, "ns", DECODE, vec![base("m", &[])]),
            entry(3, 0, "other", PREFILL, vec![base("m", &[])]),
            entry(4, 1, "ns", PREFILL, vec![base("m", &[])]),
        ];
        let resolved = resolve(&entries, "m", None).unwrap();
        let cands = candidates(&entries, &resolved);
        assert_eq!(
            cands,
            vec![Candidate {
                shape: CandidateShape::Disaggregated,
                first: 0,
                decode: Some(1)
            }],
            "pairs never cross namespaces or relays; lone prefill pools are no candidates"
        );
    }

    #[test]
    fn decode_pool_without_prefill_is_a_decode_only_candidate() {
        let entries = vec![entry(1, 0, "ns", DECODE, vec![base("m", &[])])];
        let resolved = resolve(&entries, "m", None).unwrap();
        let cands = candidates(&entries, &resolved);
        assert_eq!(cands[0].shape, CandidateShape::DecodeOnly);
    }

    #[test]
    fn pools_not_serving_the_model_are_not_candidates() {
        let entries = vec![
            entry(1, 0, "a", AGG, vec![base("m", &[])]),
            entry(2, 0, "b", AGG, vec![base("n", &[])]),
        ];
        let resolved = resolve(&entries, "m", None).unwrap();
        assert_eq!(candidates(&entries, &resolved).len(), 1);
    }
}
