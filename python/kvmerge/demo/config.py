"""The demo's vLLM configuration: ``KVMergeMultiConnector`` over demo children.

A real ``VllmConfig`` on CPU: TP = the number of workers, a
``KVTransferConfig`` naming ``KVMergeMultiConnector`` with one demo child per
lane, and KV events enabled. Workers hold a copy with their own
``parallel_config.rank``, as vLLM's ``WorkerBase`` sets it.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.config import (
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_cache_interface import KVCacheConfig

from .connectors import EXTRA_KEY
from .workload import CONNECTOR_NAMES, Settings

MODULE = "kvmerge.demo.connectors"


def child_entry(settings: Settings, lane: int, kind: str) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_NAMES[kind],
        "kv_role": "kv_both",
        "kv_connector_module_path": MODULE,
        "kv_connector_extra_config": {
            EXTRA_KEY: {"settings": settings.to_extra(), "lane": lane, "kind": kind}
        },
    }


def _vllm_config(settings: Settings, ktc: KVTransferConfig, rank: int) -> VllmConfig:
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=settings.workers),
        kv_transfer_config=ktc,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True),
    )
    return worker_config(cfg, rank) if rank else cfg


def worker_config(cfg: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker holds: its own ``parallel_config.rank``, as vLLM's
    ``WorkerBase`` sets it (the rest shared with the scheduler's)."""
    wcfg = copy.copy(cfg)
    wcfg.parallel_config = copy.copy(cfg.parallel_config)
    wcfg.parallel_config.rank = rank
    return wcfg


def kvmerge_config(
    settings: Settings, *, max_pending_steps: int, rank: int = 0
) -> VllmConfig:
    """``KVMergeMultiConnector`` with one demo child per lane."""
    ktc = KVTransferConfig(
        kv_connector="KVMergeMultiConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvmerge.vllm",
        kv_connector_extra_config={
            "max_pending_steps": max_pending_steps,
            "connectors": [
                child_entry(settings, lane, kind)
                for lane, kind in enumerate(settings.kinds)
            ],
        },
    )
    return _vllm_config(settings, ktc, rank)


def single_config(settings: Settings, lane: int, *, rank: int = 0) -> VllmConfig:
    """One demo child as the only connector (vLLM's own path, per child)."""
    entry = child_entry(settings, lane, settings.kinds[lane])
    ktc = KVTransferConfig(**entry)
    return _vllm_config(settings, ktc, rank)


def kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[])


def build(cfg: VllmConfig, role: Any) -> Any:
    return KVConnectorFactory.create_connector(cfg, role, kv_cache_config())
