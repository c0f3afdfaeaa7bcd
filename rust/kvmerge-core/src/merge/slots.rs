//! Batches that pending reports still point into, with a count of those
//! reports: a batch is dropped when its last report is used, cleared or
//! expired, which bounds memory by the pending window.

use std::sync::Arc;

use crate::batch::Batch;

#[derive(Default)]
pub(super) struct Slots {
    entries: Vec<Option<(Arc<Batch>, u32)>>,
    free: Vec<u32>,
    /// Over the live slots: the bytes of events their batches carry, and
    /// the reports that point into them. Every pending report is in a live
    /// slot, so these bound what the pending reports can publish.
    carried: u64,
    reports: u64,
}

impl Slots {
    pub fn insert(&mut self, batch: Arc<Batch>, live: u32) -> u32 {
        self.carried += batch.carried_len() as u64;
        self.reports += live as u64;
        match self.free.pop() {
            Some(slot) => {
                self.entries[slot as usize] = Some((batch, live));
                slot
            }
            None => {
                self.entries.push(Some((batch, live)));
                (self.entries.len() - 1) as u32
            }
        }
    }

    pub fn arc(&self, slot: u32) -> Arc<Batch> {
        self.entries[slot as usize]
            .as_ref()
            .expect("live slot")
            .0
            .clone()
    }

    /// One fewer report points into `slot`.
    pub fn release(&mut self, slot: u32) {
        self.release_n(slot, 1);
    }

    /// `n` fewer reports point into `slot`.
    pub fn release_n(&mut self, slot: u32, n: u32) {
        let entry = self.entries[slot as usize].as_mut().expect("live slot");
        entry.1 -= n;
        self.reports -= n as u64;
        if entry.1 == 0 {
            self.carried -= entry.0.carried_len() as u64;
            self.entries[slot as usize] = None;
            self.free.push(slot);
        }
    }

    /// Bytes of events carried by the live slots' batches, and the reports
    /// pointing into them.
    pub fn load(&self) -> (u64, u64) {
        (self.carried, self.reports)
    }

    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.entries.iter().flatten().count()
    }
}

/// The slots of the reports a step used, released once its output is
/// gathered from them: as runs of one slot. A step uses reports in queue
/// order, so they come a batch at a time, and releasing a run is one update
/// where one per report was a tenth of a straggler's step.
#[derive(Default)]
pub(super) struct Released(Vec<(u32, u32)>);

impl Released {
    pub fn push(&mut self, slot: u32) {
        match self.0.last_mut() {
            Some((last, n)) if *last == slot => *n += 1,
            _ => self.0.push((slot, 1)),
        }
    }

    pub fn release(self, slots: &mut Slots) {
        for (slot, n) in self.0 {
            slots.release_n(slot, n);
        }
    }
}
