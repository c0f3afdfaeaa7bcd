//! The guard (docs/merge-rules.md, "Guard"): after the rule, withholds each
//! published event a router could not apply to what the stream published
//! before it, so that every published stream stays valid whatever the
//! ranks report.
//!
//! Only the events the rule publishes are read, and only their block
//! hashes, parent and medium; a merger without a guard has none of this.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use super::published::Published;
use super::stats::Stats;
use crate::batch::Batch;
use crate::identity::PassThrough;
use crate::schema::{read_blocks, BlockHash, Blocks, EventKind};

/// A block hash as the guard keeps it, in 16 bytes: an int (64 bits and a
/// sign at most, as msgpack holds it) offset into `[0, 2^65)`, a bytes
/// hash as its XXH3-128 with the top bit set. So an int and a bytes are
/// never the same key; two bytes hashes are only on a 127-bit collision
/// (docs/merge-rules.md, "Identity", weighs such odds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key(u128);

const BYTES_TAG: u128 = 1 << 127;

impl Key {
    fn of(h: BlockHash<'_>) -> Key {
        match h {
            BlockHash::Int(v) => Key(v.wrapping_add(1 << 64) as u128),
            BlockHash::Bytes(b) => Key(xxhash_rust::xxh3::xxh3_128(b) | BYTES_TAG),
        }
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Ints may be small and dense: a folded multiply spreads every bit
        // over the table's index and control bits.
        let x = (self.0 as u64) ^ ((self.0 >> 64) as u64).rotate_left(32);
        let p = (x as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        state.write_u64((p as u64) ^ ((p >> 64) as u64));
    }
}

type KeySet = HashSet<Key, BuildHasherDefault<PassThrough>>;

/// Why an event was withheld.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    Orphan,
    Duplicate,
    Unknown,
}

/// The blocks each medium holds, as the published stream says.
#[derive(Default)]
pub(super) struct Guard {
    /// Per medium (its name's bytes; None is its own medium), the held
    /// blocks. A child reports to a handful of media: a list beats a map.
    media: Vec<(Option<Box<[u8]>>, KeySet)>,
    /// One event's keys (kept for its capacity).
    keys: Vec<Key>,
}

impl Guard {
    /// Drops what the rule published but the guard withholds, counting it.
    pub(super) fn filter(&mut self, out: &mut Published, stats: &mut Stats) {
        out.retain(|batch, i| match self.apply(batch, i) {
            Ok(()) => true,
            Err(why) => {
                match why {
                    Why::Orphan => stats.withheld_orphan += 1,
                    Why::Duplicate => stats.withheld_duplicate += 1,
                    Why::Unknown => stats.withheld_unknown += 1,
                }
                false
            }
        });
    }

    pub(super) fn clear(&mut self) {
        self.media.iter_mut().for_each(|(_, set)| set.clear());
    }

    /// Applies event `i` of `batch` if a router can: else says why not, and
    /// nothing changes.
    fn apply(&mut self, batch: &Batch, i: usize) -> Result<(), Why> {
        let kind = batch.kind(i);
        if kind == EventKind::AllBlocksCleared {
            self.clear();
            return Ok(());
        }
        // A published event is carried, and its bytes were checked against
        // the schema where its batch was made (`read_event`, or the
        // binding's writer, which writes only events of that shape) and kept
        // so in transit by the batch's checksum: they always read. A batch
        // crafted to pass the checksum could hold bytes that do not; such an
        // event goes out as the rule published it, and the guard's state is
        // unchanged.
        let tokens_end = batch.tokens_end(i);
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        let read = batch
            .event_bytes(i)
            .and_then(|e| read_blocks(e, tokens_end, |h| keys.push(Key::of(h))));
        let Some(blocks) = read else {
            self.keys = keys;
            return Ok(());
        };
        let parent = blocks.parent.map(Key::of);
        let held = self.medium(&blocks);
        let done = match kind {
            EventKind::BlockStored => store(held, parent, &keys),
            _ => remove(held, &keys),
        };
        self.keys = keys;
        done
    }

    fn medium(&mut self, blocks: &Blocks<'_>) -> &mut KeySet {
        let at = match self
            .media
            .iter()
            .position(|(m, _)| m.as_deref() == blocks.medium)
        {
            Some(at) => at,
            None => {
                let name = blocks.medium.map(Box::<[u8]>::from);
                self.media.push((name, KeySet::default()));
                self.media.len() - 1
            }
        };
        &mut self.media[at].1
    }
}

/// A store: its parent must be held, its blocks not (nor twice in it).
fn store(held: &mut KeySet, parent: Option<Key>, keys: &[Key]) -> Result<(), Why> {
    if parent.is_some_and(|p| !held.contains(&p)) {
        return Err(Why::Orphan);
    }
    // Inserting tells both cases apart in one probe per block; a refused
    // insert takes back the ones before it.
    for (n, k) in keys.iter().enumerate() {
        if !held.insert(*k) {
            keys[..n].iter().for_each(|k| {
                held.remove(k);
            });
            return Err(Why::Duplicate);
        }
    }
    Ok(())
}

/// A removal: each of its blocks must be held, and named once.
fn remove(held: &mut KeySet, keys: &[Key]) -> Result<(), Why> {
    for (n, k) in keys.iter().enumerate() {
        if !held.remove(k) {
            held.extend(keys[..n].iter().copied());
            return Err(Why::Unknown);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
