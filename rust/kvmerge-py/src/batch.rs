//! `EventBatch`: the core's batch as a Python object that exports its bytes
//! through the buffer protocol and pickles them out of band.

use std::ffi::c_int;
use std::sync::Arc;

use kvmerge_core::{Backing, Batch, FillError};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PyTuple, PyType};

use crate::convert::{
    decode_events, export_read_only, indices_arg, kind_arg, payload_slice, type_name,
};
use crate::errors::{corrupt_batch, incomplete_batch};
use crate::gil::{is_small, without_gil_unless};
use crate::raw::raw_list;

/// A received Python buffer whose memory cannot change (see
/// `immutable_exporter`), borrowed for as long as the batch lives.
struct Borrowed(PyUntypedBuffer);

// SAFETY: only buffers of immutable exporters are borrowed: exact `bytes`
// (a subclass may export other memory through `__buffer__`), or an
// `EventBatch` (itself backed by immutable memory), possibly seen through
// exact memoryviews or exact `pickle.PickleBuffer`s; or, inside `kvmerge.borrow_buffers()`, a
// read-only buffer the caller vouches for (a sealed Ray plasma object). The
// held export keeps the exporter alive, and nothing writes to its memory.
// Anything else (a `bytearray`, which Python code may still modify in place
// while it is exported, a writable memoryview, mmap, a zmq frame...) is
// copied instead.
unsafe impl Backing for Borrowed {
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
}

/// An exact `bytes` (what unpickling makes of a batch sent in-band), read in
/// place: immutable for its lifetime, so no buffer export is needed, which
/// cost an allocation and a release per batch at decode-size steps.
struct HeldBytes {
    _bytes: Py<PyBytes>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `ptr` points into the `bytes` object held, which never changes nor
// moves while referenced; the reference is dropped (or queued, without the
// GIL) only with the batch.
unsafe impl Send for HeldBytes {}
unsafe impl Sync for HeldBytes {}

unsafe impl Backing for HeldBytes {
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// `pickle.PickleBuffer`, the type itself (looked up once).
pub(crate) fn pickle_buffer_type(py: Python<'_>) -> Option<&Bound<'_, PyType>> {
    static CELL: pyo3::sync::PyOnceLock<Py<PyType>> = pyo3::sync::PyOnceLock::new();
    CELL.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import("pickle")?
            .getattr("PickleBuffer")?
            .cast_into::<PyType>()?
            .unbind())
    })
    .ok()
    .map(|t| t.bind(py))
}

/// Whether the memory behind `obj`'s buffer is immutable for as long as it
/// is exported: `bytes` and `EventBatch`, directly or through memoryviews
/// and `PickleBuffer`s (what `pickle.loads(..., buffers=...)` passes on).
/// Exact types only: a subclass (of `bytes`, or any class merely *named*
/// `PickleBuffer`, e.g. a `bytearray` subclass) may export memory that
/// Python code still writes, so it is copied. A `bytearray` is not
/// immutable: Python code could still write it while the merge reads it
/// without the GIL. Nor is Ray's `SubBuffer`: the same type views sealed
/// plasma objects and reusable compiled-graph channels.
fn immutable_exporter(obj: &Bound<'_, PyAny>) -> bool {
    let py = obj.py();
    let mut obj = obj.clone();
    // memoryview.obj of a view of a view names the original exporter; the
    // bound only guards against exotic chains.
    for _ in 0..4 {
        if obj.is_exact_instance_of::<PyBytes>() || obj.is_exact_instance_of::<PyEventBatch>() {
            return true;
        }
        let inner = if obj.is_exact_instance_of::<PyMemoryView>() {
            obj.getattr("obj")
        } else if pickle_buffer_type(py).is_some_and(|t| obj.get_type().is(t)) {
            obj.call_method0("raw").and_then(|view| view.getattr("obj"))
        } else {
            return false;
        };
        match inner {
            Ok(inner) if !inner.is_none() => obj = inner,
            _ => return false,
        }
    }
    false
}

