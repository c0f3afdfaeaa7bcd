"""kvmerge's logs and metrics where vLLM's are.

Logs: in a fresh process, vLLM's own logging setup (``configure_logging``, as
``vllm serve`` runs it) and a real scheduler connector; kvmerge's INFO and
WARNING lines come out in vLLM's format on vLLM's stream, and
``VLLM_LOGGING_LEVEL=WARNING`` drops the INFO.

Metrics: merged steps through the harness (workers' outputs with their
``kv_connector_stats`` as the model runner sets them, pickled, aggregated),
the scheduler's part of ``update_from_output`` for the stats, the
``SchedulerStats`` through vLLM's msgpack as the engine core sends it, then
vLLM's real ``PrometheusStatLogger`` and ``LoggingStatLogger``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from support.vllm_children import LMCacheChild
from support.vllm_harness import Cluster, child, removed, stored, worker_output
from vllm.config import ModelConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvmerge.sim.model import model_dir
from kvmerge.sim.transport import shm_roundtrip
from kvmerge.vllm.stats import (
    KEY,
    METRIC_NAMES,
    REPORT_NS,
    STEP_KEY,
    STEP_METRIC_NAMES,
    WORKER_METRIC_NAMES,
    Interval,
    WorkerMeter,
)

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parents[1]


# --- logs ----------------------------------------------------------------------
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # what `vllm serve` does at start-up
    from support.vllm_harness import Bus, Cluster, child, stored

    from kvmerge.vllm import register

    register()
    bus = Bus()
    # The scheduler's child logs its rule (INFO) when it is built.
    c = Cluster([child("LMCacheChild", kv_events_merge="all")], bus, tp=2)
    # Rank 1 sends no output: the worker-loss incident warning.
    c.emit(0, 0, [stored(1)])
    c.schedule(c.aggregate(ranks=[0]))
    bus.close()
    sys.stdout.flush()
    print("\\nRESULT " + json.dumps({"pid": os.getpid()}), file=sys.stderr)
    """
)

# vLLM's _FORMAT: "(%(vllm_process_name)s pid=%(process)d) %(levelname)s
# %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s", dates "%m-%d %H:%M:%S".
VLLM_LINE = re.compile(
    r"^\((?P<process>[^ ]+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) "
    r"(?P<date>\d\d-\d\d \d\d:\d\d:\d\d) \[(?P<file>[^:\]]+):(?P<line>\d+)\] "
    r"(?P<message>.*)$"
)


def run_under_vllm_logging(level: str) -> tuple[list[re.Match], str, int]:
    env = dict(os.environ)
    for name in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_CONFIG_PATH"):
        env.pop(name, None)
    env.update(
        VLLM_LOGGING_LEVEL=level,
        VLLM_CONFIGURE_LOGGING="1",
        VLLM_LOGGING_COLOR="0",
        VLLM_LOGGING_PREFIX="",
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TESTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stderr.rsplit("RESULT ", 1)[1])
    lines = [m for m in map(VLLM_LINE.match, out.stdout.splitlines()) if m]
    return lines, out.stderr, result["pid"]


def kvmerge_lines(lines: list[re.Match]) -> dict[str, re.Match]:
    found = {}
    for m in lines:
        if "merging with rule" in m["message"]:
            found["info"] = m
        elif "sent no output" in m["message"]:
            found["warning"] = m
    return found


def test_info_and_warnings_come_out_in_vllm_format_on_vllm_stream():
    lines, stderr, pid = run_under_vllm_logging("INFO")
    found = kvmerge_lines(lines)
    assert set(found) == {"info", "warning"}, [m.group(0) for m in lines]
    info, warning = found["info"], found["warning"]
    assert info["level"] == "INFO" and warning["level"] == "WARNING"
    assert int(info["pid"]) == int(warning["pid"]) == pid
    assert info["file"] == "connector.py" and warning["file"] == "incidents.py"
    assert info["message"].startswith(
        "KVMergeMultiConnector connectors[0] (LMCacheChild): merging with rule 'all'"
    )
    assert "vllm:kvmerge_expired_total" in warning["message"]
    # On vLLM's stream (stdout) only: nothing bare on stderr.
    assert "merging with rule" not in stderr and "sent no output" not in stderr


