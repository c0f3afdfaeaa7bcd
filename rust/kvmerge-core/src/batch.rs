//! The wire format of a batch: a small header, one fixed-size record per
//! event (identity, span, kind, group), then the msgspec payload.
//!
//! ```text
//! 0..4    magic "KVMB"          8..12   event count (u32 LE)
//! 4       format version (4)    12..16  payload length (u32 LE)
//! 5..8    zero                  16..24  XXH3-64 of every byte after 24
//! 24..32  the identity digest: XXH3-64 of the identities, in order
//! 32..    one 40-byte record per event, then the payload: a msgpack array
//!         of the events whose bytes travel, exactly as msgspec encoded them
//! record: 0..16 identity | 16..20 offset in payload | 20..24 length
//!         24 kind | 25 flags (bit 0: has group, bit 1: bytes not carried)
//!         26..28 zero | 28..32 where token_ids ends in the event (u32 LE,
//!         0: none; see `EventInfo::tokens_end`) | 32..40 group
//! ```
//! An event whose bytes the batch does not carry (another rank carries them,
//! see `carriers`) keeps its record, with length 0. The merger reads
//! records only; the payload is read once more, to copy the published events
//! out.
//!
//! The identity digest is written where the batch is made (on the worker)
//! and not computed again where it is read: ranks whose batches have equal
//! digests reported the same identities in the same order, which the
//! merger learns in one comparison per rank instead of one per event (its
//! shortcut for a healthy step, `merge::fast`). The checksum covers it, as
//! every other byte of the records.

use crate::carriers::Carriers;
use crate::error::{Error, Result};
use crate::identity::{Identity, IdentityMap};
use crate::msgpack::{self, Reader};
use crate::schema::{self, EventKind};

const MAGIC: &[u8; 4] = b"KVMB";
const VERSION: u8 = 4;
pub const HEADER_LEN: usize = 32;
/// The checksum covers every byte from here: the digest and what follows.
pub const SUMMED_FROM: usize = 24;
pub const RECORD_LEN: usize = 40;
const HAS_GROUP: u8 = 1;
const UNCARRIED: u8 = 2;

/// Memory a `Batch` reads from: an owned `Vec`, or a buffer the binding
/// borrows from Python without copying.
///
/// # Safety
/// `bytes()` must return the same, unchanging slice for as long as the value
/// lives: the batch keeps a pointer to it.
pub unsafe trait Backing: Send + Sync + 'static {
    fn bytes(&self) -> &[u8];
}

// SAFETY: a Vec we own and never mutate does not move its heap buffer.
unsafe impl Backing for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// One event's record, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub identity: Identity,
    pub kind: EventKind,
    pub group_idx: Option<i64>,
    /// Whether the event's bytes are in this batch (see `carriers`).
    pub carried: bool,
    pub tokens_end: u32,
    offset: u32,
    len: u32,
}

/// An immutable, validated batch.
pub struct Batch {
    /// Owns the bytes `ptr` points into.
    _owner: Box<dyn Backing>,
    ptr: *const u8,
    nbytes: usize,
    n_events: usize,
    n_uncarried: usize,
}