thread_local! {
    /// Depth of `kvmerge.borrow_buffers()` blocks open on this thread.
    static VOUCHED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

// Opens (`True`) or closes (`False`) a `kvmerge.borrow_buffers()` block on
// this thread: within it, `from_buffer` also borrows read-only buffers of
// exporters it does not know, because the caller vouches that they do not
// change while any batch made of them lives.
#[pyfunction]
pub fn _borrow_buffers(enter: bool) {
    VOUCHED.with(|v| {
        v.set(if enter {
            v.get() + 1
        } else {
            v.get().saturating_sub(1)
        })
    });
}

fn vouched() -> bool {
    VOUCHED.with(|v| v.get() > 0)
}

/// The memory of a received buffer, for batches to read: an exact `bytes`
/// read in place, an immutable exporter's buffer borrowed (vouched-for
/// read-only ones too, inside `kvmerge.borrow_buffers()`), anything else
/// copied.
pub(crate) fn backing_of(buffer: &Bound<'_, PyAny>) -> Result<Box<dyn Backing>, Refusal> {
    if let Ok(bytes) = buffer.cast_exact::<PyBytes>() {
        let data = bytes.as_bytes();
        return Ok(Box::new(HeldBytes {
            ptr: data.as_ptr(),
            len: data.len(),
            _bytes: bytes.clone().unbind(),
        }));
    }
    // Not bytes-like at all: a wrong argument type, as for memoryview().
    let buf = PyUntypedBuffer::get(buffer).map_err(|_| {
        Refusal::NotABuffer(format!(
            "EventBatch.from_buffer needs a bytes-like object, not {}",
            type_name(buffer)
        ))
    })?;
    if !buf.is_c_contiguous() || buf.item_size() != 1 {
        return Err(Refusal::Corrupt(
            "the buffer is not contiguous bytes".into(),
        ));
    }
    if immutable_exporter(buffer) || (buf.readonly() && vouched()) {
        return Ok(Box::new(Borrowed(buf)));
    }
    // Copied with the GIL held, so no Python thread writes meanwhile;
    // once copied, later writes to the buffer cannot reach the batch.
    // SAFETY: the export is held, contiguous, `len_bytes` long.
    let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
    Ok(Box::new(bytes.to_vec()))
}

#[pyclass(module = "kvmerge", frozen, name = "EventBatch")]
pub struct PyEventBatch {
    /// The batch; the empty batch when `error` is set (never read then).
    inner: Arc<Batch>,
    /// Why the buffer this batch was unpickled from is not a batch: the
    /// `CorruptBatchError` message, raised by every use of its events.
    error: Option<String>,
}

/// Why a buffer did not make a batch.
pub(crate) enum Refusal {
    /// Not a buffer at all (`TypeError` from `from_buffer`).
    NotABuffer(String),
    /// A buffer, but not a valid batch (`CorruptBatchError`).
    Corrupt(String),
}

impl PyEventBatch {
    pub fn new(inner: Arc<Batch>) -> Self {
        PyEventBatch { inner, error: None }
    }

    /// A batch unpickled from bad bytes: it only remembers why.
    pub(crate) fn invalid(message: String) -> Self {
        PyEventBatch {
            inner: Arc::new(Batch::empty()),
            error: Some(message),
        }
    }

    /// The batch, unless it was unpickled from bad bytes.
    pub(crate) fn valid(&self) -> Option<&Arc<Batch>> {
        self.error.is_none().then_some(&self.inner)
    }

    /// The batch, or the `CorruptBatchError` it was unpickled with.
    pub(crate) fn batch(&self, py: Python<'_>) -> PyResult<&Arc<Batch>> {
        match &self.error {
            None => Ok(&self.inner),
            Some(message) => Err(corrupt_batch(py, message.clone())),
        }
    }

    /// `from_buffer`'s work, its refusals as values.
    fn load(py: Python<'_>, buffer: &Bound<'_, PyAny>) -> Result<Self, Refusal> {
        // A batch is its own buffer: share it (and an invalid one's error).
        if let Ok(batch) = buffer.cast_exact::<PyEventBatch>() {
            let b = batch.get();
            return match &b.error {
                None => Ok(PyEventBatch::new(b.inner.clone())),
                Some(message) => Err(Refusal::Corrupt(message.clone())),
            };
        }
        Self::validated(py, backing_of(buffer)?)
    }

    fn validated(py: Python<'_>, backing: Box<dyn Backing>) -> Result<Self, Refusal> {
        let small = is_small(backing.bytes().len() as u64, 0);
        let batch = without_gil_unless(py, small, || Batch::from_backing(backing))
            .map_err(|e| Refusal::Corrupt(e.to_string()))?;
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    fn memoryview<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyMemoryView>> {
        PyMemoryView::from(slf.as_any())
    }
}

/// Refuses to read the events of a batch that does not carry all of their
/// bytes (other ranks carry them): only the merger can put the events back
/// together.
fn require_bytes(py: Python<'_>, batch: &Batch) -> PyResult<()> {
    match batch.uncarried() {
        0 => Ok(()),
        n => Err(incomplete_batch(
            py,
            format!(
                "{n} of this batch's {} events were sent without their bytes (other ranks \
                 carry them); merge it to get the events",
                batch.len()
            ),
        )),
    }
}

// The Python-facing docs are in _kvmerge.pyi; comments here say why.
#[pymethods]
impl PyEventBatch {
    #[staticmethod]
    fn from_buffer(py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<Self> {
        PyEventBatch::load(py, buffer).map_err(|refusal| match refusal {
            Refusal::NotABuffer(message) => PyTypeError::new_err(message),
            Refusal::Corrupt(message) => corrupt_batch(py, message),
        })
    }

    // The pickle reconstructor: `from_buffer` that never raises for what it
    // is given. Unpickling runs inside vLLM's message queue, before any code
    // could drop one rank's batch; so bad bytes give a batch that remembers
    // why (`error`), and raises `CorruptBatchError` with that message when
    // its events are used (`Merger.add`, `decode`, ...).
    #[staticmethod]
    fn _from_pickle(py: Python<'_>, buffer: &Bound<'_, PyAny>) -> Self {
        PyEventBatch::load(py, buffer).unwrap_or_else(|refusal| match refusal {
            Refusal::NotABuffer(message) | Refusal::Corrupt(message) => {
                PyEventBatch::invalid(message)
            }
        })
    }

    #[getter]
    pub(crate) fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    #[staticmethod]
    fn empty() -> Self {
        PyEventBatch::new(Arc::new(Batch::empty()))
    }

    pub(crate) fn decode<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let batch = slf.get().batch(py)?;
        require_bytes(py, batch)?;
        let view = Self::memoryview(slf)?;
        let payload = view.get_item(payload_slice(py, batch.payload_start())?)?;
        decode_events(py, &payload)
    }

    fn raw<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let batch = slf.get().batch(py)?;
        require_bytes(py, batch)?;
        raw_list(py, (0..batch.len()).map(|i| (batch, i)))
    }

    fn filled(slf: &Bound<'_, Self>, sources: Vec<Bound<'_, PyEventBatch>>) -> PyResult<Self> {
        let py = slf.py();
        let me = slf.get().batch(py)?;
        let inners: Vec<Arc<Batch>> = sources
            .iter()
            .map(|b| b.get().batch(py).cloned())
            .collect::<PyResult<_>>()?;
        if me.uncarried() == 0 {
            return Ok(PyEventBatch::new(me.clone()));
        }
        let refs: Vec<&Batch> = inners.iter().map(|b| &**b).collect();
        let work: u64 = refs.iter().map(|b| b.bytes().len() as u64).sum();
        let small = is_small(work + me.bytes().len() as u64, 0);
        let batch = without_gil_unless(py, small, || me.filled(&refs)).map_err(|e| match e {
            FillError::Missing(i) => incomplete_batch(
                py,
                format!(
                    "event {i} was sent without its bytes, and none of the {} batches \
                     given carries them",
                    refs.len()
                ),
            ),
            FillError::TooLarge(e) => PyValueError::new_err(format!("filled: {e}")),
        })?;
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    fn kinds(&self, py: Python<'_>) -> PyResult<Vec<&'static str>> {
        let batch = self.batch(py)?;
        Ok((0..batch.len()).map(|i| batch.kind(i).name()).collect())
    }

    // One pass over the records, not a class name per event.
    fn indices(&self, py: Python<'_>, kind: &str) -> PyResult<Vec<usize>> {
        let batch = self.batch(py)?;
        let kind = kind_arg(kind, "indices")?;
        Ok((0..batch.len())
            .filter(|&i| batch.kind(i) == kind)
            .collect())
    }

    fn take(&self, py: Python<'_>, indices: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        let me = self.batch(py)?;
        let idx = indices_arg(&indices, me.len())?;
        // A batch holds at most 4 GiB of events (u32 offsets): refuse
        // rather than let the gather fail on it.
        let total: u64 = idx
            .iter()
            .map(|&i| me.event_range(i).map_or(0, |r| r.len() as u64))
            .sum();
        if total > u32::MAX as u64 {
            return Err(PyValueError::new_err(format!(
                "take: {total} bytes of events exceed one batch's 4 GiB limit"
            )));
        }
        let inner = &**me;
        let small = is_small(total, idx.len() as u64);
        let batch = without_gil_unless(py, small, || {
            Batch::try_gather(idx.iter().map(|&i| (inner, i)))
        })
        .map_err(|e| PyValueError::new_err(format!("take: {e}")))?;
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    #[staticmethod]
    fn concat(py: Python<'_>, batches: Vec<Bound<'_, PyEventBatch>>) -> PyResult<Self> {
        let inners: Vec<Arc<Batch>> = batches
            .iter()
            .map(|b| b.get().batch(py).cloned())
            .collect::<PyResult<_>>()?;
        if let [only] = &inners[..] {
            return Ok(PyEventBatch::new(only.clone()));
        }
        let total: u64 = inners.iter().map(|b| b.payload().len() as u64).sum();
        if total > u32::MAX as u64 {
            return Err(PyValueError::new_err(format!(
                "concat: {total} bytes of events exceed one batch's 4 GiB limit"
            )));
        }
        let events: u64 = inners.iter().map(|b| b.len() as u64).sum();
        let batch = without_gil_unless(py, is_small(total, events), || {
            let events: Vec<(&Batch, usize)> = inners
                .iter()
                .flat_map(|b| (0..b.len()).map(move |i| (&**b, i)))
                .collect();
            Batch::try_gather(events.iter().copied())
        })
        .map_err(|e| PyValueError::new_err(format!("concat: {e}")))?;
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    fn identities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let batch = self.batch(py)?;
        PyList::new(py, batch.identities().map(|id| PyBytes::new(py, &id.0)))
    }

    #[getter]
    fn uncarried(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.batch(py)?.uncarried())
    }

    #[getter]
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.batch(py)?.bytes().len())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.batch(py)?.len())
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, self.batch(py)?.bytes()))
    }

    fn __repr__(&self) -> String {
        match &self.error {
            Some(message) => format!("<EventBatch invalid: {message}>"),
            None => format!(
                "<EventBatch events={} nbytes={}>",
                self.inner.len(),
                self.inner.bytes().len()
            ),
        }
    }

    // Protocol 5 hands the bytes over as an out-of-band `PickleBuffer`;
    // older protocols copy them into the pickle as `bytes`. The
    // reconstructor is `_from_pickle`: unpickling never raises for the
    // batch's bytes. An invalid batch does not pickle (`CorruptBatchError`).
    fn __reduce_ex__<'py>(slf: &Bound<'py, Self>, protocol: i64) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let batch = slf.get().batch(py)?;
        let rebuild = py.get_type::<PyEventBatch>().getattr("_from_pickle")?;
        let payload = if protocol >= 5 {
            py.import("pickle")?
                .getattr("PickleBuffer")?
                .call1((slf,))?
        } else {
            PyBytes::new(py, batch.bytes()).into_any()
        };
        PyTuple::new(py, [rebuild, PyTuple::new(py, [payload])?.into_any()])
    }

    // Read-only export of the wire bytes; the export keeps `self` alive.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if let Some(message) = &slf.get().error {
            return Err(PyBufferError::new_err(format!(
                "this EventBatch is invalid: {message}"
            )));
        }
        let bytes = slf.get().inner.bytes();
        // SAFETY: `bytes` is the batch `slf` holds, which never changes.
        unsafe { export_read_only(slf.as_any(), bytes, view, flags, "EventBatch") }
    }
}
