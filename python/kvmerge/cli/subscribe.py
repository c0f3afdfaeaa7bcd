"""``kvmerge subscribe ENDPOINT``: read a vLLM KV-event stream and check it.

Connects a ZMQ SUB socket to a publisher (vLLM's ``ZmqEventPublisher``, as
started by ``vllm serve --kv-events-config ...`` or ``kvmerge demo``), decodes
every ``(topic, seq, payload)`` message as a ``KVEventBatch``, and shows the
rates per event type and medium. Sequence numbers are checked: on a gap it asks
the publisher's replay socket (``--replay``) for the missing batches, and says
which ones it could not get. ``--jsonl FILE`` writes the stream, one batch per
line. Nothing arriving within ``--first-batch-timeout`` seconds is an error.
``--check`` checks what a KV-aware router relies on with
``kvmerge.streamcheck.StreamCheck`` (every batch, a parent held before its
child is stored, no block stored twice or removed unheld), and ``--json``
prints its summary as JSON lines on stdout.

The command decodes with ``kvmerge.events`` (a copy of vLLM's msgspec structs):
it imports neither vLLM nor torch, and is connected within a fraction of a
second.

The reading itself is ``kvmerge.subscriber.EventSubscriber``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvmerge.streamcheck import StreamCheck, Summary
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
    if stats.restarts:
        parts.append(f"restarts {stats.restarts}")
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


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer, ``minimum`` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {text!r}")
        return value

    return parse


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
        "exit status: 0 the stream was complete (and, with --check, passed the "
        "check), 1 batches were missing or could not be decoded, nothing arrived "
        "within --first-batch-timeout, or --check found a violation, 2 bad "
        "options, 130 interrupted (Ctrl-C ends a run without "
        "--duration/--batches/--idle; the summary is printed first)"
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
        type=_int_at_least(1),
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
        "--check",
        action="store_true",
        help="check what a KV-aware router relies on, per dp rank and medium "
        "since the rank's last AllBlocksCleared: no batch missing, no store "
        "whose parent is not held (in its medium or, below the device tier, a "
        "tier above: Dynamo's tiers), no block stored twice, none removed "
        "that is not held; a summary every --interval and at exit. Without "
        "--history the stream is joined where it is, and a rank's events are "
        "judged from its next clear on",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --check: the check's summary as one JSON object per line "
        'on stdout, every --interval and at exit ("final": true); the other '
        "lines go to stderr",
    )
    parser.add_argument(
        "--min-batches",
        metavar="N",
        type=_int_at_least(0),
        default=0,
        help="with --check: fewer than N batches fails the check (default 0)",
    )
    parser.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_positive_float,
        default=1.0,
        help="how often the rates (and the --check summary) are shown (default 1)",
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
            "incarnation": received.incarnation,
            "events": b.events,
        }
        self._file.write(self._encode(line) + b"\n")

    def close(self) -> None:
        self._file.close()


# --- the check (--check) --------------------------------------------------------
def _new_check(args: argparse.Namespace) -> StreamCheck | None:
    if not args.check:
        return None
    # With --history the stream is read from seq 0; otherwise from wherever it
    # is, and a rank's blocks are known only from its next clear.
    return StreamCheck(
        min_batches=args.min_batches, first_seq=0 if args.history else None
    )


def _json_line(summary: Summary, elapsed: float, final: bool) -> str:
    return json.dumps(
        {**summary.to_dict(), "elapsed_s": round(elapsed, 3), "final": final}
    )


def _option_error(args: argparse.Namespace) -> str | None:
    if args.history and not args.replay:
        return "--history needs --replay"
    if args.json and not args.check:
        return "--json needs --check"
    if args.min_batches and not args.check:
        return "--min-batches needs --check"
    return None


# --- the command's run ----------------------------------------------------------
class _Watch:
    """One run of the command: the subscriber, what it shows, when it stops."""

    def __init__(
        self,
        args: argparse.Namespace,
        sub: EventSubscriber,
        writer: _JsonlWriter | None,
    ) -> None:
        self.args = args
        self.sub = sub
        self.stats = sub.stats
        self.writer = writer
        self.check = _new_check(args)
        #: Where the lines for people go: stderr when stdout carries JSON.
        self.out = sys.stderr if args.json else sys.stdout
        self.console = None if args.plain or args.json else _rich_console()
        self.live_view = self.console is not None and self.console.is_terminal
        self.where = f"{args.endpoint}" + (
            f" (replay {args.replay})" if args.replay else ""
        )
        self.first_batch_timeout = getattr(
            args, "first_batch_timeout", FIRST_BATCH_TIMEOUT
        )
        self.meter = RateMeter()
        self.start = time.monotonic()
        self.last_batch: float | None = None
        self.last_show = self.last_line = self.start
        self.shown = -1
        self.interrupted = False
        self.timed_out = False
        #: The publisher the last batch came from (``Received.incarnation``).
        self.incarnation = 0

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def on_sigint(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True

    # --- reading ------------------------------------------------------------
    def handle(self, batches: Iterable[Received]) -> None:
        for received in batches:
            self.last_batch = time.monotonic()
            if self.writer is not None:
                self.writer.write(received)
            if received.incarnation > self.incarnation:
                # A restarted server: its blocks start from nothing.
                self.incarnation = received.incarnation
                self.say(
                    f"the stream started over at seq {received.seq}: a new "
                    f"publisher on the endpoint (restart {received.incarnation})"
                )
                if self.check is not None:
                    self.check.restart()
            if self.check is not None:
                self.check.feed(received.batch, received.seq)
            if self.args.show_events and not self.live_view:
                tag = " (replayed)" if received.replayed else ""
                for event in received.batch.events:
                    self.say(f"{received.seq}{tag} {event}")

    def done(self) -> bool:
        args, stats = self.args, self.stats
        now = time.monotonic()
        if self.interrupted:
            return True
        if (
            self.first_batch_timeout
            and not (stats.batches or stats.decode_errors)
            and now - self.start >= self.first_batch_timeout
        ):
            self.timed_out = True
            return True
        if args.duration is not None and now - self.start >= args.duration:
            return True
        if args.batches is not None and stats.batches >= args.batches:
            return True
        return (
            args.idle is not None
            and self.last_batch is not None
            and now - self.last_batch >= args.idle
        )

    def summary(self) -> Summary | None:
        if self.check is None:
            return None
        return self.check.summary(stats=self.stats)

    def loop(self) -> None:
        sub = self.sub
        sub.load_decoder()
        if self.args.history:
            self.handle(sub.fetch_history())
        live = None
        try:
            if self.live_view:
                from rich.live import Live

                live = Live(
                    _table(self.stats, {}, self.title()),
                    console=self.console,
                    refresh_per_second=4,
                )
                live.start()
            while not self.done():
                self.handle(sub.receive(100))
                now = time.monotonic()
                if now - self.last_show >= self.args.interval:
                    self.last_show = now
                    self.show(now, live)
        finally:
            if live is not None:
                live.stop()

    # --- showing ------------------------------------------------------------
    def title(self) -> str:
        summary = self.summary()
        line = stats_line(self.stats)
        return line if summary is None else f"{line}\n{summary.text()}"

    def show(self, now: float, live: Any) -> None:
        """Every --interval: the live table, or a line when batches came (else
        one every 10 s); with --json, the check's summary every time."""
        stats = self.stats
        rates = self.meter.update(stats.by_kind)
        summary = self.summary()
        if self.args.json and summary is not None:
            print(_json_line(summary, now - self.start, False), flush=True)
        if live is not None:
            live.update(_table(stats, rates, self.title()))
            return
        if self.args.show_events or (
            stats.batches == self.shown and now - self.last_line < 10
        ):
            return
        self.shown, self.last_line = stats.batches, now
        per = ", ".join(
            f"{etype}/{medium} {rate:,.0f}/s"
            for etype, medium, _n, rate in kind_rows(stats, rates)
        )
        self.say(
            f"[{now - self.start:6.1f}s] {stats_line(stats)}"
            + (f"; {per}" if per else "")
        )
        if summary is not None and not self.args.json:
            self.say(summary.text())

    def report(self) -> int:
        """The summary at exit, and the exit status."""
        args, stats = self.args, self.stats
        elapsed = time.monotonic() - self.start
        self.say(f"summary after {elapsed:.1f}s: {stats_line(stats)}")
        if self.console is not None and self.console.is_terminal:
            self.console.print(_table(stats, None, "events by type and medium"))
        else:
            for etype, medium, n, _rate in kind_rows(stats):
                self.say(f"  {etype:<17} {medium:<10} {n:>9,}")
        if stats.missing:
            self.say(f"missing batches: {_missing_text(stats)}")
        if args.jsonl:
            self.say(f"wrote {stats.batches} batches to {args.jsonl}")
        summary = self.summary()
        if summary is not None:
            self.say(summary.text())
            if args.json:
                print(_json_line(summary, elapsed, True), flush=True)
        if self.interrupted:
            return 130
        if self.timed_out:
            print(
                f"kvmerge subscribe: error: no batch arrived within "
                f"{self.first_batch_timeout:g}s from {self.where}, topic "
                f"{args.topic or '(all)'} (is the publisher running, with this "
                "endpoint and topic? --first-batch-timeout 0 waits for ever)",
                file=sys.stderr,
            )
            return 1
        failed = summary is not None and not summary.ok
        return 1 if stats.missing or stats.decode_errors or failed else 0


def _open(
    args: argparse.Namespace,
) -> tuple[EventSubscriber, _JsonlWriter | None] | str:
    """The subscriber and the --jsonl file, or why not."""
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
        return f"{args.endpoint}: {e}"
    try:
        return sub, _JsonlWriter(args.jsonl) if args.jsonl else None
    except OSError as e:
        sub.close()
        return str(e)


def run(args: argparse.Namespace) -> int:
    import signal

    error = _option_error(args)
    opened = _open(args) if error is None else error
    if isinstance(opened, str):
        print(f"kvmerge subscribe: error: {opened}", file=sys.stderr)
        return 2
    sub, writer = opened
    watch = _Watch(args, sub, writer)
    old = signal.signal(signal.SIGINT, watch.on_sigint)
    watch.say(f"subscribed to {watch.where}, topic {args.topic or '(all)'}")
    try:
        watch.loop()
    except KeyboardInterrupt:
        watch.interrupted = True
    finally:
        signal.signal(signal.SIGINT, old)
        sub.close()
        if writer is not None:
            writer.close()
    return watch.report()
