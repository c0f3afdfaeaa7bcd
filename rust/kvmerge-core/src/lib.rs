//! kvmerge's engine: encode vLLM KV-cache events into batches with
//! fixed-size identities, and merge the batches many workers report into the
//! events to publish once; and the scheduler's step around it (`step`): the
//! wire form a worker's output travels in, and every check of a step. No
//! Python here; `kvmerge-py` binds it.
//!
//! The rules are specified in `docs/merge-rules.md`.

pub mod batch;
pub mod carriers;
pub mod error;
pub mod identity;
pub mod merge;
pub mod msgpack;
pub mod rule;
pub mod schema;
pub mod step;

pub use batch::{Backing, Batch, FillError, Record, Written};
pub use carriers::{Carriers, MAX_WORLD_SIZE};
pub use error::{Error, Result};
pub use identity::Identity;
pub use merge::{Merger, MergerConfig, Stats, DEFAULT_MAX_PENDING_STEPS};
pub use rule::Rule;
pub use schema::{EventKind, SchemaError};

/// Event builders for tests, benchmarks, examples and the fuzz targets (the
/// `testing` feature); not part of the stable API.
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
