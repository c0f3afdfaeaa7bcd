"""Fail on module cycles in the workspace's crates (cargo-modules' graph
without installing it: owns edges, parent to child, and uses edges, from
every `crate::`, `super::` and `self::` path in a module's source, function
bodies included). Unit-test modules (`mod tests`, `#[cfg(test)]`) are left
out: `use super::*` is how Rust tests are written.

    python .ci/rust_module_cycles.py [CRATE_SRC ...]
    # default: rust/kvmerge-core/src rust/kvmerge-py/src
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cycles import cycles

ROOT = Path(__file__).resolve().parents[1]
CRATES = ["rust/kvmerge-core/src", "rust/kvmerge-py/src"]
TEST_MODULE = re.compile(
    r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", re.S
)
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
GROUP = re.compile(r"\b(crate|super|self)::\{([^}]*)\}")


def modules(src: Path) -> dict[tuple[str, ...], str]:
    """Module path -> its source, for every file module of the crate."""
    found: dict[tuple[str, ...], str] = {}
    for f in sorted(src.rglob("*.rs")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("lib", "main", "mod"):
            parts.pop()
        if "tests" in parts:
            continue
        text = f.read_text()
        m = TEST_MODULE.search(text)
        found[tuple(parts)] = text[: m.start()] if m else text
    return found


def edges(mods: dict[tuple[str, ...], str]) -> dict[tuple[str, ...], set]:
    out: dict[tuple[str, ...], set] = {m: set() for m in mods}
    for m in mods:
        if m:
            out[m[:-1]].add(m)  # owns
    for m, text in mods.items():
        refs: list[tuple[str, str]] = PATH.findall(text)
        for base, group in GROUP.findall(text):
            refs += [(base, "::" + g.strip().split(" ")[0]) for g in group.split(",")]
        for base, rest in refs:
            start = {"crate": (), "super": m[:-1], "self": m}[base]
            path = start + tuple(p for p in rest.split("::") if p)
            # The longest module prefix is what this path depends on.
            while path and path not in mods:
                path = path[:-1]
            if path != m and path in mods and (path or base != "crate"):
                out[m].add(path)
    return out


def main(crates: list[str]) -> int:
    bad = 0
    for crate in crates:
        graph = edges(modules(ROOT / crate))
        found = [
            sorted("::".join(("crate", *m)) for m in c)
            for c in cycles(sorted(graph), graph.__getitem__)
        ]
        n_edges = sum(map(len, graph.values()))
        print(f"{crate}: {len(graph)} modules, {n_edges} edges, {len(found)} cycles")
        for c in found:
            print(f"  module cycle: {' <-> '.join(c)}", file=sys.stderr)
        bad += len(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or CRATES))
