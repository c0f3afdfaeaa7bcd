"""NVIDIA Dynamo's standalone KV indexer, a real consumer of vLLM's KV-event stream.

``python -m dynamo.indexer`` (ai-dynamo-runtime 1.6.1, in its own venv: see
``.ci/setup-dynamo.sh``) subscribes to vLLM ZMQ publishers itself (SUB on the
PUB endpoint, DEALER on the replay ROUTER), converts the stream with Dynamo's
own code into one radix tree per ``(model_name, routing_group)`` and answers
HTTP. No NATS, etcd or GPU. It binds ``0.0.0.0``; this client talks to
``127.0.0.1`` only. :class:`DynamoIndexer` runs one, this module needs only the
standard library (the project venv has no Dynamo).

HTTP API (JSON; errors are ``{"error": msg}`` with 404/409, or 422 text)
  ``GET /health`` 200, empty body.
  ``POST /register {instance_id, endpoint, model_name, block_size,
  replay_endpoint?, dp_rank=0, routing_group="default"}`` 201
  ``{"status": "ok"}``. 409 when ``(instance_id, dp_rank)`` is registered (under
  any model) or ``block_size`` differs from the model's first registration.
  Listener status "active" does not mean connected or subscribed.
  ``POST /unregister {instance_id, model_name, routing_group?, dp_rank?}``
  drops the worker's blocks; with the model's last worker, the model too.
  ``GET /workers[?model_name=&routing_group=]`` list of ``{instance_id,
  source, status, model_name, routing_group, block_size, endpoints, listeners}``.
  ``GET /dump`` ``{"model:group": {block_size, events: [{worker_id,
  storage_tier ("device"|"host_pinned"|"disk"|"external"), residency_domain,
  event: {event_id, dp_rank, data: {stored: {parent_hash, start_position,
  blocks: [{block_hash, tokens_hash, mm_extra_info}]}}}}]}}``.
  ``POST /query {token_ids, model_name, routing_group?, lora_name?,
  cache_salt?}``; 404 for an unknown model. Returns ``{scores: {iid: {dp:
  tokens}}, frequencies: [], instances: {iid: {gpu, cpu, disk,
  longest_matched, dp: {dp: tokens}}}}``, every count in TOKENS (blocks x
  block_size). ``POST /query_by_hash {block_hashes, model_name}`` takes
  Dynamo's own ``tokens_hash`` values as signed i64 (vLLM's block hashes
  match nothing). ``GET /metrics``: Prometheus text, see below.

How it indexes (found by experiment; kvmerge.events structs on a real PUB)
  Hashing. /query takes token ids. The indexer hashes each full block of a
  BlockStored's ``token_ids`` itself (``tokens_hash``: the block's tokens,
  ``lora_name`` and a cache salt only; not the parent, not ``lora_id``, not
  multimodal ``extra_keys``). The salt comes only from an ``extra_keys``
  entry ``"dynamo-cache-salt:<s>"`` of the first block, inherited by
  children; query it with ``cache_salt``. vLLM's block hashes are only keys
  for parent links and removals. Hashes must be ints (i64 or u64, vLLM's
  default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): a ``bytes`` hash anywhere
  makes the whole batch undecodable, dropped with a log warning and no metric
  (its seq then counts as a gap; the replayed copy fails the same way).
  Device tier (medium "GPU", "DEVICE" or None): a radix tree per worker and
  dp rank; a node is (parent node, tokens_hash). A store whose parent hash
  is unknown to that worker and dp rank is skipped whole. A store of a
  hash already held with the same tokens and parent is counted ok (plus a
  ``duplicate_store`` warning). A different hash for a node the worker already
  holds is not recorded (its removal is ``block_not_found``, its children's
  parent is not found). Re-storing a held hash with other tokens leaves the
  old node in the tree, unreachable by hash: /query still matches it, even
  after AllBlocksCleared. Removing a block drops its descendants; an event's
  unknown hashes make its status ``block_not_found`` while its known ones are
  still removed.
  Lower tiers ("CPU"/"CPU_PINNED"/"CPU_TIER1" -> host_pinned,
  "STORAGE"/"DISK"/"NVME"/"CPU_TIER2" -> disk, "EXTERNAL"/"NETWORK"/
  "REMOTE"/"SHARED" -> external; case-sensitive): per worker and dp rank,
  a flat map of blocks keyed by (parent hash, tokens_hash). No parent check,
  no cascade on removal, unknown removals silent, not counted in metrics.
  Tiers are independent: a removal in one tier never touches another.
  AllBlocksCleared clears every tier of the batch's dp rank only.
  Query, per dp rank: ``gpu`` = leading blocks found in the device tree;
  then ``cpu`` = ``gpu`` + the blocks found in host_pinned by continuing from
  the last matched block's hash (root when none); then ``disk`` = ``cpu`` +
  the same walk in disk, then in external. Each tier is walked once, in that
  order. Per instance: ``gpu``, ``cpu``, ``disk`` are maxima over dp ranks,
  ``longest_matched`` = max of the three, ``dp`` = device tokens of each dp
  rank with any match, ``scores`` = device tokens of ranks with ``gpu > 0``.
  Instances matching nothing are absent; a partial last block is ignored.
  Dropped silently (no metric; no log but for an unknown kind): a medium not
  listed above (so "cpu", "gpu"), ``locality`` "REMOTE", any ``ownership``
  other than None, a ``kv_cache_spec_kind`` other than full/mla/sink_full
  attention, and a ``group_idx`` other than 0 whose kind that listener has
  not seen with that group (a kind seen once for a (dp rank, group) is
  remembered, so a non-main kind on group 0 drops later kind-less group 0
  events too). ``group_idx`` None passes. ``session_id`` and
  ``lookahead_token_ids`` are ignored.
  A store is cut at the first block whose ``block_size`` differs from the
  registered one, or whose ``token_ids`` run out (counted ok even when that
  leaves nothing). A store repeating a hash (or its parent's) counts as
  ``removed``/``ok`` and stores nothing. A batch's ``data_parallel_rank``
  overrides the registered dp rank.
  Metrics: ``dynamo_kvrouter_kv_cache_events_applied{event_type, status}``,
  one per device-tier event that survived the filters above (a store of
  several blocks counts once). event_type: stored, removed, cleared; status:
  ok, parent_block_not_found, block_not_found, ... Lower-tier events are never
  counted, so :meth:`DynamoIndexer.wait_applied` needs a device-tier event
  last (lower-tier events of the same or earlier batches were visible by then
  in every trial) or use :meth:`DynamoIndexer.wait_until`.
  Sequence numbers: the topic is ignored (SUB to all). A gap (seq >
  last + 1), or a first batch with seq > 0, makes it request
  ``[expected, got)`` from ``replay_endpoint`` and apply what comes back;
  without one the batches are lost (warning). Batches at or below the
  watermark are ignored. PUB/SUB joins late: a batch sent before the SUB has
  subscribed is lost unless a later batch triggers the replay from 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

__all__ = [
    "APPLIED_METRIC",
    "DumpedBlock",
    "DynamoIndexer",
    "DynamoIndexerError",
    "InstanceMatch",
    "QueryResult",
]

APPLIED_METRIC = "dynamo_kvrouter_kv_cache_events_applied"
DEFAULT_MODEL = "kvmerge"

Tier = Literal["gpu", "cpu", "disk", "longest_matched"]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class DynamoIndexerError(RuntimeError):
    """The indexer did not start, exited, or answered with an error status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class InstanceMatch:
    """One instance's entry of a /query answer; every count in tokens."""

    gpu: int
    cpu: int
    disk: int
    longest_matched: int
    dp: dict[int, int]


