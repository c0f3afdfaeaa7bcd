//! An independent, deliberately naive model of docs/merge-rules.md, used as
//! the oracle of the soak run (`examples/soak`) and of the `merger` fuzz
//! target (which includes this file by path).
//!
//! It shares nothing with the engine but the `Identity` type: reports are
//! kept as plain per-rank vectors, every segment regroups every eligible
//! report from scratch, and positions are compared as tuples. Slow and
//! obvious on purpose; the pending window keeps it fast enough.

use std::collections::HashMap;

use kvmerge_core::{Identity, Rule};

/// What the model needs to know of one event: its identity (computed by the
/// caller from the event's bytes), and its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub id: Identity,
    pub kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Stored { group: Option<i64> },
    Removed,
    Cleared,
}

/// The spec's three kinds of rejected `add`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    Rank,
    DuplicateRank,
    Group,
}

/// The counters of `Merger.stats()`, kept the spec's way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub steps: u64,
    pub batches: u64,
    pub reports: u64,
    pub published: u64,
    pub consumed: u64,
    pub cleared: u64,
    pub expired: u64,
    pub pending: u64,
}

/// `(step, index in the batch, rank)`: compared lexicographically.
type Position = (u64, usize, usize);

#[derive(Debug, Clone, Copy)]
struct Report {
    event: Event,
    pos: Position,
}

pub struct Reference {
    world_size: usize,
    rule: Rule,
    factors: Option<Vec<u32>>,
    max_pending_steps: u64,
    step: u64,
    incoming: Vec<Option<Vec<Event>>>,
    queues: Vec<Vec<Report>>,
    counters: Counters,
}

impl Reference {
    pub fn new(
        world_size: usize,
        rule: Rule,
        factors: Option<Vec<u32>>,
        max_pending_steps: u64,
    ) -> Self {
        Reference {
            world_size,
            rule,
            factors,
            max_pending_steps,
            step: 0,
            incoming: vec![None; world_size],
            queues: vec![Vec::new(); world_size],
            counters: Counters::default(),
        }
    }

    pub fn counters(&self) -> Counters {
        let queued: usize = self.queues.iter().map(Vec::len).sum();
        let incoming: usize = self.incoming.iter().flatten().map(Vec::len).sum();
        Counters {
            pending: (queued + incoming) as u64,
            ..self.counters
        }
    }

    pub fn add(&mut self, rank: i64, events: Vec<Event>) -> Result<(), Rejected> {
        self.add_all(vec![(rank, events)])
    }

    /// Several ranks' batches: all of them, or none if any is refused (the
    /// first refusal in list order is reported).
    pub fn add_all(&mut self, reports: Vec<(i64, Vec<Event>)>) -> Result<(), Rejected> {
        let mut taken: Vec<usize> = Vec::new();
        for (rank, events) in &reports {
            let rank = *rank;
            if rank < 0 || rank as u64 >= self.world_size as u64 {
                return Err(Rejected::Rank);
            }
            let rank = rank as usize;
            if self.incoming[rank].is_some() || taken.contains(&rank) {
                return Err(Rejected::DuplicateRank);
            }
            if let (Rule::Quorum, Some(factors)) = (self.rule, &self.factors) {
                for e in events {
                    if let Kind::Stored { group: Some(g) } = e.kind {
                        if g < 0 || g as u64 >= factors.len() as u64 {
                            return Err(Rejected::Group);
                        }
                    }
                }
            }
            taken.push(rank);
        }
        for (rank, events) in reports {
            self.counters.batches += 1;
            self.counters.reports += events.len() as u64;
            self.incoming[rank as usize] = Some(events);
        }
        Ok(())
    }

    pub fn reset(&mut self) {
        self.counters.cleared += self.counters().pending;
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.queues.iter_mut().for_each(Vec::clear);
    }

    /// Closes the step; returns the identities published, in order.
    pub fn finish_step(&mut self) -> Vec<Identity> {
        let out = match self.rule {
            Rule::Any => self.union(),
            Rule::All | Rule::Quorum => {
                for rank in 0..self.world_size {
                    let events = self.incoming[rank].take().unwrap_or_default();
                    for (idx, event) in events.into_iter().enumerate() {
                        self.queues[rank].push(Report {
                            event,
                            pos: (self.step, idx, rank),
                        });
                    }
                }
                let out = self.segments();
                self.expire();
                out
            }
        };
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.step += 1;
        self.counters.steps += 1;
        self.counters.published += out.len() as u64;
        out
    }

