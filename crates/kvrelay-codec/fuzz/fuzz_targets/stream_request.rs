//! The `StreamRequest` body decoder (any minor version), validation and re-encoding.
#![no_main]

use bytes::BytesMut;
use kvrelay_codec::PROTOCOL_MINOR;
use kvrelay_codec::v1::StreamRequest;
use libfuzzer_sys::fuzz_target;

mod support;

fuzz_target!(|data: &[u8]| {
    let (flag, body) = support::flag(data);
    let minor = u16::from(flag & 1);
    if let Ok(message) = StreamRequest::decode_body(body, minor) {
        let _ = message.validate();
        let mut dst = BytesMut::new();
        if message.encode_body(&mut dst).is_ok() {
            assert_eq!(
                StreamRequest::decode_body(&dst, PROTOCOL_MINOR).ok(),
                Some(message)
            );
        }
    }
});
