//! Events out as `msgspec.Raw`: each one a read-only view of its bytes in
//! the batch it came in, nothing copied.
//!
//! A `bytes` per event was most of the output's cost at prefill-size steps:
//! an event's encoding is over pymalloc's 512 bytes, so each took a libc
//! `malloc`, a copy and a `free`; gathering the step's events into one
//! batch first was another copy of them all. A view is one small object
//! that keeps its batch (a worker's received buffer) alive for as long as a
//! `Raw` refers to it: vLLM's publisher drops them once it has encoded the
//! step, as it drops a `bytes`.

use std::ffi::c_int;
use std::sync::Arc;

use kvmerge_core::Batch;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::schema::schema;

/// One event's msgpack bytes in `batch`: exported through the buffer
/// protocol, for `msgspec.Raw` to hold. Not in the module nor the stubs:
/// only `Raw` objects hold one (`memoryview(raw).obj`).
#[pyclass(module = "kvmerge", frozen, name = "_EventBytes")]
pub struct EventBytes {
    batch: Arc<Batch>,
    start: usize,
    len: usize,
}

#[pymethods]
impl EventBytes {
    fn __len__(&self) -> usize {
        self.len
    }

    // Read-only export; the export keeps `self`, and so the batch, alive.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("View is null"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("an event's bytes are read-only"));
        }
        let me = slf.get();
        let bytes = &me.batch.bytes()[me.start..me.start + me.len];
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

/// `msgspec.Raw` objects of these events (a batch and an index in it; the
/// batch must carry the event).
pub fn raw_list<'py, 'a>(
    py: Python<'py>,
    events: impl ExactSizeIterator<Item = (&'a Arc<Batch>, usize)>,
) -> PyResult<Bound<'py, PyList>> {
    let raw = schema(py)?.raw.bind(py);
    let items = events
        .map(|(batch, i)| {
            let range = batch.event_range(i).expect("the events are carried");
            let bytes = EventBytes {
                batch: batch.clone(),
                start: range.start,
                len: range.len(),
            };
            raw.call1((Bound::new(py, bytes)?,))
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}
