"""Hypothesis strategies: vLLM KV cache events and per-rank step scenarios.

Merging only does something when ranks report *the same* events, so scenarios
draw from a small pool of events and then perturb one common sequence per
rank (missing, late, duplicated, reordered reports, silent ranks) instead of
drawing every rank's batch independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from hypothesis import strategies as st
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

#: vLLM 0.32's BlockStored has no lookahead_token_ids (0.33 added it).
HAS_LOOKAHEAD = "lookahead_token_ids" in BlockStored.__struct_fields__
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1

# Both wire forms of ExternalBlockHash; the extremes matter (msgpack picks a
# different integer width for each range).
int_hashes = st.one_of(
    st.sampled_from([0, 1, -1, INT64_MIN, UINT64_MAX, 2**63 - 1, 2**63, 2**32]),
    st.integers(INT64_MIN, UINT64_MAX),
)
bytes_hashes = st.binary(min_size=0, max_size=40)
block_hashes_ = st.one_of(int_hashes, bytes_hashes)
small_ints = st.integers(-(2**31), 2**31)
texts = st.text(max_size=8)
opt_texts = st.none() | texts
opt_ints = st.none() | small_ints
# extra_keys entries are tuples of scalars (LoRA name, cache salt, prompt
# embedding digests...). Tuples, not lists: vLLM `==` tells them apart, msgpack
# does not. vLLM also nests (mm_identifier, offset) pairs in them, but msgpack
# turns a nested tuple into a list, so those cannot round-trip `==`-equal.
extra_key = st.none() | st.lists(
    texts | small_ints | st.binary(max_size=8), max_size=3
).map(tuple)


def group_indices(n_groups: int | None) -> st.SearchStrategy[int | None]:
    """group_idx values: any int when n_groups is None, else a valid group."""
    if n_groups is None:
        return st.none() | st.integers(0, 3) | st.integers(-(2**31), 2**31)
    if n_groups == 0:
        return st.none()
    return st.none() | st.integers(0, n_groups - 1)


@st.composite
def block_stored(draw, n_groups: int | None = None) -> BlockStored:
    n = draw(st.integers(0, 4))
    hashes = draw(st.lists(block_hashes_, min_size=n, max_size=n))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | block_hashes_),
        token_ids=draw(st.lists(small_ints, max_size=6)),
        block_size=draw(st.sampled_from([1, 16]) | small_ints),
        lora_id=draw(opt_ints),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU", "STORAGE"]) | texts),
        lora_name=draw(opt_texts),
        extra_keys=draw(st.none() | st.lists(extra_key, min_size=n, max_size=n)),
        group_idx=draw(group_indices(n_groups)),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full", "sliding"])),
        kv_cache_spec_sliding_window=draw(opt_ints),
        locality=draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=draw(opt_texts),
        session_id=draw(opt_texts),
        **(
            {
                "lookahead_token_ids": draw(
                    st.none()
                    | st.lists(st.lists(small_ints, max_size=3), min_size=n, max_size=n)
                )
            }
            if HAS_LOOKAHEAD
            else {}
        ),
    )


@st.composite
def block_removed(draw, n_groups: int | None = None) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=draw(st.lists(block_hashes_, max_size=4)),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU"]) | texts),
        group_idx=draw(group_indices(n_groups)),
        locality=draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=draw(opt_texts),
    )


def events(n_groups: int | None = None):
    """Any single KV cache event. Under "quorum" pass the number of groups."""
    return st.one_of(
        block_stored(n_groups),
        block_removed(n_groups),
        st.just(AllBlocksCleared()),
    )


def key(event: object) -> bytes:
    """A hashable stand-in for an event (AllBlocksCleared is not hashable)."""
    return msgspec.msgpack.encode(event)


@st.composite
def pools(draw, n_groups: int | None = None, max_size: int = 6) -> list[object]:
    """A few distinct non-clear events; scenarios reuse them across ranks."""
    stored = block_stored(n_groups)
    removed = block_removed(n_groups)
    # Near-twins (same hashes, one field differs) must stay apart.
    twins = stored.flatmap(
        lambda e: st.tuples(
            st.just(e),
            st.builds(
                lambda g: msgspec.structs.replace(
                    e, session_id=(e.session_id or "") + g
                ),
                st.sampled_from(["x", "y"]),
            ),
        )
    )
    drawn = draw(
        st.lists(
            st.one_of(
                stored.map(lambda e: [e]), removed.map(lambda e: [e]), twins.map(list)
            ),
            min_size=1,
            max_size=max_size,
        )
    )
    pool, seen = [], set()
    for group in drawn:
        for e in group:
            if key(e) not in seen:
                seen.add(key(e))
                pool.append(e)
    return pool


CLEAR = AllBlocksCleared()


@st.composite
def base_sequence(draw, pool: list[object], clears: bool = True) -> list[object]:
    """One step's "true" sequence of events: pool items, maybe a clear."""
    item = st.sampled_from(pool)
    if clears:
        item = st.one_of(item, item, item, item, st.just(CLEAR))
    return draw(st.lists(item, max_size=6))