// SAFETY: `ptr` points into `backing`, which is Send + Sync and never mutated.
unsafe impl Send for Batch {}
unsafe impl Sync for Batch {}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("events", &self.n_events)
            .field("nbytes", &self.nbytes)
            .field("uncarried", &self.n_uncarried)
            .finish()
    }
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::CorruptBatch(msg.into())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl Batch {
    /// Validates `backing` as a batch and takes it over without copying.
    pub fn from_backing(backing: Box<dyn Backing>) -> Result<Batch> {
        let bytes = backing.bytes();
        let (ptr, nbytes) = (bytes.as_ptr(), bytes.len());
        let (n_events, n_uncarried) = validate(bytes)?;
        Ok(Batch {
            _owner: backing,
            ptr,
            nbytes,
            n_events,
            n_uncarried,
        })
    }

    pub fn from_vec(bytes: Vec<u8>) -> Result<Batch> {
        Batch::from_backing(Box::new(bytes))
    }

    /// For bytes this module just wrote: validating them again would read
    /// the whole buffer a second time.
    fn from_own_vec(bytes: Vec<u8>, n_events: usize, n_uncarried: usize) -> Batch {
        debug_assert_eq!(validate(&bytes), Ok((n_events, n_uncarried)));
        let (ptr, nbytes) = (bytes.as_ptr(), bytes.len());
        Batch {
            _owner: Box::new(bytes),
            ptr,
            nbytes,
            n_events,
            n_uncarried,
        }
    }

    /// Builds a batch from msgspec's encoding of a list of vLLM events,
    /// checking every event's shape and computing its identity.
    pub fn encode(payload: &[u8]) -> Result<Batch> {
        Batch::encode_for(payload, None)
    }

    /// `encode` for `rank` of the world `carriers` describes: the batch
    /// carries only the bytes of the events this rank must carry
    /// (`Carriers::carries`), and keeps every event's record.
    pub fn encode_for(payload: &[u8], carrier: Option<(&Carriers, usize)>) -> Result<Batch> {
        check_carrier(carrier)?;
        let mut r = Reader::new(payload);
        let n = r
            .read_array_len()
            .map_err(|e| Error::InvalidPayload(e.to_string()))?;
        let start = r.pos();
        // The announced count is untrusted until the events are read: every
        // event takes bytes of the payload, so its length bounds the count.
        let mut written = Vec::with_capacity(n.min(payload.len()));
        for index in 0..n {
            let info = schema::read_event(&mut r)
                .map_err(|reason| Error::InvalidEvent { index, reason })?;
            written.push(Written {
                end: r.pos() - start,
                info,
            });
        }
        if !r.is_empty() {
            return Err(Error::InvalidPayload(format!(
                "{} trailing bytes after the event list",
                payload.len() - r.pos()
            )));
        }
        build(&payload[start..], &written, carrier)
    }

    /// `encode_for` of events a caller wrote itself, exactly as msgspec
    /// writes them, back to back in `events` (no array header); event `i`
    /// ends at `written[i].end`. For a writer that produces each event's
    /// bytes and knows its kind and group as it does (the binding's, from
    /// vLLM's objects): nothing is parsed again. Debug builds check every
    /// event against the schema.
    pub fn encode_written(
        events: &[u8],
        written: &[Written],
        carrier: Option<(&Carriers, usize)>,
    ) -> Result<Batch> {
        check_carrier(carrier)?;
        if cfg!(debug_assertions) {
            let mut start = 0;
            for w in written {
                let mut r = Reader::new(&events[start..w.end]);
                assert_eq!(schema::read_event(&mut r), Ok(w.info));
                assert!(r.is_empty(), "an event ends where the writer says");
                start = w.end;
            }
            assert_eq!(start, events.len(), "no bytes after the last event");
        }
        build(events, written, carrier)
    }

    /// A new batch holding the given events of other batches, in order
    /// (an event whose bytes its batch does not carry stays without them).
    ///
    /// # Panics
    /// If they do not fit one batch (see `try_gather`).
    pub fn gather<'a>(events: impl ExactSizeIterator<Item = (&'a Batch, usize)> + Clone) -> Batch {
        Batch::try_gather(events).expect("gathered events fit one batch")
    }

    /// `gather`, refusing with `Error::TooLarge` (before allocating) events
    /// that do not fit one batch: more than 4 GiB of them, or more than
    /// 2^32 - 1.
    pub fn try_gather<'a>(
        events: impl ExactSizeIterator<Item = (&'a Batch, usize)> + Clone,
    ) -> Result<Batch> {
        let n = events.len();
        let kept = events.clone().filter(|(b, i)| b.carries(*i)).count();
        let mut payload_len = array_header_len(kept) as u64;
        for (batch, i) in events.clone() {
            payload_len += batch.record(i).len as u64;
        }
        check_fits(n as u64, payload_len)?;
        let payload_len = payload_len as usize;
        let mut out = Vec::with_capacity(HEADER_LEN + n * RECORD_LEN + payload_len);
        out.resize(HEADER_LEN, 0);
        let mut offset = array_header_len(kept);
        for (batch, i) in events.clone() {
            let rec = batch.record(i);
            let info = schema::EventInfo {
                kind: rec.kind,
                group_idx: rec.group_idx,
                tokens_end: rec.tokens_end,
            };
            push_record(
                &mut out,
                rec.identity,
                info,
                rec.carried,
                offset,
                rec.len as usize,
            );
            offset += rec.len as usize;
        }
        msgpack::write_array_header(&mut out, kept);
        for (batch, i) in events {
            if let Some(bytes) = batch.event_bytes(i) {
                out.extend_from_slice(bytes);
            }
        }
        finish_header(&mut out, n, payload_len)?;
        Ok(Batch::from_own_vec(out, n, n - kept))
    }

    /// This batch with the bytes it does not carry taken from `sources` (any event
    /// of the same identity: equal identities, equal bytes).
    /// `Err(FillError::Missing(i))`: event `i`'s bytes are in none of them.
    pub fn filled(&self, sources: &[&Batch]) -> std::result::Result<Batch, FillError> {
        let mut carried: IdentityMap<(&Batch, usize)> = IdentityMap::default();
        for &b in sources.iter().chain([&self]) {
            for i in (0..b.len()).filter(|&i| b.carries(i)) {
                carried.entry(b.identity(i)).or_insert((b, i));
            }
        }
        let picks = (0..self.len())
            .map(|i| {
                carried
                    .get(&self.identity(i))
                    .copied()
                    .ok_or(FillError::Missing(i))
            })
            .collect::<std::result::Result<Vec<_>, FillError>>()?;
        Batch::try_gather(picks.into_iter()).map_err(FillError::TooLarge)
    }

    pub fn empty() -> Batch {
        Batch::encode(&[0x90]).expect("the empty list is a valid batch")
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: see `Backing`; `ptr`/`nbytes` came from `backing`, alive with self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.nbytes) }
    }

    pub fn len(&self) -> usize {
        self.n_events
    }

    pub fn is_empty(&self) -> bool {
        self.n_events == 0
    }

    /// How many events' bytes this batch does not carry (another rank
    /// carries them).
    pub fn uncarried(&self) -> usize {
        self.n_uncarried
    }

    /// Whether this batch carries event `i`'s bytes.
    pub fn carries(&self, i: usize) -> bool {
        self.bytes()[HEADER_LEN + i * RECORD_LEN + 25] & UNCARRIED == 0
    }

    /// The msgpack array of the events whose bytes are here (all of them
    /// unless `uncarried() > 0`), as msgspec would decode it.
    pub fn payload(&self) -> &[u8] {
        &self.bytes()[self.payload_start()..]
    }

    /// The bytes of the events carried here: the payload without its array
    /// header. What this batch can contribute to a merged output.
    pub fn carried_len(&self) -> usize {
        let payload = self.payload();
        let header = match payload.first() {
            Some(0xdc) => 3,
            Some(0xdd) => 5,
            _ => 1,
        };
        payload.len().saturating_sub(header)
    }

    pub fn payload_start(&self) -> usize {
        HEADER_LEN + self.n_events * RECORD_LEN
    }

    pub fn record(&self, i: usize) -> Record {
        let at = HEADER_LEN + i * RECORD_LEN;
        let r = &self.bytes()[at..at + RECORD_LEN];
        let mut identity = [0u8; 16];
        identity.copy_from_slice(&r[..16]);
        Record {
            identity: Identity(identity),
            kind: EventKind::from_u8(r[24]).expect("validated"),
            group_idx: (r[25] & HAS_GROUP != 0)
                .then(|| i64::from_le_bytes(r[32..40].try_into().expect("8 bytes"))),
            carried: r[25] & UNCARRIED == 0,
            tokens_end: u32_at(r, 28),
            offset: u32_at(r, 16),
            len: u32_at(r, 20),
        }
    }

    /// Only the identity: the merger's hot loops need nothing else.
    pub fn identity(&self, i: usize) -> Identity {
        let at = HEADER_LEN + i * RECORD_LEN;
        let mut identity = [0u8; 16];
        identity.copy_from_slice(&self.bytes()[at..at + 16]);
        Identity(identity)
    }

    pub fn kind(&self, i: usize) -> EventKind {
        EventKind::from_u8(self.bytes()[HEADER_LEN + i * RECORD_LEN + 24]).expect("validated")
    }

    /// Where event `i`'s `token_ids` end (`EventInfo::tokens_end`).
    pub fn tokens_end(&self, i: usize) -> u32 {
        u32_at(self.bytes(), HEADER_LEN + i * RECORD_LEN + 28)
    }

    /// The msgpack encoding of event `i`, None if this batch does not carry it.
    pub fn event_bytes(&self, i: usize) -> Option<&[u8]> {
        self.event_range(i).map(|r| &self.bytes()[r])
    }

    /// Byte range of event `i` within `bytes()`, None if not carried.
    pub fn event_range(&self, i: usize) -> Option<std::ops::Range<usize>> {
        let rec = self.record(i);
        if !rec.carried {
            return None;
        }
        let start = self.payload_start() + rec.offset as usize;
        Some(start..start + rec.len as usize)
    }

    pub fn identities(&self) -> impl Iterator<Item = Identity> + '_ {
        (0..self.n_events).map(|i| self.identity(i))
    }

    /// The identity digest its maker wrote (see the module docs).
    pub fn digest(&self) -> u64 {
        u64::from_le_bytes(
            self.bytes()[SUMMED_FROM..HEADER_LEN]
                .try_into()
                .expect("8 bytes"),
        )
    }

    /// Whether `other` holds the same identities in the same order, by
    /// their makers' digests (but for a 64-bit collision): one comparison,
    /// whatever the number of events.
    pub fn alike(&self, other: &Batch) -> bool {
        self.n_events == other.n_events && self.digest() == other.digest()
    }
}

