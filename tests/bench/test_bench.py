"""``benches.compare``: the workload generator, the transport emulation, and a
tiny run end to end (JSON, PNG, path B equal to the reference model)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

import kvmerge
from benches.compare import build_parser, grid_from_args, main, run_bench
from benches.compare.check import ChildDiff
from benches.compare.paths import EmptyEvents, Floor, PathB
from benches.compare.runner import Case, run_case
from benches.compare.workload import Workload, WorkloadConfig, preset
from kvmerge.sim.transport import OOB_THRESHOLD, dequeue, enqueue
from kvmerge.vllm.container import KVMergeKVEvents

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

ENC = msgspec.msgpack.Encoder()


def encoded(config: WorkloadConfig, steps: int) -> list:
    return [
        [[[ENC.encode(e) for e in rank] for rank in child] for child in step.events]
        for step in Workload(config).steps(steps)
    ]


def test_module_imports_no_vllm():
    code = (
        "import argparse, sys, benches.compare as b; "
        "b.add_arguments(argparse.ArgumentParser()); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# --- workload --------------------------------------------------------------------
def test_workload_is_deterministic_per_seed():
    cfg = WorkloadConfig(world_size=4, events=40, missing=0.1, late=0.1, duplicate=0.1)
    assert encoded(cfg, 3) == encoded(cfg, 3)
    other = WorkloadConfig(**{**cfg.as_dict(), "children": cfg.children, "seed": 1})
    assert encoded(other, 3) != encoded(cfg, 3)


def test_uniform_workload_sizes():
    step = Workload(WorkloadConfig(world_size=3, events=2000)).next_step()
    for child in step.events:
        assert len(child) == 3
        assert all(rank == child[0] for rank in child)  # same events everywhere
        assert len(child[0]) == 2000
        stores = [e for e in child[0] if isinstance(e, BlockStored)]
        removals = [e for e in child[0] if isinstance(e, BlockRemoved)]
        assert len(stores) + len(removals) == 2000
        assert 0.10 < len(removals) / 2000 < 0.20
        for e in stores:
            assert 1 <= len(e.block_hashes) <= 16 and e.block_size == 16
            assert len(e.token_ids) == 16 * len(e.block_hashes)
            assert all(isinstance(h, int) for h in e.block_hashes)
    lmcache, mooncake = step.events
    assert all(e.group_idx is None for e in lmcache[0] if isinstance(e, BlockStored))
    assert all(e.group_idx == 0 for e in mooncake[0] if isinstance(e, BlockStored))


def test_one_block_per_event():
    """The "one-block" workload stores one block per ``BlockStored``, as vLLM's
    Mooncake store reports them; the same number of reports as "uniform"."""
    one = Workload(preset("one-block", world_size=2, events=400)).next_step()
    uniform = Workload(preset("uniform", world_size=2, events=400)).next_step()
    assert one.count() == uniform.count()
    for child in one.events:
        stores = [e for e in child[0] if isinstance(e, BlockStored)]
        assert len(stores) > 300
        assert all(len(e.block_hashes) == 1 for e in stores)
        assert all(len(e.token_ids) == 16 for e in stores)
    sizes = {len(e.block_hashes) for c in uniform.events for e in c[0]}
    assert min(sizes) == 1 and max(sizes) == 16


def test_the_default_grid_runs_every_workload():
    """Beside the uniform grid, every named workload, one block per event
    among them, at TP 8 x 32 and x 512."""
    from benches.compare.presets import PRESETS

    keys = [c.key for c in grid_from_args(build_parser().parse_args([]))]
    assert keys[:12] == [
        f"uniform/tp{tp}/{n}" for tp in (2, 4, 8) for n in (32, 128, 512, 2048)
    ]
    others = [w for w in PRESETS if w != "uniform"]
    assert "one-block" in others
    assert keys[12:] == [f"{w}/tp8/{n}" for w in others for n in (32, 512)]
    quick = [c.key for c in grid_from_args(build_parser().parse_args(["--quick"]))]
    assert "one-block/tp2/16" in quick


def test_the_plot_draws_one_block_per_event_beside_uniform(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from benches.compare import report

    def case(workload: str, events: int) -> dict:
        summary = {"scheduler_ms": events / 100}
        return {
            "workload": workload,
            "world_size": 8,
            "events": events,
            "summary": {"A": summary, "B": summary},
        }

    drawn = []
    original = plt.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append(kwargs["label"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", plot)
    cases = [case(w, n) for w in ("uniform", "one-block") for n in (32, 512)]
    assert report.plot(tmp_path / "a.png", cases)
    assert report.plot(tmp_path / "b.png", cases[2:])
    assert drawn == [
        "A vLLM 0.33.0, TP=8",
        "B kvmerge, TP=8",
        "A vLLM 0.33.0, TP=8, one block per event",
        "B kvmerge, TP=8, one block per event",
        "A vLLM 0.33.0, TP=8, one block per event",
        "B kvmerge, TP=8, one block per event",
    ]
    assert not report.plot(tmp_path / "c.png", [case("bytes", 32)])


def test_knob_missing():
    step = Workload(WorkloadConfig(world_size=4, events=200, missing=0.2)).next_step()
    for child in step.events:
        counts = Counter(ENC.encode(e) for rank in child for e in rank)
        partial = [n for n in counts.values() if n < 4]
        assert partial and all(1 <= n <= 3 for n in partial)


def test_knob_late():
    w = Workload(WorkloadConfig(world_size=4, events=200, late=0.2))
    s0, s1 = w.next_step(), w.next_step()
    step0, step1 = s0.events[0], s1.events[0]  # child 0 in steps 0 and 1
    assert min(len(r) for r in step0) < 200  # some rank held events back
    everywhere0 = set.intersection(*({ENC.encode(e) for e in r} for r in step0))
    late = {ENC.encode(e) for r in step1 for e in r} & {
        ENC.encode(e) for r in step0 for e in r
    }
    # Events of step 0 that show up in step 1, on one rank only.
    assert late and not late & everywhere0
    for key in late:
        assert sum(key in {ENC.encode(e) for e in r} for r in step1) == 1


def test_knob_duplicate():
    step = Workload(WorkloadConfig(world_size=4, events=200, duplicate=0.2)).next_step()
    for child in step.events:
        dups = 0
        for rank in child:
            for a, b in itertools.pairwise(rank):
                if a == b:
                    assert a is not b  # a separate object, as a worker builds it
                    dups += 1
        assert dups > 10


def test_knob_clears_only_where_the_container_can_carry_them():
    cfg = WorkloadConfig(
        world_size=3, events=20, children=("lmcache", "mooncake", "list"), clear_every=2
    )
    steps = list(Workload(cfg).steps(4))
    for step in steps:
        lmcache, mooncake, lst = step.events
        for child in (lmcache, mooncake):
            assert not any(isinstance(e, AllBlocksCleared) for r in child for e in r)
        clears = [sum(isinstance(e, AllBlocksCleared) for e in r) for r in lst]
        assert clears == ([1, 1, 1] if step.index in (1, 3) else [0, 0, 0])


def test_knob_bytes_hashes():
    step = Workload(
        WorkloadConfig(world_size=2, events=50, bytes_hashes=True)
    ).next_step()
    for e in step.events[0][0]:
        assert all(isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes)


def test_knobs_late_rank_and_silent_rank():
    late = Workload(preset("straggler", world_size=3, events=10))
    s0, s1 = late.next_step(), late.next_step()
    for c0, c1 in zip(s0.events, s1.events, strict=True):
        assert c0[2] == [] and c1[2] == c0[0]  # the step before's, all of them
        assert c0[0] == c0[1] and len(c0[0]) == 10
    silent = Workload(preset("silent", world_size=3, events=10))
    for step in silent.steps(2):
        for child in step.events:
            assert child[2] == [] and len(child[0]) == len(child[1]) == 10


def _case(workload: str, events: int, b_ms: float) -> dict:
    summary = {"scheduler_ms": b_ms, "scheduler_cpu_ms": b_ms}
    return {
        "case": f"{workload}/tp8/{events}",
        "workload": workload,
        "summary": {"A": summary, "B": summary},
        "ratio": {
            "scheduler_a_over_b": 1.0,
            "scheduler_cpu_a_over_b": 1.0,
            "worker_a_over_b": 1.0,
            "worker_cpu_a_over_b": 1.0,
            "bytes_b_over_a": 1.0,
        },
    }


def test_straggler_targets_compare_with_the_healthy_case():
    from benches.compare.runner import targets

    cases = [
        _case("uniform", 512, 1.0),
        _case("straggler", 512, 1.2),
        _case("silent", 512, 2.5),
        _case("uniform", 32, 0.5),
        _case("straggler", 32, 0.7),
        _case("silent", 32, 0.6),
    ]
    met = {t["target"]: t["met"] for t in targets(cases) if "on time" in t["target"]}
    assert len(met) == 4
    late = {k: v for k, v in met.items() if "late" in k}
    silent = {k: v for k, v in met.items() if "silent" in k}
    assert sorted(late.values()) == [False, True]  # 1.2x met, 1.4x missed
    assert sorted(silent.values()) == [False, True]  # 2.5x missed, 1.2x met
    assert all("512" in k for k, v in late.items() if v)


def test_issue_14_targets_are_reported():
    from benches.compare.runner import targets

    def case(workload: str, events: int, sched_ms: float, a_over_b: float) -> dict:
        c = _case(workload, events, sched_ms)
        c["ratio"]["scheduler_a_over_b"] = a_over_b
        c["ratio"]["worker_a_over_b"] = a_over_b
        return c

    def verdicts(cases: list[dict]) -> dict[str, bool | None]:
        wanted = ("32-byte hashes", "three children", "A/B >= 1.5 (every uniform")
        return {
            t["target"]: t["met"]
            for t in targets(cases)
            if any(w in t["target"] for w in wanted)
        }

    met = verdicts(
        [
            case("bytes", 512, 1.0, 120.0),
            case("clears", 32, 0.15, 45.0),
            case("uniform", 32, 0.2, 1.6),
        ]
    )
    assert list(met.values()) == [True, True, True], met
    missed = verdicts(
        [
            case("bytes", 512, 1.0, 80.0),
            case("clears", 32, 0.25, 45.0),  # fast enough a ratio, too slow
            case("uniform", 32, 0.2, 1.2),
        ]
    )
    assert list(missed.values()) == [False, False, False], missed
    assert set(verdicts([]).values()) == {None}


def test_presets():
    assert preset("skewed", world_size=2, events=4).late > 0
    with pytest.raises(ValueError):
        preset("nope")


# --- transport -------------------------------------------------------------------
def test_transport_sends_large_buffers_out_of_band():
    small = kvmerge.encode([BlockRemoved(block_hashes=[1], medium="CPU")])
    wire = enqueue(("x", small))
    assert wire.oob == [] and wire.nbytes == len(wire.main)
    big_events = [
        BlockStored(
            block_hashes=[i],
            parent_block_hash=None,
            token_ids=list(range(2048)),
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        for i in range(300)
    ]
    big = kvmerge.encode(big_events)
    assert big.nbytes >= OOB_THRESHOLD
    wire = enqueue(("x", big))
    assert [len(b) for b in wire.oob] == [big.nbytes]
    assert wire.nbytes == len(wire.main) + big.nbytes
    _, back = dequeue(wire)
    assert back.decode() == big_events


def test_child_diff_reports_missing_extra_reordered():
    d = ChildDiff()
    d.compare(0, [b"\x81\xa4type\xb0AllBlocksCleared"], [])
    assert (d.missing, d.extra, d.equal) == (1, 0, False)
    assert "step 0" in d.first
    same = ChildDiff()
    same.compare(0, [b"a", b"b"], [b"a", b"b"])
    assert same.equal


# --- end to end ------------------------------------------------------------------
def test_vllm_path_differs_on_a_skewed_workload_kvmerge_does_not():
    cfg = WorkloadConfig(world_size=2, events=24, late=0.2, duplicate=0.2, seed=3)
    res = run_case(
        Case("custom", 2, 24),
        steps=3,
        warmup=1,
        seed=3,
        check_limit=10_000,
        config=cfg,
    )
    a, b = res["check"]["A"], res["check"]["B"]
    assert all(d["equal"] for d in b)
    # LMCache's rule loses late events and events a worker repeated.
    assert not a[0]["equal"] and a[0]["missing"] > 0


def test_tiny_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "res"
    argv = [
        "--tp", "2,4", "--events", "8,16",
        "--workloads", "skewed,clears", "--workload-tp", "2", "--workload-events", "8",
        "--steps", "2", "--warmup", "1", "--profile", "clears/2x8", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "A sched ms" in text and "targets:" in text and "load average" in text
    doc = json.loads((out / "bench.json").read_text())
    # The model ships in the package: an installed wheel checks too.
    assert doc["settings"]["reference"] == "kvmerge.testing.reference"
    assert [c["case"] for c in doc["cases"]] == [
        "uniform/tp2/8",
        "uniform/tp2/16",
        "uniform/tp4/8",
        "uniform/tp4/16",
        "skewed/tp2/8",
        "clears/tp2/8",
    ]
    for case in doc["cases"]:
        assert len(case["records"]["A"]) == len(case["records"]["B"]) == 2
        for path in ("A", "B"):
            s = case["summary"][path]
            assert s["scheduler_ms"] > 0 and s["worker_ms_per_rank"] > 0
            assert s["bytes_per_rank"] > 0
        # Path B's merged output equals the reference model, child by child.
        assert [d["equal"] for d in case["check"]["B"]] == [True] * len(
            case["children"]
        )
    assert {t["target"].split(":")[0] for t in doc["targets"]}
    assert "profile" in doc and doc["profile"]["scheduler"]["B"]["total"] > 0
    assert doc["profile"]["case"] == "clears/tp2/8"
    for part in ("floor", "envelope", "fixed"):
        assert doc["profile"]["scheduler"][part]["total"] > 0
    assert "floor (vLLM alone, no KV events)" in text
    assert "envelope (the floor with one empty container per rank)" in text
    assert "fixed (B with no events" in text
    parts = doc["profile"]["scheduler"]["parts"]
    assert set(parts) == {"Raw per event", "identities", "publisher's encode"}
    assert parts["Raw per event"] > 0 and parts["publisher's encode"] > 0
    assert "the floor's parts: envelope" in text and "x the floor" in text
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_the_floor_carries_no_kv_events():
    """The floor is vLLM's scheduler side with nothing for a KV-event path
    to add: each rank's message has no ``KVConnectorOutput``, upstream
    ``MultiConnector`` hands its children an aggregated output without
    events, and nothing is published."""
    floor = Floor(2, ("lmcache", "mooncake"))
    assert type(floor.multi) is MultiConnector
    wires = floor.wires()
    assert len(wires) == 2
    assert all(dequeue(w).kv_connector_output is None for w in wires)
    seen = []
    child = floor.multi._connectors[0]
    original = child.update_connector_output
    child.update_connector_output = lambda out: (seen.append(out), original(out))
    assert floor.scheduler(wires) == []
    assert len(seen) == 1 and seen[0].kv_cache_events is None


def test_the_envelope_carries_one_empty_container_per_rank():
    """The envelope is the floor plus what any event path's container costs
    vLLM: each rank's message holds an ``EmptyEvents`` in its
    ``KVConnectorOutput``, the aggregator combines them, and the children
    get the aggregated output without it (as path B's merged children do)."""
    envelope = Floor(2, ("lmcache", "mooncake"), envelope=True)
    wires = envelope.wires()
    received = [dequeue(w).kv_connector_output for w in wires]
    assert all(type(o.kv_cache_events) is EmptyEvents for o in received)
    combined = []
    original_aggregate = envelope.aggregator.aggregate

    def aggregate(outputs, output_rank=0):
        out = original_aggregate(outputs, output_rank)
        combined.append(out.kv_connector_output.kv_cache_events)
        return out

    envelope.aggregator.aggregate = aggregate
    seen = []
    child = envelope.multi._connectors[0]
    original = child.update_connector_output
    child.update_connector_output = lambda out: (seen.append(out), original(out))
    assert envelope.scheduler(wires) == []
    assert len(combined) == 1 and type(combined[0]) is EmptyEvents
    assert len(seen) == 1 and seen[0].kv_cache_events is None


def test_the_fixed_cost_carries_containers_without_events():
    """``--profile``'s fixed cost is path B over steps whose events were taken
    away: every rank still sends its ``KVMergeKVEvents``, the connector
    merges them, and nothing is published."""
    b = PathB(2, ("lmcache", "mooncake"))
    steps = list(Workload(preset("uniform", world_size=2, events=4)).steps(2))
    for step in steps:
        b.feed([[[] for _ in ranks] for ranks in step.events])
        wires = [b.worker(rank) for rank in range(2)]
        received = [dequeue(w).kv_connector_output.kv_cache_events for w in wires]
        assert all(type(e) is KVMergeKVEvents for e in received)
        assert b.scheduler(wires) == []
    # LMCache's child returns no container without events (no merger yet);
    # Mooncake's returns an empty one, merged every step.
    lmcache, mooncake = b.connector.merge_stats()
    assert lmcache is None
    assert mooncake is not None and mooncake["steps"] == 2


def test_the_store_children_have_upstreams_removal_hooks():
    """The bench's children have a removal hook exactly where vLLM's own have
    one (none of theirs: Mooncake's scheduler has none; tests/plugin/
    test_families.py checks every family's stand-in against vLLM's). The
    connector decodes the removals it publishes for a hook: one that upstream
    lacks would charge path B for work a real deployment skips."""
    b = PathB(2, ("lmcache", "mooncake", "list"))
    assert [c.invalidate for c in b.connector._children] == [None, None, None]


def test_the_wheel_has_no_bench():
    from kvmerge.cli import SUBCOMMANDS

    assert "bench" not in SUBCOMMANDS
    assert importlib.util.find_spec("kvmerge.bench") is None


def test_runs_as_a_module_from_the_checkout():
    args = build_parser().parse_args(["--quick"])
    assert args.quick
    assert [c.key for c in grid_from_args(args)][:2] == [
        "uniform/tp2/16",
        "uniform/tp2/32",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "benches.compare", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith("usage: python -m benches.compare")


def test_run_bench_as_a_module_without_checks():
    doc = run_bench([Case("bytes", 2, 4)], steps=1, warmup=0, check=False, log=print)
    (case,) = doc["cases"]
    assert case["check"] is None and case["summary"]["B"]["events_in_per_step"] == 16
    assert doc["settings"]["reference"].startswith("disabled")


def test_bad_arguments():
    p = argparse.ArgumentParser()
    from benches.compare import add_arguments

    add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--tp", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--profile", "8by512"])
    with pytest.raises(SystemExit):
        p.parse_args(["--profile", "clears/8by32"])
    with pytest.raises(SystemExit):  # gone: the model is kvmerge.testing's
        p.parse_args(["--reference", "tests/reference.py"])


