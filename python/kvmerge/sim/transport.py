"""A worker's output on its way to the scheduler, as vLLM 0.33.0's shm
``MessageQueue`` (``distributed/device_communicators/shm_broadcast.py``)
carries it.

``enqueue`` pickles like ``MessageQueue.enqueue``: a ``pickle.Pickler`` with
the highest protocol, a ``buffer_callback`` that keeps ``PickleBuffer``s under
1 MiB in line and sends larger ones out of band, and the queue's dispatch
table (``copyreg``'s, plus its CPU-tensor reducer). ``dequeue`` unpickles like
``MessageQueue.dequeue`` on a local reader: every out-of-band buffer is first
copied into a ``bytearray`` (it may outlive the ring slot), then
``pickle.loads(main, buffers=...)``. What is not emulated: the copy into the
shared-memory ring and the ring's synchronisation, the same for both paths,
and the zmq fallback for messages of 24 MiB and more.

Bytes are counted the same way for every path: the pickle stream plus the
out-of-band buffers (``Wire.nbytes``).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass
from pickle import PickleBuffer
from typing import Any

#: MessageQueue.enqueue: "In-line buffers smaller than 1MiB."
OOB_THRESHOLD = 1024 * 1024


def _dispatch_table() -> dict[Any, Any]:
    table = dict(copyreg.dispatch_table)
    try:
        import torch
        from vllm.distributed.device_communicators.shm_broadcast import (
            _reduce_tensor,
        )
    except ImportError:  # pragma: no cover - other vLLM versions
        return table
    table[torch.Tensor] = _reduce_tensor
    return table


_DISPATCH: dict[Any, Any] | None = None


@dataclass
class Wire:
    """One message: the pickle stream and its out-of-band buffers."""

    main: bytes
    oob: list[bytes]

    @property
    def nbytes(self) -> int:
        return len(self.main) + sum(len(b) for b in self.oob)


def enqueue(obj: Any) -> Wire:
    global _DISPATCH
    if _DISPATCH is None:
        _DISPATCH = _dispatch_table()
    oob: list[bytes] = []

    def callback(buf: PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < OOB_THRESHOLD:
            return True
        # The queue writes it into shared memory: one copy, as here.
        oob.append(bytes(raw))
        return False

    with io.BytesIO() as bio:
        pickler = pickle.Pickler(
            bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=callback
        )
        pickler.dispatch_table = _DISPATCH
        pickler.dump(obj)
        main = bio.getvalue()
    return Wire(main, oob)


def dequeue(wire: Wire) -> Any:
    return pickle.loads(wire.main, buffers=[bytearray(b) for b in wire.oob])


def shm_roundtrip(obj: Any) -> tuple[Any, int]:
    """``obj`` after the queue (``enqueue`` then ``dequeue``), and the number of
    buffers that went out of band."""
    wire = enqueue(obj)
    return dequeue(wire), len(wire.oob)