/// Why `Batch::filled` could not fill a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FillError {
    /// Event `i`'s bytes are in none of the sources.
    Missing(usize),
    /// The filled batch would not fit one batch (`Error::TooLarge`).
    TooLarge(Error),
}

/// The most bytes of events one batch holds: its payload (the events and a
/// msgpack array header of at most 5 bytes) has a 32-bit length.
pub const MAX_CARRIED_BYTES: u64 = u32::MAX as u64 - 5;

/// Refuses, as `Error::TooLarge`, `n` events in a payload of `payload_len`
/// bytes that one batch cannot hold (32-bit counts and offsets).
pub fn check_fits(n: u64, payload_len: u64) -> Result<()> {
    if n > u32::MAX as u64 {
        return Err(Error::TooLarge(format!(
            "{n} events exceed one batch's limit of {}",
            u32::MAX
        )));
    }
    if payload_len > u32::MAX as u64 {
        return Err(Error::TooLarge(format!(
            "{payload_len} bytes of events exceed one batch's 4 GiB limit"
        )));
    }
    Ok(())
}

/// Where one event ends in events written back to back, and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub end: usize,
    pub info: schema::EventInfo,
}

fn check_carrier(carrier: Option<(&Carriers, usize)>) -> Result<()> {
    if let Some((carriers, rank)) = carrier {
        carriers.validate()?;
        if rank >= carriers.world_size {
            return Err(Error::RankOutOfRange {
                rank: rank as i64,
                world_size: carriers.world_size,
            });
        }
    }
    Ok(())
}

