//! Which ranks send an event's bytes.
//!
//! Every rank reports every event's identity (its record), but the scheduler
//! only needs one copy of the bytes of each event it publishes. Under rules
//! "all" and "quorum" an event is published only when at least `q` distinct
//! ranks reported it (`q = world_size` under "all", `ceil(world_size / f)`
//! under "quorum" with factor `f`, `world_size` for clears and removals). If
//! `world_size - q + 1` ranks carry the bytes, any `q` distinct ranks include
//! one of them (the other `q - 1` ranks are too few): whatever subset of
//! ranks completes the event, a carrier is among them. The carriers are
//! consecutive ranks starting at a rank taken from the identity, so every
//! rank carries about the same share.
//!
//! Workers and the scheduler apply the same function: the worker to decide
//! what to leave out, the merger to check that a rank left out nothing it
//! had to carry (so a published event always has its bytes).

use super::{MergerConfig, Rule};
use crate::identity::Identity;
use crate::schema::EventKind;

impl MergerConfig {
    /// The fewest distinct ranks whose reports can publish this event.
    fn min_reporters(&self, kind: EventKind, group: Option<i64>) -> usize {
        let w = self.world_size;
        match self.rule {
            Rule::Any => 1,
            Rule::All => w,
            Rule::Quorum => match self.replication_factor(kind, group) {
                Some(f) => w.div_ceil(f as usize),
                // A group without a factor is refused by `Merger::add`;
                // until then, every rank keeps the bytes.
                None => 1,
            },
        }
    }

    /// Whether `rank` must send the bytes of this event (see the module docs).
    pub fn carries(
        &self,
        rank: usize,
        identity: &Identity,
        kind: EventKind,
        group: Option<i64>,
    ) -> bool {
        let w = self.world_size;
        let carriers = w - self.min_reporters(kind, group) + 1;
        if carriers >= w {
            return true;
        }
        // Multiply-shift maps the 64 bits onto [0, w) as evenly as `%`,
        // without a division: this runs for every left-out record received.
        let first = ((identity.spread() as u128 * w as u128) >> 64) as usize;
        // `rank`'s distance after `first`, going round: `(rank - first) mod w`.
        let after = if rank >= first {
            rank - first
        } else {
            rank + w - first
        };
        after < carriers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{batch, clear, removed, stored};

    fn carriers(cfg: &MergerConfig, b: &crate::Batch, i: usize) -> Vec<usize> {
        let rec = b.record(i);
        (0..cfg.world_size)
            .filter(|&r| cfg.carries(r, &rec.identity, rec.kind, rec.group_idx))
            .collect()
    }

    #[test]
    fn every_possible_completion_includes_a_carrier() {
        let evs = [stored(1, Some(0)), stored(2, Some(1)), removed(3), clear()];
        let b = batch(&evs);
        for w in 1..=9usize {
            let cfgs = [
                MergerConfig::new(w, Rule::All),
                MergerConfig::new(w, Rule::Any),
                MergerConfig {
                    replication_factors: Some(vec![2, 3]),
                    ..MergerConfig::new(w, Rule::Quorum)
                },
            ];
            for cfg in &cfgs {
                for i in 0..b.len() {
                    let rec = b.record(i);
                    let q = cfg.min_reporters(rec.kind, rec.group_idx);
                    let c = carriers(cfg, &b, i);
                    // Every set of q ranks meets the carriers: checked by
                    // counting, there are fewer non-carriers than q.
                    assert!(w - c.len() < q, "{cfg:?} event {i}: {c:?}");
                    assert_eq!(c.len(), w - q + 1);
                }
            }
        }
    }

    #[test]
    fn carriers_spread_over_the_ranks() {
        let w = 8;
        let cfg = MergerConfig::new(w, Rule::All);
        let mut load = vec![0; w];
        for h in 0..=255u8 {
            let b = batch(&[removed(h)]);
            for r in carriers(&cfg, &b, 0) {
                load[r] += 1;
            }
        }
        // 128 distinct removals over 8 ranks: each rank carries some.
        assert!(load.iter().all(|&n| n > 4), "{load:?}");
    }
}
