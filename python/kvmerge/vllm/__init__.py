"""vLLM integration: ``KVMergeMultiConnector``.

Use it in place of vLLM's ``MultiConnector``, by either spelling::

    --kv-transfer-config '{"kv_connector": "KVMergeMultiConnector", ...}'
    --kv-transfer-config '{"kv_connector": "MultiConnector",
                           "kv_connector_module_path": "kvmerge.vllm", ...}'

The second is what vLLM runs either way (``alias``): vLLM loads
``kvmerge.vllm.MultiConnector`` (this package's class) from the module path,
and every setting vLLM derives from the name ``"MultiConnector"`` applies. The
``vllm.general_plugins`` entry point (``register``), which vLLM calls in every
process, registers the first name and makes it mean the second. This module
stays cheap to import: the connector and container classes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .alias import CONNECTOR_NAME
from .log import get_logger

if TYPE_CHECKING:
    from .connector import KVMergeMultiConnector
    from .connector import KVMergeMultiConnector as MultiConnector
    from .container import KVMergeKVEvents, WorkerOutput, WorkerOutputs

__all__ = [
    "CONNECTOR_NAME",
    "KVMergeKVEvents",
    "KVMergeMultiConnector",
    "MultiConnector",
    "WorkerOutput",
    "WorkerOutputs",
    "register",
]

logger = get_logger(__name__)

# name -> (submodule, attribute)
_LAZY = {
    CONNECTOR_NAME: ("connector", CONNECTOR_NAME),
    # What vLLM loads for kv_connector "MultiConnector" with this module path.
    "MultiConnector": ("connector", CONNECTOR_NAME),
    "KVMergeKVEvents": ("container", "KVMergeKVEvents"),
    "WorkerOutput": ("container", "WorkerOutput"),
    "WorkerOutputs": ("container", "WorkerOutputs"),
}


def __getattr__(name: str) -> Any:
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module_name, attribute = found
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), attribute)
    globals()[name] = value
    return value


def register() -> None:
    """Register ``KVMergeMultiConnector`` with vLLM's ``KVConnectorFactory``.

    Also makes a transfer config naming it mean ``MultiConnector`` from this
    module (``alias.install``), and warns if the running vLLM is outside the
    supported range. Idempotent: vLLM loads general plugins in every process,
    possibly more than once, and ``register_connector`` raises for a name it
    already has.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from . import alias, versions

    versions.warn_if_unsupported()
    try:
        alias.install()
    except Exception:
        # A vLLM whose KVTransferConfig no longer takes the probe configs:
        # the connector still loads; only the name alias is missing.
        logger.warning(
            "kvmerge: could not check how this vLLM treats kv_connector %r; "
            "name 'MultiConnector' with kv_connector_module_path %r to be sure "
            "vLLM treats it as MultiConnector",
            CONNECTOR_NAME,
            __name__,
            exc_info=True,
        )

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