def test_vllm_logging_level_warning_drops_our_info():
    lines, stderr, _pid = run_under_vllm_logging("WARNING")
    found = kvmerge_lines(lines)
    assert set(found) == {"warning"}, [m.group(0) for m in lines]
    assert "merging with rule" not in stderr


def test_plugin_loggers_are_under_vllm():
    from kvmerge.vllm import alias, connector, incidents, versions

    for module in (connector, incidents, alias, versions):
        assert module.logger.name.startswith("vllm.kvmerge."), module.logger.name
        assert module.logger.parent is not None


# --- metrics -------------------------------------------------------------------
@dataclass
class LoadStats(KVConnectorStats):
    """A child's own worker-side stats (kept working beside kvmerge's)."""

    def reset(self):
        self.data = {"loads": 0}

    def aggregate(self, other):
        self.data["loads"] = self.data.get("loads", 0) + other.data.get("loads", 0)
        return self

    def reduce(self):
        return {"loads": self.data.get("loads", 0)}

    def is_empty(self):
        return not self.data.get("loads")


class LoadProm(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.loads = self._counter_cls(
            name="vllm:test_child_loads", documentation="loads", labelnames=labelnames
        )

    def observe(self, transfer_stats_data, engine_idx=0):
        values = self.per_engine_labelvalues[engine_idx]
        self.loads.labels(*values).inc(transfer_stats_data["loads"])


class StatsChild(LMCacheChild):
    """An LMCache-like child with stats of its own: one load per worker step."""

    def get_kv_connector_stats(self):
        return LoadStats(data={"loads": 1}) if self._role.name == "WORKER" else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return LoadStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ):
        return LoadProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class SlowChild(LMCacheChild):
    """An LMCache-like child whose scheduler side takes ``SLOW_S`` per step:
    time the connector's own step time must include."""

    def take_events(self):
        time.sleep(SLOW_S)
        return super().take_events()


SLOW_S = 0.002


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """A real ModelConfig for the stat loggers, from the harness's tiny model."""
    path = model_dir(tmp_path_factory.mktemp("tiny"))
    return ModelConfig(
        model=str(path), skip_tokenizer_init=True, served_model_name="tiny"
    )


@pytest.fixture(scope="module", autouse=True)
def _stats_child(registered):
    # MultiConnector rebuilds a child's stats by its registered name.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector("StatsChild", __name__, "StatsChild")
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector("SlowChild", __name__, "SlowChild")


def stats_child(name: str = "StatsChild", **extra) -> dict:
    return {**child(name, **extra), "kv_connector_module_path": __name__}


def engine_step(
    c: Cluster, ranks=None, sent: list[int] | None = None
) -> SchedulerStats:
    """One step, the stats as the engine core sends them to the front end
    (each worker output's bytes appended to ``sent``)."""
    ranks = range(c.world_size) if ranks is None else ranks
    outputs = []
    for r in ranks:
        worker = c.workers[r]
        # KVConnectorModelRunnerMixin: the worker connector's stats, then its events.
        out = worker_output(worker, kv_connector_stats=worker.get_kv_connector_stats())
        if sent is not None:
            (made,) = out.kv_connector_output.kv_cache_events.outputs
            sent.append(made.nbytes)
        outputs.append(shm_roundtrip(out)[0])
    output = c.aggregator.aggregate(outputs, output_rank=0)
    kv_out = output.kv_connector_output
    c.bus.publish(c.schedule(output))
    # Scheduler.update_from_output, then make_stats.
    kv_stats = kv_out.kv_connector_stats if kv_out else None
    sched = c.scheduler.get_kv_connector_stats()
    if sched is not None and not sched.is_empty():
        kv_stats = kv_stats.aggregate(sched) if kv_stats is not None else sched
    stats = SchedulerStats(kv_connector_stats=kv_stats.to_dict() if kv_stats else None)
    # EngineCoreOutputs go to the front end msgpack-encoded.
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    return MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats


def sample(text: str, name: str, connector: str) -> float:
    pattern = re.compile(
        rf"^{re.escape(name)}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$", re.M
    )
    for m in pattern.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("connector") == connector:
            assert labels["model_name"] == "tiny" and labels["engine"] == "0"
            return float(m["value"])
    raise AssertionError(f"no {name} for {connector}:\n{text}")


def transfer_line(logging_logger: LoggingStatLogger, caplog) -> str:
    """The periodic "KV Transfer metrics" line the logger writes now (an idle
    engine's: at DEBUG)."""
    with caplog.at_level(logging.DEBUG, logger="vllm"):
        logging_logger.log()
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("KV Transfer metrics")
    ]
    return line


