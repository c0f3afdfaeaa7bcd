//! Why the step refused an output, or one child's part of it: each kind
//! declared once (`refusal_kinds!`), with its name in Python and its meaning
//! (`_refusal_kinds()`, docs/robustness.md).

use std::fmt;

macro_rules! refusal_kinds {
    ($($variant:ident => $name:literal, $doc:literal;)*) => {
        /// Why the step refused an output, or one child's part of it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kind {
            $(#[doc = $doc] $variant,)*
        }

        impl Kind {
            pub const ALL: &'static [Kind] = &[$(Kind::$variant,)*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Kind::$variant => $name,)*
                }
            }

            pub fn doc(self) -> &'static str {
                match self {
                    $(Kind::$variant => $doc,)*
                }
            }
        }
    };
}

refusal_kinds! {
    Output => "output", "Not a worker output, or one whose buffer is damaged.";
    Rank => "rank", "A rank outside the aggregated world.";
    Duplicate => "duplicate", "A second output of one rank in one step.";
    Settings => "settings", "The worker's settings differ from the scheduler's.";
    Misconfigured => "misconfigured", "An output of a rank whose settings differed.";
    Children => "children", "Another number of children than the scheduler's.";
    Encode => "encode", "The worker could not encode or send the child's events.";
    Native => "native", "A native child's container that is no KVConnectorKVEvents, or not of the other ranks' class.";
    Family => "family", "A container family, or mode, this child cannot take.";
    Factors => "factors", "Replication factors that are missing, invalid or disagree.";
    Batch => "batch", "A batch that does not read (damaged in transit).";
    Merge => "merge", "The child's merger refused the batch.";
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One refusal: what, whose (a rank, when known), where (a child, or every
/// child when the whole output was refused), and the detail an operator
/// reads in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: Kind,
    pub rank: Option<i64>,
    pub child: Option<usize>,
    pub detail: String,
}

/// A child's part refused: its kind and detail (the step adds rank and child).
pub type Why = (Kind, String);
