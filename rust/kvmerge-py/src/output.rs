//! `WorkerOutput`: what one worker sends the scheduler for one step, in the
//! one form it travels in (`wire`), with a native child's container beside.
//!
//! The worker builds it from typed values; the scheduler's `OutputMerger`
//! reads it, and nothing else does on the step path. Unpickling never
//! raises, whatever a damaged message holds: it runs inside vLLM's message
//! queue, where an exception is fatal to the engine, before any code could
//! drop one worker's output. A damaged output remembers why; the step
//! refuses it, naming its rank when the header got that far.

use std::ops::Range;
use std::sync::Arc;

use kvmerge_core::{Backing, Batch};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString, PyTuple};

use crate::batch::{backing_of, pickle_buffer_type, PyEventBatch, Refusal};
use crate::convert::type_name;
use crate::gil::{is_small, without_gil_unless};
use crate::settings::PyWorkerSettings;
use kvmerge_core::step::wire::{self, Damage, Header, Part, Written};

/// The first pickle protocol with out-of-band buffers.
const OUT_OF_BAND_PROTOCOL: i64 = 5;

/// One part of an output's buffer (a child's batch), read in place.
struct Slice {
    whole: Arc<dyn Backing>,
    range: Range<usize>,
}

// SAFETY: a part of a backing, which never changes and lives as long.
unsafe impl Backing for Slice {
    fn bytes(&self) -> &[u8] {
        &self.whole.bytes()[self.range.clone()]
    }
}

/// A buffer that reads: its bytes and its header.
pub(crate) struct Read {
    whole: Arc<dyn Backing>,
    pub header: Header,
}

impl Read {
    /// The bytes of `range` of the buffer.
    pub(crate) fn bytes(&self, range: &Range<usize>) -> &[u8] {
        &self.whole.bytes()[range.clone()]
    }

    /// The batch at `range`, validated (a large one with the GIL released).
    pub(crate) fn batch(&self, py: Python<'_>, range: &Range<usize>) -> Result<Batch, String> {
        let small = is_small(range.len() as u64, 0);
        let part = Slice {
            whole: self.whole.clone(),
            range: range.clone(),
        };
        without_gil_unless(py, small, || Batch::from_backing(Box::new(part)))
            .map_err(|e| e.to_string())
    }
}

#[pyclass(module = "kvmerge._kvmerge", frozen, name = "WorkerOutput")]
pub struct PyWorkerOutput {
    /// What travels: the buffer as received or written.
    buffer: Py<PyAny>,
    read: Result<Read, Damage>,
    /// None, or per child the native container (None for other children).
    natives: Py<PyAny>,
}

impl PyWorkerOutput {
    pub(crate) fn read(&self) -> Result<&Read, &Damage> {
        self.read.as_ref()
    }

    /// Child `i`'s native container, if the output carries one there.
    pub(crate) fn native<'py>(&self, py: Python<'py>, i: usize) -> Option<Bound<'py, PyAny>> {
        let natives = self.natives.bind(py).cast::<PyTuple>().ok()?;
        natives.get_item(i).ok().filter(|n| !n.is_none())
    }

    fn from_buffer(buffer: &Bound<'_, PyAny>, natives: Py<PyAny>) -> Self {
        let read = match backing_of(buffer) {
            Ok(backing) => {
                let whole: Arc<dyn Backing> = Arc::from(backing);
                wire::parse(whole.bytes()).map(|header| Read { whole, header })
            }
            Err(Refusal::NotABuffer(_)) => Err(Damage {
                rank: None,
                why: format!("a worker output is a {}", type_name(buffer)),
            }),
            Err(Refusal::Corrupt(why)) => Err(Damage { rank: None, why }),
        };
        PyWorkerOutput {
            buffer: buffer.clone().unbind(),
            read,
            natives,
        }
    }
}

/// One child's entry, as `WorkerOutput()` takes it.
enum Entry<'py> {
    Nothing,
    Batch {
        family: String,
        batch: Arc<Batch>,
        factors: Option<Vec<i64>>,
    },
    Native(Bound<'py, PyAny>),
    Refused(String),
}

fn entry<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Entry<'py>> {
    if obj.is_none() {
        return Ok(Entry::Nothing);
    }
    if let Ok(reason) = obj.cast::<PyString>() {
        return Ok(Entry::Refused(reason.to_str()?.to_owned()));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let (family, batch, factors): (String, Bound<'py, PyEventBatch>, Option<Vec<i64>>) =
            tuple.extract().map_err(|_| {
                PyTypeError::new_err(
                    "an encoded child's entry is (family: str, batch: EventBatch, \
                     factors: tuple[int, ...] | None)",
                )
            })?;
        let batch = batch.get().valid().cloned().ok_or_else(|| {
            PyValueError::new_err(format!(
                "the {family} batch does not read: {}",
                batch.get().error().unwrap_or_default()
            ))
        })?;
        return Ok(Entry::Batch {
            family,
            batch,
            factors,
        });
    }
    Ok(Entry::Native(obj.clone()))
}

