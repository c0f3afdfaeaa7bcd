"""The plugin's loggers live under vLLM's ``vllm`` logger.

vLLM's logging setup (``vllm.logger``: ``configure_logging``, run by ``vllm
serve`` and by every engine process, from ``--log-level`` / ``LoggingConfig``
or ``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``,
``VLLM_LOGGING_CONFIG_PATH``) gives the ``vllm`` logger its handler, format
and level and stops it propagating. A logger outside that hierarchy gets none
of it: its INFO lines are dropped and its warnings come out bare, on another
stream. So every module of ``kvmerge.vllm`` logs as ``vllm.kvmerge.<module>``
(``kvmerge.vllm.connector`` as ``vllm.kvmerge.connector``, the package itself
as ``vllm.kvmerge``), through ``get_logger``. The rest of kvmerge (the CLI,
the demo, the benchmarks) keeps its ``kvmerge.*`` loggers.

``logging.getLogger`` rather than ``vllm.logger.init_logger``: the package
must stay cheap to import (``import vllm`` takes seconds), and the plugin does
not use ``init_logger``'s ``*_once`` methods.
"""

from __future__ import annotations

import logging
from typing import Final

#: The logger every ``kvmerge.vllm`` module logs under.
ROOT: Final = "vllm.kvmerge"
_PACKAGE: Final = __name__.rpartition(".")[0]  # "kvmerge.vllm"


def logger_name(module: str) -> str:
    """``vllm.kvmerge.<module>`` for a module of ``kvmerge.vllm``."""
    if module == _PACKAGE:
        return ROOT
    prefix = _PACKAGE + "."
    if not module.startswith(prefix):
        raise ValueError(f"{module!r} is not a module of {_PACKAGE}")
    return f"{ROOT}.{module[len(prefix) :]}"


def get_logger(module: str) -> logging.Logger:
    """The logger of a ``kvmerge.vllm`` module: ``get_logger(__name__)``."""
    return logging.getLogger(logger_name(module))
