//! `WorkerSettings`: what a worker believes (`kvmerge_core::step::Settings`),
//! as Python builds and reads it.

use kvmerge_core::step::repr::{py_bool, py_str};
use kvmerge_core::step::settings::py_children;
use kvmerge_core::step::{ChildSettings, Settings};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A child's settings as Python passes them: `(label, rule, factors)`.
type ChildArg = (String, Option<String>, Option<Vec<i64>>);

#[pyclass(module = "kvmerge._kvmerge", frozen, eq, name = "WorkerSettings")]
#[derive(PartialEq)]
pub struct PyWorkerSettings(pub Settings);

// The Python-facing docs are in _kvmerge.pyi.
#[pymethods]
impl PyWorkerSettings {
    #[new]
    #[pyo3(signature = (kvmerge_version, world_size, rank, kv_events, children))]
    fn new(
        kvmerge_version: String,
        world_size: i64,
        rank: i64,
        kv_events: bool,
        children: Vec<ChildArg>,
    ) -> Self {
        PyWorkerSettings(Settings {
            version: kvmerge_version,
            world_size,
            rank,
            kv_events,
            children: children
                .into_iter()
                .map(|(label, rule, factors)| ChildSettings {
                    label,
                    rule,
                    factors,
                })
                .collect(),
        })
    }

    #[getter]
    fn kvmerge_version(&self) -> &str {
        &self.0.version
    }

    #[getter]
    fn world_size(&self) -> i64 {
        self.0.world_size
    }

    #[getter]
    fn rank(&self) -> i64 {
        self.0.rank
    }

    #[getter]
    fn kv_events(&self) -> bool {
        self.0.kv_events
    }

    #[getter]
    fn children<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .0
            .children
            .iter()
            .map(|c| {
                let factors = match &c.factors {
                    None => py.None().into_bound(py),
                    Some(f) => PyTuple::new(py, f)?.into_any(),
                };
                PyTuple::new(
                    py,
                    [
                        c.label.clone().into_pyobject(py)?.into_any(),
                        c.rule.clone().into_pyobject(py)?.into_any(),
                        factors,
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, items)
    }

    fn differences(&self, worker: &PyWorkerSettings, rank: i64) -> Vec<String> {
        self.0.differences(&worker.0, rank)
    }

    fn __repr__(&self) -> String {
        let s = &self.0;
        format!(
            "WorkerSettings(kvmerge_version={}, world_size={}, rank={}, kv_events={}, children={})",
            py_str(&s.version),
            s.world_size,
            s.rank,
            py_bool(s.kv_events),
            py_children(&s.children)
        )
    }
}
