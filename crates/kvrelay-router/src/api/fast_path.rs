//! A fast parser for the common shape of route requests.
//!
//! `serde_json` spends most of a 1,024-token request's parse on the `tokens` array (its
//! generic number path: sign, fraction and exponent checks, a visitor call per element).
//! This parser accepts only a strict subset of JSON — the one clients send: the known
//! fields at most once each, token ids and `top_k` as plain decimal integers, strings
//! without escapes, `null` for absent options — and declines (`None`) on anything else,
//! so [`super::parse`] falls back to `serde_json`, which answers exactly as before
//! (including every error and the field it names). What it accepts it must parse exactly
//! as `serde_json` would: the property test in `api/tests.rs` holds it to that.

use super::{BatchRequest, RouteRequest};

/// `RouteRequest` if `body` is in the fast subset.
pub(super) fn route_request(body: &[u8]) -> Option<RouteRequest> {
    let mut cursor = Cursor { body, at: 0 };
    let request = cursor.route_object()?;
    cursor.end()?;
    Some(request)
}

/// `BatchRequest` if `body` is in the fast subset. Parsing stops after `max_batch + 1`
/// requests (enough for validation to refuse the batch), so a body of many tiny requests
/// never builds more of them than the limit allows.
pub(super) fn batch_request(body: &[u8], max_batch: usize) -> Option<BatchRequest> {
    let mut cursor = Cursor { body, at: 0 };
    cursor.skip_ws();
    cursor.eat(b'{')?;
    cursor.skip_ws();
    if cursor.key()? != b"requests" {
        return None;
    }
    cursor.colon()?;
    let mut requests = Vec::new();
    cursor.eat(b'[')?;
    cursor.skip_ws();
    if !cursor.eat_if(b']') {
        loop {
            requests.push(cursor.route_object()?);
            if requests.len() > max_batch {
                return Some(BatchRequest { requests });
            }
            cursor.skip_ws();
            if cursor.eat_if(b']') {
                break;
            }
            cursor.eat(b',')?;
        }
    }
    cursor.skip_ws();
    cursor.eat(b'}')?;
    cursor.end()?;
    Some(BatchRequest { requests })
}

/// Token ids reserved up front per request (the array grows past it as needed).
const MAX_TOKEN_RESERVATION: usize = 4096;

