//! Whole-message decoding of any frame, and re-encoding what decodes.
#![no_main]

use bytes::BytesMut;
use kvrelay_codec::{Limits, v1};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let mut src = BytesMut::from(data);
    while let Ok(Some(message)) = v1::decode_message(&mut src, &limits) {
        let mut dst = BytesMut::new();
        if v1::encode_message(&message, &limits, &mut dst).is_ok() {
            let again = v1::decode_message(&mut dst, &limits);
            assert_eq!(again, Ok(Some(message)));
        }
    }
});
