"""Where each path's time goes, phase by phase, for one case.

The same workload and connectors as the comparison; each phase of a step is
timed on its own (``perf_counter`` around it; a garbage collection before each
step, untimed), medians over the steps:

Scheduler side, path B (``kv_events_output`` as configured):

* ``unpickle``: ``pickle.loads`` of every rank's message (a worker's
  output arrives packed, one buffer, unread);
* ``aggregate``: ``KVOutputAggregator.aggregate``;
* ``update_connector_output``, of which ``validate`` is
  ``EventBatch.from_buffer`` on each child's batch bytes (the check of a
  received batch, where the connector's step makes it: XXH3 over it, the
  records' spans), and, on standalone mergers fed the same batches:
  ``merge, output as one batch`` (``Merger.add_all`` +
  ``finish_step_batch``: the Rust merge, and the copy of the published
  events into one batch) and ``merge and output`` (``add_all`` +
  ``finish_step_raw()`` or ``finish_step()``: what the connector calls, the
  Python objects handed out included); the rest is the connector's own
  Python code;
* ``take_events``.

Scheduler side, the floor (``paths.Floor``): the same steps with no KV
events at all (vLLM's envelopes, aggregator and upstream ``MultiConnector``
over the same children). The ``envelope``: the floor with one empty
container per rank (``paths.EmptyEvents`` in each rank's
``KVConnectorOutput``, combined by the aggregator): what vLLM charges any
event path that sends a container per rank, the cost kvmerge's own adds
to. And path B's ``fixed`` cost: a second ``KVMergeMultiConnector`` over
the same steps with every child's events taken away (each rank still sends
its container, of empty batches): what B adds whatever the events, per
message and per child. Each of the three is timed after an untimed replay
of path A's step, as B's step follows A's: the same cold caches.

The floor's parts (issue 37): what any path pays for the step's published
events besides the envelope, each timed on its own (``_floor_parts``): a
``msgspec.Raw`` per event over bytes it already has, a comparison of every other
rank's 16-byte identities with the first's, and the publisher's encode of
the step's ``KVEventBatch`` (vLLM's publisher thread pays it in either
path, so B is compared with the floor with it added to both).

Scheduler side, path A: ``unpickle`` (rebuilds each container's ``Counter``:
one Python ``__hash__`` per event), ``aggregate`` (``add_events``: a
``Counter.update`` per worker), ``update_connector_output``, ``take_events``
(``aggregate``/``pop_common_events``).

Worker side, per rank: the children's containers (``get_kv_connector_kv_cache_
events`` of each child), and for B their ``get_all_events()`` and
``kvmerge.encode`` (and, for comparison, msgspec's encode of the same events,
which ``kvmerge.encode`` no longer calls: it writes them itself), then
pickling.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from collections import defaultdict
from typing import Any

import msgspec

import kvmerge
from kvmerge import DEFAULT_MAX_PENDING_STEPS, EventBatch, Rule
from kvmerge.sim.transport import dequeue, enqueue

from .paths import _wrap
from .workload import Workload, preset

_clock = time.perf_counter
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _faults() -> int:
    """Minor page faults so far (this thread, on Linux)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt


def _med(d: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) * 1e3 for k, v in d.items()}


