//! vLLM's event objects written as msgspec writes them, without msgspec:
//! the worker's common case. Encoding with msgspec and then parsing its
//! output to find each event's span, kind and group cost as much again as
//! the encoding (issue 14); writing each event here gives all three as it
//! goes, and a field of a known type needs no second check.
//!
//! Only what is certain to come out byte for byte as msgspec's does is
//! written here: an instance of vLLM's own class (not a subclass), its
//! struct config the one `kvmerge-core`'s schema reads, every field one the
//! schema knows, and every value of exactly the type the field declares
//! (`int` within 64 bits, `str`, `bytes`, `list`, None). `extra_keys`, whose
//! entries are `Any`, goes to msgspec on its own and is checked by the
//! schema. Anything else (a subclass, a `bool` or an int subclass, a tuple
//! for a list) makes `Writer::event` return None: the caller gives that
//! event to msgspec, which also says what is wrong. Both must give the same
//! bytes, or ranks would disagree on identities: `tests/core/test_write.py`
//! compares them.

use kvmerge_core::msgpack::{self, write_struct_header, NIL};
use kvmerge_core::schema::{self, EventInfo, Ty};
use kvmerge_core::EventKind;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};

use crate::layout::{self, Layout};

/// How to write one of vLLM's event classes.
pub struct Plan {
    class: Py<PyType>,
    kind: EventKind,
    /// The `"type"` key and the class's tag, as msgspec writes them.
    tag: Vec<u8>,
    /// Entries the class can have (its fields and the tag): the size of the
    /// map header msgspec writes.
    max: usize,
    fields: Vec<Field>,
}

struct Field {
    name: Py<PyString>,
    /// Where an instance holds the field (`slots`): read in place, without
    /// `getattr`'s lookup and call (a third of the writer's time).
    slot: Option<usize>,
    /// The field's name, as msgspec writes it.
    key: Vec<u8>,
    ty: Ty,
    /// No default: written even when None (msgspec omits only defaults).
    always: bool,
    is_group: bool,
    is_tokens: bool,
}

/// What `event` needs: the plans of the `EVENT_TYPES` this module can write
/// (a class it cannot has none, and its events take msgspec's path), and
/// how to read lists and ints in place, where it can.
pub struct Writer {
    plans: Vec<Plan>,
    layout: Option<Layout>,
}

impl Writer {
    pub fn new(types: &Bound<'_, PyTuple>) -> Writer {
        Writer {
            plans: types
                .iter()
                .filter_map(|class| plan(&class).ok().flatten())
                .collect(),
            layout: Layout::detect(types.py()),
        }
    }

    /// Writes `ev` as msgspec would; returns what it is. None if it is not
    /// of the common case (`out` then holds a part of it, for the caller to
    /// cut).
    pub fn event(
        &self,
        ev: &Bound<'_, PyAny>,
        encoder: &Bound<'_, PyAny>,
        out: &mut Vec<u8>,
    ) -> Option<EventInfo> {
        let ty = ev.get_type_ptr();
        let plan = self
            .plans
            .iter()
            .find(|p| std::ptr::eq(p.class.as_ptr(), ty.cast()))?;
        let (group_idx, tokens_end) = plan.write(ev, self.layout, encoder, out)?;
        Some(EventInfo {
            kind: plan.kind,
            group_idx,
            tokens_end,
        })
    }
}

/// The plan of an event class whose tag names the kind the schema reads.
fn plan(class: &Bound<'_, PyAny>) -> PyResult<Option<Plan>> {
    let config = class.getattr("__struct_config__")?;
    let tag_field: String = config.getattr("tag_field")?.extract()?;
    let tag: String = config.getattr("tag")?.extract()?;
    let Some(kind) = EventKind::from_name(&tag) else {
        return Ok(None);
    };
    if tag_field != "type"
        || config.getattr("array_like")?.is_truthy()?
        || !config.getattr("omit_defaults")?.is_truthy()?
    {
        return Ok(None);
    }
    let names: Vec<String> = class.getattr("__struct_fields__")?.extract()?;
    let encoded: Vec<String> = class.getattr("__struct_encode_fields__")?.extract()?;
    let defaults = class
        .getattr("__struct_defaults__")?
        .cast_into::<PyTuple>()?;
    if names != encoded || defaults.len() > names.len() || defaults.iter().any(|d| !d.is_none()) {
        return Ok(None);
    }
    let first_default = names.len() - defaults.len();
    let mut fields = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let Some((ty, required)) = schema::field(kind, name) else {
            return Ok(None);
        };
        let always = i < first_default;
        if required && !always {
            // msgspec would leave out a None the schema requires.
            return Ok(None);
        }
        let mut key = Vec::new();
        msgpack::write_str(&mut key, name.as_bytes());
        fields.push(Field {
            name: PyString::intern(class.py(), name).unbind(),
            slot: None,
            key,
            ty,
            always,
            is_group: name == "group_idx",
            is_tokens: name == "token_ids",
        });
    }
    if let Some(slots) = slots(class, &names) {
        for (f, slot) in fields.iter_mut().zip(slots) {
            f.slot = Some(slot);
        }
    }
    let mut head = Vec::new();
    msgpack::write_str(&mut head, tag_field.as_bytes());
    msgpack::write_str(&mut head, tag.as_bytes());
    Ok(Some(Plan {
        class: class.cast::<PyType>()?.clone().unbind(),
        kind,
        tag: head,
        max: names.len() + 1,
        fields,
    }))
}

