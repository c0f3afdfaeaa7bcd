//! A worker's output packed into one buffer, as a message carries it.
//!
//! At decode-size steps unpickling was the largest part of the scheduler's
//! step: each output came as a tree of tuples, strings and one `bytes` per
//! batch, rebuilt by two Python reconstructors, and every batch was
//! validated and wrapped in an `EventBatch` there, whether or not anything
//! would read it as one. Packed, an output unpickles as one `bytes`; the
//! connector's common step (`step`) reads the header and validates each
//! child's batch where it merges it, with no Python object in between. The
//! fields are unpacked into Python objects (`_unpack`) only when Python code
//! reads them: the connector's checks of an output that is not of the
//! common shape, or a test.
//!
//! ```text
//! 0..4    magic "KVMO"        8..16   rank (i64 LE)
//! 4       format version (1)  16..24  seq (i64 LE)
//! 5..8    zero                24..26  children (u16 LE)
//! per child: family length (u8, 0: the child returned nothing), the
//!            family (UTF-8); factor count (u8, 0: none), the factors
//!            (i64 LE each); batch length (u32 LE)
//! then every child's batch, in child order, exactly its bytes
//! ```
//! An output is packed only when all of it fits: no settings, int rank and
//! `seq`, every entry a valid `EventBatch` (or nothing, for a child without
//! a family), at most `PACKED_MAX_BYTES` in all. Anything else travels as
//! the tuples it always did.

use std::ops::Range;
use std::sync::Arc;

use kvmerge_core::{Backing, Batch};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString, PyTuple};

use crate::batch::{backing_of, PyEventBatch, Refusal};
use crate::convert::type_name;
use crate::gil::{is_small, without_gil_unless};

const MAGIC: &[u8; 4] = b"KVMO";
/// The largest output packed. Packing copies the batches once more on the
/// worker; what it saves on the scheduler (Python objects per output, a few
/// microseconds) is the same at any size. Above this, the copy costs more
/// than that, and each batch travels as its own buffer (out of band when
/// large) instead.
pub const PACKED_MAX_BYTES: usize = 64 << 10;
const VERSION: u8 = 1;
const HEADER_LEN: usize = 26;

/// One part of a packed output's buffer: a child's batch, read in place.
struct Part {
    whole: Arc<dyn Backing>,
    range: Range<usize>,
}

// SAFETY: a part of a backing, which never changes and lives as long.
unsafe impl Backing for Part {
    fn bytes(&self) -> &[u8] {
        &self.whole.bytes()[self.range.clone()]
    }
}

/// What the header says of one child.
struct Child {
    family: Option<Range<usize>>,
    factors: Option<Vec<i64>>,
    batch: Range<usize>,
}

/// A packed output: its rank and `seq`, and where each child's parts are.
pub(crate) struct Packed {
    whole: Arc<dyn Backing>,
    pub rank: i64,
    pub seq: i64,
    children: Vec<Child>,
}

/// Why a buffer is not a packed output, and its rank when the header got
/// that far.
pub(crate) struct Damage {
    rank: Option<i64>,
    why: String,
}

/// Reads the header's fields in order, bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<Range<usize>, String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!(
                "the packed output ends at byte {} of its header",
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

    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.array()?))
    }
}

/// The header of `bytes`: rank, `seq` and the children's parts.
fn parse(bytes: &[u8]) -> Result<(i64, i64, Vec<Child>), Damage> {
    let damage = |rank, why| Damage { rank, why };
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(damage(None, "not a packed kvmerge output".into()));
    }
    if bytes[4] != VERSION || bytes[5..8] != [0, 0, 0] {
        return Err(damage(
            None,
            format!(
                "a packed output of format version {} (this kvmerge reads {VERSION}): workers \
                 and scheduler must run the same kvmerge",
                bytes[4]
            ),
        ));
    }
    let mut cursor = Cursor { bytes, at: 8 };
    let rank = cursor.i64().map_err(|why| damage(None, why))?;
    let header = |cursor: &mut Cursor<'_>| -> Result<_, String> {
        let seq = cursor.i64()?;
        let n = u16::from_le_bytes(cursor.array()?) as usize;
        let mut children = Vec::with_capacity(n);
        let mut batches = 0usize;
        for _ in 0..n {
            let family = match cursor.u8()? {
                0 => None,
                len => Some(cursor.take(len as usize)?),
            };
            let factors = match cursor.u8()? {
                0 => None,
                count => Some(
                    (0..count)
                        .map(|_| cursor.i64())
                        .collect::<Result<Vec<_>, _>>()?,
                ),
            };
            let len = u32::from_le_bytes(cursor.array()?) as usize;
            if family.is_none() && (factors.is_some() || len != 0) {
                return Err("a child without a family has factors or a batch".into());
            }
            children.push(Child {
                family,
                factors,
                batch: batches..batches + len,
            });
            batches += len;
        }
        if cursor.at + batches != bytes.len() {
            return Err(format!(
                "the batches take {batches} bytes after the header, the packed output has {}",
                bytes.len() - cursor.at
            ));
        }
        for child in &mut children {
            child.batch = child.batch.start + cursor.at..child.batch.end + cursor.at;
        }
        Ok((seq, children))
    };
    let (seq, children) = header(&mut cursor).map_err(|why| damage(Some(rank), why))?;
    Ok((rank, seq, children))
}

