//! The open file limit: raised from its soft value to the hard one at start (as the Go
//! runtime does), because a relay or router holds one descriptor per connection and the
//! common soft default (1,024) is below what their configured bounds allow.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Where a hard limit of "unlimited" leaves the soft one: Linux's default `nr_open`.
const UNLIMITED_CAP: u64 = 1 << 20;

/// The process's open file limit before and after [`raise_open_file_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpenFileLimit {
    /// The soft limit the process started with (`None`: unlimited).
    pub(crate) before: Option<u64>,
    /// The soft limit now (`None`: unlimited).
    pub(crate) now: Option<u64>,
    /// The hard limit (`None`: unlimited).
    pub(crate) hard: Option<u64>,
}

impl OpenFileLimit {
    /// Whether `demand` descriptors fit under the soft limit now.
    pub(crate) fn fits(&self, demand: u64) -> bool {
        self.now.is_none_or(|limit| demand <= limit)
    }
}

/// A limit as logged: its number, or `unlimited`.
pub(crate) fn shown(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), |limit| limit.to_string())
}

/// Raises the soft open file limit to the hard one (capped at 2^20 when the hard limit is
/// unlimited). A refusal leaves the limit as it was; the caller reports what it got.
pub(crate) fn raise_open_file_limit() -> OpenFileLimit {
    let start = getrlimit(Resource::Nofile);
    let target = start.maximum.unwrap_or(UNLIMITED_CAP);
    let now = match start.current {
        Some(current) if current < target => {
            let raised = Rlimit {
                current: Some(target),
                maximum: start.maximum,
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => Some(target),
                Err(errno) => {
                    tracing::warn!(%errno, soft = current, target, "could not raise the open file limit");
                    Some(current)
                }
            }
        }
        current => current,
    };
    OpenFileLimit {
        before: start.current,
        now,
        hard: start.maximum,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Raising is idempotent and never lowers: after it the soft limit is the hard one (or
    /// the cap), and a second call changes nothing.
    #[test]
    fn raising_reaches_the_hard_limit_and_is_idempotent() {
        let first = raise_open_file_limit();
        let target = first.hard.unwrap_or(UNLIMITED_CAP);
        assert_eq!(first.now, first.before.map(|before| before.max(target)));
        let second = raise_open_file_limit();
        assert_eq!(second.before, second.now, "already raised");
        assert_eq!(second.now, first.now);
        assert!(second.fits(0));
    }
}
