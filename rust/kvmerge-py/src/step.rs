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
//!
//! `_merge_common_step` takes the rest of the step's common case too: the
//! worker outputs' checks (what `_output_problem` would accept without a
//! word; a rank `last_seq` knows is one it found in the world), their order
//! and the merge. Taking the connector's per-step Python out piece by piece
//! moved nothing measurable after vLLM's step had left the caches cold; all
//! of it at once made the decode-size step about 7% shorter
//! (docs/benchmarks.md, "The whole common step in one call").

use std::sync::{Arc, OnceLock};

use kvmerge_core::{Batch, Merger};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PySet, PyString, PyTuple, PyType};

use crate::batch::PyEventBatch;
use crate::convert::kind_arg;
use crate::errors::KVMergeError;
use crate::gil::is_small;
use crate::merger::{raw_and_decoded, PyMerger};
use crate::packed::Packed;

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

/// One worker output (`WorkerOutput`) as the step reads it: its rank and
/// its children's entries.
struct Output<'py> {
    rank: i64,
    entries: Entries<'py>,
}

/// A worker output's entries: its fields (checked by the connector: exact
/// tuples, one entry per child), or the buffer it arrived packed in.
enum Entries<'py> {
    Fields {
        families: Bound<'py, PyTuple>,
        entries: Bound<'py, PyTuple>,
        factors: Bound<'py, PyTuple>,
    },
    Packed(Packed),
}

/// A worker output of the common shape, read by `_merge_common_step`: its
/// fields, and its rank and `seq` as the ints they are.
struct Common<'py> {
    output: Bound<'py, PyAny>,
    fields: Output<'py>,
    rank: Bound<'py, PyInt>,
    seq: Bound<'py, PyInt>,
}

impl<'py> Common<'py> {
    /// `output` when it is exactly a `WorkerOutput` (`output_type`) with
    /// no settings, int rank and `seq`, and one entry per child (`n`) in
    /// each of its tuples; None for anything else.
    fn read(
        output: &Bound<'py, PyAny>,
        output_type: &Bound<'py, PyType>,
        n: usize,
    ) -> Option<Common<'py>> {
        let py = output.py();
        if !output.get_type().is(output_type) {
            return None;
        }
        if let Some(packed) = packed_field(output)? {
            // Packed: no settings, int rank and `seq` (see `packed`).
            let (fields, seq) = Output::packed(&packed)?;
            if fields.len() != n {
                return None;
            }
            return Some(Common {
                output: output.clone(),
                rank: PyInt::new(py, fields.rank),
                seq: PyInt::new(py, seq),
                fields,
            });
        }
        if !output
            .getattr(pyo3::intern!(py, "settings"))
            .ok()?
            .is_none()
        {
            return None;
        }
        let rank = int_field(output, pyo3::intern!(py, "rank"))?;
        let seq = int_field(output, pyo3::intern!(py, "seq"))?;
        let fields = Output::read_with(output, &rank)?;
        if fields.len() != n {
            return None;
        }
        Some(Common {
            output: output.clone(),
            fields,
            rank,
            seq,
        })
    }

    /// Whether this is the next output of a rank `last_seq` knows (the
    /// `seq` after the last one seen) and `misconfigured` does not hold.
    fn is_next(&self, last_seq: &Bound<'py, PyDict>, misconfigured: &Bound<'py, PySet>) -> bool {
        if !misconfigured.is_empty() && misconfigured.contains(&self.rank).unwrap_or(true) {
            return false;
        }
        let Ok(Some(last)) = last_seq.get_item(&self.rank) else {
            return false;
        };
        let last = last
            .cast_exact::<PyInt>()
            .ok()
            .and_then(|l| l.extract::<i64>().ok());
        let seq = self.seq.extract::<i64>().ok();
        matches!((last, seq), (Some(l), Some(s)) if s.checked_sub(1) == Some(l))
    }
}