def profile_case(
    world_size: int = 8,
    events: int = 512,
    *,
    workload: str = "uniform",
    steps: int = 8,
    warmup: int = 2,
    seed: int = 0,
    output: str = "raw",
) -> dict[str, Any]:
    from .paths import Floor, PathA, PathB

    cfg = preset(workload, world_size=world_size, events=events, seed=seed)
    a = PathA(world_size, cfg.children)
    b = PathB(world_size, cfg.children, output)
    floor = Floor(world_size, cfg.children)
    envelope = Floor(world_size, cfg.children, envelope=True)
    fixed = PathB(world_size, cfg.children, output)
    # Replays path A's steps before each of the three above (see the top).
    cooler = PathA(world_size, cfg.children)
    # Three sets of mergers fed the same reports: the merge alone (output as
    # one batch), the merge with raw output, the merge with object output.
    merger_sets = [
        [
            kvmerge.Merger(world_size, rule, factors, DEFAULT_MAX_PENDING_STEPS)
            for rule, factors in (_rule(k) for k in cfg.children)
        ]
        for _ in range(3)
    ]
    enc = msgspec.msgpack.Encoder()
    sa: dict[str, list[float]] = defaultdict(list)
    sb: dict[str, list[float]] = defaultdict(list)
    sf: dict[str, list[float]] = defaultdict(list)
    se: dict[str, list[float]] = defaultdict(list)
    sx: dict[str, list[float]] = defaultdict(list)
    sp: dict[str, list[float]] = defaultdict(list)
    wa: dict[str, list[float]] = defaultdict(list)
    wb: dict[str, list[float]] = defaultdict(list)
    faults: dict[str, list[int]] = {"A": [], "B": []}
    gc.collect()
    gc.freeze()  # as the runner does (vLLM's freeze_gc_heap)
    try:
        for step in Workload(cfg).steps(warmup + steps):
            keep = step.index >= warmup
            # --- worker side, path A ------------------------------------------
            a.feed(step.events)
            wires_a = []
            acc: dict[str, float] = defaultdict(float)
            for rank in range(world_size):
                gc.collect()
                t0 = _clock()
                outs = tuple(
                    _wrap(c.get_kv_connector_kv_cache_events())
                    for c in a._worker_children[rank]
                )
                t1 = _clock()
                wires_a.append(enqueue(outs))
                t2 = _clock()
                acc["containers"] += t1 - t0
                acc["pickle"] += t2 - t1
            if keep:
                for k, v in acc.items():
                    wa[k].append(v / world_size)
            # --- worker side, path B ------------------------------------------
            b.feed(step.events)
            wires_b = []
            acc = defaultdict(float)
            for rank in range(world_size):
                worker = b.workers[rank]
                gc.collect()
                # The children's part, by hand (the same calls the connector makes).
                t0 = _clock()
                conts = [
                    c.get_kv_connector_kv_cache_events() for c in worker.sub_connectors
                ]
                t1 = _clock()
                evs = [c.get_all_events() if c is not None else [] for c in conts]
                t2 = _clock()
                for e in evs:
                    kvmerge.encode(e)
                t3 = _clock()
                for e in evs:
                    enc.encode(e)
                t4 = _clock()
                # The connector's whole call, on the same events again.
                for index, child in enumerate(worker.sub_connectors):
                    child.feed(step.events[index][rank])
                t5 = _clock()
                container = worker.get_kv_connector_kv_cache_events()
                t6 = _clock()
                wires_b.append(enqueue(_wrap(container)))
                t7 = _clock()
                acc["connector call"] += t6 - t5
                acc["(of which containers)"] += t1 - t0
                acc["(of which get_all_events)"] += t2 - t1
                acc["(of which kvmerge.encode)"] += t3 - t2
                acc["(for comparison: msgspec encode of the same events)"] += t4 - t3
                acc["pickle"] += t7 - t6
            if keep:
                for k, v in acc.items():
                    wb[k].append(v / world_size)
            # --- scheduler side, path A ---------------------------------------
            gc.collect()
            f0 = _faults()
            t0 = _clock()
            received = [dequeue(w) for w in wires_a]
            t1 = _clock()
            fa = _faults() - f0
            acc = defaultdict(float)
            for index, child in enumerate(a.children):
                u0 = _clock()
                out = a.aggregators[index].aggregate([r[index] for r in received], 0)
                u1 = _clock()
                kv_out = out.kv_connector_output if out is not None else None
                if kv_out:
                    child.update_connector_output(kv_out)
                u2 = _clock()
                list(child.take_events())
                u3 = _clock()
                acc["aggregate"] += u1 - u0
                acc["update_connector_output"] += u2 - u1
                acc["take_events"] += u3 - u2
            if keep:
                sa["unpickle"].append(t1 - t0)
                faults["A"].append(fa)
                for k, v in acc.items():
                    sa[k].append(v)
            # --- scheduler side, path B ---------------------------------------
            gc.collect()
            f0 = _faults()
            t0 = _clock()
            received_b = [dequeue(w) for w in wires_b]
            t1 = _clock()
            fb = _faults() - f0
            out = b.aggregator.aggregate(received_b, 0)
            t2 = _clock()
            kv_out = out.kv_connector_output if out is not None else None
            if kv_out:
                b.connector.update_connector_output(kv_out)
            t3 = _clock()
            published = list(b.connector.take_events())
            t4 = _clock()
            # Replays, untimed above: validation, merge, output.
            assert kv_out is not None
            worker_outputs = sorted(
                kv_out.kv_cache_events.outputs, key=lambda o: o.rank
            )
            raw = [bytes(p) for o in worker_outputs for p in o.entries if p is not None]
            v0 = _clock()
            for buf in raw:
                EventBatch.from_buffer(buf)
            v1 = _clock()
            merge_s = raw_s = objects_s = 0.0
            for index in range(len(cfg.children)):
                pairs = [
                    (
                        o.rank,
                        o.entries[index]
                        if o.entries[index] is not None
                        else EventBatch.empty(),
                    )
                    for o in worker_outputs
                ]
                alone, raw_m, obj_m = (ms[index] for ms in merger_sets)
                m0 = _clock()
                alone.add_all(pairs)
                alone.finish_step_batch()
                m1 = _clock()
                raw_m.add_all(pairs)
                raw_m.finish_step_raw()
                m2 = _clock()
                obj_m.add_all(pairs)
                obj_m.finish_step()
                m3 = _clock()
                merge_s += m1 - m0
                raw_s += m2 - m1
                objects_s += m3 - m2
            out_s = {"raw": raw_s, "objects": objects_s}
            other = "objects" if output == "raw" else "raw"
            if keep:
                sb["unpickle"].append(t1 - t0)
                faults["B"].append(fb)
                sb["aggregate"].append(t2 - t1)
                sb["update_connector_output"].append(t3 - t2)
                sb["(of which validate)"].append(v1 - v0)
                sb["(of which merge, output as one batch)"].append(merge_s)
                sb[f"(of which merge and output: {output})"].append(out_s[output])
                sb[f"(merge and output as {other} instead)"].append(out_s[other])
                sb["take_events"].append(t4 - t3)
                sb["total"].append(t4 - t0)
            if keep:
                for k, v in _floor_parts(published, world_size).items():
                    sp[k].append(v)
            # --- scheduler side: the floor (vLLM alone, no KV events), the
            # envelope (one empty container per rank), B's fixed cost (the
            # same steps, no events) ------------------------------------------
            floor_s = _after_a(cooler, wires_a, floor, floor.wires())
            envelope_s = _after_a(cooler, wires_a, envelope, envelope.wires())
            fixed.feed([[[] for _ in ranks] for ranks in step.events])
            fixed_s = _after_a(
                cooler,
                wires_a,
                fixed,
                [fixed.worker(rank) for rank in range(world_size)],
            )
            if keep:
                sf["total"].append(floor_s)
                se["total"].append(envelope_s)
                sx["total"].append(fixed_s)
    finally:
        gc.unfreeze()
    sa_med = _med(sa)
    sa_med["total"] = sum(sa_med.values())
    wa_med = _med(wa)
    wa_med["total"] = sum(wa_med.values())
    wb_med = _med(wb)
    wb_med["total"] = wb_med["connector call"] + wb_med["pickle"]
    return {
        "case": f"{workload}/tp{world_size}/{events}",
        "steps": steps,
        "output": output,
        "scheduler": {
            "A": sa_med,
            "B": _med(sb),
            "floor": _med(sf),
            "envelope": _med(se),
            "fixed": _med(sx),
            "parts": _med(sp),
        },
        "worker_per_rank": {"A": wa_med, "B": wb_med},
        "unpickle_minor_page_faults": {
            k: statistics.median(v) if v else None for k, v in faults.items()
        },
    }