/// How `entry` is written into the buffer.
fn written<'a>(entry: &'a Entry<'_>) -> Written<'a> {
    match entry {
        Entry::Nothing => Written::Nothing,
        Entry::Batch {
            family,
            batch,
            factors,
        } => Written::Batch {
            family,
            factors: factors.as_deref(),
            batch: batch.bytes(),
        },
        Entry::Native(_) => Written::Native,
        Entry::Refused(reason) => Written::Refused(reason),
    }
}

impl PyWorkerOutput {
    fn build(
        py: Python<'_>,
        rank: i64,
        seq: i64,
        entries: Vec<Entry<'_>>,
        settings: Option<&Bound<'_, PyWorkerSettings>>,
    ) -> PyResult<Self> {
        let written: Vec<Written<'_>> = entries.iter().map(written).collect();
        let settings = settings.map(|s| &s.get().0);
        let header = wire::header(rank, seq, settings, &written)
            .map_err(|e| PyValueError::new_err(format!("WorkerOutput: {}", e.0)))?;
        let total = header.len() + wire::batches(&written).map(<[u8]>::len).sum::<usize>();
        // The batches copied once, into the buffer that travels.
        let buffer = PyBytes::new_with(py, total, |out| {
            out[..header.len()].copy_from_slice(&header);
            let mut at = header.len();
            for batch in wire::batches(&written) {
                out[at..at + batch.len()].copy_from_slice(batch);
                at += batch.len();
            }
            Ok(())
        })?;
        let natives = if entries.iter().any(|e| matches!(e, Entry::Native(_))) {
            let items = entries.iter().map(|e| match e {
                Entry::Native(obj) => obj.clone(),
                _ => py.None().into_bound(py),
            });
            PyTuple::new(py, items)?.into_any().unbind()
        } else {
            py.None()
        };
        Ok(PyWorkerOutput::from_buffer(buffer.as_any(), natives))
    }
}

// The Python-facing docs are in _kvmerge.pyi; comments here say why.
#[pymethods]
impl PyWorkerOutput {
    #[new]
    #[pyo3(signature = (rank, seq, entries, settings = None))]
    fn new(
        py: Python<'_>,
        rank: i64,
        seq: i64,
        entries: Vec<Bound<'_, PyAny>>,
        settings: Option<&Bound<'_, PyWorkerSettings>>,
    ) -> PyResult<Self> {
        let entries = entries.iter().map(entry).collect::<PyResult<Vec<_>>>()?;
        Self::build(py, rank, seq, entries, settings)
    }

    // On the worker's step path an exception stops the engine: a child's
    // entry that cannot be sent costs only that child's part, which the
    // scheduler refuses (counted, logged with the rank).
    #[staticmethod]
    #[pyo3(signature = (rank, seq, entries, settings = None))]
    fn for_step(
        py: Python<'_>,
        rank: i64,
        seq: i64,
        entries: Vec<Bound<'_, PyAny>>,
        settings: Option<&Bound<'_, PyWorkerSettings>>,
    ) -> PyResult<Self> {
        let refused = |why: &dyn std::fmt::Display| {
            Entry::Refused(format!("its entry cannot be sent: {why}"))
        };
        let entries = entries
            .iter()
            .map(|obj| match entry(obj) {
                Err(err) => refused(&err),
                Ok(e) => match wire::unwritable(&written(&e)) {
                    Some(wire::Unwritable(why)) => refused(&why),
                    None => e,
                },
            })
            .collect();
        Self::build(py, rank, seq, entries, settings)
    }

    // The pickle reconstructor: never raises for what it is given (see the
    // module's docs).
    #[staticmethod]
    #[pyo3(signature = (buffer = None, natives = None, *_rest))]
    fn _from_wire(
        py: Python<'_>,
        buffer: Option<&Bound<'_, PyAny>>,
        natives: Option<Bound<'_, PyAny>>,
        _rest: &Bound<'_, PyTuple>,
    ) -> Self {
        let none = py.None().into_bound(py);
        let natives = natives.unwrap_or_else(|| none.clone()).unbind();
        PyWorkerOutput::from_buffer(buffer.unwrap_or(&none), natives)
    }

