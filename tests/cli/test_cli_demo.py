"""``kvmerge demo``: options, a small real run (vLLM's Scheduler, worker
processes behind vLLM's shm MessageQueue, KVOutputAggregator,
KVMergeMultiConnector, the scheduler's ZmqEventPublisher, the checking
subscriber, NVIDIA Dynamo's indexer, and --compare), Ctrl-C, a failing check.

The runs are subprocesses of the installed command (``python -m kvmerge``) with
small settings: each imports vLLM once (its workers are forked from it).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmerge.sim import FAMILY_NAMES
from kvmerge.sim.children import SIMULATED

pytestmark = pytest.mark.vllm

CMD = [sys.executable, "-m", "kvmerge"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
#: The demo's default children (the families this vLLM has) and their media.
MEDIA = {
    SIMULATED[name].cls.__name__: SIMULATED[name].cls.MEDIUM for name in FAMILY_NAMES
}
CONNECTORS = tuple(MEDIA)


def kvmerge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMD, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def number(text: str) -> int:
    return int(text.replace(",", ""))


# --- options (no vLLM import) ------------------------------------------------------
def test_help_is_fast_and_lists_the_commands():
    t = time.monotonic()
    proc = kvmerge("--help")
    assert proc.returncode == 0
    assert time.monotonic() - t < 10  # no vLLM import
    for name in ("demo", "subscribe", "example"):
        assert re.search(rf"^\s+{name}\b", proc.stdout, re.M), name


def test_demo_help_explains_every_option():
    proc = kvmerge("demo", "--help")
    assert proc.returncode == 0
    for option in (
        "--steps",
        "--workers",
        "--rate",
        "--blocks",
        "--seed",
        "--connectors",
        "--router",
        "--dynamo-python",
        "--lookups",
        "--clear-every",
        "--max-pending-steps",
        "--interval",
        "--compare",
        "--endpoint",
        "--replay-endpoint",
        "--topic",
        "--start-method",
        "--plain",
        "--verbose",
    ):
        assert option in proc.stdout, option
    assert "exit status" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers: must be between 1 and 64"),
        (["--steps", "x"], "--steps: not an integer"),
        (["--connectors", "lmcache,nixl"], "--connectors: expected a comma"),
        (["--connectors", "lmcache,lmcache"], "listed twice"),
        (["--endpoint", "tcp://127.0.0.1:5557"], "expected ipc://PATH"),
        (["--endpoint", "ipc:///no/such/dir/kv"], "no such directory"),
        (["--interval", "-1"], "--interval: must be between 0 and 60"),
        (["--rate", "x"], "--rate: not a number"),
        (["--blocks", "8"], "--blocks: must be between 16 and 100000"),
        (["--router", "llm-d"], "--router: invalid choice"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_options_exit_2_with_a_one_line_error(args, message):
    proc = kvmerge("demo", *args, timeout=60)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr


# --- a real run ------------------------------------------------------------------
def lane_table(out: str) -> dict[str, list[int]]:
    """connector -> [events in, out, pending, expired, cleared, withheld]
    (first table)."""
    rows: dict[str, list[int]] = {}
    for line in out.splitlines():
        m = re.match(r"(Sim\w+|total)\s+.*?((?:\s+[\d,]+){6})$", line)
        if m and m.group(1) not in rows:
            rows[m.group(1)] = [number(x) for x in m.group(2).split()]
    return rows


@dataclass
class DemoRun:
    demo: subprocess.CompletedProcess[str]
    subscriber: subprocess.CompletedProcess[str]
    jsonl: Path


@functools.cache
def demo_with_subscriber() -> DemoRun:
    """One small demo run (with --compare), and ``kvmerge subscribe`` reading
    its publisher at the same time (started together: both import vLLM).
    Shared by this file's and test_cli_subscribe's tests."""
    tmp = Path(tempfile.mkdtemp(prefix="kvmerge-test-demo-"))
    atexit.register(shutil.rmtree, tmp, True)
    endpoint = f"ipc://{tmp}/kv"
    replay = f"ipc://{tmp}/kv-replay"
    jsonl = tmp / "stream.jsonl"
    subscriber = subprocess.Popen(
        [
            *CMD,
            "subscribe",
            endpoint,
            "--replay",
            replay,
            "--topic",
            "kv-events",
            "--history",
            "--idle",
            "3",
            "--duration",
            "240",
            "--jsonl",
            str(jsonl),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        demo = kvmerge(
            "demo",
            "--steps",
            "120",
            "--rate",
            "1.5",
            "--seed",
            "7",
            "--clear-every",
            "40",
            "--interval",
            "0",
            "--compare",
            "--router",
            "dynamo",
            "--lookups",
            "60",
            "--endpoint",
            endpoint,
            "--replay-endpoint",
            replay,
        )
        out, err = subscriber.communicate(timeout=120)
    finally:
        if subscriber.poll() is None:
            subscriber.kill()
            subscriber.wait()
    return DemoRun(
        demo,
        subprocess.CompletedProcess(subscriber.args, subscriber.returncode, out, err),
        jsonl,
    )


def published(out: str) -> tuple[int, int, dict[str, int]]:
    """Batches, events and events per medium of the demo's stream."""
    m = re.search(
        r"^published ([\d,]+) batches, ([\d,]+) events \(by medium: (.*)\)$", out, re.M
    )
    assert m, out
    media = {k: number(v) for k, v in (x.split(" ") for x in m.group(3).split(", "))}
    return number(m.group(1)), number(m.group(2)), media


