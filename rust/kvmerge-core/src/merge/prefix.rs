//! Rule "all" while every rank's pending reports are a prefix of one
//! sequence (by identity): a rank a step late, or silent, or every rank on
//! time after a backlog. Then the multiset intersection is exactly the
//! shortest rank's sequence, each event's j-th report is at the same index
//! on every rank, and a step is a walk over that prefix: no index.
//!
//! Why the shortest prefix is what the segment rules publish: for an
//! identity `K`, the shortest rank has exactly the prefix's reports of `K`
//! and every other rank at least those, at the same indices, so the `j`-th
//! eligible report of `K` on every rank is the `j`-th one in the prefix;
//! clears sit at the same indices on every rank, so each fenced segment is
//! the same on every rank and completes whole.
//!
//! Rule "quorum" too, while every pending report needs every rank
//! (`ceil(world_size / f) == world_size`: factor 1, the common case): an
//! identity of the prefix then has a report on every rank, so it completes,
//! once, at its first occurrence in its segment (the q-th smallest of the
//! ranks' first positions is their greatest, the first occurrence's index
//! being the same on every rank); its later occurrences in the segment are
//! consumed with it. That stays a walk as long as none of them lies past
//! the prefix (in the longer queues' part of the last segment): `finish`
//! checks that before changing anything and otherwise declines. What is
//! left (identities the shortest, now empty, queue lacks) cannot complete.

use super::pending::Queue;
use super::report::{Position, Publication};
use super::slots::Released;
use super::state::Merger;
use crate::rule::Rule;

/// Whether the queues (each `old[r]` reports long before this step's were
/// appended, all of those a prefix of one sequence) still are prefixes of
/// one sequence. Compares only what this step appended.
/// Under "quorum", also that every appended report needs every rank.
pub(super) fn compatible(queues: &[Queue], old: &[usize], rule: Rule) -> bool {
    if rule == Rule::Quorum {
        let w = queues.len() as u64;
        let all_needed = queues.iter().zip(old).all(|(queue, &from)| {
            (from..queue.nodes.len()).all(|i| w.div_ceil(queue.nodes[i].rep.factor as u64) == w)
        });
        if !all_needed {
            return false;
        }
    }
    let Some(longest) = (0..queues.len()).max_by_key(|&r| (queues[r].nodes.len(), usize::MAX - r))
    else {
        return true;
    };
    let reference = &queues[longest].nodes;
    queues.iter().enumerate().all(|(r, queue)| {
        r == longest
            || (old[r].min(old[longest])..queue.nodes.len())
                .all(|i| queue.nodes[i].rep.identity == reference[i].rep.identity)
    })
}

/// Publishes the common prefix (its segments' completions in position
/// order, each clear after its segment) and removes it from every queue.
/// Under "quorum", declines (false, nothing changed) when an identity of
/// the prefix's last segment recurs past the prefix in that segment.
pub(super) fn finish(m: &mut Merger, pubs: &mut Vec<Publication>, released: &mut Released) -> bool {
    let w = m.cfg.carriers.world_size;
    let quorum = m.cfg.carriers.rule == Rule::Quorum;
    let start = pubs.len();
    // Under "quorum": the identities published in the current segment.
    let mut seen = std::mem::take(&mut m.scratch);
    seen.clear();
    let n = m.queues.iter().map(|q| q.nodes.len()).min().unwrap_or(0);
    let mut segment: Vec<(Position, Publication)> = Vec::new();
    let mut ordered = true;
    let flush = |segment: &mut Vec<(Position, Publication)>,
                 ordered: &mut bool,
                 pubs: &mut Vec<Publication>| {
        if !*ordered {
            segment.sort_unstable_by_key(|(pos, _)| *pos);
        }
        pubs.extend(segment.drain(..).map(|(_, p)| p));
        *ordered = true;
    };
    let mut clears = 0;
    for i in 0..n {
        let mut best: Option<(Position, Publication)> = None;
        for (r, queue) in m.queues.iter().enumerate() {
            let rep = &queue.nodes[i].rep;
            let at = ((rep.step, rep.idx, r as u32), rep.publication());
            match &mut best {
                None => best = Some(at),
                Some((pos, publication)) => {
                    *pos = (*pos).max(at.0);
                    publication.prefer_carried(at.1);
                }
            }
        }
        let (pos, publication) = best.expect("world_size >= 1");
        let rep = &m.queues[0].nodes[i].rep;
        if rep.clear {
            flush(&mut segment, &mut ordered, pubs);
            pubs.push(publication);
            clears += 1;
            seen.clear();
        } else if quorum && !seen.insert(rep.identity) {
            // A later occurrence: consumed by the first one's publication.
        } else {
            if segment.last().is_some_and(|(last, _)| pos < *last) {
                ordered = false;
            }
            segment.push((pos, publication));
        }
    }
    flush(&mut segment, &mut ordered, pubs);
    if quorum {
        // The last segment goes on past the prefix up to the next clear;
        // every queue there is a prefix of the longest one.
        let longest = &m
            .queues
            .iter()
            .max_by_key(|q| q.nodes.len())
            .expect("world_size >= 1")
            .nodes;
        let recurs = (n..longest.len())
            .map(|i| &longest[i].rep)
            .take_while(|rep| !rep.clear)
            .any(|rep| seen.contains(&rep.identity));
        m.scratch = seen;
        if recurs {
            pubs.truncate(start);
            return false;
        }
    }
    for queue in &mut m.queues {
        for _ in 0..n {
            let node = queue.pop_front().expect("n is the shortest queue");
            released.push(node.rep.slot);
        }
        queue.clears.drain(..clears);
    }
    m.fenced = m.queues.iter().filter(|q| !q.clears.is_empty()).count();
    m.stats.consumed += (w * n) as u64;
    m.live -= (w * n) as u64;
    true
}
