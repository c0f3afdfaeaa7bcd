//! The common case under "all" and "quorum": nothing pending and every rank
//! reported the same identities in the same order. The segment rules then
//! reduce to a single pass over one batch; `tests` checks that they agree.
//!
//! Whether the ranks agree is one comparison per rank: of the identity
//! digests their workers wrote (`Batch::digest`). So a healthy step costs
//! one rank's events, not every rank's: each published event's bytes are
//! taken from its first carrier, found from its identity.

use std::sync::Arc;

use super::published::Published;
use super::state::Merger;
use crate::batch::Batch;
use crate::carriers::Carriers;
use crate::identity::IdentitySet;
use crate::rule::Rule;
use crate::schema::EventKind;

/// The step's output, when nothing is pending and every rank's batch has
/// the same digest; None (nothing changed) otherwise, and where a batch
/// agrees by digest but carries none of an event's bytes (a batch forged
/// past its checksum: the general path refuses nothing it should publish).
pub(super) fn finish(m: &mut Merger) -> Option<Published> {
    if !applies(m) {
        return None;
    }
    let w = m.cfg.carriers.world_size;
    let last = m.incoming[w - 1].clone().expect("applies() checked");
    // Every report completes, in order: the output is the batch itself.
    let out = if m.cfg.carriers.rule == Rule::All && last.uncarried() == 0 {
        Published::whole(&last)
    } else {
        let batches: Vec<&Arc<Batch>> = m.incoming.iter().flatten().collect();
        let rule = m.cfg.carriers.rule;
        let indices = published(rule, &last, &mut m.scratch);
        carried(&m.cfg.carriers, &batches, indices)?
    };
    m.stats.consumed += (w * last.len()) as u64;
    Some(out)
}

fn applies(m: &Merger) -> bool {
    let Some(Some(first)) = m.incoming.first() else {
        return false;
    };
    m.live == 0
        && m.incoming
            .iter()
            .all(|b| b.as_ref().is_some_and(|b| b.alike(first)))
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
/// rank), each taken from its first carrier (`Carriers::first`), or the
/// next rank round that carries it: None if none does.
pub(super) fn carried(
    carriers: &Carriers,
    batches: &[&Arc<Batch>],
    indices: Vec<usize>,
) -> Option<Published> {
    let last = batches[batches.len() - 1];
    let picks = indices
        .into_iter()
        .map(|i| {
            let (after, before) = batches.split_at(carriers.first(&last.identity(i)));
            before
                .iter()
                .chain(after)
                .find(|b| b.carries(i))
                .map(|&b| (b.clone(), i as u32))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Published::new(picks))
}
