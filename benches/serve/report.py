"""The serve benchmark's results: each configuration's summary over its
runs, the table (text or Markdown), and the ratio to vLLM's MultiConnector.

Pure functions of the run records ``benches.serve.runner`` makes (no vLLM,
no kvmerge): ``tests/bench`` checks them on canned records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: The configuration the ratio is taken against (MultiConnector, the
#: children doing their own work as under kvmerge), and the one it is taken of.
BASELINE = "drain"
OURS = "kvmerge"
#: kvmerge's request throughput over the baseline's: the target.
TARGET = 0.98

COLUMNS = (
    ("config", "<"),
    ("runs", ">"),
    ("req/s", ">"),
    ("(per run)", "<"),
    ("TTFT p50 ms", ">"),
    ("TTFT p99 ms", ">"),
    ("ITL p50 ms", ">"),
    ("ITL p99 ms", ">"),
    ("step ms", ">"),
    ("kvmerge us/step", ">"),
    ("kvmerge share", ">"),
    ("events/step", ">"),
    ("worker us/output", ">"),
    ("bytes/output", ">"),
)

#: Two-sided 95% quantiles of Student's t, by degrees of freedom (beyond the
#: table: the normal's).
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
    8: 2.306, 9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042,
}  # fmt: skip


def t95(df: int) -> float:
    """The table's quantile for ``df``, or the next smaller df's (wider)."""
    if df < 1:
        return math.nan
    return _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96


def percentile(values: Sequence[float], p: float) -> float:
    """``p``-th percentile, linear between the closest ranks (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _flat(values: Iterable[Any]) -> list[float]:
    out: list[float] = []
    for v in values:
        if isinstance(v, list):
            out.extend(float(x) for x in v)
        elif v is not None:
            out.append(float(v))
    return out


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One configuration's runs pooled: requests over the benchmark's
    durations, latency percentiles over every request (TTFT) and every token
    gap (ITL); the engine's mean step period (the benchmark's seconds over
    vLLM's count of engine steps with output, ``iteration_tokens``), kvmerge's
    time per step (its seconds over its own count of steps) and its share of
    the benchmark's seconds."""
    results = [r["result"] for r in runs]
    duration = sum(float(x["duration"]) for x in results)
    completed = sum(int(x["completed"]) for x in results)
    ttfts = _flat(t for x in results for t in x.get("ttfts", []))
    itls = _flat(i for x in results for i in x.get("itls", []))
    metrics = [r["metrics"] for r in runs]
    steps = sum(m.get("engine_steps", 0.0) for m in metrics)
    ours_steps = sum(m.get("kvmerge_steps") or 0.0 for m in metrics)
    ours_s = sum(m.get("kvmerge_step_seconds") or 0.0 for m in metrics)
    published = sum(m.get("kvmerge_published") or 0.0 for m in metrics)
    outputs = sum(m.get("kvmerge_worker_outputs") or 0.0 for m in metrics)
    encode_s = sum(m.get("kvmerge_worker_encode_seconds") or 0.0 for m in metrics)
    sent = sum(m.get("kvmerge_worker_bytes") or 0.0 for m in metrics)
    step_s = duration / steps if steps else math.nan
    ours_step_s = ours_s / ours_steps if ours_steps else math.nan
    return {
        "runs": len(runs),
        "completed": completed,
        "failed": sum(int(x.get("failed", 0)) for x in results),
        "duration_s": duration,
        "req_s": completed / duration if duration else math.nan,
        "req_s_runs": [float(x["request_throughput"]) for x in results],
        "ttft_ms": {p: percentile(ttfts, p) * 1e3 for p in (50, 99)},
        "itl_ms": {p: percentile(itls, p) * 1e3 for p in (50, 99)},
        "engine_steps": steps,
        "step_ms": step_s * 1e3,
        "kvmerge_steps": ours_steps,
        "kvmerge_us_per_step": ours_step_s * 1e6,
        # Its seconds over the benchmark's: the engine core's time in it.
        "kvmerge_share": ours_s / duration if ours_steps and duration else math.nan,
        "events_per_step": published / ours_steps if ours_steps else math.nan,
        # Every worker's: kvmerge's time making an output, and its bytes.
        "worker_us_per_output": encode_s / outputs * 1e6 if outputs else math.nan,
        "bytes_per_output": sent / outputs if outputs else math.nan,
    }


def summaries(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration, in the order the configurations first ran."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r)
    return {name: summarise(rs) for name, rs in by.items()}


def ratio(summary: Mapping[str, Mapping[str, Any]]) -> float | None:
    """kvmerge's request throughput over the baseline's (None without both)."""
    if OURS not in summary or BASELINE not in summary:
        return None
    return float(summary[OURS]["req_s"]) / float(summary[BASELINE]["req_s"])


def _num(x: float, digits: int = 2) -> str:
    if x != x:  # NaN
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


#: Beyond this many runs of a configuration (``--interleave``'s bursts), its
#: runs are summarised, not listed.
LISTED_RUNS = 12


def _per_run(values: Sequence[float]) -> str:
    if len(values) <= LISTED_RUNS:
        return " ".join(_num(x) for x in values)
    return (
        f"{_num(min(values))}..{_num(max(values))} "
        f"(median {_num(percentile(values, 50))})"
    )


def row(name: str, s: Mapping[str, Any]) -> list[str]:
    share = s["kvmerge_share"]
    return [
        name,
        str(s["runs"]),
        _num(s["req_s"]),
        _per_run(s["req_s_runs"]),
        _num(s["ttft_ms"][50]),
        _num(s["ttft_ms"][99]),
        _num(s["itl_ms"][50]),
        _num(s["itl_ms"][99]),
        _num(s["step_ms"]),
        _num(s["kvmerge_us_per_step"], 1),
        "-" if share != share else f"{share * 100:.2f}%",
        _num(s["events_per_step"], 1),
        _num(s["worker_us_per_output"], 1),
        _num(s["bytes_per_output"], 0),
    ]


def table(summary: Mapping[str, Mapping[str, Any]], markdown: bool = False) -> str:
    rows = [row(name, s) for name, s in summary.items()]
    heads = [c for c, _ in COLUMNS]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |"]
        lines.append(
            "|" + "|".join(" --- " if a == "<" else " ---: " for _, a in COLUMNS) + "|"
        )
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    out = []
    for cells in (heads, *rows):
        out.append(
            "  ".join(
                f"{c:{a}{w}}"
                for c, (_, a), w in zip(cells, COLUMNS, widths, strict=True)
            ).rstrip()
        )
    return "\n".join(out)


def paired(
    runs: Sequence[Mapping[str, Any]], ours: str = OURS
) -> dict[str, Any] | None:
    """``ours``' request throughput over the baseline's in each round that
    ran both (runs of one round are neighbours in time: the host's drift
    mostly cancels); their geometric mean and its 95% t interval, taken on
    the ratios' logarithms (a round twice as fast and one twice as slow
    cancel, and one stalled run does not swamp the rest); None without two
    such rounds."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        x = r["result"]
        req_s = int(x["completed"]) / float(x["duration"]) if x["duration"] else 0.0
        by_round.setdefault(int(r["round"]), {})[r["config"]] = req_s
    ratios = [
        rs[ours] / rs[BASELINE]
        for _, rs in sorted(by_round.items())
        if rs.get(ours) and rs.get(BASELINE)
    ]
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(x) for x in ratios]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t95(n - 1) * sd / math.sqrt(n)
    return {
        "rounds": n,
        "ratios": ratios,
        "mean": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
    }


def verdict(
    summary: Mapping[str, Mapping[str, Any]], pairs: Mapping[str, Any] | None
) -> str:
    """The pooled ratio, and whether the target is met: only the paired
    ratio's interval says so, when it lies wholly on one side of the
    target."""
    r = ratio(summary)
    if r is None:
        return f"ratio: needs both {OURS!r} and {BASELINE!r}"
    if pairs is None:
        met = "not shown: needs two rounds of both"
    elif pairs["low"] >= TARGET:
        met = "met"
    elif pairs["high"] < TARGET:
        met = "NOT met"
    else:
        met = (
            f"not shown: the paired interval, {pairs['low'] * 100:.1f}% to "
            f"{pairs['high'] * 100:.1f}%, holds it"
        )
    return (
        f"{OURS} / {BASELINE} request throughput: {r * 100:.1f}% "
        f"(target >= {TARGET * 100:.0f}%: {met})"
    )


def failures(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Configurations where a request failed or none completed."""
    return [
        f"{name}: {s['failed']} failed, {s['completed']} completed"
        for name, s in summary.items()
        if s["failed"] or not s["completed"]
    ]


def _order_and_load(runs: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The run order, and the host's load around the runs: each run's when
    few, else the first round and the load's range."""
    if len(runs) <= LISTED_RUNS:
        order = " ".join(r["config"] for r in runs)
        loads = ", ".join(
            f"{r['config']} {r['load'][0]:.2f}->{r['load'][1]:.2f}" for r in runs
        )
        return order, f"before -> after each run: {loads}"
    first = " ".join(r["config"] for r in runs if r["round"] == runs[0]["round"])
    every = [x for r in runs for x in r["load"]]
    return (
        f"{first}, then each round the reverse of the one before ({len(runs)} runs)",
        f"from {min(every):.2f} to {max(every):.2f} over the runs",
    )


def _interval(name: str, pairs: Mapping[str, Any] | None) -> str:
    if pairs is None:
        return f"{name} paired by round: needs two rounds of both"
    return (
        f"{name} / {BASELINE} paired by round ({pairs['rounds']} rounds): "
        f"{pairs['mean'] * 100:.1f}% (95% t interval {pairs['low'] * 100:.1f}% "
        f"to {pairs['high'] * 100:.1f}%, geometric)"
    )


def render(doc: Mapping[str, Any], markdown: bool = False) -> str:
    """The document's table, the ratio and the run order, as printed."""
    summary = summaries(doc["runs"])
    order, loads = _order_and_load(doc["runs"])
    pairs = paired(doc["runs"])
    parts = [
        table(summary, markdown),
        "",
        verdict(summary, pairs),
        _interval(OURS, pairs),
    ]
    # Any other configuration against the baseline (``spend``'s: what
    # kvmerge's measured time alone costs).
    for name in summary:
        if name not in (OURS, BASELINE) and (other := paired(doc["runs"], name)):
            parts.append(_interval(name, other))
    parts += [
        f"order: {order}",
        f"load average (1 min) {loads}",
    ]
    parts += [f"FAILED: {f}" for f in failures(summary)]
    return "\n".join(parts)
