//! A minimal, allocation-free msgpack reader: just enough to validate vLLM's
//! event encoding and to find each event's byte span. Every read is
//! bounds-checked, and nesting is limited, so arbitrary bytes cannot panic
//! or overflow the stack.

use std::fmt;

/// Deeper nesting than this is rejected; vLLM events nest at most 4 levels.
pub const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    Eof {
        at: usize,
    },
    Unexpected {
        at: usize,
        expected: &'static str,
        found: Marker,
    },
    TooDeep {
        at: usize,
    },
    InvalidUtf8 {
        at: usize,
    },
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Eof { at } => write!(f, "unexpected end of data at byte {at}"),
            ReadError::Unexpected {
                at,
                expected,
                found,
            } => write!(f, "expected {expected} at byte {at}, found {found}"),
            ReadError::TooDeep { at } => {
                write!(f, "nesting deeper than {MAX_DEPTH} at byte {at}")
            }
            ReadError::InvalidUtf8 { at } => write!(f, "invalid UTF-8 string at byte {at}"),
        }
    }
}

/// The family of a msgpack value, as told by its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
    Reserved,
}

impl Marker {
    #[inline]
    pub fn of(byte: u8) -> Marker {
        match byte {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Marker::Int,
            0x80..=0x8f | 0xde | 0xdf => Marker::Map,
            0x90..=0x9f | 0xdc | 0xdd => Marker::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Marker::Str,
            0xc0 => Marker::Nil,
            0xc2 | 0xc3 => Marker::Bool,
            0xc4..=0xc6 => Marker::Bin,
            0xca | 0xcb => Marker::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Marker::Ext,
            0xc1 => Marker::Reserved,
        }
    }
}

impl fmt::Display for Marker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Marker::Nil => "nil",
            Marker::Bool => "bool",
            Marker::Int => "int",
            Marker::Float => "float",
            Marker::Str => "str",
            Marker::Bin => "bytes",
            Marker::Array => "array",
            Marker::Map => "map",
            Marker::Ext => "ext",
            Marker::Reserved => "reserved byte 0xc1",
        };
        f.write_str(name)
    }
}

