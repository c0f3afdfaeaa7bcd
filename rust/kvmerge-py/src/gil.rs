//! Every heavy call into the core goes through here, with the GIL released.
//! Callers extract owned or borrowed-from-immutable Rust values first
//! (tokenizers' pattern), so nothing Python is touched inside.
//!
//! Small work keeps the GIL: releasing it hands it to any Python thread
//! waiting for it (vLLM's engine core has input and output threads, the
//! publisher its own), and getting it back waits until that thread lets go,
//! for a switch interval at worst. At decode-size steps that handoff, not the
//! microsecond of Rust work, was most of `EventBatch._from_pickle`,
//! `Merger.add_all` and `finish_step_batch` on the scheduler (issue 14).

use pyo3::marker::Ungil;
use pyo3::prelude::*;

/// Work on at most this many bytes (validating a batch, encoding events,
/// copying a step's output) runs with the GIL held: tens of microseconds at
/// most.
pub const SMALL_BYTES: u64 = 256 << 10;
/// Likewise for the reports a merger call works through.
pub const SMALL_REPORTS: u64 = 4096;

pub fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    py.detach(f)
}

/// `f()`, with the GIL held when `small`, else released (`without_gil`).
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

/// Whether work on `bytes` bytes and `reports` reports is small.
pub fn is_small(bytes: u64, reports: u64) -> bool {
    bytes <= SMALL_BYTES && reports <= SMALL_REPORTS
}
