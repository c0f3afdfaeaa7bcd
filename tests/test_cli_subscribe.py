"""``kvmerge subscribe``: options; ``EventSubscriber`` against a real
``ZmqEventPublisher`` (gaps filled from its replay socket, or counted missing);
and the command reading ``kvmerge demo``'s publisher (the run is shared with
test_cli_demo: one demo, the subscriber started next to it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

import msgspec
import pytest
from test_cli_demo import CONNECTORS, demo_with_subscriber, lane_table, number

pytestmark = pytest.mark.vllm

CMD = [sys.executable, "-m", "kvmerge"]
MEDIUM = {
    "DemoLMCacheConnector": "LMCACHE",
    "DemoMooncakeConnector": "MOONCAKE",
    "DemoUMBPConnector": "UMBP",
}


def kvmerge(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


# --- options -------------------------------------------------------------------
def test_subscribe_help_explains_every_option():
    proc = kvmerge("subscribe", "--help")
    assert proc.returncode == 0
    for option in (
        "ENDPOINT",
        "--topic",
        "--replay",
        "--history",
        "--bind",
        "--jsonl",
        "--duration",
        "--batches",
        "--idle",
        "--show-events",
        "--plain",
        "--interval",
        "exit status",
    ):
        assert option in proc.stdout, option


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: ENDPOINT"),
        (["localhost:5557"], "not a ZMQ endpoint"),
        (["ipc:///tmp/x", "--duration", "0"], "--duration: must be > 0"),
        (["ipc:///tmp/x", "--batches", "-3"], "--batches: must be >= 1"),
        (["ipc:///tmp/x", "--history"], "--history needs --replay"),
    ],
)
def test_bad_options_exit_2_with_a_one_line_error(args, message):
    proc = kvmerge("subscribe", *args)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr


# --- EventSubscriber against vLLM's publisher -----------------------------------
@pytest.fixture
def publisher():
    from vllm.distributed.kv_events import ZmqEventPublisher

    tmp = tempfile.mkdtemp(prefix="kvmerge-test-sub-")
    made = []

    def make(buffer_steps: int = 100):
        pub = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"ipc://{tmp}/pub{len(made)}",
            replay_endpoint=f"ipc://{tmp}/replay{len(made)}",
            buffer_steps=buffer_steps,
            topic="kv",
        )
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def batches(n: int) -> list:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    return [
        KVEventBatch(
            ts=float(i),
            events=[
                BlockStored(
                    block_hashes=[i],
                    parent_block_hash=i - 1 if i else None,
                    token_ids=[1, 2],
                    block_size=2,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                ),
                BlockRemoved(block_hashes=[i + 1000], medium="GPU"),
            ],
        )
        for i in range(n)
    ]


def wait_replayable(sub, last_seq: int) -> None:
    """The publisher encodes on a thread: wait until it sent ``last_seq``."""
    deadline = time.monotonic() + 10
    while last_seq not in {seq for _t, seq, _p in sub.replay(0)}:
        assert time.monotonic() < deadline, "publisher never buffered the batches"
        time.sleep(0.05)


def frames(batch, seq: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def test_a_gap_is_filled_from_the_replay_socket_in_order(publisher):
    from kvmerge.subscribe import EventSubscriber

    pub = publisher()
    sent = batches(8)
    for b in sent:
        pub.publish(b)
    sub = EventSubscriber(
        pub.get_publisher_config().endpoint,
        topic="kv",
        replay_endpoint=pub.get_publisher_config().replay_endpoint,
    )
    try:
        wait_replayable(sub, 7)
        # What the SUB socket saw: 0, 1, then 5 (2..4 were lost on the way).
        got = [
            *sub._on_message(frames(sent[0], 0)),
            *sub._on_message(frames(sent[1], 1)),
        ]
        got += sub._on_message(frames(sent[5], 5))
        assert [r.seq for r in got] == [0, 1, 2, 3, 4, 5]
        assert [r.replayed for r in got] == [False, False, True, True, True, False]
        assert [r.batch.events for r in got] == [b.events for b in sent[:6]]
        st = sub.stats
        assert (st.gaps, st.replayed, st.missing, st.batches) == (1, 3, 0, 6)
        # A batch seen again is not delivered twice.
        assert sub._on_message(frames(sent[4], 4)) == []
        assert st.repeated == 1
        assert st.by_kind == Counter(
            {("BlockStored", "CPU"): 6, ("BlockRemoved", "GPU"): 6}
        )
        # The stream's tail, from the replay socket: catch_up.
        assert [r.seq for r in sub.catch_up(7)] == [6, 7]
    finally:
        sub.close()


def test_batches_the_publisher_no_longer_holds_are_counted_missing(publisher):
    from kvmerge.subscribe import EventSubscriber

    pub = publisher(buffer_steps=3)  # replays only the last 3 batches
    sent = batches(10)
    for b in sent:
        pub.publish(b)
    cfg = pub.get_publisher_config()
    sub = EventSubscriber(cfg.endpoint, topic="kv", replay_endpoint=cfg.replay_endpoint)
    try:
        wait_replayable(sub, 9)
        got = sub._on_message(frames(sent[0], 0))
        got += sub._on_message(frames(sent[9], 9))  # 1..8 missed; 7, 8 replayable
        assert [r.seq for r in got] == [0, 7, 8, 9]
        assert (sub.stats.missing, sub.stats.missing_ranges) == (6, [(1, 6)])
    finally:
        sub.close()


def test_history_fetches_what_was_published_before(publisher):
    from kvmerge.subscribe import EventSubscriber

    pub = publisher()
    sent = batches(4)
    for b in sent:
        pub.publish(b)
    cfg = pub.get_publisher_config()
    sub = EventSubscriber(cfg.endpoint, topic="kv", replay_endpoint=cfg.replay_endpoint)
    try:
        wait_replayable(sub, 3)
        got = sub.fetch_history()
        assert [r.seq for r in got] == [0, 1, 2, 3] and all(r.replayed for r in got)
        assert sub.expected == 4
        # The next live batch follows without a gap.
        pub.publish(batches(5)[4])
        deadline = time.monotonic() + 10
        live = []
        while not live and time.monotonic() < deadline:
            live = sub.receive(100)
        assert [r.seq for r in live] == [4]
        assert sub.stats.gaps == 0
    finally:
        sub.close()


# --- the command against kvmerge demo's publisher ------------------------------
def test_subscribe_reads_the_demo_stream_completely():
    run = demo_with_subscriber()
    demo, sub = run.demo.stdout, run.subscriber
    assert run.demo.returncode == 0, demo + run.demo.stderr[-3000:]
    assert sub.returncode == 0, sub.stdout + sub.stderr[-3000:]
    m = re.search(
        r"^published ([\d,]+) batches, ([\d,]+) events \((\d+) All", demo, re.M
    )
    assert m, demo
    n_batches, n_events, n_clears = (number(g) for g in m.groups())
    m = re.search(
        r"^summary after [\d.]+s: batches ([\d,]+), events ([\d,]+), seq 0\.\.(\d+), "
        # Batches published before the subscription took effect come from the
        # replay socket; the live copies of replayed ones are skipped (repeated).
        r"gaps 0, replayed \d+, missing 0(, repeated \d+)?$",
        sub.stdout,
        re.M,
    )
    assert m, sub.stdout
    assert [number(g) for g in m.groups()[:3]] == [n_batches, n_events, n_batches - 1]
    # Per event type and medium: each demo connector has its own medium.
    rows = {
        (etype, medium): number(n)
        for etype, medium, n in re.findall(
            r"^  (Block\w+|AllBlocksCleared)\s+(\S+)\s+([\d,]+)$", sub.stdout, re.M
        )
    }
    assert rows[("AllBlocksCleared", "-")] == n_clears
    table = lane_table(demo)
    for connector in CONNECTORS:
        medium = MEDIUM[connector]
        per_medium = sum(n for (_t, m), n in rows.items() if m == medium)
        assert per_medium == table[connector][1], connector  # its events out
    assert rows[("BlockRemoved", "UMBP")] > 0 and rows[("BlockStored", "MOONCAKE")] > 0
    assert f"wrote {n_batches} batches to {run.jsonl}" in sub.stdout


def test_subscribe_writes_the_stream_as_json_lines():
    run = demo_with_subscriber()
    lines = run.jsonl.read_text().splitlines()
    batches = [json.loads(line) for line in lines]
    assert [b["seq"] for b in batches] == list(range(len(batches)))
    assert all(b["topic"] == "kv-events" for b in batches)
    # Replayed batches (if the subscription took effect late) come first.
    replayed = [b["replayed"] for b in batches]
    assert replayed == sorted(replayed, reverse=True)
    assert all(b["data_parallel_rank"] == 0 for b in batches)
    events = [e for b in batches for e in b["events"]]
    m = re.search(r"^published [\d,]+ batches, ([\d,]+) events", run.demo.stdout, re.M)
    assert m and len(events) == number(m.group(1))
    kinds = Counter(e["type"] for e in events)
    assert set(kinds) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    store = next(e for e in events if e["type"] == "BlockStored")
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size"} <= set(
        store
    )
    assert store["medium"] in MEDIUM.values()
