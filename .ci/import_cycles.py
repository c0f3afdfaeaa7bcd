"""Fail on import cycles in kvmerge's Python, between modules and between
the subpackages of each package (an import inside a function counts: it is
still a dependency). Uses grimp, the import graph behind import-linter.

    python .ci/import_cycles.py [PACKAGE ...]     # default: kvmerge benches
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

# `benches` is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return found


def main(packages: list[str]) -> int:
    graph = grimp.build_graph(*packages)
    problems = [" <-> ".join(c) for c in module_cycles(graph)]
    packages_checked = [m for m in graph.modules if graph.find_children(m)]
    for package in sorted(packages_checked):
        for importer, imported in sorted(
            (i["importer"], i["imported"])
            for i in graph.nominate_cycle_breakers(package)
        ):
            problems.append(
                f"{package}: its children import each other ({importer} -> {imported})"
            )
    for p in problems:
        print(f"import cycle: {p}", file=sys.stderr)
    print(
        f"{len(graph.modules)} modules, {len(packages_checked)} packages, "
        f"{len(problems)} cycles"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["kvmerge", "benches"]))
