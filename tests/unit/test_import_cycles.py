"""No import cycle in ``src/vllm_repro``: read from the sources with :mod:`ast` (nothing imported).

A cycle among module-level imports fails outright. Imports inside functions count too (a lazy
import that closes a cycle only hides it), with one exception named below: the command line's
presentation modules import each other lazily for start-up time, and that loop never runs at
import. Importing ``a.b.c`` from outside ``a.b`` runs ``a.b``'s ``__init__`` first, so that is an
edge to the package too (``engine/capabilities.py`` importing ``engine.adapter.probes`` is an
import of ``engine.adapter``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "vllm_repro"
MODULES = {}
for _p in sorted(PACKAGE.rglob("*.py")):
    _parts = ("vllm_repro",) + _p.relative_to(PACKAGE).with_suffix("").parts
    MODULES[".".join(_parts[:-1] if _parts[-1] == "__init__" else _parts)] = _p

#: cycles allowed among lazy imports only, each with why (module names without vllm_repro.)
LAZY_ONLY = {
    # console.print_results imports verdict, scenario.load's long-load note imports console:
    # both lazily so that `vllm-repro --help` imports neither pydantic nor rich
    frozenset({"console", "scenario", "scenario.load", "verdict"}),
}


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Import statements run when the module is imported (not under ``if TYPE_CHECKING``)."""
    out: list[ast.stmt] = []

    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for h in node.handlers:
                    walk(h.body)
                walk(node.orelse)
                walk(node.finalbody)
    walk(tree.body)
    return out


def graph(lazy: bool) -> dict[str, set[str]]:
    """module -> the lab modules it imports (at import time, or anywhere with ``lazy``)."""
    g: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] \
            if lazy else _top_level(tree)
        edges: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod
                           for a in node.names]
            for t in targets:
                parts = t.split(".")
                for k in range(1, len(parts) + 1):
                    anc = ".".join(parts[:k])
                    # a package being initialised already (ours or an outer one) is not re-run
                    if anc in MODULES and anc != name and \
                            (k == len(parts) or not (package + ".").startswith(anc + ".")):
                        edges.add(anc)
        g[name] = edges
    return g


def cycles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _short(comp: set[str]) -> frozenset[str]:
    return frozenset(m.removeprefix("vllm_repro.") for m in comp)


def test_no_cycle_among_module_level_imports():
    assert [sorted(_short(c)) for c in cycles(graph(lazy=False))] == []


def test_no_lazy_import_hides_a_cycle():
    found = [_short(c) for c in cycles(graph(lazy=True))]
    assert [sorted(c) for c in found if c not in LAZY_ONLY] == []


def test_the_checker_sees_a_cycle_and_a_package_init():
    # what the tests above rely on: an edge through a package's __init__ closes a cycle
    g = {"a": {"p"}, "p": {"p.x"}, "p.x": {"a"}, "b": set()}
    assert [sorted(c) for c in cycles(g)] == [["a", "p", "p.x"]]
    g = graph(lazy=False)
    assert "vllm_repro.engine.adapter" in g["vllm_repro.engine.adapter.capability_probes"] or \
        "vllm_repro.engine.capabilities" in g["vllm_repro.engine.adapter.capability_probes"]
    assert "vllm_repro.engine.adapter" in g["vllm_repro.engine.run"]