impl<'py> Output<'py> {
    fn read(output: &Bound<'py, PyAny>) -> Option<Output<'py>> {
        if let Some(packed) = packed_field(output)? {
            return Output::packed(&packed).map(|(fields, _)| fields);
        }
        let rank = int_field(output, pyo3::intern!(output.py(), "rank"))?;
        Output::read_with(output, &rank)
    }

    /// An output that arrived packed in `buffer`, and its `seq`; None when
    /// the buffer does not read.
    fn packed(buffer: &Bound<'py, PyAny>) -> Option<(Output<'py>, i64)> {
        let packed = Packed::read(buffer).ok()?;
        let (rank, seq) = (packed.rank, packed.seq);
        let entries = Entries::Packed(packed);
        Some((Output { rank, entries }, seq))
    }

    /// `read` of an unpacked output, the rank already read.
    fn read_with(output: &Bound<'py, PyAny>, rank: &Bound<'py, PyInt>) -> Option<Output<'py>> {
        let py = output.py();
        let tuple = |name| output.getattr(name).ok()?.cast_into_exact::<PyTuple>().ok();
        let (families, entries, factors) = (
            tuple(pyo3::intern!(py, "families"))?,
            tuple(pyo3::intern!(py, "entries"))?,
            tuple(pyo3::intern!(py, "factors"))?,
        );
        if entries.len() != families.len() || factors.len() != families.len() {
            return None;
        }
        Some(Output {
            rank: rank.extract().ok()?,
            entries: Entries::Fields {
                families,
                entries,
                factors,
            },
        })
    }

    /// How many children this output has entries for.
    fn len(&self) -> usize {
        match &self.entries {
            Entries::Fields { families, .. } => families.len(),
            Entries::Packed(packed) => packed.len(),
        }
    }

    /// Whether this output holds nothing for child `index` (the child
    /// returned None on this worker).
    fn holds_nothing(&self, index: usize) -> bool {
        if index >= self.len() {
            return false;
        }
        match &self.entries {
            // The header holds no batch for a child without a family.
            Entries::Packed(packed) => packed.family(index).is_none(),
            Entries::Fields {
                families, entries, ..
            } => {
                families.get_item(index).is_ok_and(|f| f.is_none())
                    && entries.get_item(index).is_ok_and(|e| e.is_none())
            }
        }
    }

    /// This output's batch for the child of `plan`: its own (valid, of the
    /// child's family, reporting no factors or the child's own), the empty
    /// batch when the child returned nothing, or None for anything else.
    fn batch(&self, plan: &Plan<'py>, empty: &Arc<Batch>) -> Option<Arc<Batch>> {
        let (index, family, factors, _, _) = plan;
        if *index >= self.len() {
            return None;
        }
        if self.holds_nothing(*index) {
            return Some(empty.clone());
        }
        match &self.entries {
            Entries::Packed(packed) => {
                let kind = packed.family(*index)?;
                if kind != family.to_str().ok()?.as_bytes() {
                    return None;
                }
                if let Some(reported) = packed.factors(*index) {
                    if factors.as_deref() != Some(reported) {
                        return None;
                    }
                }
                packed.batch(family.py(), *index).ok().map(Arc::new)
            }
            Entries::Fields {
                families,
                entries,
                factors: reported,
            } => {
                // Not a string (None, with an entry): not of the common shape.
                let kind = families.get_item(*index).ok()?;
                let kind = kind.cast_exact::<PyString>().ok()?;
                if kind.to_str().ok()? != family.to_str().ok()? {
                    return None;
                }
                let reported = reported.get_item(*index).ok()?;
                if !reported.is_none() && !same_factors(&reported, factors.as_deref()) {
                    return None;
                }
                entries
                    .get_item(*index)
                    .ok()?
                    .cast_exact::<PyEventBatch>()
                    .ok()?
                    .get()
                    .valid()
                    .cloned()
            }
        }
    }
}

