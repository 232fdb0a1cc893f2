"""Import and file tracer that runs inside a release environment (standard library only).

Installed at interpreter start by a generated ``sitecustomize.py`` (see
:func:`vllm_repro.slicing.trace.tracer_dir`) when ``VLLM_REPRO_TRACE_DIR`` is set, so it follows
the engine worker, pytest, and any child process vLLM starts (0.9/0.10 resolve the model
architecture in ``python -m vllm.model_executor.models.registry``). Each process writes
``trace.<pid>.json`` into that folder at exit with:

- ``modules``: every module in ``sys.modules`` at exit, plus every module ever imported
  (``{name: file or null}``), so that modules removed from ``sys.modules`` still count;
- ``probed``: every name any import asked the import system for (``importlib.util.find_spec``
  probes included): a probed ``vllm.*`` module that exists must be in the slice even if it was
  never imported, or the probe's answer would change;
- ``opened``: every file opened for reading below the watched roots (the vLLM tree: data files
  such as JSON configs and chat templates; the environment: ``*.dist-info/METADATA`` reads of
  ``importlib.metadata.version``);
- ``listed``: directories below the watched roots that were listed (``os.listdir``,
  ``os.scandir``): a listing of a sliced folder would see fewer entries;
- ``calls``: with ``VLLM_REPRO_TRACE_CALLS=1``, ``{callee_top: {caller_top: n}}``: Python calls
  into a third-party top-level package from code outside it (imports excluded), which tells
  which packages scheduling only imports and never uses (the stub candidates).

The roots watched are ``VLLM_REPRO_TRACE_ROOTS`` (``os.pathsep``-separated). Nothing here
changes what vLLM sees: the finder only records and always answers ``None``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

_STATE: dict | None = None
#: Bumped when what a record means changes (a slicer reuses a traced run of the same format).
TRACE_FORMAT = 1


class _Recorder:
    """A meta-path finder at the front of ``sys.meta_path`` that records every name asked for
    and defers to the rest (``find_spec`` returns ``None``)."""

    def __init__(self, probed: set, importers: dict):
        self.probed = probed
        self.importers = importers

    def find_spec(self, name, path=None, target=None):  # noqa: D401 - importlib protocol
        if name not in self.probed:
            self.probed.add(name)
            # the first frame outside the import system: who asked for this module first
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in f.f_code.co_filename):
                f = f.f_back
            if f is not None:
                self.importers[name] = f.f_globals.get("__name__")
        return None

    def invalidate_caches(self):
        return None


def _top_of(filename: str, prefixes: list[tuple[str, str]], cache: dict) -> str | None:
    """The top-level package a code file belongs to: ``vllm``, ``tests``, a site-packages
    top-level name, ``<stdlib>`` / ``<frozen>``, or ``None`` when outside every root."""
    top = cache.get(filename)
    if top is not None or filename in cache:
        return top
    top = None
    if filename.startswith("<frozen"):
        top = "<frozen>"
    else:
        for prefix, kind in prefixes:
            if filename.startswith(prefix):
                rest = filename[len(prefix):]
                first = rest.split(os.sep, 1)[0]
                if kind == "site":
                    top = first[:-3] if first.endswith(".py") else first.split(".", 1)[0]
                else:
                    top = kind if kind != "tree" else first[:-3] if first.endswith(".py") else first
                break
    cache[filename] = top
    return top


def install(out_dir: str, roots: list[str], calls: bool = False) -> None:
    """Start tracing this process; the record is written to ``out_dir`` at exit."""
    global _STATE
    if _STATE is not None:
        return
    probed: set = set()
    opened: set = set()
    listed: set = set()
    imported: dict = {}
    importers: dict = {}
    roots = [os.path.realpath(r) for r in roots if r]
    state = {"probed": probed, "opened": opened, "listed": listed, "imported": imported,
             "calls": {}, "importers": importers, "out_dir": out_dir, "roots": roots, "argv": list(sys.argv)}
    _STATE = state
    sys.meta_path.insert(0, _Recorder(probed, importers))

    def audit(event, args):
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, str) and (mode is None or "r" in str(mode) or mode == "rb"):
                opened.add(path)
        elif event in ("os.listdir", "os.scandir"):
            path = args[0]
            if isinstance(path, str):
                listed.add(path)
        elif event == "ctypes.dlopen":
            if isinstance(args[0], str):
                opened.add(args[0])
        elif event == "import":
            name = args[0]
            if name not in imported:
                imported[name] = None

    sys.addaudithook(audit)
    _record_metadata_lookups(state)
    if calls:
        _install_call_profile(state)
    atexit.register(write)


def _record_metadata_lookups(state: dict) -> None:
    """Record the names passed to ``importlib.metadata`` lookups by name (``version``,
    ``distribution``, ``metadata``...), all of which go through ``Distribution.from_name``:
    a distribution looked up by name must look the same in a slice environment."""
    import importlib.metadata as md

    names: dict = {}
    state["metadata"] = names
    original = md.Distribution.from_name.__func__

    def from_name(cls, name, *args, **kwargs):
        try:
            dist = original(cls, name, *args, **kwargs)
        except Exception:
            names.setdefault(name, False)
            raise
        names[name] = True
        return dist

    md.Distribution.from_name = classmethod(from_name)


def _install_call_profile(state: dict) -> None:
    """Record calls into site-packages code from frames outside the callee's package."""
    import sysconfig

    site = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            site.append(os.path.realpath(p) + os.sep)
    prefixes = [(p, "site") for p in dict.fromkeys(site)]
    prefixes += [(os.path.realpath(r) + os.sep, "tree") for r in state["roots"]
                 if not any(os.path.realpath(r) + os.sep == p for p, _ in prefixes)]
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
    prefixes.append((stdlib, "<stdlib>"))
    calls: dict = state["calls"]
    cache: dict = {}
    c_tops: dict = {}

    def prof(frame, event, arg):
        if event == "c_call":
            # a C function of a third-party extension called from Python code outside it
            mod = getattr(arg, "__module__", None)
            if not isinstance(mod, str):
                owner = getattr(arg, "__self__", None)
                mod = getattr(owner, "__name__", None) if type(owner).__name__ == "module" \
                    else getattr(type(owner), "__module__", None)
            if not isinstance(mod, str) or mod in sys.builtin_module_names:
                return
            callee = c_tops.get(mod)
            if callee is None:
                m = sys.modules.get(mod.split(".", 1)[0])
                f = getattr(m, "__file__", None) or ""
                callee = c_tops[mod] = _top_of(f, prefixes, cache) or "<none>"
            if callee.startswith("<"):
                return
            caller = _top_of(frame.f_code.co_filename, prefixes, cache)
            if caller == callee or caller == "<frozen>":
                return
            row = calls.setdefault(callee, {})
            key = caller or "<other>"
            row[key] = row.get(key, 0) + 1
            return
        if event != "call":
            return
        code = frame.f_code
        callee = _top_of(code.co_filename, prefixes, cache)
        if callee is None or callee.startswith("<"):
            return
        back = frame.f_back
        if back is None:
            return
        caller = _top_of(back.f_code.co_filename, prefixes, cache)
        if caller == callee or caller == "<frozen>":
            return
        if code.co_name == "<module>":
            return
        row = calls.get(callee)
        if row is None:
            row = calls[callee] = {}
        key = caller or "<other>"
        row[key] = row.get(key, 0) + 1

    sys.setprofile(prof)
    threading.setprofile(prof)


