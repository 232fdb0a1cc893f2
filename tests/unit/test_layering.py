"""The command line sits on top: only ``cli.py`` and ``commands/`` know typer, and no feature
module reaches up into the command line (``vllm_repro.cli`` or ``vllm_repro.commands``).
``console.py`` (out / err / say / the verdict table) is shared by the commands and knows no typer
either. Read from the sources with :mod:`ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "vllm_repro"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "models" not in p.relative_to(PACKAGE).parts)


def module_name(path: Path) -> str:
    parts = ("vllm_repro",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved; ``from A import b`` also counts
    ``A.b``, which may be a module), anywhere in the file (lazy imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def is_under(mod: str, top: str) -> bool:
    return mod == top or mod.startswith(top + ".")


def is_command_line(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).parts
    return rel == ("cli.py",) or rel[0] == "commands"


def test_the_walk_sees_the_package():
    names = {module_name(p) for p in MODULES}
    assert {"vllm_repro.cli", "vllm_repro.console", "vllm_repro.lab",
            "vllm_repro.triage.core"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_command_line_imports_typer(path):
    if is_command_line(path):
        return
    typer = sorted(m for m in imported(path) if is_under(m, "typer") or is_under(m, "click"))
    assert not typer, f"{path.relative_to(PACKAGE)} imports {typer}; typer belongs in commands/"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_feature_module_imports_the_command_line(path):
    if is_command_line(path):
        return
    up = sorted(m for m in imported(path)
                if is_under(m, "vllm_repro.cli") or is_under(m, "vllm_repro.commands"))
    assert not up, (f"{path.relative_to(PACKAGE)} imports {up}; the command line imports the "
                    "features, never the other way (shared printing is in vllm_repro.console)")
