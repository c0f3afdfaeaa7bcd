"""Hypothesis settings profiles (select one with HYPOTHESIS_PROFILE).

The default "ci" profile keeps the core suite well under two minutes on a
two-core machine; "dev" is quicker still, "thorough" is for hunting bugs.
Deadlines are off: the first call of a test imports vLLM and torch.
"""

import logging
import os

import pytest
from hypothesis import HealthCheck, settings

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=150, **_common)
settings.register_profile("dev", max_examples=30, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def vllm_caplog(caplog):
    """caplog for the plugin's loggers (``vllm.kvmerge.*``), whether or not
    vLLM's logging setup ran in this process: it stops the ``vllm`` logger
    propagating to the root logger, where caplog listens. The records reach
    caplog's handler straight from ``vllm.kvmerge``, once."""
    logger = logging.getLogger("vllm.kvmerge")
    saved = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@pytest.fixture(scope="module")
def bus():
    """A real ``ZmqEventPublisher`` and a SUB socket reading it, per module
    (support.vllm_harness.Bus; imported here only when a test asks for one)."""
    from support.vllm_harness import Bus

    b = Bus()
    yield b
    b.close()


@pytest.fixture(scope="module")
def registered():
    """kvmerge's vLLM plugin registered, as vLLM's plugin loader does in every
    process (``register`` is idempotent)."""
    from kvmerge.vllm import register

    register()


@pytest.fixture(scope="session")
def dynamo_python():
    """The interpreter of the venv holding NVIDIA Dynamo's indexer
    (``.ci/setup-dynamo.sh``; ``.ci/test`` sets ``KVMERGE_DYNAMO_PYTHON``).
    Missing is a failure, not a skip: the router check is part of the suite."""
    python = os.environ.get("KVMERGE_DYNAMO_PYTHON")
    if not python or not os.path.exists(python):
        pytest.fail(
            "KVMERGE_DYNAMO_PYTHON must name the interpreter of the venv made "
            "by .ci/setup-dynamo.sh (its bin/python); .ci/test sets it"
        )
    return python