def test_counters_reach_prometheus_and_the_logging_line(bus, model_config, caplog):
    c = Cluster(
        [stats_child(kv_events_merge="all"), child("LMCacheChild")],
        bus,
        tp=2,
        max_pending_steps=1,
    )
    cfg = copy.copy(c.cfg)
    cfg.model_config = model_config
    prom = PrometheusStatLogger(cfg)
    logging_logger = LoggingStatLogger(cfg)

    def run(step, ranks=None):
        stats = engine_step(c, ranks)
        prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        logging_logger.record(scheduler_stats=stats, iteration_stats=None)

    # Step 0: both ranks report [1, 2] on child 0, and on child 1 a store of
    # 1 and a removal of 5, a block child 1 never stored: the guard withholds it.
    for r in (0, 1):
        c.emit(r, 0, [stored(1), stored(2, 1)])
        c.emit(r, 1, [stored(1), removed(5)])
    run(0)
    # Steps 1-2: rank 1 is gone; rank 0's reports of child 0 wait, then expire.
    for step in (1, 2):
        c.emit(0, 0, [stored(10 + step)])
        run(step, ranks=[0])

    text = generate_latest(REGISTRY).decode()
    child0 = "connectors[0] (StatsChild)"
    child1 = "connectors[1] (LMCacheChild)"
    expected = {
        child0: {
            "reports": 6,
            "published": 2,
            "expired": 1,
            "cleared": 0,
            "withheld": 0,
        },
        child1: {
            "reports": 4,
            "published": 1,
            "expired": 0,
            "cleared": 0,
            "withheld": 1,
        },
    }
    merger_stats = c.scheduler.merge_stats()
    for label, want in expected.items():
        index = 0 if label == child0 else 1
        for name, value in want.items():
            assert merger_stats[index][name] == value, (label, name)
            assert sample(text, f"vllm:kvmerge_{name}_total", label) == value
        assert sample(text, "vllm:kvmerge_refused_total", label) == 0
    # Rank 0's report of step 2 waits still; the gauge is the latest level.
    assert sample(text, "vllm:kvmerge_pending", child0) == merger_stats[0]["pending"]
    assert merger_stats[0]["pending"] == 1
    assert sample(text, "vllm:kvmerge_pending", child1) == 0
    for name in METRIC_NAMES:
        kind = "counter" if name.endswith("_total") else "gauge"
        assert f"# TYPE {name} {kind}\n" in text, name
    # The child's own stats still get through MultiConnector's path.
    loads = re.search(r"^vllm:test_child_loads_total\{[^}]*\} (\S+)$", text, re.M)
    assert loads is not None and float(loads[1]) == 2 + 1 + 1

    # The periodic logging line (idle engine: at DEBUG).
    line = transfer_line(logging_logger, caplog)
    assert "StatsChild={'loads': 4}" in line
    assert (
        f"kvmerge={{'{child0}': 'reports=6 published=2 expired=1 cleared=0 "
        f"withheld=0 refused=0 pending=1', '{child1}': 'reports=4 published=1 "
        "expired=0 cleared=0 withheld=1 refused=0 pending=0'}"
    ) in line, line


def test_refused_batches_are_counted(bus, model_config):
    """The child's ``refused`` counter reaches Prometheus (set by hand here: the
    connector increments it where it drops a bad batch)."""
    c = Cluster([child("LMCacheChild", kv_events_merge="all")], bus, tp=1)
    cfg = copy.copy(c.cfg)
    cfg.model_config = model_config
    prom = PrometheusStatLogger(cfg)
    c.emit(0, 0, [stored(1)])
    prom.record(scheduler_stats=engine_step(c), iteration_stats=None)
    c.scheduler._children[0].refused = 3
    prom.record(scheduler_stats=engine_step(c), iteration_stats=None)
    c.scheduler._children[0].refused = 4
    prom.record(scheduler_stats=engine_step(c), iteration_stats=None)
    text = generate_latest(REGISTRY).decode()
    label = "connectors[0] (LMCacheChild)"
    assert sample(text, "vllm:kvmerge_refused_total", label) == 4
    assert sample(text, "vllm:kvmerge_reports_total", label) == 1
    assert sample(text, "vllm:kvmerge_published_total", label) == 1


