//! Validation of a pool's registrations and declared roles, before anything is reserved.
//!
//! Rules: at least one registration; no model twice (a second target for the same model
//! is a conflict); an alias may not name a canonical model of the same pool; an alias may
//! not be claimed by two models. Roles: at least one, none repeated.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_identity::{
    CanonicalModelId, CanonicalModelRegistration, ModelAlias, PoolId, WorkerRole,
};

use crate::error::RegistrationError;

/// Checks a pool's registrations.
pub(crate) fn validate_registrations(
    pool: PoolId,
    registrations: &[CanonicalModelRegistration],
) -> Result<(), RegistrationError> {
    if registrations.is_empty() {
        return Err(RegistrationError::NoRegistrations { pool });
    }
    let mut models = BTreeMap::new();
    for registration in registrations {
        if let Some(previous) =
            models.insert(registration.model().clone(), registration.target().clone())
        {
            if previous != *registration.target() {
                return Err(RegistrationError::ConflictingTargets {
                    model: registration.model().clone(),
                });
            }
            return Err(RegistrationError::DuplicateModel {
                model: registration.model().clone(),
            });
        }
    }
    let mut aliases: BTreeMap<&ModelAlias, &CanonicalModelId> = BTreeMap::new();
    for registration in registrations {
        for alias in registration.aliases() {
            if models.keys().any(|model| model.as_str() == alias.as_str()) {
                return Err(RegistrationError::AliasIsModel {
                    alias: alias.clone(),
                });
            }
            if let Some(owner) = aliases.insert(alias, registration.model())
                && owner != registration.model()
            {
                return Err(RegistrationError::AliasClaimedTwice {
                    alias: alias.clone(),
                    first: owner.clone(),
                    second: registration.model().clone(),
                });
            }
        }
    }
    Ok(())
}

/// Checks a pool's declared roles.
pub(crate) fn validate_roles(roles: &[WorkerRole]) -> Result<(), RegistrationError> {
    if roles.is_empty() {
        return Err(RegistrationError::NoRoles);
    }
    let mut unique = BTreeSet::new();
    for role in roles {
        if !unique.insert(*role) {
            return Err(RegistrationError::DuplicateRole { role: *role });
        }
    }
    Ok(())
}