    fn __reduce_ex__<'py>(
        slf: &Bound<'py, Self>,
        protocol: i64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let rebuild = slf
            .py()
            .get_type::<PyWorkerOutput>()
            .getattr("_from_wire")?;
        Ok((rebuild, Self::_wire(slf, protocol)?))
    }

    // What travels, as `_from_wire` takes it: the buffer (out of band from
    // protocol 5) and the natives. `KVMergeKVEvents` pickles its outputs so,
    // under one reconstructor of its own.
    fn _wire<'py>(slf: &Bound<'py, Self>, protocol: i64) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let buffer = me.buffer.bind(py);
        let Ok(read) = &me.read else {
            // Damaged: as it came, for the next reader to refuse in turn.
            return PyTuple::new(py, [buffer.clone(), me.natives.bind(py).clone()]);
        };
        // The bytes that were read: a buffer its sender can still write
        // (a `bytearray`) was read from a copy, and the copy is what travels.
        let buffer = if buffer.is_exact_instance_of::<PyBytes>() {
            buffer.clone()
        } else {
            PyBytes::new(py, read.whole.bytes()).into_any()
        };
        let buffer = match pickle_buffer_type(py) {
            Some(wrap) if protocol >= OUT_OF_BAND_PROTOCOL => wrap.call1((buffer,))?,
            _ => buffer,
        };
        PyTuple::new(py, [buffer, me.natives.bind(py).clone()])
    }

    #[getter]
    fn rank(&self) -> Option<i64> {
        match &self.read {
            Ok(read) => Some(read.header.rank),
            Err(damage) => damage.rank,
        }
    }

    #[getter]
    fn seq(&self) -> Option<i64> {
        self.read.as_ref().ok().map(|r| r.header.seq)
    }

    #[getter]
    fn settings(&self) -> Option<PyWorkerSettings> {
        let read = self.read.as_ref().ok()?;
        read.header.settings.clone().map(PyWorkerSettings)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.read.as_ref().map_or(0, |r| r.whole.bytes().len())
    }

    #[getter]
    fn damage(&self) -> Option<&str> {
        self.read.as_ref().err().map(|d| d.why.as_str())
    }

    #[getter]
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let Ok(read) = &self.read else {
            return Ok(PyTuple::empty(py));
        };
        let none = || py.None().into_bound(py);
        let items = read
            .header
            .parts
            .iter()
            .enumerate()
            .map(|(i, part)| -> PyResult<Bound<'py, PyAny>> {
                Ok(match part {
                    Part::Nothing => none(),
                    Part::Native => self.native(py, i).unwrap_or_else(none),
                    Part::Refused(reason) => {
                        PyString::new(py, &String::from_utf8_lossy(read.bytes(reason))).into_any()
                    }
                    Part::Batch { batch, .. } => {
                        let batch = match read.batch(py, batch) {
                            Ok(batch) => PyEventBatch::new(Arc::new(batch)),
                            Err(why) => PyEventBatch::invalid(why),
                        };
                        Bound::new(py, batch)?.into_any()
                    }
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    }

    #[getter]
    fn families<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let Ok(read) = &self.read else {
            return Ok(PyTuple::empty(py));
        };
        let items = read.header.parts.iter().map(|part| match part {
            Part::Batch { family, .. } => Some(String::from_utf8_lossy(read.bytes(family))),
            _ => None,
        });
        PyTuple::new(py, items)
    }

    #[getter]
    fn factors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let Ok(read) = &self.read else {
            return Ok(PyTuple::empty(py));
        };
        let items = read
            .header
            .parts
            .iter()
            .map(|part| match part {
                Part::Batch {
                    factors: Some(f), ..
                } => Ok(PyTuple::new(py, f)?.into_any()),
                _ => Ok(py.None().into_bound(py)),
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    }

    fn __repr__(&self) -> String {
        match &self.read {
            Err(damage) => format!(
                "<WorkerOutput rank={} damaged: {}>",
                damage.rank.map_or("?".into(), |r| r.to_string()),
                damage.why
            ),
            Ok(read) => {
                let parts: Vec<String> = read
                    .header
                    .parts
                    .iter()
                    .map(|p| match p {
                        Part::Nothing => "None".into(),
                        Part::Native => "native".into(),
                        Part::Refused(_) => "refused".into(),
                        Part::Batch { family, batch, .. } => format!(
                            "{}:{}B",
                            String::from_utf8_lossy(read.bytes(family)),
                            batch.len()
                        ),
                    })
                    .collect();
                format!(
                    "<WorkerOutput rank={} seq={} children=[{}]>",
                    read.header.rank,
                    read.header.seq,
                    parts.join(", ")
                )
            }
        }
    }
}
