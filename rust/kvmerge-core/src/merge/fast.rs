//! The common case under "all" and "quorum": nothing pending and every rank
//! reported the same identities in the same order. The segment rules then
//! reduce to a single pass over one batch; `tests` checks that they agree.

use std::sync::Arc;

use super::published::Published;
use super::state::Merger;
use crate::batch::Batch;
use crate::identity::IdentitySet;
use crate::rule::Rule;
use crate::schema::EventKind;

pub(super) fn applies(m: &Merger) -> bool {
    let Some(Some(first)) = m.incoming.first() else {
        return false;
    };
    m.live == 0
        && m.incoming
            .iter()
            .all(|b| b.as_ref().is_some_and(|b| b.identity_column_eq(first)))
}

pub(super) fn finish(m: &mut Merger) -> Published {
    let w = m.cfg.carriers.world_size;
    let last = m.incoming[w - 1].clone().expect("applies() checked");
    m.stats.consumed += (w * last.len()) as u64;
    match m.cfg.carriers.rule {
        // Every report completes, in order: the output is the batch itself.
        Rule::All if last.uncarried() == 0 => Published::whole(&last),
        Rule::All => carried(m, 0..last.len()),
        Rule::Quorum => {
            let mut seen = IdentitySet::default();
            let keep = (0..last.len()).filter(|&i| {
                if last.kind(i) == EventKind::AllBlocksCleared {
                    seen.clear();
                    true
                } else {
                    seen.insert(last.identity(i))
                }
            });
            carried(m, keep)
        }
        Rule::Any => unreachable!("rule \"any\" has its own pass"),
    }
}

/// The events at `indices` (equal on every rank), each taken from a rank
/// whose batch carries its bytes; `check_carriers` guarantees there is one.
fn carried(m: &Merger, indices: impl Iterator<Item = usize>) -> Published {
    let batches: Vec<&Arc<Batch>> = m.incoming.iter().flatten().collect();
    Published::new(
        indices
            .map(|i| {
                let carrier = batches.iter().find(|b| b.carries(i)).unwrap_or(&batches[0]);
                ((*carrier).clone(), i as u32)
            })
            .collect(),
    )
}
