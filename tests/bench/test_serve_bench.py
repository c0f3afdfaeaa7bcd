"""``benches.serve``: its options, its run order, and its report on canned
records (vllm bench serve's JSON, /metrics deltas): no server here, and no
timing checked."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benches.serve import main, order, parse
from benches.serve.report import (
    paired,
    percentile,
    ratio,
    render,
    summaries,
    t95,
    verdict,
)
from benches.serve.runner import CONFIGS, delta, scrape

ROOT = Path(__file__).resolve().parents[2]


def test_the_module_and_its_options_import_no_vllm():
    code = (
        "import sys, benches.serve as b, benches.serve.runner; b.parse([]); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_options():
    args = parse([])
    assert args.configs == ["kvmerge", "drain", "multi", "events-off"]
    assert list(CONFIGS) == [*args.configs, "spend"]
    assert (args.rounds, args.tp, args.num_prompts) == (2, 2, 960)
    assert not args.example
    assert args.spend_us == (71.0, 22.0)
    assert parse(["--spend-us", "40,0.5"]).spend_us == (40.0, 0.5)
    quick = parse(["--quick", "--configs", "multi,kvmerge"])
    assert (quick.rounds, quick.num_prompts, quick.configs) == (
        1,
        48,
        ["multi", "kvmerge"],
    )
    for bad in (
        ["--configs", "kvmerge,nope"],
        ["--configs", "multi,multi"],
        ["--rounds", "0"],
        ["--prefix-len", "500"],
        ["--spend-us", "40"],
        ["--spend-us", "40,-1"],
        ["--spend-us", "40,nan"],
    ):
        with pytest.raises(SystemExit):
            parse(bad)


def test_rounds_alternate_their_order():
    names = ["kvmerge", "multi", "events-off"]
    assert [n for _, n in order(names, 2)] == [*names, *reversed(names)]
    assert [r for r, _ in order(names, 3)] == [0] * 3 + [1] * 3 + [2] * 3


def test_configurations_differ_only_in_connector_and_events():
    k, d, m = CONFIGS["kvmerge"], CONFIGS["drain"], CONFIGS["multi"]
    off, spend = CONFIGS["events-off"], CONFIGS["spend"]
    assert (k.kvmerge, k.kv_events, k.drain, k.spend) == (True, True, False, False)
    assert (d.kvmerge, d.kv_events, d.drain, d.spend) == (False, True, True, False)
    assert (m.kvmerge, m.kv_events, m.drain, m.spend) == (False, True, False, False)
    assert (off.kvmerge, off.kv_events, off.drain) == (False, False, False)
    assert (spend.kvmerge, spend.kv_events, spend.drain) == (False, True, True)
    assert spend.spend


METRICS = """\
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 120.0
vllm:kvmerge_steps_total{engine="0",model_name="m"} 118.0
vllm:kvmerge_published_total{connector="connectors[0] (A)",engine="0"} 30.0
vllm:kvmerge_published_total{connector="connectors[1] (B)",engine="0"} 12.0
"""


def test_metrics_are_summed_over_labels_and_differenced():
    got = scrape(METRICS)
    assert got["engine_steps"] == 120 and got["kvmerge_steps"] == 118
    assert got["kvmerge_published"] == 42
    assert got["kvmerge_step_seconds"] is None
    before = dict(got, engine_steps=20.0, kvmerge_published=None)
    d = delta(before, got)
    assert d["engine_steps"] == 100 and d["kvmerge_published"] == 42
    assert d["kvmerge_step_seconds"] is None


def record(
    config, duration, completed, ttfts, itls, metrics, load=(1.0, 1.5), round_=0
):
    return {
        "config": config,
        "round": round_,
        "load": list(load),
        "result": {
            "duration": duration,
            "completed": completed,
            "failed": 0,
            "request_throughput": completed / duration,
            "ttfts": ttfts,
            "itls": itls,
        },
        "metrics": metrics,
    }


RUNS = [
    record(
        "kvmerge",
        10.0,
        40,
        [0.1, 0.2, 0.3],
        [[0.01, 0.02], [0.03]],
        {
            "engine_steps": 400.0,
            "kvmerge_steps": 400.0,
            "kvmerge_step_seconds": 0.2,
            "kvmerge_published": 800.0,
            "kvmerge_worker_outputs": 800.0,
            "kvmerge_worker_encode_seconds": 0.05,
            "kvmerge_worker_bytes": 2_400_000.0,
        },
    ),
    record(
        "drain",
        9.8,
        40,
        [0.1, 0.2, 0.4],
        [[0.01], [0.02, 0.04]],
        {"engine_steps": 392.0, "kvmerge_steps": None},
    ),
    record("drain", 10.2, 40, [0.2], [[0.02]], {"engine_steps": 408.0}, round_=1),
    record(
        "kvmerge",
        10.0,
        40,
        [0.4],
        [[0.04]],
        {
            "engine_steps": 400.0,
            "kvmerge_steps": 400.0,
            "kvmerge_step_seconds": 0.2,
            "kvmerge_published": 800.0,
            "kvmerge_worker_outputs": 800.0,
            "kvmerge_worker_encode_seconds": 0.05,
            "kvmerge_worker_bytes": 2_400_000.0,
        },
        round_=1,
    ),
]


def test_percentiles_are_numpys_linear_ones():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def test_runs_are_pooled_per_configuration():
    s = summaries(RUNS)
    assert list(s) == ["kvmerge", "drain"]
    k, m = s["kvmerge"], s["drain"]
    assert k["runs"] == 2 and k["completed"] == 80
    assert k["req_s"] == pytest.approx(80 / 20.0)
    assert m["req_s"] == pytest.approx(80 / 20.0)
    assert m["req_s_runs"] == pytest.approx([40 / 9.8, 40 / 10.2])
    assert k["ttft_ms"][50] == pytest.approx(250.0)
    assert k["itl_ms"][50] == pytest.approx(25.0)
    # 20 s over 800 steps: 25 ms a step; kvmerge's 0.4 s over its 800
    # steps: 500 us, and 2% of the 20 s.
    assert k["step_ms"] == pytest.approx(25.0)
    assert k["kvmerge_us_per_step"] == pytest.approx(500.0)
    assert k["kvmerge_share"] == pytest.approx(0.02)
    assert k["events_per_step"] == pytest.approx(2.0)
    assert math.isnan(m["kvmerge_us_per_step"]) and math.isnan(m["kvmerge_share"])
    assert ratio(s) == pytest.approx(1.0)
    assert "100.0%" in verdict(s, {"mean": 1.0, "low": 0.99, "high": 1.01})


def test_another_configuration_is_paired_with_the_baseline_too():
    """``spend`` (or any configuration but kvmerge and the baseline) gets
    its own paired line; kvmerge's verdict is unchanged by it."""
    spend = [
        dict(r, config="spend", result=dict(r["result"], duration=10.4))
        for r in RUNS
        if r["config"] == "kvmerge"
    ]
    runs = [*RUNS, *spend]
    p = paired(runs, "spend")
    assert p is not None and p["ratios"] == pytest.approx([9.8 / 10.4, 10.2 / 10.4])
    assert paired(runs) == paired(RUNS)
    text = render({"runs": runs})
    assert f"spend / drain paired by round (2 rounds): {p['mean'] * 100:.1f}%" in text
    assert text.count("paired by round") == 2