def test_demo_runs_the_pipeline_and_every_check_passes():
    proc = demo_with_subscriber().demo
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "\x1b[" not in out  # not a terminal: plain lines
    assert "vLLM's scheduler, 4 worker processes (TP ranks), 120 steps" in out
    assert "publishing on ipc://" in out and "/kv (topic 'kv-events'" in out
    assert "Dynamo's KV indexer follows it: http://127.0.0.1:" in out
    assert re.search(r"^step 120/120 ", out, re.M)  # the progress lines
    # vLLM's scheduler served the requests: some finished, some preempted.
    m = re.search(
        r"^120 steps in [\d.]+s: ([\d,]+) requests finished, ([\d,]+) "
        r"preempted, (\d+) prefix-cache resets",
        out,
        re.M,
    )
    assert m, out
    finished, preempted, resets = (number(g) for g in m.groups())
    assert finished > 50 and preempted > 0 and resets > 0
    # The summary table: every child, and the totals add up.
    rows = lane_table(out)
    assert set(rows) == {*CONNECTORS, "total"}, out
    assert re.search(
        r"^connector\s+rule\s+events in\s+out\s+pending\s+expired\s+cleared\s+"
        r"withheld$",
        out,
        re.M,
    ), out
    for column in range(6):
        assert rows["total"][column] == sum(rows[c][column] for c in CONNECTORS)
    assert rows["total"][0] > rows["total"][1] > 0
    # UMBP's pool is shared (rule any): nothing waits or expires.
    if "SimUMBP" in rows:
        assert rows["SimUMBP"][2:4] == [0, 0]
    # Each child has its medium; the GPU block pool's events and the clears too.
    _batches, events, media = published(out)
    assert media["-"] == resets  # AllBlocksCleared, from the GPU pool
    assert media["GPU"] > 0
    for name, medium in MEDIA.items():
        assert media[medium] == rows[name][1], name
    assert events == sum(media.values())
    checks = re.findall(r"^  (ok  |FAIL) (\w+):", out, re.M)
    assert checks == [
        ("ok  ", "sequence"),
        ("ok  ", "stream"),
        ("ok  ", "rules"),
        ("ok  ", "router"),
        ("ok  ", "lookups"),
    ], out
    assert re.search(
        r"ok   rules: the children's ([\d,]+) events are exactly what the "
        r"reference model",
        out,
    )
    assert re.search(
        r"ok   router: Dynamo applied [\d,]+ GPU stores, 0 with an "
        r"unknown parent; its counters equal the rules'",
        out,
    )
    m = re.search(r"ok   lookups: ([\d,]+) of ([\d,]+) lookups", out)
    assert m and m.group(1) == m.group(2) and number(m.group(1)) >= 60, out
    assert "result: every check passed" in out
    # --compare: vLLM's own path on the same requests and children, beside
    # kvmerge again with its workers in this process: the same stream.
    compare = out[out.index("--compare:") :]
    assert "kvmerge in this process publishes the same stream as with worker" in out
    for name in CONNECTORS:
        m = re.search(
            rf"^{name}\s+\S+(?: \[[\d, ]+\])?\s+([\d,]+)\s+([\d,]+)$", compare, re.M
        )
        assert m, compare
        assert number(m.group(1)) == rows[name][1], name
    assert re.search(
        r"^  kvmerge: [\d,]+ children's events, 0 events a router cannot apply; "
        r"Dynamo: 0 of [\d,]+ lookups differ",
        compare,
        re.M,
    ), compare
    m = re.search(
        r"^  vLLM   : [\d,]+ children's events, ([\d,]+) events a router cannot "
        r"apply; Dynamo: ([\d,]+) of",
        compare,
        re.M,
    )
    # vLLM's own rules publish what a router cannot apply (LMCache's loses
    # the late rank's reports; none of them is guarded).
    assert m and number(m.group(1)) > 0, compare
    assert len(re.findall(r"; scheduler side per step p50 [\d.]+ ms", compare)) == 2


# --- Ctrl-C ----------------------------------------------------------------------
class Running:
    """A demo subprocess whose output lines are read on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*CMD, "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.seen)
                continue
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no {pattern!r} in:\n{''.join(self.seen)}")

    def finish(self, timeout: float = 60) -> str:
        self.proc.wait(timeout)
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (None: no process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid`` (from /proc): pid -> its start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if fields := _stat(child):
                out[child] = fields[19]
            todo.append(child)
    return out


def assert_all_gone(family: dict[int, str], timeout: float = 10) -> None:
    """None of these processes exists any more, not even as a zombie (the
    demo reaps its workers and multiprocessing's resource tracker)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {
            pid: " ".join(f[:1])
            for pid, started in family.items()
            if (f := _stat(pid)) is not None and f[19] == started
        }
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left (pid: state): {left}")
        time.sleep(0.2)


