//! The Python side of the event schema, imported once: vLLM's event classes
//! and msgspec's encoder and decoder (see `kvmerge/_schema.py`).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

use crate::write::Writer;

pub struct Schema {
    pub event_types: Py<PyTuple>,
    pub encoder: Py<PyAny>,
    pub decode: Py<PyAny>,
    pub raw: Py<PyAny>,
    pub decode_error: Py<PyAny>,
    /// Writes the events it can without msgspec (see `write`).
    pub writer: Writer,
}

static SCHEMA: PyOnceLock<Schema> = PyOnceLock::new();

pub fn schema(py: Python<'_>) -> PyResult<&Schema> {
    SCHEMA.get_or_try_init(py, || {
        let m = py.import("kvmerge._schema")?;
        let event_types = m.getattr("EVENT_TYPES")?.cast_into::<PyTuple>()?;
        Ok(Schema {
            writer: Writer::new(&event_types),
            event_types: event_types.unbind(),
            encoder: m.getattr("ENCODER")?.unbind(),
            decode: m.getattr("decode")?.unbind(),
            raw: m.getattr("Raw")?.unbind(),
            decode_error: m.getattr("DecodeError")?.unbind(),
        })
    })
}
