"""NVIDIA Dynamo's standalone KV indexer reading a hand-made vLLM stream.

A real ``python -m dynamo.indexer`` (from the venv of ``.ci/setup-dynamo.sh``,
found through ``KVMERGE_DYNAMO_PYTHON``) subscribes to a ZMQ publisher in this
process that speaks vLLM's wire format: frames (topic, 8-byte big-endian seq,
msgpack ``KVEventBatch``) on a PUB socket, replays on a ROUTER. The publisher
is an XPUB so that the test knows when the indexer has subscribed. The events
are kvmerge.events' copies of vLLM's structs; vLLM is not imported.
What is asserted is documented in kvmerge.sim.dynamo.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvmerge.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmerge.sim.dynamo import DynamoIndexer, DynamoIndexerError

pytestmark = pytest.mark.dynamo

BLOCK = 4
MODEL = "kvmerge-test"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ZmqEventPublisher.END_SEQ


def stored(
    hashes: list[Any], parent: int | None, tokens: list[int], medium: str | None
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


class Publisher:
    """vLLM's ``ZmqEventPublisher`` on the wire: every batch is numbered and
    kept for replays; ``send=False`` numbers and keeps one without sending it
    (a gap for the subscriber)."""

    def __init__(self, folder: str, topic: str = "kv") -> None:
        self.endpoint = f"ipc://{folder}/pub"
        self.replay_endpoint = f"ipc://{folder}/replay"
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        # Every subscription shows, a repeated one too (a subscriber that
        # registers again while the old subscription lingers).
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.bind(self.endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind(self.replay_endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_requests: list[int] = []
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        assert self._pub.poll(int(timeout * 1000)), "the indexer did not subscribe"
        assert self._pub.recv()[:1] == b"\x01"

    def publish(self, events: list[Any], send: bool = True) -> int:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=None)
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = len(self._buffer)
            self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replays(self) -> None:  # ZmqEventPublisher._service_replay
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _, start_bytes = self._router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            with self._lock:
                kept = list(self._buffer)
            for seq, payload in kept:
                if seq >= start:
                    self._router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def indexer(dynamo_python: str) -> Iterator[DynamoIndexer]:
    with DynamoIndexer(dynamo_python, BLOCK, model_name=MODEL) as idx:
        yield idx


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    folder = tempfile.mkdtemp(prefix="kvd-")  # short: ipc paths max ~100 chars
    pub = Publisher(folder)
    try:
        yield pub
    finally:
        pub.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_indexer_applies_a_vllm_stream(
    indexer: DynamoIndexer, publisher: Publisher
) -> None:
    iid = 7
    toks = list(range(100, 116))  # four blocks of 4
    indexer.register(iid, publisher.endpoint, publisher.replay_endpoint, MODEL)
    publisher.wait_subscribed()
    assert [w["instance_id"] for w in indexer.workers(MODEL)] == [iid]

    # seq 0: blocks 11, 12 on the GPU; seq 1 only reaches it by replay.
    publisher.publish([stored([11, 12], None, toks[0:8], "GPU")])
    publisher.publish([stored([13], 12, toks[8:12], "GPU")], send=False)
    publisher.publish(
        [
            stored([50], 999, toks[12:16], "GPU"),  # parent unknown: skipped
            BlockRemoved(block_hashes=[777], medium="GPU"),  # unknown block
            stored([11, 12, 13], None, toks[0:12], "CPU"),  # lower tier: no metric
            stored([60], None, toks[0:4], "cpu"),  # lower-case medium: dropped
        ]
    )
    applied = indexer.wait_applied(4)
    assert publisher.replay_requests == [1]
    assert applied[("stored", "ok")] == 2
    assert applied[("stored", "parent_block_not_found")] == 1
    assert applied[("removed", "block_not_found")] == 1
    held = {(b.tier, b.block_hash) for b in indexer.dump_blocks(MODEL)}
    assert held == {
        ("device", 11),
        ("device", 12),
        ("device", 13),
        ("host_pinned", 11),
        ("host_pinned", 12),
        ("host_pinned", 13),
    }
    result = indexer.query(toks)  # counts in tokens, a walk over token blocks
    assert (result.tokens(iid, "gpu"), result.tokens(iid, "cpu")) == (12, 12)
    assert result.scores == {iid: {0: 12}}
    assert indexer.query(toks[0:6]).blocks(iid) == 1  # a partial block: ignored
    assert indexer.query(toks[4:12]).instances == {}  # walks from the root

    # Removing 12 on the GPU drops 13 there; the CPU tier keeps its copies and
    # the query's CPU walk continues from the GPU's last block (11).
    publisher.publish([BlockRemoved(block_hashes=[12], medium="GPU")])
    assert indexer.wait_applied(5)[("removed", "ok")] == 1
    result = indexer.query(toks)
    assert (result.blocks(iid, "gpu"), result.blocks(iid, "cpu")) == (1, 3)
    assert result.blocks(iid, "disk") == result.blocks(iid, "longest_matched") == 3

    # A CPU removal leaves the GPU's block; storing a held block again is ok.
    publisher.publish(
        [
            BlockRemoved(block_hashes=[11], medium="CPU"),
            stored([11], None, toks[:4], "GPU"),
        ]
    )
    assert indexer.wait_applied(6)[("stored", "ok")] == 3
    warnings = indexer.samples("dynamo_kvrouter_kv_cache_event_warnings")
    assert warnings == {(("warning_kind", "duplicate_store"),): 1.0}
    result = indexer.query(toks)
    assert (result.blocks(iid, "gpu"), result.blocks(iid, "cpu")) == (1, 3)
    held = {(b.tier, b.block_hash) for b in indexer.dump_blocks(MODEL)}
    assert held == {("device", 11), ("host_pinned", 12), ("host_pinned", 13)}

    # AllBlocksCleared empties every tier (of the batch's dp rank).
    publisher.publish([AllBlocksCleared()])
    assert indexer.wait_applied(7)[("cleared", "ok")] == 1
    assert indexer.query(toks).instances == {}
    assert indexer.dump_blocks(MODEL) == []

    # A bytes block hash makes the whole batch undecodable: no metric, and
    # the next batch's replay of it fails again.
    publisher.publish([stored([b"\x01" * 32], None, toks[0:4], "GPU")])
    publisher.publish([stored([21], None, toks[0:4], None)])  # medium None: GPU
    applied = indexer.wait_applied(8)
    assert {k: v for k, v in applied.items() if v} == {
        ("stored", "ok"): 4,
        ("stored", "parent_block_not_found"): 1,
        ("removed", "ok"): 1,
        ("removed", "block_not_found"): 1,
        ("cleared", "ok"): 1,
    }
    assert publisher.replay_requests == [1, 6]
    assert indexer.query(toks).blocks(iid) == 1
    assert any("Failed to decode" in w for w in indexer.warnings())
    indexer.unregister(iid, MODEL)  # its last worker: the model goes too
    with pytest.raises(DynamoIndexerError) as gone:
        indexer.query(toks)
    assert gone.value.status == 404


def test_indexer_http_errors(indexer: DynamoIndexer, publisher: Publisher) -> None:
    indexer.register(8, publisher.endpoint, None, MODEL)
    with pytest.raises(DynamoIndexerError) as again:
        indexer.register(8, publisher.endpoint, None, MODEL)
    assert again.value.status == 409
    with pytest.raises(DynamoIndexerError) as size:
        indexer.register(9, publisher.endpoint, None, MODEL, block_size=2 * BLOCK)
    assert size.value.status == 409
    with pytest.raises(DynamoIndexerError) as unknown:
        indexer.query([1, 2, 3, 4], "no-such-model")
    assert unknown.value.status == 404
    indexer.unregister(8, MODEL)


def _held(indexer: DynamoIndexer, iid: int) -> list[int]:
    return sorted(
        {b.block_hash for b in indexer.dump_blocks(MODEL) if b.worker_id == iid}
    )


def _subscribed_again(pub: Publisher, timeout: float = 20.0) -> None:
    """The indexer's (re)subscription reached ``pub`` (an unsubscription of
    an old one may come first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert pub._pub.poll(int(max(0.0, deadline - time.monotonic()) * 1000) + 1)
        if pub._pub.recv()[:1] == b"\x01":
            return
    raise AssertionError("the indexer did not subscribe again")


