//! The msgpack shape of vLLM 0.33.0's KV cache events, as msgspec encodes
//! them (`tag=True`: a map whose `"type"` entry names the class, fields in
//! declaration order, defaults omitted). Validating on the worker means a
//! batch that reaches the scheduler always decodes.
//!
//! A key the schema does not know (a field a later vLLM added) is accepted
//! as long as it is a string, appears once and holds one well-formed value:
//! it stays in the event's bytes, so it travels verbatim and is part of the
//! identity, and msgspec's decoders (which do not forbid unknown fields)
//! skip it.

use std::collections::HashSet;

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

    /// The kind a class name ("BlockStored", ...) names: the inverse of `name`.
    pub fn from_name(name: &str) -> Option<EventKind> {
        EventKind::from_tag(name.as_bytes())
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
    /// Where `token_ids`' value ends, from the event's first byte; 0 when
    /// the event has none. The guard jumps there instead of reading the
    /// token ids (most of a `BlockStored`'s bytes) to reach its medium.
    pub tokens_end: u32,
}

/// The type of a field the schema knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
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

/// The type of field `name` of `kind`, and whether every event must have
/// it; None for a field the schema does not know.
pub fn field(kind: EventKind, name: &str) -> Option<(Ty, bool)> {
    fields(kind)
        .iter()
        .find(|f| f.name == name)
        .map(|f| (f.ty, f.required))
}

/// Whether `bytes` are exactly one value of type `ty`.
pub fn is_value(ty: Ty, bytes: &[u8]) -> bool {
    let mut r = Reader::new(bytes);
    check_value(&mut r, ty).is_ok() && r.is_empty()
}

/// Why an event does not have vLLM's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaError {
    Malformed(ReadError),
    NotAnEvent(String),
    UnknownType(String),
    MissingField {
        kind: EventKind,
        field: &'static str,
    },
    /// A key twice in one event: a known field, the `"type"` tag, or a key
    /// the schema does not know (msgspec never writes a key twice).
    DuplicateField {
        kind: EventKind,
        field: String,
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
    let start = r.pos();
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
    let mut tokens_end = 0;
    let mut next = 0;
    // Keys the schema does not know, kept only once there is one.
    let mut unknown: Option<HashSet<&[u8]>> = None;
    for _ in 1..n {
        let at = r.pos();
        let name = r.read_str_bytes()?;
        // msgspec writes fields in declaration order: look from the one after
        // the last field first, so the usual search is one comparison.
        let Some(i) = (0..schema.len())
            .map(|k| (next + k) % schema.len())
            .find(|&i| schema[i].name.as_bytes() == name)
        else {
            skip_unknown(r, kind, name, at, &mut unknown)?;
            continue;
        };
        let field = &schema[i];
        next = i + 1;
        if seen & (1 << i) != 0 {
            return Err(SchemaError::DuplicateField {
                kind,
                field: field.name.into(),
            });
        }
        seen |= 1 << i;
        let wrong = |detail: String| SchemaError::WrongType {
            kind,
            field: field.name,
            detail,
        };
        let value = check_value(r, field.ty).map_err(wrong)?;
        match field.name {
            "group_idx" => group_idx = value,
            // An event is far below 4 GiB: a batch refuses one that is not.
            "token_ids" => tokens_end = u32::try_from(r.pos() - start).unwrap_or(0),
            _ => {}
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
    Ok(EventInfo {
        kind,
        group_idx,
        tokens_end,
    })
}

/// A block hash as an event holds it: vLLM's `int | bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockHash<'a> {
    Int(i128),
    Bytes(&'a [u8]),
}

/// The fields of a `BlockStored` or `BlockRemoved` that say where its
/// blocks hang and lie, read from an event `read_event` accepted (its
/// `block_hashes` go to `read_blocks`'s caller one by one).
#[derive(Debug, Clone, Copy, Default)]
pub struct Blocks<'a> {
    pub parent: Option<BlockHash<'a>>,
    /// `medium`'s UTF-8 bytes; None for None.
    pub medium: Option<&'a [u8]>,
}

/// `block_hashes` (each given to `hash`, in order, as it is read: one
/// pass), `parent_block_hash` (a `BlockStored`'s: `kind`) and `medium` of
/// one event (its bytes alone); None when they do not read, which an event
/// `read_event` accepted (every event of a batch) always does; `hash` may
/// then have seen some of them. `tokens_end` is its `EventInfo`'s: the
/// token ids are jumped over, not read (0: read). The fields after the last
/// of these are not read: vLLM 0.33's `BlockStored` has 15, the guard needs
/// the first 6, and `read_event` has checked the rest. Only reads, so bytes
/// of any shape (and any `kind` or `tokens_end`) give None or other blocks,
/// never a panic.
pub fn read_blocks<'a>(
    event: &'a [u8],
    kind: EventKind,
    tokens_end: u32,
    mut hash: impl FnMut(BlockHash<'a>),
) -> Option<Blocks<'a>> {
    let mut r = Reader::new(event);
    let n = r.read_map_len().ok()?;
    let mut out = Blocks::default();
    let (mut hashes, mut medium) = (false, false);
    let mut parent = kind != EventKind::BlockStored;
    for _ in 0..n {
        match r.read_str_bytes().ok()? {
            b"block_hashes" if !hashes => {
                for _ in 0..r.read_array_len().ok()? {
                    hash(read_hash(&mut r).ok()?);
                }
                hashes = true;
            }
            b"parent_block_hash" if !parent => {
                if r.peek().ok()? == Marker::Nil {
                    r.skip_field().ok()?;
                } else {
                    out.parent = Some(read_hash(&mut r).ok()?);
                }
                parent = true;
            }
            b"medium" if !medium => {
                if r.peek().ok()? == Marker::Nil {
                    r.skip_field().ok()?;
                } else {
                    out.medium = Some(r.read_str_bytes().ok()?);
                }
                medium = true;
            }
            b"token_ids" if (r.pos() + 1..=event.len()).contains(&(tokens_end as usize)) => {
                r.seek(tokens_end as usize)
            }
            _ => r.skip_field().ok()?,
        }
        if hashes && parent && medium {
            return Some(out);
        }
    }
    hashes.then_some(out)
}

