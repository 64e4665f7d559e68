//! Deltas: absolute images of the buckets that changed between two sequences.
//!
//! Body: base epoch u64, image count u32, then per image bucket index u32 and the bucket's
//! complete new word u64 (12 bytes each).

use bytes::{BufMut, Bytes, BytesMut};
use kvrelay_ckf::{BucketImage, Delta};

use super::header::{
    self, CBI1_HEADER_LEN, Cbi1Error, Cbi1FrameType, Cbi1Header, Cbi1Layout, DELTA_HEADER_LEN,
    DELTA_IMAGE_LEN, MAX_DELTA_IMAGES, u64_at,
};

/// Appends a delta from `base_epoch` to `epoch` carrying `images` to `dst`.
///
/// Every bucket index is checked against the layout and the count against
/// [`MAX_DELTA_IMAGES`] before anything is written; on error `dst` is unchanged. A larger
/// publication must be sent as a snapshot instead.
pub fn encode_delta(
    layout: &Cbi1Layout,
    dc_id: u64,
    base_epoch: u64,
    epoch: u64,
    images: &[BucketImage],
    dst: &mut BytesMut,
) -> Result<(), Cbi1Error> {
    if images.len() > MAX_DELTA_IMAGES {
        return Err(Cbi1Error::TooManyImages {
            count: images.len(),
        });
    }
    let bucket_count = layout.bucket_count();
    if let Some(image) = images
        .iter()
        .find(|image| u64::from(image.bucket_idx) >= bucket_count)
    {
        return Err(Cbi1Error::BucketOutOfRange {
            bucket_idx: u64::from(image.bucket_idx),
            bucket_count,
        });
    }
    let start = dst.len();
    dst.reserve(CBI1_HEADER_LEN + DELTA_HEADER_LEN + images.len() * DELTA_IMAGE_LEN);
    header::put_header(dst, Cbi1FrameType::Delta, layout, dc_id, epoch);
    dst.put_u64_le(base_epoch);
    dst.put_u32_le(images.len() as u32);
    put_images(dst, images);
    header::seal(dst, start);
    Ok(())
}

/// A decoded delta; its images share the receive buffer and every bucket index is below
/// the layout's bucket count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaView {
    header: Cbi1Header,
    base_epoch: u64,
    images: Bytes,
}

impl DeltaView {
    /// The payload header (`epoch` is the sequence after the delta).
    pub fn header(&self) -> &Cbi1Header {
        &self.header
    }

    /// The sequence the replica must be at before applying the delta.
    pub fn base_epoch(&self) -> u64 {
        self.base_epoch
    }

    /// The number of images.
    pub fn n_images(&self) -> usize {
        self.images.len() / DELTA_IMAGE_LEN
    }

    /// The images, in wire order.
    pub fn images(&self) -> impl ExactSizeIterator<Item = BucketImage> + '_ {
        self.images
            .chunks_exact(DELTA_IMAGE_LEN)
            .map(|bytes| BucketImage {
                bucket_idx: u32::from_le_bytes(header::array4(bytes, 0)),
                word: u64_at(bytes, 4),
            })
    }

    /// The images collected into a vector.
    pub fn to_images(&self) -> Vec<BucketImage> {
        self.images().collect()
    }

    /// This delta as a `kvrelay-ckf` delta from its base epoch to its epoch: what a
    /// [`kvrelay_ckf::Replica`] (or a query-table lane) applies.
    pub fn to_delta(&self) -> Delta {
        Delta {
            base_sequence: self.base_epoch,
            sequence: self.header.epoch,
            images: self.to_images(),
        }
    }
}

pub(super) fn decode_delta_body(header: Cbi1Header, body: Bytes) -> Result<DeltaView, Cbi1Error> {
    let len = body.len();
    if len < DELTA_HEADER_LEN {
        return Err(Cbi1Error::DeltaBodyTooShort { len });
    }
    let base_epoch = u64_at(&body, 0);
    let count = u32::from_le_bytes(header::array4(&body, 8));
    if count as usize > MAX_DELTA_IMAGES {
        return Err(Cbi1Error::TooManyImages {
            count: count as usize,
        });
    }
    let expected = DELTA_HEADER_LEN + count as usize * DELTA_IMAGE_LEN;
    if len != expected {
        return Err(Cbi1Error::DeltaBodyLength {
            len,
            count,
            expected,
        });
    }
    let images = body.slice(DELTA_HEADER_LEN..);
    let bucket_count = header.layout.bucket_count();
    for bytes in images.chunks_exact(DELTA_IMAGE_LEN) {
        let bucket_idx = u64::from(u32::from_le_bytes(header::array4(bytes, 0)));
        if bucket_idx >= bucket_count {
            return Err(Cbi1Error::BucketOutOfRange {
                bucket_idx,
                bucket_count,
            });
        }
    }
    Ok(DeltaView {
        header,
        base_epoch,
        images,
    })
}

