//! The discovery scope: which namespaces one relay watches, and which endpoints it keeps.
//!
//! Request-facing model and adapter names must be unique across the whole scope: a relay
//! federates independently owned endpoints, so a name claimed by two targets is omitted
//! everywhere (see [`crate::MembershipProjection`]).

use std::collections::HashSet;

use kvrelay_identity::EndpointId;

use crate::instance::DiscoveryQuery;

/// Which endpoints one relay supervises. Validate with [`DiscoveryScope::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoveryScope {
    /// Namespaces to watch (one server-side query each). Exclusive with `watch_all`.
    pub namespaces: Vec<String>,
    /// Keep only endpoints under one of these `ns[.component[.endpoint]]` prefixes; empty
    /// keeps every endpoint.
    pub endpoint_prefixes: Vec<String>,
    /// Watch every namespace in the store.
    pub watch_all: bool,
}

/// Why a discovery scope was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryScopeError {
    /// Neither a namespace nor `watch_all` was given.
    #[error("discovery scope needs at least one namespace or watch_all")]
    NoScope,
    /// Both namespaces and `watch_all` were given.
    #[error("discovery watch_all cannot be combined with namespaces {namespaces:?}")]
    WatchAllWithNamespaces {
        /// The namespaces given alongside `watch_all`.
        namespaces: Vec<String>,
    },
    /// A namespace is empty or only whitespace.
    #[error("discovery namespace must not be empty")]
    EmptyNamespace,
    /// A namespace has leading or trailing whitespace.
    #[error("discovery namespace {namespace:?} has surrounding whitespace")]
    NamespaceWhitespace {
        /// The offending namespace.
        namespace: String,
    },
    /// A namespace is listed twice.
    #[error("discovery namespace {namespace:?} is listed twice")]
    DuplicateNamespace {
        /// The repeated namespace.
        namespace: String,
    },
    /// An endpoint prefix is empty or only whitespace.
    #[error("endpoint prefix must not be empty")]
    EmptyPrefix,
    /// An endpoint prefix has leading or trailing whitespace.
    #[error("endpoint prefix {prefix:?} has surrounding whitespace")]
    PrefixWhitespace {
        /// The offending prefix.
        prefix: String,
    },
    /// An endpoint prefix is listed twice.
    #[error("endpoint prefix {prefix:?} is listed twice")]
    DuplicatePrefix {
        /// The repeated prefix.
        prefix: String,
    },
    /// An endpoint prefix lies outside every configured namespace.
    #[error("endpoint prefix {prefix:?} is outside the configured namespaces")]
    PrefixOutsideNamespaces {
        /// The offending prefix.
        prefix: String,
    },
}

impl DiscoveryScope {
    /// Checks the scope rules: namespaces xor `watch_all`; entries non-empty, without
    /// surrounding whitespace and unique; each prefix equal to a namespace or starting with
    /// `<namespace>.` (any prefix is allowed with `watch_all`).
    pub fn validate(&self) -> Result<(), DiscoveryScopeError> {
        if !self.watch_all && self.namespaces.is_empty() {
            return Err(DiscoveryScopeError::NoScope);
        }
        if self.watch_all && !self.namespaces.is_empty() {
            return Err(DiscoveryScopeError::WatchAllWithNamespaces {
                namespaces: self.namespaces.clone(),
            });
        }
        let mut seen = HashSet::new();
        for namespace in &self.namespaces {
            if namespace.trim().is_empty() {
                return Err(DiscoveryScopeError::EmptyNamespace);
            }
            if namespace.trim() != namespace {
                return Err(DiscoveryScopeError::NamespaceWhitespace {
                    namespace: namespace.clone(),
                });
            }
            if !seen.insert(namespace) {
                return Err(DiscoveryScopeError::DuplicateNamespace {
                    namespace: namespace.clone(),
                });
            }
        }
        let mut seen = HashSet::new();
        for prefix in &self.endpoint_prefixes {
            if prefix.trim().is_empty() {
                return Err(DiscoveryScopeError::EmptyPrefix);
            }
            if prefix.trim() != prefix {
                return Err(DiscoveryScopeError::PrefixWhitespace {
                    prefix: prefix.clone(),
                });
            }
            if !seen.insert(prefix) {
                return Err(DiscoveryScopeError::DuplicatePrefix {
                    prefix: prefix.clone(),
                });
            }
            let inside = self.watch_all
                || self.namespaces.iter().any(|namespace| {
                    prefix
                        .strip_prefix(namespace.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
                });
            if !inside {
                return Err(DiscoveryScopeError::PrefixOutsideNamespaces {
                    prefix: prefix.clone(),
                });
            }
        }
        Ok(())
    }

    /// The server-side queries: `AllModels` for `watch_all`, else one per namespace.
    pub fn queries(&self) -> Vec<DiscoveryQuery> {
        if self.watch_all {
            vec![DiscoveryQuery::AllModels]
        } else {
            self.namespaces
                .iter()
                .map(|namespace| DiscoveryQuery::NamespacedModels {
                    namespace: namespace.clone(),
                })
                .collect()
        }
    }

    /// The client-side endpoint filter built from `endpoint_prefixes`.
    pub fn filter(&self) -> EndpointFilter {
        EndpointFilter {
            prefixes: self
                .endpoint_prefixes
                .iter()
                .map(|prefix| prefix.split('.').map(str::to_owned).collect())
                .collect(),
        }
    }
}

/// Keeps endpoints whose leading `(namespace, component, name)` segments equal one of the
/// prefixes' `.`-separated segments (whole segments: `prod.back` does not keep
/// `prod.backend`). An empty filter keeps everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointFilter {
    prefixes: Vec<Vec<String>>,
}