def test_ctrl_c_stops_cleanly_while_starting_and_while_stepping():
    """SIGINT to the main process (as Ctrl-C): once right after the workers
    were started (they are building their connectors), once while it steps.
    Exit code 130, no process left running, the shared memory unlinked.
    (Both demos run at the same time: each imports vLLM.)"""
    starting = Running("--steps", "50", "--plain")
    stepping = Running("--steps", "20000", "--verbose", "--plain")
    try:
        starting.wait_for(r"^importing vLLM")
        time.sleep(1.0)
        early_family = descendants(starting.proc.pid)
        starting.proc.send_signal(signal.SIGINT)

        stepping.wait_for(r"^ready in ")
        out = "".join(stepping.seen)
        workers = dict(
            (int(r), int(p))
            for r, p in re.findall(r"worker (\d+): pid (\d+), response", out)
        )
        shm = re.findall(r"shm (\w+)$", out, re.M)
        assert len(workers) == 4 and len(shm) == 5, out
        family = descendants(stepping.proc.pid)
        assert set(workers.values()) <= set(family)
        time.sleep(1.0)  # some steps
        stepping.proc.send_signal(signal.SIGINT)

        early_out = starting.finish()
        out = stepping.finish()
    finally:
        for demo in (starting, stepping):
            if demo.proc.poll() is None:
                demo.proc.kill()
                demo.proc.wait()
    assert starting.proc.returncode == 130, early_out
    assert re.search(r"interrupted after 0 of 50 steps", early_out), early_out
    assert "Traceback" not in early_out
    assert_all_gone(early_family)

    assert stepping.proc.returncode == 130, out
    assert re.search(r"interrupted after \d+ of 20000 steps: workers stopped", out), out
    assert "Traceback" not in out
    assert_all_gone(family)
    for name in shm:
        assert not Path("/dev/shm", name).exists(), name


def test_without_waiting_the_guard_withholds_and_every_check_passes():
    """Without waiting (max_pending_steps 0, vLLM's same-step rule) the late
    rank's reports expire, and the rules publish stores whose parent was never
    published and removals of blocks never stored: the connector's guard
    withholds them (counted in the withheld column), so the stream stays one a
    router can apply, and it is what the reference model of the rules (with
    the guard) publishes. Also: 3 ranks, two children."""
    proc = kvmerge(
        "demo",
        "--steps",
        "150",
        "--workers",
        "3",
        "--connectors",
        "mooncake,lmcache",
        "--max-pending-steps",
        "0",
        "--interval",
        "0",
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "3 worker processes (TP ranks)" in out
    rows = lane_table(out)
    assert set(rows) == {"SimMooncake", "SimLMCache", "total"}, out
    for column in range(6):
        assert rows["total"][column] == sum(
            rows[c][column] for c in ("SimMooncake", "SimLMCache")
        )
    # Nothing waits: reports expire, and the guard withholds what they leave.
    assert rows["total"][2] == 0 and rows["total"][3] > 0
    assert rows["SimMooncake"][5] > 0 and rows["SimLMCache"][5] > 0, out
    checks = re.findall(r"^  (ok  |FAIL) (\w+):", out, re.M)
    assert [name for _, name in checks][:3] == ["sequence", "stream", "rules"], out
    assert all(status == "ok  " for status, _ in checks), out
    assert re.search(
        r"^  ok   stream: the children's events, a router can apply each: 0 stores "
        r"before their parent's, 0 of a block held, 0 removals of a block not held",
        out,
        re.M,
    ), out
    assert "result: every check passed" in out


def test_a_failed_check_exits_1(monkeypatch, capsys):
    """The demo's own run, in this process, with the stream it read back
    damaged after the run (one of the children's stores lost, as a dropped
    message would lose it): the rules check sees the difference, the demo
    says FAILED and exits 1."""
    from vllm.distributed.kv_events import MEDIUM_GPU

    from kvmerge.cli import main
    from kvmerge.sim import run as sim_run

    finish = sim_run.Run.finish
    dropped: list[object] = []

    def damaged_finish(self):
        result = finish(self)
        i = next(
            i
            for i, e in enumerate(result.stream)
            if type(e).__name__ == "BlockStored" and e.medium not in (MEDIUM_GPU, None)
        )
        dropped.append(result.stream[i])
        stream = result.stream[:i] + result.stream[i + 1 :]
        return dataclasses.replace(result, stream=stream)

    monkeypatch.setattr(sim_run.Run, "finish", damaged_finish)
    code = main(
        [
            "demo",
            "--steps",
            "40",
            "--workers",
            "2",
            "--connectors",
            "lmcache",
            "--router",
            "none",
            "--interval",
            "0",
            "--plain",
            "--verbose",  # leaves this process's log levels alone
        ]
    )
    out = capsys.readouterr().out
    assert len(dropped) == 1, out
    assert code == 1, out
    assert re.search(r"^  ok   sequence:", out, re.M), out
    assert re.search(r"^  FAIL rules: ", out, re.M), out
    assert "result: FAILED (see above)" in out
