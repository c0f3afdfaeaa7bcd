//! The merger's state, and the bookkeeping every rule shares: queuing a
//! step's batches, indexing them, settling, expiring, and the step's output.
//! The rules (`segment`, `prefix`, `union`, `fast`) work on it; the public
//! operations are in `merge` itself.

use std::collections::VecDeque;
use std::sync::Arc;

use super::config::MergerConfig;
use super::guard::Guard;
use super::pending::{Held, Index, Queue};
use super::published::Published;
use super::report::{Publication, Report};
use super::slots::{Released, Slots};
use super::stats::Stats;
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::identity::IdentitySet;
use crate::schema::EventKind;

/// Merges per-rank batches into the events to publish once
/// (docs/merge-rules.md); its operations are in `merge`.
pub struct Merger {
    pub(super) cfg: MergerConfig,
    pub(super) step: u64,
    pub(super) incoming: Vec<Option<Arc<Batch>>>,
    /// The incoming batches' carried bytes and reports (see `Slots::load`).
    pub(super) incoming_load: (u64, u64),
    pub(super) queues: Vec<Queue>,
    /// Per rank, batches pending whole instead of queued, oldest first (see
    /// `held`): then nothing is queued on any rank, and the ranks that hold
    /// any hold batches of the same steps.
    pub(super) held: Vec<VecDeque<Held>>,
    /// Live reports in the queues and the held batches.
    pub(super) live: u64,
    /// Ranks with a fence (a pending clear).
    pub(super) fenced: usize,
    /// Whether `index` holds every eligible report (else the queues are
    /// prefixes of one sequence: see `prefix`).
    pub(super) indexed: bool,
    pub(super) index: Index,
    /// Scratch for `prefix` under "quorum" (kept for its capacity).
    pub(super) scratch: IdentitySet,
    /// Tests: never prefix mode, to check that it changes nothing.
    #[cfg(test)]
    pub(super) index_only: bool,
    pub(super) slots: Slots,
    pub(super) stats: Stats,
    /// The guard, when the merger has one (`Merger::with_guard`).
    pub(super) guard: Option<Box<Guard>>,
    /// Whether `add` leaves the carriers check to `finish_step`
    /// (`Merger::with_deferred_carrier_check`).
    pub(super) defer_carrier_check: bool,
    /// Per rank: this step's batch still owes its carriers check.
    pub(super) unchecked: Vec<bool>,
    /// Batches the deferred check refused, for `take_refused`.
    pub(super) refused: Vec<(i64, Error)>,
}

impl Merger {
    pub fn new(cfg: MergerConfig) -> Result<Merger> {
        cfg.validate()?;
        let w = cfg.carriers.world_size;
        Ok(Merger {
            step: 0,
            incoming: vec![None; w],
            incoming_load: (0, 0),
            queues: (0..w).map(|_| Queue::default()).collect(),
            held: (0..w).map(|_| VecDeque::new()).collect(),
            live: 0,
            fenced: 0,
            indexed: false,
            index: Index::default(),
            scratch: IdentitySet::default(),
            #[cfg(test)]
            index_only: false,
            slots: Slots::default(),
            stats: Stats::default(),
            guard: None,
            defer_carrier_check: false,
            unchecked: vec![false; w],
            refused: Vec::new(),
            cfg,
        })
    }

    pub(super) fn factor_of(&self, batch: &Batch, i: usize) -> u32 {
        let carriers = &self.cfg.carriers;
        if carriers.replication_factors.is_none() {
            return 1;
        }
        let rec = batch.record(i);
        // `check` refused groups without a factor, but for a batch whose
        // digest lied (its groups were taken as those of the batch it
        // claimed to be alike): such a report needs every rank.
        carriers
            .replication_factor(rec.kind, rec.group_idx)
            .unwrap_or(1)
    }

    pub(super) fn enqueue_incoming(&mut self) {
        for rank in 0..self.cfg.carriers.world_size {
            let Some(batch) = self.incoming[rank].take() else {
                continue;
            };
            if batch.is_empty() {
                continue;
            }
            let slot = self.slots.insert(batch.clone(), batch.len() as u32);
            self.queue_reports(rank, &batch, slot, self.step);
            self.live += batch.len() as u64;
        }
    }

    /// `rank`'s batch, pending whole from this step on (see `held`).
    pub(super) fn hold_batch(&mut self, rank: usize, batch: Arc<Batch>) {
        let n = batch.len();
        let slot = self.slots.insert(batch, n as u32);
        self.held[rank].push_back(Held {
            slot,
            step: self.step,
        });
        self.live += n as u64;
    }

