"""A worker: one TP rank's model runner, with the forward pass simulated.

``Sampler`` is what a model runner knows of the requests: it samples one
token for every request whose scheduled tokens reach its end (none for a
partial prefill, as the model runner discards those). Tokens are a hash of the
request and position: every rank samples the same ones, and a rerun the same
stream.

``Worker.execute`` drives a rank's KV connector in the order vLLM's model
runner does (``KVConnectorModelRunnerMixin``: bind the metadata, start the
loads, the forward pass, wait for the saves, the transfer results, stats,
events, worker metadata, clear). It is a rank in the engine's own process
(``Engine(processes=False)``), and the model runner of
``kvmerge.sim.executor.NoForwardWorker`` in vLLM's own ``WorkerProc``s.
"""

from __future__ import annotations

import zlib
from typing import Any

from .model import VOCAB, create_connector, kv_cache_config, worker_config


def sampled_token(req_id: str, position: int) -> int:
    return zlib.crc32(f"{req_id}/{position}".encode()) % VOCAB


class Sampler:
    """The requests a rank's model runner holds: their token counts."""

    def __init__(self) -> None:
        #: request -> its number of tokens (prompt and sampled)
        self.num_tokens: dict[str, int] = {}

    def track(self, so: Any) -> dict[str, int]:
        """Take in a step's ``SchedulerOutput``; each scheduled request's
        computed tokens."""
        for req_id in so.finished_req_ids:
            self.num_tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # A request resumed after preemption comes back with its outputs
            # to prefill again (vLLM 0.34: as a new request).
            tokens = new.prefill_token_ids or new.prompt_token_ids or ()
            self.num_tokens[new.req_id] = len(tokens)
        cached = so.scheduled_cached_reqs
        # vLLM 0.33 resumes a preempted request as a cached one.
        for req_id in getattr(cached, "resumed_req_ids", ()):
            self.num_tokens[req_id] = len(cached.all_token_ids[req_id])
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        return computed

    def sample(self, so: Any, computed: dict[str, int]) -> tuple[list[str], Any]:
        """The scheduled requests, and the tokens sampled for each."""
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            req_ids.append(req_id)
            total = self.num_tokens.get(req_id, 0)
            if computed.get(req_id, 0) + n < total:
                sampled.append([])  # a partial prefill: nothing sampled
                continue
            sampled.append([sampled_token(req_id, total)])
            self.num_tokens[req_id] = total + 1
        return req_ids, sampled


def model_runner_output(req_ids: list[str], sampled: Any, kv_out: Any) -> Any:
    """A ``ModelRunnerOutput`` of sampled tokens and the connector's output."""
    from vllm.v1.outputs import ModelRunnerOutput

    fields: dict[str, Any] = {
        "req_ids": req_ids,
        "sampled_token_ids": sampled,
        "kv_connector_output": kv_out,
    }
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM 0.33
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**fields)


class Worker:
    """One rank in this process: its connector and its sampler."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.sampler = Sampler()

    def execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        computed = self.sampler.track(so)
        conn = self.connector
        kv_out = KVConnectorOutput()
        conn.bind_connector_metadata(so.kv_connector_metadata)
        conn.start_load_kv(None)
        req_ids, sampled = self.sampler.sample(so, computed)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kv_out.finished_sending = results.finished_sending
        kv_out.finished_recving = results.finished_recving
        kv_out.invalid_block_ids = conn.get_block_ids_with_load_errors()
        kv_out.kv_connector_stats = conn.get_kv_connector_stats()
        kv_out.kv_cache_events = conn.get_kv_connector_kv_cache_events()
        kv_out.kv_connector_worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return model_runner_output(req_ids, sampled, kv_out)


def build_worker(config: Any, rank: int, num_blocks: int) -> Worker:
    """The worker of ``rank``: its own copy of the config, as ``WorkerBase``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return Worker(
        create_connector(
            worker_config(config, rank),
            KVConnectorRole.WORKER,
            kv_cache_config(num_blocks),
        )
    )