def engine_sample(text: str, name: str) -> float:
    """The value of ``name`` (labels ``model_name`` and ``engine`` only)."""
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.M)
    for m in pattern.finditer(text):
        if dict(re.findall(r'(\w+)="([^"]*)"', m[1])) == {
            "model_name": "tiny",
            "engine": "0",
        }:
            return float(m[2])
    raise AssertionError(f"no {name}:\n{text}")


def test_the_connectors_own_step_time_reaches_prometheus_and_the_log(
    bus, model_config, caplog
):
    c = Cluster(
        [stats_child("SlowChild", kv_events_merge="all")],
        bus,
        tp=2,
        max_pending_steps=1,
    )
    cfg = copy.copy(c.cfg)
    cfg.model_config = model_config
    prom = PrometheusStatLogger(cfg)
    logging_logger = LoggingStatLogger(cfg)
    steps = 6
    for step in range(steps):
        for r in (0, 1):
            c.emit(r, 0, [stored(step + 1)])
        stats = engine_step(c)
        prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        logging_logger.record(scheduler_stats=stats, iteration_stats=None)

    text = generate_latest(REGISTRY).decode()
    for name in STEP_METRIC_NAMES:
        assert f"# TYPE {name} counter\n" in text, name
    steps_name, seconds_name = STEP_METRIC_NAMES
    # One step per take_events, as vLLM's scheduler calls it.
    assert engine_sample(text, steps_name) == steps == c.scheduler._timer.steps
    seconds = engine_sample(text, seconds_name)
    # The child's sleep is the connector's time too; only the last
    # get_kv_connector_stats call's own time is still to be sent.
    timer = c.scheduler._timer
    assert steps * SLOW_S <= seconds <= timer.ns / 1e9
    assert seconds < steps * SLOW_S + 1.0
    # Still one per child for the children's counters.
    assert (
        sample(text, "vllm:kvmerge_published_total", "connectors[0] (SlowChild)") == 6
    )

    line = transfer_line(logging_logger, caplog)
    m = re.search(
        r"kvmerge_step=\{'steps': (\d+), 'ms': ([\d.]+), 'us_per_step': ([\d.]+)\}",
        line,
    )
    assert m is not None, line
    assert int(m[1]) == steps
    assert float(m[2]) == pytest.approx(seconds * 1e3, abs=1e-3)
    assert float(m[3]) == pytest.approx(seconds * 1e6 / steps, abs=0.1)
    assert float(m[3]) >= SLOW_S * 1e6


def test_the_workers_encode_time_and_bytes_reach_prometheus_and_the_log(
    bus, model_config, caplog, monkeypatch
):
    """Every worker's outputs, kvmerge's time making them and their bytes,
    summed over the ranks by vLLM's aggregator, as each worker reported them
    (a worker reports its outputs at the next step's stats call)."""
    monkeypatch.setattr(Interval, "interval_ns", 0)
    c = Cluster([child("LMCacheChild", kv_events_merge="all")], bus, tp=2)
    cfg = copy.copy(c.cfg)
    cfg.model_config = model_config
    prom = PrometheusStatLogger(cfg)
    logging_logger = LoggingStatLogger(cfg)
    steps = 6
    sent: list[int] = []
    for step in range(steps + 1):
        if step < steps:
            for r in (0, 1):
                c.emit(r, 0, [stored(10 * step + k + 1) for k in range(step + 1)])
        stats = engine_step(c, sent=sent)
        prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        logging_logger.record(scheduler_stats=stats, iteration_stats=None)
    # The last step's outputs are reported at the step after it.
    reported = sent[: 2 * steps]
    assert len(set(reported)) > 1, "outputs of several sizes"
    text = generate_latest(REGISTRY).decode()
    outputs_name, seconds_name, bytes_name = WORKER_METRIC_NAMES
    for name in WORKER_METRIC_NAMES:
        assert f"# TYPE {name} counter\n" in text, name
    assert engine_sample(text, outputs_name) == 2 * steps
    assert engine_sample(text, bytes_name) == sum(reported)
    seconds = engine_sample(text, seconds_name)
    assert 0 < seconds < 1.0

    line = transfer_line(logging_logger, caplog)
    m = re.search(
        r"kvmerge_worker=\{'outputs': (\d+), 'us_per_output': ([\d.]+), "
        r"'bytes_per_output': (\d+)\}",
        line,
    )
    assert m is not None, line
    assert int(m[1]) == 2 * steps
    assert float(m[2]) == pytest.approx(seconds * 1e6 / (2 * steps), abs=0.1)
    assert int(m[3]) == round(sum(reported) / (2 * steps))


