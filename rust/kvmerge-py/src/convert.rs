//! Every conversion between Python values and Rust ones: arguments in
//! (ints, ranks, a merger's settings, indices) and events out (`msgspec.Raw`
//! objects, decoded vLLM events).
//!
//! Integers beyond the machine's range are bad values like any other (a
//! `ConfigError`, `RankError` or `IndexError`, as an in-range bad value
//! would get), not `OverflowError`; non-integers stay `TypeError`.

use std::ffi::c_int;

use kvmerge_core::{
    Carriers, EventKind, MergerConfig, Rule, DEFAULT_MAX_PENDING_STEPS, MAX_WORLD_SIZE,
};
use pyo3::exceptions::{PyBufferError, PyIndexError, PyOverflowError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::{config, corrupt_batch, rank_out_of_range, PyKvError};
use crate::schema::schema;

/// `obj`'s class name, for error messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// `obj` as a `T`: `Ok(None)` for an int outside `T`'s range, the usual
/// `TypeError` for anything that is not an int.
pub fn int_arg<'py, T>(obj: &Bound<'py, PyAny>) -> PyResult<Option<T>>
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

fn outside_the_world(rank: &Bound<'_, PyAny>, world_size: usize) -> PyErr {
    rank_out_of_range(
        rank.py(),
        format!("rank {rank} is outside the world [0, {world_size})"),
    )
}

/// A rank as the core takes it (the core refuses one outside the world); a
/// Python int beyond i64 is outside every world, so it gets the core's
/// `RankError` rather than `OverflowError`. `world_size` is only asked for
/// that message (`Merger` must lock to answer).
pub fn rank_arg(rank: &Bound<'_, PyAny>, world_size: impl FnOnce() -> usize) -> PyResult<i64> {
    int_arg::<i64>(rank)?.ok_or_else(|| outside_the_world(rank, world_size()))
}

/// A rank of the world `[0, world_size)`, checked here: any int outside it
/// (however large) is a `RankError`, as from `Merger.add`.
pub fn rank_in_world(rank: &Bound<'_, PyAny>, world_size: usize) -> PyResult<usize> {
    usize::try_from(rank_arg(rank, || world_size)?)
        .ok()
        .filter(|&r| r < world_size)
        .ok_or_else(|| outside_the_world(rank, world_size))
}

fn world_size_arg(world_size: &Bound<'_, PyAny>) -> PyResult<usize> {
    int_arg::<usize>(world_size)?.ok_or_else(|| {
        config(
            world_size.py(),
            format!("world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}"),
        )
    })
}

fn rule_arg(rule: &str) -> PyResult<Rule> {
    Ok(rule.parse::<Rule>().map_err(PyKvError::from)?)
}

fn factors_arg(factors: Option<Vec<Bound<'_, PyAny>>>) -> PyResult<Option<Vec<u32>>> {
    factors
        .map(|fs| {
            fs.iter()
                .enumerate()
                .map(|(g, f)| {
                    int_arg::<u32>(f)?.filter(|&f| f >= 1).ok_or_else(|| {
                        config(
                            f.py(),
                            format!(
                                "replication_factors[{g}] is {f}, must be between 1 and {}",
                                u32::MAX
                            ),
                        )
                    })
                })
                .collect::<PyResult<Vec<u32>>>()
        })
        .transpose()
}

