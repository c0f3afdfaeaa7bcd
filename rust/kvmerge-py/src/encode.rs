//! `encode`, the worker's entry point: vLLM's events written as msgspec
//! writes them (by `write`, or by msgspec and then checked), made a batch
//! by the core.

use std::sync::Arc;

use kvmerge_core::msgpack::Reader;
use kvmerge_core::schema::{self, EventInfo};
use kvmerge_core::{Batch, Error, Written};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::batch::PyEventBatch;
use crate::convert::{carriers_arg, rank_in_world, type_name};
use crate::errors::{config, invalid_event, PyKvError};
use crate::gil::{self, is_small};
use crate::schema::{schema, Schema};

// Documented in _kvmerge.pyi.
#[pyfunction]
#[pyo3(signature = (events, *, rank = None, world_size = None, rule = "all", replication_factors = None))]
pub fn encode(
    py: Python<'_>,
    events: &Bound<'_, PyAny>,
    rank: Option<&Bound<'_, PyAny>>,
    world_size: Option<&Bound<'_, PyAny>>,
    rule: &str,
    replication_factors: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<PyEventBatch> {
    let carrier = match (rank, world_size) {
        (None, None) => None,
        (Some(rank), Some(world_size)) => {
            let carriers = carriers_arg(world_size, rule, replication_factors)?;
            // As `Merger.add`: a non-int is a TypeError, any int outside the
            // world (however large) a RankError.
            let r = rank_in_world(rank, carriers.world_size)?;
            Some((carriers, r))
        }
        _ => {
            return Err(config(
                py,
                "encode: give rank and world_size together, or neither".into(),
            ))
        }
    };
    let s = schema(py)?;
    let list = match events.cast::<PyList>() {
        Ok(list) => list.clone(),
        Err(_) if events.is_instance_of::<PyString>() || events.is_instance_of::<PyBytes>() => {
            return Err(invalid_event(
                py,
                format!(
                    "events must be a sequence of events, not {}",
                    type_name(events)
                ),
            ))
        }
        Err(_) => PyList::new(
            py,
            events
                .try_iter()
                .map_err(|_| {
                    invalid_event(
                        py,
                        format!(
                            "events must be a sequence of events, not {}",
                            type_name(events)
                        ),
                    )
                })?
                .collect::<PyResult<Vec<_>>>()?,
        )?,
    };
    let carrier = carrier.as_ref().map(|(carriers, r)| (carriers, *r));
    let (events, written) = write_all(&list, s)?;
    let small = is_small(events.len() as u64, 0);
    let batch = gil::run(py, small, || {
        Batch::encode_written(&events, &written, carrier)
    })?;
    Ok(PyEventBatch::new(Arc::new(batch)))
}

/// Every event written back to back, with where each ends and what it is:
/// by `write` when it can, else checked here and encoded by msgspec, its
/// bytes then checked against the schema (what `write` leaves to msgspec is
/// rare: a subclass, an `int` subclass, a value of the wrong type).
fn write_all(list: &Bound<'_, PyList>, s: &Schema) -> PyResult<(Vec<u8>, Vec<Written>)> {
    let py = list.py();
    let encoder = s.encoder.bind(py);
    // About what vLLM's prefill-size events take (600 bytes at 144 tokens).
    let mut out = Vec::with_capacity(list.len() * 512);
    let mut written = Vec::with_capacity(list.len());
    for (index, ev) in list.iter().enumerate() {
        let start = out.len();
        let info = match s.writer.event(&ev, encoder, &mut out) {
            Some(info) => info,
            None => {
                out.truncate(start);
                by_msgspec(index, &ev, s.event_types.bind(py), encoder, &mut out)?
            }
        };
        written.push(Written {
            end: out.len(),
            info,
        });
    }
    Ok((out, written))
}

/// Event `index` checked, encoded by msgspec and its bytes read back.
fn by_msgspec(
    index: usize,
    ev: &Bound<'_, PyAny>,
    types: &Bound<'_, PyTuple>,
    encoder: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
) -> PyResult<EventInfo> {
    let py = ev.py();
    let ty = ev.get_type();
    let kind = match types.iter().position(|t| t.is(&ty)) {
        Some(kind) => kind,
        None => subclass_kind(ev, types)
            .map_err(|why| invalid_event(py, format!("event {index}: {why}")))?,
    };
    check_containers(ev, kind).map_err(|why| invalid_event(py, format!("event {index}: {why}")))?;
    let bytes = encoder.call_method1("encode", (ev,)).map_err(|e| {
        // msgspec's refusals (unsupported types, ints beyond 64 bits,
        // recursion) are bad events; KeyboardInterrupt and the like are not.
        if e.is_instance_of::<PyException>(py) {
            invalid_event(
                py,
                format!("event {index}: does not encode: {}", e.value(py)),
            )
        } else {
            e
        }
    })?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    let info = schema::read_event(&mut Reader::new(bytes))
        .map_err(|reason| PyKvError::from(Error::InvalidEvent { index, reason }))?;
    out.extend_from_slice(bytes);
    Ok(info)
}

/// The position in `EVENT_TYPES` of the vLLM class `ev`'s class derives
/// from, if it encodes as that class does (same tag in the same field).
/// Fields such a subclass adds are fields vLLM 0.33.0 does not know: the
/// core lets them travel verbatim, as it does a later vLLM's new fields.
fn subclass_kind(ev: &Bound<'_, PyAny>, types: &Bound<'_, PyTuple>) -> Result<usize, String> {
    const NAMES: [&str; 3] = ["BlockStored", "BlockRemoved", "AllBlocksCleared"];
    let ty = ev.get_type();
    let Some((kind, base)) = types
        .iter()
        .enumerate()
        .find(|(_, t)| ty.is_subclass(t).unwrap_or(false))
    else {
        return Err(format!(
            "expected BlockStored, BlockRemoved or AllBlocksCleared, got {}",
            type_name(ev)
        ));
    };
    let tagging = |t: &Bound<'_, PyAny>| -> Option<(String, String)> {
        let config = t.getattr("__struct_config__").ok()?;
        let tag = config.getattr("tag").ok()?.str().ok()?.to_string();
        let field = config.getattr("tag_field").ok()?.str().ok()?.to_string();
        Some((tag, field))
    };
    let (want, got) = (tagging(&base), tagging(ty.as_any()));
    if want.is_none() || want != got {
        let (tag, field) = got.unwrap_or_default();
        return Err(format!(
            "{} derives from {} but is tagged {tag:?} in field {field:?}: a subclass \
             must encode as its base (tag={:?})",
            type_name(ev),
            NAMES[kind],
            NAMES[kind],
        ));
    }
    Ok(kind)
}

