"""Why vLLM raised: what the innermost vLLM frame held when it did.

At a vLLM exception the worker records (:func:`crash_context`, bounded) the statement that
raised, in full (a multi-line ``assert`` included), the frame's local variables (``repr`` cut
to :data:`MAX_REPR` characters, at most :data:`MAX_LOCALS` of them; a vLLM ``Request`` reads as
``<Request L>``) and, for a failed ``assert``, each operand of its test evaluated again in that
frame, as pytest's assertion rewriting shows them: for ``assert len(a) + len(b) <= len(
self.running)`` the values of ``len(a) + len(b)``, ``len(a)``, ``len(b)`` and
``len(self.running)``. Only side-effect-free operands are evaluated: names, attributes,
subscripts, constants, arithmetic, comparisons and calls of :data:`SAFE_CALLS` (``len``,
``sum``...); anything else is shown as not evaluated.

Standard library only (runs inside release environments).
"""

from __future__ import annotations

import ast
import linecache
import re
from pathlib import Path
from types import FrameType, TracebackType

from ..records import CrashContext

#: locals recorded at most, and characters of each one's repr
MAX_LOCALS = 40
MAX_REPR = 200
#: operands of an assert evaluated at most
MAX_OPERANDS = 12
#: characters of the statement kept
MAX_STATEMENT = 2000
#: the builtins an operand may call (none has a side effect)
SAFE_CALLS = frozenset({"len", "sum", "min", "max", "abs", "sorted", "set", "list", "tuple",
                        "any", "all", "isinstance", "bool", "int", "str", "id", "type"})


def innermost_vllm(tb: TracebackType | None, vllm_root: Path) -> tuple[FrameType, int] | None:
    """The innermost traceback entry in the vLLM package: ``(frame, line)``, or None."""
    root = str(vllm_root.resolve()) + "/"
    found = None
    while tb is not None:
        try:
            path = str(Path(tb.tb_frame.f_code.co_filename).resolve())
        except OSError:
            path = ""
        if path.startswith(root):
            found = (tb.tb_frame, tb.tb_lineno)
        tb = tb.tb_next
    return found


#: `` at 0x7f00b26ed5d0`` in a default ``object.__repr__``
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+(?=>)")


def short_repr(value, limit: int = MAX_REPR, depth: int = 0) -> str:
    """``repr(value)`` cut to ``limit`` characters; a vLLM request (anything with a
    ``request_id``) as ``<Request ID>`` (also inside lists, tuples, sets and dicts, the first 20
    items). Never raises."""
    try:
        rid = getattr(value, "request_id", None) if not isinstance(value, (str, bytes)) else None
        if isinstance(rid, str):
            text = f"<{type(value).__name__} {rid}>"
        elif depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
            items = list(value)[:20]
            inner = ", ".join(short_repr(v, limit, depth + 1) for v in items)
            more = f", ... ({len(value)} in all)" if len(value) > 20 else ""
            open_, close = {list: "[]", tuple: "()"}.get(type(value), "{}")
            if isinstance(value, tuple) and len(value) == 1:
                inner += ","
            text = f"{open_}{inner}{more}{close}"
        elif depth < 2 and isinstance(value, dict):
            items = list(value.items())[:20]
            inner = ", ".join(f"{short_repr(k, 40, depth + 1)}: {short_repr(v, limit, depth + 1)}"
                              for k, v in items)
            more = f", ... ({len(value)} in all)" if len(value) > 20 else ""
            text = "{" + inner + more + "}"
        else:
            # an object's default repr names its address, which differs from run to run: left
            # out, so that result.json is the same for the same run (``<X object>``)
            text = _ADDRESS.sub("", repr(value))
    except Exception as exc:  # noqa: BLE001 - a repr that raises
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


#: a local holding a clock reading (``time.monotonic()`` / ``time.time()``), such as
#: ``Scheduler.schedule``'s ``scheduled_timestamp``: its value differs from run to run
_CLOCK_NAME = re.compile(r"(^|_)(time|timestamp|ts|now|deadline|t0|start_time)(_|$)")


