"""``benches.serve``: its options, its run order, and its report on canned
records (vllm bench serve's JSON, /metrics deltas): no server here, and no
timing checked."""

from __future__ import annotations

import json
import math
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
    assert args.configs == ["kvmerge", "drain", "multi", "events-off"] == list(CONFIGS)
    assert (args.rounds, args.tp, args.num_prompts) == (2, 2, 960)
    assert not args.example
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
    ):
        with pytest.raises(SystemExit):
            parse(bad)


def test_rounds_alternate_their_order():
    names = ["kvmerge", "multi", "events-off"]
    assert [n for _, n in order(names, 2)] == [*names, *reversed(names)]
    assert [r for r, _ in order(names, 3)] == [0] * 3 + [1] * 3 + [2] * 3


def test_configurations_differ_only_in_connector_and_events():
    k, d, m = CONFIGS["kvmerge"], CONFIGS["drain"], CONFIGS["multi"]
    off = CONFIGS["events-off"]
    assert (k.kvmerge, k.kv_events, k.drain) == (True, True, False)
    assert (d.kvmerge, d.kv_events, d.drain) == (False, True, True)
    assert (m.kvmerge, m.kv_events, m.drain) == (False, True, False)
    assert (off.kvmerge, off.kv_events, off.drain) == (False, False, False)


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
    assert "100.0%" in verdict(s, {"mean": 1.0, "half": 0.01})


def test_a_slower_kvmerge_misses_the_target():
    slow = [dict(r, result=dict(r["result"])) for r in RUNS]
    for r in slow:
        if r["config"] == "kvmerge":
            r["result"]["duration"] = 10.5
    s = summaries(slow)
    assert ratio(s) == pytest.approx(20.0 / 21.0)
    pairs = paired(slow)
    assert pairs is not None and pairs["mean"] == pytest.approx(
        (10.0 / 10.5 * 9.8 + 10.0 / 10.5 * 10.2) / 2 / 10.0
    )
    # Two rounds 4% apart: an interval of +/- 24%, which shows nothing.
    assert "95.2%" in verdict(s, pairs) and "not shown" in verdict(s, pairs)
    assert "NOT met" in verdict(s, {**pairs, "half": 0.01})
    assert ratio(summaries(RUNS[1:3])) is None


def test_only_a_narrow_paired_interval_says_whether_the_target_is_met():
    s = summaries(RUNS)
    assert verdict(s, {"mean": 0.99, "half": 0.02}).endswith("98%: met)")
    assert verdict(s, {"mean": 0.97, "half": 0.005}).endswith("98%: NOT met)")
    wide = verdict(s, {"mean": 1.10, "half": 0.021})
    assert "met" not in wide.replace("not shown", "")
    assert "not shown: the paired interval, +/- 2.1%, is wider than +/- 2%" in wide
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
    assert p["mean"] == pytest.approx(1.0)
    # sd 0.02*sqrt(2), n 2, t(1) 12.706: the half-width.
    assert p["half"] == pytest.approx(12.706 * 0.02 * math.sqrt(2) / math.sqrt(2))
    assert "paired by round (2 rounds): 100.0% +/- 25.4%" in render({"runs": RUNS})
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