@dataclass
class Scenario:
    """steps[s][rank] is the batch rank adds in step s; absent ranks are silent."""

    world_size: int
    steps: list[dict[int, list[object]]]


WORLD_SIZES = st.integers(1, 5)
STEP_COUNTS = st.integers(1, 6)
MODES = ["same"] * 6 + ["miss", "late", "dup", "reorder", "silent", "empty", "random"]


@st.composite
def scenarios(
    draw,
    world_size: int | st.SearchStrategy[int] = WORLD_SIZES,
    pool: list[object] | None = None,
    n_groups: int | None = None,
    n_steps: st.SearchStrategy[int] = STEP_COUNTS,
    clears: bool = True,
) -> Scenario:
    """Per-step, per-rank batches: mostly the common sequence, perturbed."""
    if not isinstance(world_size, int):
        world_size = draw(world_size)
    if pool is None:
        pool = draw(pools(n_groups))
    steps = draw(n_steps)
    base = [draw(base_sequence(pool, clears)) for _ in range(steps)]
    out: list[dict[int, list[object]]] = [{} for _ in range(steps)]
    # In a synchronized step every rank reports exactly the common sequence
    # (the engine has a fast path for that), whatever is still pending.
    synced = [draw(st.integers(0, 3)) == 0 for _ in range(steps)]
    for rank in range(world_size):
        carry: list[object] = []  # reports this rank makes a step late
        for s in range(steps):
            batch = carry + list(base[s])
            carry = []
            mode = "sync" if synced[s] else draw(st.sampled_from(MODES))
            if mode == "sync":
                batch = list(base[s])
            elif mode == "miss" and batch:
                drop = draw(st.sets(st.integers(0, len(batch) - 1), min_size=1))
                batch = [e for i, e in enumerate(batch) if i not in drop]
            elif mode == "late" and batch:
                cut = draw(st.integers(0, len(batch) - 1))
                batch, carry = batch[:cut], batch[cut:]
            elif mode == "dup" and batch:
                i = draw(st.integers(0, len(batch) - 1))
                batch.insert(draw(st.integers(i, len(batch))), batch[i])
            elif mode == "reorder":
                batch = draw(st.permutations(batch))
            elif mode == "silent":
                continue
            elif mode == "empty":
                batch = []
            elif mode == "random":
                batch = draw(base_sequence(pool, clears))
            out[s][rank] = list(batch)
    return Scenario(world_size, out)


# Configurations -------------------------------------------------------------

max_pending = st.sampled_from([0, 1, 2, 32]) | st.integers(0, 4)


@st.composite
def quorum_configs(draw) -> tuple[int, list[int]]:
    """(world_size, replication_factors), GQA-like factors included."""
    return draw(
        st.sampled_from([(8, [1, 4, 2]), (4, [1, 2]), (2, [1, 2]), (6, [1, 3, 2])])
        | st.tuples(
            st.integers(1, 5), st.lists(st.integers(1, 6), min_size=1, max_size=3)
        )
    )


# The guard ------------------------------------------------------------------

#: A few block hashes of both wire forms, equal as numbers but not as hashes
#: (1 and b"\x01"), so stores, removals and parents meet often.
chain_hashes = st.sampled_from([0, 1, 2, -1, b"\x01", b"\x02", b""])
chain_media = st.sampled_from([None, "CPU", "GPU"])


@st.composite
def chain_stored(draw, n_groups: int | None = None) -> BlockStored:
    """A store over `chain_hashes`: often a child, sometimes of two blocks."""
    hashes = draw(st.lists(chain_hashes, min_size=1, max_size=2))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | chain_hashes),
        token_ids=list(range(len(hashes))),
        block_size=1,
        lora_id=None,
        medium=draw(chain_media),
        lora_name=None,
        group_idx=draw(group_indices(n_groups)) if n_groups else None,
    )


@st.composite
def chain_removed(draw) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=draw(st.lists(chain_hashes, min_size=1, max_size=2)),
        medium=draw(chain_media),
    )


@st.composite
def chain_pools(draw, n_groups: int | None = None, max_size: int = 8) -> list[object]:
    """Distinct stores and removals of a few blocks: some of the streams the
    rules publish of them are valid for a router, some are not."""
    drawn = draw(
        st.lists(
            st.one_of(chain_stored(n_groups), chain_stored(n_groups), chain_removed()),
            min_size=1,
            max_size=max_size,
        )
    )
    pool, seen = [], set()
    for e in drawn:
        if key(e) not in seen:
            seen.add(key(e))
            pool.append(e)
    return pool
