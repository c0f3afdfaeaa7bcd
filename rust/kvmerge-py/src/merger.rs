//! `Merger` and `MergerStats`.

use std::sync::{Arc, Mutex};

use kvmerge_core::{Merger, MergerConfig, Rule, Stats};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::batch::{raw_events, PyEventBatch};
use crate::errors::{config, PyKvError};
use crate::gil::without_gil;

/// Merges per-rank event batches into events published once.
#[pyclass(module = "kvmerge", frozen, name = "Merger")]
pub struct PyMerger {
    // A Mutex rather than `&mut self`: the GIL is released while merging, so
    // Python threads may call in concurrently.
    inner: Mutex<Merger>,
}

impl PyMerger {
    fn lock(&self) -> std::sync::MutexGuard<'_, Merger> {
        // A panic inside the core leaves the guard poisoned; the state it
        // protects is still consistent, as every mutation validates first.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish(&self, py: Python<'_>) -> Arc<kvmerge_core::Batch> {
        without_gil(py, || self.lock().finish_step())
    }
}

#[pymethods]
impl PyMerger {
    #[new]
    #[pyo3(signature = (world_size, rule = "all", replication_factors = None, max_pending_steps = 32))]
    fn new(
        py: Python<'_>,
        world_size: i64,
        rule: &str,
        replication_factors: Option<Vec<i64>>,
        max_pending_steps: i64,
    ) -> PyResult<Self> {
        let world_size = usize::try_from(world_size).map_err(|_| {
            config(
                py,
                format!("world_size must be at least 1, got {world_size}"),
            )
        })?;
        let rule: Rule = rule.parse().map_err(PyKvError::from)?;
        let max_pending_steps = u64::try_from(max_pending_steps).map_err(|_| {
            config(
                py,
                format!("max_pending_steps must be 0 or more, got {max_pending_steps}"),
            )
        })?;
        let replication_factors = replication_factors
            .map(|fs| {
                fs.iter()
                    .enumerate()
                    .map(|(g, &f)| {
                        u32::try_from(f).ok().filter(|&f| f >= 1).ok_or_else(|| {
                            config(
                                py,
                                format!("replication_factors[{g}] is {f}, must be at least 1"),
                            )
                        })
                    })
                    .collect::<PyResult<Vec<u32>>>()
            })
            .transpose()?;
        let merger = Merger::new(MergerConfig {
            world_size,
            rule,
            replication_factors,
            max_pending_steps,
        })
        .map_err(PyKvError::from)?;
        Ok(PyMerger {
            inner: Mutex::new(merger),
        })
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.lock().config().world_size
    }

    #[getter]
    fn rule(&self) -> &'static str {
        self.lock().config().rule.name()
    }

    #[getter]
    fn replication_factors(&self) -> Option<Vec<u32>> {
        self.lock().config().replication_factors.clone()
    }

    #[getter]
    fn max_pending_steps(&self) -> u64 {
        self.lock().config().max_pending_steps
    }

    /// The number of the step now being collected.
    #[getter]
    fn step(&self) -> u64 {
        self.lock().step()
    }

    fn add(&self, py: Python<'_>, rank: i64, batch: &Bound<'_, PyEventBatch>) -> PyResult<()> {
        let batch = batch.get().inner.clone();
        without_gil(py, || self.lock().add(rank, batch)).map_err(|e| PyKvError::from(e).into())
    }

    /// Add several ranks' batches at once: all of them, or none on error.
    fn add_all(
        &self,
        py: Python<'_>,
        reports: Vec<(i64, Bound<'_, PyEventBatch>)>,
    ) -> PyResult<()> {
        let reports: Vec<_> = reports
            .into_iter()
            .map(|(r, b)| (r, b.get().inner.clone()))
            .collect();
        without_gil(py, || self.lock().add_all(reports)).map_err(|e| PyKvError::from(e).into())
    }

    fn finish_step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let out = Bound::new(py, PyEventBatch::new(self.finish(py)))?;
        PyEventBatch::decode(&out)
    }

    fn finish_step_raw<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = Bound::new(py, PyEventBatch::new(self.finish(py)))?;
        raw_events(&out)
    }

    fn finish_step_batch(&self, py: Python<'_>) -> PyEventBatch {
        PyEventBatch::new(self.finish(py))
    }

    fn stats(&self) -> PyMergerStats {
        PyMergerStats(self.lock().stats())
    }

    /// Drop every pending report and the current step's batches (counters stay).
    fn reset(&self) {
        self.lock().reset()
    }

    fn __repr__(&self) -> String {
        let m = self.lock();
        let c = m.config();
        format!(
            "Merger(world_size={}, rule={:?}, max_pending_steps={}, step={})",
            c.world_size,
            c.rule.name(),
            c.max_pending_steps,
            m.step()
        )
    }
}

#[pyclass(module = "kvmerge", frozen, name = "MergerStats")]
pub struct PyMergerStats(Stats);

#[pymethods]
impl PyMergerStats {
    #[getter]
    fn steps(&self) -> u64 {
        self.0.steps
    }
    #[getter]
    fn batches(&self) -> u64 {
        self.0.batches
    }
    #[getter]
    fn reports(&self) -> u64 {
        self.0.reports
    }
    #[getter]
    fn published(&self) -> u64 {
        self.0.published
    }
    #[getter]
    fn consumed(&self) -> u64 {
        self.0.consumed
    }
    #[getter]
    fn cleared(&self) -> u64 {
        self.0.cleared
    }
    #[getter]
    fn expired(&self) -> u64 {
        self.0.expired
    }
    #[getter]
    fn pending(&self) -> u64 {
        self.0.pending
    }

    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let s = self.0;
        for (k, v) in [
            ("steps", s.steps),
            ("batches", s.batches),
            ("reports", s.reports),
            ("published", s.published),
            ("consumed", s.consumed),
            ("cleared", s.cleared),
            ("expired", s.expired),
            ("pending", s.pending),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyMergerStats>()
            .is_ok_and(|o| o.get().0 == self.0)
    }

    fn __repr__(&self) -> String {
        let s = self.0;
        format!(
            "MergerStats(steps={}, batches={}, reports={}, published={}, consumed={}, cleared={}, expired={}, pending={})",
            s.steps, s.batches, s.reports, s.published, s.consumed, s.cleared, s.expired, s.pending
        )
    }
}