/// Where an instance of `class` holds each of its fields: found by making
/// one whose fields are distinct new objects and looking for each among the
/// words of the instance (msgspec keeps a struct's fields at fixed offsets,
/// as `__slots__`). Nothing is assumed about any layout: None unless every
/// field is found exactly once.
fn slots(class: &Bound<'_, PyAny>, names: &[String]) -> Option<Vec<usize>> {
    let py = class.py();
    let size: usize = class.getattr("__basicsize__").ok()?.extract().ok()?;
    let kwargs = PyDict::new(py);
    let marks: Vec<Bound<'_, PyAny>> = names.iter().map(|_| PyList::empty(py).into_any()).collect();
    for (name, mark) in names.iter().zip(&marks) {
        kwargs.set_item(name, mark).ok()?;
    }
    let probe = class.call((), Some(&kwargs)).ok()?;
    let words = size / std::mem::size_of::<*mut ffi::PyObject>();
    // SAFETY: `probe` is a live instance of `class`, `__basicsize__` bytes.
    let word = |i: usize| unsafe { probe.as_ptr().cast::<*mut ffi::PyObject>().add(i).read() };
    marks
        .iter()
        .map(|mark| {
            let mut found = (0..words).filter(|&i| std::ptr::eq(word(i), mark.as_ptr()));
            match (found.next(), found.next()) {
                (Some(i), None) => Some(i * std::mem::size_of::<*mut ffi::PyObject>()),
                _ => None,
            }
        })
        .collect()
}

impl Plan {
    /// Writes `ev`; returns its group.
    fn write(
        &self,
        ev: &Bound<'_, PyAny>,
        layout: Option<Layout>,
        encoder: &Bound<'_, PyAny>,
        out: &mut Vec<u8>,
    ) -> Option<(Option<i64>, u32)> {
        let py = ev.py();
        let at = out.len();
        write_struct_header(out, 0, self.max);
        let header_len = out.len() - at;
        out.extend_from_slice(&self.tag);
        let mut entries = 1;
        let mut group_idx = None;
        let mut tokens_end = 0;
        for f in &self.fields {
            let owned;
            let v = match f.slot {
                // SAFETY: `ev` is an instance of exactly the class the slot
                // was found in; it holds the value (borrowed here).
                Some(at) => unsafe {
                    ev.as_ptr()
                        .cast::<u8>()
                        .add(at)
                        .cast::<*mut ffi::PyObject>()
                        .read()
                },
                None => {
                    owned = ev.getattr(f.name.bind(py)).ok()?;
                    owned.as_ptr()
                }
            };
            if v.is_null() {
                return None;
            }
            if !f.always && is_none(v) {
                continue;
            }
            out.extend_from_slice(&f.key);
            if f.ty == Ty::OptExtraKeys && !is_none(v) {
                // SAFETY: a live object; msgspec may run code, so hold it.
                let value = unsafe { Bound::from_borrowed_ptr(py, v) };
                extra_keys(&value, encoder, out)?;
                entries += 1;
                continue;
            }
            // SAFETY: `v` is a live object `ev` or we hold; nothing
            // below runs Python code (exact types only), so the lists it
            // reaches cannot change while they are read.
            let int = unsafe { value_of(out, v, f.ty, layout)? };
            if f.is_group {
                group_idx = int;
            }
            if f.is_tokens {
                tokens_end = u32::try_from(out.len() - at).unwrap_or(0);
            }
            entries += 1;
        }
        let mut header = Vec::with_capacity(header_len);
        write_struct_header(&mut header, entries, self.max);
        out[at..at + header_len].copy_from_slice(&header);
        Some((group_idx, tokens_end))
    }
}

fn is_none(v: *mut ffi::PyObject) -> bool {
    // SAFETY: Py_None is the interpreter's static singleton.
    std::ptr::eq(v, unsafe { ffi::Py_None() })
}

/// Writes a value of type `ty`; returns the int of an `OptInt`, saturated
/// to i64 as the schema's reader returns it. None: not the common case.
///
/// # Safety
/// `v` must be a live object, and the GIL held.
unsafe fn value_of(
    out: &mut Vec<u8>,
    v: *mut ffi::PyObject,
    ty: Ty,
    layout: Option<Layout>,
) -> Option<Option<i64>> {
    let none = is_none(v);
    let int = |out: &mut Vec<u8>, item| int_value(out, item, layout).map(drop);
    let hash = |out: &mut Vec<u8>, item| hash_value(out, item, layout);
    match ty {
        Ty::Int => int_value(out, v, layout).map(Some),
        Ty::OptInt if none => nil(out),
        Ty::OptInt => int_value(out, v, layout).map(Some),
        Ty::OptStr if none => nil(out),
        Ty::OptStr => str_value(out, v).map(|()| None),
        Ty::OptHash if none => nil(out),
        Ty::OptHash => hash(out, v).map(|()| None),
        Ty::HashList => list_value(out, v, layout, hash).map(|()| None),
        Ty::IntList => list_value(out, v, layout, int).map(|()| None),
        Ty::OptIntListList if none => nil(out),
        Ty::OptIntListList => list_value(out, v, layout, |out, inner| {
            list_value(out, inner, layout, int)
        })
        .map(|()| None),
        Ty::OptExtraKeys if none => nil(out),
        // Entries are `Any`: msgspec's to write (`extra_keys`).
        Ty::OptExtraKeys => None,
    }
}

