//! Rules "all" and "quorum": segments between clears, completions among the
//! reports before each rank's fence (docs/merge-rules.md).
//!
//! Incremental: at the end of every step no identity among the eligible
//! reports is complete (each segment publishes everything it can, and
//! expiry only removes reports), so a step checks only the identities whose
//! eligible reports grew: its new reports, and those a consumed or expired
//! fence made eligible. A step costs what it adds, uses, clears and
//! expires, not what stays pending.

use super::pending::{Index, Queue};
use super::prefix;
use super::published::Published;
use super::report::{Position, Publication};
use super::slots::Released;
use super::state::Merger;
use crate::rule::Rule;

pub(super) fn finish(m: &mut Merger) -> Published {
    let mut pubs = Vec::new();
    // Slots are released only after the output is gathered from them.
    let mut released = Released::default();
    m.expand_held();
    let before: Vec<u64> = m.queues.iter().map(Queue::end).collect();
    m.enqueue_incoming();
    if !m.indexed {
        let old: Vec<usize> = (m.queues.iter().zip(&before))
            .map(|(q, &end)| (end - q.base) as usize)
            .collect();
        if prefix::compatible(&m.queues, &old, m.cfg.carriers.rule)
            && prefix::finish(m, &mut pubs, &mut released)
        {
            return m.output(&pubs, released);
        }
        m.index_all();
    } else {
        let Merger { queues, index, .. } = m;
        for (r, &from) in before.iter().enumerate() {
            let to = queues[r].eligible_end();
            if from < to {
                index.link_range(queues, r, from, to);
            }
        }
    }
    run_segments(m, &mut pubs, &mut released);
    m.output(&pubs, released)
}

fn run_segments(m: &mut Merger, pubs: &mut Vec<Publication>, released: &mut Released) {
    let w = m.cfg.carriers.world_size;
    loop {
        let mut done = complete(m, released);
        done.sort_unstable_by_key(|(pos, _)| *pos);
        pubs.extend(done.into_iter().map(|(_, p)| p));

        if m.fenced < w {
            break;
        }
        let mut clear: Option<(Position, Publication)> = None;
        let Merger {
            queues,
            index,
            stats,
            live,
            fenced,
            ..
        } = m;
        for r in 0..w {
            let fence = queues[r].clears.pop_front().expect("every rank is fenced");
            // Every eligible report still pending is discarded.
            for seq in queues[r].base..fence {
                let node = queues[r].get_mut(seq);
                if node.live {
                    node.live = false;
                    let (id, next, slot) = (node.rep.identity, node.next, node.rep.slot);
                    index.unlink_head(&id, r, next);
                    released.push(slot);
                    stats.cleared += 1;
                    *live -= 1;
                }
            }
            let at = queues[r].position(fence, r);
            let node = queues[r].get_mut(fence);
            node.live = false;
            released.push(node.rep.slot);
            stats.consumed += 1;
            *live -= 1;
            match &mut clear {
                None => clear = Some(at),
                Some((pos, publication)) => {
                    *pos = (*pos).max(at.0);
                    publication.prefer_carried(at.1);
                }
            }
            queues[r].pop_dead();
            // The reports up to the next fence become eligible.
            let to = queues[r].eligible_end();
            index.link_range(queues, r, fence + 1, to);
            if queues[r].clears.is_empty() {
                *fenced -= 1;
            }
        }
        pubs.push(clear.expect("world_size >= 1").1);
    }
}

/// Checks the touched identities, publishes those complete (with their
/// positions) and removes the reports they use.
fn complete(m: &mut Merger, released: &mut Released) -> Vec<(Position, Publication)> {
    let w = m.cfg.carriers.world_size;
    let rule = m.cfg.carriers.rule;
    let Merger {
        queues,
        index: Index { map, touched },
        stats,
        live,
        ..
    } = m;
    let mut done = Vec::new();
    for id in std::mem::take(touched) {
        let Some(e) = map.get_mut(&id) else {
            continue;
        };
        e.touched = false;
        match rule {
            // The j-th publication uses the j-th eligible report on every
            // rank; its position is the greatest of theirs.
            Rule::All => {
                while e.lists.len() == w {
                    let mut best: Option<(Position, Publication)> = None;
                    for l in e.lists.iter_mut() {
                        let r = l.rank as usize;
                        let at = queues[r].position(l.head, r);
                        let node = queues[r].get_mut(l.head);
                        node.live = false;
                        released.push(node.rep.slot);
                        l.head = node.next;
                        l.len -= 1;
                        match &mut best {
                            None => best = Some(at),
                            Some((pos, publication)) => {
                                *pos = (*pos).max(at.0);
                                publication.prefer_carried(at.1);
                            }
                        }
                    }
                    stats.consumed += w as u64;
                    *live -= w as u64;
                    e.lists.retain(|l| l.len > 0);
                    done.push(best.expect("world_size >= 1"));
                }
            }
            // Complete when enough distinct ranks reported it: published
            // once, at the q-th smallest first position; every eligible
            // report of it is used.
            _ => {
                let distinct = e.lists.len() as u64;
                if distinct * e.factor as u64 >= w as u64 {
                    let mut firsts: Vec<(Position, Publication)> = e
                        .lists
                        .iter()
                        .map(|l| queues[l.rank as usize].position(l.head, l.rank as usize))
                        .collect();
                    let q = (w as u64).div_ceil(e.factor as u64) as usize;
                    firsts.select_nth_unstable_by_key(q - 1, |(pos, _)| *pos);
                    let (pos, mut publication) = firsts[q - 1];
                    for (_, p) in &firsts {
                        publication.prefer_carried(*p);
                    }
                    done.push((pos, publication));
                    for l in e.lists.drain(..) {
                        let queue = &mut queues[l.rank as usize];
                        let mut seq = l.head;
                        for _ in 0..l.len {
                            let node = queue.get_mut(seq);
                            node.live = false;
                            released.push(node.rep.slot);
                            seq = node.next;
                        }
                        stats.consumed += l.len as u64;
                        *live -= l.len as u64;
                    }
                }
            }
        }
        if e.lists.is_empty() {
            map.remove(&id);
        }
    }
    done
}