/// msgpack writes a list, a tuple or a set alike, and msgspec decodes each as
/// the declared type: an event whose `list` field holds a tuple would come
/// back different (`!=`) from what was encoded, with the same identity. So
/// the container fields must have their declared types (`EVENT_TYPES` order:
/// BlockStored, BlockRemoved, AllBlocksCleared). The insides of
/// `extra_keys` entries are `Any`, written and read back as msgspec does.
fn check_containers<'py>(ev: &Bound<'py, PyAny>, kind: usize) -> Result<(), String> {
    let py = ev.py();
    // Interned names: these lookups run for every event a worker encodes.
    let block_hashes = pyo3::intern!(py, "block_hashes");
    let token_ids = pyo3::intern!(py, "token_ids");
    let (name, lists) = match kind {
        0 => ("BlockStored", &[block_hashes, token_ids][..]),
        1 => ("BlockRemoved", &[block_hashes][..]),
        _ => return Ok(()),
    };
    let field = |f: &Bound<'py, PyString>| -> Result<Bound<'py, PyAny>, String> {
        ev.getattr(f).map_err(|e| format!("{name}.{f}: {e}"))
    };
    let wrong = |f: &Bound<'_, PyString>, want: &str, got: &Bound<'_, PyAny>| {
        format!("{name}.{f}: expected {want}, got {}", type_name(got))
    };
    for f in lists {
        let v = field(f)?;
        if !v.is_instance_of::<PyList>() {
            return Err(wrong(f, "a list", &v));
        }
    }
    if kind != 0 {
        return Ok(());
    }
    // Optional lists whose items must be of one container type.
    let optional = [
        (pyo3::intern!(py, "extra_keys"), true),
        (pyo3::intern!(py, "lookahead_token_ids"), false),
    ];
    for (f, item_is_tuple) in optional {
        // A release whose class lacks the field (vLLM 0.32 has no
        // lookahead_token_ids) writes none: nothing to check.
        if !ev.hasattr(f).unwrap_or(false) {
            continue;
        }
        let v = field(f)?;
        if v.is_none() {
            continue;
        }
        let Ok(items) = v.cast::<PyList>() else {
            return Err(wrong(f, "a list or None", &v));
        };
        for (j, item) in items.iter().enumerate() {
            let ok = if item_is_tuple {
                item.is_none() || item.is_instance_of::<PyTuple>()
            } else {
                item.is_instance_of::<PyList>()
            };
            if !ok {
                let want = if item_is_tuple {
                    "a tuple or None"
                } else {
                    "a list"
                };
                return Err(format!(
                    "{name}.{f}: item {j}: expected {want}, got {}",
                    type_name(&item)
                ));
            }
        }
    }
    Ok(())
}