def test_a_slower_kvmerge_misses_the_target():
    slow = [dict(r, result=dict(r["result"])) for r in RUNS]
    for r in slow:
        if r["config"] == "kvmerge":
            r["result"]["duration"] = 10.5
    s = summaries(slow)
    assert ratio(s) == pytest.approx(20.0 / 21.0)
    pairs = paired(slow)
    assert pairs is not None and pairs["mean"] == pytest.approx(
        math.sqrt(10.0 / 10.5 * 9.8 / 10.0 * 10.0 / 10.5 * 10.2 / 10.0)
    )
    # Two rounds 4% apart: an interval from 72% to 127%, which shows nothing.
    assert "95.2%" in verdict(s, pairs) and "not shown" in verdict(s, pairs)
    assert "NOT met" in verdict(s, {**pairs, "low": 0.93, "high": 0.97})
    assert ratio(summaries(RUNS[1:3])) is None


def test_only_an_interval_on_one_side_of_the_target_says_whether_it_is_met():
    s = summaries(RUNS)
    met = {"mean": 0.99, "low": 0.98, "high": 1.0}
    assert verdict(s, met).endswith("98%: met)")
    low = {"mean": 0.9, "low": 0.85, "high": 0.9799}
    assert verdict(s, low).endswith("98%: NOT met)")
    holds = verdict(s, {"mean": 1.10, "low": 0.979, "high": 1.2})
    assert "met" not in holds.replace("not shown", "")
    assert "not shown: the paired interval, 97.9% to 120.0%, holds it" in holds
    assert "not shown: needs two rounds of both" in verdict(s, None)


