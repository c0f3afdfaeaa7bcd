"""Worker outputs through Ray: kvmerge vs vLLM 0.33.0's native containers.

One command (from the repository root, in the project's environment)::

    python benches/ray_transport.py                  # TP 8, 512 events per child
    python benches/ray_transport.py --tp 4 --steps 10 --transports ray

A local, loopback-only Ray cluster; TP Ray actors act as the worker ranks,
each holding, for every compared configuration (row), a worker-side
connector whose children return vLLM's own containers (tests/support/vllm_children.py):

* ``kvmerge``: ``KVMergeMultiConnector`` with the LMCache child, the Mooncake
  store child, or both; each worker returns one ``KVMergeKVEvents`` whose
  children's batches are ``kvmerge.EventBatch`` (pickled as protocol-5 out-of-band
  buffers);
* ``native``: the child itself as the connector, returning vLLM's
  ``LMCacheKVEvents`` / ``MooncakeStoreKVEvents`` (pickled event by event).

Every step each rank reports the same ``--events`` new stores per child (a
chain of 32-byte hashes, ``--tokens`` tokens per block: the TP-replicated
common case, where everything is published). The driver collects the TP
outputs, runs vLLM's ``KVOutputAggregator`` and the scheduler connector's
``update_connector_output`` + ``take_events``, and msgpack-encodes the
``KVEventBatch`` the publisher would send. Event objects are built on the
workers before the timed part (that is the model runner's work, not transport).

Transports (``--transports``):

* ``ray``: the actor method returns the ``ModelRunnerOutput`` and the driver
  ``ray.get``s it (Ray's serialization and object store);
* ``mq-tcp`` / ``mq-shm``: what vLLM 0.33.0's Ray executor (``RayExecutorV2``)
  really does: the worker enqueues its output on its response
  ``MessageQueue``; over TCP for a worker on another node, shared memory for
  one on the executor's node. The step is triggered by a Ray call (vLLM uses
  its broadcast queue), so a Ray round trip is included: see the printed floor.

Printed per row: bytes per rank (pickle in-band / out-of-band; for ``ray`` the
object size Ray reports) and milliseconds per step (median over ``--steps``):
``worker`` (building the container, inside one rank, mean over ranks),
``collect`` (driver: trigger to all TP outputs received), ``scheduler``
(aggregator + scheduler connector + publisher encoding), ``total``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# vLLM's info logs (one per connector built) would drown the table; set before
# vLLM is imported, and inherited by the Ray workers.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

import ray_actors  # noqa: E402

#: Row name -> (children, native). Native rows use the child as the connector.
ROWS: dict[str, tuple[list[str], bool]] = {
    "kvmerge  LMCache": (["LMCacheChild"], False),
    "native   LMCacheKVEvents": (["LMCacheChild"], True),
    "kvmerge  Mooncake": (["MooncakeChild"], False),
    "native   MooncakeStoreKVEvents": (["MooncakeChild"], True),
    "kvmerge  LMCache+Mooncake": (["LMCacheChild", "MooncakeChild"], False),
}
TRANSPORTS = ("ray", "mq-tcp", "mq-shm")


def child_entries(names: list[str]) -> list[dict[str, Any]]:
    from vllm_harness import child

    return [
        child(n, test_factors=[1]) if n == "MooncakeChild" else child(n) for n in names
    ]


def config(names: list[str], native: bool, tp: int) -> Any:
    from kvmerge.sim.model import connector_config

    entries = child_entries(names)
    if native:
        return ray_actors.native_config(entries[0], tp=tp)
    return connector_config(entries, tp=tp)


class BenchRank(ray_actors.ResponseQueue):
    """One rank: one worker-side connector per row (built once)."""

    def __init__(self, rank: int, tp: int, rows: dict[str, Any]) -> None:
        sys.path.insert(0, str(TESTS))
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )

        from kvmerge.sim.model import create_connector, worker_config
        from kvmerge.vllm import register

        register()
        self.rank = rank
        self.connectors: dict[str, tuple[Any, list[Any]]] = {}
        for name, (names, native) in rows.items():
            conn = create_connector(
                worker_config(config(names, native, tp), rank), KVConnectorRole.WORKER
            )
            self.connectors[name] = (conn, [conn] if native else conn.sub_connectors)
        self.seconds: list[float] = []

    def ready(self) -> int:
        return os.getpid()

    def noop(self) -> None:
        return None

    def emit(self, name: str, step: int, events: int, tokens: int) -> None:
        _conn, children = self.connectors[name]
        for index, child in enumerate(children):
            group = 0 if type(child).__name__ == "MooncakeChild" else None
            start = step * 1_000_000 + index * 100_000
            child.emit(ray_actors.chain_events(events, start, tokens, group))

    def output(self, name: str) -> Any:
        from vllm_harness import worker_output

        conn, _children = self.connectors[name]
        t0 = time.perf_counter()
        out = worker_output(conn)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def output_mq(self, name: str) -> None:
        from vllm.v1.executor.multiproc_executor import WorkerProc

        WorkerProc.enqueue_output(self, self.output(name))  # type: ignore[arg-type]

    def take_seconds(self) -> list[float]:
        out, self.seconds = self.seconds, []
        return out


def pickled_sizes(output: Any, oob_threshold: int) -> tuple[int, int]:
    """(in-band, out-of-band) bytes of one output, pickled with protocol 5
    and a buffer_callback sending buffers of ``oob_threshold`` bytes or more
    out of band (Ray: all of them, 0; vLLM's MessageQueue: 1 MiB)."""
    oob: list[int] = []

    def callback(buf: pickle.PickleBuffer) -> bool:
        n = buf.raw().nbytes
        if n < oob_threshold:
            return True
        oob.append(n)
        return False

    inband = pickle.dumps(output, protocol=5, buffer_callback=callback)
    return len(inband), sum(oob)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


def run_row(
    ray: Any,
    actors: list[Any],
    name: str,
    transport: str,
    mqs: list[Any] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from kvmerge.sim.model import create_connector
    from kvmerge.sim.transport import OOB_THRESHOLD

    names, native = ROWS[name]
    tp = args.tp
    scheduler = create_connector(config(names, native, tp), KVConnectorRole.SCHEDULER)
    aggregator = KVOutputAggregator.from_connector(scheduler, tp)
    encoder = msgspec.msgpack.Encoder()
    collect_s: list[float] = []
    sched_s: list[float] = []
    total_s: list[float] = []
    sizes: dict[str, Any] = {}
    expected = args.events * len(names)
    for step in range(args.warmup + args.steps):
        ray.get([a.emit.remote(name, step, args.events, args.tokens) for a in actors])
        t0 = time.perf_counter()
        if transport == "ray":
            refs = [a.output.remote(name) for a in actors]
            outputs = ray.get(refs)
        else:
            assert mqs is not None
            sent = [a.output_mq.remote(name) for a in actors]
            outputs = []
            for mq in mqs:
                status, output = mq.dequeue(timeout=120)
                assert status == WorkerProc.ResponseStatus.SUCCESS, output
                outputs.append(output)
        t1 = time.perf_counter()
        if step == 0:  # sizes, before the aggregator adds to outputs[0]
            inband, oob = pickled_sizes(
                outputs[0], 0 if transport == "ray" else OOB_THRESHOLD
            )
            sizes = {"inband": inband, "oob": oob}
            if transport == "ray":
                loc = ray.experimental.get_object_locations(refs[:1])[refs[0]]
                sizes["object"] = loc["object_size"]
        t2 = time.perf_counter()
        out = aggregator.aggregate(outputs, output_rank=0)
        scheduler.update_connector_output(out.kv_connector_output)
        events = list(scheduler.take_events())
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=events))
        t3 = time.perf_counter()
        if transport != "ray":
            ray.get(sent)
        assert len(events) == expected, (name, step, len(events), expected)
        if step >= args.warmup:
            collect_s.append(t1 - t0)
            sched_s.append(t3 - t2)
            total_s.append((t1 - t0) + (t3 - t2))
    worker = [
        s
        for per_rank in ray.get([a.take_seconds.remote() for a in actors])
        for s in per_rank[args.warmup :]
    ]
    return {
        "row": name,
        "transport": transport,
        "events_per_rank": expected,
        **sizes,
        "published_bytes": len(payload),
        "worker_ms": statistics.mean(worker) * 1000,
        "collect_ms": median_ms(collect_s),
        "scheduler_ms": median_ms(sched_s),
        "total_ms": median_ms(total_s),
    }


