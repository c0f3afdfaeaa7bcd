"""A small, complete example: four TP ranks report KV events, one is late
and one repeats itself; the merger publishes each logical event once.

    kvmerge example        (or: python -m kvmerge.cli.example)
"""

from __future__ import annotations

import argparse
import pickle
from typing import Any

import kvmerge


def store(h: int, parent: int | None = None) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=list(range(h * 16, h * 16 + 16)),
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )


def run(args: argparse.Namespace | None = None) -> int:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    world = 4
    merger = kvmerge.Merger(world, rule="all", max_pending_steps=2)
    step0 = [store(1), store(2, parent=1), BlockRemoved(block_hashes=[7], medium="CPU")]
    step1 = [store(3, parent=2), AllBlocksCleared()]
    reports = [
        # (step, rank, events): rank 3 reports step 0's last event a step late,
        # rank 1 repeats a store (its own duplicate must not count twice).
        (0, 0, step0),
        (0, 1, [*step0, store(1)]),
        (0, 2, step0),
        (0, 3, step0[:2]),
        (1, 0, step1),
        (1, 1, step1),
        (1, 2, step1),
        (1, 3, [step0[2], *step1]),
    ]
    for step in (0, 1):
        for s, rank, events in reports:
            if s != step:
                continue
            batch = kvmerge.encode(events)  # on the worker
            # What vLLM's shm queue does: protocol 5, bytes out of band.
            buffers: list[pickle.PickleBuffer] = []
            wire = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
            received = pickle.loads(wire, buffers=[bytes(b.raw()) for b in buffers])
            merger.add(rank, received)  # on the scheduler
            print(
                f"step {step} rank {rank}: {len(events)} events, {batch.nbytes} bytes"
            )
        print(f"step {step} publishes:")
        for event in merger.finish_step():
            print(f"  {event}")
    print(merger.stats())
    return 0


if __name__ == "__main__":
    run()
