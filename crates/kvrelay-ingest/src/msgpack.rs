//! A minimal, allocation-free msgpack reader over a byte slice.
//!
//! It accepts every header width, including non-minimal ones (msgspec writes a `map16`
//! header for small maps), never panics, skips nested values iteratively (no recursion), and never reserves memory from a declared
//! length: callers iterate element by element, so a hostile length fails at the first
//! missing byte.

use crate::error::DecodeError;

/// One decoded msgpack value header; containers report their element count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Item<'a> {
    Nil,
    Bool(bool),
    /// A non-negative integer (positive fixint, uint8..uint64, or a non-negative int).
    Unsigned(u64),
    /// A negative integer.
    Negative(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Item<'_> {
    /// A short name of the value's kind, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Item::Nil => "nil",
            Item::Bool(_) => "bool",
            Item::Unsigned(_) | Item::Negative(_) => "int",
            Item::Float(_) => "float",
            Item::Str(_) => "str",
            Item::Bin(_) => "bin",
            Item::Array(_) => "array",
            Item::Map(_) => "map",
            Item::Ext => "ext",
        }
    }
}

/// A cursor over msgpack bytes.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Reads the next value header (for str/bin, the whole value).
    pub(crate) fn next(&mut self) -> Result<Item<'a>, DecodeError> {
        let at = self.pos;
        let marker = self.byte()?;
        let item = match marker {
            0x00..=0x7f => Item::Unsigned(u64::from(marker)),
            0x80..=0x8f => Item::Map(u32::from(marker & 0x0f)),
            0x90..=0x9f => Item::Array(u32::from(marker & 0x0f)),
            0xa0..=0xbf => Item::Str(self.take(usize::from(marker & 0x1f))?),
            0xc0 => Item::Nil,
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xc4 => {
                let n = usize::from(self.byte()?);
                Item::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = usize::from(self.be_u16()?);
                Item::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.be_u32()? as usize;
                Item::Bin(self.take(n)?)
            }
            0xc7 => {
                let n = usize::from(self.byte()?);
                self.take(n + 1)?;
                Item::Ext
            }
            0xc8 => {
                let n = usize::from(self.be_u16()?);
                self.take(n + 1)?;
                Item::Ext
            }
            0xc9 => {
                let n = self.be_u32()? as usize;
                self.take(n.saturating_add(1))?;
                Item::Ext
            }
            0xca => Item::Float(f64::from(f32::from_bits(self.be_u32()?))),
            0xcb => Item::Float(f64::from_bits(self.be_u64()?)),
            0xcc => Item::Unsigned(u64::from(self.byte()?)),
            0xcd => Item::Unsigned(u64::from(self.be_u16()?)),
            0xce => Item::Unsigned(u64::from(self.be_u32()?)),
            0xcf => Item::Unsigned(self.be_u64()?),
            0xd0 => signed(i64::from(self.byte()? as i8)),
            0xd1 => signed(i64::from(self.be_u16()? as i16)),
            0xd2 => signed(i64::from(self.be_u32()? as i32)),
            0xd3 => signed(self.be_u64()? as i64),
            0xd4..=0xd8 => {
                let n = 1usize << (marker - 0xd4);
                self.take(n + 1)?;
                Item::Ext
            }
            0xd9 => {
                let n = usize::from(self.byte()?);
                Item::Str(self.take(n)?)
            }
            0xda => {
                let n = usize::from(self.be_u16()?);
                Item::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.be_u32()? as usize;
                Item::Str(self.take(n)?)
            }
            0xdc => Item::Array(u32::from(self.be_u16()?)),
            0xdd => Item::Array(self.be_u32()?),
            0xde => Item::Map(u32::from(self.be_u16()?)),
            0xdf => Item::Map(self.be_u32()?),
            0xe0..=0xff => Item::Negative(i64::from(marker as i8)),
            0xc1 => return Err(DecodeError::InvalidMarker { offset: at, marker }),
        };
        Ok(item)
    }

    /// Skips one whole value, including nested containers.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        // Count of values still to skip; containers add their children.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.next()? {
                Item::Array(n) => pending += u64::from(n),
                Item::Map(n) => pending += 2 * u64::from(n),
                _ => {}
            }
            // Each byte holds at most one header, so a bound on pending values by the
            // remaining bytes rejects hostile counts early.
            if pending > self.remaining() as u64 {
                return Err(DecodeError::Truncated { offset: self.pos });
            }
        }
        Ok(())
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = *self
            .bytes
            .get(self.pos)
            .ok_or(DecodeError::Truncated { offset: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or(DecodeError::Truncated { offset: self.pos })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn be_u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn be_u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn be_u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut arr = [0u8; 8];
        arr.copy_from_slice(b);
        Ok(u64::from_be_bytes(arr))
    }
}

fn signed(value: i64) -> Item<'static> {
    if value >= 0 {
        Item::Unsigned(value as u64)
    } else {
        Item::Negative(value)
    }
}