impl EndpointFilter {
    /// Whether the endpoint is in scope.
    pub fn matches(&self, endpoint: &EndpointId) -> bool {
        if self.prefixes.is_empty() {
            return true;
        }
        let parts = [endpoint.namespace(), endpoint.component(), endpoint.name()];
        self.prefixes.iter().any(|prefix| {
            prefix.len() <= parts.len()
                && prefix
                    .iter()
                    .zip(parts)
                    .all(|(expected, actual)| expected == actual)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(ns: &str, component: &str, name: &str) -> EndpointId {
        EndpointId::new(ns, component, name).unwrap()
    }

    fn config(namespaces: &[&str], prefixes: &[&str], watch_all: bool) -> DiscoveryScope {
        DiscoveryScope {
            namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
            endpoint_prefixes: prefixes.iter().map(|s| (*s).to_owned()).collect(),
            watch_all,
        }
    }

    // spec: discovery_scope_requires_explicit_namespaces_or_watch_all
    #[test]
    fn scope_needs_namespaces_or_watch_all() {
        assert_eq!(
            DiscoveryScope::default().validate(),
            Err(DiscoveryScopeError::NoScope)
        );
        let all = config(&[], &[], true);
        assert_eq!(all.validate(), Ok(()));
        assert_eq!(all.queries(), vec![DiscoveryQuery::AllModels]);
    }

    #[test]
    fn watch_all_with_namespaces_is_rejected() {
        assert!(matches!(
            config(&["a"], &[], true).validate(),
            Err(DiscoveryScopeError::WatchAllWithNamespaces { .. })
        ));
    }

    // spec: discovery_scope_uses_one_server_side_query_per_namespace
    #[test]
    fn one_query_per_namespace_and_whole_segment_prefix_filter() {
        let scope = config(&["prod-a", "prod-b"], &["prod-a.backend"], false);
        assert_eq!(scope.validate(), Ok(()));
        assert_eq!(
            scope.queries(),
            vec![
                DiscoveryQuery::NamespacedModels {
                    namespace: "prod-a".into()
                },
                DiscoveryQuery::NamespacedModels {
                    namespace: "prod-b".into()
                },
            ]
        );
        let filter = scope.filter();
        assert!(filter.matches(&endpoint("prod-a", "backend", "generate")));
        assert!(!filter.matches(&endpoint("prod-a", "backend2", "generate")));
        assert!(!filter.matches(&endpoint("prod-b", "backend", "generate")));
    }

    #[test]
    fn prefix_matches_whole_segments_only() {
        let filter = config(&["prod"], &["prod.back"], false).filter();
        assert!(!filter.matches(&endpoint("prod", "backend", "generate")));
        let full = config(&["prod"], &["prod.backend.generate"], false).filter();
        assert!(full.matches(&endpoint("prod", "backend", "generate")));
        assert!(!full.matches(&endpoint("prod", "backend", "prefill")));
        let too_long = config(&["prod"], &["prod.backend.generate.x"], false).filter();
        assert!(!too_long.matches(&endpoint("prod", "backend", "generate")));
    }

    #[test]
    fn empty_filter_keeps_everything() {
        assert!(EndpointFilter::default().matches(&endpoint("a", "b", "c")));
    }

    // spec: discovery_scope_rejects_prefix_outside_assigned_namespaces
    #[test]
    fn prefix_outside_namespaces_is_rejected() {
        assert_eq!(
            config(&["prod-a"], &["prod-b.backend"], false).validate(),
            Err(DiscoveryScopeError::PrefixOutsideNamespaces {
                prefix: "prod-b.backend".into()
            })
        );
        // A namespace that is a string prefix but not a segment prefix is outside too.
        assert!(
            config(&["prod"], &["prod-a.backend"], false)
                .validate()
                .is_err()
        );
        assert_eq!(config(&["prod"], &["prod"], false).validate(), Ok(()));
        assert_eq!(config(&[], &["anything.x"], true).validate(), Ok(()));
    }

    // spec: discovery_scope_rejects_surrounding_whitespace
    #[test]
    fn surrounding_whitespace_is_rejected() {
        assert!(matches!(
            config(&[" prod-a"], &[], false).validate(),
            Err(DiscoveryScopeError::NamespaceWhitespace { .. })
        ));
        assert!(matches!(
            config(&["prod-a"], &["prod-a.backend "], false).validate(),
            Err(DiscoveryScopeError::PrefixWhitespace { .. })
        ));
    }

    #[test]
    fn empty_and_duplicate_entries_are_rejected() {
        assert_eq!(
            config(&[""], &[], false).validate(),
            Err(DiscoveryScopeError::EmptyNamespace)
        );
        assert!(matches!(
            config(&["a", "a"], &[], false).validate(),
            Err(DiscoveryScopeError::DuplicateNamespace { .. })
        ));
        assert_eq!(
            config(&["a"], &[" "], false).validate(),
            Err(DiscoveryScopeError::EmptyPrefix)
        );
        assert!(matches!(
            config(&["a"], &["a.b", "a.b"], false).validate(),
            Err(DiscoveryScopeError::DuplicatePrefix { .. })
        ));
    }
}
