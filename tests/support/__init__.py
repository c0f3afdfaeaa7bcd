"""Machinery the tests share: Hypothesis strategies, hostile inputs, child
connectors that emit vLLM's real containers, the vLLM harness (a cluster of
connectors behind the shm queue, a real publisher), the shm-queue worker
script and the Ray actors. Imported as ``support.*`` (``tests/`` is on
``sys.path``: pyproject's ``pythonpath``; the worker processes get it in
``PYTHONPATH``)."""
