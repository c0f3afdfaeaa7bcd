//! A worker's output as one buffer: the one form it travels in.
//!
//! Unpickling each output as a tree of tuples, strings and one `bytes` per
//! batch, rebuilt by Python reconstructors, was the largest part of the
//! scheduler's decode-size step; one buffer read in place made that step
//! 9-10% shorter (docs/benchmarks.md, "A worker's output packed in one
//! buffer"). Every output now travels so, whatever it holds: the scheduler
//! reads one form, in Rust only. A native child's container, a Python object
//! of another connector, travels beside the buffer (`output`).
//!
//! ```text
//! 0..4    magic "KVMO"        8..16   rank (i64 LE)
//! 4       format version (2)  16..24  seq (i64 LE)
//! 5..8    zero                24..26  children (u16 LE)
//! 26      settings: 0 none, 1 the worker's `Settings` follow (`put_settings`)
//! per child: its part's tag (u8), then
//!   NOTHING  -
//!   BATCH    family length (u8, >= 1), the family (UTF-8); factor count
//!            (u8, 0: none), the factors (i64 LE each); batch length (u32 LE)
//!   NATIVE   - (the container travels beside the buffer)
//!   REFUSED  reason length (u16 LE), the reason (UTF-8)
//! then every BATCH child's batch, in child order, exactly its bytes
//! ```
//!
//! No Python here: the format, and its damage, are tested in Rust alone.

use std::ops::Range;

use super::settings::{ChildSettings, Settings};

const MAGIC: &[u8; 4] = b"KVMO";
const VERSION: u8 = 2;
const NOTHING: u8 = 0;
const BATCH: u8 = 1;
const NATIVE: u8 = 2;
const REFUSED: u8 = 3;

/// The longest reason a worker sends for a child it could not encode; the
/// scheduler logs at most 500 characters of it.
const REASON_MAX_BYTES: usize = 2000;

/// What an output holds for one child, as ranges of its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The child returned None on this worker.
    Nothing,
    /// An encoded batch of `family`, with the replication factors its
    /// container reported.
    Batch {
        family: Range<usize>,
        factors: Option<Vec<i64>>,
        batch: Range<usize>,
    },
    /// The child's own container, beside the buffer.
    Native,
    /// Why the worker could not encode the child's events.
    Refused(Range<usize>),
}

/// A buffer's header, read.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub rank: i64,
    pub seq: i64,
    pub settings: Option<Settings>,
    pub parts: Vec<Part>,
}

/// Why a buffer is not an output, and its rank when the header got that far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub rank: Option<i64>,
    pub why: String,
}

/// What a worker writes for one child.
pub enum Written<'a> {
    Nothing,
    Batch {
        family: &'a str,
        factors: Option<&'a [i64]>,
        batch: &'a [u8],
    },
    Native,
    Refused(&'a str),
}

/// Why a worker's output cannot be written (the caller's own mistake:
/// values the format has no room for).
#[derive(Debug, PartialEq, Eq)]
pub struct Unwritable(pub String);

/// Reads fields in order, bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<Range<usize>, String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!(
                "the output ends at byte {} of its header",
                self.bytes.len()
            ));
        };
        let range = self.at..end;
        self.at = end;
        Ok(range)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let range = self.take(N)?;
        Ok(self.bytes[range].try_into().expect("N bytes"))
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn text(&mut self, len: usize) -> Result<String, String> {
        let range = self.take(len)?;
        std::str::from_utf8(&self.bytes[range])
            .map(str::to_owned)
            .map_err(|_| "a text of the header is not UTF-8".to_owned())
    }

    /// A count-prefixed (u8) list of i64: None when the count is 0.
    fn factors(&mut self) -> Result<Option<Vec<i64>>, String> {
        match self.u8()? {
            0 => Ok(None),
            n => (0..n)
                .map(|_| self.i64())
                .collect::<Result<_, _>>()
                .map(Some),
        }
    }

    fn settings(&mut self) -> Result<Settings, String> {
        let len = self.u16()? as usize;
        let version = self.text(len)?;
        let world_size = self.i64()?;
        let rank = self.i64()?;
        let kv_events = match self.u8()? {
            0 => false,
            1 => true,
            b => return Err(format!("kv_events is the byte {b}, not 0 or 1")),
        };
        let n = self.u16()? as usize;
        let mut children = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let len = self.u16()? as usize;
            let label = self.text(len)?;
            let rule = match self.u8()? {
                0 => None,
                len => Some(self.text(len as usize)?),
            };
            let factors = self.factors()?;
            children.push(ChildSettings {
                label,
                rule,
                factors,
            });
        }
        Ok(Settings {
            version,
            world_size,
            rank,
            kv_events,
            children,
        })
    }
}

