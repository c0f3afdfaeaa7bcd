"""Long run of the Python surface vLLM's scheduler uses, checking memory.

Issue 12: ``PySlice::new`` under pyo3 0.30 never released the ints it made,
so every ``EventBatch.decode()`` and ``Merger.finish_step()`` kept 36 bytes;
a scheduler-like loop grew without bound. This runs 300,000 steps of what
the connector does per step (unpickle each rank's batch out of band, add
2-4 ranks' reports, close the step with ``finish_step_raw``,
``finish_step_raw_and_decode`` (the removals decoded: a removal hook's
child), or ``finish_step_batch`` + ``kinds``/``take``/``decode``/``raw``, ``stats``, now
and then ``finish_step``, a corrupt report dropped, a ``reset``), over
small batches, and asserts that resident memory grows by less than 2 MiB
after a 30,000-step warm-up (the leak alone made about 10 MiB here).
"""

from __future__ import annotations

import gc
import pickle
import random

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge
from kvmerge import CorruptBatchError, Merger

STEPS = 300_000
WARMUP = 30_000
ALLOWED_GROWTH = 2 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def stored(h: int) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[h, h + 1],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def pickled(batch) -> tuple[bytes, bytes]:
    """What a worker sends: the pickle and its out-of-band buffer."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return data, bytes(buffers[0].raw())


def test_scheduler_loop_does_not_grow():
    rng = random.Random(12)
    pool = []
    for k in range(24):
        events = [
            stored(k % 7),
            BlockRemoved(block_hashes=[k % 5], medium=None),
            stored(100 + k % 3),
        ][: 1 + k % 3]
        if k % 11 == 0:
            events.append(AllBlocksCleared())
        pool.append(pickled(kvmerge.encode(events)))
    bad = (pool[0][0], pool[0][1][:-1])  # a truncated buffer: an invalid batch
    # The schedule, drawn up front so the loop does only what vLLM does.
    plan = [
        (rng.randrange(4), rng.sample(range(4), rng.randint(2, 4)), rng.random())
        for _ in range(997)
    ]
    mergers = [
        Merger(4, "all", max_pending_steps=8),
        Merger(4, "quorum", [2], max_pending_steps=8),
        Merger(4, "any"),
    ]
    published = 0
    start = warm = peak = 0
    for step in range(STEPS):
        m = mergers[step % 3]
        pick, ranks, u = plan[step % len(plan)]
        reports = []
        for r in ranks:
            data, buf = bad if u < 0.001 and r == ranks[0] else pool[(pick + r) % 24]
            reports.append((r, pickle.loads(data, buffers=[buf])))
        try:
            m.add_all(reports)
        except CorruptBatchError:
            # The connector's answer: drop the rank that sent it.
            m.add_all([(r, b) for r, b in reports if b.error is None])
        if u < 0.35:
            published += len(m.finish_step_raw())
        elif u < 0.5:
            raws, removed = m.finish_step_raw_and_decode("BlockRemoved")
            published += len(raws) + len(removed) // 2
        elif u < 0.9:
            out = m.finish_step_batch()
            kinds = out.kinds()
            removed = [i for i, k in enumerate(kinds) if k == "BlockRemoved"]
            if removed:
                out.take(removed).decode()
            published += len(out.decode()) + len(out.raw()) // 2
        else:
            published += len(m.finish_step())
        s = m.stats()
        assert s.reports == s.consumed + s.cleared + s.expired + s.pending
        if u > 0.9995:
            m.reset()
        if step == 0:
            start = rss()
        elif step == WARMUP:
            gc.collect()
            warm = rss()
        elif step > WARMUP and step % 10_000 == 0:
            peak = max(peak, rss())
    gc.collect()
    end = rss()
    peak = max(peak, end)
    assert published > STEPS
    growth = peak - warm
    print(
        f"rss: start {start / 2**20:.2f} MiB, warm {warm / 2**20:.2f} MiB, "
        f"end {end / 2**20:.2f} MiB, growth after warm-up {growth} bytes "
        f"({growth / (STEPS - WARMUP):.2f} B/step)"
    )
    assert growth < ALLOWED_GROWTH, f"grew {growth} bytes after the warm-up"
