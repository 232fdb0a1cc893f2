"""Run-time support of a materialised slice (standard library only).

Copied into the root of every slice tree as ``_vllm_slice.py`` and imported at interpreter start
(the slice's ``sitecustomize.py``, or the engine worker), next to ``_vllm_slice.json``, which
names the release, the ``vllm.*`` modules of the release left out of the slice, and the stubbed
third-party packages. It does two things:

- a meta-path finder, last on ``sys.meta_path``, so that importing a module of the release that
  the slice left out raises ``ModuleNotFoundError: vllm.x.y is not in the slice of vLLM 0.N;
  re-slice with --include vllm.x.y`` instead of a bare "No module named";
- stubs for the third-party packages that the traced scheduling paths import only at module
  level and never use: ``import openai.types.chat`` and ``from openai import X`` work, classes
  can be subclassed and used in annotations, but calling, instantiating or validating anything
  raises :class:`SliceStubError`, naming the slice and the package.

Every such event is kept in :data:`EVENTS` (``{"kind": "missing" | "stub", "name": ...,
"package": ...}``): a run that met one left the traced paths, so the lab reports it as its own
failure, never as vLLM's outcome (``vllm_repro.engine.run.run_scenario``). When
``VLLM_REPRO_SLICE_LOG`` is set, each is also appended to that file as one JSON line: the
slicer's verification runs use it to find a stub that something did use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
try:
    with open(os.path.join(_HERE, "_vllm_slice.json")) as _f:
        SLICE = json.load(_f)
except OSError:  # pragma: no cover - a broken slice tree
    SLICE = {"vllm": "?", "absent": [], "stubs": {}}
VERSION = SLICE.get("vllm", "?")
ABSENT = frozenset(SLICE.get("absent", ()))
#: top-level import name -> {"distribution": name, "version": as traced}
STUBS = dict(SLICE.get("stubs", {}))


#: every event of this process, oldest first (what the engine worker checks after a run)
EVENTS: list = []


def _log(kind: str, name: str, package: str | None = None) -> None:
    EVENTS.append({"kind": kind, "name": name, "package": package})
    path = os.environ.get("VLLM_REPRO_SLICE_LOG")
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "name": name, "package": package,
                                "pid": os.getpid()}) + "\n")
    except OSError:
        pass


def missing_message(name: str) -> str:
    return (f"{name} is not in the slice of vLLM {VERSION}; "
            f"re-slice with --include {name}")


class SliceStubError(RuntimeError):
    """Something real was asked of a stubbed third-party package."""


def _stub_error(what: str, package: str) -> SliceStubError:
    dist = STUBS.get(package.split(".", 1)[0], {}).get("distribution", package)
    _log("stub", what, dist)
    return SliceStubError(
        f"{what} was used, but {package.split('.', 1)[0]!r} (distribution {dist!r}) is a stub "
        f"in the slice of vLLM {VERSION}: the traced scheduling paths only import it. "
        f"Run on the full tree (--tree full) or re-slice with a trace that covers this path.")


class _StubMeta(type):
    """Metaclass of stub classes: usable in annotations, unions, subscripts and as a base
    class; calling one (instantiating it or a subclass) or setting or deleting an item of one
    raises :class:`SliceStubError`."""

    def __call__(cls, *args, **kwargs):
        # a subclass defined by vLLM names the stubbed base it inherits from
        origin = cls.__dict__.get("_stub_module") or cls._stub_module
        what = f"{cls.__module__}.{cls.__qualname__}()"
        if origin != cls.__module__:
            what += f" (a subclass of {origin}.{cls._stub_qualname})"
        raise _stub_error(what, origin)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item):
        return cls

    def __setitem__(cls, key, value):
        # registering into a stub's table at import time (lmformatenforcer does
        # ``yaml.SafeLoader.yaml_constructors[tag] = f``): a use, which the slicer must see
        raise _stub_error(f"setting an item of {cls.__module__}.{cls.__qualname__}",
                          cls._stub_module or cls.__module__)

    def __delitem__(cls, key):
        raise _stub_error(f"deleting an item of {cls.__module__}.{cls.__qualname__}",
                          cls._stub_module or cls.__module__)

    def __or__(cls, other):
        import typing
        return typing.Union[cls, other]

    def __ror__(cls, other):
        import typing
        return typing.Union[other, cls]

    def __repr__(cls):
        return f"<stub {cls.__module__}.{cls.__qualname__} (slice of vLLM {VERSION})>"


class _StubBase(metaclass=_StubMeta):
    _stub_module = ""
    _stub_qualname = ""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # pydantic fields typed with a stub
        from pydantic_core import core_schema

        def refuse(value):
            raise _stub_error(f"validating a value as {cls.__module__}.{cls.__qualname__}",
                              cls.__module__)

        return core_schema.no_info_plain_validator_function(refuse)


def _stub_class(qualname: str, module: str) -> type:
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (_StubBase,),
                    {"__module__": module, "_stub_module": module, "_stub_qualname": qualname})
    cls.__qualname__ = qualname
    return cls


class StubModule(types.ModuleType):
    """A stubbed module: any public attribute is a stub class (created on first access)."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"{self.__name__}.{name}: {self.__name__.split('.')[0]!r} is "
                                 f"a stub in the slice of vLLM {VERSION}")
        cls = _stub_class(name, self.__name__)
        setattr(self, name, cls)
        return cls


def stub_module(name: str, file: str | None = None) -> StubModule:
    """Make ``name`` a stub (called by the stub package's ``__init__``); returns the module."""
    mod = StubModule(name)
    mod.__file__ = file or os.path.join(_HERE, *name.split("."), "__init__.py")
    mod.__path__ = []
    mod.__all__ = []
    mod.__package__ = name
    if "." not in name and name in STUBS:
        # the version the trace saw: packages that check it (transformers' is_*_available)
        # decide exactly as they did on the full environment
        mod.__version__ = STUBS[name].get("version")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, _SliceFinder.instance, is_package=True)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


class _SliceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: stub submodules, and a clear error for sliced-out modules."""

    instance: "_SliceFinder"

    def find_spec(self, name, path=None, target=None):
        top = name.split(".", 1)[0]
        if top in STUBS and "." in name:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name in ABSENT:
            _log("missing", name)
            raise ModuleNotFoundError(missing_message(name), name=name)
        return None

    def create_module(self, spec):
        return stub_module(spec.name)

    def exec_module(self, module):
        return None


_SliceFinder.instance = _SliceFinder()


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _SliceFinder) for f in sys.meta_path):
        sys.meta_path.append(_SliceFinder.instance)


install()
