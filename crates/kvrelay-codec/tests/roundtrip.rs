//! Every v1 message round-trips through a frame, any split of a stream decodes like the
//! whole, and random bytes never panic a decoder.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests fail by panicking")]

use bytes::BytesMut;
use kvrelay_codec::Limits;
use kvrelay_codec::v1::{self, Message};
use proptest::prelude::*;

mod strategy;

fn encode_all(messages: &[Message]) -> BytesMut {
    let mut buf = BytesMut::new();
    for message in messages {
        v1::encode_message(message, &Limits::default(), &mut buf).unwrap();
    }
    buf
}

fn decode_all(buf: &mut BytesMut) -> Vec<Message> {
    let mut out = Vec::new();
    while let Some(message) = v1::decode_message(buf, &Limits::default()).unwrap() {
        out.push(message);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_message_round_trips(message in strategy::message()) {
        let mut buf = encode_all(std::slice::from_ref(&message));
        prop_assert_eq!(decode_all(&mut buf), vec![message]);
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn any_split_decodes_like_the_whole(
        messages in proptest::collection::vec(strategy::message(), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let whole = encode_all(&messages);
        let cut = cut.index(whole.len() + 1);
        let mut buf = BytesMut::from(&whole[..cut]);
        let mut decoded = decode_all(&mut buf);
        buf.extend_from_slice(&whole[cut..]);
        decoded.extend(decode_all(&mut buf));
        prop_assert_eq!(decoded, messages);
    }

    #[test]
    fn every_truncation_asks_for_more(message in strategy::message(), cut in any::<prop::sample::Index>()) {
        let whole = encode_all(std::slice::from_ref(&message));
        let cut = cut.index(whole.len());
        let mut buf = BytesMut::from(&whole[..cut]);
        prop_assert_eq!(v1::decode_message(&mut buf, &Limits::default()), Ok(None));
        prop_assert_eq!(buf.len(), cut);
    }

    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut buf = BytesMut::from(&b"KVRW\x01\x00"[..]);
        buf.extend_from_slice(&bytes);
        let _ = v1::decode_message(&mut buf, &Limits::default());
        let mut raw = BytesMut::from(&bytes[..]);
        let _ = v1::decode_message(&mut raw, &Limits::default());
    }

    #[test]
    fn random_bodies_never_panic_any_kind(kind in 1u16..=8, minor in 0u16..2, bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let frame = kvrelay_codec::RawFrame { minor, kind_code: kind, body: bytes.into() };
        if let Ok(message) = Message::from_frame(&frame) {
            // Whatever decodes re-encodes and decodes to the same message.
            let mut buf = encode_all(std::slice::from_ref(&message));
            prop_assert_eq!(decode_all(&mut buf), vec![message]);
        }
    }
}
