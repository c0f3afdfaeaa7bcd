"""Writes the checked-in seed corpus of the fuzz targets (corpus/<target>/).

decode_batch gets real batches (``bytes(kvmerge.encode(events))``),
encode_payload the msgspec payloads they were made from, and merger a few
op sequences in the format described in fuzz_targets/merger.rs. Run it from
the repository root with the project's venv; it rewrites the corpus from
scratch, so the output only changes when this file or the wire format does:

    python rust/kvmerge-fuzz/make_corpus.py
"""

import shutil
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge

HERE = Path(__file__).resolve().parent


class FutureStored(BlockStored, tag="BlockStored"):
    """A later vLLM's store, with fields vLLM 0.33.0 does not have: they
    travel verbatim (docs/merge-rules.md)."""

    priority: int | None = None
    tier_hints: dict[str, list[int]] | None = None


class FutureRemoved(BlockRemoved, tag="BlockRemoved"):
    reason: str | None = None


def stored(h, **fields):
    base = dict(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return BlockStored(**{**base, **fields})


CLEAR = AllBlocksCleared()
EVENT_LISTS = {
    "empty": [],
    "one_store": [stored(1)],
    "store_group": [stored(2, group_idx=1)],
    "store_bytes_hash": [stored(b"\x00" * 32, parent_block_hash=b"\x01" * 32)],
    "store_extremes": [
        stored(2**64 - 1, parent_block_hash=-(2**63), block_size=2**63, lora_id=-1)
    ],
    "store_every_field": [
        stored(
            3,
            parent_block_hash=2,
            lora_id=7,
            lora_name="adapter",
            extra_keys=[("adapter", ("mm-hash", 0), "salt"), None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=4096,
            locality="LOCAL",
            ownership="tier2",
            session_id="s-1",
            lookahead_token_ids=[[5, 6], []],
        )
    ],
    "removed": [BlockRemoved(block_hashes=[1, b"\x02"], medium=None)],
    "removed_every_field": [
        BlockRemoved(
            block_hashes=[9],
            medium="CPU",
            group_idx=2,
            locality="REMOTE",
            ownership="o",
        )
    ],
    "clear": [CLEAR],
    "clear_twice": [CLEAR, CLEAR],
    "mixed": [stored(1), BlockRemoved(block_hashes=[1], medium="GPU"), CLEAR],
    "own_duplicate": [stored(1), stored(1)],
    # 16 and more events: the payload's array header is no longer a fixarray.
    "sixteen": [stored(i, group_idx=i % 2) for i in range(16)],
    "long_tokens": [stored(4, token_ids=list(range(300)))],
    "future_fields": [
        FutureStored(
            block_hashes=[5],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            priority=3,
            tier_hints={"ssd": [1, 2]},
        ),
        FutureRemoved(block_hashes=[5], medium=None, reason="evicted"),
    ],
}

# Payloads that are not event lists. Found by the fuzzer (docs/robustness.md,
# oom-e0710e8d): a count of 1.9 billion events in 5 bytes made encode reserve
# 40 MiB up front.
RAW_PAYLOADS = {"regress_oversized_count": bytes.fromhex("dd6ff93fff")}

# Op sequences for the merger target: config bytes, then ops.
ADD = lambda rank, pool: bytes([(rank << 4) | pool])  # noqa: E731
FINISH, RESET = b"\xa0", b"\xe0"
ALL, QUORUM, ANY = 0 << 2, 1 << 2, 2 << 2
MERGER_SEEDS = {
    "all_identical": bytes([ALL | 3, 2])
    + b"".join(ADD(r, 2) for r in range(4))
    + FINISH,
    "all_late_rank": bytes([ALL | 1, 1])
    + ADD(0, 13)
    + FINISH
    + ADD(1, 13)
    + FINISH
    + FINISH,
    "all_clear_barrier": bytes([ALL | 1, 3])
    + ADD(0, 7)
    + ADD(1, 8)
    + FINISH
    + ADD(1, 2)
    + FINISH,
    "all_expiry_horizon_max": bytes([ALL | 1, 7]) + ADD(0, 1) + FINISH + FINISH,
    "quorum_factors": bytes([QUORUM | 3, 1 | (1 << 3) | (3 << 5)])
    + ADD(0, 10)
    + ADD(2, 9)
    + FINISH
    + ADD(1, 12)
    + ADD(3, 12)
    + FINISH,
    "quorum_bad_group": bytes([QUORUM | 1, 2]) + ADD(0, 14) + ADD(0, 1) + FINISH,
    "any_union": bytes([ANY | 2, 0]) + ADD(0, 15) + ADD(1, 11) + ADD(2, 5) + FINISH,
    "duplicate_rank_then_reset": bytes([ALL | 1, 2])
    + ADD(0, 1)
    + ADD(0, 2)
    + RESET
    + ADD(0, 1)
    + ADD(1, 1)
    + FINISH,
    "bad_ranks": bytes([ALL | 0, 0]) + ADD(8, 1) + ADD(9, 1) + ADD(5, 1) + FINISH,
    "add_all_duplicate_rank": bytes([ALL | 2, 2])
    + b"\xf1"
    + ADD(0, 1)
    + ADD(0, 2)
    + b"\xf2"
    + ADD(0, 1)
    + ADD(1, 1)
    + ADD(2, 1)
    + FINISH,
    # Found by the fuzzer (docs/robustness.md): step + u64::MAX overflowed
    # (crash-833fab19: 01ffffffffa012a0, rewritten for the add_all op).
    "regress_horizon_overflow": bytes.fromhex("01ffa012a0"),
}


def write(target, name, data):
    (HERE / "corpus" / target / name).write_bytes(data)


def main():
    for target in ("decode_batch", "encode_payload", "merger"):
        shutil.rmtree(HERE / "corpus" / target, ignore_errors=True)
        (HERE / "corpus" / target).mkdir(parents=True)
    for name, events in EVENT_LISTS.items():
        write("decode_batch", name, bytes(kvmerge.encode(events)))
        write("encode_payload", name, msgspec.msgpack.encode(events))
    for name, payload in RAW_PAYLOADS.items():
        write("encode_payload", name, payload)
    for name, ops in MERGER_SEEDS.items():
        write("merger", name, ops)


if __name__ == "__main__":
    main()
