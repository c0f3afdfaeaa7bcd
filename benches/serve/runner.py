"""One configuration's run: the real ``vllm serve`` started, warmed up, loaded
by vLLM's own ``vllm bench serve``, its ``/metrics`` read before and after,
stopped.

The server is ``kvmerge.sim.server.Server`` (TP 2, prefix caching, a small
KV cache, ``--load-format dummy``) with ``kvmerge.sim.served``'s
``--kv-transfer-config`` over the simulated children; the client is the CPU
venv's ``vllm`` (the same interpreter's), against the served model and its
tokenizer (``kvmerge.sim.model.served_model_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmerge.sim.model import CONNECTOR, word
from kvmerge.sim.server import Server, ServerOptions, cpu_python


@dataclass(frozen=True)
class Config:
    """A configuration: vLLM's MultiConnector or kvmerge's over the same
    children, KV events on or off; ``drain``: MultiConnector's workers drain
    the children's events and drop them (``kvmerge.sim.baseline``);
    ``spend``: besides, the connector spends ``--spend-us`` of CPU a step."""

    name: str
    kvmerge: bool
    kv_events: bool
    drain: bool = False
    spend: bool = False


#: The same children under each. ``drain`` is ``multi`` with the children's
#: own work of building their events, as under kvmerge: ``drain`` ->
#: ``kvmerge`` is kvmerge's cost. ``events-off`` is ``multi`` without
#: ``--kv-events-config``: ``events-off`` -> ``multi`` is vLLM's own KV events'.
#: ``spend`` is ``drain`` spending kvmerge's measured CPU time a step and
#: nothing else of kvmerge's: ``drain`` -> ``spend`` is what that time costs.
CONFIGS = {
    c.name: c
    for c in (
        Config("kvmerge", kvmerge=True, kv_events=True),
        Config("drain", kvmerge=False, kv_events=True, drain=True),
        Config("multi", kvmerge=False, kv_events=True),
        Config("events-off", kvmerge=False, kv_events=False),
        Config("spend", kvmerge=False, kv_events=True, drain=True, spend=True),
    )
}

#: The series read from ``/metrics`` (each summed over its label sets), and
#: their names in a run's ``metrics``.
SERIES = {
    # One observation per engine step with output (vLLM's IterationStats).
    "engine_steps": "vllm:iteration_tokens_total_count",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "kvmerge_steps": "vllm:kvmerge_steps_total",
    "kvmerge_step_seconds": "vllm:kvmerge_step_seconds_total",
    "kvmerge_reports": "vllm:kvmerge_reports_total",
    "kvmerge_published": "vllm:kvmerge_published_total",
    "kvmerge_refused": "vllm:kvmerge_refused_total",
    "kvmerge_worker_outputs": "vllm:kvmerge_worker_outputs_total",
    "kvmerge_worker_encode_seconds": "vllm:kvmerge_worker_encode_seconds_total",
    "kvmerge_worker_bytes": "vllm:kvmerge_worker_output_bytes_total",
}


def scrape(text: str) -> dict[str, float | None]:
    """``SERIES`` from a ``/metrics`` text (None: the series is absent)."""
    out: dict[str, float | None] = {}
    for key, name in SERIES.items():
        values = re.findall(
            rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M
        )
        out[key] = sum(float(v) for v in values) if values else None
    return out


def delta(
    before: dict[str, float | None], after: dict[str, float | None]
) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k, a in after.items():
        out[k] = None if a is None else a - (before.get(k) or 0.0)
    return out


def transfer_config(config: Config, args: Any, dir: Path) -> dict[str, Any]:
    """``--kv-transfer-config``: ``kvmerge.sim.served``'s, without the
    children's recording (it writes every rank's reports to disk each step,
    and only under kvmerge: vLLM's MultiConnector never asks for them)."""
    from kvmerge.sim.baseline import DRAIN_CONNECTOR, DRAIN_MODULE_PATH, SPEND_KEY
    from kvmerge.sim.children import EXTRA_KEY, ChildSettings
    from kvmerge.sim.served import UPSTREAM, ServedOptions, connector_config

    opts = ServedOptions(
        tp=args.tp,
        connector=CONNECTOR if config.kvmerge else UPSTREAM,
        num_blocks=args.num_blocks,
        example=args.example,
        seed=args.seed,
        faults=not args.agree,
        damage=0 if args.agree else ServedOptions.damage,
    )
    cfg = connector_config(opts, dir / "records", dir / "example")
    if config.drain:
        cfg["kv_connector"] = DRAIN_CONNECTOR
        cfg["kv_connector_module_path"] = DRAIN_MODULE_PATH
    if config.spend:
        scheduler_us, worker_us = args.spend_us
        cfg["kv_connector_extra_config"][SPEND_KEY] = {
            "scheduler": scheduler_us,
            "worker": worker_us,
        }
    for child in cfg["kv_connector_extra_config"]["connectors"]:
        extra = child["kv_connector_extra_config"]
        if EXTRA_KEY in extra:
            settings = ChildSettings.from_extra(extra)
            extra.update(dataclasses.replace(settings, record=None).to_extra())
    return cfg


