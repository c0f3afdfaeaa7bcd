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
    // Every report completes, in order: the output is the batch itself.
    if m.cfg.carriers.rule == Rule::All && last.uncarried() == 0 {
        return Published::whole(&last);
    }
    let batches: Vec<&Arc<Batch>> = m.incoming.iter().flatten().collect();
    let rule = m.cfg.carriers.rule;
    carried(&batches, published(rule, &last, &mut m.scratch))
}

/// The indices of the events of a sequence every rank reported alike that
/// the rule publishes: every one under "all"; under "quorum" each
/// identity's first in its segment (between clears). `seen` is the
/// merger's scratch set (left empty): a set grown from nothing each step
/// was most of this pass's cost at decode-size steps. A set a far larger
/// step left behind is shrunk first, since clearing it costs its capacity.
pub(super) fn published(rule: Rule, batch: &Batch, seen: &mut IdentitySet) -> Vec<usize> {
    match rule {
        Rule::All => (0..batch.len()).collect(),
        Rule::Quorum => {
            seen.clear();
            if seen.capacity() > 8 * batch.len() + 1024 {
                seen.shrink_to(batch.len());
            }
            let out = (0..batch.len())
                .filter(|&i| {
                    if batch.kind(i) == EventKind::AllBlocksCleared {
                        seen.clear();
                        true
                    } else {
                        seen.insert(batch.identity(i))
                    }
                })
                .collect();
            seen.clear();
            out
        }
        Rule::Any => unreachable!("rule \"any\" has its own pass"),
    }
}

/// The events at `indices` (equal in every batch of `batches`, one per
/// rank), each taken from the first batch that carries its bytes;
/// `check_carriers` guarantees there is one.
pub(super) fn carried(batches: &[&Arc<Batch>], indices: Vec<usize>) -> Published {
    Published::new(
        indices
            .into_iter()
            .map(|i| {
                let carrier = batches.iter().find(|b| b.carries(i)).unwrap_or(&batches[0]);
                ((*carrier).clone(), i as u32)
            })
            .collect(),
    )
}
