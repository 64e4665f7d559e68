//! Addressing: fingerprint, primary bucket and alternate bucket of a hash, for format 1
//! (power-of-two count, XOR alternate) and the dense format 2 (any count, multiply-shift
//! primary, reflected alternate).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvrelay_identity::CkfFormat;

/// Mixed into the seed for the fingerprint-to-offset hash.
const ALTERNATE_SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Where a hash lives: its nonzero 16-bit fingerprint and its two candidate buckets.
///
/// Each is the other's alternate for this fingerprint. In format 1 `primary != alternate`
/// always; in the dense format the two coincide for about one hash in `bucket_count / 2`
/// (the hash then has one candidate bucket).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Address {
    /// The 16-bit fingerprint, never 0 (0 marks an empty slot).
    pub fingerprint: u16,
    /// The primary bucket index.
    pub primary: u32,
    /// The alternate bucket index (format 1: `primary XOR offset(fingerprint)`; dense:
    /// `(offset(fingerprint) - primary) mod bucket_count`).
    pub alternate: u32,
}

/// A hash's fingerprint and primary bucket: an [`Address`] whose alternate bucket is
/// derived only when needed (most inserts and removals never look at it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Home {
    /// The nonzero 16-bit fingerprint.
    pub(crate) fingerprint: u16,
    /// The primary bucket index.
    pub(crate) primary: u32,
}

/// Computes [`Address`]es for one [`CkfFormat`] (version, seed and bucket count).
///
/// Both formats take the fingerprint from the low 16 bits of `m = xxh3_64(le(h), seed)`
/// and the offset from `xxh3_64(le16(fp), seed XOR 0x9E37_79B9_7F4A_7C15)`. Format 1
/// masks (`primary = (m >> 16) & (n - 1)`, `alternate = primary XOR offset`, offset 0 →
/// 1); the dense format reduces by multiply-shift (`primary = (u32(m >> 16) · n) >> 32`,
/// `offset' = (u32(offset) · n) >> 32`, `alternate = (offset' - primary) mod n`, an
/// involution for any `n`).
///
/// ```
/// use kvrelay_ckf::Addressing;
/// use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};
/// let format = CkfFormat::v1(DEFAULT_CKF_SEED, 524_288)?;
/// let address = Addressing::new(format).address(11);
/// assert_eq!((address.fingerprint, address.primary, address.alternate), (0xD6F8, 410_005, 65_990));
/// # Ok::<(), kvrelay_identity::CkfFormatError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addressing {
    seed: u64,
    alternate_seed: u64,
    /// Format 1: `bucket_count - 1`. Dense: the bucket count.
    reduce: u64,
    dense: bool,
}

impl Addressing {
    /// The addressing of `format`.
    pub fn new(format: CkfFormat) -> Self {
        Self {
            seed: format.seed(),
            alternate_seed: format.seed() ^ ALTERNATE_SEED_MIX,
            reduce: if format.is_dense() {
                u64::from(format.bucket_count())
            } else {
                u64::from(format.bucket_count()) - 1
            },
            dense: format.is_dense(),
        }
    }

    /// The address of a 64-bit (canonical sequence) hash.
    #[inline]
    pub fn address(&self, hash: u64) -> Address {
        let Home {
            fingerprint,
            primary,
        } = self.home(hash);
        Address {
            fingerprint,
            primary,
            alternate: self.alternate(primary, fingerprint),
        }
    }

    /// The fingerprint and primary bucket of a hash (its address without the alternate).
    #[inline]
    pub(crate) fn home(&self, hash: u64) -> Home {
        let mixed = xxh3_64_with_seed(&hash.to_le_bytes(), self.seed);
        let low = (mixed & 0xFFFF) as u16;
        // Masked by, or scaled into, a bucket count <= 2^24, so it fits in u32.
        let primary = if self.dense {
            ((mixed >> 16) as u32 as u64 * self.reduce) >> 32
        } else {
            (mixed >> 16) & self.reduce
        };
        Home {
            fingerprint: if low == 0 { 1 } else { low },
            primary: primary as u32,
        }
    }