/// The header of `bytes`.
pub fn parse(bytes: &[u8]) -> Result<Header, Damage> {
    let damage = |rank, why| Damage { rank, why };
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(damage(None, "not a kvmerge worker output".into()));
    }
    if bytes[4] != VERSION || bytes[5..8] != [0, 0, 0] {
        return Err(damage(
            None,
            format!(
                "a worker output of format version {} (this kvmerge reads {VERSION}): workers \
                 and scheduler must run the same kvmerge",
                bytes[4]
            ),
        ));
    }
    let mut cursor = Cursor { bytes, at: 8 };
    let rank = cursor.i64().map_err(|why| damage(None, why))?;
    let rest = |cursor: &mut Cursor<'_>| -> Result<_, String> {
        let seq = cursor.i64()?;
        let n = cursor.u16()? as usize;
        let settings = match cursor.u8()? {
            0 => None,
            1 => Some(cursor.settings()?),
            b => return Err(format!("the settings flag is the byte {b}")),
        };
        let mut parts = Vec::with_capacity(n);
        let mut batches = 0usize;
        for _ in 0..n {
            parts.push(match cursor.u8()? {
                NOTHING => Part::Nothing,
                BATCH => {
                    let family = match cursor.u8()? {
                        0 => return Err("a batch without a family".into()),
                        len => cursor.take(len as usize)?,
                    };
                    let factors = cursor.factors()?;
                    let len = u32::from_le_bytes(cursor.array()?) as usize;
                    let batch = batches..batches + len;
                    batches += len;
                    Part::Batch {
                        family,
                        factors,
                        batch,
                    }
                }
                NATIVE => Part::Native,
                REFUSED => {
                    let len = cursor.u16()? as usize;
                    Part::Refused(cursor.take(len)?)
                }
                tag => return Err(format!("a child's part has the unknown tag {tag}")),
            });
        }
        if cursor.at + batches != bytes.len() {
            return Err(format!(
                "the batches take {batches} bytes after the header, the output has {}",
                bytes.len() - cursor.at
            ));
        }
        for part in &mut parts {
            if let Part::Batch { batch, .. } = part {
                *batch = batch.start + cursor.at..batch.end + cursor.at;
            }
        }
        Ok((seq, settings, parts))
    };
    let (seq, settings, parts) = rest(&mut cursor).map_err(|why| damage(Some(rank), why))?;
    Ok(Header {
        rank,
        seq,
        settings,
        parts,
    })
}

/// Appends to `out`, in the header's order.
struct Out(Vec<u8>);

