//! The guard (docs/merge-rules.md, "Guard"): after the rule, withholds each
//! published event a router could not apply to what the stream published
//! before it, so that every published stream stays valid whatever the
//! ranks report.
//!
//! Only the events the rule publishes are read, and only their block
//! hashes, parent and medium; a merger without a guard has none of this.

use std::ops::Range;

use self::table::{Key, KeyTable};
use super::published::Published;
use super::stats::Stats;
use crate::batch::Batch;
use crate::schema::{read_blocks, EventKind};

mod table;

/// Why an event was withheld.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    Orphan,
    Duplicate,
    Unknown,
}

/// What applying one published event asks of the guard, read before any
/// is applied.
#[derive(Debug)]
enum Op {
    Clear,
    /// Bytes that do not read: published as the rule published them.
    Pass,
    Store {
        medium: usize,
        parent: Option<Key>,
        keys: Range<usize>,
    },
    Remove {
        medium: usize,
        keys: Range<usize>,
    },
}

/// How many events ahead the guard asks for the slots it will probe: far
/// enough for memory to answer while it checks the events between, near
/// enough for the lines to still be in the cache.
const AHEAD: usize = 8;

/// The blocks each medium holds, as the published stream says.
#[derive(Default)]
pub(super) struct Guard {
    /// Per medium (its name's bytes; None is its own medium), the held
    /// blocks. A child reports to a handful of media: a list beats a map.
    media: Vec<(Option<Box<[u8]>>, KeyTable)>,
    /// The step's events as operations, and their keys (kept for their
    /// capacity).
    ops: Vec<Op>,
    keys: Vec<Key>,
}

impl Guard {
    /// Drops what the rule published but the guard withholds, counting it.
    /// Two passes: every event read first, then applied in order, each
    /// asking for the slots of the one `AHEAD` of it.
    pub(super) fn filter(&mut self, out: &mut Published, stats: &mut Stats) {
        self.ops.clear();
        self.keys.clear();
        for (batch, i) in out.iter() {
            let op = self.read(batch, i);
            self.ops.push(op);
        }
        let ops = std::mem::take(&mut self.ops);
        let mut n = 0;
        out.retain(|_, _| {
            if let Some(ahead) = ops.get(n + AHEAD) {
                self.prefetch(ahead);
            }
            let verdict = self.apply(&ops[n]);
            n += 1;
            match verdict {
                Ok(()) => true,
                Err(why) => {
                    match why {
                        Why::Orphan => stats.withheld_orphan += 1,
                        Why::Duplicate => stats.withheld_duplicate += 1,
                        Why::Unknown => stats.withheld_unknown += 1,
                    }
                    false
                }
            }
        });
        self.ops = ops;
    }

    pub(super) fn clear(&mut self) {
        self.media.iter_mut().for_each(|(_, set)| set.clear());
    }

    /// Event `i` of `batch` as an operation, its keys appended to `keys`.
    fn read(&mut self, batch: &Batch, i: usize) -> Op {
        let kind = batch.kind(i);
        if kind == EventKind::AllBlocksCleared {
            return Op::Clear;
        }
        // A published event is carried, and its bytes were checked against
        // the schema where its batch was made (`read_event`, or the
        // binding's writer, which writes only events of that shape) and kept
        // so in transit by the batch's checksum: they always read. A batch
        // crafted to pass the checksum could hold bytes that do not; such an
        // event goes out as the rule published it, and the guard's state is
        // unchanged.
        let first = self.keys.len();
        let keys = &mut self.keys;
        let read = batch
            .event_bytes(i)
            .and_then(|e| read_blocks(e, kind, batch.tokens_end(i), |h| keys.push(Key::of(h))));
        let Some(blocks) = read else {
            self.keys.truncate(first);
            return Op::Pass;
        };
        let medium = self.medium(blocks.medium);
        let keys = first..self.keys.len();
        match kind {
            EventKind::BlockStored => Op::Store {
                medium,
                parent: blocks.parent.map(Key::of),
                keys,
            },
            _ => Op::Remove { medium, keys },
        }
    }

    fn medium(&mut self, name: Option<&[u8]>) -> usize {
        match self.media.iter().position(|(m, _)| m.as_deref() == name) {
            Some(at) => at,
            None => {
                self.media.push((name.map(Box::from), KeyTable::default()));
                self.media.len() - 1
            }
        }
    }

    fn prefetch(&self, op: &Op) {
        let (medium, parent, keys) = match op {
            Op::Store {
                medium,
                parent,
                keys,
            } => (*medium, *parent, keys),
            Op::Remove { medium, keys } => (*medium, None, keys),
            Op::Clear | Op::Pass => return,
        };
        let held = &self.media[medium].1;
        parent.iter().for_each(|&k| held.prefetch(k));
        self.keys[keys.clone()]
            .iter()
            .for_each(|&k| held.prefetch(k));
    }

    /// Applies one operation if a router can: else says why not, and
    /// nothing changes.
    fn apply(&mut self, op: &Op) -> Result<(), Why> {
        match op {
            Op::Clear => {
                self.clear();
                Ok(())
            }
            Op::Pass => Ok(()),
            Op::Store {
                medium,
                parent,
                keys,
            } => store(
                &mut self.media[*medium].1,
                *parent,
                &self.keys[keys.clone()],
            ),
            Op::Remove { medium, keys } => {
                remove(&mut self.media[*medium].1, &self.keys[keys.clone()])
            }
        }
    }
}

/// A store: its parent must be held, its blocks not (nor twice in it).
fn store(held: &mut KeyTable, parent: Option<Key>, keys: &[Key]) -> Result<(), Why> {
    if parent.is_some_and(|p| !held.contains(p)) {
        return Err(Why::Orphan);
    }
    // Inserting tells both cases apart in one probe per block; a refused
    // insert takes back the ones before it.
    for (n, k) in keys.iter().enumerate() {
        if !held.insert(*k) {
            keys[..n].iter().for_each(|k| {
                held.remove(*k);
            });
            return Err(Why::Duplicate);
        }
    }
    Ok(())
}

/// A removal: each of its blocks must be held, and named once.
fn remove(held: &mut KeyTable, keys: &[Key]) -> Result<(), Why> {
    for (n, k) in keys.iter().enumerate() {
        if !held.remove(*k) {
            keys[..n].iter().for_each(|k| {
                held.insert(*k);
            });
            return Err(Why::Unknown);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
