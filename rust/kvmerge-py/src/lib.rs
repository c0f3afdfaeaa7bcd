//! Python bindings of kvmerge-core: a thin layer that extracts Rust values
//! (`convert`), releases the GIL for the core's work (`gil`), and maps errors
//! to one exception hierarchy (`errors`). The Python-facing documentation is
//! `python/kvmerge/_kvmerge.pyi`.

mod batch;
mod convert;
mod encode;
mod errors;
mod gil;
mod layout;
mod merger;
mod output;
mod raw;
mod schema;
mod settings;
mod step;
mod write;

use pyo3::prelude::*;

// glibc's malloc is shared with CPython: the core's many small, short-lived
// allocations (batches, merge state, outputs) churn its bins, and CPython's
// own allocations then pay for it too. With mimalloc for ours, vLLM's
// aggregator alone ran a third faster inside the decode-size step
// (docs/benchmarks.md, "The allocator").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ALLOCATOR: &str = if cfg!(feature = "mimalloc") {
    "mimalloc"
} else {
    "system"
};

#[pymodule]
fn _kvmerge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Not `add`: that would list it in `__all__`.
    m.setattr("__version__", env!("CARGO_PKG_VERSION"))?;
    // Which allocator this build uses: checked by the tests and the release
    // wheel's checks (a build without the default features falls back to
    // the system's).
    m.setattr("_allocator", ALLOCATOR)?;
    errors::add_to(m)?;
    m.add_class::<batch::PyEventBatch>()?;
    m.add_class::<merger::PyMerger>()?;
    m.add_class::<merger::PyMergerStats>()?;
    m.add_function(wrap_pyfunction!(encode::encode, m)?)?;
    m.add_function(wrap_pyfunction!(batch::_borrow_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(layout::_layout, m)?)?;
    m.add_class::<output::PyWorkerOutput>()?;
    m.add_class::<settings::PyWorkerSettings>()?;
    m.add_class::<step::PyOutputMerger>()?;
    m.add_class::<step::PyRefusal>()?;
    m.add_class::<step::PyStepResult>()?;
    m.add_class::<step::PyChildStep>()?;
    m.add_class::<step::PyChildConfig>()?;
    m.add("MERGE_KEY", kvmerge_core::step::MERGE_KEY)?;
    m.add("FACTORS_KEY", kvmerge_core::step::FACTORS_KEY)?;
    m.add_function(wrap_pyfunction!(step::_refusal_kinds, m)?)?;
    Ok(())
}
