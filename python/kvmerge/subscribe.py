"""``kvmerge subscribe ENDPOINT``: read a vLLM KV-event stream and check it.

Connects a ZMQ SUB socket to a publisher (vLLM's ``ZmqEventPublisher``, as
started by ``vllm serve --kv-events-config ...`` or ``kvmerge demo``), decodes
every ``(topic, seq, payload)`` message as a ``KVEventBatch``, and shows the
rates per event type and medium. Sequence numbers are checked: on a gap it asks
the publisher's replay socket (``--replay``) for the missing batches, and says
which ones it could not get. ``--jsonl FILE`` writes the stream, one batch per
line. Nothing arriving within ``--first-batch-timeout`` seconds is an error.

The command decodes with ``kvmerge.events`` (a copy of vLLM's msgspec structs):
it imports neither vLLM nor torch, and is connected within a fraction of a
second.

``EventSubscriber`` is the reusable part (``kvmerge demo`` reads its own
stream with it, decoding into vLLM's own classes).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable, Iterable
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
        return Received(seq, topic, batch, replayed)

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
                self.stats.repeated += 1
                return out
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


# --- rates ----------------------------------------------------------------------
class RateMeter:
    """Events per second per (type, medium) over the last ``window`` seconds."""

    def __init__(self, window: float = 3.0) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, dict[Any, int]]] = (
            collections.deque()
        )

    def update(self, counts: collections.Counter[Any]) -> dict[Any, float]:
        now = time.monotonic()
        self._samples.append((now, dict(counts)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        t0, old = self._samples[0]
        dt = now - t0
        if dt <= 0:
            return {k: 0.0 for k in counts}
        return {k: (n - old.get(k, 0)) / dt for k, n in counts.items()}


def kind_rows(
    stats: Stats, rates: dict[Any, float] | None = None
) -> list[tuple[str, str, int, float | None]]:
    rows = []
    for (etype, medium), n in sorted(stats.by_kind.items()):
        rate = None if rates is None else rates.get((etype, medium), 0.0)
        rows.append((etype, medium, n, rate))
    return rows


def stats_line(stats: Stats) -> str:
    seq = "-" if stats.first_seq is None else f"{stats.first_seq}..{stats.last_seq}"
    parts = [
        f"batches {stats.batches:,}",
        f"events {stats.events:,}",
        f"seq {seq}",
        f"gaps {stats.gaps}",
        f"replayed {stats.replayed}",
        f"missing {stats.missing}",
    ]
    if stats.repeated:
        parts.append(f"repeated {stats.repeated}")
    if stats.decode_errors:
        parts.append(f"undecodable {stats.decode_errors}")
    return ", ".join(parts)


def _missing_text(stats: Stats) -> str:
    ranges = [f"{a}" if a == b else f"{a}..{b}" for a, b in stats.missing_ranges[:5]]
    more = "" if len(stats.missing_ranges) <= 5 else ", ..."
    return ", ".join(ranges) + more


# --- the command ----------------------------------------------------------------
#: --first-batch-timeout's default, in seconds.
FIRST_BATCH_TIMEOUT = 60.0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _endpoint(text: str) -> str:
    if "://" not in text:
        raise argparse.ArgumentTypeError(
            f"not a ZMQ endpoint: {text!r} (e.g. tcp://127.0.0.1:5557, ipc:///tmp/kv)"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Subscribe to a vLLM KV-event publisher (vllm serve --kv-events-config, "
        "or kvmerge demo), decode its KVEventBatch messages, show the rates per "
        "event type and medium, and check the sequence numbers: a gap is filled "
        "from the replay socket when there is one."
    )
    parser.epilog = (
        "exit status: 0 the stream was complete, 1 batches were missing or could "
        "not be decoded, or nothing arrived within --first-batch-timeout, 2 bad "
        "options, 130 interrupted (Ctrl-C ends a run without "
        "--duration/--batches/--idle)"
    )
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        type=_endpoint,
        help="the publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557 or "
        "ipc:///tmp/kv-events (the KVEventsConfig endpoint, with '*' replaced "
        "by the host)",
    )
    parser.add_argument(
        "--topic",
        default="",
        help="topic to subscribe to (KVEventsConfig topic; default: every topic)",
    )
    parser.add_argument(
        "--replay",
        metavar="ENDPOINT",
        type=_endpoint,
        default=None,
        help="the publisher's replay (ROUTER) endpoint (KVEventsConfig "
        "replay_endpoint): missing batches are requested from it",
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help="read the stream from its start: first every batch the replay "
        "endpoint still buffers, then whatever is published before the "
        "subscription takes effect (needs --replay)",
    )
    parser.add_argument(
        "--bind",
        action="store_true",
        help="bind ENDPOINT instead of connecting to it (for a publisher whose "
        "endpoint has no '*' and therefore connects)",
    )
    parser.add_argument(
        "--jsonl",
        metavar="FILE",
        default=None,
        help="write every batch as a JSON line: seq, topic, ts, "
        "data_parallel_rank, replayed, events (tagged with 'type'; bytes "
        "hashes as base64)",
    )
    parser.add_argument(
        "--duration",
        metavar="SECONDS",
        type=_positive_float,
        default=None,
        help="stop after this many seconds",
    )
    parser.add_argument(
        "--batches",
        metavar="N",
        type=_positive_int,
        default=None,
        help="stop after N batches",
    )
    parser.add_argument(
        "--idle",
        metavar="SECONDS",
        type=_positive_float,
        default=None,
        help="stop once no batch arrived for this many seconds (counted from "
        "the first batch)",
    )
    parser.add_argument(
        "--first-batch-timeout",
        metavar="SECONDS",
        type=_nonnegative_float,
        default=FIRST_BATCH_TIMEOUT,
        help="exit 1 if no batch arrived this many seconds after the start "
        f"(default {FIRST_BATCH_TIMEOUT:g}; 0 waits for ever, e.g. for a server "
        "that is idle: vLLM publishes a batch only when there are events)",
    )
    parser.add_argument(
        "--show-events",
        action="store_true",
        help="print every event (plain output)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain lines instead of the live table (the default when stdout "
        "is not a terminal)",
    )
    parser.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_positive_float,
        default=1.0,
        help="how often the rates are shown (default 1)",
    )


def _rich_console() -> Any:
    try:
        from rich.console import Console
    except ImportError:  # the cli extra is not installed
        return None
    return Console()


def _table(stats: Stats, rates: dict[Any, float] | None, title: str) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table()
    table.add_column("event")
    table.add_column("medium")
    table.add_column("events", justify="right")
    if rates is not None:
        table.add_column("per s", justify="right")
    for etype, medium, n, rate in kind_rows(stats, rates):
        row = [etype, medium, f"{n:,}"]
        if rates is not None:
            row.append(f"{rate:,.0f}")
        table.add_row(*row)
    return Group(Text(title), table)


class _JsonlWriter:
    def __init__(self, path: str) -> None:
        import msgspec

        self._encode = msgspec.json.Encoder().encode
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, received: Received) -> None:
        b = received.batch
        line = {
            "seq": received.seq,
            "topic": received.topic.decode(errors="replace"),
            "ts": b.ts,
            "data_parallel_rank": b.data_parallel_rank,
            "replayed": received.replayed,
            "events": b.events,
        }
        self._file.write(self._encode(line) + b"\n")

    def close(self) -> None:
        self._file.close()


def run(args: argparse.Namespace) -> int:
    import signal

    if args.history and not args.replay:
        print("kvmerge subscribe: error: --history needs --replay", file=sys.stderr)
        return 2
    console = None if args.plain else _rich_console()
    live_view = console is not None and console.is_terminal
    interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True

    from kvmerge.events import KVEventBatch

    try:
        sub = EventSubscriber(
            args.endpoint,
            topic=args.topic,
            replay_endpoint=args.replay,
            bind=args.bind,
            batch_type=KVEventBatch,
        )
    except Exception as e:  # zmq.ZMQError: a bad or busy endpoint
        print(f"kvmerge subscribe: error: {args.endpoint}: {e}", file=sys.stderr)
        return 2
    writer = None
    try:
        writer = _JsonlWriter(args.jsonl) if args.jsonl else None
    except OSError as e:
        print(f"kvmerge subscribe: error: {e}", file=sys.stderr)
        sub.close()
        return 2
    old = signal.signal(signal.SIGINT, on_sigint)
    where = f"{args.endpoint}" + (f" (replay {args.replay})" if args.replay else "")
    print(f"subscribed to {where}, topic {args.topic or '(all)'}", flush=True)
    meter = RateMeter()
    start = time.monotonic()
    last_batch: float | None = None
    last_show = last_line = start
    shown = -1
    stats = sub.stats
    first_batch_timeout = getattr(args, "first_batch_timeout", FIRST_BATCH_TIMEOUT)
    timed_out = False

    def handle(batches: Iterable[Received]) -> None:
        nonlocal last_batch
        for received in batches:
            last_batch = time.monotonic()
            if writer is not None:
                writer.write(received)
            if args.show_events and not live_view:
                for event in received.batch.events:
                    tag = " (replayed)" if received.replayed else ""
                    print(f"{received.seq}{tag} {event}")

    def done() -> bool:
        nonlocal timed_out
        now = time.monotonic()
        if interrupted:
            return True
        if (
            first_batch_timeout
            and not (stats.batches or stats.decode_errors)
            and now - start >= first_batch_timeout
        ):
            timed_out = True
            return True
        if args.duration is not None and now - start >= args.duration:
            return True
        if args.batches is not None and stats.batches >= args.batches:
            return True
        return (
            args.idle is not None
            and last_batch is not None
            and now - last_batch >= args.idle
        )

    live = None
    try:
        sub.load_decoder()
        if args.history:
            handle(sub.fetch_history())
        if live_view:
            from rich.live import Live

            live = Live(
                _table(stats, {}, f"{stats_line(stats)}"),
                console=console,
                refresh_per_second=4,
            )
            live.start()
        while not done():
            handle(sub.receive(100))
            now = time.monotonic()
            if now - last_show >= args.interval:
                last_show = now
                rates = meter.update(stats.by_kind)
                if live is not None:
                    live.update(_table(stats, rates, stats_line(stats)))
                elif not args.show_events and (
                    stats.batches != shown or now - last_line >= 10
                ):
                    # A line when batches came (else one every 10 s).
                    shown, last_line = stats.batches, now
                    per = ", ".join(
                        f"{etype}/{medium} {rate:,.0f}/s"
                        for etype, medium, _n, rate in kind_rows(stats, rates)
                    )
                    print(
                        f"[{now - start:6.1f}s] {stats_line(stats)}"
                        + (f"; {per}" if per else ""),
                        flush=True,
                    )
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if live is not None:
            live.stop()
        signal.signal(signal.SIGINT, old)
        sub.close()
        if writer is not None:
            writer.close()
    elapsed = time.monotonic() - start
    print(f"summary after {elapsed:.1f}s: {stats_line(stats)}")
    if console is not None and console.is_terminal:
        console.print(_table(stats, None, "events by type and medium"))
    else:
        for etype, medium, n, _rate in kind_rows(stats):
            print(f"  {etype:<17} {medium:<10} {n:>9,}")
    if stats.missing:
        print(f"missing batches: {_missing_text(stats)}")
    if args.jsonl:
        print(f"wrote {stats.batches} batches to {args.jsonl}")
    if interrupted:
        return 130
    if timed_out:
        print(
            f"kvmerge subscribe: error: no batch arrived within "
            f"{first_batch_timeout:g}s from {where}, topic {args.topic or '(all)'} "
            "(is the publisher running, with this endpoint and topic? "
            "--first-batch-timeout 0 waits for ever)",
            file=sys.stderr,
        )
        return 1
    return 1 if stats.missing or stats.decode_errors else 0