@dataclass(frozen=True)
class QueryResult:
    """A /query (or /query_by_hash) answer, keys as ints, counts in tokens."""

    block_size: int
    scores: dict[int, dict[int, int]]
    instances: dict[int, InstanceMatch]
    frequencies: list[int]

    def tokens(self, instance_id: int, tier: Tier = "gpu") -> int:
        """Matched tokens of one instance in one column (0 when absent)."""
        match = self.instances.get(instance_id)
        return 0 if match is None else int(getattr(match, tier))

    def blocks(self, instance_id: int, tier: Tier = "gpu") -> int:
        """Matched blocks of one instance in one column (0 when absent)."""
        return self.tokens(instance_id, tier) // self.block_size


@dataclass(frozen=True)
class DumpedBlock:
    """One block of /dump: ``tier`` is "device", "host_pinned", "disk" or
    "external"; ``parent_hash`` the parent of the stored run it came in."""

    model: str
    worker_id: int
    dp_rank: int
    tier: str
    parent_hash: int | None
    block_hash: int
    tokens_hash: int


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def as_i64(value: int) -> int:
    """A 64-bit hash as a signed int (the indexer takes and writes either)."""
    return value - (1 << 64) if value >= 1 << 63 else value


class DynamoIndexer:
    """``python -m dynamo.indexer --port P --threads N`` as a context manager.

    ``python`` is the interpreter of the Dynamo venv (``KVMERGE_DYNAMO_PYTHON``
    in CI). Entering starts it on a free port, logging JSON lines to
    ``log_path`` (a temporary file, removed on exit, when None), and waits
    until /health answers; exiting terminates it, then kills it. ``block_size``
    and ``model_name`` are the defaults of :meth:`register` and :meth:`query`.
    """

    def __init__(
        self,
        python: str | Path,
        block_size: int,
        *,
        model_name: str = DEFAULT_MODEL,
        threads: int = 1,
        log_path: str | Path | None = None,
        startup_timeout: float = 30.0,
        request_timeout: float = 10.0,
    ) -> None:
        self.python = str(python)
        self.block_size = block_size
        self.model_name = model_name
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self._own_dir: str | None = None
        self.log_path: Path | None = None if log_path is None else Path(log_path)
        self.port = 0
        self.log_text = ""  # the log, kept when the process stops
        self._proc: subprocess.Popen[bytes] | None = None
        # 127.0.0.1 only, and never through a proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- process -----------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        if self._proc is not None:
            raise DynamoIndexerError("already started")
        if self.log_path is None:
            self._own_dir = tempfile.mkdtemp(prefix="kvmerge-dynamo-")
            self.log_path = Path(self._own_dir) / "indexer.log"
        env = dict(os.environ)
        env["DYN_LOGGING_JSONL"] = "1"
        env.pop("DYN_ROUTER_MIN_INITIAL_WORKERS", None)  # would delay the server
        last_error = ""
        for _ in range(3):  # a free port can be taken before the indexer binds it
            self.port = free_port()
            cmd = [self.python, "-m", "dynamo.indexer", "--port", str(self.port)]
            cmd += ["--threads", str(self.threads)]
            try:
                with open(self.log_path, "ab") as log:
                    self._proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
            except OSError as error:
                self._cleanup_dir()
                raise DynamoIndexerError(f"cannot run {self.python}: {error}") from None
            try:
                self._wait_ready()
                return self
            except DynamoIndexerError as error:
                last_error = str(error)
                self._stop()
            if "ddr" not in last_error:  # AddrInUse / Address already in use
                break
        self.log_text = self.read_log()
        self._cleanup_dir()
        raise DynamoIndexerError(f"dynamo.indexer did not start: {last_error}")

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise DynamoIndexerError(
                    f"exited with {self._proc.returncode}: {self._log_tail()}"
                )
            try:
                with self._opener.open(f"{self.base_url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise DynamoIndexerError(
            f"no answer on {self.base_url} after {self.startup_timeout} s: "
            + self._log_tail()
        )

    def _log_tail(self, chars: int = 2000) -> str:
        return self.read_log()[-chars:]

    def read_log(self) -> str:
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self.log_text

    def log_records(self) -> list[dict[str, Any]]:
        """The log's JSON lines (``level``, ``target``, ``message``, fields)."""
        records = []
        for line in self.read_log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def warnings(self) -> list[str]:
        """The messages of the log's WARN and ERROR records."""
        return [
            str(r.get("message", ""))
            for r in self.log_records()
            if r.get("level") in ("WARN", "ERROR")
        ]

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def _cleanup_dir(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
            self.log_path = None

    def close(self) -> None:
        """Stop the indexer (SIGTERM, then SIGKILL after 5 s); keep the log in
        ``log_text``."""
        self._stop()
        self.log_text = self.read_log()
        self._cleanup_dir()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- HTTP --------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        if self._proc is None:
            raise DynamoIndexerError("not started")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with self._opener.open(request, timeout=self.request_timeout) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise DynamoIndexerError(
                f"{method} {path}: {error.code} {detail}", status=error.code
            ) from None
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def register(
        self,
        instance_id: int,
        endpoint: str,
        replay_endpoint: str | None = None,
        model_name: str | None = None,
        *,
        dp_rank: int = 0,
        routing_group: str | None = None,
        block_size: int | None = None,
    ) -> None:
        """Subscribe to a publisher. ``endpoint`` is the PUB address (tcp on
        127.0.0.1 or ipc), ``replay_endpoint`` its ROUTER, for gaps."""
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model_name or self.model_name,
            "block_size": block_size or self.block_size,
            "dp_rank": dp_rank,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        if routing_group is not None:
            body["routing_group"] = routing_group
        self._request("POST", "/register", body)

    def unregister(
        self,
        instance_id: int,
        model_name: str | None = None,
        *,
        dp_rank: int | None = None,
        routing_group: str | None = None,
    ) -> None:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "model_name": model_name or self.model_name,
        }
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        if routing_group is not None:
            body["routing_group"] = routing_group
        self._request("POST", "/unregister", body)

    def workers(self, model_name: str | None = None) -> list[dict[str, Any]]:
        path = "/workers"
        if model_name is not None:
            path += "?" + urllib.parse.urlencode({"model_name": model_name})
        result = self._request("GET", path)
        return list(result or [])

    def dump(self) -> dict[str, Any]:
        """/dump as it comes: ``{"model:group": {block_size, events}}``."""
        return dict(self._request("GET", "/dump") or {})

    def dump_blocks(self, model_name: str | None = None) -> list[DumpedBlock]:
        """Every block of /dump (of one model when given), flattened."""
        blocks = []
        for key, entry in self.dump().items():
            model = key.rsplit(":", 1)[0]
            if model_name is not None and model != model_name:
                continue
            for item in entry.get("events", []):
                event = item["event"]
                stored = event["data"].get("stored")
                if stored is None:
                    continue
                for block in stored["blocks"]:
                    blocks.append(
                        DumpedBlock(
                            model=model,
                            worker_id=int(item["worker_id"]),
                            dp_rank=int(event.get("dp_rank") or 0),
                            tier=str(item["storage_tier"]),
                            parent_hash=stored["parent_hash"],
                            block_hash=int(block["block_hash"]),
                            tokens_hash=int(block["tokens_hash"]),
                        )
                    )
        return blocks

    def metrics_text(self) -> str:
        return str(self._request("GET", "/metrics") or "")

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample of one metric, keyed by its sorted (label, value)s."""
        out: dict[tuple[tuple[str, str], ...], float] = {}
        for line in self.metrics_text().splitlines():
            match = _SAMPLE.match(line)
            if match is None or match.group(1) != name:
                continue
            labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
            out[labels] = float(match.group(3))
        return out

    def metrics(self) -> dict[tuple[str, str], float]:
        """``dynamo_kvrouter_kv_cache_events_applied`` by (event_type, status),
        process-wide (all models, workers); absent before the first event."""
        out: dict[tuple[str, str], float] = {}
        for labels, value in self.samples(APPLIED_METRIC).items():
            label = dict(labels)
            key = (label.get("event_type", ""), label.get("status", ""))
            out[key] = out.get(key, 0.0) + value
        return out

    def applied_total(self) -> int:
        return int(sum(self.metrics().values()))

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Poll ``predicate`` every 20 ms until true; TimeoutError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"dynamo indexer: {what or 'condition'} not reached after "
                    f"{timeout} s; metrics {self.metrics()}; warnings "
                    f"{self.warnings()[-5:]}"
                )
            if self._proc is None or self._proc.poll() is not None:
                raise DynamoIndexerError("indexer exited: " + self._log_tail())
            time.sleep(0.02)

    def wait_applied(
        self, n_events: int, timeout: float = 10.0
    ) -> dict[tuple[str, str], float]:
        """Wait until the applied counters (all statuses) add up to at least
        ``n_events`` since start, and return them. Only device-tier events
        that pass the filters count (see the module docstring)."""
        self.wait_until(
            lambda: self.applied_total() >= n_events,
            timeout,
            f"{n_events} applied events",
        )
        return self.metrics()

    def query(
        self,
        token_ids: Sequence[int],
        model_name: str | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        routing_group: str | None = None,
    ) -> QueryResult:
        """Overlap of a token sequence with every instance of the model."""
        body: dict[str, Any] = {
            "token_ids": [int(t) for t in token_ids],
            "model_name": model_name or self.model_name,
        }
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if routing_group is not None:
            body["routing_group"] = routing_group
        return self._result(self._request("POST", "/query", body), model_name)

    def query_by_hash(
        self, tokens_hashes: Sequence[int], model_name: str | None = None
    ) -> QueryResult:
        """The same from Dynamo's ``tokens_hash`` values (as in /dump), not
        vLLM's block hashes."""
        body = {
            "block_hashes": [as_i64(int(h)) for h in tokens_hashes],
            "model_name": model_name or self.model_name,
        }
        return self._result(self._request("POST", "/query_by_hash", body), model_name)

    def _result(self, raw: Any, model_name: str | None) -> QueryResult:
        block_size = self.block_size
        if model_name not in (None, self.model_name):
            for worker in self.workers(model_name):
                block_size = int(worker["block_size"])
        instances = {
            int(iid): InstanceMatch(
                gpu=int(m["gpu"]),
                cpu=int(m["cpu"]),
                disk=int(m["disk"]),
                longest_matched=int(m["longest_matched"]),
                dp={int(k): int(v) for k, v in m.get("dp", {}).items()},
            )
            for iid, m in raw.get("instances", {}).items()
        }
        scores = {
            int(iid): {int(k): int(v) for k, v in per_dp.items()}
            for iid, per_dp in raw.get("scores", {}).items()
        }
        return QueryResult(
            block_size=block_size,
            scores=scores,
            instances=instances,
            frequencies=[int(f) for f in raw.get("frequencies", [])],
        )
