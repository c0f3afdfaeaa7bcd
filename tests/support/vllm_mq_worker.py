"""A worker process for test_vllm_processes: real worker connectors whose step
outputs travel to the test process through vLLM's shm ``MessageQueue``.

The event script is shared with the test, which computes the expected merge
from it.
"""

from __future__ import annotations

from typing import Any

from .vllm_harness import child, stored
from .worker_outputs import with_damaged_batch

TP = 2
STEPS = 4
#: In this step rank 1's LMCache batch is damaged on its way (see Damaged).
DAMAGED_STEP = 3
#: Distinct stores in the big step: its batch is over 1 MiB and travels out of band.
BIG = 12_000
FACTORS = [1, 2]


def children() -> list[dict[str, Any]]:
    return [
        child("LMCacheChild"),
        child("MooncakeChild", test_factors=FACTORS),
        child("ThirdPartyConnector", test_min_reports=2),
    ]


def big_chain() -> list[Any]:
    tokens = list(range(16))
    return [
        stored(
            h.to_bytes(32, "big"),
            (h - 1).to_bytes(32, "big") if h else None,
            tokens=tokens,
        )
        for h in range(BIG)
    ]


def script(rank: int, step: int) -> list[list[Any] | None]:
    """Per child, what this rank's child emits in this step."""
    chain = big_chain() if step in (0, 1) else []
    if step == 0:
        # Rank 1 reports the last store of the chain one step late.
        lmcache = chain if rank == 0 else chain[:-1]
        mooncake = [stored(7, group=1)] if rank == 0 else []
        third = [stored(8)]
        return [lmcache, mooncake, third]
    if step == 1:
        return [None if rank == 0 else chain[-1:], [], [stored(9)] if rank else None]
    if step == 2:
        return [[stored(10)], [stored(11, group=0)], [stored(12)]]
    return [[stored(13)], [stored(14, group=0)], [stored(15)]]


def damage(output: Any) -> Any:
    """Rank 1's LMCache batch damaged in transit: the reader's real
    ``MessageQueue.dequeue`` unpickles damaged bytes."""
    from kvmerge.vllm import KVMergeKVEvents

    kv_out = output.kv_connector_output
    sent = kv_out.kv_cache_events.outputs[0]
    kv_out.kv_cache_events = KVMergeKVEvents.for_worker(with_damaged_batch(sent, 0))
    return output


def expected(step: int) -> list[Any]:
    chain = big_chain()
    if step == 0:
        return [*chain[:-1], stored(7, group=1), stored(8)]
    if step == 1:
        return [chain[-1]]
    if step == 2:
        return [stored(10), stored(11, group=0), stored(12)]
    # Rank 1's LMCache batch was dropped: rule "all" waits for it; the other
    # children's batches of this step, from both ranks, merge as usual.
    return [stored(14, group=0), stored(15)]


def main(rank: int, port: int, pipe: Any) -> None:
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmerge.sim.model import connector_config, create_connector
    from kvmerge.vllm import register

    from .vllm_harness import init_tp_group, worker_output

    register()
    cfg = connector_config(children(), tp=TP)
    # A real TP group (gloo on CPU), as a vLLM worker has. parallel_config.rank
    # is left at 0 in both workers: the connector must take its rank from the
    # parallel state (the scheduler rejects a rank reported twice).
    init_tp_group(cfg, rank, port)
    connector = create_connector(cfg, KVConnectorRole.WORKER)
    assert cfg.parallel_config.rank == 0
    assert connector.worker_rank == rank
    mq = MessageQueue(1, 1)
    pipe.send(mq.export_handle())
    mq.wait_until_ready()
    for step in range(STEPS):
        for i, events in enumerate(script(rank, step)):
            connector.sub_connectors[i].emit(events)
        output = worker_output(connector, finished_sending={f"req-{step}"})
        mq.enqueue(damage(output) if rank == 1 and step == DAMAGED_STEP else output)
    pipe.recv()  # keep the queue alive until the reader is done
    mq.shutdown()
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