    /// Rule "any": walk the step's reports by (index, rank); a clear is
    /// published unless the last event published in the step is a clear.
    fn union(&mut self) -> Vec<Identity> {
        let mut reports: Vec<(usize, usize, Event)> = Vec::new();
        for (rank, events) in self.incoming.iter().enumerate() {
            for (idx, e) in events.iter().flatten().enumerate() {
                reports.push((idx, rank, *e));
            }
        }
        reports.sort_by_key(|&(idx, rank, _)| (idx, rank));
        self.counters.consumed += reports.len() as u64;
        let mut seen: Vec<Identity> = Vec::new();
        let mut out: Vec<(Identity, bool)> = Vec::new();
        for (_, _, e) in reports {
            let clear = e.kind == Kind::Cleared;
            if clear {
                if out.last().is_none_or(|&(_, was_clear)| !was_clear) {
                    seen.clear();
                    out.push((e.id, true));
                }
            } else if !seen.contains(&e.id) {
                seen.push(e.id);
                out.push((e.id, false));
            }
        }
        out.into_iter().map(|(id, _)| id).collect()
    }

    fn factor(&self, e: &Event) -> u64 {
        match (e.kind, &self.factors) {
            (Kind::Stored { group: Some(g) }, Some(f)) => f[g as usize] as u64,
            _ => 1,
        }
    }

    /// Rules "all" and "quorum": segments until a clear is incomplete.
    fn segments(&mut self) -> Vec<Identity> {
        let w = self.world_size;
        let mut out = Vec::new();
        loop {
            let fence: Vec<usize> = self
                .queues
                .iter()
                .map(|q| {
                    q.iter()
                        .position(|r| r.event.kind == Kind::Cleared)
                        .unwrap_or(q.len())
                })
                .collect();
            // identity -> per rank, the queue indices of its eligible reports
            let mut by_id: HashMap<Identity, Vec<Vec<usize>>> = HashMap::new();
            for (r, q) in self.queues.iter().enumerate() {
                for (i, rep) in q[..fence[r]].iter().enumerate() {
                    by_id
                        .entry(rep.event.id)
                        .or_insert_with(|| vec![Vec::new(); w])[r]
                        .push(i);
                }
            }
            let mut used: Vec<Vec<bool>> =
                self.queues.iter().map(|q| vec![false; q.len()]).collect();
            let mut done: Vec<(Position, Identity)> = Vec::new();
            for (id, per_rank) in &by_id {
                match self.rule {
                    Rule::All => {
                        let m = per_rank.iter().map(Vec::len).min().unwrap_or(0);
                        for j in 0..m {
                            let pos = (0..w)
                                .map(|r| self.queues[r][per_rank[r][j]].pos)
                                .max()
                                .expect("w >= 1");
                            done.push((pos, *id));
                            for r in 0..w {
                                used[r][per_rank[r][j]] = true;
                            }
                        }
                    }
                    _ => {
                        let d = per_rank.iter().filter(|v| !v.is_empty()).count() as u64;
                        let some = per_rank.iter().find_map(|v| v.first()).copied();
                        let rank = per_rank.iter().position(|v| !v.is_empty());
                        let (Some(i), Some(r)) = (some, rank) else {
                            continue;
                        };
                        let f = self.factor(&self.queues[r][i].event);
                        if d * f < w as u64 {
                            continue;
                        }
                        let mut firsts: Vec<Position> = (0..w)
                            .filter(|&r| !per_rank[r].is_empty())
                            .map(|r| self.queues[r][per_rank[r][0]].pos)
                            .collect();
                        firsts.sort();
                        let q = (w as u64).div_ceil(f) as usize;
                        done.push((firsts[q - 1], *id));
                        for (r, idxs) in per_rank.iter().enumerate() {
                            for &i in idxs {
                                used[r][i] = true;
                            }
                        }
                    }
                }
            }
            done.sort();
            out.extend(done.into_iter().map(|(_, id)| id));
            for (q, used) in self.queues.iter_mut().zip(&used) {
                let before = q.len();
                let mut k = 0;
                q.retain(|_| {
                    k += 1;
                    !used[k - 1]
                });
                self.counters.consumed += (before - q.len()) as u64;
            }
            // The clear: complete when every rank has one pending.
            let fences: Vec<Option<usize>> = self
                .queues
                .iter()
                .map(|q| q.iter().position(|r| r.event.kind == Kind::Cleared))
                .collect();
            if fences.iter().any(Option::is_none) {
                break;
            }
            let mut clear_id = None;
            for (q, f) in self.queues.iter_mut().zip(fences) {
                let f = f.expect("checked");
                self.counters.cleared += f as u64;
                self.counters.consumed += 1;
                clear_id = Some(q[f].event.id);
                q.drain(..=f);
            }
            out.push(clear_id.expect("w >= 1"));
        }
        out
    }

    fn expire(&mut self) {
        let (now, horizon) = (self.step as u128, self.max_pending_steps as u128);
        for q in &mut self.queues {
            let before = q.len();
            q.retain(|r| r.pos.0 as u128 + horizon > now);
            self.counters.expired += (before - q.len()) as u64;
        }
    }
}
