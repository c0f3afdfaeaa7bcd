//! Every heavy call into the core goes through here, with the GIL released.
//! Callers extract owned or borrowed-from-immutable Rust values first
//! (tokenizers' pattern), so nothing Python is touched inside.

use pyo3::marker::Ungil;
use pyo3::prelude::*;

pub fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Ungil + FnOnce() -> T,
    T: Ungil,
{
    py.detach(f)
}
