//! The msgpack shape of vLLM 0.33.0's KV cache events, as msgspec encodes
//! them (`tag=True`: a map whose `"type"` entry names the class, fields in
//! declaration order, defaults omitted). Validating on the worker means a
//! batch that reaches the scheduler always decodes.

use crate::msgpack::{Marker, ReadError, Reader};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum EventKind {
    BlockStored = 1,
    BlockRemoved = 2,
    AllBlocksCleared = 3,
}

impl EventKind {
    pub fn from_u8(v: u8) -> Option<EventKind> {
        match v {
            1 => Some(EventKind::BlockStored),
            2 => Some(EventKind::BlockRemoved),
            3 => Some(EventKind::AllBlocksCleared),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EventKind::BlockStored => "BlockStored",
            EventKind::BlockRemoved => "BlockRemoved",
            EventKind::AllBlocksCleared => "AllBlocksCleared",
        }
    }

    fn from_tag(tag: &[u8]) -> Option<EventKind> {
        match tag {
            b"BlockStored" => Some(EventKind::BlockStored),
            b"BlockRemoved" => Some(EventKind::BlockRemoved),
            b"AllBlocksCleared" => Some(EventKind::AllBlocksCleared),
            _ => None,
        }
    }
}

/// What the merger needs to know of an event besides its identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventInfo {
    pub kind: EventKind,
    pub group_idx: Option<i64>,
}

#[derive(Debug, Clone, Copy)]
enum Ty {
    Int,
    OptInt,
    OptStr,
    /// `ExternalBlockHash | None`, where `ExternalBlockHash = bytes | int`
    OptHash,
    HashList,
    IntList,
    OptIntListList,
    /// `list[tuple[Any, ...] | None] | None`
    OptExtraKeys,
}

struct Field {
    name: &'static str,
    ty: Ty,
    required: bool,
}

const fn req(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        required: true,
    }
}

const fn opt(name: &'static str, ty: Ty) -> Field {
    Field {
        name,
        ty,
        required: false,
    }
}

const BLOCK_STORED: &[Field] = &[
    req("block_hashes", Ty::HashList),
    req("parent_block_hash", Ty::OptHash),
    req("token_ids", Ty::IntList),
    req("block_size", Ty::Int),
    req("lora_id", Ty::OptInt),
    req("medium", Ty::OptStr),
    req("lora_name", Ty::OptStr),
    opt("extra_keys", Ty::OptExtraKeys),
    opt("group_idx", Ty::OptInt),
    opt("kv_cache_spec_kind", Ty::OptStr),
    opt("kv_cache_spec_sliding_window", Ty::OptInt),
    opt("locality", Ty::OptStr),
    opt("ownership", Ty::OptStr),
    opt("session_id", Ty::OptStr),
    opt("lookahead_token_ids", Ty::OptIntListList),
];

const BLOCK_REMOVED: &[Field] = &[
    req("block_hashes", Ty::HashList),
    req("medium", Ty::OptStr),
    opt("group_idx", Ty::OptInt),
    opt("locality", Ty::OptStr),
    opt("ownership", Ty::OptStr),
];

const ALL_BLOCKS_CLEARED: &[Field] = &[];

fn fields(kind: EventKind) -> &'static [Field] {
    match kind {
        EventKind::BlockStored => BLOCK_STORED,
        EventKind::BlockRemoved => BLOCK_REMOVED,
        EventKind::AllBlocksCleared => ALL_BLOCKS_CLEARED,
    }
}

/// Why an event does not have vLLM's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaError {
    Malformed(ReadError),
    NotAnEvent(String),
    UnknownType(String),
    UnknownField {
        kind: EventKind,
        field: String,
    },
    MissingField {
        kind: EventKind,
        field: &'static str,
    },
    DuplicateField {
        kind: EventKind,
        field: &'static str,
    },
    WrongType {
        kind: EventKind,
        field: &'static str,
        detail: String,
    },
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchemaError::Malformed(e) => write!(f, "malformed msgpack: {e}"),
            SchemaError::NotAnEvent(why) => write!(f, "not a KV cache event: {why}"),
            SchemaError::UnknownType(t) => write!(f, "unknown event type {t:?}"),
            SchemaError::UnknownField { kind, field } => {
                write!(f, "{} has no field {field:?}", kind.name())
            }
            SchemaError::MissingField { kind, field } => {
                write!(f, "{}.{field} is missing", kind.name())
            }
            SchemaError::DuplicateField { kind, field } => {
                write!(f, "{}.{field} appears twice", kind.name())
            }
            SchemaError::WrongType {
                kind,
                field,
                detail,
            } => write!(f, "{}.{field}: {detail}", kind.name()),
        }
    }
}

impl From<ReadError> for SchemaError {
    fn from(e: ReadError) -> Self {
        SchemaError::Malformed(e)
    }
}

