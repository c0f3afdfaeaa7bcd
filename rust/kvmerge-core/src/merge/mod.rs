//! The merger: per-rank queues of pending reports (`state`, `pending`), and
//! one `finish_step` that applies the rule. The rules themselves are in
//! `segment` ("all", "quorum", incrementally over an index of the pending
//! reports), `prefix` ("all", and "quorum" while every report needs every
//! rank, while the ranks' pending reports are prefixes of one sequence: a
//! rank late or silent), `union` ("any"), `fast` (nothing pending and
//! every rank said the same thing) and `held` (a rank a step late or
//! silent, the others' batches waiting whole). `guard`, when the merger
//! has one, then withholds what a router could not apply.
//!
//! Dependencies go one way: this module uses the rules, the rules use
//! `state` and the small leaf modules (`report`, `pending`, `published`...),
//! and nothing uses this module from below.

mod config;
mod fast;
mod guard;
mod held;
mod pending;
mod prefix;
mod published;
mod report;
mod segment;
mod slots;
mod state;
mod stats;
mod union;

use std::collections::VecDeque;
use std::sync::Arc;

pub use config::{MergerConfig, DEFAULT_MAX_PENDING_STEPS};
pub use published::Published;
pub use state::Merger;
pub use stats::Stats;

use crate::batch::{Batch, MAX_CARRIED_BYTES};
use crate::error::{Error, Result};
use crate::rule::Rule;
use pending::Queue;
use slots::Slots;

impl Merger {
    pub fn config(&self) -> &MergerConfig {
        &self.cfg
    }

    /// This merger with a guard (`on`) or without one: each published
    /// event a router cannot apply to what was published before it is
    /// withheld and counted (docs/merge-rules.md, "Guard"). A merger has
    /// none unless given one; a guard given later knows nothing published
    /// before it, so give it before the first step.
    pub fn with_guard(mut self, on: bool) -> Merger {
        self.guard = on.then(Box::default);
        self
    }

    pub fn guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// This merger with `add`'s check that a rank carries the bytes it must
    /// (`check_carriers`) left to `finish_step` (`on`): there it runs only
    /// where the step does not take the shortcut for a healthy step (which
    /// finds a carrier for every event it publishes, or declines), so that
    /// a healthy step costs one rank's events, not every rank's. A batch it
    /// refuses is dropped as if `add` had refused it, before any rule runs;
    /// `take_refused` hands over why.
    pub fn with_deferred_carrier_check(mut self, on: bool) -> Merger {
        self.defer_carrier_check = on;
        self
    }

    /// The batches the deferred carriers check refused in the last steps,
    /// by rank, with `add`'s error for them.
    pub fn take_refused(&mut self) -> Vec<(i64, Error)> {
        std::mem::take(&mut self.refused)
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
        let r = self.check(rank, &batch, &[], (0, 0), None)?;
        self.commit(r, batch);
        Ok(())
    }

    /// Records several ranks' batches at once: all of them, or (on the first
    /// error) none.
    pub fn add_all(&mut self, batches: Vec<(i64, Arc<Batch>)>) -> Result<()> {
        let mut ranks = Vec::with_capacity(batches.len());
        let mut load = (0, 0);
        for (rank, batch) in &batches {
            let checked = batches
                .first()
                .map(|(_, b)| &**b)
                .filter(|_| !ranks.is_empty());
            ranks.push(self.check(*rank, batch, &ranks, load, checked)?);
            load = (
                load.0 + batch.carried_len() as u64,
                load.1 + batch.len() as u64,
            );
        }
        for (r, (_, batch)) in ranks.into_iter().zip(batches) {
            self.commit(r, batch);
        }
        Ok(())
    }

