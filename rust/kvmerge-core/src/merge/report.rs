//! The small values every rule works with: a report, its position, and a
//! publication.

use crate::identity::Identity;

/// One event in one rank's batch, waiting for the other ranks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Report {
    pub identity: Identity,
    pub step: u64,
    pub slot: u32,
    pub idx: u32,
    /// Replication factor under "quorum" (1 for everything else).
    pub factor: u32,
    pub clear: bool,
    pub carried: bool,
}

impl Report {
    pub fn publication(&self) -> Publication {
        Publication {
            slot: self.slot,
            idx: self.idx,
            carried: self.carried,
        }
    }
}

/// Where a report stands among all reports: `(step, index, rank)`.
pub(super) type Position = (u64, u32, u32);

/// A published event: which batch slot and which event in it, and whether
/// that batch carries the event's bytes (the output needs one report that
/// does).
#[derive(Debug, Clone, Copy)]
pub(super) struct Publication {
    pub slot: u32,
    pub idx: u32,
    pub carried: bool,
}

impl Publication {
    /// Keeps the first report that carries the bytes.
    pub fn prefer_carried(&mut self, other: Publication) {
        if !self.carried && other.carried {
            *self = other;
        }
    }
}