struct Cursor<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    /// Consumes `byte` or declines.
    fn eat(&mut self, byte: u8) -> Option<()> {
        self.eat_if(byte).then_some(())
    }

    fn eat_if(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        if found {
            self.at += 1;
        }
        found
    }

    /// Only whitespace left.
    fn end(&mut self) -> Option<()> {
        self.skip_ws();
        (self.at == self.body.len()).then_some(())
    }

    /// A string without escapes or control characters; its raw bytes.
    fn raw_string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.at;
        loop {
            match self.peek()? {
                b'"' => break,
                b'\\' | 0..0x20 => return None,
                _ => self.at += 1,
            }
        }
        let raw = &self.body[start..self.at];
        self.at += 1;
        Some(raw)
    }

    fn key(&mut self) -> Option<&'a [u8]> {
        self.raw_string()
    }

    /// `:` with whitespace around it.
    fn colon(&mut self) -> Option<()> {
        self.skip_ws();
        self.eat(b':')?;
        self.skip_ws();
        Some(())
    }

    fn string(&mut self) -> Option<String> {
        let raw = self.raw_string()?;
        std::str::from_utf8(raw).ok().map(str::to_owned)
    }

    fn eat_null(&mut self) -> bool {
        let found = self.body[self.at..].starts_with(b"null");
        if found {
            self.at += 4;
        }
        found
    }

    fn optional_string(&mut self) -> Option<Option<String>> {
        if self.eat_null() {
            return Some(None);
        }
        self.string().map(Some)
    }

    /// A plain decimal integer (no sign, fraction, exponent or leading zero) up to `max`.
    fn integer(&mut self, max: u64) -> Option<u64> {
        let rest = &self.body[self.at..];
        let digits = rest.iter().take_while(|byte| byte.is_ascii_digit()).count();
        // Twenty digits can overflow a u64; no bound here needs more than twenty.
        if digits == 0 || digits > 20 || (digits > 1 && rest[0] == b'0') {
            return None;
        }
        if matches!(rest.get(digits), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        let mut value: u64 = 0;
        for &byte in &rest[..digits] {
            value = value.checked_mul(10)?.checked_add(u64::from(byte - b'0'))?;
        }
        self.at += digits;
        (value <= max).then_some(value)
    }

    /// A token id: a plain decimal integer that fits a `u32`.
    ///
    /// Eight bytes at a time where eight are left: the run of leading digits is found and
    /// converted with a few multiplications (SWAR) instead of a branch and a multiply per
    /// byte; the last few bytes of a body go the scalar way.
    fn token(&mut self) -> Option<u32> {
        let rest = &self.body[self.at..];
        let Some(chunk) = rest.first_chunk::<8>() else {
            let token = self.integer(u64::from(u32::MAX))?;
            return u32::try_from(token).ok();
        };
        let chunk = u64::from_le_bytes(*chunk);
        let len = leading_digits(chunk);
        if len == 0 || (len > 1 && rest[0] == b'0') {
            return None;
        }
        let mut value = u64::from(eight_digits(pad_with_leading_zeros(chunk, len)));
        let mut digits = len;
        // Eight digits and more: a u32 has at most ten.
        while let Some(byte) = rest.get(digits).filter(|byte| byte.is_ascii_digit()) {
            if digits == 10 {
                return None;
            }
            value = value * 10 + u64::from(byte - b'0');
            digits += 1;
        }
        if matches!(rest.get(digits), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.at += digits;
        u32::try_from(value).ok()
    }

    fn tokens(&mut self) -> Option<Vec<u32>> {
        self.eat(b'[')?;
        self.skip_ws();
        if self.eat_if(b']') {
            return Some(Vec::new());
        }
        // Reserve for this array only: every token takes at least two bytes (a digit and
        // a separator) up to its closing bracket, so the reservations of all the requests
        // of a batch add up to at most twice the body's size, and an empty array reserves
        // nothing. Capped; the array grows past the cap as needed.
        let array_end = self.body[self.at..]
            .iter()
            .position(|&byte| byte == b']')
            .unwrap_or(self.body.len() - self.at);
        let mut tokens = Vec::with_capacity((array_end / 2 + 1).min(MAX_TOKEN_RESERVATION));
        loop {
            tokens.push(self.token()?);
            self.skip_ws();
            let next = self.peek()?;
            self.at += 1;
            match next {
                b',' => self.skip_ws(),
                b']' => return Some(tokens),
                // `.`, `e` and anything else: not a plain token list.
                _ => return None,
            }
        }
    }

    /// One route request object.
    fn route_object(&mut self) -> Option<RouteRequest> {
        let mut tokens = None;
        let mut model = None;
        let mut lora = None;
        let mut namespace = None;
        let mut top_k = None;
        self.skip_ws();
        self.eat(b'{')?;
        self.skip_ws();
        if !self.eat_if(b'}') {
            loop {
                let key = self.key()?;
                self.colon()?;
                // A repeated field declines (serde_json refuses it, naming it).
                match key {
                    b"tokens" if tokens.is_none() => tokens = Some(self.tokens()?),
                    b"model" if model.is_none() => model = Some(self.string()?),
                    b"lora" if lora.is_none() => lora = Some(self.optional_string()?),
                    b"namespace" if namespace.is_none() => {
                        namespace = Some(self.optional_string()?);
                    }
                    b"top_k" if top_k.is_none() => {
                        top_k = Some(if self.eat_null() {
                            None
                        } else {
                            let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
                            Some(usize::try_from(self.integer(max)?).ok()?)
                        });
                    }
                    _ => return None,
                }
                self.skip_ws();
                if self.eat_if(b'}') {
                    break;
                }
                self.eat(b',')?;
                self.skip_ws();
            }
        }
        Some(RouteRequest {
            tokens: tokens?,
            model: model?,
            lora: lora.flatten(),
            namespace: namespace.flatten(),
            top_k: top_k.flatten(),
        })
    }
}

/// Eight ASCII `'0'`s.
const ASCII_ZEROS: u64 = 0x3030_3030_3030_3030;
/// The high bit of every byte.
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// How many of the eight bytes of `chunk` (read little-endian: the first byte lowest) are
/// ASCII digits before the first that is not.
///
/// A byte's high bit is flagged when it is above `'9'` (adding `0x46` reaches `0x80`),
/// below `'0'` (subtracting `0x30` wraps) or not ASCII. Carries and borrows only cross
/// from a flagged byte into the bytes after it, so the lowest flag is exact.
fn leading_digits(chunk: u64) -> usize {
    let above = chunk.wrapping_add(0x4646_4646_4646_4646);
    let below = chunk.wrapping_sub(ASCII_ZEROS);
    let flags = (above | below | chunk) & HIGH_BITS;
    (flags.trailing_zeros() / 8) as usize
}

/// The first `len` (1 to 8) bytes of `chunk` moved to its end behind leading `'0'`s, so
/// that the eight bytes spell the same number.
fn pad_with_leading_zeros(chunk: u64, len: usize) -> u64 {
    if len >= 8 {
        return chunk;
    }
    let shift = (8 - len) * 8;
    (chunk << shift) | (ASCII_ZEROS >> (64 - shift))
}

/// The number spelt by eight ASCII digits (the first byte lowest): pairs, then quads,
/// then the whole, each step one multiplication.
fn eight_digits(chunk: u64) -> u32 {
    let pairs = ((chunk & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561)) >> 8;
    let quads = ((pairs & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601)) >> 16;
    // At most 99,999,999: the high half of the product always fits.
    (((quads & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001)) >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &[u8; 8]) -> u64 {
        u64::from_le_bytes(*text)
    }

    #[test]
    fn leading_digits_stop_at_the_first_non_digit() {
        assert_eq!(leading_digits(chunk(b"12345678")), 8);
        assert_eq!(leading_digits(chunk(b"1234567,")), 7);
        assert_eq!(leading_digits(chunk(b"1]000000")), 1);
        assert_eq!(leading_digits(chunk(b",1234567")), 0);
        for (at, byte) in (0..8).flat_map(|at| [(at, b'/'), (at, b':'), (at, 0x00), (at, 0xff)]) {
            let mut text = *b"99999999";
            text[at] = byte;
            assert_eq!(leading_digits(chunk(&text)), at, "{text:?}");
        }
    }

    #[test]
    fn eight_digits_spell_their_number() {
        assert_eq!(eight_digits(chunk(b"00000000")), 0);
        assert_eq!(eight_digits(chunk(b"12345678")), 12_345_678);
        assert_eq!(eight_digits(chunk(b"99999999")), 99_999_999);
        for len in 1..=8 {
            let padded = pad_with_leading_zeros(chunk(b"98765432"), len);
            let expected: u32 = std::str::from_utf8(&b"98765432"[..len])
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(eight_digits(padded), expected, "{len} digits");
        }
    }

    #[test]
    fn tokens_of_every_length_parse_with_or_without_eight_bytes_left() {
        for value in [
            0u32, 7, 42, 999, 1_000, 65_535, 1_234_567, 12_345_678, 99_999_999,
        ]
        .into_iter()
        .chain([100_000_000, 999_999_999, 1_000_000_000, u32::MAX])
        {
            for tail in ["]", ",1]", "]                "] {
                let body = format!("{value}{tail}");
                let mut cursor = Cursor {
                    body: body.as_bytes(),
                    at: 0,
                };
                assert_eq!(cursor.token(), Some(value), "{body}");
                assert_eq!(cursor.at, value.to_string().len());
            }
        }
        for refused in [
            "4294967296]      ",
            "12345678901]    ",
            "01]             ",
            "1.5]",
            "2e3]            ",
        ] {
            let mut cursor = Cursor {
                body: refused.as_bytes(),
                at: 0,
            };
            assert_eq!(cursor.token(), None, "{refused}");
        }
    }
}