    /// Validates one rank's batch; `also_taken` are ranks about to be added
    /// with it, `also_load` their carried bytes and reports, `checked` one of
    /// their batches (checked already).
    fn check(
        &self,
        rank: i64,
        batch: &Batch,
        also_taken: &[usize],
        also_load: (u64, u64),
        checked: Option<&Batch>,
    ) -> Result<usize> {
        let world_size = self.cfg.carriers.world_size;
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
        let carriers = &self.cfg.carriers;
        if let (Rule::Quorum, Some(factors)) = (carriers.rule, &carriers.replication_factors) {
            // Equal identities are equal events, groups included: a batch
            // alike one this step already took has groups the factors cover.
            let taken = self.incoming.iter().flatten().map(|b| &**b).chain(checked);
            let known = taken.take(1).any(|b| b.alike(batch));
            for i in (0..batch.len()).take_while(|_| !known) {
                let rec = batch.record(i);
                if let (None, Some(g)) = (
                    carriers.replication_factor(rec.kind, rec.group_idx),
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
        if batch.uncarried() > 0 && !self.defer_carrier_check {
            self.check_carriers(r, batch)?;
        }
        self.check_load(r, batch, also_load)?;
        Ok(r)
    }

    /// One step's output is one batch, so it must fit one (32-bit offsets
    /// and counts). Each publication takes its bytes from a report it
    /// consumes, and every pending report sits in a live slot or an incoming
    /// batch: so if the bytes carried by those batches, and their reports,
    /// fit one batch, so does any step's output. A batch that would break
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
                 that no step's output overflows; drop this batch (or lower \
                 max_pending_steps)",
                batch.len(),
                batch.carried_len(),
                u32::MAX,
            )));
        }
        Ok(())
    }

    /// A rank may leave uncarried only bytes other ranks are bound to carry:
    /// then every event this merger can publish has a report with its bytes.
    fn check_carriers(&self, rank: usize, batch: &Batch) -> Result<()> {
        let carriers = &self.cfg.carriers;
        for i in 0..batch.len() {
            let rec = batch.record(i);
            if !rec.carried && carriers.carries(rank, &rec.identity, rec.kind, rec.group_idx) {
                return Err(Error::Config(format!(
                    "rank {rank} did not carry the bytes of event {i} ({}), which it must carry \
                     under rule {:?} with world size {} and replication factors {:?}: \
                     workers and merger must be configured alike",
                    rec.kind.name(),
                    carriers.rule.name(),
                    carriers.world_size,
                    carriers.replication_factors,
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
        self.unchecked[r] = self.defer_carrier_check && batch.uncarried() > 0;
        self.incoming[r] = Some(batch);
    }

    /// The carriers checks `add` deferred: a batch that fails is taken back
    /// as if `add` had refused it.
    fn check_deferred(&mut self) {
        for r in 0..self.unchecked.len() {
            if !std::mem::take(&mut self.unchecked[r]) {
                continue;
            }
            let batch = self.incoming[r].clone().expect("an unchecked rank's batch");
            if let Err(e) = self.check_carriers(r, &batch) {
                self.incoming[r] = None;
                self.stats.batches -= 1;
                self.stats.reports -= batch.len() as u64;
                self.incoming_load.0 -= batch.carried_len() as u64;
                self.incoming_load.1 -= batch.len() as u64;
                self.refused.push((r as i64, e));
            }
        }
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
        let mut out = match self.cfg.carriers.rule {
            Rule::Any => {
                self.check_deferred();
                union::finish(self)
            }
            Rule::All | Rule::Quorum => {
                if let Some(out) = shortcut.then(|| fast::finish(self)).flatten() {
                    out
                } else {
                    self.check_deferred();
                    if let Some(out) = shortcut.then(|| held::finish(self)).flatten() {
                        out
                    } else {
                        let out = segment::finish(self);
                        self.expire();
                        self.settle();
                        out
                    }
                }
            }
        };
        self.unchecked.fill(false);
        if let Some(guard) = &mut self.guard {
            guard.filter(&mut out, &mut self.stats);
        }
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.incoming_load = (0, 0);
        self.step += 1;
        self.stats.steps += 1;
        self.stats.published += out.len() as u64;
        out
    }

    /// Drops every pending report and this step's batches; they count as
    /// cleared. Counters and the step number stay; the guard holds nothing
    /// (the scheduler publishes a clear of its own).
    pub fn reset(&mut self) {
        let dropped = self.stats().pending;
        self.stats.cleared += dropped;
        self.incoming.iter_mut().for_each(|b| *b = None);
        self.incoming_load = (0, 0);
        self.unchecked.fill(false);
        self.queues.iter_mut().for_each(Queue::clear);
        self.held.iter_mut().for_each(VecDeque::clear);
        self.live = 0;
        self.fenced = 0;
        self.index.clear();
        self.indexed = false;
        self.slots = Slots::default();
        if let Some(guard) = &mut self.guard {
            guard.clear();
        }
    }
}

#[cfg(test)]
mod tests;
