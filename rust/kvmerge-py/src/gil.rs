//! Every call into the core goes through here: with the GIL released for
//! heavy work, and the core's error raised as its Python exception. Callers
//! extract owned or borrowed-from-immutable Rust values first (tokenizers'
//! pattern), so nothing Python is touched inside.
//!
//! Small work keeps the GIL: releasing it hands it to any Python thread
//! waiting for it (vLLM's engine core has input and output threads, the
//! publisher its own), and getting it back waits until that thread lets go,
//! for a switch interval at worst. At decode-size steps that handoff, not the
//! microsecond of Rust work, was most of `EventBatch._from_pickle`,
//! `Merger.add_all` and `finish_step_batch` on the scheduler (issue 14).

use pyo3::marker::Ungil;
use pyo3::prelude::*;

use crate::errors::PyKvError;

/// Work on at most this many bytes (validating a batch, encoding events,
/// copying a step's output) runs with the GIL held: tens of microseconds at
/// most.
pub const SMALL_BYTES: u64 = 256 << 10;
/// Likewise for the reports a merger call works through.
pub const SMALL_REPORTS: u64 = 4096;

/// Whether work on `bytes` bytes and `reports` reports is small.
pub fn is_small(bytes: u64, reports: u64) -> bool {
    bytes <= SMALL_BYTES && reports <= SMALL_REPORTS
}

/// `f()`, with the GIL held when `small`, else released; a core error is
/// raised as its Python exception (polars' `enter_polars`).
pub fn run<T, F>(py: Python<'_>, small: bool, f: F) -> PyResult<T>
where
    F: Ungil + FnOnce() -> kvmerge_core::Result<T>,
    kvmerge_core::Result<T>: Ungil,
{
    Ok(without_gil_unless(py, small, f).map_err(PyKvError::from)?)
}

/// `run` for work whose failures are not core errors, or are raised as
/// something else: `f()`, with the GIL held when `small`, else released.
pub fn without_gil_unless<T, F>(py: Python<'_>, small: bool, f: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    if small {
        f()
    } else {
        py.detach(f)
    }
}