def test_a_restarted_publisher_leaves_dynamos_old_blocks_until_registered_again(
    indexer: DynamoIndexer,
) -> None:
    """Dynamo's indexer, as it is, and a server restarted on its endpoints
    (a new publisher, its seq from 0 again): it reconnects, keeps every block
    of the old publisher, and drops the new one's batches whose seq is not
    above the last it saw, so its view is stale. Unregistering the worker
    drops its blocks; registered again, the new stream is applied from its
    start (what it missed, from the replay socket). What an
    operator does: docs/deployment.md, "A server that restarts"."""
    iid = 9
    toks = list(range(200, 216))
    folder = tempfile.mkdtemp(prefix="kvd-")
    old = Publisher(folder)
    new = None
    try:
        indexer.register(iid, old.endpoint, old.replay_endpoint, MODEL)
        old.wait_subscribed()
        old.publish([stored([11, 12], None, toks[0:8], "GPU")])
        old.publish([stored([13], 12, toks[8:12], "GPU")])
        indexer.wait_until(lambda: _held(indexer, iid) == [11, 12, 13], 10, "3 blocks")
        old.close()
        new = Publisher(folder)  # the same endpoints
        _subscribed_again(new)
        new.publish([stored([21], None, toks[0:4], "GPU")])  # seq 0 again
        time.sleep(2.0)
        assert _held(indexer, iid) == [11, 12, 13]
        indexer.unregister(iid)
        indexer.wait_until(lambda: _held(indexer, iid) == [], 10, "no block")
        indexer.register(iid, new.endpoint, new.replay_endpoint, MODEL)
        _subscribed_again(new)
        new.publish([stored([31], None, toks[4:8], "GPU")])
        # From the new stream's start: seq 0 from the replay socket.
        indexer.wait_until(lambda: _held(indexer, iid) == [21, 31], 10, "new blocks")
    finally:
        with contextlib.suppress(Exception):
            indexer.unregister(iid)
        for pub in (old, new):
            if pub is not None:
                with contextlib.suppress(Exception):
                    pub.close()
        shutil.rmtree(folder, ignore_errors=True)
