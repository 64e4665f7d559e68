//! Probe stamps: an engine appends one line per latency probe to its stamp file, the
//! follower tails every engine's file.
//!
//! A line is `REQUEST SENT_UNIX_NS BLOCKS`: trace request index, the wall-clock time the
//! engine handed the request's batch to its PUB socket, and how many leading blocks of
//! the request are resident on the engine after it (what the follower waits to see).

/// One probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The request's index in the trace.
    pub request: usize,
    /// Wall-clock send time, ns since the Unix epoch.
    pub sent_unix_ns: u64,
    /// Leading blocks resident after the batch.
    pub blocks: usize,
}

impl Stamp {
    /// The line for this stamp, newline included.
    pub fn line(&self) -> String {
        format!("{} {} {}\n", self.request, self.sent_unix_ns, self.blocks)
    }

    /// Parses one line (without its newline); `None` when malformed.
    pub fn parse(line: &str) -> Option<Self> {
        let mut fields = line.split_whitespace();
        let request = fields.next()?.parse().ok()?;
        let sent_unix_ns = fields.next()?.parse().ok()?;
        let blocks = fields.next()?.parse().ok()?;
        Some(Self {
            request,
            sent_unix_ns,
            blocks,
        })
    }
}

/// Wall-clock now, ns since the Unix epoch (0 if the clock is before it).
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_round_trip() {
        let stamp = Stamp {
            request: 12,
            sent_unix_ns: 1_700_000_000_000_000_000,
            blocks: 975,
        };
        assert_eq!(Stamp::parse(stamp.line().trim_end()), Some(stamp));
        assert_eq!(Stamp::parse("12 x 3"), None);
    }
}
