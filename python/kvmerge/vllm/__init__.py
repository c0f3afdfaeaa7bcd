"""vLLM 0.33.0 integration: ``KVMergeMultiConnector``.

Use it in place of vLLM's ``MultiConnector``::

    --kv-transfer-config '{"kv_connector": "KVMergeMultiConnector", ...}'

The name is registered with ``KVConnectorFactory`` by the ``vllm.general_plugins``
entry point (``register``), which vLLM calls in every process;
``"kv_connector_module_path": "kvmerge.vllm"`` works as well. This module stays
cheap to import: the connector and container classes load on first use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KVMergeMultiConnector
    from .container import KVMergeKVEvents, WorkerReport, WorkerReports

__all__ = [
    "CONNECTOR_NAME",
    "KVMergeKVEvents",
    "KVMergeMultiConnector",
    "WorkerReport",
    "WorkerReports",
    "register",
]

CONNECTOR_NAME = "KVMergeMultiConnector"

logger = logging.getLogger(__name__)

_LAZY = {
    "KVMergeMultiConnector": "connector",
    "KVMergeKVEvents": "container",
    "WorkerReport": "container",
    "WorkerReports": "container",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value
    return value


def register() -> None:
    """Register ``KVMergeMultiConnector`` with vLLM's ``KVConnectorFactory``.

    Idempotent: vLLM loads general plugins in every process, possibly more than
    once, and ``register_connector`` raises for a name it already has.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, f"{__name__}.connector", CONNECTOR_NAME
        )
    except ValueError:
        # Already registered: by an earlier call (fine) or by someone else.
        cls = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
        if f"{cls.__module__}.{cls.__qualname__}" != (
            f"{__name__}.connector.{CONNECTOR_NAME}"
        ):
            logger.warning(
                "kvmerge: connector name %r is already registered to %s.%s; "
                "use kv_connector_module_path='kvmerge.vllm' to select kvmerge's",
                CONNECTOR_NAME,
                cls.__module__,
                cls.__qualname__,
            )
