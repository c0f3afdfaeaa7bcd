use crate::carriers::Carriers;
use crate::error::Result;
use crate::rule::Rule;

/// How many steps a report waits for the other ranks unless configured
/// otherwise (`MergerConfig::new`, and the binding's `Merger`).
pub const DEFAULT_MAX_PENDING_STEPS: u64 = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergerConfig {
    /// The world, the rule and the replication factors (which also decide
    /// which ranks carry each event's bytes).
    pub carriers: Carriers,
    pub max_pending_steps: u64,
}

impl MergerConfig {
    pub fn new(world_size: usize, rule: Rule) -> MergerConfig {
        MergerConfig {
            carriers: Carriers::new(world_size, rule),
            max_pending_steps: DEFAULT_MAX_PENDING_STEPS,
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.carriers.validate()
    }
}
