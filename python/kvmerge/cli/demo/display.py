"""What ``kvmerge demo`` shows: a live view on a terminal, plain lines elsewhere.

On a terminal (and with rich installed): a progress bar and a live table of
the children's merge counters, the merge time and the subscriber's counts.
Otherwise (a pipe, a file, CI, ``--plain``): a line every tenth of the run.
Summary tables are printed the same way in both modes (plain text columns off a
terminal).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChildRow:
    name: str
    rule: str
    reports: int = 0
    published: int = 0
    pending: int = 0
    expired: int = 0
    cleared: int = 0
    #: Events the rule published that the connector's guard withheld (no
    #: router could apply them: docs/merge-rules.md "Guard").
    withheld: int = 0


def total(rows: Sequence[ChildRow]) -> ChildRow:
    """A "total" row: the counters of ``rows`` summed."""
    out = ChildRow("total", "")
    for row in rows:
        out.reports += row.reports
        out.published += row.published
        out.pending += row.pending
        out.expired += row.expired
        out.cleared += row.cleared
        out.withheld += row.withheld
    return out


@dataclass
class Snapshot:
    step: int
    total: int
    elapsed: float
    children: list[ChildRow] = field(default_factory=list)
    p50_ms: float | None = None
    p99_ms: float | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    missing: int = 0
    resets: int = 0


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def plain_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()
) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


CHILD_HEADERS = (
    "connector",
    "rule",
    "events in",
    "out",
    "pending",
    "expired",
    "cleared",
    "withheld",
)


def child_cells(row: ChildRow) -> list[str]:
    return [
        row.name,
        row.rule,
        f"{row.reports:,}",
        f"{row.published:,}",
        f"{row.pending:,}",
        f"{row.expired:,}",
        f"{row.cleared:,}",
        f"{row.withheld:,}",
    ]


def stream_text(s: Snapshot) -> str:
    return (
        f"read back {s.batches:,} batches, {s.events:,} events; "
        f"gaps {s.gaps}, replayed {s.replayed}, missing {s.missing}"
    )


def published_text(r: Any) -> str:
    """What a run (``kvmerge.sim.run.Result``) published, by medium."""
    media = ", ".join(f"{m} {n:,}" for m, n in sorted(r.by_medium.items()))
    return (
        f"published {r.published:,} batches, {len(r.stream):,} events "
        f"(by medium: {media})"
    )


def show_checks(
    d: PlainDisplay | RichDisplay,
    checks: Sequence[Any],
    examples: Sequence[str] = (),
    final: bool = True,
) -> bool:
    """Prints each check as ok or FAIL (and, when ``final``, the result);
    whether every one passed."""
    d.print("checks:")
    for c in checks:
        d.print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.text}")
    for example in examples:
        d.print(f"       e.g. {example}")
    ok = all(c.ok for c in checks)
    if final:
        d.print("result: every check passed" if ok else "result: FAILED (see above)")
    return ok


class PlainDisplay:
    """Lines on stdout; a progress line every tenth of the steps."""

    live = False

    def __init__(self) -> None:
        self._next = 0
        self._total = 0
        self._shown: tuple[int, str] | None = None

    def print(self, text: str = "") -> None:
        print(text, flush=True)

    def status(self, text: str) -> None:
        self.print(text)

    def start_steps(self, total: int) -> None:
        self._total = total
        self._next = max(1, total // 10)

    def due(self, step: int) -> bool:
        """Whether ``update`` would show this step (snapshots cost something)."""
        return step >= self._next

    def update(self, s: Snapshot, force: bool = False) -> None:
        if s.step < self._next and not force:
            return
        while self._next <= s.step:
            self._next += max(1, self._total // 10)
        totals = total(s.children)
        body = (
            f"events in {totals.reports:,}, out {totals.published:,}, pending "
            f"{totals.pending:,}, expired {totals.expired:,}; step p50 "
            f"{fmt_ms(s.p50_ms)}, p99 {fmt_ms(s.p99_ms)}; subscriber "
            f"{s.batches:,} batches, {s.events:,} events"
        )
        # The last (forced) update repeats a step only if something changed.
        if (s.step, body) != self._shown:
            self._shown = (s.step, body)
            self.print(f"step {s.step}/{s.total} ({s.elapsed:.1f}s): {body}")

    def stop_steps(self) -> None:
        return None

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[Any]],
        right: Sequence[int] = (),
        title: str | None = None,
    ) -> None:
        if title:
            self.print(title)
        self.print(plain_table(headers, rows, right))


class RichDisplay:
    """A progress bar and a live table (rich)."""

    live = True

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self.progress = Progress(
            TextColumn("[bold]steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self._task: Any = None
        self._live: Any = None
        self._last = 0.0

    def print(self, text: str = "") -> None:
        self.console.print(text, highlight=False)

    def status(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]", highlight=False)

    def _render(self, s: Snapshot) -> Any:
        from rich.console import Group
        from rich.table import Table

        table = Table(title=None, expand=False)
        for i, h in enumerate(CHILD_HEADERS):
            table.add_column(h, justify="right" if i >= 2 else "left")
        for row in s.children:
            table.add_row(*child_cells(row))
        footer = (
            f"engine step: p50 {fmt_ms(s.p50_ms)}, p99 {fmt_ms(s.p99_ms)}"
            f"   prefix-cache resets: {s.resets}\n"
            f"subscriber: {stream_text(s)}"
        )
        return Group(self.progress, table, footer)

    def start_steps(self, total: int) -> None:
        from rich.live import Live

        self._task = self.progress.add_task("steps", total=total)
        self._live = Live(
            self._render(Snapshot(0, total, 0.0)),
            console=self.console,
            refresh_per_second=8,
            transient=False,
        )
        self._live.start()

    def due(self, step: int) -> bool:
        return time.monotonic() - self._last >= 0.1

    def update(self, s: Snapshot, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        self.progress.update(self._task, completed=s.step)
        if self._live is not None:
            self._live.update(self._render(s), refresh=force)

    def stop_steps(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[Any]],
        right: Sequence[int] = (),
        title: str | None = None,
    ) -> None:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="right" if i in right else "left")
        for row in rows:
            table.add_row(*[str(c) for c in row])
        self.console.print(table)


def make_display(plain: bool) -> PlainDisplay | RichDisplay:
    if not plain and sys.stdout.isatty():
        try:
            from rich.console import Console
        except ImportError:
            return PlainDisplay()
        console = Console()
        if console.is_terminal:
            return RichDisplay(console)
    return PlainDisplay()
