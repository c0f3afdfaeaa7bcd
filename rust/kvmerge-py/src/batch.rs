//! `EventBatch`: the core's batch as a Python object that exports its bytes
//! through the buffer protocol and pickles them out of band.

use std::ffi::c_int;
use std::sync::Arc;

use kvmerge_core::{Backing, Batch};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyIndexError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PySlice, PyTuple};

use crate::errors::{corrupt_batch, invalid_event, PyKvError};
use crate::gil::without_gil;
use crate::schema::schema;

/// A received Python buffer (bytes, bytearray, a pickle buffer...), borrowed
/// for as long as the batch lives.
struct Borrowed(PyUntypedBuffer);

// SAFETY: the exporter keeps the memory in place while the buffer is held
// (a held export also stops a bytearray from resizing), and the batch only
// reads it.
unsafe impl Backing for Borrowed {
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
}

#[pyclass(module = "kvmerge", frozen, name = "EventBatch")]
pub struct PyEventBatch {
    pub(crate) inner: Arc<Batch>,
}

impl PyEventBatch {
    pub fn new(inner: Arc<Batch>) -> Self {
        PyEventBatch { inner }
    }

    fn memoryview<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyMemoryView>> {
        PyMemoryView::from(slf.as_any())
    }
}

/// Decodes a msgpack array of events into vLLM objects with msgspec.
pub fn decode_events<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let s = schema(py)?;
    s.decoder
        .bind(py)
        .call_method1("decode", (payload,))
        .map_err(|e| {
            if e.is_instance(py, s.decode_error.bind(py)) {
                corrupt_batch(py, format!("events do not decode: {}", e.value(py)))
            } else {
                e
            }
        })
}

/// One `msgspec.Raw` per event, each a view into the batch's buffer.
pub fn raw_events<'py>(slf: &Bound<'py, PyEventBatch>) -> PyResult<Bound<'py, PyList>> {
    let py = slf.py();
    let batch = &slf.get().inner;
    let view = PyEventBatch::memoryview(slf)?;
    let raw = schema(py)?.raw.bind(py);
    let items = (0..batch.len())
        .map(|i| {
            let r = batch.event_range(i);
            let slice = PySlice::new(py, r.start as isize, r.end as isize, 1);
            raw.call1((view.get_item(slice)?,))
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

#[pymethods]
impl PyEventBatch {
    /// Borrow a received buffer (bytes, bytearray, memoryview...) without copying.
    #[staticmethod]
    fn from_buffer(py: Python<'_>, buffer: &Bound<'_, PyAny>) -> PyResult<Self> {
        let buf = PyUntypedBuffer::get(buffer).map_err(|e| {
            corrupt_batch(
                py,
                format!(
                    "expected a bytes-like object, got {}: {e}",
                    type_name(buffer)
                ),
            )
        })?;
        if !buf.is_c_contiguous() || buf.item_size() != 1 {
            return Err(corrupt_batch(
                py,
                "the buffer is not contiguous bytes".into(),
            ));
        }
        let batch = without_gil(py, || Batch::from_backing(Box::new(Borrowed(buf))))
            .map_err(PyKvError::from)?;
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    #[staticmethod]
    fn empty() -> Self {
        PyEventBatch::new(Arc::new(Batch::empty()))
    }

    /// The events, equal to the encoded ones, in order.
    pub(crate) fn decode<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let view = Self::memoryview(slf)?;
        let start = slf.get().inner.payload_start() as isize;
        let payload = view.get_item(PySlice::new(slf.py(), start, isize::MAX, 1))?;
        decode_events(slf.py(), &payload)
    }

    /// Each event's msgpack encoding, ready for a msgspec encoder.
    fn raw<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        raw_events(slf)
    }

    /// Each event's class name ("BlockStored", "BlockRemoved", "AllBlocksCleared").
    fn kinds(&self) -> Vec<&'static str> {
        (0..self.inner.len())
            .map(|i| self.inner.kind(i).name())
            .collect()
    }

    /// A new batch of the events at `indices`, in that order (no decoding).
    fn take(&self, py: Python<'_>, indices: Vec<i64>) -> PyResult<Self> {
        let n = self.inner.len();
        let idx = indices
            .iter()
            .map(|&i| {
                usize::try_from(if i < 0 { i + n as i64 } else { i })
                    .ok()
                    .filter(|&i| i < n)
                    .ok_or_else(|| {
                        PyIndexError::new_err(format!("index {i} out of range for {n} events"))
                    })
            })
            .collect::<PyResult<Vec<usize>>>()?;
        let inner = &*self.inner;
        let batch = without_gil(py, || Batch::gather(idx.iter().map(|&i| (inner, i))));
        Ok(PyEventBatch::new(Arc::new(batch)))
    }

    /// Each event's 16-byte identity.
    fn identities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.inner.identities().map(|id| PyBytes::new(py, &id.0)),
        )
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes().len()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.bytes())
    }

    fn __repr__(&self) -> String {
        format!(
            "<EventBatch events={} nbytes={}>",
            self.inner.len(),
            self.inner.bytes().len()
        )
    }

    /// Protocol 5 hands the bytes over as an out-of-band `PickleBuffer`;
    /// older protocols copy them into the pickle as `bytes`.
    fn __reduce_ex__<'py>(slf: &Bound<'py, Self>, protocol: i64) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let from_buffer = py.get_type::<PyEventBatch>().getattr("from_buffer")?;
        let payload = if protocol >= 5 {
            py.import("pickle")?
                .getattr("PickleBuffer")?
                .call1((slf,))?
        } else {
            PyBytes::new(py, slf.get().inner.bytes()).into_any()
        };
        PyTuple::new(py, [from_buffer, PyTuple::new(py, [payload])?.into_any()])
    }

    /// Read-only export of the wire bytes; the export keeps `self` alive.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("View is null"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("EventBatch is read-only"));
        }
        let bytes = slf.get().inner.bytes();
        // SAFETY: `bytes` lives as long as `slf`, which the view references.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len() as ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Encode vLLM KV cache events into a batch (identities computed here).
