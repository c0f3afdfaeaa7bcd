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

The reading itself is ``kvmerge.subscriber.EventSubscriber``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Iterable
from typing import Any

from kvmerge.subscriber import EventSubscriber, Received, Stats


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