/// A batch of checked events: each one's record, then the bytes of those
/// `carrier`'s rank carries (all of them without a carrier), contiguous runs
/// copied at once.
fn build(events: &[u8], written: &[Written], carrier: Option<(&Carriers, usize)>) -> Result<Batch> {
    let n = written.len();
    let mut carried = Vec::with_capacity(n);
    let mut kept_len = 0;
    let mut start = 0;
    for w in written {
        let span = &events[start..w.end];
        let identity = Identity::of(span);
        let keep = carrier.is_none_or(|(carriers, rank)| {
            carriers.carries(rank, &identity, w.info.kind, w.info.group_idx)
        });
        if keep {
            kept_len += span.len();
        }
        carried.push((identity, keep));
        start = w.end;
    }
    let kept = carried.iter().filter(|(_, keep)| *keep).count();
    let header = array_header_len(kept);
    let mut out = Vec::with_capacity(HEADER_LEN + n * RECORD_LEN + header + kept_len);
    out.resize(HEADER_LEN, 0);
    let (mut start, mut offset) = (0, header);
    for (w, &(identity, keep)) in written.iter().zip(&carried) {
        let len = if keep { w.end - start } else { 0 };
        push_record(&mut out, identity, w.info, keep, offset, len);
        offset += len;
        start = w.end;
    }
    msgpack::write_array_header(&mut out, kept);
    let mut run: Option<std::ops::Range<usize>> = None;
    let mut start = 0;
    for (w, &(_, keep)) in written.iter().zip(&carried) {
        if keep {
            run = match run {
                Some(r) if r.end == start => Some(r.start..w.end),
                Some(r) => {
                    out.extend_from_slice(&events[r]);
                    Some(start..w.end)
                }
                None => Some(start..w.end),
            };
        }
        start = w.end;
    }
    if let Some(r) = run {
        out.extend_from_slice(&events[r]);
    }
    let payload_len = header + kept_len;
    finish_header(&mut out, n, payload_len)?;
    Ok(Batch::from_own_vec(out, n, n - kept))
}

