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
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::export_read_only;
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
        let me = slf.get();
        let bytes = &me.batch.bytes()[me.start..me.start + me.len];
        // SAFETY: `bytes` is in the batch `slf` holds, which never changes.
        unsafe { export_read_only(slf.as_any(), bytes, view, flags, "an event's bytes") }
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
