//! [`CkfFormat`]: the identity of a cuckoo-filter layout (CKF v1, or our own dense CKF 2).

use serde::{Deserialize, Serialize};

/// CKF format 1, the reference's (Dynamo's) published format: a power-of-two bucket count,
/// XOR alternate buckets.
pub const CKF_FORMAT_V1: u16 = 1;

/// CKF format 2, kvrelay's dense format: any bucket count in range (sized to the pool's
/// capacity, not rounded up to a power of two), buckets by multiply-shift range reduction
/// and the alternate bucket by reflection (`(offset - bucket) mod bucket_count`). Same
/// fingerprints and slots as v1. Only kvrelay's own protocol carries it.
pub const CKF_FORMAT_DENSE: u16 = 2;

/// The default CKF seed.
pub const DEFAULT_CKF_SEED: u64 = 0x5DEE_CE66_D1B5_4A33;

/// Fingerprint width of CKF v1, in bits.
pub const CKF_FINGERPRINT_BITS: u8 = 16;

/// Slots per bucket of CKF v1.
pub const CKF_SLOTS_PER_BUCKET: u8 = 4;

/// Fewest buckets a CKF may have.
pub const MIN_CKF_BUCKET_COUNT: u32 = 2;

/// Most buckets a CKF may have (the CBI1 image limit).
pub const MAX_CKF_BUCKET_COUNT: u32 = 16_777_216;

/// Why a CKF format was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CkfFormatError {
    /// The format version is neither [`CKF_FORMAT_V1`] nor [`CKF_FORMAT_DENSE`].
    #[error(
        "ckf format version {version} is unsupported, expected {CKF_FORMAT_V1} or {CKF_FORMAT_DENSE}"
    )]
    UnsupportedVersion {
        /// The version given.
        version: u16,
    },
    /// The bucket count is outside
    /// [`MIN_CKF_BUCKET_COUNT`]..=[`MAX_CKF_BUCKET_COUNT`], or (format 1) not a power of
    /// two.
    #[error(
        "ckf format {version} bucket count {bucket_count} must be {rule} in \
         {MIN_CKF_BUCKET_COUNT}..={MAX_CKF_BUCKET_COUNT}"
    )]
    InvalidBucketCount {
        /// The format version given.
        version: u16,
        /// The bucket count given.
        bucket_count: u32,
        /// What the version requires ("a power of two" or "a count").
        rule: &'static str,
    },
    /// The fingerprint width is not [`CKF_FINGERPRINT_BITS`].
    #[error("ckf fingerprint width {bits} bits is unsupported, expected {CKF_FINGERPRINT_BITS}")]
    UnsupportedFingerprintBits {
        /// The width given.
        bits: u8,
    },
    /// The slot count is not [`CKF_SLOTS_PER_BUCKET`].
    #[error("ckf slots per bucket {slots} is unsupported, expected {CKF_SLOTS_PER_BUCKET}")]
    UnsupportedSlotsPerBucket {
        /// The slot count given.
        slots: u8,
    },
}

/// The layout identity of a CKF: `(format_version, seed, bucket_count, fingerprint_bits,
/// slots_per_bucket)`. Two filters are interchangeable only if all five are equal.
///
/// Invariants: version [`CKF_FORMAT_V1`] (bucket count a power of two) or
/// [`CKF_FORMAT_DENSE`] (any bucket count); the count in
/// [`MIN_CKF_BUCKET_COUNT`]..=[`MAX_CKF_BUCKET_COUNT`]; [`CKF_FINGERPRINT_BITS`]-bit
/// fingerprints; [`CKF_SLOTS_PER_BUCKET`] slots per bucket. Deserialising re-validates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawCkfFormat")]
pub struct CkfFormat {
    format_version: u16,
    seed: u64,
    bucket_count: u32,
    fingerprint_bits: u8,
    slots_per_bucket: u8,
}

impl CkfFormat {
    /// A v1 format with `seed` and `bucket_count` buckets.
    ///
    /// ```
    /// use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};
    /// let format = CkfFormat::v1(DEFAULT_CKF_SEED, 1 << 19).unwrap();
    /// assert_eq!(format.bucket_count(), 524_288);
    /// assert!(CkfFormat::v1(DEFAULT_CKF_SEED, 3).is_err());
    /// ```
    pub const fn v1(seed: u64, bucket_count: u32) -> Result<Self, CkfFormatError> {
        Self::from_parts(
            CKF_FORMAT_V1,
            seed,
            bucket_count,
            CKF_FINGERPRINT_BITS,
            CKF_SLOTS_PER_BUCKET,
        )
    }