impl Packed {
    /// `obj` (what unpickling gave for the packed output) read.
    pub(crate) fn read(obj: &Bound<'_, PyAny>) -> Result<Packed, Damage> {
        let whole: Arc<dyn Backing> = match backing_of(obj) {
            Ok(backing) => Arc::from(backing),
            Err(Refusal::NotABuffer(_)) => {
                return Err(Damage {
                    rank: None,
                    why: format!("a packed output is a {}", type_name(obj)),
                })
            }
            Err(Refusal::Corrupt(why)) => return Err(Damage { rank: None, why }),
        };
        let (rank, seq, children) = parse(whole.bytes())?;
        Ok(Packed {
            whole,
            rank,
            seq,
            children,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.children.len()
    }

    /// Child `i`'s family, as the worker wrote it; None when the child
    /// returned nothing.
    pub(crate) fn family(&self, i: usize) -> Option<&[u8]> {
        let range = self.children[i].family.clone()?;
        Some(&self.whole.bytes()[range])
    }

    pub(crate) fn factors(&self, i: usize) -> Option<&[i64]> {
        self.children[i].factors.as_deref()
    }

    /// Child `i`'s batch, validated (a large one with the GIL released).
    pub(crate) fn batch(&self, py: Python<'_>, i: usize) -> Result<Batch, String> {
        let range = self.children[i].batch.clone();
        let small = is_small(range.len() as u64, 0);
        let part = Part {
            whole: self.whole.clone(),
            range,
        };
        without_gil_unless(py, small, || Batch::from_backing(Box::new(part)))
            .map_err(|e| e.to_string())
    }
}

/// One child as `_pack` writes it.
#[derive(Default)]
struct Written {
    family: Option<String>,
    factors: Option<Vec<i64>>,
    batch: Option<Arc<Batch>>,
}

impl Written {
    fn header_len(&self) -> usize {
        let family = self.family.as_ref().map_or(0, |f| f.len());
        let factors = self.factors.as_ref().map_or(0, |f| f.len());
        1 + family + 1 + 8 * factors + 4
    }

    fn batch_len(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.bytes().len())
    }
}

// `KVMergeKVEvents.__reduce__`'s packing of one output; docs in
// _kvmerge.pyi. None for anything it does not pack (the tuples then
// carry it).
#[pyfunction]
pub fn _pack<'py>(
    py: Python<'py>,
    rank: &Bound<'py, PyAny>,
    seq: &Bound<'py, PyAny>,
    settings: &Bound<'py, PyAny>,
    families: &Bound<'py, PyAny>,
    entries: &Bound<'py, PyAny>,
    factors: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let int = |v: &Bound<'py, PyAny>| v.cast_exact::<PyInt>().ok()?.extract::<i64>().ok();
    let (Some(rank), Some(seq)) = (int(rank), int(seq)) else {
        return Ok(None);
    };
    let tuple = |v: &Bound<'py, PyAny>| v.cast_exact::<PyTuple>().ok().cloned();
    let (Some(families), Some(entries), Some(factors)) =
        (tuple(families), tuple(entries), tuple(factors))
    else {
        return Ok(None);
    };
    let n = families.len();
    if !settings.is_none() || entries.len() != n || factors.len() != n || n > u16::MAX as usize {
        return Ok(None);
    }
    let mut children: Vec<Written> = Vec::with_capacity(n);
    for i in 0..n {
        let (family, entry, reported) = (
            families.get_item(i)?,
            entries.get_item(i)?,
            factors.get_item(i)?,
        );
        if family.is_none() {
            if !entry.is_none() || !reported.is_none() {
                return Ok(None);
            }
            children.push(Written::default());
            continue;
        }
        let Ok(family) = family.cast_exact::<PyString>() else {
            return Ok(None);
        };
        let family = family.to_str()?.to_owned();
        if family.is_empty() || family.len() > u8::MAX as usize {
            return Ok(None);
        }
        let reported = if reported.is_none() {
            None
        } else {
            let Some(t) = tuple(&reported) else {
                return Ok(None);
            };
            let values = t.iter().map(|f| int(&f)).collect::<Option<Vec<_>>>();
            match values {
                Some(v) if !v.is_empty() && v.len() <= u8::MAX as usize => Some(v),
                _ => return Ok(None),
            }
        };
        let Some(batch) = entry
            .cast_exact::<PyEventBatch>()
            .ok()
            .and_then(|b| b.get().valid().cloned())
        else {
            return Ok(None);
        };
        if batch.bytes().len() > u32::MAX as usize {
            return Ok(None);
        }
        children.push(Written {
            family: Some(family),
            factors: reported,
            batch: Some(batch),
        });
    }
    let total = HEADER_LEN
        + children
            .iter()
            .map(|c| c.header_len() + c.batch_len())
            .sum::<usize>();
    if total > PACKED_MAX_BYTES {
        return Ok(None);
    }
    let packed = PyBytes::new_with(py, total, |out| {
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(MAGIC);
        put(&[VERSION, 0, 0, 0]);
        put(&rank.to_le_bytes());
        put(&seq.to_le_bytes());
        put(&(n as u16).to_le_bytes());
        for child in &children {
            let family = child.family.as_deref().unwrap_or("");
            put(&[family.len() as u8]);
            put(family.as_bytes());
            let factors = child.factors.as_deref().unwrap_or(&[]);
            put(&[factors.len() as u8]);
            for f in factors {
                put(&f.to_le_bytes());
            }
            put(&(child.batch_len() as u32).to_le_bytes());
        }
        for batch in children.iter().filter_map(|c| c.batch.as_ref()) {
            put(batch.bytes());
        }
        Ok(())
    })?;
    Ok(Some(packed))
}

