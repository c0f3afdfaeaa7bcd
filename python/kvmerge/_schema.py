"""The vLLM event schema the compiled core encodes and decodes against.

Imported lazily by the extension on first use, so that `import kvmerge` stays
cheap and vLLM is imported only when events are.
"""

import msgspec
from msgspec import DecodeError, Raw
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)

# The encoder vLLM's ZmqEventPublisher uses: default settings.
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved | AllBlocksCleared])

__all__ = ["DECODER", "ENCODER", "EVENT_TYPES", "DecodeError", "Raw"]
