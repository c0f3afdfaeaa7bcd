//! How reports from different ranks combine.

use crate::error::{Error, Result};

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