#[pyfunction]
pub fn encode(py: Python<'_>, events: &Bound<'_, PyAny>) -> PyResult<PyEventBatch> {
    let s = schema(py)?;
    let list = match events.cast::<PyList>() {
        Ok(list) => list.clone(),
        Err(_)
            if events.is_instance_of::<pyo3::types::PyString>()
                || events.is_instance_of::<PyBytes>() =>
        {
            return Err(invalid_event(
                py,
                format!(
                    "events must be a sequence of events, not {}",
                    type_name(events)
                ),
            ))
        }
        Err(_) => PyList::new(
            py,
            events
                .try_iter()
                .map_err(|_| {
                    invalid_event(
                        py,
                        format!(
                            "events must be a sequence of events, not {}",
                            type_name(events)
                        ),
                    )
                })?
                .collect::<PyResult<Vec<_>>>()?,
        )?,
    };
    let types = s.event_types.bind(py);
    for (i, ev) in list.iter().enumerate() {
        // Exact classes: a subclass could carry fields the schema doesn't know.
        let ty = ev.get_type();
        if !types.iter().any(|t| t.is(&ty)) {
            return Err(invalid_event(
                py,
                format!(
                    "event {i}: expected BlockStored, BlockRemoved or AllBlocksCleared, got {}",
                    type_name(&ev)
                ),
            ));
        }
    }
    let payload = s
        .encoder
        .bind(py)
        .call_method1("encode", (&list,))
        .map_err(|e| invalid_event(py, format!("events do not encode: {}", e.value(py))))?;
    let payload = payload.cast::<PyBytes>()?;
    let bytes: &[u8] = payload.as_bytes();
    let batch = without_gil(py, || Batch::encode(bytes)).map_err(PyKvError::from)?;
    Ok(PyEventBatch::new(Arc::new(batch)))
}