    /// The other candidate bucket of `fingerprint` when it sits in `bucket_idx`.
    #[inline]
    pub fn alternate(&self, bucket_idx: u32, fingerprint: u16) -> u32 {
        let offset = xxh3_64_with_seed(&fingerprint.to_le_bytes(), self.alternate_seed);
        if self.dense {
            // `bucket_idx` is a bucket of this table (an address's or a slot's), so both
            // are below the count (<= 2^24) and one conditional add wraps the difference
            // (no division on the relocation and removal paths).
            let offset = ((offset as u32 as u64 * self.reduce) >> 32) as u32;
            let reflected = offset.wrapping_sub(bucket_idx);
            if reflected >= self.reduce as u32 {
                reflected.wrapping_add(self.reduce as u32)
            } else {
                reflected
            }
        } else {
            let offset = offset & self.reduce;
            let offset = if offset == 0 { 1 } else { offset as u32 };
            bucket_idx ^ offset
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_identity::DEFAULT_CKF_SEED;

    #[test]
    fn reproduces_the_worked_example() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 524_288).unwrap();
        let addressing = Addressing::new(format);
        let address = addressing.address(11);
        assert_eq!(address.fingerprint, 0xD6F8);
        assert_eq!(address.primary, 410_005);
        assert_eq!(address.alternate, 65_990);
        assert_eq!(addressing.alternate(65_990, 0xD6F8), 410_005);
    }

    #[test]
    fn alternate_is_an_involution_and_never_the_same_bucket() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 2).unwrap();
        let addressing = Addressing::new(format);
        for hash in 0..2000u64 {
            let address = addressing.address(hash);
            assert_ne!(address.primary, address.alternate);
            assert_eq!(
                addressing.alternate(address.alternate, address.fingerprint),
                address.primary
            );
            assert_ne!(address.fingerprint, 0);
        }
    }

    #[test]
    fn dense_alternate_is_an_involution_within_the_table() {
        for bucket_count in [2u32, 3, 7, 1000, 263_159, 1 << 24] {
            let addressing =
                Addressing::new(CkfFormat::dense(DEFAULT_CKF_SEED, bucket_count).unwrap());
            let mut same = 0;
            for hash in 0..5000u64 {
                let address = addressing.address(hash);
                assert!(address.primary < bucket_count && address.alternate < bucket_count);
                assert_eq!(
                    addressing.alternate(address.alternate, address.fingerprint),
                    address.primary,
                    "{bucket_count} buckets, hash {hash}"
                );
                same += usize::from(address.primary == address.alternate);
            }
            if bucket_count >= 1000 {
                assert!(same < 50, "{same} of 5000 hashes have one candidate bucket");
            }
        }
    }

    #[test]
    fn dense_primary_buckets_are_spread_evenly() {
        let bucket_count = 1000u32;
        let addressing = Addressing::new(CkfFormat::dense(DEFAULT_CKF_SEED, bucket_count).unwrap());
        let mut counts = vec![0u32; bucket_count as usize];
        for hash in 0..200_000u64 {
            counts[addressing.address(hash).primary as usize] += 1;
        }
        // 200 expected per bucket; a Poisson tail past 300 or under 110 is ~1e-10.
        assert!(
            counts.iter().all(|&c| (110..=300).contains(&c)),
            "{:?}",
            counts.iter().max()
        );
    }

    #[test]
    fn dense_and_v1_address_differently() {
        let v1 = Addressing::new(CkfFormat::v1(DEFAULT_CKF_SEED, 1024).unwrap());
        let dense = Addressing::new(CkfFormat::dense(DEFAULT_CKF_SEED, 1024).unwrap());
        let differ = (0..1000u64)
            .filter(|&h| v1.address(h) != dense.address(h))
            .count();
        assert!(differ > 900, "{differ}");
        assert_eq!(v1.address(7).fingerprint, dense.address(7).fingerprint);
    }
}
