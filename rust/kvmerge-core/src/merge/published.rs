//! What a step publishes, before any byte is copied: the events in order,
//! each a batch it arrived in and its index there.

use std::sync::Arc;

use crate::batch::Batch;

pub struct Published {
    picks: Vec<(Arc<Batch>, u32)>,
}

impl Published {
    pub(super) fn new(picks: Vec<(Arc<Batch>, u32)>) -> Published {
        debug_assert!(picks.iter().all(|(b, i)| b.carries(*i as usize)));
        Published { picks }
    }

    /// Every event of `batch`, in order.
    pub(super) fn whole(batch: &Arc<Batch>) -> Published {
        Published::new(
            (0..batch.len() as u32)
                .map(|i| (batch.clone(), i))
                .collect(),
        )
    }

    /// Keeps the events `keep` says yes to, asked in publication order.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Batch, usize) -> bool) {
        self.picks.retain(|(b, i)| keep(b, *i as usize));
    }

    pub fn len(&self) -> usize {
        self.picks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.picks.is_empty()
    }

    /// Each event's batch and index, in publication order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&Arc<Batch>, usize)> + Clone {
        self.picks.iter().map(|(b, i)| (b, *i as usize))
    }

    /// The events as one batch: the batch they came in when that is all of
    /// it, in order (no copy), else a new one.
    pub fn into_batch(self) -> Arc<Batch> {
        if let Some((first, _)) = self.picks.first() {
            let whole = first.len() == self.picks.len()
                && self
                    .picks
                    .iter()
                    .enumerate()
                    .all(|(k, (b, i))| Arc::ptr_eq(b, first) && *i as usize == k);
            if whole {
                return first.clone();
            }
        }
        Arc::new(Batch::gather(self.iter().map(|(b, i)| (&**b, i))))
    }
}