def test_the_profile_names_its_workload(capsys):
    """``--profile`` takes a workload before the size (uniform when none is
    named); an unknown one stops the run before anything is measured."""
    p = argparse.ArgumentParser()
    from benches.compare import add_arguments

    add_arguments(p)
    assert p.parse_args([]).profile == ("uniform", 8, 512)
    assert p.parse_args(["--profile", "4x16"]).profile == ("uniform", 4, 16)
    assert p.parse_args(["--profile", "clears/8x32"]).profile == ("clears", 8, 32)
    assert p.parse_args(["--profile", "none"]).profile is None
    assert main(["--tp", "2", "--events", "8", "--profile", "nope/2x8"]) == 2
    assert "unknown workload(s) nope" in capsys.readouterr().err


def test_what_a_report_costs_end_to_end(capsys, monkeypatch):
    """``benches.compare.stats``, tiny: vLLM's MultiConnector reports nothing of
    the children's, kvmerge with no request running reports every step, and
    with one running not one of 40 steps (its interval made longer than any
    run), each case timed in both processes."""
    from benches.compare.stats import CASES, main, run
    from kvmerge.vllm.stats import Interval

    monkeypatch.setattr(Interval, "interval_ns", 10**15)

    cases = run(tp=2, events=2, steps=40, warmup=3)
    assert [c.name for c in cases] == list(CASES)
    assert [c.reports for c in cases] == [0, 40, 0]
    for case in cases:
        assert len(case.engine_ns) == len(case.front_ns) == 40
        assert min(case.engine_ns) > 0 and min(case.front_ns) > 0
    main(["--steps", "5", "--warmup", "1"])
    out = capsys.readouterr().out
    assert "kvmerge, every step" in out and "over multi" in out
