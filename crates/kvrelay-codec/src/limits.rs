//! Every bound the codec enforces, in one place.

/// Default [`Limits::max_frame_len`]: 8 MiB, header included.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 8 * 1024 * 1024;

/// The smallest accepted [`Limits::max_frame_len`]: one maximal CBI1 snapshot chunk
/// ([`crate::cbi1::MAX_CBI1_LEN`] bytes) plus 64 KiB for the pool frame envelope.
pub const MIN_MAX_FRAME_LEN: u32 = crate::cbi1::MAX_CBI1_LEN as u32 + 64 * 1024;

/// The largest accepted [`Limits::max_frame_len`]: 64 MiB.
pub const MAX_MAX_FRAME_LEN: u32 = 64 * 1024 * 1024;

/// Longest subscriber id, in UTF-8 bytes (a protocol rule, not a knob).
pub const MAX_SUBSCRIBER_ID_LEN: usize = 128;

/// Longest auth token in a stream request, in bytes (a protocol rule, not a knob).
pub const MAX_AUTH_TOKEN_LEN: usize = 4096;

/// Longest free-text error message, in bytes; longer messages are cut at a char boundary
/// by the encoder.
pub const MAX_ERROR_MESSAGE_LEN: usize = 4096;

/// Bounds applied by the decoders. Plain data: every field has a documented default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame, in bytes, header included; checked against the declared length
    /// before any body byte is buffered. Default [`DEFAULT_MAX_FRAME_LEN`]; must lie in
    /// [`MIN_MAX_FRAME_LEN`]`..=`[`MAX_MAX_FRAME_LEN`].
    pub max_frame_len: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
        }
    }
}

impl Limits {
    /// Checks every bound against its allowed range.
    pub fn validate(&self) -> Result<(), LimitsError> {
        if !(MIN_MAX_FRAME_LEN..=MAX_MAX_FRAME_LEN).contains(&self.max_frame_len) {
            return Err(LimitsError::MaxFrameLen {
                value: self.max_frame_len,
            });
        }
        Ok(())
    }
}

/// A [`Limits`] field outside its allowed range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// `max_frame_len` outside `MIN_MAX_FRAME_LEN..=MAX_MAX_FRAME_LEN`.
    #[error(
        "max_frame_len {value} outside {MIN_MAX_FRAME_LEN}..={MAX_MAX_FRAME_LEN} (a snapshot chunk must fit)"
    )]
    MaxFrameLen {
        /// The rejected value.
        value: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_valid() {
        assert_eq!(Limits::default().validate(), Ok(()));
    }

    #[test]
    fn frame_limit_below_one_snapshot_chunk_is_rejected() {
        let limits = Limits {
            max_frame_len: MIN_MAX_FRAME_LEN - 1,
        };
        assert_eq!(
            limits.validate(),
            Err(LimitsError::MaxFrameLen {
                value: MIN_MAX_FRAME_LEN - 1
            })
        );
    }
}
