//! The pool frame body decoder and the full check against its own producer (CBI1
//! checksum optionally fixed so the payload checks are reachable).
#![no_main]

use bytes::{Bytes, BytesMut};
use kvrelay_codec::v1::PoolFrame;
use libfuzzer_sys::fuzz_target;

mod support;

fuzz_target!(|data: &[u8]| {
    let (flag, body) = support::flag(data);
    let Ok(mut frame) = PoolFrame::decode_body(&Bytes::copy_from_slice(body), u16::from(flag & 1)) else {
        return;
    };
    if flag & 2 != 0 {
        let mut payload = frame.payload.to_vec();
        support::reseal(&mut payload);
        frame.payload = Bytes::from(payload);
    }
    let producer = frame.header.producer;
    let _ = frame.check(&producer);
    let mut dst = BytesMut::new();
    if frame.encode_body(&mut dst).is_ok() {
        assert_eq!(PoolFrame::decode_body(&dst.freeze(), 0).ok(), Some(frame));
    }
});
