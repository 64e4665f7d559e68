//! The CBI1 decoder against a small layout (checksum optionally fixed so body checks are
//! reachable).
#![no_main]

use bytes::Bytes;
use kvrelay_codec::cbi1::{self, Cbi1Layout, Cbi1Payload};
use libfuzzer_sys::fuzz_target;

mod support;

fuzz_target!(|data: &[u8]| {
    let (flag, payload) = support::flag(data);
    let mut payload = payload.to_vec();
    if flag & 1 != 0 {
        support::reseal(&mut payload);
    }
    let bucket_count = 1u64 << (1 + flag % 16);
    let Ok(layout) = Cbi1Layout::new(0, bucket_count) else {
        return;
    };
    match cbi1::decode_cbi1(&Bytes::from(payload), &layout) {
        Ok(Cbi1Payload::Chunk(chunk)) => {
            assert!(chunk.bucket_offset() + chunk.n_words() as u64 <= bucket_count);
            assert_eq!(chunk.words().count(), chunk.n_words());
        }
        Ok(Cbi1Payload::Delta(delta)) => {
            assert!(
                delta
                    .images()
                    .all(|image| u64::from(image.bucket_idx) < bucket_count)
            );
        }
        Err(_) => {}
    }
});
