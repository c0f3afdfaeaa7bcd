"""Smoke test of the aarch64 wheel under emulation (.ci/aarch64-check).

    python aarch64_smoke.py host SITE REF   (x86_64, with vLLM and kvmerge)
    python -I -S aarch64_smoke.py check REF SITE   (emulated aarch64 CPython)

`host` writes vLLM's event classes into SITE and the bytes expected into REF.

vLLM cannot be imported under emulation: `vllm.distributed.kv_events` pulls in
torch (thousands of modules, no arm64 wheels fetched here). The extension
needs only that module's event classes, so `host` writes a `vllm` package
holding them: their source, verbatim, cut out of the installed vLLM with `ast`,
without the publisher code and imports around them. `check` then compares its
encodings with those the host makes with vLLM's real classes: equal bytes show
both that the classes are vLLM's and that the format does not depend on the
architecture.
"""

import ast
import json
import pickle
import platform
import sys
from pathlib import Path
from typing import Any

# The parts of vllm/distributed/kv_events.py that the extension's schema uses.
CLASSES = ("KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")
ALIAS = "ExternalBlockHash"  # defined in vllm/v1/core/kv_cache_utils.py
WORLD_SIZE = 2


def write_vllm(dest: Path) -> None:
    """The `vllm` package of the event classes alone, from the host's vLLM."""
    import vllm.distributed.kv_events as kv
    import vllm.v1.core.kv_cache_utils as kcu

    def segments(module: Any, names: tuple[str, ...]) -> list[str]:
        source = Path(module.__file__).read_text()
        found: dict[str, str] = {}
        for node in ast.parse(source).body:
            name = getattr(node, "name", None)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name = node.target.id
            segment = ast.get_source_segment(source, node)
            if name in names and segment:
                found[name] = segment
        missing = set(names) - found.keys()
        if missing:
            raise SystemExit(f"{module.__file__} defines no {sorted(missing)}")
        return [found[n] for n in names]

    from vllm import __version__

    body = [
        f'"""vLLM {__version__}\'s event classes, cut out of its kv_events.py."""',
        "from typing import Any, TypeAlias",
        "import msgspec",
        *segments(kcu, (ALIAS,)),
        *segments(kv, CLASSES),
    ]
    pkg = dest / "vllm"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {__version__!r}\n")
    (pkg / "distributed" / "__init__.py").write_text("")
    (pkg / "distributed" / "kv_events.py").write_text("\n\n".join(body) + "\n")


def events() -> list[Any]:
    """Events whose ints take every path: one 30-bit digit (read in place),
    wider (through the API), negative, zero; both block hash forms."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    wide = [2**30, -(2**30), 2**62, -(2**63), 2**64 - 1]
    return [
        BlockStored(
            block_hashes=[1, -2, 2**63, b"\x07" * 16],
            parent_block_hash=None,
            token_ids=[*range(-5, 600), *wide, 0, (1 << 30) - 1],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name="adapter",
            extra_keys=[("adapter",), None, ("salt", 3, b"\x01"), None],
            group_idx=1,
        ),
        BlockStored(
            block_hashes=[b""],
            parent_block_hash=2**63,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=7,
            medium=None,
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[1, b"\x07" * 16], medium="CPU"),
        AllBlocksCleared(),
    ]


def outputs(kvmerge: Any) -> dict[str, str]:
    """What both architectures must produce byte for byte, as hex."""
    evs = events()
    merger = kvmerge.Merger(WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        merger.add(rank, kvmerge.encode(evs, rank=rank, world_size=WORLD_SIZE))
    return {
        "batch": bytes(kvmerge.encode(evs)).hex(),
        "merged": bytes(merger.finish_step_batch()).hex(),
    }


def check(reference: Path, site: Path) -> None:
    sys.path.insert(0, str(site))
    import kvmerge
    from kvmerge import EventBatch

    errors = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            errors.append(what)

    expect(platform.machine() == "aarch64", f"machine is {platform.machine()}")
    expect(
        Path(kvmerge._kvmerge.__file__).parent == site / "kvmerge",
        f"the extension is {kvmerge._kvmerge.__file__}, not the wheel's",
    )
    version = sys.version_info[:2]
    want = "sized" if version == (3, 11) else "tagged"
    layout = kvmerge._kvmerge._layout()
    expect(layout == want, f"_layout() is {layout!r} on {version}, expected {want!r}")

    evs = events()
    batch = kvmerge.encode(evs)
    expect(batch.decode() == evs, "decode() differs from the encoded events")
    want_bytes = json.loads(reference.read_text())
    got = outputs(kvmerge)
    for name, hexed in want_bytes.items():
        expect(got[name] == hexed, f"{name}: bytes differ from x86_64's")
    host = EventBatch.from_buffer(bytes.fromhex(want_bytes["batch"]))
    expect(host.decode() == evs, "x86_64's batch decodes differently here")
    expect(host.identities() == batch.identities(), "identities differ from x86_64's")

    # Merging: ranks that carry each event's bytes once (encode with a rank).
    merger = kvmerge.Merger(WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        merger.add(rank, kvmerge.encode(evs, rank=rank, world_size=WORLD_SIZE))
    expect(merger.finish_step() == evs, "merged events differ from each rank's")

    # Pickle protocol 5: the payload travels out of band, as vLLM's shm queue
    # moves it, and comes back as bytes or as a bytearray.
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    expect(len(buffers) == 1 and len(data) < 200, "pickle: payload not out of band")
    with buffers[0].raw() as view:
        payload = view.tobytes()
    expect(payload == bytes(batch), "pickle: the out-of-band buffer is not the batch")
    for container in (bytes, bytearray):
        back = pickle.loads(data, buffers=[container(payload)])
        expect(back.decode() == evs, f"pickle: decoded from a {container.__name__}")
        expect(back.identities() == batch.identities(), "pickle: identities")
    back = pickle.loads(pickle.dumps(batch, protocol=4))
    expect(bytes(back) == bytes(batch), "pickle: protocol 4 (in band)")

    for e in errors:
        print(f"  {e}", file=sys.stderr)
    if errors:
        raise SystemExit(1)
    print(
        f"CPython {platform.python_version()} on {platform.machine()}: layout "
        f"{layout}, {len(evs)} events encoded, merged ({WORLD_SIZE} ranks), "
        f"decoded, pickled out of band; bytes equal to x86_64's"
    )


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "host":
        import kvmerge

        write_vllm(Path(args[0]))
        Path(args[1]).write_text(json.dumps(outputs(kvmerge)))
    elif command == "check":
        check(Path(args[0]), Path(args[1]).resolve())
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
