//! The merger: per-rank lanes of pending reports, and one `finish_step`
//! that applies the rule. The rules themselves are in `segment` ("all",
//! "quorum", incrementally over an index of the pending reports), `prefix`
//! ("all", and "quorum" while every report needs every rank, while the
//! ranks' pending reports are prefixes of one sequence: a rank late or
//! silent), `union` ("any") and `fast` (nothing pending and
//! every rank said the same thing).

mod carriers;
mod config;
mod fast;
mod pending;
mod prefix;
mod published;
mod segment;
mod slots;
mod stats;
mod union;

use std::sync::Arc;

pub use config::{MergerConfig, Rule, MAX_WORLD_SIZE};
pub use published::Published;
pub use stats::Stats;

use crate::batch::{Batch, MAX_CARRIED_BYTES};
use crate::error::{Error, Result};
use crate::identity::{Identity, IdentitySet};
use crate::schema::EventKind;
use pending::{Index, Lane};
use slots::Slots;

/// One event in one rank's batch, waiting for the other ranks.
#[derive(Debug, Clone, Copy)]
struct Report {
    identity: Identity,
    step: u64,
    slot: u32,
    idx: u32,
    /// Replication factor under "quorum" (1 for everything else).
    factor: u32,
    clear: bool,
    carried: bool,
}

impl Report {
    fn publication(&self) -> Publication {
        Publication {
            slot: self.slot,
            idx: self.idx,
            carried: self.carried,
        }
    }
}

/// Where a report stands among all reports: `(step, index, rank)`.
type Position = (u64, u32, u32);

/// A published event: which batch slot and which event in it, and whether
/// that batch holds the event's bytes (the output needs one report that does).
#[derive(Debug, Clone, Copy)]
struct Publication {
    slot: u32,
    idx: u32,
    carried: bool,
}

impl Publication {
    /// Keeps the first report that carries the bytes.
    fn prefer_carried(&mut self, other: Publication) {
        if !self.carried && other.carried {
            *self = other;
        }
    }
}

pub struct Merger {
    cfg: MergerConfig,
    step: u64,
    incoming: Vec<Option<Arc<Batch>>>,
    /// The incoming batches' carried bytes and reports (see `Slots::load`).
    incoming_load: (u64, u64),
    lanes: Vec<Lane>,
    /// Live reports in the lanes.
    live: u64,
    /// Ranks with a fence (a pending clear).
    fenced: usize,
    /// Whether `index` holds every eligible report (else the lanes are
    /// prefixes of one sequence: see `prefix`).
    indexed: bool,
    index: Index,
    /// Scratch for `prefix` under "quorum" (kept for its capacity).
    scratch: IdentitySet,
    /// Tests: never prefix mode, to check that it changes nothing.
    #[cfg(test)]
    index_only: bool,
    slots: Slots,
    stats: Stats,
}

