"""Reading a vLLM KV-event stream: ``EventSubscriber``.

A ZMQ SUB socket on a publisher (vLLM's ``ZmqEventPublisher``), decoding every
``(topic, seq, payload)`` message as a ``KVEventBatch``, with sequence numbers
checked: on a gap it asks the publisher's replay socket for the missing
batches, and says which ones it could not get. ``kvmerge subscribe`` is its
command line; ``kvmerge.sim`` reads the demo's stream with it, decoding into
vLLM's own classes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

#: The replay socket's end-of-replay marker: sequence -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- the subscriber -----------------------------------------------------------
class Received(NamedTuple):
    seq: int
    topic: bytes
    batch: Any  # a KVEventBatch: vLLM's, or kvmerge.events' (batch_type)
    replayed: bool
    #: Which publisher on the endpoint sent it: 0, then one more each time
    #: the stream started over (a server restarted on the same endpoints).
    incarnation: int = 0


@dataclass
class Stats:
    """What a subscriber has seen so far."""

    batches: int = 0
    events: int = 0
    #: (event type, medium) -> events; medium "-" when the event has none.
    by_kind: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter
    )
    first_seq: int | None = None
    last_seq: int | None = None
    #: Gaps in the sequence numbers seen on the live socket.
    gaps: int = 0
    #: Batches recovered from the replay socket.
    replayed: int = 0
    #: Batches never received (not recovered by a replay).
    missing: int = 0
    missing_ranges: list[tuple[int, int]] = field(default_factory=list)
    #: Batches received again (replayed twice, or older than the stream).
    repeated: int = 0
    #: Times the stream started over: a new publisher on the endpoint (a
    #: restarted server), whose sequence numbers start again at 0.
    restarts: int = 0
    decode_errors: int = 0
    dp_ranks: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)


def event_kind(event: Any) -> tuple[str, str]:
    medium = getattr(event, "medium", None)
    return type(event).__name__, medium if medium is not None else "-"


def _decoder(batch_type: type | None = None) -> Any:
    """A msgpack decoder of ``batch_type``; None: vLLM's ``KVEventBatch``."""
    import msgspec

    if batch_type is None:
        from vllm.distributed.kv_events import KVEventBatch

        batch_type = KVEventBatch
    return msgspec.msgpack.Decoder(batch_type)


