"""``KVMergeMultiConnector`` is configured as vLLM's ``MultiConnector``.

vLLM derives engine-wide settings from the transfer config by the connector's
*name*: ``KVTransferConfig.is_kv_producer`` / ``is_kv_consumer`` /
``uses_custom_mem_pool`` / ``has_connector`` and ``hisparse_host_pool_gib``
look at the children only when ``kv_connector == "MultiConnector"``, and so do
the factory's HMA check and several model and platform checks. A config naming
``"KVMergeMultiConnector"`` would get other roles and skip the children's
engine-level setup.

The name vLLM sees is the one thing to fix, so that is what changes: a
``KVTransferConfig`` naming ``"KVMergeMultiConnector"`` (with no module path, or
``kvmerge.vllm``'s) becomes ``kv_connector="MultiConnector"`` with
``kv_connector_module_path="kvmerge.vllm"``, the spelling that needs no patch
at all: vLLM loads a module path's class in priority to its registry, so it
builds ``kvmerge.vllm.MultiConnector`` (our class) while every name check sees
``"MultiConnector"``, in this vLLM release and the next.

``install`` does it in one place, ``KVTransferConfig.__post_init__``, and only
where the running vLLM needs it: it first compares, for probe configs, what
vLLM derives from each name, and leaves vLLM alone where they already agree
(which is also why a second call is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .log import get_logger

logger = get_logger(__name__)

#: kvmerge's own connector name (``kvmerge.vllm.CONNECTOR_NAME``).
CONNECTOR_NAME: Final = "KVMergeMultiConnector"
UPSTREAM_NAME: Final = "MultiConnector"
#: This package, whose ``MultiConnector`` is ``KVMergeMultiConnector``.
MODULE_PATH: Final = __name__.rpartition(".")[0]

_ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
# A child name vLLM checks for by has_connector, with a setting vLLM reads
# through the MultiConnector-only paths.
_PROBE_CHILD: Final = {
    "kv_connector": "HiSparseConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"custom_mem_pool": True, "host_pool_gib": 1},
}


def should_rename(kv_connector: str | None, module_path: str | None) -> bool:
    """Whether a transfer config means kvmerge's connector by its own name."""
    return kv_connector == CONNECTOR_NAME and module_path in (
        None,
        MODULE_PATH,
        f"{MODULE_PATH}.connector",
    )


def _derived(config: Any) -> tuple[Any, ...]:
    """What vLLM reads off a transfer config (each where this release has it)."""
    from vllm.config import kv_transfer

    values: list[Any] = [
        config.is_kv_producer,
        config.is_kv_consumer,
        config.has_connector(_PROBE_CHILD["kv_connector"]),
    ]
    uses_pool = getattr(config, "uses_custom_mem_pool", None)
    if uses_pool is not None:
        values.append(uses_pool())
    pool_gib = getattr(kv_transfer, "hisparse_host_pool_gib", None)
    if pool_gib is not None:
        values.append(pool_gib(config))
    return tuple(values)


def _probe_configs(cls: type, name: str) -> list[Any]:
    return [
        cls(
            kv_connector=name,
            kv_role=top,
            kv_connector_extra_config={
                "connectors": [{**_PROBE_CHILD, "kv_role": child}]
            },
        )
        for top in _ROLES
        for child in _ROLES
    ]


def names_agree(cls: type) -> bool:
    """Whether vLLM derives the same settings for ``"KVMergeMultiConnector"``
    as for ``"MultiConnector"`` over the same children."""
    ours = [_derived(c) for c in _probe_configs(cls, CONNECTOR_NAME)]
    upstream = [_derived(c) for c in _probe_configs(cls, UPSTREAM_NAME)]
    return ours == upstream


def install(cls: Any = None) -> bool:
    """Make ``KVTransferConfig`` (or ``cls``) configure ``KVMergeMultiConnector``
    as ``MultiConnector`` loaded from ``kvmerge.vllm``, if the names disagree.

    Returns whether it changed anything. Idempotent: once installed the names
    agree, and a vLLM that already treats them alike is left as it is.
    """
    if cls is None:
        from vllm.config import KVTransferConfig

        cls = KVTransferConfig
    if names_agree(cls):
        return False
    original: Callable[[Any], None] = cls.__post_init__

    def __post_init__(self: Any) -> None:
        original(self)
        if should_rename(self.kv_connector, self.kv_connector_module_path):
            self.kv_connector = UPSTREAM_NAME
            self.kv_connector_module_path = MODULE_PATH

    __post_init__.__doc__ = original.__doc__
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__
    if not names_agree(cls):
        cls.__post_init__ = original
        logger.warning(
            "kvmerge: this vLLM derives other settings for kv_connector %r than "
            "for %r even when configured as the latter; name %r with "
            "kv_connector_module_path %r",
            CONNECTOR_NAME,
            UPSTREAM_NAME,
            UPSTREAM_NAME,
            MODULE_PATH,
        )
        return False
    logger.debug(
        "kvmerge: kv_connector %r is configured as %r from %r",
        CONNECTOR_NAME,
        UPSTREAM_NAME,
        MODULE_PATH,
    )
    return True