def _floor_parts(published: list[Any], world_size: int) -> dict[str, float]:
    """Seconds of what any path pays for this step's published events
    besides vLLM's envelope, each part on its own, at its cheapest: a
    ``msgspec.Raw`` per event over bytes it already has (``map``: no Python
    loop), a comparison of every other rank's 16-byte identities with the
    first's, and the publisher's encode of the step's ``KVEventBatch``."""
    from vllm.distributed.kv_events import KVEventBatch

    encoder = msgspec.msgpack.Encoder()
    payloads = [
        bytes(memoryview(e)) if isinstance(e, msgspec.Raw) else encoder.encode(e)
        for e in published
    ]
    first = bytes(16 * len(published))
    others = [bytearray(first) for _ in range(world_size - 1)]
    gc.collect()
    t0 = _clock()
    raws = list(map(msgspec.Raw, payloads))
    t1 = _clock()
    same = all(o == first for o in others)
    t2 = _clock()
    encoder.encode(KVEventBatch(ts=0.0, events=raws))
    t3 = _clock()
    assert same
    return {
        "Raw per event": t1 - t0,
        "identities": t2 - t1,
        "publisher's encode": t3 - t2,
    }


def _after_a(cooler: Any, wires_a: list[Any], path: Any, wires: list[Any]) -> float:
    """Seconds of one scheduler step of ``path``, right after path A's
    scheduler step on ``wires_a`` (untimed, on ``cooler``, a path A of its
    own) and a garbage collection."""
    cooler.scheduler(wires_a)
    gc.collect()
    t0 = _clock()
    path.scheduler(wires)
    return _clock() - t0


