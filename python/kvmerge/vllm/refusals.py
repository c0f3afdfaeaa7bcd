"""Reports dropped on the step path: counted per child, logged per incident.

On vLLM's step path an exception is fatal to the engine, so a report that
cannot be merged (a damaged batch, a misrouted or repeated rank, a group
without a factor, another kvmerge's report) costs only itself: that rank's
report for that child and step is dropped and the child's ``refused`` counter
(``vllm:kvmerge_refused_total``) counts it. One warning names the rank, the
child and the reason when a (child, rank) pair starts being refused, and one
line says how many were refused when that rank's reports of the child are
accepted again.
"""

from __future__ import annotations

from typing import Any, Protocol

from .log import get_logger

logger = get_logger(__name__)


class Lane(Protocol):
    refused: int

    @property
    def label(self) -> str: ...


class Refusals:
    def __init__(self) -> None:
        #: (lane label, rank) -> [first step, count] of an open incident.
        self._open: dict[tuple[str, int], list[int]] = {}
        self._this_step: set[tuple[str, int]] = set()
        self.step = 0

    def refuse(self, lane: Lane, rank: Any, why: str) -> None:
        lane.refused += 1
        if type(rank) is not int:  # what a damaged report claims: as text
            rank = repr(rank)[:50]
        key = (lane.label, rank)
        self._this_step.add(key)
        incident = self._open.get(key)
        if incident is not None:
            incident[1] += 1
            return
        self._open[key] = [self.step, 1]
        logger.warning(
            "%s: step %d: dropped rank %s's report: %s (counted in "
            "vllm:kvmerge_refused_total; the other ranks' reports merge without "
            "it; one more line when this rank's reports are accepted again)",
            lane.label,
            self.step,
            rank,
            why,
        )

    def refuse_report(self, lanes: list[Any], rank: Any, why: str) -> None:
        """A report none of whose lanes can be used."""
        for lane in lanes:
            self.refuse(lane, rank, why)

    def lost(self, lane: Lane, step: int, why: str) -> None:
        """A step whose merged events could not be produced."""
        lane.refused += 1
        logger.error(
            "%s: step %d: the merged events of this step are lost: %s",
            lane.label,
            step,
            why,
        )

    def end_step(self) -> None:
        """Closes the incidents of pairs not refused in the step just merged."""
        if not self._open:  # the common case: nothing refused, nothing open
            self._this_step.clear()
            self.step += 1
            return
        for key in [k for k in self._open if k not in self._this_step]:
            start, count = self._open.pop(key)
            logger.warning(
                "%s: rank %s's reports are accepted again at step %d: %d refused "
                "since step %d",
                key[0],
                key[1],
                self.step,
                count,
                start,
            )
        self._this_step.clear()
        self.step += 1
