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

use super::pending::Lane;
use super::{Merger, Position, Publication};

/// Whether the lanes (each `old[r]` reports long before this step's were
/// appended, all of those a prefix of one sequence) still are prefixes of
/// one sequence. Compares only what this step appended.
pub(super) fn compatible(lanes: &[Lane], old: &[usize]) -> bool {
    let Some(longest) = (0..lanes.len()).max_by_key(|&r| (lanes[r].nodes.len(), usize::MAX - r))
    else {
        return true;
    };
    let reference = &lanes[longest].nodes;
    lanes.iter().enumerate().all(|(r, lane)| {
        r == longest
            || (old[r].min(old[longest])..lane.nodes.len())
                .all(|i| lane.nodes[i].rep.identity == reference[i].rep.identity)
    })
}

/// Publishes the common prefix (its segments' completions in position
/// order, each clear after its segment) and removes it from every lane.
pub(super) fn finish(m: &mut Merger, pubs: &mut Vec<Publication>, released: &mut Vec<u32>) {
    let w = m.cfg.world_size;
    let n = m.lanes.iter().map(|l| l.nodes.len()).min().unwrap_or(0);
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
        for (r, lane) in m.lanes.iter().enumerate() {
            let rep = &lane.nodes[i].rep;
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
        if m.lanes[0].nodes[i].rep.clear {
            flush(&mut segment, &mut ordered, pubs);
            pubs.push(publication);
            clears += 1;
        } else {
            if segment.last().is_some_and(|(last, _)| pos < *last) {
                ordered = false;
            }
            segment.push((pos, publication));
        }
    }
    flush(&mut segment, &mut ordered, pubs);
    for lane in &mut m.lanes {
        for _ in 0..n {
            let node = lane.pop_front().expect("n is the shortest lane");
            released.push(node.rep.slot);
        }
        lane.clears.drain(..clears);
    }
    m.fenced = m.lanes.iter().filter(|l| !l.clears.is_empty()).count();
    m.stats.consumed += (w * n) as u64;
    m.live -= (w * n) as u64;
}