    /// A dense (format 2) format with `seed` and `bucket_count` buckets (any count in
    /// range).
    ///
    /// ```
    /// use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};
    /// let format = CkfFormat::dense(DEFAULT_CKF_SEED, 263_159).unwrap();
    /// assert!(format.is_dense());
    /// assert!(CkfFormat::dense(DEFAULT_CKF_SEED, 1).is_err());
    /// ```
    pub const fn dense(seed: u64, bucket_count: u32) -> Result<Self, CkfFormatError> {
        Self::from_parts(
            CKF_FORMAT_DENSE,
            seed,
            bucket_count,
            CKF_FINGERPRINT_BITS,
            CKF_SLOTS_PER_BUCKET,
        )
    }

    /// Validates every field, as received from the wire.
    pub const fn from_parts(
        format_version: u16,
        seed: u64,
        bucket_count: u32,
        fingerprint_bits: u8,
        slots_per_bucket: u8,
    ) -> Result<Self, CkfFormatError> {
        let needs_power_of_two = match format_version {
            CKF_FORMAT_V1 => true,
            CKF_FORMAT_DENSE => false,
            version => return Err(CkfFormatError::UnsupportedVersion { version }),
        };
        if (needs_power_of_two && !bucket_count.is_power_of_two())
            || bucket_count < MIN_CKF_BUCKET_COUNT
            || bucket_count > MAX_CKF_BUCKET_COUNT
        {
            return Err(CkfFormatError::InvalidBucketCount {
                version: format_version,
                bucket_count,
                rule: if needs_power_of_two {
                    "a power of two"
                } else {
                    "a count"
                },
            });
        }
        if fingerprint_bits != CKF_FINGERPRINT_BITS {
            return Err(CkfFormatError::UnsupportedFingerprintBits {
                bits: fingerprint_bits,
            });
        }
        if slots_per_bucket != CKF_SLOTS_PER_BUCKET {
            return Err(CkfFormatError::UnsupportedSlotsPerBucket {
                slots: slots_per_bucket,
            });
        }
        Ok(Self {
            format_version,
            seed,
            bucket_count,
            fingerprint_bits,
            slots_per_bucket,
        })
    }

    /// The format version ([`CKF_FORMAT_V1`] or [`CKF_FORMAT_DENSE`]).
    pub const fn format_version(&self) -> u16 {
        self.format_version
    }

    /// Whether this is the dense format ([`CKF_FORMAT_DENSE`]).
    pub const fn is_dense(&self) -> bool {
        self.format_version == CKF_FORMAT_DENSE
    }

    /// The addressing seed.
    pub const fn seed(&self) -> u64 {
        self.seed
    }

    /// The number of buckets (a power of two in format 1).
    pub const fn bucket_count(&self) -> u32 {
        self.bucket_count
    }

    /// Fingerprint width in bits ([`CKF_FINGERPRINT_BITS`]).
    pub const fn fingerprint_bits(&self) -> u8 {
        self.fingerprint_bits
    }

    /// Slots per bucket ([`CKF_SLOTS_PER_BUCKET`]).
    pub const fn slots_per_bucket(&self) -> u8 {
        self.slots_per_bucket
    }
}

/// The unvalidated serde shape of [`CkfFormat`].
#[derive(Deserialize)]
struct RawCkfFormat {
    format_version: u16,
    seed: u64,
    bucket_count: u32,
    fingerprint_bits: u8,
    slots_per_bucket: u8,
}

impl TryFrom<RawCkfFormat> for CkfFormat {
    type Error = CkfFormatError;

