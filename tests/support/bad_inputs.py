"""Every bad input tried on kvmerge's Python surface, and what the caller gets.

Prints the table of docs/robustness.md ("What a bad input gets") from a real
run; ``test_fuzz_surface.py`` checks that the document shows this output.

    python tests/support/bad_inputs.py > /tmp/table.md

Each case is a call that must be refused: the table gives the exception's
class (and the standard class it also is) and its exact message. A case that
is accepted, or that fails with anything but a kvmerge error or a
``TypeError``/``IndexError`` for a wrong argument type, is printed as such
and makes ``check()`` fail.

``stored`` builds the valid ``BlockStored`` the core tests start from.
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge
from kvmerge import EventBatch, Merger


def stored(*hashes: int | bytes, **fields: Any) -> BlockStored:
    """A valid store of block(s) ``hashes`` (default: 1), two token ids in a
    16-token block, on the GPU; ``fields`` replace any of its fields."""
    base = dict(
        block_hashes=list(hashes or [1]),
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return BlockStored(**{**base, **fields})


class OtherEvent(msgspec.Struct, tag=True):
    block_hashes: list[int]


class MyRemoved(BlockRemoved):
    """Tagged "MyRemoved": a subclass tagged as its base would be accepted
    (its extra fields travel verbatim, see docs/merge-rules.md)."""


def nested(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def recursive() -> list:
    x: list = []
    x.append(x)
    return x


def good() -> bytes:
    return bytes(
        kvmerge.encode([stored(), BlockRemoved(block_hashes=[2], medium=None)])
    )


def edit(at: int, value: int) -> bytes:
    b = bytearray(good())
    b[at] = value
    return bytes(b)


def flip_payload_bit() -> bytes:
    b = bytearray(good())
    b[-3] ^= 0x01
    return bytes(b)


def oob_pickle_with(buffer: bytes) -> Callable[[], object]:
    """Adds a batch unpickled from `buffer`: unpickling never raises (it runs
    in vLLM's message queue); the batch is invalid, and adding it raises."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(kvmerge.encode([stored()]), 5, buffer_callback=buffers.append)
    return lambda: Merger(2).add(0, pickle.loads(data, buffers=[bytearray(buffer)]))


def oob_loads(buffer: bytes) -> EventBatch:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(kvmerge.encode([stored()]), 5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[bytearray(buffer)])


def merger_then(
    call: Callable[[Merger], object], *args, **kwargs
) -> Callable[[], object]:
    def run() -> object:
        m = Merger(*args, **kwargs)
        m.add(0, kvmerge.encode([stored()]))
        return call(m)

    return run


B = kvmerge.encode


def big_removal(value: int = 2**64 - 1) -> BlockRemoved:
    """One BlockRemoved of about 4 MiB (466,034 hashes of 9 bytes): 1,023 of
    them fit one step's output (4 GiB), 1,024 do not."""
    return BlockRemoved(block_hashes=[value] * 466_034, medium=None)


def past_the_output_limit() -> None:
    """Issue 12's case: rank 0 of 2 adds the same 4 MiB batch every step
    under rule "all" (rank 1 silent, nothing expires): the 1,024th would let
    the pending reports publish over 4 GiB in one step."""
    m = Merger(2, max_pending_steps=1024)
    big = B([big_removal()])
    for _ in range(1023):
        m.add(0, big)
        m.finish_step_raw()
    m.add(0, big)


def lean() -> EventBatch:
    """Rank 0's batch in a world of 4: most events' bytes left to others."""
    batch = B(
        [BlockRemoved(block_hashes=[h], medium=None) for h in range(40)],
        rank=0,
        world_size=4,
    )
    assert batch.uncarried > 0
    return batch


CASES: list[tuple[str, Callable[[], object]]] = [
    # -- encode: not a list of events
    ("encode('BlockStored')", lambda: B("BlockStored")),
    ("encode(b'...')", lambda: B(b"\x91\x80")),
    ("encode(42)", lambda: B(42)),
    (
        "encode(AllBlocksCleared())  # an event, not a list",
        lambda: B(AllBlocksCleared()),
    ),
    (
        "encode([{'type': 'AllBlocksCleared'}])",
        lambda: B([{"type": "AllBlocksCleared"}]),
    ),
    ("encode([None])", lambda: B([None])),
    ("encode([AllBlocksCleared])  # the class", lambda: B([AllBlocksCleared])),
    (
        "encode([OtherEvent([1])])  # another msgspec struct",
        lambda: B([OtherEvent([1])]),
    ),
    (
        "encode([MyRemoved([1], None)])  # a subclass with its own tag",
        lambda: B([MyRemoved(block_hashes=[1], medium=None)]),
    ),
    # -- encode: vLLM events with wrong field values
    ("block_hashes=(1, 2)  # a tuple", lambda: B([stored(block_hashes=(1, 2))])),
    ("block_hashes=None", lambda: B([stored(block_hashes=None)])),
    ("block_hashes=[1.5]", lambda: B([stored(block_hashes=[1.5])])),
    ("block_hashes=['a']", lambda: B([stored(block_hashes=["a"])])),
    ("block_hashes=[2**64]", lambda: B([stored(block_hashes=[2**64])])),
    ("block_hashes=[-(2**63) - 1]", lambda: B([stored(block_hashes=[-(2**63) - 1])])),
    ("parent_block_hash=1.0", lambda: B([stored(parent_block_hash=1.0)])),
    ("token_ids=[True]", lambda: B([stored(token_ids=[True])])),
    ("token_ids=[float('nan')]", lambda: B([stored(token_ids=[float("nan")])])),
    ("token_ids=range(3)", lambda: B([stored(token_ids=range(3))])),
    ("block_size='16'", lambda: B([stored(block_size="16")])),
    ("block_size=2**70", lambda: B([stored(block_size=2**70)])),
    ("medium=3", lambda: B([stored(medium=3)])),
    ("lora_name=b'x'", lambda: B([stored(lora_name=b"x")])),
    ("group_idx='0'", lambda: B([stored(group_idx="0")])),
    ("extra_keys=[['a', 1]]  # list entry", lambda: B([stored(extra_keys=[["a", 1]])])),
    (
        "extra_keys=(('a',),)  # tuple of entries",
        lambda: B([stored(extra_keys=(("a",),))]),
    ),
    ("extra_keys=[(object(),)]", lambda: B([stored(extra_keys=[(object(),)])])),
    (
        "extra_keys=[(x,)] with x = [x]",
        lambda: B([stored(extra_keys=[(recursive(),)])]),
    ),
    (
        "extra_keys=[(40 nested lists,)]",
        lambda: B([stored(extra_keys=[(nested(40),)])]),
    ),
    ("lookahead_token_ids=[(1,)]", lambda: B([stored(lookahead_token_ids=[(1,)])])),
    ("lookahead_token_ids=[[1.0]]", lambda: B([stored(lookahead_token_ids=[[1.0]])])),
    (
        "BlockRemoved(block_hashes=[1], medium=b'GPU')",
        lambda: B([BlockRemoved(block_hashes=[1], medium=b"GPU")]),
    ),
    # -- received buffers
    ("from_buffer(b'')", lambda: EventBatch.from_buffer(b"")),
    ("from_buffer(32 bytes of 'x')", lambda: EventBatch.from_buffer(b"x" * 32)),
    (
        "from_buffer(msgspec bytes of events)",
        lambda: EventBatch.from_buffer(msgspec.msgpack.encode([stored()]) * 2),
    ),
    ("from_buffer: version byte 3 (older)", lambda: EventBatch.from_buffer(edit(4, 3))),
    ("from_buffer: version byte 5", lambda: EventBatch.from_buffer(edit(4, 5))),
    ("from_buffer: reserved byte set", lambda: EventBatch.from_buffer(edit(6, 1))),
    ("from_buffer: event count + 1", lambda: EventBatch.from_buffer(edit(8, 3))),
    ("from_buffer: last byte cut", lambda: EventBatch.from_buffer(good()[:-1])),
    ("from_buffer: one byte appended", lambda: EventBatch.from_buffer(good() + b"\0")),
    (
        "from_buffer: one payload bit flipped",
        lambda: EventBatch.from_buffer(flip_payload_bit()),
    ),
    ("from_buffer('text')", lambda: EventBatch.from_buffer("text")),
    ("from_buffer(None)", lambda: EventBatch.from_buffer(None)),
    (
        "from_buffer(memoryview(...)[::2])",
        lambda: EventBatch.from_buffer(memoryview(good())[::2]),
    ),
    (
        "from_buffer(array('I', ...))",
        lambda: EventBatch.from_buffer(array.array("I", good()[:24])),
    ),
    (
        "add(0, pickle.loads(batch, buffers=[damaged]))",
        oob_pickle_with(flip_payload_bit()),
    ),
    ("add(0, pickle.loads(batch, buffers=[b'']))", oob_pickle_with(b"")),
    (
        "decode() of pickle.loads(batch, buffers=[b''])",
        lambda: oob_loads(b"").decode(),
    ),
    # -- Merger settings
    ("Merger(0)", lambda: Merger(0)),
    ("Merger(-3)", lambda: Merger(-3)),
    ("Merger(2**31)", lambda: Merger(2**31)),
    ("Merger(2**70)", lambda: Merger(2**70)),
    ("Merger('2')", lambda: Merger("2")),
    ("Merger(2.0)", lambda: Merger(2.0)),
    ("Merger(2, 'majority')", lambda: Merger(2, "majority")),
    ("Merger(2, 'quorum')", lambda: Merger(2, "quorum")),
    ("Merger(2, 'quorum', [1, 0])", lambda: Merger(2, "quorum", [1, 0])),
    ("Merger(2, 'quorum', [2**40])", lambda: Merger(2, "quorum", [2**40])),
    ("Merger(2, 'quorum', ['1'])", lambda: Merger(2, "quorum", ["1"])),
    ("Merger(2, 'all', [1])", lambda: Merger(2, "all", [1])),
    ("Merger(2, 'any', [1])", lambda: Merger(2, "any", [1])),
    ("Merger(2, max_pending_steps=-1)", lambda: Merger(2, max_pending_steps=-1)),
    ("Merger(2, max_pending_steps=2**64)", lambda: Merger(2, max_pending_steps=2**64)),
    # -- Merger.add (rank 0 already added in step 0)
    ("add(2, batch) in a world of 2", merger_then(lambda m: m.add(2, B([])), 2)),
    ("add(-1, batch)", merger_then(lambda m: m.add(-1, B([])), 2)),
    ("add(2**70, batch)", merger_then(lambda m: m.add(2**70, B([])), 2)),
    ("add(0, batch) again in the step", merger_then(lambda m: m.add(0, B([])), 2)),
    (
        "add_all([(1, batch), (1, batch)])",
        merger_then(lambda m: m.add_all([(1, B([])), (1, B([]))]), 2),
    ),
    ("add(1, [events])  # not a batch", merger_then(lambda m: m.add(1, [stored()]), 2)),
    (
        "quorum [1]: add(1, BlockStored group_idx=1)",
        merger_then(lambda m: m.add(1, B([stored(group_idx=1)])), 2, "quorum", [1]),
    ),
    (
        "quorum [1]: add(1, BlockStored group_idx=-1)",
        merger_then(lambda m: m.add(1, B([stored(group_idx=-1)])), 2, "quorum", [1]),
    ),
    (
        "encode for rank 0 of 4, added to a Merger(2)",
        lambda: Merger(2).add(0, lean()),
    ),
    (
        "add(0, 4 MiB batch) for the 1,024th step, nothing completing",
        past_the_output_limit,
    ),
    # -- encode with a rank: bytes other ranks carry are not carried here
    ("encode(events, rank=0)  # no world_size", lambda: B([stored()], rank=0)),
    (
        "encode(events, rank=4, world_size=4)",
        lambda: B([stored()], rank=4, world_size=4),
    ),
    (
        "encode(events, rank=0, world_size=4, rule='quorum')",
        lambda: B([stored()], rank=0, world_size=4, rule="quorum"),
    ),
    ("decode() of such a batch", lambda: lean().decode()),
    ("raw() of such a batch", lambda: lean().raw()),
    # -- EventBatch.take
    ("take([5]) of a 1-event batch", lambda: B([stored()]).take([5])),
    ("take([2**70])", lambda: B([stored()]).take([2**70])),
]

# Exceptions a caller may get for a wrong *argument type* (Python's usual);
# everything else must be one of kvmerge's own classes.
ARGUMENT_ERRORS = (TypeError, IndexError)


def outcome(call: Callable[[], object]) -> tuple[str, str, bool]:
    """(exception column, message, acceptable)."""
    try:
        call()
    except BaseException as e:  # a PanicException is a BaseException
        cls = type(e)
        std = [b.__name__ for b in cls.__mro__[1:] if b.__module__ == "builtins"]
        kind = (
            cls.__name__
            if cls.__module__ == "builtins"
            else f"{cls.__name__} ({std[0]})"
        )
        ok = isinstance(e, kvmerge.KVMergeError) or (
            isinstance(e, ARGUMENT_ERRORS) and isinstance(e, Exception)
        )
        return kind, str(e), ok
    return "accepted", "", False


def table() -> str:
    rows = ["| # | bad input | exception | message |", "| --- | --- | --- | --- |"]
    for i, (label, call) in enumerate(CASES, 1):
        kind, message, _ = outcome(call)
        cell = message.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {i} | `{label}` | {kind} | {cell} |")
    return "\n".join(rows) + "\n"


def check() -> list[str]:
    """The cases that did not get an acceptable refusal."""
    return [label for label, call in CASES if not outcome(call)[2]]


if __name__ == "__main__":
    print(table(), end="")
    bad = check()
    if bad:
        raise SystemExit(f"not refused as they should be: {bad}")
