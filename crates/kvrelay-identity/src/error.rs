//! [`IdentityError`]: any identity validation failure, for callers that validate several
//! identity types in one step.

use crate::dc::DcIdParseError;
use crate::endpoint::EndpointIdError;
use crate::format::CkfFormatError;
use crate::model::ModelNameError;
use crate::producer::ProducerIdentityError;
use crate::query::KvQuerySemanticsError;
use crate::relay::DcRelayIdentityError;
use crate::role::WorkerRoleParseError;
use crate::spec::IdentityMapError;

/// Any identity validation failure; each variant wraps the finer per-type error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// An explicit identity map was invalid.
    #[error(transparent)]
    IdentityMap(#[from] IdentityMapError),
    /// An endpoint triple was invalid.
    #[error(transparent)]
    Endpoint(#[from] EndpointIdError),
    /// A model name or alias was invalid.
    #[error(transparent)]
    ModelName(#[from] ModelNameError),
    /// KV query semantics were invalid.
    #[error(transparent)]
    QuerySemantics(#[from] KvQuerySemanticsError),
    /// A CKF format was invalid.
    #[error(transparent)]
    CkfFormat(#[from] CkfFormatError),
    /// A producer identity was invalid.
    #[error(transparent)]
    Producer(#[from] ProducerIdentityError),
    /// A relay identity was invalid.
    #[error(transparent)]
    Relay(#[from] DcRelayIdentityError),
    /// A DC id did not parse.
    #[error(transparent)]
    DcId(#[from] DcIdParseError),
    /// A worker role did not parse.
    #[error(transparent)]
    WorkerRole(#[from] WorkerRoleParseError),
}