/// `output._packed`: Some(the buffer) for an output that arrived packed and
/// has not been unpacked, Some(None) for any other; None if unreadable.
fn packed_field<'py>(output: &Bound<'py, PyAny>) -> Option<Option<Bound<'py, PyAny>>> {
    let packed = output.getattr(pyo3::intern!(output.py(), "_packed")).ok()?;
    Some((!packed.is_none()).then_some(packed))
}

/// `output.name` when it is exactly an int.
fn int_field<'py>(
    output: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> Option<Bound<'py, PyInt>> {
    output.getattr(name).ok()?.cast_into_exact::<PyInt>().ok()
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
    let outputs = outputs.iter().map(Output::read).collect::<Option<Vec<_>>>();
    merge_planned(py, outputs.as_deref(), &plans)
}

/// Each plan's child merged from `outputs` (`merge_child`). For a plan
/// that is None (the children's plans are in child order), False when no
/// output holds anything for its child, else None; None for every plan when
/// the outputs are not all readable.
fn merge_planned<'py>(
    py: Python<'py>,
    outputs: Option<&[Output<'py>]>,
    plans: &[Option<Plan<'py>>],
) -> PyResult<Bound<'py, PyList>> {
    static EMPTY: OnceLock<Arc<Batch>> = OnceLock::new();
    let empty = EMPTY.get_or_init(|| Arc::new(Batch::empty()));
    let results = plans
        .iter()
        .enumerate()
        .map(|(index, plan)| match (plan, outputs) {
            (Some(plan), Some(outputs)) => merge_child(py, outputs, plan, empty),
            (None, Some(outputs)) if outputs.iter().all(|o| o.holds_nothing(index)) => {
                Ok(Some(PyBool::new(py, false).to_owned().into_any()))
            }
            _ => Ok(None),
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, results)
}

/// `_merge_common_step`'s result: the outputs in rank order, their ranks,
/// and each plan's child merged.
type CommonStep<'py> = (Bound<'py, PyList>, Bound<'py, PyList>, Bound<'py, PyList>);

// The connector's whole step in the common case; docs in _kvmerge.pyi. The
// outputs arrive unchecked: when one is not of the common shape nothing is
// changed and None tells the caller to check and merge them itself.
#[pyfunction]
pub fn _merge_common_step<'py>(
    py: Python<'py>,
    outputs: Vec<Bound<'py, PyAny>>,
    plans: Vec<Option<Plan<'py>>>,
    output_type: Bound<'py, PyType>,
    last_seq: Bound<'py, PyDict>,
    misconfigured: Bound<'py, PySet>,
) -> PyResult<Option<CommonStep<'py>>> {
    let mut common: Vec<Common<'py>> = Vec::with_capacity(outputs.len());
    for output in &outputs {
        let Some(read) = Common::read(output, &output_type, plans.len()) else {
            return Ok(None);
        };
        let again = common.iter().any(|c| c.fields.rank == read.fields.rank);
        if again || !read.is_next(&last_seq, &misconfigured) {
            return Ok(None);
        }
        common.push(read);
    }
    for c in &common {
        last_seq.set_item(&c.rank, &c.seq)?;
    }
    common.sort_by_key(|c| c.fields.rank);
    let ordered = PyList::new(py, common.iter().map(|c| &c.output))?;
    let ranks = PyList::new(py, common.iter().map(|c| &c.rank))?;
    let fields: Vec<Output<'py>> = common.into_iter().map(|c| c.fields).collect();
    Ok(Some((
        ordered,
        ranks,
        merge_planned(py, Some(&fields), &plans)?,
    )))
}

// The expired counters of these mergers, summed; docs in _kvmerge.pyi.
#[pyfunction]
pub fn _expired(mergers: Vec<Option<Bound<'_, PyMerger>>>) -> u64 {
    mergers
        .iter()
        .flatten()
        .map(|m| m.get().stats_now().expired)
        .sum()
}