impl Out {
    fn put(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    /// A text of at most `max` bytes, after its length in `width` bytes.
    fn text(&mut self, text: &str, width: usize, what: &str) -> Result<(), Unwritable> {
        let max = (1usize << (8 * width)) - 1;
        if text.len() > max {
            return Err(Unwritable(format!(
                "{what} is {} bytes long, more than {max}",
                text.len()
            )));
        }
        self.put(&(text.len() as u64).to_le_bytes()[..width]);
        self.put(text.as_bytes());
        Ok(())
    }

    fn factors(&mut self, factors: Option<&[i64]>) -> Result<(), Unwritable> {
        let factors = factors.unwrap_or(&[]);
        if factors.len() > u8::MAX as usize {
            return Err(Unwritable(format!(
                "{} replication factors, more than {}",
                factors.len(),
                u8::MAX
            )));
        }
        self.put(&[factors.len() as u8]);
        for f in factors {
            self.put(&f.to_le_bytes());
        }
        Ok(())
    }

    fn part(&mut self, part: &Written<'_>) -> Result<(), Unwritable> {
        match part {
            Written::Nothing => self.put(&[NOTHING]),
            Written::Batch {
                family,
                factors,
                batch,
            } => {
                if family.is_empty() {
                    return Err(Unwritable("a batch's family is empty".into()));
                }
                self.put(&[BATCH]);
                self.text(family, 1, "a family's name")?;
                self.factors(*factors)?;
                let len = u32::try_from(batch.len()).map_err(|_| {
                    Unwritable(format!("a batch of {} bytes, more than 4 GiB", batch.len()))
                })?;
                self.put(&len.to_le_bytes());
            }
            Written::Native => self.put(&[NATIVE]),
            Written::Refused(reason) => {
                self.put(&[REFUSED]);
                self.text(cut(reason, REASON_MAX_BYTES), 2, "a reason")?;
            }
        }
        Ok(())
    }

    fn settings(&mut self, s: &Settings) -> Result<(), Unwritable> {
        self.text(&s.version, 2, "the kvmerge version")?;
        self.put(&s.world_size.to_le_bytes());
        self.put(&s.rank.to_le_bytes());
        self.put(&[u8::from(s.kv_events)]);
        self.count(s.children.len(), "settings' children")?;
        for c in &s.children {
            self.text(&c.label, 2, "a child's label")?;
            self.text(c.rule.as_deref().unwrap_or(""), 1, "a child's rule")?;
            self.factors(c.factors.as_deref())?;
        }
        Ok(())
    }

    fn count(&mut self, n: usize, what: &str) -> Result<(), Unwritable> {
        let n = u16::try_from(n)
            .map_err(|_| Unwritable(format!("{n} {what}, more than {}", u16::MAX)))?;
        self.put(&n.to_le_bytes());
        Ok(())
    }
}

/// One output's buffer but its batches, which follow it in child order
/// (`write`; the binding copies them straight into the Python `bytes`).
pub fn header(
    rank: i64,
    seq: i64,
    settings: Option<&Settings>,
    parts: &[Written<'_>],
) -> Result<Vec<u8>, Unwritable> {
    let mut out = Out(Vec::with_capacity(64 + 32 * parts.len()));
    out.put(MAGIC);
    out.put(&[VERSION, 0, 0, 0]);
    out.put(&rank.to_le_bytes());
    out.put(&seq.to_le_bytes());
    out.count(parts.len(), "children")?;
    match settings {
        None => out.put(&[0]),
        Some(s) => {
            out.put(&[1]);
            out.settings(s)?;
        }
    }
    for part in parts {
        out.part(part)?;
    }
    Ok(out.0)
}

/// Why `part` cannot be written into an output's header, if it cannot (the
/// same code as `header`'s).
pub fn unwritable(part: &Written<'_>) -> Option<Unwritable> {
    Out(Vec::new()).part(part).err()
}

/// The batches of `parts`, in child order: what follows the header.
pub fn batches<'a>(parts: &'a [Written<'a>]) -> impl Iterator<Item = &'a [u8]> {
    parts.iter().filter_map(|p| match p {
        Written::Batch { batch, .. } => Some(*batch),
        _ => None,
    })
}

/// One output's buffer: its header, then its batches.
#[cfg(any(test, feature = "testing"))]
pub fn write(
    rank: i64,
    seq: i64,
    settings: Option<&Settings>,
    parts: &[Written<'_>],
) -> Result<Vec<u8>, Unwritable> {
    let mut out = header(rank, seq, settings, parts)?;
    for batch in batches(parts) {
        out.extend_from_slice(batch);
    }
    Ok(out)
}

/// The longest prefix of `text` of at most `max` bytes, at a character
/// boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            version: "0.1.0".into(),
            world_size: 2,
            rank: 1,
            kv_events: true,
            children: vec![ChildSettings {
                label: "connectors[0] (X)".into(),
                rule: Some("quorum".into()),
                factors: Some(vec![2]),
            }],
        }
    }

    fn sample() -> Vec<u8> {
        write(
            3,
            7,
            Some(&settings()),
            &[
                Written::Batch {
                    family: "lmcache",
                    factors: None,
                    batch: &[1, 2],
                },
                Written::Nothing,
                Written::Native,
                Written::Refused("no"),
                Written::Batch {
                    family: "mooncake",
                    factors: Some(&[1, 2]),
                    batch: &[10, 20, 30],
                },
            ],
        )
        .expect("writes")
    }

    #[test]
    fn what_is_written_reads_back() {
        let bytes = sample();
        let h = parse(&bytes).expect("parses");
        assert_eq!((h.rank, h.seq), (3, 7));
        assert_eq!(h.settings, Some(settings()));
        assert_eq!(h.parts.len(), 5);
        let Part::Batch { batch, .. } = &h.parts[0] else {
            panic!("{:?}", h.parts[0])
        };
        assert_eq!(&bytes[batch.clone()], &[1, 2]);
        assert_eq!(h.parts[1], Part::Nothing);
        assert_eq!(h.parts[2], Part::Native);
        let Part::Refused(reason) = &h.parts[3] else {
            panic!()
        };
        assert_eq!(&bytes[reason.clone()], b"no");
        let Part::Batch {
            family,
            factors,
            batch,
        } = &h.parts[4]
        else {
            panic!()
        };
        assert_eq!(&bytes[family.clone()], b"mooncake");
        assert_eq!(factors.as_deref(), Some(&[1i64, 2][..]));
        assert_eq!(&bytes[batch.clone()], &[10, 20, 30]);
    }

    #[test]
    fn every_truncation_and_extension_is_damage() {
        let mut bytes = sample();
        for end in 0..bytes.len() {
            let err = parse(&bytes[..end]).expect_err("truncated");
            // The rank is named once the header holds it.
            assert_eq!(err.rank.is_some(), end >= 16, "{end}: {}", err.why);
        }
        bytes.push(0);
        assert!(parse(&bytes).is_err());
    }

    #[test]
    fn no_flipped_byte_panics() {
        let bytes = sample();
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[at] ^= 1 << bit;
                let _ = parse(&b);
            }
        }
    }

    #[test]
    fn an_older_format_names_its_version() {
        let mut bytes = sample();
        bytes[4] = 1;
        let err = parse(&bytes).expect_err("version 1");
        assert!(err.why.contains("format version 1"), "{}", err.why);
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character() {
        let reason = "é".repeat(REASON_MAX_BYTES);
        let bytes = write(0, 0, None, &[Written::Refused(&reason)]).expect("writes");
        let h = parse(&bytes).expect("parses");
        let Part::Refused(r) = &h.parts[0] else {
            panic!()
        };
        let text = std::str::from_utf8(&bytes[r.clone()]).expect("utf-8");
        assert_eq!(text.len(), REASON_MAX_BYTES);
    }

    #[test]
    fn what_does_not_fit_is_refused() {
        let family = "f".repeat(256);
        let batch = Written::Batch {
            family: &family,
            factors: None,
            batch: &[],
        };
        assert!(write(0, 0, None, &[batch]).is_err());
        let empty = Written::Batch {
            family: "",
            factors: None,
            batch: &[],
        };
        assert!(write(0, 0, None, &[empty]).is_err());
    }

    #[test]
    fn unwritable_says_what_header_refuses() {
        let family = "f".repeat(256);
        let factors = vec![1; 256];
        for part in [
            Written::Batch {
                family: &family,
                factors: None,
                batch: &[],
            },
            Written::Batch {
                family: "",
                factors: None,
                batch: &[],
            },
            Written::Batch {
                family: "lmcache",
                factors: Some(&factors),
                batch: &[],
            },
        ] {
            let why = unwritable(&part).expect("unwritable");
            assert_eq!(header(0, 0, None, &[part]).expect_err("refused"), why);
        }
        let fits = Written::Batch {
            family: &family[..255],
            factors: Some(&factors[..255]),
            batch: &[],
        };
        assert_eq!(unwritable(&fits), None);
        assert!(header(0, 0, None, &[fits]).is_ok());
    }
}