pub type Result<T> = std::result::Result<T, ReadError>;

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    #[inline]
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Goes on from `pos` (at most the end): for a caller that knows where
    /// the values it does not read end.
    #[inline]
    pub fn seek(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline]
    pub fn peek(&self) -> Result<Marker> {
        self.buf
            .get(self.pos)
            .map(|&b| Marker::of(b))
            .ok_or(ReadError::Eof { at: self.pos })
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(ReadError::Eof { at: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or(ReadError::Eof { at: self.buf.len() })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    #[inline]
    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn unexpected(&self, at: usize, expected: &'static str, byte: u8) -> ReadError {
        ReadError::Unexpected {
            at,
            expected,
            found: Marker::of(byte),
        }
    }

    #[inline]
    pub fn read_array_len(&mut self) -> Result<usize> {
        let at = self.pos;
        match self.byte()? {
            b @ 0x90..=0x9f => Ok((b & 0x0f) as usize),
            0xdc => Ok(self.be(2)? as usize),
            0xdd => Ok(self.be(4)? as usize),
            b => Err(self.unexpected(at, "array", b)),
        }
    }

    #[inline]
    pub fn read_map_len(&mut self) -> Result<usize> {
        let at = self.pos;
        match self.byte()? {
            b @ 0x80..=0x8f => Ok((b & 0x0f) as usize),
            0xde => Ok(self.be(2)? as usize),
            0xdf => Ok(self.be(4)? as usize),
            b => Err(self.unexpected(at, "map", b)),
        }
    }

    pub fn read_str(&mut self) -> Result<&'a str> {
        let at = self.pos;
        std::str::from_utf8(self.read_str_bytes()?).map_err(|_| ReadError::InvalidUtf8 { at })
    }

    /// A string's bytes, unchecked: for comparing with known ASCII names,
    /// where a match proves them valid and anything else is refused anyway.
    #[inline]
    pub fn read_str_bytes(&mut self) -> Result<&'a [u8]> {
        let at = self.pos;
        let len = match self.byte()? {
            b @ 0xa0..=0xbf => (b & 0x1f) as usize,
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            b => return Err(self.unexpected(at, "str", b)),
        };
        self.take(len)
    }

    #[inline]
    pub fn read_bin(&mut self) -> Result<&'a [u8]> {
        let at = self.pos;
        let len = match self.byte()? {
            0xc4 => self.be(1)? as usize,
            0xc5 => self.be(2)? as usize,
            0xc6 => self.be(4)? as usize,
            b => return Err(self.unexpected(at, "bytes", b)),
        };
        self.take(len)
    }

    /// Reads an integer; the value is returned as i128 so both i64 and u64
    /// ranges fit.
    #[inline]
    pub fn read_int(&mut self) -> Result<i128> {
        let at = self.pos;
        Ok(match self.byte()? {
            b @ 0x00..=0x7f => b as i128,
            b @ 0xe0..=0xff => (b as i8) as i128,
            0xcc => self.be(1)? as i128,
            0xcd => self.be(2)? as i128,
            0xce => self.be(4)? as i128,
            0xcf => self.be(8)? as i128,
            0xd0 => (self.be(1)? as u8 as i8) as i128,
            0xd1 => (self.be(2)? as u16 as i16) as i128,
            0xd2 => (self.be(4)? as u32 as i32) as i128,
            0xd3 => (self.be(8)? as i64) as i128,
            b => return Err(self.unexpected(at, "int", b)),
        })
    }

    /// Skips `n` integers: the hot loop of validating `token_ids`. The width
    /// of each comes from a table, not a branch: token ids mix 2- and 4-byte
    /// encodings at random, which a branch would mispredict half the time.
    /// On error, returns the item's index.
    pub fn skip_ints(&mut self, n: usize) -> std::result::Result<(), (usize, ReadError)> {
        let mut at = self.pos;
        for i in 0..n {
            let Some(&b) = self.buf.get(at) else {
                return Err((i, ReadError::Eof { at }));
            };
            let width = INT_WIDTH[b as usize] as usize;
            if width == 0 {
                return Err((i, self.unexpected(at, "int", b)));
            }
            if at + width > self.buf.len() {
                return Err((i, ReadError::Eof { at: self.buf.len() }));
            }
            at += width;
        }
        self.pos = at;
        Ok(())
    }

    pub fn read_nil(&mut self) -> Result<()> {
        let at = self.pos;
        match self.byte()? {
            0xc0 => Ok(()),
            b => Err(self.unexpected(at, "nil", b)),
        }
    }

    /// `skip_value`, without its heap-allocated stack for the values an
    /// event's fields mostly hold: a scalar, a string, bytes or an array of
    /// ints (`token_ids`); anything else goes to `skip_value`. For bytes
    /// already checked (a batch's events): a string's UTF-8 is not.
    #[inline]
    pub fn skip_field(&mut self) -> Result<()> {
        let at = self.pos;
        match self.peek()? {
            Marker::Nil | Marker::Bool => self.byte().map(drop),
            Marker::Int => self.read_int().map(drop),
            Marker::Str => self.read_str_bytes().map(drop),
            Marker::Bin => self.read_bin().map(drop),
            Marker::Array => {
                let n = self.read_array_len()?;
                if self.skip_ints(n).is_err() {
                    self.pos = at;
                    self.skip_value()?;
                }
                Ok(())
            }
            _ => self.skip_value(),
        }
    }

    /// Skips one complete value of any type, checking it is well formed.
    pub fn skip_value(&mut self) -> Result<()> {
        // Iterative: `remaining` counts values still to skip at each level,
        // so hostile nesting costs heap, never stack.
        let mut remaining: Vec<usize> = vec![1];
        while let Some(top) = remaining.last_mut() {
            if *top == 0 {
                remaining.pop();
                continue;
            }
            *top -= 1;
            let at = self.pos;
            let b = self.byte()?;
            let children = match b {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => 2 * (b & 0x0f) as usize,
                0x90..=0x9f => (b & 0x0f) as usize,
                0xa0..=0xbf => {
                    self.pos = at;
                    self.read_str()?;
                    0
                }
                0xd9..=0xdb => {
                    self.pos = at;
                    self.read_str()?;
                    0
                }
                0xc4 => self.skip_len(1, 0)?,
                0xc5 => self.skip_len(2, 0)?,
                0xc6 => self.skip_len(4, 0)?,
                0xc7 => self.skip_len(1, 1)?,
                0xc8 => self.skip_len(2, 1)?,
                0xc9 => self.skip_len(4, 1)?,
                0xca => self.skip_fixed(4)?,
                0xcb => self.skip_fixed(8)?,
                0xcc | 0xd0 => self.skip_fixed(1)?,
                0xcd | 0xd1 => self.skip_fixed(2)?,
                0xce | 0xd2 => self.skip_fixed(4)?,
                0xcf | 0xd3 => self.skip_fixed(8)?,
                0xd4 => self.skip_fixed(2)?,
                0xd5 => self.skip_fixed(3)?,
                0xd6 => self.skip_fixed(5)?,
                0xd7 => self.skip_fixed(9)?,
                0xd8 => self.skip_fixed(17)?,
                0xdc => self.be(2)? as usize,
                0xdd => self.be(4)? as usize,
                0xde => 2 * self.be(2)? as usize,
                0xdf => 2 * self.be(4)? as usize,
                0xc1 => return Err(self.unexpected(at, "a msgpack value", b)),
            };
            if children > 0 {
                if remaining.len() > MAX_DEPTH {
                    return Err(ReadError::TooDeep { at });
                }
                // Each child needs at least one byte: reject impossible counts
                // before they can make us loop for long.
                if children > self.buf.len() - self.pos {
                    return Err(ReadError::Eof { at: self.buf.len() });
                }
                remaining.push(children);
            }
        }
        Ok(())
    }

    fn skip_fixed(&mut self, n: usize) -> Result<usize> {
        self.take(n)?;
        Ok(0)
    }

    fn skip_len(&mut self, len_bytes: usize, extra: usize) -> Result<usize> {
        let len = self.be(len_bytes)? as usize;
        self.take(len.saturating_add(extra))?;
        Ok(0)
    }
}

