"""The package layout: no import cycles between memctl's modules, old import paths kept."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import memctl

_ROOT = pathlib.Path(memctl.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in _ROOT.rglob("*.py"):
        parts = path.relative_to(_ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Module -> the memctl modules it imports (at any depth of its code, lazily or not)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memctl"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                deps |= subs
                if len(subs) < len(node.names):
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("memctl")}
        # A module importing its own package's __init__ (for a sibling) is not a cycle of substance.
        graph[name] = {d for d in deps & mods.keys() if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules() -> None:
    assert _cycles(_import_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_allocation_package_does_not_import_the_controller() -> None:
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("memctl.allocation"):
            assert not {d for d in deps if d.startswith("memctl.controller")}, name


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("memctl", "Controller"),
        ("memctl.codecs", "get"),
        ("memctl.codecs", "decode"),
        ("memctl.codecs.quantize", "QuantizeCodec"),
        ("memctl.codecs.quantize", "packed_nbytes"),
        ("memctl.codecs.errorbound", "ErrorBoundCodec"),
        ("memctl.codecs.errorbound", "bits_for_range"),
        ("memctl.codecs.lossless", "LosslessCodec"),
        ("memctl.allocation", "solve"),
        ("memctl.controller.allocation", "solve"),
        ("memctl.controller.allocation", "build_problem"),
        ("memctl.controller", "guarded_step"),
    ],
)
def test_public_import_paths_still_work(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None
