//! `Merger` and `MergerStats`.

use std::sync::{Arc, Mutex, TryLockError};

use kvmerge_core::merge::Published;
use kvmerge_core::{msgpack, Batch, EventKind, Merger, Stats, DEFAULT_MAX_PENDING_STEPS};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::batch::PyEventBatch;
use crate::convert::{config_arg, decode_events, kind_arg, rank_arg};
use crate::gil::{self, is_small};
use crate::raw::raw_list;

#[pyclass(module = "kvmerge", frozen, name = "Merger")]
pub struct PyMerger {
    // A Mutex rather than `&mut self`: the GIL is released while merging, so
    // Python threads may call in concurrently.
    inner: Mutex<Merger>,
}

impl PyMerger {
    fn rank_arg(&self, rank: &Bound<'_, PyAny>) -> PyResult<i64> {
        rank_arg(rank, || self.lock().config().carriers.world_size)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Merger> {
        // A panic inside the core leaves the guard poisoned; the state it
        // protects is still consistent, as every mutation validates first.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` on the merger (`gil::run`): with the GIL held when the merger is
    /// free and `small` says the work is (see `gil`), else with the GIL
    /// released. Never waits for the lock with the GIL held: a call holding
    /// the lock without the GIL may need the GIL to finish (dropping the last
    /// reference to a borrowed Python buffer).
    pub(crate) fn run<T, F>(
        &self,
        py: Python<'_>,
        small: impl FnOnce(&Merger) -> bool,
        f: F,
    ) -> PyResult<T>
    where
        F: Send + FnOnce(&mut Merger) -> kvmerge_core::Result<T>,
        T: Send,
    {
        let free = match self.inner.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut guard) = free {
            if small(&guard) {
                let merger: &mut Merger = &mut guard;
                return gil::run(py, true, || f(merger));
            }
        }
        gil::run(py, false, || f(&mut self.lock()))
    }

    /// Whether the next `finish_step` is small work (see `Merger::load`).
    fn small_finish(merger: &Merger) -> bool {
        let (bytes, reports) = merger.load();
        is_small(bytes, reports)
    }

    /// The counters now (`stats()`, without the Python object).
    pub(crate) fn stats_now(&self) -> Stats {
        self.lock().stats()
    }

    fn finish(&self, py: Python<'_>) -> PyResult<Arc<Batch>> {
        self.run(py, Self::small_finish, |m| Ok(m.finish_step()))
    }

    fn finish_published(&self, py: Python<'_>) -> PyResult<Published> {
        self.run(py, Self::small_finish, |m| Ok(m.finish_step_published()))
    }
}

// `text_signature` must be a literal: it and _kvmerge.pyi (which stubtest
// checks against it) say 32, the core's default.
const _: () = assert!(DEFAULT_MAX_PENDING_STEPS == 32);

// The Python-facing docs are in _kvmerge.pyi; comments here say why.
#[pymethods]
impl PyMerger {
    #[new]
    // `max_pending_steps` arrives as any object (None: the core's default)
    // so that an int beyond u64 can be refused as a ConfigError.
    #[pyo3(
        signature = (world_size, rule = "all", replication_factors = None, max_pending_steps = None, guard = false),
        text_signature = "(world_size, rule='all', replication_factors=None, max_pending_steps=32, guard=False)"
    )]
    fn new(
        py: Python<'_>,
        world_size: &Bound<'_, PyAny>,
        rule: &str,
        replication_factors: Option<Vec<Bound<'_, PyAny>>>,
        max_pending_steps: Option<&Bound<'_, PyAny>>,
        guard: bool,
    ) -> PyResult<Self> {
        let cfg = config_arg(world_size, rule, replication_factors, max_pending_steps)?;
        // Allocates per-rank state, bounded by MAX_WORLD_SIZE: small.
        let merger = gil::run(py, true, || Ok(Merger::new(cfg)?.with_guard(guard)))?;
        Ok(PyMerger {
            inner: Mutex::new(merger),
        })
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.lock().config().carriers.world_size
    }

    #[getter]
    fn rule(&self) -> &'static str {
        self.lock().config().carriers.rule.name()
    }

    #[getter]
    fn replication_factors(&self) -> Option<Vec<u32>> {
        self.lock().config().carriers.replication_factors.clone()
    }

    #[getter]
    fn max_pending_steps(&self) -> u64 {
        self.lock().config().max_pending_steps
    }

    #[getter]
    fn guard(&self) -> bool {
        self.lock().guarded()
    }

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
        // would have refused it: the caller drops this rank's batch.
        let batch = batch.get().batch(py)?.clone();
        let rank = self.rank_arg(rank)?;
        let small = is_small(0, batch.len() as u64);
        self.run(py, |_| small, |m| m.add(rank, batch))
    }

    fn add_all(
        &self,
        py: Python<'_>,
        batches: Vec<(Bound<'_, PyAny>, Bound<'_, PyEventBatch>)>,
    ) -> PyResult<()> {
        let batches = batches
            .into_iter()
            .map(|(r, b)| {
                let batch = b.get().batch(py)?.clone();
                Ok((self.rank_arg(&r)?, batch))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let small = is_small(0, batches.iter().map(|(_, b)| b.len() as u64).sum());
        self.run(py, |_| small, |m| m.add_all(batches))
    }

    fn finish_step<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let out = Bound::new(py, PyEventBatch::new(self.finish(py)?))?;
        PyEventBatch::decode(&out)
    }

    fn finish_step_raw<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        // Views of the events where they came in: nothing copied.
        raw_list(py, self.finish_published(py)?.iter())
    }

    // For a hook that reads one kind (the removals UMBP's scheduler drops
    // its pending events by): the step's events as views,
    // as `finish_step_raw`, and only those of `kind` decoded, where
    // `finish_step_batch` copied every event into one batch first. The kind
    // is checked before the step is finished.
    fn finish_step_raw_and_decode<'py>(
        &self,
        py: Python<'py>,
        kind: &str,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>)> {
        let kind = kind_arg(kind, "finish_step_raw_and_decode")?;
        let published = self.finish_published(py)?;
        raw_and_decoded(py, &published, Some(kind))
    }

    fn finish_step_batch(&self, py: Python<'_>) -> PyResult<PyEventBatch> {
        Ok(PyEventBatch::new(self.finish(py)?))
    }

    fn stats(&self) -> PyMergerStats {
        PyMergerStats(self.stats_now())
    }

    fn reset(&self) {
        self.lock().reset()
    }

    fn __repr__(&self) -> String {
        let m = self.lock();
        let c = m.config();
        format!(
            "Merger(world_size={}, rule={:?}, max_pending_steps={}, guard={}, step={})",
            c.carriers.world_size,
            c.carriers.rule.name(),
            c.max_pending_steps,
            if m.guarded() { "True" } else { "False" },
            m.step()
        )
    }
}

