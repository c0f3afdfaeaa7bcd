"""Interleaved bursts: every configuration's server up at once, and short
bursts of the same requests alternating between them.

A run per server start (``benches.serve.runner``) pairs runs minutes apart;
on a shared host the throughput of two neighbouring runs differs by up to 2x
whatever the configuration, and the paired ratio's interval stays at tens of
percent. Here a round is one burst per configuration, seconds apart, with
the servers already warm: the host's drift between the two halves of a pair
is that of seconds, and a round costs seconds, not minutes.

Each burst: the server's prefix caches reset (each burst does the same
work: the same stores, the same evictions), a pause while the other server's
readers stop spinning, ``/metrics`` read, then ``--num-prompts`` completions
of the ``prefix_repetition`` shape, ``--concurrency`` at a time, timed from
the first request sent to the last answer, then ``/metrics`` read again.
Its record has the shape of a run's, so that ``benches.serve.report``
summarises and pairs bursts as it does runs (no TTFT or ITL: the client
does not stream).
"""

from __future__ import annotations

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvmerge.sim.model import WORDS, word
from kvmerge.sim.server import Server, stat_fields

from .runner import CONFIGS, delta, make_server, scrape, warm_up

#: Seconds between bursts: a reader of vLLM's shm message queue busy-loops
#: for 1 s after its last read (``SpinCondition.busy_loop_s``); the server
#: of the burst before must be quiet before the next is timed.
SETTLE_S = 1.5


def prompt_ids(args: Any) -> list[list[int]]:
    """``--num-prompts`` prompts of ``vllm bench serve``'s ``prefix_repetition``
    shape, as word numbers (``kvmerge.sim.model.word``): ``--num-prefixes``
    shared prefixes, each prompt one of them and its own suffix, the same
    for every burst (seeded by ``--seed``)."""
    rng = random.Random(args.seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(WORDS) for _ in range(n)]

    prefixes = [words(args.prefix_len) for _ in range(args.num_prefixes)]
    return [
        prefixes[i % len(prefixes)] + words(args.suffix_len)
        for i in range(args.num_prompts)
    ]


def prompts(args: Any) -> list[str]:
    """``prompt_ids`` as the served tokenizer's text: a token a word."""
    return [" ".join(word(i) for i in ids) for ids in prompt_ids(args)]


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """User and system CPU seconds of each process by its name (vLLM names
    its own: ``VLLM::EngineCore``, ``VLLM::Worker_TP0``, ...; the API server
    is ``vllm``), summed over processes of one name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            fields = stat_fields(pid)
        except OSError:
            continue
        # utime and stime (clock ticks).
        out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def burst(
    server: Server, name: str, round_: int, batch: list[str], args: Any
) -> dict[str, Any]:
    """One burst of ``batch`` on ``server`` (see the module's docstring):
    its record."""
    server.reset_prefix_cache()
    time.sleep(SETTLE_S)
    before = scrape(server.metrics())
    load_before = os.getloadavg()[0]
    cpu_before = cpu_seconds(server.pids())
    with ThreadPoolExecutor(args.concurrency) as pool:
        started = time.perf_counter()
        statuses = list(pool.map(lambda p: server.complete(p, args.output_len), batch))
        duration = time.perf_counter() - started
    cpu = cpu_seconds(server.pids())
    load_after = os.getloadavg()[0]
    completed = sum(s == 200 for s in statuses)
    return {
        "config": name,
        "round": round_,
        "dir": str(server.dir),
        "load": [load_before, load_after],
        "result": {
            "duration": duration,
            "completed": completed,
            "failed": len(statuses) - completed,
            "request_throughput": completed / duration,
        },
        "metrics": delta(before, scrape(server.metrics())),
        # Busy-waiting included (vLLM's shm readers spin while the host is
        # busy): where a configuration's CPU goes, not the work it does.
        "cpu_s": {k: v - cpu_before.get(k, 0.0) for k, v in cpu.items()},
    }


def run_bursts(
    args: Any, plan: list[tuple[int, str]], model: Path, workdir: Path
) -> list[dict[str, Any]]:
    """A burst for each ``(round, config)`` of ``plan``, in its order, every
    configuration's server started first: their records."""
    batch = prompts(args)
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        for name in args.configs:
            print(f"== starting {name}", file=sys.stderr, flush=True)
            server = make_server(CONFIGS[name], name, args, model, workdir)
            servers[name] = stack.enter_context(server)
            warm_up(server, args)
        runs: list[dict[str, Any]] = []
        for round_, name in plan:
            record = burst(servers[name], name, round_, batch, args)
            runs.append(record)
            res = record["result"]
            print(
                f"   round {round_} {name}: "
                f"{res['completed']} requests in {res['duration']:.2f} s "
                f"({res['request_throughput']:.2f}/s)",
                file=sys.stderr,
                flush=True,
            )
        return runs
