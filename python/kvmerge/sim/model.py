"""The engine's configuration: a real ``VllmConfig`` for a model without weights.

vLLM's ``Scheduler`` needs a ``ModelConfig``, which reads a Hugging Face
``config.json``: a tiny Llama (2 layers, hidden size 64) written to a folder
is enough, offline, since no forward pass is computed and no tokenizer is
loaded (prompts are token ids). The KV cache has one full-attention group of
``num_blocks`` blocks: small, so that blocks are evicted and requests
preempted.

Connectors alone (the plugin tests, ``python -m benches.compare``) need no model:
``connector_config`` is a ``VllmConfig`` on ``DeviceConfig("cpu")`` with a
``KVTransferConfig`` over the given children, ``worker_config`` a rank's copy
of it, and ``create_connector`` builds a connector from one, as vLLM's
``KVConnectorFactory`` does.

The real ``vllm serve`` (``kvmerge.sim.server``) computes a forward pass, with
random weights (``--load-format dummy``): ``served_model_dir`` writes a tiny
Llama whose head size vLLM's CPU attention supports, and a tokenizer made here
(one word per token id, ``word``), so that text prompts and vLLM's own
benchmark client work offline.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

#: Tokens per KV block (vLLM's default on GPUs).
BLOCK_SIZE: Final = 16
#: kvmerge's connector, and the module vLLM's factory loads it from.
CONNECTOR: Final = "KVMergeMultiConnector"
MODULE_PATH: Final = "kvmerge.vllm"
#: The role of every connector here: it may save and load.
KV_ROLE: Final = "kv_both"
#: The blocks of the KV cache config of a connector without a model.
_CONNECTOR_BLOCKS: Final = 16
VOCAB: Final = 1000
MAX_MODEL_LEN: Final = 1024
#: The tiny model's shape (its heads: a multiple of the TP size).
_LAYERS: Final = 2
_HEADS: Final = 8
_HEAD_SIZE: Final = 8

_CONFIG_JSON: Final = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "intermediate_size": 128,
    "num_hidden_layers": _LAYERS,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def model_dir(
    parent: str | os.PathLike[str] | None = None, world_size: int = 1
) -> Path:
    """A folder holding only the tiny model's ``config.json``, with as many
    attention heads as TP over ``world_size`` ranks needs (a multiple of it)."""
    heads = math.lcm(_HEADS, world_size)
    config = {
        **_CONFIG_JSON,
        "hidden_size": heads * _HEAD_SIZE,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
    }
    path = Path(tempfile.mkdtemp(prefix="kvmerge-model-", dir=parent))
    (path / "config.json").write_text(json.dumps(config))
    return path


def engine_config(
    model: Path,
    children: Sequence[Mapping[str, Any]],
    *,
    world_size: int,
    num_blocks: int,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    connector: str = CONNECTOR,
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
        kv_transfer_config=_transfer_config(
            children, connector, MODULE_PATH, connector_extra or {}
        ),
        kv_events_config=kv_events or KVEventsConfig(enable_kv_cache_events=False),
    )


#: The served model's head size: vLLM's CPU attention kernels take 32 and up.
_SERVED_HEAD_SIZE: Final = 32
_SERVED_HEADS: Final = 4
#: The tokenizer's special tokens; word ``i`` (``word(i)``) follows them.
_SPECIAL: Final = ("<unk>", "<s>", "</s>")
#: The served tokenizer's words (``word(i)`` for ``i`` below it): its
#: vocabulary but the special tokens.
WORDS: Final = VOCAB - len(_SPECIAL)


def word(i: int) -> str:
    """The word of the served tokenizer for ``i`` in ``range(WORDS)``: one
    token each, whitespace between them."""
    return f"w{i}"


def served_model_dir(
    parent: str | os.PathLike[str] | None = None, world_size: int = 1
) -> Path:
    """A folder for ``vllm serve --load-format dummy``: the tiny Llama's
    ``config.json`` (heads a multiple of ``world_size``) and a word-level
    tokenizer over its vocabulary, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    heads = math.lcm(_SERVED_HEADS, world_size)
    config = {
        **_CONFIG_JSON,
        "hidden_size": heads * _SERVED_HEAD_SIZE,
        "intermediate_size": 2 * heads * _SERVED_HEAD_SIZE,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": _SERVED_HEAD_SIZE,
    }
    path = Path(tempfile.mkdtemp(prefix="kvmerge-served-", dir=parent))
    (path / "config.json").write_text(json.dumps(config))
    vocab = {t: i for i, t in enumerate(_SPECIAL)}
    vocab.update((word(i), len(_SPECIAL) + i) for i in range(WORDS))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=_SPECIAL[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=_SPECIAL[0],
        bos_token=_SPECIAL[1],
        eos_token=_SPECIAL[2],
        model_max_length=MAX_MODEL_LEN,
    ).save_pretrained(path)
    return path