/// The step's events as views (`raw_list`), and those of `kind` decoded
/// as well (None when no kind is asked for; an empty list, without a decoder
/// call, when the step has none).
pub(crate) fn raw_and_decoded<'py>(
    py: Python<'py>,
    published: &Published,
    kind: Option<EventKind>,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyAny>)> {
    let raws = raw_list(py, published.iter())?;
    let Some(kind) = kind else {
        return Ok((raws, py.None().into_bound(py)));
    };
    let picks: Vec<&[u8]> = published
        .iter()
        .filter(|(b, i)| b.kind(*i) == kind)
        .map(|(b, i)| b.event_bytes(i).expect("published events are carried"))
        .collect();
    if picks.is_empty() {
        return Ok((raws, PyList::empty(py).into_any()));
    }
    // Their bytes as one msgpack array, decoded in one call: no batch built
    // for them first (records, checksum, an `EventBatch` and two views).
    let mut payload = Vec::with_capacity(5 + picks.iter().map(|b| b.len()).sum::<usize>());
    msgpack::write_array_header(&mut payload, picks.len());
    for bytes in picks {
        payload.extend_from_slice(bytes);
    }
    Ok((raws, decode_events(py, &PyBytes::new(py, &payload))?))
}

#[pyclass(module = "kvmerge", frozen, name = "MergerStats")]
pub struct PyMergerStats(Stats);

impl From<Stats> for PyMergerStats {
    fn from(stats: Stats) -> Self {
        PyMergerStats(stats)
    }
}

impl PyMergerStats {
    /// Every counter by its Python name, in the stub's order.
    fn counters(&self) -> [(&'static str, u64); 12] {
        let s = self.0;
        [
            ("steps", s.steps),
            ("batches", s.batches),
            ("reports", s.reports),
            ("published", s.published),
            ("consumed", s.consumed),
            ("cleared", s.cleared),
            ("expired", s.expired),
            ("pending", s.pending),
            ("withheld", s.withheld()),
            ("withheld_orphan", s.withheld_orphan),
            ("withheld_duplicate", s.withheld_duplicate),
            ("withheld_unknown", s.withheld_unknown),
        ]
    }
}

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
    #[getter]
    fn withheld(&self) -> u64 {
        self.0.withheld()
    }
    #[getter]
    fn withheld_orphan(&self) -> u64 {
        self.0.withheld_orphan
    }
    #[getter]
    fn withheld_duplicate(&self) -> u64 {
        self.0.withheld_duplicate
    }
    #[getter]
    fn withheld_unknown(&self) -> u64 {
        self.0.withheld_unknown
    }

    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.counters() {
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
        let fields: Vec<String> = self
            .counters()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("MergerStats({})", fields.join(", "))
    }
}
