"""Imports between ``verl_backend/driver`` and ``verl_backend/driver/aot`` run one way (issue #46): ``aot`` may read
the driver's lower modules (the memory plan, the profiles, :mod:`verl_backend.driver.job_keys`), and none of the
modules it reads imports ``aot`` back, directly or through others. Read from the code (``tests/test_layers.py``'s
import graph: module-level and function-level imports)."""

from __future__ import annotations

AOT = "verl_backend.driver.aot"


def back_into_aot(graph: dict[str, set[str]]) -> list[str]:
    """``"A -> ... -> aot.X"`` for each module outside ``aot`` that an ``aot`` module imports and that imports
    ``aot`` again (a circle through the two folders); empty when imports run one way."""
    inside = {m for m in graph if m == AOT or m.startswith(AOT + ".")}
    found = []
    for start in sorted({t for m in inside for t in graph[m] if t in graph and t not in inside}):
        seen, stack = {start}, [[start]]
        while stack:
            path = stack.pop()
            for nxt in sorted(graph.get(path[-1], ())):
                if nxt in inside:
                    found.append(" -> ".join(path + [nxt]))
                elif nxt in graph and nxt not in seen:
                    seen.add(nxt)
                    stack.append(path + [nxt])
    return found


def test_driver_and_aot_import_one_way():
    from test_layers import PACKAGES, ROOT, import_graph

    graph = import_graph(ROOT, PACKAGES)
    assert "verl_backend.driver.memory_plan" in graph[f"{AOT}.job"]  # aot reads the plan (inside a function)
    assert back_into_aot(graph) == []
    # negative control: the import the plan had before (memory_plan -> aot.graphs) closes the circle again
    graph["verl_backend.driver.memory_plan"] = graph["verl_backend.driver.memory_plan"] | {f"{AOT}.graphs"}
    assert "verl_backend.driver.memory_plan -> verl_backend.driver.aot.graphs" in back_into_aot(graph)