fn put_images(dst: &mut BytesMut, images: &[BucketImage]) {
    const BLOCK: usize = 256;
    let mut buf = [0u8; BLOCK * DELTA_IMAGE_LEN];
    for block in images.chunks(BLOCK) {
        let out = &mut buf[..block.len() * DELTA_IMAGE_LEN];
        for (bytes, image) in out.chunks_exact_mut(DELTA_IMAGE_LEN).zip(block) {
            bytes[..4].copy_from_slice(&image.bucket_idx.to_le_bytes());
            bytes[4..].copy_from_slice(&image.word.to_le_bytes());
        }
        dst.put_slice(out);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::cbi1::{Cbi1Payload, decode_cbi1};

    fn layout() -> Cbi1Layout {
        Cbi1Layout::new(3, 1024).unwrap()
    }

    fn images(n: u32) -> Vec<BucketImage> {
        (0..n)
            .map(|i| BucketImage {
                bucket_idx: i * 7 % 1024,
                word: u64::from(i) << 16 | 1,
            })
            .collect()
    }

    fn encode(images: &[BucketImage]) -> BytesMut {
        let mut dst = BytesMut::new();
        encode_delta(&layout(), 9, 4, 5, images, &mut dst).unwrap();
        dst
    }

    fn decode(bytes: BytesMut) -> Result<DeltaView, Cbi1Error> {
        match decode_cbi1(&bytes.freeze(), &layout())? {
            Cbi1Payload::Delta(delta) => Ok(delta),
            Cbi1Payload::Chunk(_) => Err(Cbi1Error::UnsupportedFrameType { code: 1 }),
        }
    }

    #[test]
    fn delta_round_trips_images_in_order() {
        let sent = images(600);
        let delta = decode(encode(&sent)).unwrap();
        assert_eq!(delta.base_epoch(), 4);
        assert_eq!(delta.header().epoch, 5);
        assert_eq!(delta.header().dc_id, 9);
        assert_eq!(delta.to_images(), sent);
    }

    #[test]
    fn empty_delta_round_trips() {
        assert_eq!(decode(encode(&[])).unwrap().n_images(), 0);
    }

    #[test]
    fn encoder_refuses_out_of_range_bucket_without_writing() {
        let mut dst = BytesMut::new();
        let bad = [BucketImage {
            bucket_idx: 1024,
            word: 1,
        }];
        assert_eq!(
            encode_delta(&layout(), 9, 4, 5, &bad, &mut dst),
            Err(Cbi1Error::BucketOutOfRange {
                bucket_idx: 1024,
                bucket_count: 1024
            })
        );
        assert!(dst.is_empty());
    }

    #[test]
    fn encoder_refuses_oversize_delta() {
        let many = vec![
            BucketImage {
                bucket_idx: 0,
                word: 0
            };
            MAX_DELTA_IMAGES + 1
        ];
        let mut dst = BytesMut::new();
        assert_eq!(
            encode_delta(&layout(), 9, 4, 5, &many, &mut dst),
            Err(Cbi1Error::TooManyImages {
                count: MAX_DELTA_IMAGES + 1
            })
        );
    }

    /// ckf's publisher hands out deltas of at most its `max_delta_images`, by default what
    /// one delta payload carries, and charges each image what it takes on the wire: the
    /// two crates' numbers must agree.
    #[test]
    fn the_publishers_delta_bounds_match_the_payload() {
        use kvrelay_ckf::stream::{DEFAULT_MAX_DELTA_IMAGES, IMAGE_WIRE_BYTES, StreamLimits};
        assert_eq!(DEFAULT_MAX_DELTA_IMAGES, MAX_DELTA_IMAGES);
        assert_eq!(StreamLimits::default().max_delta_images, MAX_DELTA_IMAGES);
        assert_eq!(IMAGE_WIRE_BYTES, DELTA_IMAGE_LEN as u64);
    }

    #[test]
    fn decoder_rejects_out_of_range_bucket() {
        let mut bytes = encode(&images(2));
        let at = CBI1_HEADER_LEN + DELTA_HEADER_LEN;
        bytes[at..at + 4].copy_from_slice(&5000u32.to_le_bytes());
        header::seal(&mut bytes, 0);
        assert_eq!(
            decode(bytes),
            Err(Cbi1Error::BucketOutOfRange {
                bucket_idx: 5000,
                bucket_count: 1024
            })
        );
    }

    #[test]
    fn decoder_rejects_count_that_disagrees_with_length() {
        let mut bytes = encode(&images(2));
        let at = CBI1_HEADER_LEN + 8;
        bytes[at..at + 4].copy_from_slice(&3u32.to_le_bytes());
        header::seal(&mut bytes, 0);
        assert_eq!(
            decode(bytes),
            Err(Cbi1Error::DeltaBodyLength {
                len: 36,
                count: 3,
                expected: 48
            })
        );
    }
}