/// Encoded size of an integer by its first byte; 0 for anything else.
const INT_WIDTH: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = match b as u8 {
            0x00..=0x7f | 0xe0..=0xff => 1,
            0xcc | 0xd0 => 2,
            0xcd | 0xd1 => 3,
            0xce | 0xd2 => 5,
            0xcf | 0xd3 => 9,
            _ => 0,
        };
        b += 1;
    }
    t
};

/// msgpack's nil.
pub const NIL: u8 = 0xc0;

/// The header of a str, bin, array or map holding `n` (bytes, items or
/// entries), in the smallest form that holds `size`: `n` itself, except for
/// a struct's map (`write_struct_header`). `fix` is the family's short form
/// and how far it reaches, then the 8-bit form if the family has one, the
/// 16- and 32-bit forms: the choices msgspec makes.
fn write_header(
    out: &mut Vec<u8>,
    n: usize,
    size: usize,
    fix: Option<(u8, usize)>,
    wide: (Option<u8>, u8, u8),
) {
    match (fix, wide.0) {
        (Some((short, reach)), _) if size < reach => out.push(short | n as u8),
        (_, Some(w8)) if size <= 0xff => out.extend_from_slice(&[w8, n as u8]),
        _ if size <= 0xffff => {
            out.push(wide.1);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(wide.2);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

/// A msgpack str (UTF-8 `bytes`).
pub fn write_str(out: &mut Vec<u8>, bytes: &[u8]) {
    let n = bytes.len();
    write_header(out, n, n, Some((0xa0, 32)), (Some(0xd9), 0xda, 0xdb));
    out.extend_from_slice(bytes);
}

/// A msgpack bin.
pub fn write_bin(out: &mut Vec<u8>, bytes: &[u8]) {
    let n = bytes.len();
    write_header(out, n, n, None, (Some(0xc4), 0xc5, 0xc6));
    out.extend_from_slice(bytes);
}

/// A non-negative int in its smallest encoding (msgspec's for any int >= 0).
/// Without a branch on the width: token ids mix 2- and 4-byte encodings at
/// random, which a branch would mispredict half the time (as `skip_ints`).
#[inline(always)]
pub fn write_uint(out: &mut Vec<u8>, v: u64) {
    const MARKER: [u8; 9] = [0, 0xcc, 0xcd, 0, 0xce, 0, 0, 0, 0xcf];
    // Bytes after the marker: 0 (a fixint, its own marker), 1, 2, 4 or 8.
    let k = (v >= 0x80) as usize
        + (v > 0xff) as usize
        + 2 * (v > 0xffff) as usize
        + 4 * (v > 0xffff_ffff) as usize;
    let mut buf = [0u8; 9];
    buf[0] = if k == 0 { v as u8 } else { MARKER[k] };
    // The low k bytes of v, big-endian, right after the marker.
    buf[1..].copy_from_slice(&v.wrapping_shl(8 * (8 - k as u32)).to_be_bytes());
    out.reserve(buf.len());
    // SAFETY: `reserve` made room for all 9 bytes; only the first 1 + k are
    // kept, and they are initialised.
    unsafe {
        let len = out.len();
        std::ptr::copy_nonoverlapping(buf.as_ptr(), out.as_mut_ptr().add(len), buf.len());
        out.set_len(len + 1 + k);
    }
}

/// An int in its smallest encoding: the unsigned forms for `v >= 0`, as
/// msgspec writes them.
#[inline(always)]
pub fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as u8);
    } else if v >= i8::MIN as i64 {
        out.extend_from_slice(&[0xd0, v as u8]);
    } else if v >= i16::MIN as i64 {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i32::MIN as i64 {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// A map header for `n` entries of a msgspec struct of at most `max`
/// entries (its fields and tag). With `omit_defaults` msgspec sizes the
/// header for `max` before it knows how many entries follow: vLLM's
/// `BlockStored` (15 fields and the tag) gets a map16 header even with 8.
pub fn write_struct_header(out: &mut Vec<u8>, n: usize, max: usize) {
    write_header(out, n, max, Some((0x80, 16)), (None, 0xde, 0xdf));
}

/// Writes a msgpack array header for `n` elements.
pub fn write_array_header(out: &mut Vec<u8>, n: usize) {
    write_header(out, n, n, Some((0x90, 16)), (None, 0xdc, 0xdd));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ints_across_widths() {
        let cases: &[(&[u8], i128)] = &[
            (&[0x05], 5),
            (&[0xff], -1),
            (&[0xcc, 0xff], 255),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                u64::MAX as i128,
            ),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], i64::MIN as i128),
            (&[0xd0, 0x80], -128),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).read_int().unwrap(), *want);
        }
    }

    #[test]
    fn skip_rejects_truncation_and_deep_nesting() {
        assert!(Reader::new(&[0x92, 0x01]).skip_value().is_err());
        assert!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
            .skip_value()
            .is_err());
        let deep = vec![0x91u8; 100];
        assert!(matches!(
            Reader::new(&deep).skip_value(),
            Err(ReadError::TooDeep { .. }) | Err(ReadError::Eof { .. })
        ));
        let mut nested = vec![0x91u8; 10];
        nested.push(0xc0);
        let mut r = Reader::new(&nested);
        r.skip_value().unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn ints_round_trip_in_their_smallest_form() {
        let cases: &[(i64, usize)] = &[
            (0, 1),
            (127, 1),
            (128, 2),
            (255, 2),
            (256, 3),
            (65_535, 3),
            (65_536, 5),
            (u32::MAX as i64, 5),
            (u32::MAX as i64 + 1, 9),
            (i64::MAX, 9),
            (-1, 1),
            (-32, 1),
            (-33, 2),
            (-128, 2),
            (-129, 3),
            (-32_768, 3),
            (-32_769, 5),
            (i32::MIN as i64, 5),
            (i32::MIN as i64 - 1, 9),
            (i64::MIN, 9),
        ];
        for &(v, len) in cases {
            let mut out = Vec::new();
            write_int(&mut out, v);
            assert_eq!(out.len(), len, "{v}");
            assert_eq!(Reader::new(&out).read_int().unwrap(), v as i128);
        }
        let mut out = Vec::new();
        write_uint(&mut out, u64::MAX);
        assert_eq!(Reader::new(&out).read_int().unwrap(), u64::MAX as i128);
    }

    #[test]
    fn strs_and_bins_round_trip() {
        for len in [0usize, 31, 32, 255, 256, 65_535, 65_536] {
            let s = "x".repeat(len);
            let mut out = Vec::new();
            write_str(&mut out, s.as_bytes());
            write_bin(&mut out, s.as_bytes());
            let mut r = Reader::new(&out);
            assert_eq!(r.read_str().unwrap(), s);
            assert_eq!(r.read_bin().unwrap(), s.as_bytes());
            assert!(r.is_empty());
        }
    }

    #[test]
    fn struct_headers_are_sized_for_the_most_entries() {
        for (n, max, first, len) in [(3, 3, 0x83, 1), (8, 16, 0xde, 3), (8, 70_000, 0xdf, 5)] {
            let mut out = Vec::new();
            write_struct_header(&mut out, n, max);
            assert_eq!((out[0], out.len()), (first, len));
            assert_eq!(Reader::new(&out).read_map_len().unwrap(), n);
        }
    }

    #[test]
    fn array_header_round_trips() {
        for n in [0usize, 15, 16, 65535, 65536] {
            let mut out = Vec::new();
            write_array_header(&mut out, n);
            assert_eq!(Reader::new(&out).read_array_len().unwrap(), n);
        }
    }

    proptest::proptest! {
        /// `skip_field` is `skip_value`, whatever the bytes, but for the
        /// UTF-8 it does not check: where one skips, the other skips as far.
        #[test]
        fn skip_field_is_skip_value(
            bytes in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(vec![0x93u8, 0x92, 0xdc, 0xc0, 0xc3, 0xa1, 0xc4, 0xcd, 0xd3, 0x81, 0xc1]),
                    proptest::prelude::any::<u8>(),
                ],
                0..24,
            ),
        ) {
            let (mut a, mut b) = (Reader::new(&bytes), Reader::new(&bytes));
            let (x, y) = (a.skip_field(), b.skip_value());
            if y.is_ok() {
                proptest::prop_assert!(x.is_ok());
            }
            if x.is_ok() && y.is_ok() {
                proptest::prop_assert_eq!(a.pos(), b.pos());
            }
        }
    }
}
