"""Worker loss, logged once per incident rather than once per event.

A worker that stops reporting (it crashed, or vLLM salvages its output later)
makes the other ranks' reports wait and then expire, step after step. A
router operator needs to know that it happened, to whom and for how long, not
a line per expired event: one warning when the trouble starts, counting while
it lasts, one line when it is over.
"""

from __future__ import annotations

from collections.abc import Collection

from .log import get_logger

logger = get_logger(__name__)


class Incidents:
    """Opens an incident on the first step with a missing rank or expired
    reports; closes it after `quiet_steps` steps without either."""

    def __init__(self, world_size: int, quiet_steps: int) -> None:
        self.world_size = world_size
        self.quiet_steps = quiet_steps
        self.start: int | None = None
        self.missing: set[int] = set()
        self.expired = 0
        self.clean = 0

    def observe(self, step: int, reported: Collection[int], expired: int) -> None:
        """One step: the ranks whose outputs it merged (distinct, in the
        world), and how many pending reports expired in it."""
        if not expired and len(reported) == self.world_size and self.start is None:
            return  # every step of a healthy engine
        missing = set(range(self.world_size)).difference(reported)
        if missing or expired:
            if self.start is None:
                self.start, self.missing, self.expired = step, set(), 0
                logger.warning(
                    "KVMergeMultiConnector: step %d: %s; other ranks' reports "
                    "of their events wait up to %d steps, then expire (metrics "
                    "vllm:kvmerge_expired_total and vllm:kvmerge_pending, per "
                    "child); one more line when this is over",
                    step,
                    _what(missing, expired),
                    self.quiet_steps - 1,
                )
            self.missing |= missing
            self.expired += expired
            self.clean = 0
        elif self.start is not None:
            self.clean += 1
            if self.clean >= self.quiet_steps:
                self.close(step, "over")

    def close(self, step: int, why: str) -> None:
        if self.start is None:
            return
        logger.warning(
            "KVMergeMultiConnector: the incident from step %d is %s at step %d: "
            "%s in all",
            self.start,
            why,
            step,
            _what(self.missing, self.expired),
        )
        self.start = None


def _what(missing: set[int], expired: int) -> str:
    parts = []
    if missing:
        parts.append(f"rank(s) {sorted(missing)} sent no output")
    if expired:
        parts.append(f"{expired} pending report(s) expired")
    return " and ".join(parts)
