//! Which ranks carry an event's bytes.
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
//! which bytes its batch carries, the merger to check that a rank carries
//! every event it must (so a published event always has its bytes).

use crate::error::{Error, Result};
use crate::identity::Identity;
use crate::rule::Rule;
use crate::schema::EventKind;

/// The largest world a merger accepts. The merger allocates per-rank state
/// up front (and its scratch grows with `world_size` per distinct event), so
/// an absurd world size must be refused, not attempted: an allocation that
/// large aborts the process. vLLM's largest TP x PP x PCP worlds are far
/// below this.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// What decides the carriers of an event: the world, the rule and (under
/// "quorum") the replication factors. Workers and merger must agree on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carriers {
    pub world_size: usize,
    pub rule: Rule,
    /// Per KV cache group TP replication factor; only with `Rule::Quorum`.
    pub replication_factors: Option<Vec<u32>>,
}

impl Carriers {
    pub fn new(world_size: usize, rule: Rule) -> Carriers {
        Carriers {
            world_size,
            rule,
            replication_factors: None,
        }
    }

    /// The replication factor "quorum" applies to an event: its group's for
    /// a `BlockStored` with a `group_idx`, 1 for everything else; None for a
    /// group `replication_factors` does not cover.
    pub fn replication_factor(&self, kind: EventKind, group: Option<i64>) -> Option<u32> {
        match (kind, group) {
            (EventKind::BlockStored, Some(g)) => {
                let factors = self.replication_factors.as_deref().unwrap_or(&[]);
                usize::try_from(g)
                    .ok()
                    .and_then(|g| factors.get(g))
                    .copied()
            }
            _ => Some(1),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_WORLD_SIZE).contains(&self.world_size) {
            return Err(Error::Config(format!(
                "world_size must be between 1 and {MAX_WORLD_SIZE}, got {}",
                self.world_size
            )));
        }
        match (&self.replication_factors, self.rule) {
            (None, Rule::Quorum) => Err(Error::Config(
                "rule \"quorum\" needs replication_factors (one TP replication factor per KV \
                 cache group)"
                    .into(),
            )),
            (Some(_), Rule::All | Rule::Any) => Err(Error::Config(format!(
                "replication_factors only apply to rule \"quorum\", not {:?}",
                self.rule.name()
            ))),
            (Some(factors), Rule::Quorum) => match factors.iter().position(|&f| f < 1) {
                Some(g) => Err(Error::Config(format!(
                    "replication_factors[{g}] is {}, must be at least 1",
                    factors[g]
                ))),
                None => Ok(()),
            },
            (None, _) => Ok(()),
        }
    }

    /// The fewest distinct ranks whose reports can publish this event.
    pub(crate) fn min_reporters(&self, kind: EventKind, group: Option<i64>) -> usize {
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

    /// The first of an event's carriers; the others follow it, going round.
    pub fn first(&self, identity: &Identity) -> usize {
        // Multiply-shift maps the 64 bits onto [0, w) as evenly as `%`,
        // without a division: this runs for every uncarried record received.
        ((identity.spread() as u128 * self.world_size as u128) >> 64) as usize
    }

    /// Whether `rank` must carry the bytes of this event (see the module docs).
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
        let first = self.first(identity);
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
    use crate::batch::Batch;
    use crate::testing::{batch, clear, removed, stored};

    fn carriers(c: &Carriers, b: &Batch, i: usize) -> Vec<usize> {
        let rec = b.record(i);
        (0..c.world_size)
            .filter(|&r| c.carries(r, &rec.identity, rec.kind, rec.group_idx))
            .collect()
    }

    #[test]
    fn every_possible_completion_includes_a_carrier() {
        let evs = [stored(1, Some(0)), stored(2, Some(1)), removed(3), clear()];
        let b = batch(&evs);
        for w in 1..=9usize {
            let all = [
                Carriers::new(w, Rule::All),
                Carriers::new(w, Rule::Any),
                Carriers {
                    replication_factors: Some(vec![2, 3]),
                    ..Carriers::new(w, Rule::Quorum)
                },
            ];
            for c in &all {
                for i in 0..b.len() {
                    let rec = b.record(i);
                    let q = c.min_reporters(rec.kind, rec.group_idx);
                    let who = carriers(c, &b, i);
                    // Every set of q ranks meets the carriers: checked by
                    // counting, there are fewer non-carriers than q.
                    assert!(w - who.len() < q, "{c:?} event {i}: {who:?}");
                    assert_eq!(who.len(), w - q + 1);
                }
            }
        }
    }

    #[test]
    fn carriers_spread_over_the_ranks() {
        let w = 8;
        let c = Carriers::new(w, Rule::All);
        let mut load = vec![0; w];
        for h in 0..=255u8 {
            let b = batch(&[removed(h)]);
            for r in carriers(&c, &b, 0) {
                load[r] += 1;
            }
        }
        // 128 distinct removals over 8 ranks: each rank carries some.
        assert!(load.iter().all(|&n| n > 4), "{load:?}");
    }
}
