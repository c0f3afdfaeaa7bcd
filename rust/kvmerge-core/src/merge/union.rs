//! Rule "any": the ordered union of one step's reports (docs/merge-rules.md).

use std::sync::Arc;

use super::published::Published;
use super::state::Merger;
use crate::batch::Batch;
use crate::identity::IdentitySet;
use crate::schema::EventKind;

pub(super) fn finish(m: &mut Merger) -> Published {
    let batches: Vec<&Arc<Batch>> = m.incoming.iter().flatten().collect();
    let total: usize = batches.iter().map(|b| b.len()).sum();
    m.stats.consumed += total as u64;
    let Some(&first) = batches.first() else {
        return Published::new(Vec::new());
    };
    // Identical reports collapse onto the first rank's: walk that one alone.
    let walk: Vec<&Arc<Batch>> = if batches.iter().all(|b| b.alike(first)) {
        vec![first]
    } else {
        batches
    };
    let longest = walk.iter().map(|b| b.len()).max().unwrap_or(0);
    let mut seen = IdentitySet::default();
    // Consecutive clears collapse; a clear after anything else is published,
    // or a subscriber would keep what a rank cleared.
    let mut last_was_clear = false;
    let mut out: Vec<(Arc<Batch>, u32)> = Vec::new();
    for i in 0..longest {
        for b in walk.iter().filter(|b| i < b.len()) {
            let publish = if b.kind(i) == EventKind::AllBlocksCleared {
                let publish = !last_was_clear;
                if publish {
                    last_was_clear = true;
                    seen.clear();
                }
                publish
            } else {
                let new = seen.insert(b.identity(i));
                last_was_clear &= !new;
                new
            };
            if publish {
                out.push(((*b).clone(), i as u32));
            }
        }
    }
    Published::new(out)
}