// A packed output's fields as Python objects; docs in _kvmerge.pyi. Never
// raises for what it is given: a damaged output gives why, and its rank if
// the header got that far.
#[pyfunction]
pub fn _unpack<'py>(py: Python<'py>, packed: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
    let none = || py.None().into_bound(py);
    let empty = || PyTuple::empty(py).into_any();
    let read = match Packed::read(packed) {
        Ok(read) => read,
        Err(Damage { rank, why }) => {
            let rank = rank.map_or_else(none, |r| PyInt::new(py, r).into_any());
            let why = PyString::new(py, &format!("the packed output is damaged: {why}"));
            return PyTuple::new(
                py,
                [rank, none(), empty(), empty(), empty(), why.into_any()],
            );
        }
    };
    let n = read.len();
    let mut families = Vec::with_capacity(n);
    let mut entries = Vec::with_capacity(n);
    let mut factors = Vec::with_capacity(n);
    for i in 0..n {
        let Some(family) = read.family(i) else {
            families.push(none());
            entries.push(none());
            factors.push(none());
            continue;
        };
        // Not UTF-8: the connector refuses a family it does not know.
        families.push(PyString::new(py, &String::from_utf8_lossy(family)).into_any());
        factors.push(match read.factors(i) {
            None => none(),
            Some(f) => PyTuple::new(py, f)?.into_any(),
        });
        let batch = match read.batch(py, i) {
            Ok(batch) => PyEventBatch::new(Arc::new(batch)),
            Err(why) => PyEventBatch::invalid(why),
        };
        entries.push(Bound::new(py, batch)?.into_any());
    }
    PyTuple::new(
        py,
        [
            PyInt::new(py, read.rank).into_any(),
            PyInt::new(py, read.seq).into_any(),
            PyTuple::new(py, families)?.into_any(),
            PyTuple::new(py, entries)?.into_any(),
            PyTuple::new(py, factors)?.into_any(),
            none(),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(rank: i64, seq: i64, children: &[(&str, &[i64], u32)]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend([VERSION, 0, 0, 0]);
        out.extend(rank.to_le_bytes());
        out.extend(seq.to_le_bytes());
        out.extend((children.len() as u16).to_le_bytes());
        for (family, factors, len) in children {
            out.push(family.len() as u8);
            out.extend(family.as_bytes());
            out.push(factors.len() as u8);
            for f in *factors {
                out.extend(f.to_le_bytes());
            }
            out.extend(len.to_le_bytes());
        }
        out
    }

    #[test]
    fn parts_follow_the_header() {
        let mut bytes = header(
            3,
            7,
            &[("lmcache", &[], 2), ("", &[], 0), ("umbp", &[1, 2], 3)],
        );
        let at = bytes.len();
        bytes.extend([1, 2, 10, 20, 30]);
        let (rank, seq, children) = parse(&bytes).ok().expect("parses");
        assert_eq!((rank, seq, children.len()), (3, 7, 3));
        assert_eq!(children[0].batch, at..at + 2);
        assert!(children[1].family.is_none());
        assert_eq!(children[2].factors.as_deref(), Some(&[1i64, 2][..]));
        assert_eq!(&bytes[children[2].batch.clone()], &[10, 20, 30]);
    }

    #[test]
    fn every_truncation_and_extension_is_damage() {
        let mut bytes = header(3, 7, &[("lmcache", &[4], 2)]);
        bytes.extend([1, 2]);
        for end in 0..bytes.len() {
            let err = parse(&bytes[..end]).err().expect("truncated");
            // The rank is named once the header holds it.
            assert_eq!(err.rank.is_some(), end >= 16, "{end}: {}", err.why);
        }
        bytes.push(0);
        assert!(parse(&bytes).is_err());
    }

    #[test]
    fn a_child_without_a_family_carries_nothing() {
        let mut bytes = header(0, 1, &[("", &[], 1)]);
        bytes.push(9);
        assert!(parse(&bytes).is_err());
    }
}