def _transfer_config(
    children: Sequence[Mapping[str, Any]] | None,
    connector: str,
    module_path: str | None,
    extra: Mapping[str, Any],
) -> KVTransferConfig:
    """A ``KVTransferConfig`` of ``connector`` (role ``KV_ROLE``) over the
    ``children`` entries (None: no ``connectors`` key), ``extra`` beside them."""
    from vllm.config import KVTransferConfig

    entries = {} if children is None else {"connectors": [dict(c) for c in children]}
    return KVTransferConfig(
        kv_connector=connector,
        kv_role=KV_ROLE,
        kv_connector_module_path=module_path,
        kv_connector_extra_config={**entries, **extra},
    )


def child_entry(
    connector: str, module_path: str | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A ``connectors`` entry of a ``MultiConnector`` config: ``connector``
    from ``module_path``, role ``KV_ROLE``, ``extra`` its settings."""
    return {
        "kv_connector": connector,
        "kv_role": KV_ROLE,
        "kv_connector_module_path": module_path,
        "kv_connector_extra_config": dict(extra or {}),
    }


def connector_config(
    children: Sequence[Mapping[str, Any]] | None,
    *,
    tp: int = 1,
    pp: int = 1,
    connector: str = CONNECTOR,
    module_path: str | None = MODULE_PATH,
    kv_events: bool = True,
    **extra: Any,
) -> VllmConfig:
    """``VllmConfig`` for connectors without a model (``DeviceConfig("cpu")``),
    TP ``tp`` and PP ``pp``: its ``KVTransferConfig`` names ``connector``, from
    ``module_path`` (None: by its registered name), over the ``children``
    entries (None: ``connector`` is a child itself, ``extra`` its settings),
    with ``extra`` in ``kv_connector_extra_config``; KV cache events on when
    ``kv_events``."""
    from vllm.config import DeviceConfig, KVEventsConfig, ParallelConfig, VllmConfig

    ktc = _transfer_config(children, connector, module_path, extra)
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp
        ),
        kv_transfer_config=ktc,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events),
    )


def worker_config(cfg: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker process holds: a shallow copy of ``cfg`` with its
    own ``parallel_config.rank`` (what vLLM's ``WorkerBase`` sets)."""
    wcfg = copy.copy(cfg)
    wcfg.parallel_config = copy.copy(cfg.parallel_config)
    wcfg.parallel_config.rank = rank
    return wcfg


def create_connector(cfg: VllmConfig, role: Any, kv_cache: Any = None) -> Any:
    """``KVConnectorFactory.create_connector`` of ``role`` (``KVConnectorRole``)
    over ``kv_cache``, by default a ``KVCacheConfig`` without layers."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_cache_interface import KVCacheConfig

    if kv_cache is None:
        kv_cache = KVCacheConfig(
            num_blocks=_CONNECTOR_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[]
        )
    return KVConnectorFactory.create_connector(cfg, role, kv_cache)


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
        head_size=_HEAD_SIZE,
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(_LAYERS)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
