"""The simulation harness: vLLM's real scheduler loop around kvmerge, no GPU.

One harness for ``kvmerge demo``, the tests and the benchmarks:

* ``model``: a ``VllmConfig`` for a tiny model without weights;
* ``requests``: prompts with shared prefixes, arriving over time;
* ``children``: child connectors whose events follow what the scheduler did
  (an LRU tier per rank, with per-rank faults), and ``NoTransfer``;
* ``tier``: the tier and the faults, without vLLM;
* ``worker``: a TP rank's model runner (the forward pass simulated), in this
  process or in its own behind vLLM's shm ``MessageQueue``;
* ``engine``: vLLM's ``Scheduler`` and the workers, step by step;
* ``transport``: the ``MessageQueue``'s pickling, for in-process workers;
* ``expect``: what the stream must be, from the reference model of the rules;
* ``dynamo``: NVIDIA Dynamo's KV indexer as a subscriber.

Importing this package imports no vLLM; its modules do.
"""

from typing import Final

#: The simulated connector families (``kvmerge.sim.children.FAMILY``), in
#: their default order.
FAMILIES: Final = ("lmcache", "mooncake", "umbp")