def local_costs(args: argparse.Namespace) -> None:
    """Per rank and step, in this process and without a transport: building
    the worker's output, pickling it as Ray does (protocol 5, every buffer out
    of band), unpickling it from received bytes. Less sensitive to machine
    load than the Ray runs, and it splits their ``collect`` column."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import worker_output

    from kvmerge.sim.model import create_connector, worker_config
    from kvmerge.vllm import register

    register()
    print(
        f"# one rank, in process ({args.events} events per child): median ms per "
        "step to build the output / pickle it / unpickle it"
    )
    for name, (names, native) in ROWS.items():
        cfg = worker_config(config(names, native, args.tp), 0)
        conn = create_connector(cfg, KVConnectorRole.WORKER)
        children = [conn] if native else conn.sub_connectors
        build_s, dump_s, load_s = [], [], []
        for step in range(args.warmup + args.steps):
            for index, child in enumerate(children):
                group = 0 if type(child).__name__ == "MooncakeChild" else None
                start = step * 1_000_000 + index * 100_000
                child.emit(
                    ray_actors.chain_events(args.events, start, args.tokens, group)
                )
            t0 = time.perf_counter()
            out = worker_output(conn)
            t1 = time.perf_counter()
            oob: list[pickle.PickleBuffer] = []
            data = pickle.dumps(out, protocol=5, buffer_callback=oob.append)
            t2 = time.perf_counter()
            received = [bytes(b.raw()) for b in oob]
            t3 = time.perf_counter()
            pickle.loads(data, buffers=received)
            t4 = time.perf_counter()
            if step >= args.warmup:
                build_s.append(t1 - t0)
                dump_s.append(t2 - t1)
                load_s.append(t4 - t3)
        print(
            f"#   {name:<32} {median_ms(build_s):6.2f} / {median_ms(dump_s):5.2f} / "
            f"{median_ms(load_s):5.2f}",
            flush=True,
        )


def open_mqs(ray: Any, actors: list[Any], same_node: bool) -> list[Any]:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    handles = ray.get([a.open_response_mq.remote(same_node) for a in actors])
    mqs = [MessageQueue.create_from_handle(h, 0) for h in handles]
    ready = [a.response_mq_ready.remote() for a in actors]
    for mq in mqs:
        mq.wait_until_ready()
    ray.get(ready)
    return mqs


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1024:,.1f} KiB" if n >= 1024 else f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--events", type=int, default=512, help="per child per rank")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per block")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=",".join(TRANSPORTS)
    )
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    parser.add_argument(
        "--no-local", action="store_true", help="skip the in-process costs"
    )
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in TRANSPORTS:
            parser.error(f"unknown transport {t!r}")

    import vllm_harness  # noqa: F401  (vLLM's logging is set up on import)

    logging.getLogger("vllm").setLevel(logging.ERROR)
    if not args.no_local:
        local_costs(args)
    started = time.perf_counter()
    saved = ray_actors.start_ray(num_cpus=args.num_cpus, object_store_mb=512)
    import ray

    results = []
    actors: list[Any] = []
    try:
        bench_rank = ray.remote(num_cpus=0)(BenchRank)
        actors = [bench_rank.remote(r, args.tp, ROWS) for r in range(args.tp)]
        ray.get([a.ready.remote() for a in actors])
        print(
            f"# {args.tp} rank actors ready in {time.perf_counter() - started:.0f} s "
            f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
            f"Python {platform.python_version()}, Ray {ray.__version__})",
            flush=True,
        )
        floor = []
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            ray.get([a.noop.remote() for a in actors])
            floor.append(time.perf_counter() - t0)
        print(
            f"# Ray round trip floor (no-op method on {args.tp} actors): "
            f"{median_ms(floor[args.warmup :]):.2f} ms",
            flush=True,
        )
        for transport in transports:
            mqs = (
                open_mqs(ray, actors, transport == "mq-shm")
                if transport != "ray"
                else None
            )
            try:
                for name in ROWS:
                    results.append(run_row(ray, actors, name, transport, mqs, args))
                    print_row(results[-1])
            finally:
                if mqs is not None:
                    ray.get([a.close_response_mq.remote() for a in actors])
                    for mq in mqs:
                        mq.shutdown()
    finally:
        for a in actors:
            ray.kill(a)
        left = ray_actors.stop_ray(saved)
    if args.json:
        meta = {"tp": args.tp, "events_per_child": args.events, "tokens": args.tokens}
        Path(args.json).write_text(json.dumps({**meta, "rows": results}, indent=1))
    if left:
        print(f"# Ray processes left: {left}", file=sys.stderr)
        return 1
    return 0


HEADER_PRINTED = False


def print_row(r: dict[str, Any]) -> None:
    global HEADER_PRINTED
    if not HEADER_PRINTED:
        print(
            f"{'transport':<8} {'container':<32} {'ev/rank':>7} {'in-band':>11} "
            f"{'out-of-band':>11} {'Ray object':>11} {'worker':>8} {'collect':>8} "
            f"{'scheduler':>9} {'total':>8}"
        )
        HEADER_PRINTED = True
    print(
        f"{r['transport']:<8} {r['row']:<32} {r['events_per_rank']:>7} "
        f"{fmt_bytes(r['inband']):>11} {fmt_bytes(r['oob']):>11} "
        f"{fmt_bytes(r.get('object')):>11} {r['worker_ms']:>6.2f}ms "
        f"{r['collect_ms']:>6.2f}ms {r['scheduler_ms']:>7.2f}ms "
        f"{r['total_ms']:>6.2f}ms",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
