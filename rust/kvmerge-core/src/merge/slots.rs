//! Batches that pending reports still point into, with a count of those
//! reports: a batch is dropped when its last report is used, cleared or
//! expired, which bounds memory by the pending window.

use std::sync::Arc;

use crate::batch::Batch;

#[derive(Default)]
pub(super) struct Slots {
    entries: Vec<Option<(Arc<Batch>, u32)>>,
    free: Vec<u32>,
}

impl Slots {
    pub fn insert(&mut self, batch: Arc<Batch>, live: u32) -> u32 {
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
        let entry = self.entries[slot as usize].as_mut().expect("live slot");
        entry.1 -= 1;
        if entry.1 == 0 {
            self.entries[slot as usize] = None;
            self.free.push(slot);
        }
    }

    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.entries.iter().flatten().count()
    }
}
