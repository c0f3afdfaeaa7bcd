"""kvmerge: merge vLLM KV-cache events from many workers, in Rust.

`encode` runs on each worker, `Merger` on the scheduler; `kvmerge.vllm` holds
the `KVMergeMultiConnector` that wires both into vLLM.
"""

from kvmerge._kvmerge import (
    ConfigError,
    CorruptBatchError,
    EventBatch,
    GroupError,
    InvalidEventError,
    KVMergeError,
    Merger,
    MergerStats,
    RankError,
    encode,
)

__all__ = [
    "ConfigError",
    "CorruptBatchError",
    "EventBatch",
    "GroupError",
    "InvalidEventError",
    "KVMergeError",
    "Merger",
    "MergerStats",
    "RankError",
    "encode",
]
