"""The vLLM event schema the compiled core encodes and decodes against.

Imported lazily by the extension on first use, so that `import kvmerge` stays
cheap and vLLM is imported only when events are.
"""

from typing import Any

import msgspec
from msgspec import DecodeError, Raw
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)

# The encoder vLLM's ZmqEventPublisher uses: default settings.
ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved | AllBlocksCleared])


def _tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def decode(payload: Any) -> list[Any]:
    """msgspec's decode, with `extra_keys` entries rebuilt as vLLM makes them.

    `extra_keys` is `list[tuple[Any, ...] | None]`: msgspec restores each entry
    as a tuple, but the `(mm_identifier, offset)` pairs nested inside come back
    as lists (msgpack has one array type), and vLLM's `==` tells them apart.
    """
    events = _DECODER.decode(payload)
    for event in events:
        if type(event) is BlockStored and event.extra_keys:
            event.extra_keys = [_tuples(k) for k in event.extra_keys]
    return events


__all__ = ["ENCODER", "EVENT_TYPES", "DecodeError", "Raw", "decode"]
