"""The results: a table for the terminal, a JSON file, a PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("case", "<"),
    ("events/step", ">"),
    ("A sched ms", ">"),
    ("B sched ms", ">"),
    ("sched A/B", ">"),
    ("(cpu)", ">"),
    ("A worker ms", ">"),
    ("B worker ms", ">"),
    ("worker A/B", ">"),
    ("A KB/rank", ">"),
    ("B KB/rank", ">"),
    ("bytes B/A", ">"),
    ("A vs ref", "<"),
    ("B vs ref", "<"),
)


def _num(x: float, digits: int = 3) -> str:
    if x != x:  # NaN
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}" if x < 1 else f"{x:.2f}"


def _check(case: dict[str, Any], path: str) -> str:
    check = case.get("check")
    if not check:
        return "skipped" if "check_skipped" in case else "-"
    return ", ".join(
        f"{family}:{_diff_summary(d)}"
        for family, d in zip(case["children"], check.get(path, []), strict=False)
    )


def _diff_summary(d: dict[str, Any]) -> str:
    if d["equal"]:
        return "="
    parts = []
    if d["missing"]:
        parts.append(f"-{d['missing']}")
    if d["extra"]:
        parts.append(f"+{d['extra']}")
    if d["reordered"]:
        parts.append(f"~{d['reordered']}")
    return "".join(parts) or "≠"


def rows(cases: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for c in cases:
        a, b, r = c["summary"]["A"], c["summary"]["B"], c["ratio"]
        out.append(
            [
                f"{c['workload']} tp{c['world_size']} {c['events']}",
                f"{b['events_in_per_step']:.0f}",
                _num(a["scheduler_ms"]),
                _num(b["scheduler_ms"]),
                f"{r['scheduler_a_over_b']:.0f}x"
                if r["scheduler_a_over_b"] >= 10
                else f"{r['scheduler_a_over_b']:.1f}x",
                f"{r['scheduler_cpu_a_over_b']:.0f}x"
                if r["scheduler_cpu_a_over_b"] >= 10
                else f"{r['scheduler_cpu_a_over_b']:.1f}x",
                _num(a["worker_ms_per_rank"]),
                _num(b["worker_ms_per_rank"]),
                f"{r['worker_a_over_b']:.2f}",
                f"{a['bytes_per_rank'] / 1024:.1f}",
                f"{b['bytes_per_rank'] / 1024:.1f}",
                f"{r['bytes_b_over_a']:.3f}",
                _check(c, "A"),
                _check(c, "B"),
            ]
        )
    return out


def table(cases: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    body = rows(cases)
    heads = [h.strip() for h, _ in COLUMNS]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |"]
        lines.append(
            "| " + " | ".join("---:" if a == ">" else "---" for _, a in COLUMNS) + " |"
        )
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(heads)]
    fmt = "  ".join(f"{{:{a}{w}}}" for (_, a), w in zip(COLUMNS, widths, strict=True))
    lines = [fmt.format(*heads), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in body]
    return "\n".join(lines)


LEGEND = (
    "events/step: events all ranks report in one step (all children). sched: "
    "scheduler-side ms per step (median); worker: worker-side ms per rank per "
    "step (median of the ranks' mean); (cpu): the scheduler-side ratio in "
    "thread CPU time (robust to a loaded machine); KB/rank: pickled bytes per "
    "rank per step (stream + out-of-band). A = vLLM 0.33.0's path, B = "
    "kvmerge. vs ref, per child: '=' identical to the reference model; -N "
    "events it lacks, +N extra events, ~N steps reordered."
)


def differences(cases: Sequence[dict[str, Any]]) -> list[str]:
    """Where each path's output differs from the model, one line each."""
    lines = []
    for c in cases:
        for path in ("A", "B"):
            for family, d in zip(
                c["children"], (c.get("check") or {}).get(path, []), strict=False
            ):
                if not d["equal"]:
                    lines.append(
                        f"{c['case']} path {path} {family}: "
                        f"{d['steps'] - d['steps_equal']}/{d['steps']} steps differ; "
                        f"{d['first_difference']}"
                    )
    return lines


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n")


#: The workloads the plot draws, each at every TP it was run at: name, the
#: line formats of paths A and B, and what the legend says of its events.
PLOTTED = (
    ("uniform", "--o", "-s", ""),
    ("one-block", ":o", ":^", ", one block per event"),
)


def plot(
    path: Path, cases: Sequence[dict[str, Any]], tps: Sequence[int] = (2, 4, 8)
) -> bool:
    """Scheduler-side time per step against events per child per rank, for
    the ``PLOTTED`` workloads at each TP in ``tps``; both paths, log-log.
    Returns False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for workload, a_fmt, b_fmt, shape in PLOTTED:
        for tp in tps:
            pts = sorted(
                (
                    c["events"],
                    c["summary"]["A"]["scheduler_ms"],
                    c["summary"]["B"]["scheduler_ms"],
                )
                for c in cases
                if c["workload"] == workload and c["world_size"] == tp
            )
            if pts:
                series.append((tp, a_fmt, b_fmt, shape, pts))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {tp: colors[i % len(colors)] for i, tp in enumerate(tps)}
    for tp, a_fmt, b_fmt, shape, pts in series:
        xs = [p[0] for p in pts]
        color = color_of[tp]
        ax.plot(
            xs,
            [p[1] for p in pts],
            a_fmt,
            color=color,
            label=f"A vLLM 0.33.0, TP={tp}{shape}",
        )
        ax.plot(
            xs,
            [p[2] for p in pts],
            b_fmt,
            color=color,
            label=f"B kvmerge, TP={tp}{shape}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("events per child connector per rank per step")
    ax.set_ylabel("scheduler-side time per step (ms, median)")
    ax.set_title("KV events, scheduler side: vLLM 0.33.0 (A) vs kvmerge (B)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