    /// Drops the held batches made `max_pending_steps` steps ago, as
    /// `expire` drops their reports from the queues (every report of a
    /// held batch is live).
    pub(super) fn expire_held(&mut self) {
        let horizon = self.cfg.max_pending_steps;
        for r in 0..self.held.len() {
            while let Some(h) = self.held[r]
                .front()
                .copied()
                .filter(|h| h.step.saturating_add(horizon) <= self.step)
            {
                self.held[r].pop_front();
                let n = self.slots.arc(h.slot).len() as u64;
                self.slots.release_n(h.slot, n as u32);
                self.stats.expired += n;
                self.live -= n;
            }
        }
    }

    /// Queues the held batches' reports, as `enqueue_incoming` would have
    /// in the steps they came (their reports stay live, in their slots).
    pub(super) fn expand_held(&mut self) {
        for rank in 0..self.held.len() {
            while let Some(h) = self.held[rank].pop_front() {
                let batch = self.slots.arc(h.slot);
                self.queue_reports(rank, &batch, h.slot, h.step);
            }
        }
    }

    fn queue_reports(&mut self, rank: usize, batch: &Batch, slot: u32, step: u64) {
        for i in 0..batch.len() {
            let report = Report {
                identity: batch.identity(i),
                step,
                slot,
                idx: i as u32,
                factor: self.factor_of(batch, i),
                clear: batch.kind(i) == EventKind::AllBlocksCleared,
                carried: batch.carries(i),
            };
            if report.clear && self.queues[rank].clears.is_empty() {
                self.fenced += 1;
            }
            self.queues[rank].push(report);
        }
    }

    /// Leaves prefix mode: every eligible report linked, every identity to
    /// be checked (once; each report is indexed once).
    pub(super) fn index_all(&mut self) {
        self.indexed = true;
        let Merger { queues, index, .. } = self;
        for r in 0..queues.len() {
            let (from, to) = (queues[r].base, queues[r].eligible_end());
            index.link_range(queues, r, from, to);
        }
    }

    /// Drops dead reports at the queues' fronts; with nothing pending,
    /// "all" and "quorum" go back to prefix mode.
    pub(super) fn settle(&mut self) {
        self.queues.iter_mut().for_each(Queue::pop_dead);
        #[cfg(test)]
        if self.index_only {
            return;
        }
        if self.live == 0 && self.indexed {
            debug_assert!(self.index.map.is_empty());
            self.queues.iter_mut().for_each(Queue::clear);
            self.index.clear();
            self.indexed = false;
        }
    }

    /// The step's output, then the slots of the reports it used released.
    pub(super) fn output(&mut self, pubs: &[Publication], released: Released) -> Published {
        let out = self.published(pubs);
        released.release(&mut self.slots);
        out
    }

    /// Drops the reports made `max_pending_steps` steps ago: per queue, from
    /// the front, so only the expiring reports are visited.
    pub(super) fn expire(&mut self) {
        let horizon = self.cfg.max_pending_steps;
        let step = self.step;
        let indexed = self.indexed;
        let Merger {
            queues,
            index,
            slots,
            stats,
            live,
            fenced,
            ..
        } = self;
        // In prefix mode: how many live reports each queue dropped.
        let mut dropped = vec![0usize; if indexed { 0 } else { queues.len() }];
        for r in 0..queues.len() {
            let fence = queues[r].clears.front().copied();
            let mut lost_fence = false;
            // Saturating: a horizon near u64::MAX means "never", not a wrap
            // that would expire everything at once.
            while queues[r]
                .nodes
                .front()
                .is_some_and(|n| n.rep.step.saturating_add(horizon) <= step)
            {
                let seq = queues[r].base;
                let node = queues[r].pop_front().expect("front exists");
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
                    queues[r].clears.pop_front();
                    lost_fence = true;
                } else if indexed && fence.is_none_or(|f| seq < f) {
                    index.unlink_head(&node.rep.identity, r, node.next);
                }
            }
            if lost_fence {
                if queues[r].clears.is_empty() {
                    *fenced -= 1;
                }
                // The reports behind an expired fence are eligible from
                // the next step on (touched: checked then).
                if indexed {
                    let from = queues[r].base.max(fence.expect("a fence expired") + 1);
                    let to = queues[r].eligible_end();
                    index.link_range(queues, r, from, to);
                }
            }
        }
        if !indexed {
            // Still prefixes of one sequence if every queue left non-empty
            // lost as many reports from the front.
            let mut left = queues
                .iter()
                .zip(&dropped)
                .filter(|(q, _)| !q.nodes.is_empty());
            if let Some((_, &first)) = left.next() {
                if left.any(|(_, &d)| d != first) {
                    self.index_all();
                }
            }
        }
    }

    pub(super) fn published(&self, pubs: &[Publication]) -> Published {
        // Published::new asserts each pick has its bytes (check_carriers).
        Published::new(
            pubs.iter()
                .map(|p| (self.slots.arc(p.slot), p.idx))
                .collect(),
        )
    }
}