def write() -> None:
    """Write this process's record (called at exit; safe to call twice)."""
    state = _STATE
    if state is None or state.get("written"):
        return
    state["written"] = True
    sys.setprofile(None)
    modules = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        modules[name] = f if isinstance(f, str) else None
    for name in state["imported"]:
        modules.setdefault(name, None)
    roots = state["roots"]

    def under(p: str) -> bool:
        try:
            rp = os.path.realpath(p)
        except (OSError, ValueError):
            return False
        return any(rp == r or rp.startswith(r + os.sep) for r in roots)

    record = {
        "pid": os.getpid(),
        "argv": state["argv"],
        "executable": sys.executable,
        "modules": modules,
        "probed": sorted(state["probed"]),
        "opened": sorted(os.path.realpath(p) for p in state["opened"] if under(p)),
        "listed": sorted(os.path.realpath(p) for p in state["listed"] if under(p)),
        "calls": state["calls"],
        "importers": state["importers"],
        "metadata": state.get("metadata", {}),
        "format": TRACE_FORMAT,
    }
    os.makedirs(state["out_dir"], exist_ok=True)
    path = os.path.join(state["out_dir"], f"trace.{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def install_from_environment() -> None:
    """Called by the generated ``sitecustomize``: trace if ``VLLM_REPRO_TRACE_DIR`` is set."""
    out = os.environ.get("VLLM_REPRO_TRACE_DIR")
    if not out:
        return
    roots = [r for r in os.environ.get("VLLM_REPRO_TRACE_ROOTS", "").split(os.pathsep) if r]
    install(out, roots, calls=os.environ.get("VLLM_REPRO_TRACE_CALLS") == "1")
