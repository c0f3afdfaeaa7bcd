//! Rules "all" and "quorum": segments between clears, completions among the
//! reports before each rank's fence (docs/merge-rules.md).

use super::{Merger, Position, Publication, Published, Rule};
use crate::identity::IdentityMap;

/// Buffers reused from step to step, so a step allocates almost nothing.
#[derive(Default)]
pub(super) struct Scratch {
    map: IdentityMap<u32>,
    /// Group of each eligible report, rank by rank, in queue order.
    gid: Vec<u32>,
    /// `groups x world_size` report counts, then reused as a cursor.
    counts: Vec<u32>,
    /// Publications each group makes this segment (0 if incomplete).
    quota: Vec<u32>,
    /// Under "quorum": each rank's first eligible report of each group.
    firsts: Vec<Option<(Position, Publication)>>,
    consumed: Vec<bool>,
}

pub(super) fn finish(m: &mut Merger) -> Published {
    let w = m.cfg.world_size;
    let mut pubs = Vec::new();
    // Slots are released only after the output is gathered from them.
    let mut released = Vec::new();
    let mut fences = fences(m);
    loop {
        let mut done = complete(m, &mut fences, &mut released);
        done.sort_unstable_by_key(|(pos, _)| *pos);
        pubs.extend(done.into_iter().map(|(_, p)| p));

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
            let p = fence.publication();
            match &mut clear {
                None => clear = Some((pos, p)),
                Some((at, publication)) => {
                    *at = (*at).max(pos);
                    publication.prefer_carried(p);
                }
            }
        }
        pubs.push(clear.expect("world_size >= 1").1);
        fences = self::fences(m);
    }
    let out = m.published(&pubs);
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
/// they use from the queues (moving `fences` back accordingly), and returns
/// them with their positions.
///
/// Two sequential passes over the eligible reports: the first groups them by
/// identity and counts them per rank, the second hands each group's quota
/// of reports out in queue order, which is how the rules pick them.
fn complete(
    m: &mut Merger,
    fences: &mut [usize],
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
    s.gid.clear();
    s.counts.clear();
    for (r, q) in queues.iter().enumerate() {
        for rep in q.iter().take(fences[r]) {
            let next = s.map.len() as u32;
            let g = *s.map.entry(rep.identity).or_insert(next);
            if g == next {
                s.counts.resize(s.counts.len() + w, 0);
            }
            s.gid.push(g);
            s.counts[g as usize * w + r] += 1;
        }
    }

    let groups = s.map.len();
    s.quota.clear();
    s.quota.extend(s.counts.chunks_exact(w).map(|c| match rule {
        Rule::All => c.iter().copied().min().unwrap_or(0),
        _ => c.iter().filter(|&&n| n > 0).count() as u32,
    }));
    s.counts.iter_mut().for_each(|c| *c = 0);
    if rule == Rule::Quorum {
        s.firsts.clear();
        s.firsts.resize(groups * w, None);
    }

    // "all": slot `g`'s first publication is done[first[g]], the j-th is
    // done[first[g] + j]; filled with the greatest position seen.
    let mut done: Vec<(Position, Publication)> = Vec::new();
    let mut first = vec![u32::MAX; groups];
    let mut k = 0;
    s.consumed.clear();
    s.consumed.resize(s.gid.len(), false);
    for (r, q) in queues.iter().enumerate() {
        for rep in q.iter().take(fences[r]) {
            let g = s.gid[k] as usize;
            let j = s.counts[g * w + r];
            s.counts[g * w + r] += 1;
            let pos = (rep.step, rep.idx, r as u32);
            let publication = rep.publication();
            match rule {
                Rule::All if j < s.quota[g] => {
                    s.consumed[k] = true;
                    if first[g] == u32::MAX {
                        first[g] = done.len() as u32;
                        done.extend((0..s.quota[g]).map(|_| (pos, publication)));
                    }
                    // Equal identities, equal bytes: any of the reports
                    // used can supply them, if its batch carries them.
                    let slot = &mut done[(first[g] + j) as usize];
                    slot.0 = slot.0.max(pos);
                    slot.1.prefer_carried(publication);
                }
                Rule::Quorum if j == 0 => s.firsts[g * w + r] = Some((pos, publication)),
                _ => {}
            }
            k += 1;
        }
    }

    if rule == Rule::Quorum {
        let mut k = 0;
        for (r, q) in queues.iter().enumerate() {
            for rep in q.iter().take(fences[r]) {
                let g = s.gid[k] as usize;
                let distinct = s.quota[g] as u64;
                s.consumed[k] = distinct * rep.factor as u64 >= w as u64;
                if s.consumed[k] && first[g] == u32::MAX {
                    first[g] = 0;
                    let mut firsts: Vec<_> = s.firsts[g * w..(g + 1) * w]
                        .iter()
                        .flatten()
                        .copied()
                        .collect();
                    let q = (w as u64).div_ceil(rep.factor as u64) as usize;
                    firsts.select_nth_unstable_by_key(q - 1, |(pos, _)| *pos);
                    let (pos, mut publication) = firsts[q - 1];
                    for (_, p) in &firsts {
                        publication.prefer_carried(*p);
                    }
                    done.push((pos, publication));
                }
                k += 1;
            }
        }
    }

    let mut k = 0;
    for (r, q) in queues.iter_mut().enumerate() {
        let (mut i, mut removed) = (0, 0);
        q.retain(|rep| {
            let keep = i >= fences[r] || !s.consumed[k + i];
            if !keep {
                released.push(rep.slot);
                removed += 1;
            }
            i += 1;
            keep
        });
        k += fences[r];
        fences[r] -= removed;
        stats.consumed += removed as u64;
    }
    done
}