/// `extra_keys`: a list of tuples or None, as `encode` requires; the
/// tuples' insides are `Any`, written by msgspec and checked by the schema.
fn extra_keys(
    value: &Bound<'_, PyAny>,
    encoder: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
) -> Option<()> {
    let entries = value.cast_exact::<PyList>().ok()?;
    if !entries
        .iter()
        .all(|e| e.is_none() || e.is_exact_instance_of::<PyTuple>())
    {
        return None;
    }
    let bytes = encoder.call_method1("encode", (value,)).ok()?;
    let bytes = bytes.cast::<PyBytes>().ok()?.as_bytes();
    if !schema::is_value(Ty::OptExtraKeys, bytes) {
        return None;
    }
    out.extend_from_slice(bytes);
    Some(())
}

fn nil(out: &mut Vec<u8>) -> Option<Option<i64>> {
    out.push(NIL);
    Some(None)
}

/// An exact `int` within 64 bits; returns it saturated to i64.
#[inline(always)]
unsafe fn int_value(
    out: &mut Vec<u8>,
    v: *mut ffi::PyObject,
    layout: Option<Layout>,
) -> Option<i64> {
    if !std::ptr::eq(ffi::Py_TYPE(v), std::ptr::addr_of_mut!(ffi::PyLong_Type)) {
        return None;
    }
    if let Some(i) = layout.and_then(|l| l.int(v)) {
        msgpack::write_int(out, i);
        return Some(i);
    }
    let mut overflow = 0;
    let i = ffi::PyLong_AsLongLongAndOverflow(v, &mut overflow);
    if overflow == 0 {
        msgpack::write_int(out, i);
        return Some(i);
    }
    if overflow < 0 {
        return None;
    }
    let u = ffi::PyLong_AsUnsignedLongLong(v);
    if u == u64::MAX && !ffi::PyErr_Occurred().is_null() {
        // Beyond 64 bits: msgspec refuses it, and says so.
        ffi::PyErr_Clear();
        return None;
    }
    msgpack::write_uint(out, u);
    Some(i64::MAX)
}

/// An exact `str`.
unsafe fn str_value(out: &mut Vec<u8>, v: *mut ffi::PyObject) -> Option<()> {
    if !std::ptr::eq(ffi::Py_TYPE(v), std::ptr::addr_of_mut!(ffi::PyUnicode_Type)) {
        return None;
    }
    let mut len: ffi::Py_ssize_t = 0;
    let data = ffi::PyUnicode_AsUTF8AndSize(v, &mut len);
    if data.is_null() {
        // Lone surrogates: not UTF-8.
        ffi::PyErr_Clear();
        return None;
    }
    msgpack::write_str(out, std::slice::from_raw_parts(data.cast(), len as usize));
    Some(())
}

/// A block hash: an exact `int` or `bytes`.
unsafe fn hash_value(
    out: &mut Vec<u8>,
    v: *mut ffi::PyObject,
    layout: Option<Layout>,
) -> Option<()> {
    if std::ptr::eq(ffi::Py_TYPE(v), std::ptr::addr_of_mut!(ffi::PyBytes_Type)) {
        let data = ffi::PyBytes_AsString(v);
        let len = ffi::PyBytes_Size(v);
        msgpack::write_bin(out, std::slice::from_raw_parts(data.cast(), len as usize));
        return Some(());
    }
    int_value(out, v, layout).map(drop)
}

/// An exact `list`, each item written by `item`.
unsafe fn list_value(
    out: &mut Vec<u8>,
    v: *mut ffi::PyObject,
    layout: Option<Layout>,
    mut item: impl FnMut(&mut Vec<u8>, *mut ffi::PyObject) -> Option<()>,
) -> Option<()> {
    if !std::ptr::eq(ffi::Py_TYPE(v), std::ptr::addr_of_mut!(ffi::PyList_Type)) {
        return None;
    }
    let n = ffi::PyList_Size(v);
    msgpack::write_array_header(out, n as usize);
    // Room for token ids of up to 4 bytes (128k-token vocabularies) at once.
    out.reserve(n as usize * 5);
    // Borrowed: the list holds its items, and nothing here changes the list.
    if layout.is_some() {
        let items = layout::items(v);
        for i in 0..n as usize {
            item(out, items.add(i).read())?;
        }
    } else {
        for i in 0..n {
            item(out, ffi::PyList_GetItem(v, i))?;
        }
    }
    Some(())
}
