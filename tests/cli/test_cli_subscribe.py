"""``kvmerge subscribe``: options; ``EventSubscriber`` against a real
``ZmqEventPublisher`` (gaps filled from its replay socket, or counted missing);
and the command reading ``kvmerge demo``'s publisher (the run is shared with
test_cli_demo: one demo, the subscriber started next to it). The command
decodes with ``kvmerge.events`` (never importing vLLM or torch) and gives up
when nothing arrives; those structs are checked against the installed vLLM's:
same definitions, the same bytes both ways, unknown fields skipped."""

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
from hypothesis import given
from hypothesis import strategies as st
from support import strategies
from support.vllm_harness import removed, stored
from test_cli_demo import (
    CONNECTORS,
    MEDIA,
    demo_with_subscriber,
    lane_table,
    number,
    published,
)

pytestmark = pytest.mark.vllm

CMD = [sys.executable, "-m", "kvmerge"]
MEDIUM = MEDIA


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
        "--first-batch-timeout",
        "--check",
        "--json",
        "--min-batches",
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
        (
            ["ipc:///tmp/x", "--first-batch-timeout", "-1"],
            "--first-batch-timeout: must be >= 0",
        ),
        (["ipc:///tmp/x", "--json"], "--json needs --check"),
        (["ipc:///tmp/x", "--min-batches", "2"], "--min-batches needs --check"),
        (["ipc:///tmp/x", "--check", "--min-batches", "-1"], "must be >= 0"),
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


def subscribe_all(cfg, batches: int) -> list[str]:
    """``kvmerge subscribe``'s arguments for ``batches`` batches of a
    publisher with config ``cfg``: its history replayed, then live ones."""
    return [
        "subscribe",
        cfg.endpoint,
        "--replay",
        cfg.replay_endpoint,
        "--topic",
        "kv",
        "--history",
        "--batches",
        str(batches),
        "--duration",
        "60",
    ]


def published_config(pub, last_seq: int):
    """``pub``'s config, once it has sent ``last_seq`` (asked by a probe)."""
    from kvmerge.subscriber import EventSubscriber

    cfg = pub.get_publisher_config()
    probe = EventSubscriber(cfg.endpoint, replay_endpoint=cfg.replay_endpoint)
    try:
        wait_replayable(probe, last_seq)
    finally:
        probe.close()
    return cfg


def frames(batch, seq: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def test_a_gap_is_filled_from_the_replay_socket_in_order(publisher):
    from kvmerge.subscriber import EventSubscriber

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
    from kvmerge.subscriber import EventSubscriber

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
    from kvmerge.subscriber import EventSubscriber

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
    n_batches, n_events, media = published(demo)
    n_clears = media["-"]
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
    # Per event type and medium: each simulated child has its own medium.
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
    # A child's tier evicted (UMBP's small pool where the vLLM has it).
    assert any(rows.get(("BlockRemoved", m), 0) > 0 for m in MEDIUM.values())
    assert rows[("BlockStored", "STORAGE")] > 0 and rows[("BlockStored", "GPU")] > 0
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
    assert len(events) == published(run.demo.stdout)[1]
    kinds = Counter(e["type"] for e in events)
    assert set(kinds) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    store = next(e for e in events if e["type"] == "BlockStored")
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size"} <= set(
        store
    )
    assert store["medium"] in {"GPU", *MEDIUM.values()}


# --- the command on its own: no vLLM, and a timeout for the first batch ---------
#: ``python -c WATCHED subscribe ...`` runs ``python -m kvmerge subscribe ...``
#: and prints, at exit, the vLLM and torch modules it imported.
WATCHED = """\
import atexit, runpy, sys
atexit.register(lambda: print("heavy modules:", sorted(
    m for m in sys.modules if m.split(".")[0] in ("vllm", "torch")
), "kvmerge.events" in sys.modules, file=sys.stderr))
sys.argv = ["kvmerge", *sys.argv[1:]]
runpy.run_module("kvmerge", run_name="__main__", alter_sys=True)
"""
NO_HEAVY_MODULES = "heavy modules: [] True"


def watched(*args: str, **kwargs) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WATCHED, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **kwargs,
    )