#[inline]
fn read_hash<'a>(r: &mut Reader<'a>) -> Result<BlockHash<'a>, ReadError> {
    match r.peek()? {
        Marker::Bin => r.read_bin().map(BlockHash::Bytes),
        _ => r.read_int().map(BlockHash::Int),
    }
}

/// A field a later vLLM may have added: its name must be valid UTF-8 (as
/// msgspec's decoder requires of a key), not the tag again and not seen
/// before in this event, and its value one well-formed msgpack value
/// (`skip_value` bounds its nesting and checks its lengths).
fn skip_unknown<'a>(
    r: &mut Reader<'a>,
    kind: EventKind,
    name: &'a [u8],
    at: usize,
    unknown: &mut Option<HashSet<&'a [u8]>>,
) -> Result<(), SchemaError> {
    let text = std::str::from_utf8(name).map_err(|_| ReadError::InvalidUtf8 { at })?;
    if name == b"type" || !unknown.get_or_insert_with(HashSet::new).insert(name) {
        return Err(SchemaError::DuplicateField {
            kind,
            field: text.into(),
        });
    }
    r.skip_value()?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing::{clear, removed, stored, with_field, write_str};

    fn read(e: &[u8]) -> Result<EventInfo, SchemaError> {
        let mut r = Reader::new(e);
        let info = read_event(&mut r)?;
        assert!(r.is_empty(), "the event's span is all of its bytes");
        Ok(info)
    }

    /// msgpack values a later field might hold.
    const VALUES: &[&[u8]] = &[
        &[0xc0],
        &[0x07],
        &[0xc3],
        &[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0],
        &[0xa2, b'h', b'i'],
        &[0xc4, 0x02, 0xff, 0x00],
        &[0x92, 0x01, 0x91, 0xc0],
        // {1: "x"}: keys inside a value may be anything msgpack allows.
        &[0x81, 0x01, 0xa1, b'x'],
        // fixext 1, and the timestamp extension (-1, 4 bytes).
        &[0xd4, 0x05, 0x00],
        &[0xd6, 0xff, 0, 0, 0, 1],
    ];

    #[test]
    fn an_unknown_field_is_accepted_in_every_event_type() {
        for v in VALUES {
            for (base, kind, group) in [
                (stored(1, Some(3)), EventKind::BlockStored, Some(3)),
                (stored(1, None), EventKind::BlockStored, None),
                (removed(2), EventKind::BlockRemoved, None),
                (clear(), EventKind::AllBlocksCleared, None),
            ] {
                let e = with_field(&base, "future_field", v);
                let info = read(&e).unwrap_or_else(|err| panic!("{v:?}: {err}"));
                assert_eq!((info.kind, info.group_idx), (kind, group));
            }
        }
    }

    #[test]
    fn unknown_fields_anywhere_do_not_upset_the_known_ones() {
        // {"type": "BlockRemoved", "a": 1, "block_hashes": [9], "b": nil,
        //  "medium": nil, "group_idx": 4, "c": [1]}
        let mut e = vec![0x87];
        write_str(&mut e, "type");
        write_str(&mut e, "BlockRemoved");
        write_str(&mut e, "a");
        e.push(0x01);
        write_str(&mut e, "block_hashes");
        e.extend_from_slice(&[0x91, 0x09]);
        write_str(&mut e, "b");
        e.push(0xc0);
        write_str(&mut e, "medium");
        e.push(0xc0);
        write_str(&mut e, "group_idx");
        e.push(0x04);
        write_str(&mut e, "c");
        e.extend_from_slice(&[0x91, 0x01]);
        let info = read(&e).unwrap();
        assert_eq!(info.kind, EventKind::BlockRemoved);
        assert_eq!(info.group_idx, Some(4));
    }

    #[test]
    fn only_malformed_events_are_refused() {
        let base = removed(2);
        let dup = |e: SchemaError| matches!(e, SchemaError::DuplicateField { .. });
        let malformed = |e: SchemaError| matches!(e, SchemaError::Malformed(_));
        let mut non_str_key = base.clone();
        non_str_key[0] += 1;
        non_str_key.extend_from_slice(&[0x01, 0x02]);
        let mut bad_utf8_key = base.clone();
        bad_utf8_key[0] += 1;
        bad_utf8_key.extend_from_slice(&[0xa2, 0xff, 0xfe, 0x01]);
        let twice = with_field(&with_field(&base, "x", &[1]), "x", &[2]);
        type Check<'a> = &'a dyn Fn(SchemaError) -> bool;
        let cases: Vec<(Vec<u8>, Check)> = vec![
            (non_str_key, &malformed),
            (bad_utf8_key, &malformed),
            (twice, &dup),
            (with_field(&base, "type", &[0xa1, b'x']), &dup),
            (with_field(&base, "medium", &[0xc0]), &dup),
            (with_field(&base, "x", &[0xc1]), &malformed),
            (with_field(&base, "x", &[0x92, 0x01]), &malformed),
            (with_field(&base, "x", &[0xa2, 0xff, 0xfe]), &malformed),
            (with_field(&base, "x", &[0x91; 40]), &malformed),
            (
                with_field(&base, "x", &[0xdd, 0xff, 0xff, 0xff, 0xff]),
                &malformed,
            ),
            (with_field(&base, "x", &[]), &malformed),
            (with_field(&base, "group_idx", &[0xa1, b'0']), &|e| {
                matches!(
                    e,
                    SchemaError::WrongType {
                        field: "group_idx",
                        ..
                    }
                )
            }),
        ];
        for (i, (e, want)) in cases.into_iter().enumerate() {
            let err = read(&e).expect_err(&format!("case {i} is refused"));
            let text = err.to_string();
            assert!(want(err), "case {i}: {text}");
        }
        // A required field is still required next to unknown ones:
        // {"type": "BlockRemoved", "block_hashes": [1], "x": nil}
        let mut e = vec![0x83];
        write_str(&mut e, "type");
        write_str(&mut e, "BlockRemoved");
        write_str(&mut e, "block_hashes");
        e.extend_from_slice(&[0x91, 0x01]);
        write_str(&mut e, "x");
        e.push(0xc0);
        assert_eq!(
            read(&e),
            Err(SchemaError::MissingField {
                kind: EventKind::BlockRemoved,
                field: "medium"
            })
        );
        assert_eq!(
            read(&with_field(&base, "x", &[1])).unwrap().kind,
            EventKind::BlockRemoved
        );
        let msg = read(&with_field(&with_field(&base, "x", &[1]), "x", &[1]))
            .unwrap_err()
            .to_string();
        assert_eq!(msg, "BlockRemoved.x appears twice");
    }

    /// A msgpack value of any shape, as bytes.
    fn value() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            Just(vec![0xc0]),
            any::<u8>().prop_map(|b| vec![b & 0x7f]),
            any::<i64>().prop_map(|v| {
                let mut out = vec![0xd3];
                out.extend_from_slice(&v.to_be_bytes());
                out
            }),
            "[a-z]{0,5}".prop_map(|s| {
                let mut out = Vec::new();
                write_str(&mut out, &s);
                out
            }),
            prop::collection::vec(any::<u8>(), 0..4).prop_map(|b| {
                let mut out = vec![0xc4, b.len() as u8];
                out.extend_from_slice(&b);
                out
            }),
        ];
        leaf.prop_recursive(3, 12, 4, |inner| {
            prop::collection::vec(inner, 0..4).prop_map(|items| {
                let mut out = vec![0x90 | items.len() as u8];
                items.iter().for_each(|i| out.extend_from_slice(i));
                out
            })
        })
    }

    proptest! {
        /// Any well-formed extra field keeps the event valid with its kind
        /// and group; cut short anywhere, the event is refused.
        #[test]
        fn any_extra_field_is_skipped_exactly(
            which in 0usize..4,
            name in "[a-z_]{1,12}",
            v in value(),
        ) {
            let base = [stored(1, Some(2)), stored(3, None), removed(4), clear()][which].clone();
            prop_assume!(!BLOCK_STORED.iter().any(|f| f.name == name) && name != "type");
            let want = read(&base).unwrap();
            let e = with_field(&base, &name, &v);
            prop_assert_eq!(read(&e).unwrap(), want);
            for cut in base.len()..e.len() {
                let mut r = Reader::new(&e[..cut]);
                prop_assert!(read_event(&mut r).is_err());
            }
        }
    }
}
