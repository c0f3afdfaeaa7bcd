"""The engine's configuration: a real ``VllmConfig`` for a model without weights.

vLLM's ``Scheduler`` needs a ``ModelConfig``, which reads a Hugging Face
``config.json``: a tiny Llama (2 layers, hidden size 64) written to a folder
is enough, offline, since no forward pass is computed and no tokenizer is
loaded (prompts are token ids). The KV cache has one full-attention group of
``num_blocks`` blocks: small, so that blocks are evicted and requests
preempted.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

#: Tokens per KV block (vLLM's default on GPUs).
BLOCK_SIZE: Final = 16
VOCAB: Final = 1000
MAX_MODEL_LEN: Final = 1024
#: The tiny model's shape: what the KV cache spec derives from.
_LAYERS: Final = 2
_HEADS: Final = 8
_HIDDEN: Final = 64

_CONFIG_JSON: Final = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": _HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": _HEADS,
    "num_key_value_heads": _HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def model_dir(parent: str | os.PathLike[str] | None = None) -> Path:
    """A folder holding only the tiny model's ``config.json``."""
    path = Path(tempfile.mkdtemp(prefix="kvmerge-model-", dir=parent))
    (path / "config.json").write_text(json.dumps(_CONFIG_JSON))
    return path


def engine_config(
    model: Path,
    children: Sequence[Mapping[str, Any]],
    *,
    world_size: int,
    num_blocks: int,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    connector: str = "KVMergeMultiConnector",
    connector_extra: Mapping[str, Any] | None = None,
    kv_events: Any = None,
) -> Any:
    """``VllmConfig`` of an engine with TP ``world_size``, prefix caching, the
    given MultiConnector children, and ``kv_events`` (a ``KVEventsConfig``, or
    None for events off)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    extra = {"connectors": [dict(c) for c in children], **(connector_extra or {})}
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_module_path="kvmerge.vllm",
            kv_connector_extra_config=extra,
        ),
        kv_events_config=kv_events or KVEventsConfig(enable_kv_cache_events=False),
    )


def kv_cache_config(num_blocks: int) -> Any:
    """One full-attention KV cache group over the tiny model's layers."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=_HEADS,
        head_size=_HIDDEN // _HEADS,
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(_LAYERS)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
