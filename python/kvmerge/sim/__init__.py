"""The simulation harness: vLLM's real scheduler loop around kvmerge, no GPU.

One harness for ``kvmerge demo``, the tests and the benchmarks:

* ``model``: a ``VllmConfig`` for a tiny model without weights;
* ``requests``: prompts with shared prefixes, arriving over time;
* ``children``: child connectors whose events follow what the scheduler did
  (an LRU tier per rank, with per-rank faults), and ``NoTransfer``;
* ``tier``: the tier and the faults, without vLLM;
* ``worker``: a TP rank's model runner (the forward pass simulated);
* ``executor``: vLLM's own ``MultiprocExecutor`` over workers of that kind,
  each in its own process behind vLLM's shm ``MessageQueue``s;
* ``engine``: vLLM's ``Scheduler`` and the workers (in processes, or in this
  one), step by step;
* ``run``, ``stream``: a whole run read back by a subscriber, and its checks;
* ``transport``: the ``MessageQueue``'s pickling, for in-process workers;
* ``expect``: what the stream must be, from the reference model of the rules;
* ``dynamo``, ``routing``: NVIDIA Dynamo's KV indexer as a subscriber, and
  what it must answer.

Importing this package imports no vLLM; its modules do.
"""

from typing import Final

from kvmerge.vllm.families import available_names

#: The simulated connector families (``kvmerge.sim.children.FAMILY``) of the
#: running vLLM, in their default order: the families of
#: ``kvmerge.vllm.families`` whose module it has (found without importing it).
FAMILY_NAMES: Final = available_names()
