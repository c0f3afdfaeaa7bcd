//! `_merge_children`: one call per scheduler step for every child of
//! `KVMergeMultiConnector` whose batches need no Python to merge.
//!
//! At decode-size steps (TP 8, 32 events per child, three children) the
//! Python loop that picked each child's batch out of each rank's output, and
//! the separate calls to add and finish, were 5-13 us of the step's 50-60 us
//! of merging (the merge itself about 30). Here
//! the common case (every rank sent this child a valid batch of the child's
//! family, or nothing) is recognised from the outputs as they are, and the
//! child is merged and finished in the same call. Anything else, and any
//! batch set the merger refuses, is left to the connector's Python path
//! (`_Child.step`), which explains, counts and logs it: the merger is then
//! exactly as it was.

use std::sync::{Arc, OnceLock};

use kvmerge_core::{Batch, Merger};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use crate::batch::PyEventBatch;
use crate::convert::kind_arg;
use crate::errors::KVMergeError;
use crate::gil::is_small;
use crate::merger::{raw_and_decoded, PyMerger};

/// What the connector knows of one child once its family and merger are
/// fixed: its position in each output, the family its batches must have, the
/// replication factors they may report, its merger, and the kind of events
/// to return decoded as well (for a scheduler hook), if any.
type Plan<'py> = (
    usize,
    Bound<'py, PyString>,
    Option<Vec<i64>>,
    Bound<'py, PyMerger>,
    Option<String>,
);

/// The fields of one worker output (`WorkerOutput`, checked by the
/// connector: exact tuples, one entry per child).
struct Output<'py> {
    rank: i64,
    families: Bound<'py, PyTuple>,
    entries: Bound<'py, PyTuple>,
    factors: Bound<'py, PyTuple>,
}

impl<'py> Output<'py> {
    fn read(output: &Bound<'py, PyAny>) -> Option<Output<'py>> {
        let py = output.py();
        let field = |name: &Bound<'py, PyString>| output.getattr(name).ok();
        let tuple = |name| field(name)?.cast_into_exact::<PyTuple>().ok();
        Some(Output {
            rank: field(pyo3::intern!(py, "rank"))?
                .cast_exact::<PyInt>()
                .ok()?
                .extract()
                .ok()?,
            families: tuple(pyo3::intern!(py, "families"))?,
            entries: tuple(pyo3::intern!(py, "entries"))?,
            factors: tuple(pyo3::intern!(py, "factors"))?,
        })
    }

    /// This output's batch for the child of `plan`: its own (valid, of the
    /// child's family, reporting no factors or the child's own), the empty
    /// batch when the child returned nothing, or None for anything else.
    fn batch(&self, plan: &Plan<'py>, empty: &Arc<Batch>) -> Option<Arc<Batch>> {
        let (index, family, factors, _, _) = plan;
        let kind = self.families.get_item(*index).ok()?;
        let entry = self.entries.get_item(*index).ok()?;
        if kind.is_none() {
            return entry.is_none().then(|| empty.clone());
        }
        let kind = kind.cast_exact::<PyString>().ok()?;
        if kind.to_str().ok()? != family.to_str().ok()? {
            return None;
        }
        let reported = self.factors.get_item(*index).ok()?;
        if !reported.is_none() && !same_factors(&reported, factors.as_deref()) {
            return None;
        }
        entry
            .cast_exact::<PyEventBatch>()
            .ok()?
            .get()
            .valid()
            .cloned()
    }
}

/// Whether `reported` is a tuple of exactly the ints `known` (`True` equals
/// 1, but is no replication factor).
fn same_factors(reported: &Bound<'_, PyAny>, known: Option<&[i64]>) -> bool {
    let (Ok(reported), Some(known)) = (reported.cast_exact::<PyTuple>(), known) else {
        return false;
    };
    reported.len() == known.len()
        && reported.iter().zip(known).all(|(f, &k)| {
            f.cast_exact::<PyInt>()
                .is_ok_and(|f| f.extract::<i64>().is_ok_and(|f| f == k))
        })
}

/// Adds every rank's batch of one child and finishes its step: its events
/// and the hook's decoded, or the `KVMergeError` that lost them; None (the
/// merger unchanged) when a batch is not of the common shape or the merger
/// refuses them.
fn merge_child<'py>(
    py: Python<'py>,
    outputs: &[Output<'py>],
    plan: &Plan<'py>,
    empty: &Arc<Batch>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(batches) = outputs
        .iter()
        .map(|o| Some((o.rank, o.batch(plan, empty)?)))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let incoming = batches.iter().fold((0, 0), |(b, r), (_, batch)| {
        (b + batch.carried_len() as u64, r + batch.len() as u64)
    });
    let (_, _, _, merger, kind) = plan;
    // Checked before the step is finished, as `finish_step_raw_and_decode`
    // does: a bad name must not cost the step's events.
    let kind = kind
        .as_deref()
        .map(|k| kind_arg(k, "_merge_children"))
        .transpose()?;
    let small = |m: &Merger| {
        let (bytes, reports) = m.load();
        is_small(bytes + incoming.0, reports + incoming.1)
    };
    let finished = merger.get().run(py, small, |m| {
        Ok(m.add_all(batches).map(|()| m.finish_step_published()))
    })?;
    let Ok(published) = finished else {
        return Ok(None);
    };
    match raw_and_decoded(py, &published, kind) {
        Ok((raws, decoded)) => Ok(Some(
            PyTuple::new(py, [raws.into_any(), decoded])?.into_any(),
        )),
        // Merged, but the hook's events do not decode (a forged removal):
        // the step's output is lost, which the caller counts and logs. On
        // vLLM's step path, not an exception.
        Err(e) if e.is_instance_of::<KVMergeError>(py) => {
            Ok(Some(e.into_value(py).into_bound(py).into_any()))
        }
        Err(e) => Err(e),
    }
}

// The connector's step for its children in the common case; docs in
// _kvmerge.pyi. Never raises for what the outputs hold: whatever is not of
// the common shape is the caller's to handle.
#[pyfunction]
pub fn _merge_children<'py>(
    py: Python<'py>,
    outputs: Vec<Bound<'py, PyAny>>,
    plans: Vec<Option<Plan<'py>>>,
) -> PyResult<Bound<'py, PyList>> {
    static EMPTY: OnceLock<Arc<Batch>> = OnceLock::new();
    let empty = EMPTY.get_or_init(|| Arc::new(Batch::empty()));
    let outputs = outputs.iter().map(Output::read).collect::<Option<Vec<_>>>();
    let results = plans
        .iter()
        .map(|plan| match (plan, &outputs) {
            (Some(plan), Some(outputs)) => merge_child(py, outputs, plan, empty),
            _ => Ok(None),
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, results)
}