/// Reads one event at the reader's position and checks it field by field.
pub fn read_event(r: &mut Reader<'_>) -> Result<EventInfo, SchemaError> {
    let found = r.peek()?;
    if found != Marker::Map {
        return Err(SchemaError::NotAnEvent(format!(
            "expected a map, found {found}"
        )));
    }
    let n = r.read_map_len()?;
    if n == 0 {
        return Err(SchemaError::NotAnEvent("empty map, no \"type\" tag".into()));
    }
    // msgspec writes the tag first; anything else did not come from vLLM's
    // event classes.
    // Names are compared as bytes (they are ASCII): only a name that
    // matches none is decoded, for the message.
    let key = r.read_str_bytes()?;
    if key != b"type" {
        return Err(SchemaError::NotAnEvent(format!(
            "first key is {:?}, not the \"type\" tag",
            String::from_utf8_lossy(key)
        )));
    }
    if r.peek()? != Marker::Str {
        read_str_value(r)?; // the error names what was found
    }
    let tag = r.read_str_bytes()?;
    let kind = EventKind::from_tag(tag)
        .ok_or_else(|| SchemaError::UnknownType(String::from_utf8_lossy(tag).into()))?;
    let schema = fields(kind);
    let mut seen: u32 = 0;
    let mut group_idx = None;
    let mut next = 0;
    for _ in 1..n {
        let name = r.read_str_bytes()?;
        // msgspec writes fields in declaration order: look from the one after
        // the last field first, so the usual search is one comparison.
        let i = (0..schema.len())
            .map(|k| (next + k) % schema.len())
            .find(|&i| schema[i].name.as_bytes() == name)
            .ok_or_else(|| SchemaError::UnknownField {
                kind,
                field: String::from_utf8_lossy(name).into(),
            })?;
        let field = &schema[i];
        next = i + 1;
        if seen & (1 << i) != 0 {
            return Err(SchemaError::DuplicateField {
                kind,
                field: field.name,
            });
        }
        seen |= 1 << i;
        let wrong = |detail: String| SchemaError::WrongType {
            kind,
            field: field.name,
            detail,
        };
        let value = check_value(r, field.ty).map_err(wrong)?;
        if field.name == "group_idx" {
            group_idx = value;
        }
    }
    if let Some(missing) = schema
        .iter()
        .enumerate()
        .find(|(i, f)| f.required && seen & (1 << i) == 0)
    {
        return Err(SchemaError::MissingField {
            kind,
            field: missing.1.name,
        });
    }
    Ok(EventInfo { kind, group_idx })
}

fn read_str_value<'a>(r: &mut Reader<'a>) -> Result<&'a str, SchemaError> {
    Ok(r.read_str()?)
}

/// Checks a field's value; returns the integer for `Ty::OptInt` fields.
fn check_value(r: &mut Reader<'_>, ty: Ty) -> Result<Option<i64>, String> {
    let at = r.pos();
    let m = r.peek().map_err(|e| e.to_string())?;
    let mismatch = |want: &str| format!("expected {want}, found {m} (byte {at})");
    let int =
        |r: &mut Reader<'_>| -> Result<i128, String> { r.read_int().map_err(|e| e.to_string()) };
    match ty {
        Ty::Int if m == Marker::Int => int(r).map(saturate),
        Ty::Int => Err(mismatch("int")),
        Ty::OptInt if m == Marker::Nil => nil(r),
        Ty::OptInt if m == Marker::Int => int(r).map(saturate),
        Ty::OptInt => Err(mismatch("int or None")),
        Ty::OptStr if m == Marker::Nil => nil(r),
        Ty::OptStr if m == Marker::Str => r.read_str().map(|_| None).map_err(|e| e.to_string()),
        Ty::OptStr => Err(mismatch("str or None")),
        Ty::OptHash if m == Marker::Nil => nil(r),
        Ty::OptHash => hash(r, m).map_err(|_| mismatch("int, bytes or None")),
        Ty::HashList => each(r, m, "a list of int or bytes", |r| {
            let m = r.peek().map_err(|e| e.to_string())?;
            hash(r, m)
        }),
        Ty::IntList => int_list(r, m),
        Ty::OptIntListList if m == Marker::Nil => nil(r),
        Ty::OptIntListList => each(r, m, "a list of lists of int", |r| {
            let m = r.peek().map_err(|e| e.to_string())?;
            int_list(r, m)
        }),
        Ty::OptExtraKeys if m == Marker::Nil => nil(r),
        Ty::OptExtraKeys => each(r, m, "a list of tuples or None", |r| {
            let m = r.peek().map_err(|e| e.to_string())?;
            match m {
                Marker::Nil => nil(r),
                Marker::Array => r.skip_value().map(|_| None).map_err(|e| e.to_string()),
                other => Err(format!("expected a tuple or None, found {other}")),
            }
        }),
    }
}

/// A `group_idx` beyond i64 is out of every factor table all the same.
fn saturate(v: i128) -> Option<i64> {
    Some(v.clamp(i64::MIN as i128, i64::MAX as i128) as i64)
}

fn nil(r: &mut Reader<'_>) -> Result<Option<i64>, String> {
    r.read_nil().map(|_| None).map_err(|e| e.to_string())
}

fn hash(r: &mut Reader<'_>, m: Marker) -> Result<Option<i64>, String> {
    match m {
        Marker::Int => r.read_int().map(|_| None).map_err(|e| e.to_string()),
        Marker::Bin => r.read_bin().map(|_| None).map_err(|e| e.to_string()),
        other => Err(format!("expected int or bytes, found {other}")),
    }
}

fn int_list(r: &mut Reader<'_>, m: Marker) -> Result<Option<i64>, String> {
    if m != Marker::Array {
        return Err(format!("expected a list of int, found {m}"));
    }
    let n = r.read_array_len().map_err(|e| e.to_string())?;
    r.skip_ints(n).map_err(|(i, e)| format!("item {i}: {e}"))?;
    Ok(None)
}

fn each(
    r: &mut Reader<'_>,
    m: Marker,
    want: &str,
    mut item: impl FnMut(&mut Reader<'_>) -> Result<Option<i64>, String>,
) -> Result<Option<i64>, String> {
    if m != Marker::Array {
        return Err(format!("expected {want}, found {m}"));
    }
    let n = r.read_array_len().map_err(|e| e.to_string())?;
    for i in 0..n {
        item(r).map_err(|e| format!("item {i}: {e}"))?;
    }
    Ok(None)
}