impl Merger {
    pub fn new(cfg: MergerConfig) -> Result<Merger> {
        cfg.validate()?;
        let w = cfg.world_size;
        Ok(Merger {
            step: 0,
            incoming: vec![None; w],
            incoming_load: (0, 0),
            lanes: (0..w).map(|_| Lane::default()).collect(),
            live: 0,
            fenced: 0,
            indexed: false,
            index: Index::default(),
            scratch: IdentitySet::default(),
            #[cfg(test)]
            index_only: false,
            slots: Slots::default(),
            stats: Stats::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &MergerConfig {
        &self.cfg
    }

    /// The step now being collected, counted from 0.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn stats(&self) -> Stats {
        let incoming: usize = self.incoming.iter().flatten().map(|b| b.len()).sum();
        Stats {
            pending: self.live + incoming as u64,
            ..self.stats
        }
    }

    /// What the next `finish_step` works through: the bytes of events
    /// carried by the batches its reports point into (a bound on what it
    /// copies out), and its reports, pending and this step's. Constant time.
    pub fn load(&self) -> (u64, u64) {
        let (bytes, reports) = self.slots.load();
        (bytes + self.incoming_load.0, reports + self.incoming_load.1)
    }

    /// Records `rank`'s batch for this step. Checks everything first, so a
    /// rejected call changes nothing.
    pub fn add(&mut self, rank: i64, batch: Arc<Batch>) -> Result<()> {
        let r = self.check(rank, &batch, &[], (0, 0))?;
        self.commit(r, batch);
        Ok(())
    }

    /// Records several ranks' batches at once: all of them, or (on the first
    /// error) none.
    pub fn add_all(&mut self, reports: Vec<(i64, Arc<Batch>)>) -> Result<()> {
        let mut ranks = Vec::with_capacity(reports.len());
        let mut load = (0, 0);
        for (rank, batch) in &reports {
            ranks.push(self.check(*rank, batch, &ranks, load)?);
            load = (
                load.0 + batch.carried_len() as u64,
                load.1 + batch.len() as u64,
            );
        }
        for (r, (_, batch)) in ranks.into_iter().zip(reports) {
            self.commit(r, batch);
        }
        Ok(())
    }

    /// Validates one report; `also_taken` are ranks about to be added with
    /// it, `also_load` their carried bytes and reports.
    fn check(
        &self,
        rank: i64,
        batch: &Batch,
        also_taken: &[usize],
        also_load: (u64, u64),
    ) -> Result<usize> {
        let world_size = self.cfg.world_size;
        let r = usize::try_from(rank)
            .ok()
            .filter(|&r| r < world_size)
            .ok_or(Error::RankOutOfRange { rank, world_size })?;
        if self.incoming[r].is_some() || also_taken.contains(&r) {
            return Err(Error::DuplicateRank {
                rank: r,
                step: self.step,
            });
        }
        if let (Rule::Quorum, Some(factors)) = (self.cfg.rule, &self.cfg.replication_factors) {
            for i in 0..batch.len() {
                let rec = batch.record(i);
                if let (None, Some(g)) = (
                    self.cfg.replication_factor(rec.kind, rec.group_idx),
                    rec.group_idx,
                ) {
                    return Err(Error::GroupOutOfRange {
                        index: i,
                        group: g,
                        n_factors: factors.len(),
                    });
                }
            }
        }
        if batch.elided() > 0 {
            self.check_elided(r, batch)?;
        }
        self.check_load(r, batch, also_load)?;
        Ok(r)
    }

    /// One step's output is one batch, so it must fit one (32-bit offsets
    /// and counts). Each publication takes its bytes from a report it
    /// consumes, and every pending report sits in a live slot or an incoming
    /// batch: so if the bytes carried by those batches, and their reports,
    /// fit one batch, so does any step's output. A report that would break
    /// that bound is refused (the caller drops it), before anything changes.
    fn check_load(&self, rank: usize, batch: &Batch, also_load: (u64, u64)) -> Result<()> {
        let (slot_bytes, slot_reports) = self.slots.load();
        let bytes = slot_bytes + self.incoming_load.0 + also_load.0 + batch.carried_len() as u64;
        let reports = slot_reports + self.incoming_load.1 + also_load.1 + batch.len() as u64;
        if bytes > MAX_CARRIED_BYTES || reports > u32::MAX as u64 {
            return Err(Error::TooLarge(format!(
                "rank {rank}'s batch ({} events, {} bytes of events) would leave the merger \
                 holding {reports} reports and {bytes} bytes of events, more than one step's \
                 merged output can hold ({} events, {MAX_CARRIED_BYTES} bytes): refused, so \
                 that no step's output overflows; drop this report (or lower \
                 max_pending_steps)",
                batch.len(),
                batch.carried_len(),
                u32::MAX,
            )));
        }
        Ok(())
    }

    /// A rank may leave out only bytes other ranks are bound to carry: then
    /// every event this merger can publish has a report with its bytes.
    fn check_elided(&self, rank: usize, batch: &Batch) -> Result<()> {
        for i in 0..batch.len() {
            let rec = batch.record(i);
            if !rec.carried
                && self
                    .cfg
                    .carries(rank, &rec.identity, rec.kind, rec.group_idx)
            {
                return Err(Error::Config(format!(
                    "rank {rank} left out the bytes of event {i} ({}), which it must carry \
                     under rule {:?} with world size {} and replication factors {:?}: \
                     workers and merger must be configured alike",
                    rec.kind.name(),
                    self.cfg.rule.name(),
                    self.cfg.world_size,
                    self.cfg.replication_factors,
                )));
            }
        }
        Ok(())
    }

    fn commit(&mut self, r: usize, batch: Arc<Batch>) {
        self.stats.batches += 1;
        self.stats.reports += batch.len() as u64;
        self.incoming_load.0 += batch.carried_len() as u64;
        self.incoming_load.1 += batch.len() as u64;
        self.incoming[r] = Some(batch);
    }

    /// Closes the step: returns the events that became complete, as one
    /// batch, in publication order.
    pub fn finish_step(&mut self) -> Arc<Batch> {
        self.finish_step_published().into_batch()
    }

    /// `finish_step`, the events left where they are: each one a batch it
    /// was reported in and its index there (no bytes copied).
    pub fn finish_step_published(&mut self) -> Published {
        self.finish_step_with(true)
    }

    /// `finish_step` without the shortcut for identical reports, so tests can
    /// check that the shortcut changes nothing.
    #[doc(hidden)]
    pub fn finish_step_general(&mut self) -> Arc<Batch> {
        self.finish_step_with(false).into_batch()
    }

    fn finish_step_with(&mut self, shortcut: bool) -> Published {
        let out = match self.cfg.rule {
            Rule::Any => union::finish(self),
            Rule::All | Rule::Quorum => {
                if shortcut && fast::applies(self) {
                    fast::finish(self)
                } else {
                    let out = segment::finish(self);
                    self.expire();
                    self.settle();
                    out
                }
            }
        };
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.incoming_load = (0, 0);
        self.step += 1;
        self.stats.steps += 1;
        self.stats.published += out.len() as u64;
        out
    }

    /// Drops every pending report and this step's batches; they count as
    /// cleared. Counters and the step number stay.
    pub fn reset(&mut self) {
        let dropped = self.stats().pending;
        self.stats.cleared += dropped;
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.incoming_load = (0, 0);
        self.lanes.iter_mut().for_each(Lane::clear);
        self.live = 0;
        self.fenced = 0;
        self.index.clear();
        self.indexed = false;
        self.slots = Slots::default();
    }

    fn factor_of(&self, batch: &Batch, i: usize) -> u32 {
        if self.cfg.replication_factors.is_none() {
            return 1;
        }
        let rec = batch.record(i);
        self.cfg
            .replication_factor(rec.kind, rec.group_idx)
            .expect("check() refused groups without a factor")
    }

    fn enqueue_incoming(&mut self) {
        for rank in 0..self.cfg.world_size {
            let Some(batch) = self.incoming[rank].take() else {
                continue;
            };
            if batch.is_empty() {
                continue;
            }
            let slot = self.slots.insert(batch.clone(), batch.len() as u32);
            for i in 0..batch.len() {
                let report = Report {
                    identity: batch.identity(i),
                    step: self.step,
                    slot,
                    idx: i as u32,
                    factor: self.factor_of(&batch, i),
                    clear: batch.kind(i) == EventKind::AllBlocksCleared,
                    carried: batch.has_bytes(i),
                };
                if report.clear && self.lanes[rank].clears.is_empty() {
                    self.fenced += 1;
                }
                self.lanes[rank].push(report);
            }
            self.live += batch.len() as u64;
        }
    }

    /// Leaves prefix mode: every eligible report linked, every identity to
    /// be checked (once; each report is indexed once).
    fn index_all(&mut self) {
        self.indexed = true;
        let Merger { lanes, index, .. } = self;
        for r in 0..lanes.len() {
            let (from, to) = (lanes[r].base, lanes[r].eligible_end());
            index.link_range(lanes, r, from, to);
        }
    }

    /// Drops dead reports at the lanes' fronts; with nothing pending,
    /// "all" and "quorum" go back to prefix mode.
    fn settle(&mut self) {
        self.lanes.iter_mut().for_each(Lane::pop_dead);
        #[cfg(test)]
        if self.index_only {
            return;
        }
        if self.live == 0 && self.indexed {
            debug_assert!(self.index.map.is_empty());
            self.lanes.iter_mut().for_each(Lane::clear);
            self.index.clear();
            self.indexed = false;
        }
    }

    /// The step's output, then the slots of the reports it used released.
    fn output(&mut self, pubs: &[Publication], released: Vec<u32>) -> Published {
        let out = self.published(pubs);
        for slot in released {
            self.slots.release(slot);
        }
        out
    }

    /// Drops the reports made `max_pending_steps` steps ago: per lane, from
    /// the front, so only the expiring reports are visited.
    fn expire(&mut self) {
        let horizon = self.cfg.max_pending_steps;
        let step = self.step;
        let indexed = self.indexed;
        let Merger {
            lanes,
            index,
            slots,
            stats,
            live,
            fenced,
            ..
        } = self;
        // In prefix mode: how many live reports each lane dropped.
        let mut dropped = vec![0usize; if indexed { 0 } else { lanes.len() }];
        for r in 0..lanes.len() {
            let fence = lanes[r].clears.front().copied();
            let mut lost_fence = false;
            // Saturating: a horizon near u64::MAX means "never", not a wrap
            // that would expire everything at once.
            while lanes[r]
                .nodes
                .front()
                .is_some_and(|n| n.rep.step.saturating_add(horizon) <= step)
            {
                let seq = lanes[r].base;
                let node = lanes[r].pop_front().expect("front exists");
                if !node.live {
                    continue;
                }
                slots.release(node.rep.slot);
                stats.expired += 1;
                *live -= 1;
                if !indexed {
                    dropped[r] += 1;
                }
                if node.rep.clear {
                    lanes[r].clears.pop_front();
                    lost_fence = true;
                } else if indexed && fence.is_none_or(|f| seq < f) {
                    index.unlink_head(&node.rep.identity, r, node.next);
                }
            }
            if lost_fence {
                if lanes[r].clears.is_empty() {
                    *fenced -= 1;
                }
                // The reports behind an expired fence are eligible from
                // the next step on (touched: checked then).
                if indexed {
                    let from = lanes[r].base.max(fence.expect("a fence expired") + 1);
                    let to = lanes[r].eligible_end();
                    index.link_range(lanes, r, from, to);
                }
            }
        }
        if !indexed {
            // Still prefixes of one sequence if every lane left non-empty
            // lost as many reports from the front.
            let mut left = lanes
                .iter()
                .zip(&dropped)
                .filter(|(l, _)| !l.nodes.is_empty());
            if let Some((_, &first)) = left.next() {
                if left.any(|(_, &d)| d != first) {
                    self.index_all();
                }
            }
        }
    }

    fn published(&self, pubs: &[Publication]) -> Published {
        // Published::new asserts each pick has its bytes (check_elided).
        Published::new(
            pubs.iter()
                .map(|p| (self.slots.arc(p.slot), p.idx))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests;
