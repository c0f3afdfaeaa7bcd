//! Rules "all" and "quorum": segments between clears, completions among the
//! reports before each rank's fence (docs/merge-rules.md).

use std::collections::hash_map::Entry;
use std::sync::Arc;

use super::{Merger, Position, Publication, Report, Rule};
use crate::batch::Batch;
use crate::identity::IdentityMap;

const NONE: u32 = u32::MAX;

/// One eligible report, linked to the next report of the same identity.
/// Items are pushed rank by rank, so each identity's list is rank-major.
struct Item {
    rank: u32,
    qi: u32,
    next: u32,
    consumed: bool,
}

struct Group {
    head: u32,
    tail: u32,
}

/// Buffers reused from step to step, so a step allocates almost nothing.
#[derive(Default)]
pub(super) struct Scratch {
    map: IdentityMap<u32>,
    groups: Vec<Group>,
    items: Vec<Item>,
    rank_start: Vec<usize>,
}

pub(super) fn finish(m: &mut Merger) -> Arc<Batch> {
    let w = m.cfg.world_size;
    let mut pubs = Vec::new();
    // Slots are released only after the output is gathered from them.
    let mut released = Vec::new();
    loop {
        let fences = fences(m);
        let mut done = complete(m, &fences, &mut released);
        done.sort_unstable_by_key(|(pos, _)| *pos);
        pubs.extend(done.into_iter().map(|(_, p)| p));

        let fences = self::fences(m);
        if (0..w).any(|r| fences[r] == m.queues[r].len()) {
            break;
        }
        let mut clear: Option<(Position, Publication)> = None;
        for (r, q) in m.queues.iter_mut().enumerate() {
            for left in q.drain(..fences[r]) {
                released.push(left.slot);
                m.stats.cleared += 1;
            }
            let fence = q.pop_front().expect("the fence is there");
            released.push(fence.slot);
            m.stats.consumed += 1;
            let pos = (fence.step, fence.idx, r as u32);
            if clear.is_none_or(|(p, _)| pos > p) {
                let p = Publication {
                    slot: fence.slot,
                    idx: fence.idx,
                };
                clear = Some((pos, p));
            }
        }
        pubs.push(clear.expect("world_size >= 1").1);
    }
    let out = Arc::new(m.gather(&pubs));
    for slot in released {
        m.slots.release(slot);
    }
    out
}

/// Each rank's first pending clear, or its queue length when it has none.
fn fences(m: &Merger) -> Vec<usize> {
    m.queues
        .iter()
        .map(|q| q.iter().position(|r| r.clear).unwrap_or(q.len()))
        .collect()
}

/// Finds the completions among the eligible reports, removes the reports
/// they use from the queues, and returns them with their positions.
fn complete(
    m: &mut Merger,
    fences: &[usize],
    released: &mut Vec<u32>,
) -> Vec<(Position, Publication)> {
    let w = m.cfg.world_size;
    let rule = m.cfg.rule;
    let Merger {
        queues,
        scratch: s,
        stats,
        ..
    } = m;
    s.map.clear();
    s.groups.clear();
    s.items.clear();
    s.rank_start.clear();
    for (r, q) in queues.iter().enumerate() {
        s.rank_start.push(s.items.len());
        for (qi, rep) in q.iter().take(fences[r]).enumerate() {
            let item = s.items.len() as u32;
            s.items.push(Item {
                rank: r as u32,
                qi: qi as u32,
                next: NONE,
                consumed: false,
            });
            match s.map.entry(rep.identity) {
                Entry::Occupied(e) => {
                    let g = &mut s.groups[*e.get() as usize];
                    s.items[g.tail as usize].next = item;
                    g.tail = item;
                }
                Entry::Vacant(e) => {
                    e.insert(s.groups.len() as u32);
                    s.groups.push(Group {
                        head: item,
                        tail: item,
                    });
                }
            }
        }
    }

    let mut done = Vec::new();
    for g in 0..s.groups.len() {
        let head = s.groups[g].head;
        match rule {
            Rule::All => all(&mut s.items, head, w, queues, &mut done),
            Rule::Quorum => quorum(&mut s.items, head, w, queues, &mut done),
            Rule::Any => unreachable!("rule \"any\" never queues reports"),
        }
    }

    for (r, q) in queues.iter_mut().enumerate() {
        let base = s.rank_start[r];
        let mut k = 0;
        q.retain(|rep| {
            let keep = k >= fences[r] || !s.items[base + k].consumed;
            if !keep {
                released.push(rep.slot);
                stats.consumed += 1;
            }
            k += 1;
            keep
        });
    }
    done
}

fn report<'q>(queues: &'q [std::collections::VecDeque<Report>], item: &Item) -> &'q Report {
    &queues[item.rank as usize][item.qi as usize]
}

fn position(rep: &Report, rank: u32) -> Position {
    (rep.step, rep.idx, rank)
}

/// Calls `f(item index, run index within its rank)` along a group's list.
fn walk(items: &mut [Item], head: u32, mut f: impl FnMut(&mut Item, u32)) {
    let (mut at, mut rank, mut run) = (head, NONE, 0u32);
    while at != NONE {
        let item = &mut items[at as usize];
        if item.rank != rank {
            rank = item.rank;
            run = 0;
        }
        f(item, run);
        run += 1;
        at = item.next;
    }
}

/// Rule "all": the `j`-th report on every rank makes the `j`-th publication.
fn all(
    items: &mut [Item],
    head: u32,
    w: usize,
    queues: &[std::collections::VecDeque<Report>],
    done: &mut Vec<(Position, Publication)>,
) {
    let (mut distinct, mut min, mut last_rank, mut run) = (0usize, u32::MAX, NONE, 0u32);
    walk(items, head, |item, j| {
        if item.rank != last_rank {
            if last_rank != NONE {
                min = min.min(run);
            }
            distinct += 1;
            last_rank = item.rank;
        }
        run = j + 1;
    });
    min = min.min(run);
    if distinct < w {
        return;
    }
    let start = done.len();
    done.extend((0..min).map(|_| {
        (
            (0, 0, 0),
            Publication {
                slot: NONE,
                idx: NONE,
            },
        )
    }));
    walk(items, head, |item, j| {
        if j < min {
            item.consumed = true;
            let rep = report(queues, item);
            let pos = position(rep, item.rank);
            let slot = &mut done[start + j as usize];
            if slot.1.slot == NONE || pos > slot.0 {
                *slot = (
                    pos,
                    Publication {
                        slot: rep.slot,
                        idx: rep.idx,
                    },
                );
            }
        }
    });
}

/// Rule "quorum": enough distinct ranks, weighted by the replication factor.
fn quorum(
    items: &mut [Item],
    head: u32,
    w: usize,
    queues: &[std::collections::VecDeque<Report>],
    done: &mut Vec<(Position, Publication)>,
) {
    let factor = report(queues, &items[head as usize]).factor as u64;
    let mut firsts: Vec<(Position, Publication)> = Vec::new();
    walk(items, head, |item, j| {
        if j == 0 {
            let rep = report(queues, item);
            let p = Publication {
                slot: rep.slot,
                idx: rep.idx,
            };
            firsts.push((position(rep, item.rank), p));
        }
    });
    if (firsts.len() as u64) * factor < w as u64 {
        return;
    }
    let q = (w as u64).div_ceil(factor) as usize;
    firsts.select_nth_unstable_by_key(q - 1, |(pos, _)| *pos);
    done.push(firsts[q - 1]);
    walk(items, head, |item, _| item.consumed = true);
}
