"""The named workloads: knob settings of ``WorkloadConfig`` (the sizes come
from the grid). Plain data, importable without vLLM, so that ``--help`` can
name them."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Every rank reports the same events: TP workers storing the same blocks.
    # 1-16 blocks per BlockStored (8.5 on average).
    "uniform": {},
    # One block per BlockStored, as vLLM's Mooncake store reports its stores:
    # the same number of reports, a sixteenth to an eighth of the tokens.
    "one-block": {"max_hashes": 1},
    "bytes": {"bytes_hashes": True},
    # 2% of events missing on some ranks, 2% a step late on one rank, 2%
    # reported twice by one rank.
    "skewed": {"missing": 0.02, "late": 0.02, "duplicate": 0.02},
    # A third, list-based child, and a clear every third step.
    "clears": {"children": ("lmcache", "mooncake", "list"), "clear_every": 3},
    # The last rank always one step late, or silent: compared with "uniform"
    # at the same size (the straggler targets).
    "straggler": {"late_rank": True},
    "silent": {"silent_rank": True},
}

#: The workloads the default grid runs beside the uniform one: all the others.
OTHER_WORKLOADS: tuple[str, ...] = tuple(w for w in PRESETS if w != "uniform")
