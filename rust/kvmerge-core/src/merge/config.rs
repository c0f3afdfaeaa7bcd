use crate::error::{Error, Result};
use crate::schema::EventKind;

/// How reports from different ranks combine; see docs/merge-rules.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Every rank must report an event (multiset intersection).
    All,
    /// Enough distinct ranks, given each KV cache group's replication factor.
    Quorum,
    /// Ordered union of one step's reports.
    Any,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::All => "all",
            Rule::Quorum => "quorum",
            Rule::Any => "any",
        }
    }
}

impl std::str::FromStr for Rule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Rule> {
        match s {
            "all" => Ok(Rule::All),
            "quorum" => Ok(Rule::Quorum),
            "any" => Ok(Rule::Any),
            other => Err(Error::Config(format!(
                "unknown rule {other:?}: expected \"all\", \"quorum\" or \"any\""
            ))),
        }
    }
}

/// The largest world a merger accepts. The merger allocates per-rank state
/// up front (and its scratch grows with `world_size` per distinct event), so
/// an absurd world size must be refused, not attempted: an allocation that
/// large aborts the process. vLLM's largest TP x PP x PCP worlds are far
/// below this.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergerConfig {
    pub world_size: usize,
    pub rule: Rule,
    /// Per KV cache group TP replication factor; only with `Rule::Quorum`.
    pub replication_factors: Option<Vec<u32>>,
    pub max_pending_steps: u64,
}

impl MergerConfig {
    pub fn new(world_size: usize, rule: Rule) -> MergerConfig {
        MergerConfig {
            world_size,
            rule,
            replication_factors: None,
            max_pending_steps: 32,
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
}