def client_command(args: Any, base_url: str, model: Path, out: Path) -> list[str]:
    """vLLM's own benchmark client, from the server's venv."""
    vllm = str(Path(args.python or cpu_python()).with_name("vllm"))
    return [
        vllm,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.prefix_len),
        "--prefix-repetition-suffix-len",
        str(args.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(args.num_prefixes),
        "--prefix-repetition-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(args.seed),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


def warm_up(server: Server, args: Any) -> float:
    """``args.warmup`` completions of the benchmark's shape, ``concurrency``
    at a time (the first one compiles and fills caches: 3-20 s), then the
    prefix caches reset, so that every run starts from the same state."""
    started = time.monotonic()
    words = " ".join(word(i) for i in range(args.prefix_len + args.suffix_len))
    with ThreadPoolExecutor(args.concurrency) as pool:
        statuses = list(
            pool.map(
                lambda i: server.complete(f"{word(i)} {words}", args.output_len),
                range(args.warmup),
            )
        )
    if any(s != 200 for s in statuses):
        raise RuntimeError(f"warm-up answered {statuses}:\n{server.log_tail()}")
    server.reset_prefix_cache()
    return time.monotonic() - started


def make_server(
    config: Config, name: str, args: Any, model: Path, workdir: Path
) -> Server:
    """``config``'s server (not started), its connector's files under
    ``workdir / name``."""
    dir = workdir / name
    dir.mkdir(parents=True)
    return Server(
        ServerOptions(
            model=model,
            tp=args.tp,
            nodes=args.nodes,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            kv_transfer=transfer_config(config, args, dir),
            kv_events=config.kv_events,
            python=args.python,
        ),
        workdir,
    )


def run_config(
    config: Config, round_: int, args: Any, model: Path, workdir: Path
) -> dict[str, Any]:
    """One run of ``config`` (see the module's docstring): its record.
    ``workdir`` must be short: the server's ipc sockets live under it."""
    server = make_server(config, f"{round_}-{config.name}", args, model, workdir)
    out = server.dir / "result.json"
    with server:
        warm_s = warm_up(server, args)
        before = scrape(server.metrics())
        load_before = os.getloadavg()[0]
        env = server.env()
        started = time.monotonic()
        client = subprocess.run(
            client_command(args, server.base_url, model, out),
            env=env,
            cwd=server.dir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=args.client_timeout,
        )
        client_s = time.monotonic() - started
        load_after = os.getloadavg()[0]
        after = scrape(server.metrics())
        (server.dir / "client.log").write_text(client.stdout + client.stderr)
        if client.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"vllm bench serve exited with {client.returncode}:\n"
                f"{(client.stdout + client.stderr)[-4000:]}"
            )
    result = json.loads(out.read_text())
    keep = (
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "ttfts",
        "itls",
        *(k for k in result if k.startswith(("p50_", "p99_", "median_", "mean_"))),
    )
    return {
        "config": config.name,
        "round": round_,
        "dir": str(server.dir),
        "command": server.command(),
        "client": client_command(args, server.base_url, model, out),
        "ready_s": server.ready_s,
        "warm_up_s": warm_s,
        "client_s": client_s,
        "load": [load_before, load_after],
        "result": {k: result[k] for k in keep if k in result},
        "metrics": delta(before, after),
        "leaked": list(server.leaked),
        "killed": server.killed,
    }
