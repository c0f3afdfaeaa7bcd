//! kvmerge's engine: encode vLLM KV-cache events into batches with
//! fixed-size identities, and merge the batches many workers report into the
//! events to publish once. No Python here; `kvmerge-py` binds it.
//!
//! The rules are specified in `docs/merge-rules.md`.

pub mod batch;
pub mod error;
pub mod identity;
pub mod merge;
pub mod msgpack;
pub mod schema;

pub use batch::{Backing, Batch, FillError, Record};
pub use error::{Error, Result};
pub use identity::Identity;
pub use merge::{Merger, MergerConfig, Rule, Stats};
pub use schema::{EventKind, SchemaError};

/// Event builders for tests and benchmarks; not part of the stable API.
#[doc(hidden)]
pub mod testing;
