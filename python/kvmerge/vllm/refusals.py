"""Batches dropped on the step path: counted per child, logged per incident.

On vLLM's step path an exception is fatal to the engine, so a batch that
cannot be merged (a damaged batch, a misrouted or repeated rank, a group
without a factor, another kvmerge's output) costs only itself: that rank's
batch for that child and step is dropped and the child's ``refused`` counter
(``vllm:kvmerge_refused_total``) counts it. One warning names the rank, the
child and the reason when a (child, rank) pair starts being refused, and one
line says how many were refused when that rank's batches of the child are
accepted again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .log import get_logger

logger = get_logger(__name__)


class Child(Protocol):
    """What a refusal needs of a child (``connector._Child``)."""

    refused: int

    @property
    def label(self) -> str: ...


class Refusals:
    def __init__(self) -> None:
        #: (child label, rank or None: unknown) -> [first step, count] of an
        #: open incident.
        self._open: dict[tuple[str, int | None], list[int]] = {}
        self._this_step: set[tuple[str, int | None]] = set()
        #: The step its lines name: the OutputMerger's (``StepResult.step``).
        self.step = 0

    def refuse(self, child: Child, rank: int | None, why: str) -> None:
        """One batch of ``child`` from ``rank`` (None: an output whose rank
        is unknown) refused."""
        child.refused += 1
        key = (child.label, rank)
        self._this_step.add(key)
        incident = self._open.get(key)
        if incident is not None:
            incident[1] += 1
            return
        self._open[key] = [self.step, 1]
        logger.warning(
            "%s: step %d: dropped rank %s's batch: %s (counted in "
            "vllm:kvmerge_refused_total; the other ranks' batches merge without "
            "it; one more line when this rank's batches are accepted again)",
            child.label,
            self.step,
            "?" if rank is None else rank,
            why,
        )

    def refuse_output(
        self, children: Iterable[Child], rank: int | None, why: str
    ) -> None:
        """A worker output none of whose batches can be used."""
        for child in children:
            self.refuse(child, rank, why)

    def lost(self, child: Child, why: str) -> None:
        """A step whose merged events could not be produced."""
        child.refused += 1
        logger.error(
            "%s: step %d: the merged events of this step are lost: %s",
            child.label,
            self.step,
            why,
        )

    def end_step(self) -> None:
        """Closes the incidents of pairs not refused in the step just merged."""
        if not self._open:  # the common case: nothing refused, nothing open
            self._this_step.clear()
            return
        for key in [k for k in self._open if k not in self._this_step]:
            start, count = self._open.pop(key)
            logger.warning(
                "%s: rank %s's batches are accepted again at step %d: %d refused "
                "since step %d",
                key[0],
                "?" if key[1] is None else key[1],
                self.step,
                count,
                start,
            )
        self._this_step.clear()