def _rule(family: str) -> tuple[Rule, list[int] | None]:
    from .check import rule_of

    return rule_of(family)


def format_profile(p: dict[str, Any]) -> str:
    """One line per side and path: each phase in ms and its share of the total."""
    lines = [f"profile {p['case']} ({p['steps']} steps; medians, ms, share of total):"]
    for side, label in (
        ("scheduler", "scheduler side"),
        ("worker_per_rank", "worker side per rank"),
    ):
        for path in ("A", "B"):
            phases = p[side][path]
            total = phases["total"]
            parts = [
                f"{k} {v:.3f} ({100 * v / total:.0f}%)"
                for k, v in phases.items()
                if k != "total"
            ]
            lines.append(f"  {label}, {path}: total {total:.3f} = " + "; ".join(parts))
    sched = p["scheduler"]
    floor, b, fixed = (sched[k]["total"] for k in ("floor", "B", "fixed"))
    lines.append(
        f"  scheduler side, floor (vLLM alone, no KV events): total {floor:.3f}"
    )
    envelope = sched.get("envelope", {}).get("total")
    if envelope is not None:
        lines.append(
            "  scheduler side, envelope (the floor with one empty container per "
            f"rank): total {envelope:.3f}; B adds {b - envelope:.3f} to it, "
            f"{fixed - envelope:.3f} of it fixed (B with no events: total "
            f"{fixed:.3f}); A/envelope {sched['A']['total'] / envelope:.0f}x"
        )
    else:  # a profile written before the envelope was measured
        lines.append(
            f"  B adds {b - floor:.3f} to the floor, {fixed - floor:.3f} of it "
            f"fixed (B with no events: total {fixed:.3f})"
        )
    parts = sched.get("parts")
    if envelope is not None and parts:
        floor_all = envelope + sum(parts.values())
        encode = parts["publisher's encode"]
        listed = "; ".join(f"{k} {v:.3f}" for k, v in parts.items())
        lines.append(
            f"  the floor's parts: envelope {envelope:.3f}; {listed}: floor "
            f"{floor_all:.3f}; B with the publisher's encode {b + encode:.3f}: "
            f"{(b + encode) / floor_all:.2f}x the floor"
        )
    pf = p.get("unpickle_minor_page_faults")
    if pf:
        lines.append(
            f"  minor page faults while unpickling, per step: A {pf['A']}, B {pf['B']}"
        )
    return "\n".join(lines)
