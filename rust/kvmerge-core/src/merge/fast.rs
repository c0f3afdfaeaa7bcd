//! The common case under "all" and "quorum": nothing pending and every rank
//! reported the same identities in the same order. The segment rules then
//! reduce to a single pass over one batch; `tests` checks that they agree.

use std::sync::Arc;

use super::{Merger, Rule};
use crate::batch::Batch;
use crate::identity::IdentitySet;
use crate::schema::EventKind;

pub(super) fn applies(m: &Merger) -> bool {
    let Some(Some(first)) = m.incoming.first() else {
        return false;
    };
    m.queues.iter().all(|q| q.is_empty())
        && m.incoming
            .iter()
            .all(|b| b.as_ref().is_some_and(|b| b.identity_column_eq(first)))
}

pub(super) fn finish(m: &mut Merger) -> Arc<Batch> {
    let w = m.cfg.world_size;
    let last = m.incoming[w - 1].clone().expect("applies() checked");
    m.stats.consumed += (w * last.len()) as u64;
    match m.cfg.rule {
        // Every report completes, in order: the output is the batch itself.
        Rule::All => last,
        Rule::Quorum => {
            let mut seen = IdentitySet::default();
            let keep: Vec<usize> = (0..last.len())
                .filter(|&i| {
                    if last.kind(i) == EventKind::AllBlocksCleared {
                        seen.clear();
                        true
                    } else {
                        seen.insert(last.identity(i))
                    }
                })
                .collect();
            if keep.len() == last.len() {
                return last;
            }
            Arc::new(Batch::gather(keep.iter().map(|&i| (&*last, i))))
        }
        Rule::Any => unreachable!("rule \"any\" has its own pass"),
    }
}