class EventSubscriber:
    """A SUB socket on a KV-event publisher, with gap detection and replay.

    ``receive(timeout_ms)`` returns the batches that arrived, in sequence
    order; when a sequence number jumps, the missing batches are requested from
    the replay endpoint (if any) and returned first, marked ``replayed``.

    ``batch_type`` is what payloads are decoded into: by default vLLM's
    ``KVEventBatch``, imported by the first decode (the socket is connected at
    once, so nothing is lost meanwhile); ``kvmerge.events.KVEventBatch``
    decodes the same stream into kvmerge's copies, without importing vLLM.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        bind: bool = False,
        replay_timeout: float = 2.0,
        context: Any = None,
        from_seq: int | None = None,
        batch_type: type | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self._ctx = context or zmq.Context.instance()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self.sub.setsockopt(zmq.LINGER, 0)
        # Retry a connection to a publisher that is not up yet every 50 ms
        # (ZMQ's default is 100): fewer of its first batches need a replay.
        self.sub.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self._replay: Any = None
        self._decode: Callable[[bytes], Any] | None = None
        self._batch_type = batch_type
        #: The next sequence number expected (None: whatever comes first).
        #: A reader that must see the stream from its start passes
        #: ``from_seq=0``: batches published before its subscription took
        #: effect (ZMQ's slow joiner) are then fetched from the replay socket.
        self.expected: int | None = from_seq
        #: Whether a batch came on the live socket yet (a jump before that is
        #: the subscription starting late, not a gap in the stream).
        self._live = False
        self.stats = Stats()
        #: The publisher the batches come from (``Received.incarnation``).
        self.incarnation = 0
        #: The newest batch's timestamp: a live batch below the expected
        #: sequence number that is newer comes from a new publisher.
        self._last_ts: float | None = None

    # --- decoding ----------------------------------------------------------------
    def load_decoder(self) -> None:
        if self._decode is None:
            self._decode = _decoder(self._batch_type).decode

    def _deliver(self, topic: bytes, seq: int, payload: bytes, replayed: bool) -> Any:
        self.load_decoder()
        assert self._decode is not None
        st = self.stats
        try:
            batch = self._decode(payload)
        except Exception:
            st.decode_errors += 1
            return None
        st.batches += 1
        st.events += len(batch.events)
        if st.first_seq is None:
            st.first_seq = seq
        st.last_seq = seq if st.last_seq is None else max(st.last_seq, seq)
        if batch.data_parallel_rank is not None:
            st.dp_ranks.add(batch.data_parallel_rank)
        by_kind = st.by_kind
        for event in batch.events:
            by_kind[event_kind(event)] += 1
        if self._last_ts is None or batch.ts > self._last_ts:
            self._last_ts = batch.ts
        return Received(seq, topic, batch, replayed, self.incarnation)

    # --- replay ------------------------------------------------------------------
    def _replay_socket(self) -> Any:
        if self._replay is None:
            zmq = self._zmq
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)
        return self._replay

    def replay(self, start: int) -> list[tuple[bytes, int, bytes]]:
        """Ask the replay socket for every buffered batch from ``start`` on."""
        if self.replay_endpoint is None:
            return []
        sock = self._replay_socket()
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[bytes, int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                # No answer (or no end marker): a later answer must not be
                # taken for the next request's.
                sock.close(linger=0)
                self._replay = None
                return out
            frames = sock.recv_multipart()
            if len(frames) != 4:
                continue
            _empty, topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq_bytes, "big"), payload))

    def _fill(self, start: int, stop: int) -> list[Received]:
        """Batches [start, stop) from the replay socket; the rest are missing."""
        got: dict[int, tuple[bytes, bytes]] = {}
        for topic, seq, payload in self.replay(start):
            if start <= seq < stop and (not self.topic or topic.startswith(self.topic)):
                got[seq] = (topic, payload)
        out = []
        st = self.stats
        first_missing: int | None = None
        for seq in range(start, stop):
            if seq in got:
                if first_missing is not None:
                    st.missing_ranges.append((first_missing, seq - 1))
                    first_missing = None
                topic, payload = got[seq]
                received = self._deliver(topic, seq, payload, True)
                if received is not None:
                    st.replayed += 1
                    out.append(received)
            else:
                st.missing += 1
                if first_missing is None:
                    first_missing = seq
        if first_missing is not None:
            st.missing_ranges.append((first_missing, stop - 1))
        return out

    def fetch_history(self) -> list[Received]:
        """Every batch the replay socket holds (published before we came); the
        stream is then read from its start: what is published before our
        subscription takes effect is fetched from the replay socket too."""
        out = []
        if self.expected is None:
            self.expected = 0
        for topic, seq, payload in self.replay(0):
            if seq < self.expected:
                continue
            received = self._deliver(topic, seq, payload, True)
            if received is not None:
                self.stats.replayed += 1
                out.append(received)
            self.expected = seq + 1
        return out

    def catch_up(self, last_seq: int) -> list[Received]:
        """Make sure every batch up to ``last_seq`` was received (replaying the
        tail if it was not): for a reader that knows how far the stream goes."""
        out: list[Received] = []
        while got := self.receive(0):
            out.extend(got)
        start = 0 if self.expected is None else self.expected
        if last_seq >= start:
            self.stats.gaps += 1
            out.extend(self._fill(start, last_seq + 1))
            self.expected = last_seq + 1
        return out

    # --- the live socket -----------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> list[Received]:
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return []
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        out: list[Received] = []
        if self.expected is not None:
            if seq < self.expected:
                if not self._started_over(payload):
                    self.stats.repeated += 1
                    return out
                # The new publisher's stream from its start: what it sent
                # before we reconnected comes from its replay socket.
                self.incarnation += 1
                self.stats.restarts += 1
                self.expected = 0
                self._live = False
            if seq > self.expected:
                if self._live:
                    self.stats.gaps += 1
                out.extend(self._fill(self.expected, seq))
        self._live = True
        self.expected = seq + 1
        received = self._deliver(topic, seq, payload, False)
        if received is not None:
            out.append(received)
        return out

    def _started_over(self, payload: bytes) -> bool:
        """Whether a live batch below the expected sequence number comes from
        a new publisher. A publisher never sends a batch twice on its live
        socket, but one already replayed by ``fetch_history`` may arrive
        there too, as old as the replay's; a new publisher's is newer than
        every batch seen."""
        self.load_decoder()
        assert self._decode is not None
        try:
            ts = self._decode(payload).ts
        except Exception:
            return False
        return self._last_ts is not None and ts > self._last_ts

    def receive(self, timeout_ms: int = 100, max_batches: int = 1000) -> list[Received]:
        """The batches that arrive within ``timeout_ms`` (at most about
        ``max_batches``), in sequence order."""
        zmq = self._zmq
        if not self.sub.poll(timeout_ms):
            return []
        out: list[Received] = []
        while len(out) < max_batches:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.extend(self._on_message(frames))
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
