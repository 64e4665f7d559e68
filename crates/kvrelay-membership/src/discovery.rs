//! The [`Discovery`] trait: a store of card instances that can be listed and watched.
//!
//! Backends: [`crate::MemoryDiscovery`] (tests, embedding), [`crate::FileDiscovery`] (a
//! watched directory, the embedded default) and [`crate::EtcdDiscovery`].

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;

use crate::instance::{DiscoveryEvent, DiscoveryQuery, ModelCardInstance};

/// A boxed, sendable future returned by [`Discovery`] methods.
pub type DiscoveryFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, DiscoveryError>> + Send + 'a>>;

/// Why a discovery operation failed. Watches end with an error or close; callers rebind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The etcd cluster failed or could not be reached.
    #[error("etcd at {endpoints}: {reason}")]
    Etcd {
        /// The client endpoints, comma separated.
        endpoints: String,
        /// The client's message.
        reason: String,
    },
    /// The etcd watch was cancelled or compacted by the server.
    #[error("etcd watch on {prefix} cancelled: {reason}")]
    WatchCancelled {
        /// The watched key prefix.
        prefix: String,
        /// The server's reason.
        reason: String,
    },
    /// Reading the card directory failed.
    #[error("reading card directory {path}: {reason}")]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// The OS message.
        reason: String,
    },
    /// The backend is unavailable (a test double said so).
    #[error("discovery backend {backend} is unavailable")]
    Unavailable {
        /// Which backend.
        backend: &'static str,
    },
}

/// A source of card instances.
///
/// `list_and_watch` returns a consistent listing and a watch of every change after it, so
/// a caller that applies the listing with `replace_all` and then the events never misses
/// or double-counts a change.
pub trait Discovery: Send + Sync + 'static {
    /// The cards matching `query` now.
    fn list<'a>(&'a self, query: &'a DiscoveryQuery)
    -> DiscoveryFuture<'a, Vec<ModelCardInstance>>;

    /// The cards matching `query` now, and a watch of every later change to them.
    fn list_and_watch<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, (Vec<ModelCardInstance>, DiscoveryWatch)>;
}

/// A stream of discovery changes; it ends (or yields an error) when the backend's watch
/// fails, and the caller rebinds.
pub struct DiscoveryWatch {
    inner: Pin<Box<dyn Stream<Item = Result<DiscoveryEvent, DiscoveryError>> + Send>>,
}

impl DiscoveryWatch {
    /// Wraps a stream of events (for backends outside this crate).
    pub fn from_stream(
        stream: impl Stream<Item = Result<DiscoveryEvent, DiscoveryError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(stream),
        }
    }

    /// The next change; `None` when the watch closed.
    pub async fn next(&mut self) -> Option<Result<DiscoveryEvent, DiscoveryError>> {
        futures::StreamExt::next(&mut self.inner).await
    }
}

impl std::fmt::Debug for DiscoveryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiscoveryWatch").finish_non_exhaustive()
    }
}

impl Stream for DiscoveryWatch {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}