def test_a_worker_reports_at_most_once_an_interval():
    """What a worker adds to its step's message is nothing most steps; no
    output is lost between two reports."""
    meter = WorkerMeter()
    assert meter.collect(0) is None, "nothing made yet"
    meter.add(1_000, 100)
    first = meter.collect(0)
    assert first is not None and first.data == {
        "outputs": 1,
        "encode_ns": 1_000,
        "bytes": 100,
    }
    meter.add(2_000, 300)
    assert meter.collect(REPORT_NS - 1) is None
    meter.add(3_000, 500)
    later = meter.collect(REPORT_NS)
    assert later is not None
    assert later.data == {"outputs": 2, "encode_ns": 5_000, "bytes": 800}
    assert later.reduce() == {
        "outputs": 2,
        "us_per_output": 2.5,
        "bytes_per_output": 400,
    }


def _scheduler_entries(stats: SchedulerStats | None) -> dict:
    """kvmerge's scheduler-side entries in a step's stats (not the workers')."""
    data = (stats.kv_connector_stats if stats is not None else None) or {}
    return {k: v for k, v in data.items() if k in (KEY, STEP_KEY)}


@pytest.mark.parametrize("flush_when_idle", [True, False], ids=["idle", "broken"])
def test_the_scheduler_reports_once_an_interval_and_whole_when_idle(
    tmp_path, monkeypatch, flush_when_idle
):
    """vLLM's own scheduler loop (``kvmerge.sim.engine``, TP 2, the simulated
    LMCache child and its faults) in two waves of requests, with an interval
    no wave lasts: kvmerge's entries reach ``SchedulerStats`` at the first
    step and at the steps that leave no request unfinished (the last of
    each wave, and the one after it that tells the workers), none between,
    and what they sum to is every step and every count the merger has.
    ``broken``: the same with the idle flush taken out, which must fail that
    sum (the check fails when it should)."""
    from vllm.config import KVEventsConfig

    from kvmerge.sim.children import entry
    from kvmerge.sim.engine import Engine
    from kvmerge.sim.model import engine_config
    from kvmerge.sim.requests import Arrivals
    from kvmerge.vllm import register
    from kvmerge.vllm.stats import SchedulerReports

    register()
    monkeypatch.setattr(Interval, "interval_ns", 10**15)
    if not flush_when_idle:
        monkeypatch.setattr(SchedulerReports, "finished", lambda self, request_id: None)
    cfg = engine_config(
        model_dir(tmp_path, 2),
        [entry("lmcache", 0, capacity=24, seed=3)],
        world_size=2,
        num_blocks=64,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{tmp_path}/kv",
            replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        ),
    )
    engine = Engine(cfg, num_blocks=64, log_stats=True)
    try:
        arrivals = Arrivals(seed=5)
        reported: list[bool] = []
        idle: list[int] = []
        sums = {"steps": 0, "published": 0, "reports": 0}
        for _wave in range(2):
            engine.add(arrivals.prompt() for _ in range(4))
            while engine.scheduler.has_requests():
                ours = _scheduler_entries(engine.step().scheduler_stats)
                if not engine.scheduler.get_num_unfinished_requests():
                    idle.append(len(reported))
                reported.append(bool(ours))
                if ours:
                    sums["steps"] += ours[STEP_KEY]["steps"]
                    for counts in ours.get(KEY, {}).values():
                        sums["published"] += counts["published"]
                        sums["reports"] += counts["reports"]
            assert idle[-1] == len(reported) - 1
        (merged,) = engine.connector.merge_stats()
        steps = len(reported)
    finally:
        engine.close()
    assert steps > 10 and merged["published"] > 20 and merged["reports"] > 40
    assert 2 <= len(idle) <= 4, idle
    whole = {
        "steps": steps,
        "published": merged["published"],
        "reports": merged["reports"],
    }
    if not flush_when_idle:
        assert [i for i, r in enumerate(reported) if r] == [0]
        assert sums != whole
        return
    assert [i for i, r in enumerate(reported) if r] == [0, *idle]
    assert sums == whole