fn array_header_len(n: usize) -> usize {
    if n < 16 {
        1
    } else if n <= u16::MAX as usize {
        3
    } else {
        5
    }
}

fn push_record(
    out: &mut Vec<u8>,
    identity: Identity,
    info: schema::EventInfo,
    carried: bool,
    offset: usize,
    len: usize,
) {
    let mut flags = if info.group_idx.is_some() {
        HAS_GROUP
    } else {
        0
    };
    if !carried {
        flags |= UNCARRIED;
    }
    out.extend_from_slice(&identity.0);
    out.extend_from_slice(&(offset as u32).to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(info.kind as u8);
    out.push(flags);
    out.extend_from_slice(&[0u8; 2]);
    out.extend_from_slice(&info.tokens_end.to_le_bytes());
    out.extend_from_slice(&info.group_idx.unwrap_or(0).to_le_bytes());
}

fn finish_header(out: &mut [u8], n: usize, payload_len: usize) -> Result<()> {
    let n32 = u32::try_from(n)
        .map_err(|_| Error::InvalidPayload(format!("{n} events exceed one batch's limit")))?;
    let len32 = u32::try_from(payload_len).map_err(|_| {
        Error::InvalidPayload(format!(
            "{payload_len} bytes exceed one batch's 4 GiB limit"
        ))
    })?;
    out[..4].copy_from_slice(MAGIC);
    out[4] = VERSION;
    out[8..12].copy_from_slice(&n32.to_le_bytes());
    out[12..16].copy_from_slice(&len32.to_le_bytes());
    let digest = identity_digest(&out[HEADER_LEN..HEADER_LEN + n * RECORD_LEN]);
    out[SUMMED_FROM..HEADER_LEN].copy_from_slice(&digest.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&out[SUMMED_FROM..]);
    out[16..24].copy_from_slice(&sum.to_le_bytes());
    Ok(())
}

/// XXH3-64 of the identities of `records`, in order.
fn identity_digest(records: &[u8]) -> u64 {
    let mut ids = Vec::with_capacity(records.len() / RECORD_LEN * 16);
    for record in records.chunks_exact(RECORD_LEN) {
        ids.extend_from_slice(&record[..16]);
    }
    xxhash_rust::xxh3::xxh3_64(&ids)
}

/// Checks everything the merger and the output path rely on; returns the
/// number of events and how many of them the batch does not carry.
fn validate(b: &[u8]) -> Result<(usize, usize)> {
    if b.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
            b.len()
        )));
    }
    if &b[..4] != MAGIC {
        return Err(corrupt("not a kvmerge batch (bad magic bytes)"));
    }
    if b[4] != VERSION {
        return Err(corrupt(format!(
            "format version {} is not supported (this build reads version {VERSION})",
            b[4]
        )));
    }
    if b[5..8] != [0, 0, 0] {
        return Err(corrupt("reserved header bytes are not zero"));
    }
    let n = u32_at(b, 8) as usize;
    let payload_len = u32_at(b, 12) as usize;
    let expected = HEADER_LEN as u64 + n as u64 * RECORD_LEN as u64 + payload_len as u64;
    if (b.len() as u64) < expected {
        return Err(corrupt(format!(
            "truncated: {} bytes, the header announces {expected}",
            b.len()
        )));
    }
    if b.len() as u64 > expected {
        return Err(corrupt(format!(
            "{} bytes of trailing data after the announced {expected}",
            b.len() as u64 - expected
        )));
    }
    let stored = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
    if xxhash_rust::xxh3::xxh3_64(&b[SUMMED_FROM..]) != stored {
        return Err(corrupt(
            "checksum mismatch: the buffer was altered or damaged",
        ));
    }
    let payload = &b[HEADER_LEN + n * RECORD_LEN..];
    let mut head = Reader::new(payload);
    let count = head
        .read_array_len()
        .map_err(|e| corrupt(format!("payload: {e}")))?;
    // Spans must tile the payload in order: then every event's bytes are
    // inside the buffer and none overlap. Uncarried events take no bytes.
    let mut next = head.pos();
    let mut uncarried = 0;
    for i in 0..n {
        let r = &b[HEADER_LEN + i * RECORD_LEN..HEADER_LEN + (i + 1) * RECORD_LEN];
        if EventKind::from_u8(r[24]).is_none()
            || r[25] & !(HAS_GROUP | UNCARRIED) != 0
            || r[26..28] != [0; 2]
        {
            return Err(corrupt(format!("record {i} is malformed")));
        }
        let (offset, len) = (u32_at(r, 16) as usize, u32_at(r, 20) as usize);
        let carried = r[25] & UNCARRIED == 0;
        if offset != next || (len == 0) == carried || offset + len > payload.len() {
            return Err(corrupt(format!("record {i} points outside its event")));
        }
        uncarried += usize::from(!carried);
        next = offset + len;
    }
    if count != n - uncarried {
        return Err(corrupt(format!(
            "payload holds {count} events, the records announce {}",
            n - uncarried
        )));
    }
    if next != payload.len() {
        return Err(corrupt("event records do not cover the payload"));
    }
    Ok((n, uncarried))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `{"type": "AllBlocksCleared"}` as msgspec writes it.
    pub(crate) fn clear_event() -> Vec<u8> {
        let mut v = vec![0x81, 0xa4];
        v.extend_from_slice(b"type");
        v.push(0xa0 | 16);
        v.extend_from_slice(b"AllBlocksCleared");
        v
    }

    #[test]
    fn encode_then_validate_round_trips() {
        let mut payload = vec![0x92];
        payload.extend(clear_event());
        payload.extend(clear_event());
        let b = Batch::encode(&payload).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b.payload(), &payload[..]);
        assert_eq!(b.identity(0), b.identity(1));
        assert_eq!(b.kind(1), EventKind::AllBlocksCleared);
        let again = Batch::from_vec(b.bytes().to_vec()).unwrap();
        assert_eq!(again.event_bytes(1), Some(&clear_event()[..]));
    }

    #[test]
    fn every_truncation_and_flip_is_rejected() {
        let mut payload = vec![0x91];
        payload.extend(clear_event());
        let good = Batch::encode(&payload).unwrap().bytes().to_vec();
        for cut in 0..good.len() {
            assert!(matches!(
                Batch::from_vec(good[..cut].to_vec()),
                Err(Error::CorruptBatch(_))
            ));
        }
        for at in 0..good.len() {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            assert!(
                matches!(Batch::from_vec(bad), Err(Error::CorruptBatch(_))),
                "flip at {at}"
            );
        }
    }

    #[test]
    fn the_digest_is_the_identities_in_order_whatever_a_rank_carries() {
        use crate::rule::Rule;
        use crate::testing::{payload, removed, stored};
        let evs = [
            stored(1, Some(0)),
            removed(2),
            clear_event(),
            stored(3, None),
        ];
        let carriers = Carriers::new(4, Rule::All);
        let whole = Batch::encode(&payload(&evs)).unwrap();
        for r in 0..4 {
            let lean = Batch::encode_for(&payload(&evs), Some((&carriers, r))).unwrap();
            assert!(lean.uncarried() > 0, "rank {r} leaves bytes to others");
            assert_eq!(lean.digest(), whole.digest());
            assert!(lean.alike(&whole));
        }
        let swapped = [
            removed(2),
            stored(1, Some(0)),
            clear_event(),
            stored(3, None),
        ];
        let other = [
            stored(1, Some(0)),
            removed(2),
            clear_event(),
            stored(4, None),
        ];
        let fewer = &evs[..3];
        for evs in [&swapped[..], &other[..], fewer] {
            let b = Batch::encode(&payload(evs)).unwrap();
            assert!(!b.alike(&whole));
        }
        // Gathered and filled batches carry the digest of what they hold.
        let gathered = Batch::gather((0..whole.len()).map(|i| (&whole, i)));
        assert!(gathered.alike(&whole));
        assert_eq!(
            Batch::empty().digest(),
            Batch::encode(&[0x90]).unwrap().digest()
        );
        // The digest is checked in transit: a flip in it is damage.
        let mut bytes = whole.bytes().to_vec();
        bytes[SUMMED_FROM] ^= 1;
        assert!(matches!(
            Batch::from_vec(bytes),
            Err(Error::CorruptBatch(_))
        ));
    }

    #[test]
    fn gather_keeps_bytes_and_identities() {
        let mut payload = vec![0x91];
        payload.extend(clear_event());
        let a = Batch::encode(&payload).unwrap();
        let g = Batch::gather([(&a, 0), (&a, 0)].into_iter());
        assert_eq!(g.len(), 2);
        assert_eq!(g.identity(1), a.identity(0));
        assert_eq!(g.event_bytes(1), a.event_bytes(0));
        assert!(g.event_bytes(1).is_some());
    }

    #[test]
    fn uncarried_bytes_keep_their_records() {
        use crate::carriers::Carriers;
        use crate::rule::Rule;
        use crate::testing::{payload, removed};
        let evs: Vec<_> = (0..40).map(removed).collect();
        let full = Batch::encode(&payload(&evs)).unwrap();
        let carriers = Carriers::new(4, Rule::All);
        let mut carried = vec![0; 40];
        for rank in 0..4 {
            let lean = Batch::encode_for(&payload(&evs), Some((&carriers, rank))).unwrap();
            let again = Batch::from_vec(lean.bytes().to_vec()).unwrap();
            assert_eq!(again.uncarried(), lean.uncarried());
            assert!(lean.uncarried() > 0 && lean.bytes().len() < full.bytes().len());
            for (i, count) in carried.iter_mut().enumerate() {
                assert_eq!(lean.identity(i), full.identity(i));
                match lean.event_bytes(i) {
                    Some(bytes) => {
                        assert_eq!(Some(bytes), full.event_bytes(i));
                        *count += 1;
                    }
                    None => assert!(!lean.record(i).carried),
                }
            }
            // The other ranks' batches hold the rest.
            let others: Vec<Batch> = (0..4)
                .map(|r| Batch::encode_for(&payload(&evs), Some((&carriers, r))).unwrap())
                .collect();
            let refs: Vec<&Batch> = others.iter().collect();
            let filled = lean.filled(&refs).unwrap();
            assert_eq!((filled.uncarried(), filled.payload()), (0, full.payload()));
            assert_eq!(
                lean.filled(&[]).err(),
                (0..40).find(|&i| !lean.carries(i)).map(FillError::Missing)
            );
            // Gathering keeps both kinds of records.
            let g = Batch::gather((0..40).rev().map(|i| (&lean, i)));
            assert_eq!(g.uncarried(), lean.uncarried());
            assert_eq!(g.event_bytes(0), lean.event_bytes(39));
        }
        assert_eq!(
            carried,
            vec![1; 40],
            "exactly one carrier per event under \"all\""
        );
    }

    /// The events back to back and where each ends, as a writer gives them.
    fn written(evs: &[Vec<u8>]) -> (Vec<u8>, Vec<Written>) {
        let mut events = Vec::new();
        let mut written = Vec::new();
        for e in evs {
            events.extend_from_slice(e);
            let info = schema::read_event(&mut Reader::new(e)).unwrap();
            written.push(Written {
                end: events.len(),
                info,
            });
        }
        (events, written)
    }

    #[test]
    fn written_events_make_the_batch_their_payload_makes() {
        use crate::carriers::Carriers;
        use crate::rule::Rule;
        use crate::testing::{payload, removed, stored};
        // 40 events: an array16 header, 10 or so carried: a fixarray one.
        let evs: Vec<_> = (0..40)
            .map(|i| {
                if i % 3 == 0 {
                    stored(i, Some(i % 2))
                } else {
                    removed(i)
                }
            })
            .collect();
        let (events, w) = written(&evs);
        let carriers = Carriers::new(4, Rule::All);
        for carrier in [None, Some((&carriers, 0)), Some((&carriers, 3))] {
            let want = Batch::encode_for(&payload(&evs), carrier).unwrap();
            let got = Batch::encode_written(&events, &w, carrier).unwrap();
            assert_eq!(got.bytes(), want.bytes());
        }
        let empty = Batch::encode_written(&[], &[], Some((&carriers, 1))).unwrap();
        assert_eq!(empty.bytes(), Batch::encode(&[0x90]).unwrap().bytes());
        assert!(matches!(
            Batch::encode_written(&events, &w, Some((&carriers, 4))),
            Err(Error::RankOutOfRange { rank: 4, .. })
        ));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "an event ends where the writer says")]
    fn a_writer_that_misplaces_an_end_is_caught_in_debug_builds() {
        let (events, mut w) = written(&[clear_event(), clear_event()]);
        w[0].end += 1;
        let _ = Batch::encode_written(&events, &w, None);
    }

    #[test]
    fn rejects_events_of_the_wrong_shape() {
        // [{"type": "Nope"}]
        let mut payload = vec![0x91, 0x81, 0xa4];
        payload.extend_from_slice(b"type");
        payload.push(0xa4);
        payload.extend_from_slice(b"Nope");
        assert!(matches!(
            Batch::encode(&payload),
            Err(Error::InvalidEvent { index: 0, .. })
        ));
        assert!(matches!(
            Batch::encode(&[0x05]),
            Err(Error::InvalidPayload(_))
        ));
    }
}