/// `encode`'s world from Python arguments, validated.
pub fn carriers_arg(
    world_size: &Bound<'_, PyAny>,
    rule: &str,
    replication_factors: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<Carriers> {
    let carriers = Carriers {
        world_size: world_size_arg(world_size)?,
        rule: rule_arg(rule)?,
        replication_factors: factors_arg(replication_factors)?,
    };
    carriers.validate().map_err(PyKvError::from)?;
    Ok(carriers)
}

/// A merger's settings from Python arguments (`Merger::new` validates
/// them); `max_pending_steps` None is the default.
pub fn config_arg(
    world_size: &Bound<'_, PyAny>,
    rule: &str,
    replication_factors: Option<Vec<Bound<'_, PyAny>>>,
    max_pending_steps: Option<&Bound<'_, PyAny>>,
) -> PyResult<MergerConfig> {
    let world_size = world_size_arg(world_size)?;
    let rule = rule_arg(rule)?;
    let max_pending_steps = match max_pending_steps {
        None => DEFAULT_MAX_PENDING_STEPS,
        Some(steps) => int_arg::<u64>(steps)?.ok_or_else(|| {
            config(
                steps.py(),
                format!(
                    "max_pending_steps must be between 0 and {}, got {steps}",
                    u64::MAX
                ),
            )
        })?,
    };
    Ok(MergerConfig {
        carriers: Carriers {
            world_size,
            rule,
            replication_factors: factors_arg(replication_factors)?,
        },
        max_pending_steps,
    })
}

/// Python indices (negative ones from the end) into `n` events; any int
/// outside them (however large) is an `IndexError`.
pub fn indices_arg(indices: &[Bound<'_, PyAny>], n: usize) -> PyResult<Vec<usize>> {
    let out_of_range = |i: &dyn std::fmt::Display| {
        PyIndexError::new_err(format!("index {i} out of range for {n} events"))
    };
    indices
        .iter()
        .map(|obj| {
            let i = int_arg::<i64>(obj)?.ok_or_else(|| out_of_range(obj))?;
            usize::try_from(if i < 0 { i + n as i64 } else { i })
                .ok()
                .filter(|&i| i < n)
                .ok_or_else(|| out_of_range(&i))
        })
        .collect()
}

/// An event class name as the kind it names; `ValueError` (saying which
/// call refused it) for anything else.
pub fn kind_arg(kind: &str, call: &str) -> PyResult<EventKind> {
    EventKind::from_name(kind).ok_or_else(|| {
        PyValueError::new_err(format!(
            "{call}: {kind:?} is not an event class name (\"BlockStored\", \
             \"BlockRemoved\" or \"AllBlocksCleared\")"
        ))
    })
}

/// Decodes a msgpack array of events into vLLM objects with msgspec.
pub fn decode_events<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let s = schema(py)?;
    s.decode.bind(py).call1((payload,)).map_err(|e| {
        if e.is_instance(py, s.decode_error.bind(py)) {
            corrupt_batch(py, format!("events do not decode: {}", e.value(py)))
        } else {
            e
        }
    })
}

/// `slice(start, None)`. Not `PySlice::new`: under pyo3 0.30 it never
/// releases the ints it makes for its bounds (36-64 bytes per call, for
/// every `decode` and `Merger.finish_step`).
pub fn payload_slice(py: Python<'_>, start: usize) -> PyResult<Bound<'_, PyAny>> {
    let start = start.into_pyobject(py)?;
    // SAFETY: PySlice_New borrows its arguments (and takes its own
    // references); it returns a new reference or NULL with an exception set.
    unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PySlice_New(start.as_ptr(), std::ptr::null_mut(), std::ptr::null_mut()),
        )
    }
}

/// Fills `view` with a read-only export of `bytes` held by `owner` (the
/// view references `owner`); `what` names the exporter in the refusal of a
/// writable export.
///
/// # Safety
/// `view` must be a `Py_buffer` from the buffer protocol, and `bytes` must
/// stay where they are, unchanged, for as long as `owner` lives.
pub unsafe fn export_read_only(
    owner: &Bound<'_, PyAny>,
    bytes: &[u8],
    view: *mut ffi::Py_buffer,
    flags: c_int,
    what: &str,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("View is null"));
    }
    if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
        return Err(PyBufferError::new_err(format!("{what} is read-only")));
    }
    // SAFETY: the caller's contract; PyBuffer_FillInfo takes a reference to
    // `owner` for the view.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            bytes.as_ptr() as *mut std::ffi::c_void,
            bytes.len() as ffi::Py_ssize_t,
            1,
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}
