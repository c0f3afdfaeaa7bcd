"""Cycles of a directed graph: its strongly connected components of more than
one node (Tarjan). Shared by import_cycles.py and rust_module_cycles.py."""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

N = TypeVar("N", bound=Hashable)


def cycles(nodes: Iterable[N], successors: Callable[[N], Iterable[N]]) -> list[list[N]]:
    index: dict[N, int] = {}
    low: dict[N, int] = {}
    stack: list[N] = []
    on_stack: set[N] = set()
    found: list[list[N]] = []

    def visit(v: N) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in successors(v):
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
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in nodes:
        if v not in index:
            visit(v)
    return found
