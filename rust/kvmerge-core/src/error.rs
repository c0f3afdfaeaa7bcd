use crate::schema::SchemaError;

/// Every way the core can refuse its input. Each variant maps to one Python
/// exception class in the binding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The bytes are not a kvmerge batch, or not one intact.
    #[error("corrupt batch: {0}")]
    CorruptBatch(String),
    /// An event to encode does not have vLLM 0.33.0's shape.
    #[error("event {index}: {reason}")]
    InvalidEvent { index: usize, reason: SchemaError },
    /// The payload to encode is not a msgpack array of events at all.
    #[error("events: {0}")]
    InvalidPayload(String),
    #[error("{0}")]
    Config(String),
    #[error("rank {rank} is outside the world [0, {world_size})")]
    RankOutOfRange { rank: i64, world_size: usize },
    #[error("rank {rank} already added a batch in step {step}")]
    DuplicateRank { rank: usize, step: u64 },
    #[error(
        "event {index} is a BlockStored with group_idx {group}, but replication_factors \
         has {n_factors} entries (groups 0..{n_factors})"
    )]
    GroupOutOfRange {
        index: usize,
        group: i64,
        n_factors: usize,
    },
    /// A batch, or one step's merged output, would exceed the format's
    /// limits (4 GiB of events, 2^32 - 1 events): 32-bit offsets.
    #[error("{0}")]
    TooLarge(String),
}

pub type Result<T> = std::result::Result<T, Error>;
