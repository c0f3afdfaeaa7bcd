"""The README's `vllm serve` on a CPU is the command tests/serve runs: the
same options with the same values, the same environment, the same connector
over the same children; only the model folder, the host's port, the
endpoints' paths and the children's settings differ. No server is started."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from kvmerge.sim.served import ServedOptions, connector_config
from kvmerge.sim.server import Server, ServerOptions

README = Path(__file__).resolve().parents[2] / "README.md"
#: Options whose value is the run's own.
OWN = {"--port", "--kv-events-config", "--kv-transfer-config"}
#: What the environment's variables say: the README's must be the harness's.
ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE")


def readme_command() -> tuple[dict[str, str], list[str]]:
    text = README.read_text()
    section = text.split("### On a CPU: the server the tests run", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    words = shlex.split(block.group(1).replace("\\\n", " "))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def options(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        assert word.startswith("--"), word
        value = argv[i + 1] if i + 1 < len(argv) else None
        if value is not None and not value.startswith("--"):
            out[word] = value
            i += 2
        else:
            out[word] = None
            i += 1
    return out


def harness(tmp_path: Path) -> Server:
    opts = ServedOptions()
    return Server(
        ServerOptions(
            model=tmp_path / "model",
            tp=opts.tp,
            num_blocks=opts.num_blocks,
            kv_transfer=connector_config(opts, tmp_path / "r", tmp_path / "e"),
            python=str(tmp_path / "bin" / "python"),
        ),
        tmp_path,
    )


def test_the_readme_runs_the_harness_command(tmp_path):
    env, argv = readme_command()
    server = harness(tmp_path)
    try:
        ours = server.command()
        assert Path(argv[0]).name == Path(ours[0]).name == "vllm"
        assert argv[1] == ours[1] == "serve"
        theirs, mine = options(argv[3:]), options(ours[3:])
        assert list(theirs) == list(mine)
        for name in theirs.keys() - OWN:
            assert theirs[name] == mine[name], name
        assert server.env()["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
        for name in ENV[1:]:
            assert env[name] == server.env()[name], name
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    finally:
        server.stop()


def test_the_readme_names_the_harness_connector_children_and_events(tmp_path):
    _, argv = readme_command()
    theirs = options(argv[3:])
    server = harness(tmp_path)
    try:
        mine = options(server.command()[3:])
    finally:
        server.stop()
    readme_events = json.loads(str(theirs["--kv-events-config"]))
    harness_events = json.loads(str(mine["--kv-events-config"]))
    assert readme_events.keys() == harness_events.keys()
    for key in ("enable_kv_cache_events", "publisher", "topic"):
        assert readme_events[key] == harness_events[key]
    readme_kv = json.loads(str(theirs["--kv-transfer-config"]))
    harness_kv = json.loads(str(mine["--kv-transfer-config"]))
    for key in ("kv_connector", "kv_role"):
        assert readme_kv[key] == harness_kv[key]
    r_extra, h_extra = (c["kv_connector_extra_config"] for c in (readme_kv, harness_kv))
    assert r_extra["max_pending_steps"] == h_extra["max_pending_steps"]
    assert [
        (c["kv_connector"], c.get("kv_connector_module_path"))
        for c in r_extra["connectors"]
    ] == [
        (c["kv_connector"], c.get("kv_connector_module_path"))
        for c in h_extra["connectors"]
    ]