    fn try_from(raw: RawCkfFormat) -> Result<Self, Self::Error> {
        Self::from_parts(
            raw.format_version,
            raw.seed,
            raw.bucket_count,
            raw.fingerprint_bits,
            raw.slots_per_bucket,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(bucket_count: u32, expected: Result<(), CkfFormatError>) {
        let got = CkfFormat::v1(DEFAULT_CKF_SEED, bucket_count).map(|_| ());
        assert_eq!(got, expected, "bucket count {bucket_count}");
    }

    #[test]
    fn bucket_count_must_be_a_power_of_two_in_range() {
        let invalid = |bucket_count| {
            Err(CkfFormatError::InvalidBucketCount {
                version: CKF_FORMAT_V1,
                bucket_count,
                rule: "a power of two",
            })
        };
        check(0, invalid(0));
        check(1, invalid(1));
        check(2, Ok(()));
        check(3, invalid(3));
        check(1 << 19, Ok(()));
        check(MAX_CKF_BUCKET_COUNT, Ok(()));
        check(MAX_CKF_BUCKET_COUNT * 2, invalid(MAX_CKF_BUCKET_COUNT * 2));
        check(MAX_CKF_BUCKET_COUNT - 1, invalid(MAX_CKF_BUCKET_COUNT - 1));
    }

    #[test]
    fn only_versions_1_and_2_are_accepted() {
        assert_eq!(
            CkfFormat::from_parts(3, 0, 4, 16, 4),
            Err(CkfFormatError::UnsupportedVersion { version: 3 })
        );
        assert_eq!(
            CkfFormat::from_parts(0, 0, 4, 16, 4),
            Err(CkfFormatError::UnsupportedVersion { version: 0 })
        );
    }

    #[test]
    fn dense_takes_any_count_in_range() {
        let invalid = |bucket_count| {
            Err(CkfFormatError::InvalidBucketCount {
                version: CKF_FORMAT_DENSE,
                bucket_count,
                rule: "a count",
            })
        };
        let check = |bucket_count, expected: Result<(), CkfFormatError>| {
            let got = CkfFormat::dense(DEFAULT_CKF_SEED, bucket_count).map(|_| ());
            assert_eq!(got, expected, "bucket count {bucket_count}");
        };
        check(1, invalid(1));
        check(2, Ok(()));
        check(3, Ok(()));
        check(263_159, Ok(()));
        check(MAX_CKF_BUCKET_COUNT, Ok(()));
        check(MAX_CKF_BUCKET_COUNT + 1, invalid(MAX_CKF_BUCKET_COUNT + 1));
        let dense = CkfFormat::dense(9, 1000).unwrap();
        assert!(dense.is_dense());
        assert!(!CkfFormat::v1(9, 1024).unwrap().is_dense());
        // Same seed and count, different addressing: never interchangeable.
        assert_ne!(
            CkfFormat::dense(9, 1024).unwrap(),
            CkfFormat::v1(9, 1024).unwrap()
        );
    }

    #[test]
    fn only_16_bit_fingerprints_are_accepted() {
        assert_eq!(
            CkfFormat::from_parts(1, 0, 4, 8, 4),
            Err(CkfFormatError::UnsupportedFingerprintBits { bits: 8 })
        );
    }

    #[test]
    fn only_4_slots_per_bucket_are_accepted() {
        assert_eq!(
            CkfFormat::from_parts(1, 0, 4, 16, 8),
            Err(CkfFormatError::UnsupportedSlotsPerBucket { slots: 8 })
        );
    }

    #[test]
    fn default_seed_matches_the_spec() {
        assert_eq!(DEFAULT_CKF_SEED, 6_768_574_230_984_739_379);
    }

    #[test]
    fn accessors_return_the_fields() {
        let format = CkfFormat::v1(9, 1024).unwrap();
        assert_eq!(
            (
                format.format_version(),
                format.seed(),
                format.bucket_count(),
                format.fingerprint_bits(),
                format.slots_per_bucket()
            ),
            (1, 9, 1024, 16, 4)
        );
    }

    #[test]
    fn deserialising_revalidates() {
        let json = r#"{"format_version":1,"seed":5,"bucket_count":6,"fingerprint_bits":16,"slots_per_bucket":4}"#;
        let err = serde_json::from_str::<CkfFormat>(json).unwrap_err();
        assert!(err.to_string().contains("bucket count 6"), "{err}");
        let format = CkfFormat::v1(5, 8).unwrap();
        let json = serde_json::to_string(&format).unwrap();
        assert_eq!(serde_json::from_str::<CkfFormat>(&json).unwrap(), format);
    }
}
