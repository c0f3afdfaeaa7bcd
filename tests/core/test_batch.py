"""EventBatch: encoding, decoding, identities, buffers and pickling."""

import contextlib
import pickle
import threading

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.strategies import events, key
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge
from kvmerge import EventBatch

event_lists = st.lists(events(), max_size=12)
EVENT = BlockStored | BlockRemoved | AllBlocksCleared
decoder = msgspec.msgpack.Decoder(EVENT)


def same_types(a: object, b: object) -> bool:
    """Deep type equality: `1 == True` and `[1] == [1.0]` must not pass."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_types, a, b))
    if isinstance(a, msgspec.Struct):
        fields = a.__struct_fields__
        return all(same_types(getattr(a, f), getattr(b, f)) for f in fields)
    return True


@given(event_lists)
def test_round_trip(evs):
    batch = kvmerge.encode(evs)
    out = batch.decode()
    assert out == evs
    assert all(same_types(a, b) for a, b in zip(out, evs, strict=True))
    assert len(batch) == len(evs)


@given(event_lists)
def test_encode_accepts_any_sequence(evs):
    assert kvmerge.encode(tuple(evs)).decode() == evs


def test_int_stays_int_and_bytes_stay_bytes():
    e = BlockStored(
        block_hashes=[1, b"\x01", 2**64 - 1, -(2**63), b""],
        parent_block_hash=b"\x00" * 32,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    (out,) = kvmerge.encode([e]).decode()
    assert [type(h) for h in out.block_hashes] == [int, bytes, int, int, bytes]
    assert out.block_hashes == e.block_hashes
    assert type(out.parent_block_hash) is bytes


@given(event_lists)
def test_nbytes_and_buffer(evs):
    batch = kvmerge.encode(evs)
    data = bytes(batch)
    assert batch.nbytes == len(data)
    with memoryview(batch) as view:
        assert view.nbytes == batch.nbytes
        assert view.tobytes() == data
        assert view.readonly


@given(event_lists)
def test_raw_is_msgspec_encoding(evs):
    raws = kvmerge.encode(evs).raw()
    assert all(isinstance(r, msgspec.Raw) for r in raws)
    # The publisher sends these bytes verbatim, so they must be exactly what
    # vLLM's own encoder would have produced.
    assert [bytes(r) for r in raws] == [msgspec.msgpack.encode(e) for e in evs]
    assert [decoder.decode(r) for r in raws] == evs


def test_raw_outlives_its_batch_and_its_buffer():
    """A ``Raw`` is a view of its event where the event came in (the worker's
    received buffer): it holds that buffer, read-only, after the batch, the
    merger and every other reference are gone."""
    import gc

    evs = [BlockRemoved(block_hashes=[i, b"h" * 32], medium="GPU") for i in range(40)]
    want = [msgspec.msgpack.encode(e) for e in evs]
    merger = kvmerge.Merger(2)
    received = [bytes(kvmerge.encode(evs, rank=r, world_size=2)) for r in range(2)]
    merger.add_all([(r, EventBatch.from_buffer(b)) for r, b in enumerate(received)])
    raws = merger.finish_step_raw()
    from_batch = EventBatch.from_buffer(bytearray(bytes(kvmerge.encode(evs)))).raw()
    del merger, received
    gc.collect()
    for out in (raws, from_batch):
        assert [bytes(r) for r in out] == want
        with memoryview(out[0]) as view:
            assert view.readonly
            with pytest.raises(TypeError):
                view[0] = 0


@given(event_lists, event_lists)
def test_identities_equal_iff_events_equal(a, b):
    ids_a = kvmerge.encode(a).identities()
    # A second, separate batch: identities must not depend on the batch.
    ids_b = kvmerge.encode(b).identities()
    assert all(type(i) is bytes and len(i) == 16 for i in ids_a + ids_b)
    for ea, ia in zip(a, ids_a, strict=True):
        for eb, ib in zip(b, ids_b, strict=True):
            assert (ia == ib) == (ea == eb), (ea, eb)


def test_near_twins_have_different_identities():
    base = dict(block_hashes=[7], medium=None)
    variants = [
        BlockRemoved(**base),
        BlockRemoved(block_hashes=[b"\x07"], medium=None),
        BlockRemoved(block_hashes=[7], medium=""),
        BlockRemoved(**base, group_idx=0),
        BlockRemoved(**base, locality="LOCAL"),
        BlockRemoved(**base, ownership=""),
        BlockRemoved(block_hashes=[7, 7], medium=None),
        BlockRemoved(block_hashes=[], medium=None),
        AllBlocksCleared(),
    ]
    ids = kvmerge.encode(variants).identities()
    assert len(set(ids)) == len(variants)


@given(event_lists, st.sampled_from([2, 3, 4, 5]))
def test_pickle_in_band(evs, protocol):
    batch = kvmerge.encode(evs)
    back = pickle.loads(pickle.dumps(batch, protocol=protocol))
    assert type(back) is EventBatch
    assert bytes(back) == bytes(batch)
    assert back.decode() == evs
    assert back.identities() == batch.identities()


@given(event_lists, st.sampled_from([bytes, bytearray]))
def test_pickle_protocol_5_out_of_band(evs, container):
    batch = kvmerge.encode(evs)
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and isinstance(buffers[0], pickle.PickleBuffer)
    with buffers[0].raw() as view:
        payload = view.tobytes()
    assert payload == bytes(batch)
    # Out of band means the payload is not in the pickle stream too.
    assert len(data) < 200
    # vLLM's shm queue hands the buffer back as a bytearray; others as bytes.
    back = pickle.loads(data, buffers=[container(payload)])
    assert back.decode() == evs
    assert back.identities() == batch.identities()


@given(event_lists, st.sampled_from([bytes, bytearray, memoryview]))
def test_from_buffer(evs, container):
    batch = kvmerge.encode(evs)
    src = container(bytearray(bytes(batch)))
    back = EventBatch.from_buffer(src)
    assert bytes(back) == bytes(batch)
    assert back.decode() == evs
    assert [bytes(r) for r in back.raw()] == [bytes(r) for r in batch.raw()]
    assert back.identities() == batch.identities()


def test_from_buffer_keeps_its_source_alive():
    evs = [BlockRemoved(block_hashes=[1, 2], medium="GPU")]
    src = bytearray(bytes(kvmerge.encode(evs)))
    back = EventBatch.from_buffer(src)
    del src  # a borrow must hold a reference, not a dangling pointer
    assert back.decode() == evs


def test_from_buffer_survives_a_resize_attempt():
    evs = [BlockRemoved(block_hashes=[b"x" * 100], medium="GPU")]
    src = bytearray(bytes(kvmerge.encode(evs)))
    back = EventBatch.from_buffer(src)
    # A borrow holds a buffer export, so the resize fails; a copy lets it pass.
    # Either way the batch must not read freed memory.
    with contextlib.suppress(BufferError):
        src.clear()
    assert back.decode() == evs


@pytest.mark.parametrize("make", [EventBatch.empty, lambda: kvmerge.encode([])])
def test_empty(make):
    batch = make()
    assert len(batch) == 0
    assert batch.decode() == [] and batch.raw() == [] and batch.identities() == []
    assert batch.nbytes == len(bytes(batch)) > 0
    assert EventBatch.from_buffer(bytes(batch)).decode() == []
    for protocol in (2, 5):
        assert pickle.loads(pickle.dumps(batch, protocol=protocol)).decode() == []


def test_clear_events_are_not_hashable_but_batches_work():
    # Guard for the test helpers: vLLM 0.33.0's AllBlocksCleared has no hash,
    # which is why the tests key events by their encoding.
    with pytest.raises(TypeError):
        hash(AllBlocksCleared())
    batch = kvmerge.encode([AllBlocksCleared(), AllBlocksCleared()])
    assert batch.decode() == [AllBlocksCleared(), AllBlocksCleared()]
    ids = batch.identities()
    assert ids[0] == ids[1]
    assert key(AllBlocksCleared()) == msgspec.msgpack.encode(AllBlocksCleared())


@given(event_lists)
def test_kinds(evs):
    assert kvmerge.encode(evs).kinds() == [type(e).__name__ for e in evs]


@given(event_lists)
def test_indices_of_a_kind(evs):
    batch = kvmerge.encode(evs)
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        want = [i for i, e in enumerate(evs) if type(e).__name__ == name]
        assert batch.indices(name) == want
        assert batch.take(want).decode() == [evs[i] for i in want]
    with pytest.raises(ValueError, match="not an event class name"):
        batch.indices("KVCacheEvent")  # type: ignore[arg-type]


@given(event_lists, st.data())
def test_take(evs, data):
    batch = kvmerge.encode(evs)
    n = len(evs)
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=8) if n else st.just([]))
    part = batch.take(idx)
    assert part.decode() == [evs[i] for i in idx]  # Python indexing, repeats too
    assert part.identities() == [batch.identities()[i] for i in idx]
    # A taken batch is a batch in its own right: it travels and re-reads.
    assert EventBatch.from_buffer(bytes(part)).decode() == [evs[i] for i in idx]
    with pytest.raises(IndexError):
        batch.take([*idx, n])


def test_multimodal_extra_keys_round_trip():
    # vLLM's own helper nests (mm_identifier, offset) pairs inside each entry;
    # msgpack turns the nested tuples into arrays, decode() must restore them.
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    extra = to_event_extra_keys(
        [(("lora", "name", "path"), ("mm", "mmhash", 0), ("salt", "s"))]
    )
    event = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name="name",
        extra_keys=extra,
    )
    assert any(isinstance(v, tuple) for v in extra[0])  # the case is real
    assert kvmerge.encode([event]).decode() == [event]


def _address(buffer) -> int:
    import numpy as np

    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def test_borrow_buffers_borrows_read_only_buffers_only_inside_the_block():
    source = bytearray(
        bytes(kvmerge.encode([BlockRemoved(block_hashes=[1], medium=None)]))
    )
    view = memoryview(source).toreadonly()
    outside = EventBatch.from_buffer(view)
    assert _address(outside) != _address(view)  # an unknown exporter: copied
    with kvmerge.borrow_buffers():
        with kvmerge.borrow_buffers():  # blocks nest
            pass
        inside = EventBatch.from_buffer(view)
        writable = EventBatch.from_buffer(source)  # not read-only: still copied
        elsewhere: list[EventBatch] = []
        thread = threading.Thread(
            target=lambda: elsewhere.append(EventBatch.from_buffer(view))
        )
        thread.start()
        thread.join()
    after = EventBatch.from_buffer(view)
    assert _address(inside) == _address(view)
    assert _address(writable) != _address(source)
    assert _address(elsewhere[0]) != _address(view)  # the block is per thread
    assert _address(after) != _address(view)
    assert inside.decode() == outside.decode()
