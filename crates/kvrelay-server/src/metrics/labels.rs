//! The metrics' label sets: each a closed set of `&'static str` values, never remote
//! input.

use prometheus_client::encoding::EncodeLabelSet;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StreamLabel {
    pub(crate) stream: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RejectionLabels {
    pub(crate) stream: &'static str,
    pub(crate) scope: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    pub(crate) outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DispositionLabel {
    pub(crate) disposition: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct AcceptErrorLabels {
    /// `wan` or `admin`.
    pub(crate) listener: &'static str,
    /// `fd_limit` (EMFILE, ENFILE, ENOBUFS, ENOMEM) or `other`.
    pub(crate) kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StateLabel {
    pub(crate) state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RpcLabel {
    /// The contract's method name.
    pub(crate) rpc: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RpcReasonLabels {
    pub(crate) rpc: &'static str,
    pub(crate) reason: &'static str,
}

/// A lower cache tier (`host`, `disk`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TierLabel {
    pub(crate) tier: &'static str,
}

/// A part of the relay's memory (`kvrelay_memory_bytes{component}`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ComponentLabel {
    pub(crate) component: &'static str,
}

/// Every pool's and lane's producer state: its table, dirty window, exact ownership index
/// and lineage maps (read with the pools' health).
pub(crate) const MEMORY_POOL_FILTERS: ComponentLabel = ComponentLabel {
    component: "pool_filters",
};
/// The other parts, read from the publication hubs' and sources' gauges at each scrape.
pub(crate) const MEMORY_PUBLICATION_MIRRORS: ComponentLabel = ComponentLabel {
    component: "publication_mirrors",
};
pub(crate) const MEMORY_PINNED_SNAPSHOTS: ComponentLabel = ComponentLabel {
    component: "pinned_snapshots",
};
pub(crate) const MEMORY_RESUME_WINDOWS: ComponentLabel = ComponentLabel {
    component: "resume_windows",
};
pub(crate) const MEMORY_SUBSCRIBER_BACKLOGS: ComponentLabel = ComponentLabel {
    component: "subscriber_backlogs",
};
pub(crate) const MEMORY_INGEST_QUEUES: ComponentLabel = ComponentLabel {
    component: "ingest_queues",
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CategoryLabel {
    pub(crate) category: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CauseLabel {
    pub(crate) cause: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StartLabel {
    pub(crate) start: &'static str,
}
