//! A rank late or silent, without a queued report per event (issue 14).
//!
//! Under "all", and "quorum" while every report needs every rank, a step
//! where some ranks report nothing and the others the same identities
//! (`hold`), or where the ranks that reported nothing last step now report
//! what the others did (`complete`), needs no queue: the waiting batches
//! are held whole, one per rank, and completed as `fast` completes a step.
//! While the ranks that reported nothing go on reporting nothing, and the
//! others identical batches (`hold_more`: a rank silent for many steps),
//! each step's batches are held too, and a step's batches expire whole
//! `max_pending_steps` steps later (`Merger::expire_held`), as their reports
//! would: nothing can complete without the silent ranks.
//! A held batch stands for exactly the queue the general path would have
//! built from it (every report, at its step, in order); any other step
//! queues the held batches first (`Merger::expand_held`), and `tests`
//! checks that both paths publish the same and count the same.
//!
//! What makes that hold: each step's held batches are identical (by
//! identity) and have no clear, so the queues are prefixes of one sequence
//! (prefix mode) with no fence; nothing else is pending; and with
//! `max_pending_steps >= 1` nothing held expires in the step that holds it.

use std::sync::Arc;

use super::fast;
use super::published::Published;
use super::state::Merger;
use crate::batch::Batch;
use crate::identity::IdentitySet;
use crate::rule::Rule;
use crate::schema::EventKind;

/// Holds or completes the step's batches, if the step is one of the shapes
/// above; None (nothing changed) otherwise.
pub(super) fn finish(m: &mut Merger) -> Option<Published> {
    #[cfg(test)]
    if m.index_only {
        return None;
    }
    if m.indexed || m.cfg.carriers.rule == Rule::Any || m.cfg.max_pending_steps == 0 {
        return None;
    }
    if m.live == 0 {
        return hold(m);
    }
    // Both shapes with something pending need all of it held.
    if m.queues.iter().any(|q| !q.nodes.is_empty()) {
        return None;
    }
    let w = m.cfg.carriers.world_size;
    let holding: Vec<usize> = (0..w).filter(|&r| !m.held[r].is_empty()).collect();
    complete(m, &holding).or_else(|| hold_more(m, &holding))
}

/// Nothing pending, some ranks silent or with nothing to report (an empty
/// batch queues nothing either), the others identical: hold those.
fn hold(m: &mut Merger) -> Option<Published> {
    let present: Vec<usize> = (0..m.incoming.len()).filter(|&r| reports(m, r)).collect();
    if present.is_empty() || present.len() == m.incoming.len() {
        return None;
    }
    hold_alike(m, &present)?;
    Some(Published::new(Vec::new()))
}

/// Every pending report held (by the ranks `held`); the ranks without a
/// held batch report the held identities now, the others each a new batch,
/// all identical: the held events are published and the new batches held.
fn complete(m: &mut Merger, held: &[usize]) -> Option<Published> {
    let w = m.cfg.carriers.world_size;
    let (&first, true) = (held.first()?, held.len() < w) else {
        return None;
    };
    if m.held[first].len() != 1 {
        // Held over several steps: completing one leaves others held.
        return None;
    }
    let h0 = *m.held[first].front().expect("held");
    if h0.step + 1 != m.step {
        return None;
    }
    let pending = m.slots.arc(h0.slot);
    // The late ranks complete the held batches...
    let late_complete = (0..w)
        .filter(|&r| m.held[r].is_empty())
        .all(|r| m.incoming[r].as_ref().is_some_and(|b| b.alike(&pending)));
    if !late_complete {
        return None;
    }
    // ...and the others' new batches can be held in turn.
    let next = m.incoming[first].clone()?;
    let all_new = held
        .iter()
        .all(|&r| m.incoming[r].as_ref().is_some_and(|b| b.alike(&next)));
    if !all_new || (!next.is_empty() && !holdable(m, &next)) {
        return None;
    }
    if m.cfg.carriers.rule == Rule::Quorum {
        // An identity published now whose report recurs in the new batches
        // is consumed with this publication (same segment): the queue would
        // not be the new batch whole.
        let published: IdentitySet = (0..pending.len()).map(|i| pending.identity(i)).collect();
        if (0..next.len()).any(|i| published.contains(&next.identity(i))) {
            return None;
        }
    }
    // The batches every rank reported the held events in, in rank order.
    let batches: Vec<Arc<Batch>> = (0..w)
        .map(|r| match m.held[r].front() {
            Some(h) => m.slots.arc(h.slot),
            None => m.incoming[r].clone().expect("checked above"),
        })
        .collect();
    let rule = m.cfg.carriers.rule;
    let indices = fast::published(rule, &pending, &mut m.scratch);
    let out = fast::carried(
        &m.cfg.carriers,
        &batches.iter().collect::<Vec<_>>(),
        indices,
    )?;
    let n = pending.len() as u64;
    for &r in held {
        let h = m.held[r].pop_front().expect("held");
        m.slots.release_n(h.slot, n as u32);
        m.live -= n;
    }
    m.stats.consumed += w as u64 * n;
    if !next.is_empty() {
        hold_incoming(m, held);
    }
    Some(out)
}

/// Batches held (by the ranks `holding`) and nothing queued; those ranks
/// report identical batches again and the others nothing (or nobody
/// reports anything): those are held too, and the batches of the step
/// `max_pending_steps` ago expire. Nothing completes in such a step: a
/// held event needs every rank, and the ranks without held batches have
/// nothing pending.
fn hold_more(m: &mut Merger, holding: &[usize]) -> Option<Published> {
    let w = m.cfg.carriers.world_size;
    if holding.is_empty() || (0..w).any(|r| m.held[r].is_empty() && reports(m, r)) {
        return None;
    }
    if holding.iter().any(|&r| reports(m, r)) {
        hold_alike(m, holding)?;
    }
    m.expire_held();
    Some(Published::new(Vec::new()))
}

/// Whether rank `r` reports anything this step (an empty batch queues
/// nothing).
fn reports(m: &Merger, r: usize) -> bool {
    m.incoming[r].as_ref().is_some_and(|b| !b.is_empty())
}

/// Holds the incoming batches of `ranks` when each reports the same
/// identities and they can wait whole; None, nothing changed, otherwise.
fn hold_alike(m: &mut Merger, ranks: &[usize]) -> Option<()> {
    let first = m.incoming[*ranks.first()?].clone()?;
    if first.is_empty() || !holdable(m, &first) {
        return None;
    }
    if !ranks
        .iter()
        .all(|&r| m.incoming[r].as_ref().is_some_and(|b| b.alike(&first)))
    {
        return None;
    }
    hold_incoming(m, ranks);
    Some(())
}

/// Holds the incoming batches of `ranks` (each has one).
fn hold_incoming(m: &mut Merger, ranks: &[usize]) {
    for &r in ranks {
        let batch = m.incoming[r].take().expect("checked by the caller");
        m.hold_batch(r, batch);
    }
}

/// A batch that can wait whole: no clear (one segment, with no fence: its
/// events complete together, and under "quorum" each identity once), and
/// under "quorum" every report needs every rank (else one could complete
/// without the late ranks).
fn holdable(m: &Merger, batch: &Batch) -> bool {
    let carriers = &m.cfg.carriers;
    (0..batch.len()).all(|i| {
        let rec = batch.record(i);
        rec.kind != EventKind::AllBlocksCleared
            && carriers.min_reporters(rec.kind, rec.group_idx) == carriers.world_size
    })
}