def test_the_command_reads_vllms_publisher_without_importing_vllm(publisher, tmp_path):
    """A fresh interpreter reads a real ZmqEventPublisher (history from the
    replay socket, then live batches) and writes what vLLM's classes encode as
    JSON, having imported neither vLLM nor torch."""

    pub = publisher()
    sent = batches(6)
    for b in sent[:3]:
        pub.publish(b)
    cfg = published_config(pub, 2)
    jsonl = tmp_path / "stream.jsonl"
    proc = watched(
        *subscribe_all(cfg, 6),
        "--jsonl",
        str(jsonl),
        "--plain",
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("subscribed to "), first
        time.sleep(0.5)  # the subscription takes effect; a late one is replayed
        for b in sent[3:]:
            pub.publish(b)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = first + out
    assert proc.returncode == 0, out + err
    assert NO_HEAVY_MODULES in err, err
    assert re.search(
        r"^summary after [\d.]+s: batches 6, events 12, seq 0\.\.5, gaps \d+, "
        r"replayed \d+, missing 0(, repeated \d+)?$",
        out,
        re.M,
    ), out
    assert re.search(r"^  BlockStored\s+CPU\s+6$", out, re.M), out
    assert re.search(r"^  BlockRemoved\s+GPU\s+6$", out, re.M), out
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [line["seq"] for line in lines] == list(range(6))
    assert [line["ts"] for line in lines] == [b.ts for b in sent]
    assert [line["data_parallel_rank"] for line in lines] == [0] * 6
    assert [line["events"] for line in lines] == [
        json.loads(msgspec.json.encode(b.events)) for b in sent
    ]


def test_nothing_arriving_exits_1_after_the_first_batch_timeout(tmp_path):
    start = time.monotonic()
    proc = watched(
        "subscribe", f"ipc://{tmp_path}/nobody", "--first-batch-timeout", "0.5"
    )
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, out + err
    # Interpreter start-up (no vLLM) plus one 100 ms poll, on a busy machine.
    assert 0.5 <= elapsed < 0.5 + 5, elapsed
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert f"no batch arrived within 0.5s from ipc://{tmp_path}/nobody" in errors[0]
    assert "summary after" in out and "batches 0" in out
    assert NO_HEAVY_MODULES in err, err


def test_a_first_batch_timeout_of_0_waits_and_a_quiet_run_still_exits_0(tmp_path):
    proc = watched(
        "subscribe",
        f"ipc://{tmp_path}/nobody",
        "--first-batch-timeout",
        "0",
        "--duration",
        "1",
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "error:" not in err and NO_HEAVY_MODULES in err, err


# --- --check: StreamCheck on the stream -------------------------------------------
def stream(duplicate: bool = False) -> list:
    """A GPU chain offloaded to CPU, a leaf evicted, a clear, stores after it;
    with ``duplicate``, a CPU block stored again."""
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    def stored(hashes: list, parent, medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[1, 2] * len(hashes),
            block_size=2,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    events = [
        [stored([1, 2], None, "GPU")],
        [stored([3], 2, "GPU"), stored([b"\x00c1"], 2, "CPU")],
        [BlockRemoved(block_hashes=[3], medium="GPU")],
        [AllBlocksCleared(), stored([1], None, "GPU")],
    ]
    if duplicate:
        events[2].append(stored([b"\x00c1"], 2, "CPU"))
    return [KVEventBatch(ts=float(i), events=e) for i, e in enumerate(events)]


def run_check(publisher, sent: list) -> tuple[int, list[dict], str]:
    """``kvmerge subscribe --check --json`` (without vLLM) on a publisher that
    sent ``sent``: the exit status, the JSON lines, stderr."""

    pub = publisher()
    for b in sent:
        pub.publish(b)
    cfg = published_config(pub, len(sent) - 1)
    proc = watched(
        *subscribe_all(cfg, len(sent)),
        "--check",
        "--json",
        "--min-batches",
        "1",
        "--interval",
        "0.2",
    )
    out, err = proc.communicate(timeout=90)
    assert NO_HEAVY_MODULES in err, err
    return proc.returncode, [json.loads(line) for line in out.splitlines()], err


def test_check_passes_a_valid_stream_with_exit_0(publisher):
    rc, lines, err = run_check(publisher, stream())
    assert rc == 0, err
    *_, final = lines  # stdout: JSON lines alone
    assert [line["final"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert final["ok"] is True and final["failures"] == [], final
    assert (final["batches"], final["events"], final["missing"]) == (4, 6, 0)
    assert final["counts"] == {"orphan": 0, "duplicate": 0, "unknown_removal": 0}
    assert final["violations"] == [] and final["clears"] == 1
    assert final["ranks"] == [
        {"dp_rank": 0, "batches": 4, "events": 6, "clears": 1, "unchecked": 0}
    ]
    assert re.search(r"^check ok: 4 batches \(seq 0\.\.3\), 6 events", err, re.M), err


def test_check_fails_a_duplicate_store_with_exit_1(publisher):
    rc, lines, err = run_check(publisher, stream(duplicate=True))
    assert rc == 1, err
    final = lines[-1]
    assert final["final"] is True and final["ok"] is False
    assert final["failures"] == ["duplicate"], final
    (violation,) = final["violations"]
    assert {k: violation[k] for k in ("kind", "dp_rank", "medium", "count")} == {
        "kind": "duplicate",
        "dp_rank": 0,
        "medium": "CPU",
        "count": 1,
    }
    (example,) = violation["examples"]
    assert (example["seq"], example["block"]) == (2, "0x006331")
    assert re.search(r"^check FAILED \(duplicate\)", err, re.M), err
    assert re.search(r"^  duplicate dp 0 CPU: 1 \(seq 2 block 0x006331", err, re.M)


def test_check_reads_vllms_own_event_objects():
    """StreamCheck duck-types: vLLM's classes are checked as kvmerge's."""
    from kvmerge.streamcheck import StreamCheck

    check = StreamCheck(min_batches=1)
    for seq, b in enumerate(stream(duplicate=True)):
        check.feed(b, seq)
    summary = check.summary(expect_last_seq=3)
    assert summary.failures == ["duplicate"] and summary.counts["duplicate"] == 1
    # batches(): a CPU chain, and removals of GPU blocks never stored.
    check = StreamCheck()
    for seq, b in enumerate(batches(5)):
        check.feed(b, seq)
    assert check.summary().counts == {"orphan": 0, "duplicate": 0, "unknown_removal": 5}


# --- kvmerge.events: vLLM's structs, copied -------------------------------------
STRUCTS = (
    "EventBatch",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
)


def _config(cls: type) -> dict:
    cfg = cls.__struct_config__  # type: ignore[attr-defined]
    return {a: getattr(cfg, a) for a in dir(cfg) if not a.startswith("_")}


def test_kvmerge_events_are_the_installed_vllms_structs():
    import vllm.distributed.kv_events as theirs

    import kvmerge.events as ours

    def type_text(tp: object, module: object) -> str:
        return str(tp).replace(f"{module.__name__}.", "")

    for name in STRUCTS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert _config(a) == _config(b), name
        assert [base.__name__ for base in a.__mro__] == [
            base.__name__ for base in b.__mro__
        ], name
        fa, fb = msgspec.structs.fields(a), msgspec.structs.fields(b)
        # kvmerge's copy is the newest supported release's: an older one's
        # lacks the fields added since, last and None by default (0.32's
        # BlockStored has no lookahead_token_ids), which kvmerge reads so.
        newer = fa[len(fb) :]
        assert all(not f.required and f.default is None for f in newer), name
        fa = fa[: len(fb)]
        assert [
            (f.name, f.encode_name, f.required, f.default, f.default_factory)
            for f in fa
        ] == [
            (f.name, f.encode_name, f.required, f.default, f.default_factory)
            for f in fb
        ], name
        assert [type_text(f.type, ours) for f in fa] == [
            type_text(f.type, theirs) for f in fb
        ], name
    # Every event type vLLM has is copied.
    events = {
        n
        for n, c in vars(theirs).items()
        if isinstance(c, type) and issubclass(c, theirs.KVCacheEvent)
    }
    assert events == {"KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert ours.MEDIUM_GPU == theirs.MEDIUM_GPU
    assert ours.MEDIUM_CPU == theirs.MEDIUM_CPU
    assert ours.MEDIUM_STORAGE == theirs.MEDIUM_STORAGE


def _newer() -> set[str]:
    """The fields of kvmerge's copy that the installed vLLM's structs lack."""
    import vllm.distributed.kv_events as theirs

    import kvmerge.events as ours

    return {
        f
        for name in STRUCTS
        for f in getattr(ours, name).__struct_fields__
        if f not in getattr(theirs, name).__struct_fields__
    }


NEWER = _newer()


def _fields(events: list) -> list[tuple[str, dict]]:
    """Each event's class and fields, those the installed vLLM's class has
    (the newer ones kvmerge's copy adds must be None: test above)."""
    import vllm.distributed.kv_events as theirs

    out = []
    for e in events:
        known = getattr(theirs, type(e).__name__).__struct_fields__
        d = msgspec.structs.asdict(e)
        assert all(v is None for k, v in d.items() if k not in known), d
        out.append((type(e).__name__, {k: v for k, v in d.items() if k in known}))
    return out


def _round_trip(vllm_batch) -> None:
    """vLLM's batch, encoded as ZmqEventPublisher does, decodes with kvmerge's
    structs to the same fields, and encodes back to the same bytes."""
    from vllm.distributed.kv_events import KVEventBatch as VLLMBatch

    import kvmerge.events as ours

    data = msgspec.msgpack.Encoder().encode(vllm_batch)
    got = msgspec.msgpack.Decoder(ours.KVEventBatch).decode(data)
    assert type(got) is ours.KVEventBatch
    assert (got.ts, got.data_parallel_rank) == (
        vllm_batch.ts,
        vllm_batch.data_parallel_rank,
    )
    assert _fields(got.events) == _fields(vllm_batch.events)
    assert all(type(e).__module__ == "kvmerge.events" for e in got.events)
    # The other way round: kvmerge's structs encode what vLLM decodes.
    again = msgspec.msgpack.encode(got)
    if not NEWER:
        # Byte for byte (kvmerge's copy writes the fields an older vLLM
        # lacks, as None).
        assert again == data
    assert msgspec.msgpack.Decoder(VLLMBatch).decode(again) == vllm_batch
    # And as JSON lines (kvmerge subscribe --jsonl) they are vLLM's JSON.
    mine = msgspec.json.decode(msgspec.json.encode(got.events))
    assert [{k: v for k, v in e.items() if k not in NEWER} for e in mine] == (
        msgspec.json.decode(msgspec.json.encode(vllm_batch.events))
    )


def test_every_field_round_trips_between_vllm_and_kvmerge():
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    stored = BlockStored(
        block_hashes=[2**64 - 1, b"\x00hash", -(2**63)],
        parent_block_hash=b"parent",
        token_ids=[1, 2, 3, 4],
        block_size=16,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("adapter", "salt"), None, (b"digest", 7)],
        group_idx=1,
        kv_cache_spec_kind="sliding",
        kv_cache_spec_sliding_window=4096,
        locality="REMOTE",
        ownership="tier-2",
        session_id="session-1",
        **(
            {"lookahead_token_ids": [[5], [], [6, 7]]}
            if "lookahead_token_ids" in BlockStored.__struct_fields__
            else {}
        ),
    )
    assert all(v is not None for v in msgspec.structs.asdict(stored).values())
    removed = BlockRemoved(
        block_hashes=[7, b"h"],
        medium="GPU",
        group_idx=2,
        locality="LOCAL",
        ownership="tier-1",
    )
    assert all(v is not None for v in msgspec.structs.asdict(removed).values())
    _round_trip(
        KVEventBatch(
            ts=1234.5,
            events=[stored, removed, AllBlocksCleared()],
            data_parallel_rank=3,
        )
    )
    # Defaults left out (omit_defaults), and no rank.
    _round_trip(
        KVEventBatch(
            ts=0.0,
            events=[
                BlockStored(
                    block_hashes=[1],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=1,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                ),
                BlockRemoved(block_hashes=[], medium=None),
            ],
        )
    )


@given(
    events=st.lists(strategies.events(), max_size=6),
    ts=st.floats(allow_nan=False),
    rank=st.none() | st.integers(0, 2**31),
)
def test_any_batch_round_trips_between_vllm_and_kvmerge(events, ts, rank):
    from vllm.distributed.kv_events import KVEventBatch

    _round_trip(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))


def test_fields_a_newer_vllm_adds_are_skipped():
    """Unknown fields, in an event (a map) or after the batch's (an array),
    are skipped: by kvmerge's structs exactly as by vLLM's."""
    from vllm.distributed.kv_events import KVEventBatch as VLLMBatch

    import kvmerge.events as ours

    stored = {
        "type": "BlockStored",
        "block_hashes": [1, b"h"],
        "a_future_field": {"nested": [1, 2]},
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "another_one": "x",
    }
    payload = msgspec.msgpack.encode(
        [
            2.5,
            [
                stored,
                {"type": "BlockRemoved", "block_hashes": [3], "medium": None, "x": 1},
                {"type": "AllBlocksCleared", "reason": "reset"},
            ],
            1,
            "a future batch field",
        ]
    )
    got = msgspec.msgpack.Decoder(ours.KVEventBatch).decode(payload)
    theirs = msgspec.msgpack.Decoder(VLLMBatch).decode(payload)
    assert (got.ts, got.data_parallel_rank) == (theirs.ts, theirs.data_parallel_rank)
    assert _fields(got.events) == _fields(theirs.events)
    assert got.events == [
        ours.BlockStored(
            block_hashes=[1, b"h"],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        ),
        ours.BlockRemoved(block_hashes=[3], medium=None),
        ours.AllBlocksCleared(),
    ]


# --- a publisher that restarts on its endpoints -----------------------------------
def _batch_at(ts: float, event: object) -> object:
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=ts, events=[event])


def _across_a_restart(tmp_path, after: list[tuple[str, int, int | None]]) -> dict:
    """``kvmerge subscribe --check`` of a publisher that stores blocks 1, 2,
    3 (a chain), stops, and starts again on the same endpoints (as a
    restarted ``vllm serve``) to publish ``after``, from seq 0: its final
    JSON summary, and the lines it wrote beside."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"

    def start() -> ZmqEventPublisher:
        return ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=100,
            topic="kv",
        )

    first = start()
    now = time.time()
    for i, (block, parent) in enumerate([(1, None), (2, 1), (3, 2)]):
        first.publish(_batch_at(now + i, stored(block, parent, medium="CPU")))
    proc = subprocess.Popen(
        [
            *CMD,
            *("subscribe", endpoint, "--replay", replay, "--topic", "kv"),
            *("--history", "--check", "--json", "--idle", "10", "--duration", "90"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    second = None
    try:
        time.sleep(3.0)  # the old stream read (replayed), the socket live
        first.shutdown()
        second = start()
        time.sleep(1.0)  # the subscriber reconnects (every 50 ms)
        for i, (kind, block, parent) in enumerate(after):
            event = (
                stored(block, parent, medium="CPU")
                if kind == "stored"
                else removed(block, medium="CPU")
            )
            second.publish(_batch_at(now + 10 + i, event))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if second is not None:
            second.shutdown()
    final = json.loads(out.strip().splitlines()[-1])
    final["stderr"] = err
    return final


def test_a_restarted_publisher_starts_a_new_stream(tmp_path):
    """A server restarted on its endpoints publishes from seq 0 again, and
    holds nothing: its stores of blocks the old one stored are no
    duplicates, and no batch is missing (not a gap, not repeated batches)."""
    final = _across_a_restart(
        tmp_path, [("stored", 1, None), ("stored", 2, 1), ("removed", 2, None)]
    )
    err = final["stderr"]
    assert final["ok"] is True, (final, err)
    assert (final["batches"], final["missing"], final["restarts"]) == (6, 0, 1)
    assert "the stream started over at seq 0" in err, err


def test_a_restarted_publisher_holds_none_of_the_old_ones_blocks(tmp_path):
    """After a restart, a removal of a block only the old publisher stored is
    one a router cannot apply: the subscriber forgot the old blocks."""
    final = _across_a_restart(tmp_path, [("stored", 5, None), ("removed", 3, None)])
    assert final["failures"] == ["unknown_removal"], (final, final["stderr"])
    assert final["restarts"] == 1 and final["missing"] == 0