def _local_repr(name: str, value: object) -> str:
    """``short_repr(value)``, except a float local whose name says it reads a clock: shown as
    ``<clock reading>`` so that result.json is the same for the same run (cold or warm)."""
    if isinstance(value, float) and _CLOCK_NAME.search(name):
        return "<clock reading>"
    return short_repr(value)


def _statement(filename: str, line: int) -> ast.stmt | None:
    """The innermost statement of ``filename`` that spans ``line``."""
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or (node.end_lineno - node.lineno) <= (best.end_lineno - best.lineno):
                best = node
    return best


def _safe(node: ast.AST) -> bool:
    """Whether evaluating ``node`` can have no side effect (see the module docstring)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if not (isinstance(sub.func, ast.Name) and sub.func.id in SAFE_CALLS):
                return False
        elif isinstance(sub, (ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom,
                              ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return False
    return True


def _operands(test: ast.expr) -> list[ast.expr]:
    """The operands pytest would show for an assert's ``test``, outermost first: each side of a
    comparison, each value of ``and`` / ``or``, what ``not`` negates, and the terms of an
    arithmetic operand; calls and names as they are."""
    out: list[ast.expr] = []

    def visit(node: ast.expr, top: bool = False) -> None:
        if isinstance(node, ast.Compare):
            if not top:
                out.append(node)
            for part in (node.left, *node.comparators):
                visit(part)
        elif isinstance(node, ast.BoolOp):
            for part in node.values:
                visit(part)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            visit(node.operand)
        elif isinstance(node, ast.BinOp):
            out.append(node)
            visit(node.left)
            visit(node.right)
        elif not isinstance(node, ast.Constant):
            out.append(node)

    visit(test, top=True)
    return out


def crash_context(tb: TracebackType | None, vllm_root: Path) -> CrashContext | None:
    """The :class:`~vllm_repro.records.CrashContext` of the innermost vLLM frame of ``tb``
    (None when no frame is vLLM's). Never raises: what could not be read is left out, and a
    failure to evaluate the operands is said in ``operand_error``."""
    found = innermost_vllm(tb, vllm_root)
    if found is None:
        return None
    frame, line = found
    ctx = CrashContext()
    try:
        names = list(frame.f_locals.items())
        ctx.locals = {name: _local_repr(name, value) for name, value in names[:MAX_LOCALS]}
        if len(names) > MAX_LOCALS:
            ctx.locals["..."] = f"{len(names) - MAX_LOCALS} more"
    except Exception as exc:  # noqa: BLE001
        ctx.operand_error = f"locals unreadable: {type(exc).__name__}"
    filename = frame.f_code.co_filename
    stmt = _statement(filename, line)
    if stmt is None:
        ctx.statement = linecache.getline(filename, line).strip() or None
        return ctx
    text = "".join(linecache.getlines(filename)[stmt.lineno - 1:stmt.end_lineno])
    ctx.statement = _dedent(text)[:MAX_STATEMENT]
    if isinstance(stmt, ast.Assert):
        ctx.operands = {}
        for node in _operands(stmt.test)[:MAX_OPERANDS]:
            label = " ".join(ast.unparse(node).split())[:160]
            if not _safe(node):
                ctx.operands[label] = "(not evaluated: it calls code)"
                continue
            try:
                value = eval(compile(ast.Expression(node), filename, "eval"),  # noqa: S307
                             frame.f_globals, dict(frame.f_locals))
                ctx.operands[label] = short_repr(value)
            except Exception as exc:  # noqa: BLE001 - the frame's state after the raise
                ctx.operands[label] = f"(raised {type(exc).__name__}: {short_repr(str(exc), 80)})"
    return ctx


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).rstrip()


__all__ = ["crash_context", "short_repr", "innermost_vllm", "MAX_LOCALS", "MAX_REPR"]