def test_the_table_as_text_and_markdown(tmp_path, capsys):
    doc = {"runs": RUNS}
    text = render(doc)
    head, kvmerge_row, drain_row = text.splitlines()[:3]
    assert head.split()[:3] == ["config", "runs", "req/s"]
    assert kvmerge_row.split()[:3] == ["kvmerge", "2", "4.00"]
    # step ms, kvmerge us/step, its share of the step, events per step, the
    # workers' time and bytes per output
    assert kvmerge_row.split()[-6:] == ["25.0", "500", "2.00%", "2.0", "62.5", "3000"]
    assert drain_row.split()[0] == "drain" and drain_row.rstrip().endswith("-")
    assert "order: kvmerge drain drain kvmerge" in text
    md = render(doc, markdown=True).splitlines()
    assert md[0].startswith("| config | runs | req/s |")
    assert md[1].startswith("| --- | ---: | ---: |")
    assert md[2].startswith("| kvmerge | 2 | 4.00 | 4.00 4.00 | 250 |")
    saved = tmp_path / "serve.json"
    saved.write_text(json.dumps(doc))
    assert main(["--render", str(saved), "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == "\n".join(md)


def test_the_ratio_is_paired_by_round_with_its_interval():
    # Rounds 0 and 1: 40/10.0 over 40/9.8, then 40/10.0 over 40/10.2.
    p = paired(RUNS)
    assert p is not None and p["rounds"] == 2
    assert p["ratios"] == pytest.approx([0.98, 1.02])
    # On the logarithms: their mean, and t(1) 12.706 times their sd over
    # sqrt(2) either side of it.
    logs = [math.log(0.98), math.log(1.02)]
    mean, sd = sum(logs) / 2, abs(logs[1] - logs[0]) / math.sqrt(2)
    assert p["mean"] == pytest.approx(math.sqrt(0.98 * 1.02))
    half = 12.706 * sd / math.sqrt(2)
    assert p["low"] == pytest.approx(math.exp(mean - half))
    assert p["high"] == pytest.approx(math.exp(mean + half))
    text = render({"runs": RUNS})
    assert (
        "kvmerge / drain paired by round (2 rounds): 100.0% (95% t interval "
        "77.5% to 128.9%"
    ) in text
    # Only kvmerge and the baseline ran: no other pairing is printed.
    assert text.count("paired by round") == 1
    # A stalled baseline run (4x slower) moves the geometric mean by what a
    # 4x faster one would take away.
    stalled = [dict(r, result=dict(r["result"])) for r in RUNS]
    stalled[1]["result"]["duration"] *= 4
    fast = [dict(r, result=dict(r["result"])) for r in RUNS]
    fast[1]["result"]["duration"] /= 4
    up, down = paired(stalled), paired(fast)
    assert up is not None and down is not None
    assert up["mean"] * down["mean"] == pytest.approx(p["mean"] ** 2)
    assert paired(RUNS[:2]) is None
    assert t95(1) == 12.706 and t95(11) == t95(10) and t95(100) == 1.96


def test_a_failed_request_is_reported():
    bad = [dict(RUNS[0], result=dict(RUNS[0]["result"], failed=3))]
    assert "FAILED: kvmerge: 3 failed, 40 completed" in render({"runs": bad})


@pytest.mark.vllm
def test_no_child_records_its_reports(tmp_path):
    """Recording writes every rank's reports to disk each step, and only
    under kvmerge (vLLM's MultiConnector never asks for them): the benchmark
    turns it off in every configuration."""
    from benches.serve.runner import transfer_config
    from kvmerge.sim.children import EXTRA_KEY, ChildSettings

    for config in CONFIGS.values():
        cfg = transfer_config(config, parse([]), tmp_path)
        children = [
            c["kv_connector_extra_config"]
            for c in cfg["kv_connector_extra_config"]["connectors"]
        ]
        simulated = [c for c in children if EXTRA_KEY in c]
        assert len(simulated) == 2, children
        assert [ChildSettings.from_extra(c).record for c in simulated] == [None] * 2
        assert cfg["kv_connector"] == (
            "KVMergeMultiConnector" if config.kvmerge else "MultiConnector"
        )
        assert cfg.get("kv_connector_module_path") == (
            "kvmerge.sim.baseline" if config.drain else None
        )


@pytest.mark.vllm
def test_agreeing_children_script_no_fault(tmp_path):
    """``--agree``: every fault off in every configuration; by default the
    serve tests' (one child's ranks late, lost, repeated, one damaging)."""
    from benches.serve.runner import transfer_config
    from kvmerge.sim.baseline import SPEND_KEY
    from kvmerge.sim.children import EXTRA_KEY, ChildSettings

    def faults(argv: list[str]) -> list[tuple[bool, bool, bool, int]]:
        cfg = transfer_config(CONFIGS["kvmerge"], parse(argv), tmp_path)
        out = []
        for c in cfg["kv_connector_extra_config"]["connectors"]:
            extra = c["kv_connector_extra_config"]
            if EXTRA_KEY in extra:
                f = ChildSettings.from_extra(extra).faults
                out.append((f.late, f.lost, f.repeat, f.damage))
        return out

    assert faults(["--agree"]) == [(False, False, False, 0)] * 2
    spend = transfer_config(CONFIGS["spend"], parse(["--spend-us", "5,2"]), tmp_path)
    assert spend["kv_connector_extra_config"][SPEND_KEY] == {
        "scheduler": 5.0,
        "worker": 2.0,
    }
    for name in ("kvmerge", "drain"):
        cfg = transfer_config(CONFIGS[name], parse([]), tmp_path)
        assert SPEND_KEY not in cfg["kv_connector_extra_config"]
    scripted = faults([])
    assert len(scripted) == 2 and any(any(f) for f in scripted)
    assert any(f[3] > 0 for f in scripted)


@pytest.mark.vllm
@pytest.mark.parametrize("drain", [True, False])
def test_the_drain_baseline_has_its_children_build_their_events(drain):
    """``drain``'s workers ask every child for its events each step, as
    kvmerge's do, and send none; plain MultiConnector never asks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmerge.sim.baseline import DRAIN_CONNECTOR, DRAIN_MODULE_PATH
    from kvmerge.sim.children import entry
    from kvmerge.sim.model import connector_config, create_connector, worker_config

    cfg = connector_config(
        [entry("lmcache", 0), entry("mooncake", 1)],
        tp=2,
        connector=DRAIN_CONNECTOR if drain else "MultiConnector",
        module_path=DRAIN_MODULE_PATH if drain else None,
    )
    worker = create_connector(worker_config(cfg, 1), KVConnectorRole.WORKER)
    assert type(worker).__name__ == (
        "DrainingMultiConnector" if drain else "MultiConnector"
    )
    for _ in range(3):
        assert worker.get_kv_connector_kv_cache_events() is None
    assert [child.step for child in worker._connectors] == [3 if drain else 0] * 2


@pytest.mark.vllm
def test_spend_spends_its_time_on_each_side():
    """``spend``'s connector is ``drain``'s, spending its microseconds in each
    worker's output and in the scheduler's ``update_connector_output``; with
    none configured, ``drain``'s spends nothing (its calls return far
    sooner than the time asked of ``spend``)."""
    from time import perf_counter_ns

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput

    from kvmerge.sim.baseline import DRAIN_CONNECTOR, DRAIN_MODULE_PATH, SPEND_KEY
    from kvmerge.sim.children import entry
    from kvmerge.sim.model import connector_config, create_connector, worker_config

    def fastest(call, n: int = 20) -> float:
        best = math.inf
        for _ in range(n):
            started = perf_counter_ns()
            call()
            best = min(best, (perf_counter_ns() - started) / 1e3)
        return best

    def sides(spend: dict[str, float] | None) -> tuple[float, float]:
        cfg = connector_config(
            [entry("lmcache", 0), entry("mooncake", 1)],
            tp=2,
            connector=DRAIN_CONNECTOR,
            module_path=DRAIN_MODULE_PATH,
            **({} if spend is None else {SPEND_KEY: spend}),
        )
        worker = create_connector(worker_config(cfg, 1), KVConnectorRole.WORKER)
        scheduler = create_connector(cfg, KVConnectorRole.SCHEDULER)
        return (
            fastest(lambda: scheduler.update_connector_output(KVConnectorOutput())),
            fastest(worker.get_kv_connector_kv_cache_events),
        )

    scheduler_us, worker_us = sides({"scheduler": 3000, "worker": 2000})
    assert scheduler_us >= 3000 and worker_us >= 2000
    scheduler_us, worker_us = sides(None)
    assert scheduler_us < 2000 and worker_us < 2000


def test_bursts_send_the_same_prefix_repetition_prompts_every_time():
    from benches.serve.bursts import prompts

    args = parse(["--num-prompts", "10", "--num-prefixes", "3"])
    got = prompts(args)
    assert got == prompts(args) and len(got) == 10
    lens = {len(p.split()) for p in got}
    assert lens == {args.prefix_len + args.suffix_len}
    heads = [" ".join(p.split()[: args.prefix_len]) for p in got]
    assert len(set(heads)) == 3 and heads[0] == heads[3] != heads[1]
    tails = [" ".join(p.split()[args.prefix_len :]) for p in got]
    assert len(set(tails)) == 10
    assert prompts(parse(["--num-prompts", "10", "--seed", "1"])) != got


class _Served:
    """A stand-in for ``kvmerge.sim.server.Server``'s HTTP calls (the burst's
    bookkeeping is under test here, not vLLM): what was asked, in order."""

    def __init__(self, fail_every: int = 0) -> None:
        self.calls: list[str] = []
        self.steps = 0.0
        self.dir = Path("served")
        self.fail_every = fail_every

    def pids(self) -> list[int]:
        return [os.getpid()]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return True

    def metrics(self) -> str:
        self.calls.append("metrics")
        return f'vllm:iteration_tokens_total_count{{engine="0"}} {self.steps}\n'

    def complete(self, prompt: str, max_tokens: int) -> int:
        self.calls.append("complete")
        self.steps += 4
        n = self.calls.count("complete")
        return 500 if self.fail_every and n % self.fail_every == 0 else 200


def test_a_burst_resets_the_caches_then_times_its_requests_only(monkeypatch):
    from benches.serve import bursts

    monkeypatch.setattr(bursts, "SETTLE_S", 0.0)
    args = parse(["--num-prompts", "6", "--concurrency", "2"])
    served = _Served(fail_every=3)
    rec = bursts.burst(served, "kvmerge", 4, bursts.prompts(args), args)
    assert served.calls[:2] == ["reset", "metrics"]
    assert served.calls[2:-1] == ["complete"] * 6 and served.calls[-1] == "metrics"
    assert (rec["config"], rec["round"]) == ("kvmerge", 4)
    res = rec["result"]
    assert (res["completed"], res["failed"]) == (4, 2)
    assert res["duration"] > 0
    assert res["request_throughput"] == pytest.approx(4 / res["duration"])
    assert rec["metrics"]["engine_steps"] == 24
    # This process's CPU over the burst, by its name.
    comm = Path("/proc/self/comm").read_text().strip()
    assert list(rec["cpu_s"]) == [comm] and rec["cpu_s"][comm] >= 0
    # The record pairs and summarises as a run's does.
    other = dict(rec, config="drain")
    assert paired([rec, other, dict(rec, round=5), dict(other, round=5)]) is not None
    assert summaries([rec])["kvmerge"]["completed"] == 4


def test_many_runs_are_summarised_not_listed():
    """``--interleave`` makes hundreds of bursts: the table gives each
    configuration's range and median, the order its first round."""
    from benches.serve.report import LISTED_RUNS

    rounds = LISTED_RUNS + 1
    runs = []
    for round_, name in order(["kvmerge", "drain"], rounds):
        seconds = 10.0 + round_ * (1 if name == "drain" else 2) / 10
        runs.append(record(name, seconds, 40, [], [], {}, (1.0 + round_, 2.0), round_))
    text = render({"runs": runs})
    k_row = text.splitlines()[1]
    # 40 requests in 10.0 .. 10.0 + (rounds - 1) * 0.2 s
    slowest = 40 / (10.0 + (rounds - 1) * 0.2)
    assert f"{slowest:.2f}..4.00 (median " in k_row
    assert (
        "order: kvmerge drain, then each round the reverse of the one before "
        f"({2 * rounds} runs)" in text
    )
    assert f"load average (1 min) from 1.00 to {rounds:.2f} over the runs" in text
    assert "  4.00 3.92" not in text
    few = render({"runs": runs[:LISTED_RUNS]})
    assert "order: kvmerge drain drain kvmerge" in few and "(median" not in few


@pytest.mark.vllm
def test_the_loop_times_each_side_of_every_step():
    """``benches.serve.loop``: the same requests through each configuration's
    engine; ``spend``'s time shows on the side it is spent on (at least half
    of it over ``drain``'s median: the rest of the step is the same work)."""
    from benches.serve.loop import measure, render

    args = parse(
        [
            "--configs",
            "kvmerge,drain,spend",
            "--rounds",
            "1",
            "--num-prompts",
            "8",
            "--spend-us",
            "2000,1000",
        ]
    )
    timings = measure(args)
    steps = {name: len(t.scheduler) for name, t in timings.items()}
    assert min(steps.values()) > 8, steps
    for t in timings.values():
        assert len(t.worker) == args.tp * len(t.scheduler)

    def over_drain(side: str) -> float:
        def median(name: str) -> float:
            return sorted(getattr(timings[name], side))[
                len(getattr(timings[name], side)) // 2
            ]

        return (median("spend") - median("drain")) / 1e3

    assert over_drain("scheduler") >= 1000
    assert over_drain("worker") >= 500
    text = render(timings)
    assert "(in brackets: the difference from drain's)" in text
    assert [line.split()[0] for line in text.splitlines()[1:4]] == list(timings)
