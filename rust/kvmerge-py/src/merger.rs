//! `Merger` and `MergerStats`.

use std::sync::{Arc, Mutex, TryLockError};

use kvmerge_core::merge::Published;
use kvmerge_core::merge::MAX_WORLD_SIZE;
use kvmerge_core::{Merger, MergerConfig, Rule, Stats};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::batch::{raw_list, PyEventBatch};
use crate::errors::{config, rank_out_of_range, PyKvError};
use crate::gil::{is_small, without_gil};

/// Merges per-rank event batches into events published once.
#[pyclass(module = "kvmerge", frozen, name = "Merger")]
pub struct PyMerger {
    // A Mutex rather than `&mut self`: the GIL is released while merging, so
    // Python threads may call in concurrently.
    inner: Mutex<Merger>,
}

impl PyMerger {
    /// A rank as the core takes it; a Python int beyond i64 is outside every
    /// world, so it gets the core's RankError rather than OverflowError.
    fn rank_arg(&self, rank: &Bound<'_, PyAny>) -> PyResult<i64> {
        int_arg::<i64>(rank)?.ok_or_else(|| {
            rank_out_of_range(
                rank.py(),
                format!(
                    "rank {rank} is outside the world [0, {})",
                    self.lock().config().world_size
                ),
            )
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Merger> {
        // A panic inside the core leaves the guard poisoned; the state it
        // protects is still consistent, as every mutation validates first.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` on the merger: with the GIL held when the merger is free and
    /// `small` says the work is (see `gil`), else with the GIL released.
    /// Never waits for the lock with the GIL held: a call holding the lock
    /// without the GIL may need the GIL to finish (dropping the last
    /// reference to a borrowed Python buffer).
    fn run<T, F>(&self, py: Python<'_>, small: impl FnOnce(&Merger) -> bool, f: F) -> T
    where
        F: Send + FnOnce(&mut Merger) -> T,
        T: Send,
    {
        let free = match self.inner.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut merger) = free {
            if small(&merger) {
                return f(&mut merger);
            }
        }
        without_gil(py, || f(&mut self.lock()))
    }

    /// Whether the next `finish_step` is small work (see `Merger::load`).
    fn small_finish(merger: &Merger) -> bool {
        let (bytes, reports) = merger.load();
        is_small(bytes, reports)
    }

    fn finish(&self, py: Python<'_>) -> Arc<kvmerge_core::Batch> {
        self.run(py, Self::small_finish, |m| m.finish_step())
    }

    fn finish_published(&self, py: Python<'_>) -> Published {
        self.run(py, Self::small_finish, |m| m.finish_step_published())
    }
}

#[pymethods]
impl PyMerger {
    #[new]
    // `max_pending_steps` arrives as any object (None: the default, 32) so
    // that an int beyond u64 can be refused as a ConfigError.
    #[pyo3(
        signature = (world_size, rule = "all", replication_factors = None, max_pending_steps = None),
        text_signature = "(world_size, rule='all', replication_factors=None, max_pending_steps=32)"
    )]
    fn new(
        py: Python<'_>,
        world_size: &Bound<'_, PyAny>,
        rule: &str,
        replication_factors: Option<Vec<Bound<'_, PyAny>>>,
        max_pending_steps: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let default_pending = 32u64.into_pyobject(py)?.into_any();
        let cfg = config_arg(
            world_size,
            rule,
            replication_factors,
            max_pending_steps.unwrap_or(&default_pending),
        )?;
        let merger = Merger::new(cfg).map_err(PyKvError::from)?;
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

    fn add(
        &self,
        py: Python<'_>,
        rank: &Bound<'_, PyAny>,
        batch: &Bound<'_, PyEventBatch>,
    ) -> PyResult<()> {
        // A batch unpickled from bad bytes is refused first, as from_buffer
        // would have refused it: the caller drops this rank's report.
        let batch = batch.get().batch(py)?.clone();
        let rank = self.rank_arg(rank)?;
        let small = is_small(0, batch.len() as u64);
        self.run(py, |_| small, |m| m.add(rank, batch))
            .map_err(|e| PyKvError::from(e).into())
    }

    /// Add several ranks' batches at once: all of them, or none on error.
    fn add_all(
        &self,
        py: Python<'_>,
        reports: Vec<(Bound<'_, PyAny>, Bound<'_, PyEventBatch>)>,
    ) -> PyResult<()> {
        let reports = reports
            .into_iter()
            .map(|(r, b)| {
                let batch = b.get().batch(py)?.clone();
                Ok((self.rank_arg(&r)?, batch))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let small = is_small(0, reports.iter().map(|(_, b)| b.len() as u64).sum());
        self.run(py, |_| small, |m| m.add_all(reports))
            .map_err(|e| PyKvError::from(e).into())
    }

    fn finish_step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let out = Bound::new(py, PyEventBatch::new(self.finish(py)))?;
        PyEventBatch::decode(&out)
    }

    fn finish_step_raw<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let published = self.finish_published(py);
        raw_list(
            py,
            published
                .iter()
                .map(|(batch, i)| batch.event_bytes(i).expect("published events have bytes")),
        )
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

/// `obj` as a `T`: `Ok(None)` for an int outside `T`'s range, the usual
/// `TypeError` for anything that is not an int.
/// A merger's settings from Python arguments, validated. Integers beyond the
/// machine's range are bad settings like any other (ConfigError), not
/// OverflowError; non-integers stay TypeError.
pub(crate) fn config_arg(
    world_size: &Bound<'_, PyAny>,
    rule: &str,
    replication_factors: Option<Vec<Bound<'_, PyAny>>>,
    max_pending_steps: &Bound<'_, PyAny>,
) -> PyResult<MergerConfig> {
    let py = world_size.py();
    let world_size = int_arg::<usize>(world_size)?.ok_or_else(|| {
        config(
            py,
            format!("world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}"),
        )
    })?;
    let rule: Rule = rule.parse().map_err(PyKvError::from)?;
    let max_pending_steps = int_arg::<u64>(max_pending_steps)?.ok_or_else(|| {
        config(
            py,
            format!(
                "max_pending_steps must be between 0 and {}, got {max_pending_steps}",
                u64::MAX
            ),
        )
    })?;
    let replication_factors = replication_factors
        .map(|fs| {
            fs.iter()
                .enumerate()
                .map(|(g, f)| {
                    int_arg::<u32>(f)?.filter(|&f| f >= 1).ok_or_else(|| {
                        config(
                            py,
                            format!(
                                "replication_factors[{g}] is {f}, must be between 1 and {}",
                                u32::MAX
                            ),
                        )
                    })
                })
                .collect::<PyResult<Vec<u32>>>()
        })
        .transpose()?;
    let cfg = MergerConfig {
        world_size,
        rule,
        replication_factors,
        max_pending_steps,
    };
    cfg.validate().map_err(PyKvError::from)?;
    Ok(cfg)
}

pub(crate) fn int_arg<'py, T>(obj: &Bound<'py, PyAny>) -> PyResult<Option<T>>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    match obj.extract::<T>() {
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            let e: PyErr = e.into();
            if e.is_instance_of::<PyOverflowError>(obj.py()) {
                Ok(None)
            } else {
                Err(e)
            }
        }
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
