"""A subscriber thread that reads an engine's published stream back.

``StreamReader`` reads with ``kvmerge.subscriber.EventSubscriber`` (gaps filled
from the replay socket) from the first batch on, and hands every batch's
events, in sequence order, to ``feed``; ``finish(last_seq)`` waits until the
batch ``last_seq`` has arrived (asking the replay socket for what the live
socket did not bring).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class StreamReader(threading.Thread):
    def __init__(
        self, endpoint: str, replay: str, topic: str, feed: Callable[[list[Any]], None]
    ) -> None:
        super().__init__(name="kvmerge-stream-reader", daemon=True)
        from kvmerge.subscriber import EventSubscriber

        # Connected now, on this thread; used only by the reader thread after.
        self.sub = EventSubscriber(
            endpoint, topic=topic, replay_endpoint=replay, from_seq=0
        )
        self.sub.load_decoder()
        self.feed = feed
        #: The ``data_parallel_rank`` of every batch read (None: unset).
        self.dp_ranks: set[int | None] = set()
        self._last: int | None = None
        self._deadline = 0.0
        self._quit = threading.Event()
        self.error: BaseException | None = None

    @property
    def stats(self) -> Any:
        return self.sub.stats

    def run(self) -> None:
        sub = self.sub
        try:
            while not self._quit.is_set():
                for received in sub.receive(50):
                    self._take(received.batch)
                last = self._last
                if last is not None:
                    if sub.expected is not None and sub.expected > last:
                        break
                    if last < 0 or time.monotonic() > self._deadline:
                        # Not all of it came on the live socket: ask the replay.
                        for received in sub.catch_up(last):
                            self._take(received.batch)
                        break
        except BaseException as e:  # reported by the caller
            self.error = e
        finally:
            sub.close()

    def _take(self, batch: Any) -> None:
        self.dp_ranks.add(batch.data_parallel_rank)
        self.feed(batch.events)

    def finish(self, last_seq: int, timeout: float = 5.0) -> None:
        self._deadline = time.monotonic() + timeout
        self._last = last_seq
        self.join(timeout + self.sub.replay_timeout + 5)
        if self.is_alive():
            self._quit.set()
            self.join(5)
