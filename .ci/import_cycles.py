"""Fail on import cycles in kvmerge's Python, between modules and between
the subpackages of each package (an import inside a function counts: it is
still a dependency). Uses grimp, the import graph behind import-linter.

    python .ci/import_cycles.py [PACKAGE ...]     # default: kvmerge benches
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
from cycles import cycles

# `benches` is imported from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(packages: list[str]) -> int:
    graph = grimp.build_graph(*packages)
    problems = [
        " <-> ".join(sorted(c))
        for c in cycles(
            sorted(graph.modules),
            lambda m: sorted(graph.find_modules_directly_imported_by(m)),
        )
    ]
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
