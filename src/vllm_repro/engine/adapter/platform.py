"""The platform vLLM sees: the deployment's (CUDA by default), emulated at vLLM's platform seam.

vLLM reads every device rule through ``vllm.platforms.current_platform`` (block sizes, async
scheduling, spec-decode methods, structured-output support, config defaults in
``check_and_update_config``). The lab runs on a CPU, but the crash it reproduces happened under a
GPU platform, whose rules differ (the CPU platform refuses ``block_size: 32``, turns async
scheduling off, calls CPU-only torch hooks at import). So the worker sets
``vllm.platforms._current_platform`` (the module global its ``__getattr__`` resolves once, in
``vllm/platforms/__init__.py``) before anything else reads it, to an instance of a subclass of the
release's own platform class (``NonNvmlCudaPlatform`` where it exists, else ``CudaPlatform``, from
``vllm/platforms/cuda.py``). vLLM's own ``check_and_update_config`` and every other platform rule
then run as on the GPU; only what a GPU runtime would *report* is answered here:

==========================  ============================================================
hook (vLLM's name)          emulated answer
==========================  ============================================================
get_device_capability       the scenario's ``platform.capability`` (``"9.0"`` by default)
has_device_capability       from that capability (the base class compares it)
get_device_name / uuid      ``platform.device_name`` / a fixed fake UUID
get_device_total_memory     ``platform.total_memory_gib`` GiB
device_count                the devices the run's topology asks for (:func:`set_device_count`:
                            ``tensor_parallel_size x pipeline_parallel_size x
                            data_parallel_size_local``, 1 by default), each one as above
is_fully_connected          True
get_current_memory_usage    0
set_device, import_kernels  nothing (no CUDA runtime, no compiled kernels: the GPU's work
                            is the fake model runner's)
log_warnings                nothing (it queries NVML)
==========================  ============================================================

The release's compiled extension modules (``vllm._C`` and the like, which ``cuda.py`` imports at
module level) are not in an sdist, nor is NVML's ``pynvml``: under the CUDA platform a last finder
on ``sys.meta_path`` (:class:`ExtensionStandIns`) makes each one an empty module, by the shape of
its name, not by a list per release; an installed full vLLM's real extension that cannot load
only for want of the GPU driver (the CUDA image without ``--gpus``) becomes the same stand-in
(:class:`_DriverlessExtension`). The kernels' capability queries that vLLM calls at import
(``torch.ops._C.cutlass_scaled_mm_supports_fp8(capability)`` ...) answer ``False``: this build
has no such kernel (:func:`answer_kernel_queries`). The CPU
platform stays available (``platform: {name: cpu}``), as vLLM's own ``CpuPlatform``.

The platform is chosen per worker process (modules bind ``current_platform`` when they are
imported), from ``VLLM_REPRO_PLATFORM`` (JSON, written by the host from the scenario's
``platform:``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import types
from typing import Any

#: the scenario's ``platform:`` when it says nothing: the deployment the lab stands in for
DEFAULT_PLATFORM = {"name": "cuda", "capability": "9.0", "device_name": "NVIDIA H100 80GB HBM3",
                    "total_memory_gib": 80}
ENV_VAR = "VLLM_REPRO_PLATFORM"


class PlatformError(RuntimeError):
    """The platform the scenario names cannot be set up in this release (the host reports it as
    the release refusing the scenario: exit 2)."""


def requested() -> dict[str, Any]:
    """The platform this worker presents, from ``VLLM_REPRO_PLATFORM`` (JSON; unset: the
    default, CUDA 9.0). Raises :class:`PlatformError` for JSON that is not an object."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return dict(DEFAULT_PLATFORM)
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise PlatformError(f"{ENV_VAR} is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise PlatformError(f"{ENV_VAR} must be a JSON object")
    return {**DEFAULT_PLATFORM, **spec} if spec.get("name", "cuda") == "cuda" else spec


#: a compiled extension of vLLM's build (``vllm._C``, ``vllm._moe_C``, ``vllm._C_stable_libtorch``,
#: ``vllm.vllm_flash_attn._vllm_fa2_C`` ...): a module named ``_..._C`` or ``_C_...`` that an sdist
#: has no source for
_EXTENSION = re.compile(r"^_(?:\w*_)?C(?:_\w*)?$")
#: modules a GPU runtime's packages provide that an sdist's CPU requirements lack
_RUNTIME_MODULES = ("pynvml",)


def _gpu_only(module: str, name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is a GPU kernel of vLLM's CUDA build; the lab has none "
                           "(the GPU's work is the fake model runner's)")
    call.__name__ = call.__qualname__ = name
    return call


class _GpuOnlyNames:
    """A name imported from a stood-in extension (``from vllm._C import ops``, 0.4.0 and 0.4.1):
    any attribute is a GPU-only callable (raises when called)."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _gpu_only(self._module, name)


class _StandIn(importlib.abc.Loader):
    def __init__(self, package: bool = False, names: bool = False):
        self.package = package
        self.names = names

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        if self.names and not self.package:  # names imported from it: GPU-only namespaces
            def __getattr__(name, _module=spec.name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _GpuOnlyNames(f"{_module}.{name}")

            mod.__getattr__ = __getattr__
        if self.package:  # a build product's package: any name in it is a GPU-only callable
            mod.__path__ = []

            def __getattr__(name, _module=spec.name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return _gpu_only(_module, name)

            mod.__getattr__ = __getattr__
        mod.__file__ = f"<vllm-repro stand-in for {spec.name}>"
        mod.__doc__ = ("vllm-repro: an empty stand-in for a compiled extension or GPU runtime "
                       "module, absent from the sdist (the GPU's work is the fake model runner's)")
        if spec.name == "pynvml":
            def _no_nvml(*a, **k):
                raise RuntimeError("NVML is not available (vllm-repro emulates the platform)")
            mod.nvmlInit = _no_nvml
            mod.nvmlShutdown = lambda *a, **k: None
        return mod

    def exec_module(self, module):
        STOOD_IN.append(module.__name__)


class ExtensionStandIns(importlib.abc.MetaPathFinder):
    """A last finder on ``sys.meta_path``: a vLLM compiled extension (:data:`_EXTENSION`) or a GPU
    runtime module (:data:`_RUNTIME_MODULES`) no other finder found becomes an empty module, so
    that vLLM's CUDA import paths (``vllm/platforms/cuda.py``, the flash-attention wrapper's
    availability checks) import as on a GPU build. Real modules always win: it is asked last.
    With ``names`` (releases without ``vllm/platforms``, whose layers import names from the
    extension at module level: ``from vllm._C import ops``), any name of an extension is a
    namespace of GPU-only callables (:class:`_GpuOnlyNames`)."""

    def __init__(self, names: bool = False):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        last = fullname.rpartition(".")[2]
        if fullname.startswith("vllm.") and _EXTENSION.match(last):
            return importlib.machinery.ModuleSpec(fullname, _StandIn(names=self.names))
        if fullname in _RUNTIME_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _StandIn())
        return None


#: an extension's load error when the machine has no GPU driver (libcuda.so.1 is the driver's,
#: mounted into a container by the NVIDIA runtime only with ``--gpus``)
_NO_DRIVER = re.compile(r"\blibcuda\.so(\.\d+)*: cannot open shared object file")


class _DriverlessExtension(importlib.abc.Loader):
    """The loader of a *real* compiled extension of an installed full vLLM (the CUDA image):
    loaded as it is where the GPU driver is present; on a machine without it (that image run
    without ``--gpus``: the shared suite's CPU-level tests) the load fails only for want of
    ``libcuda.so.1``, and the module becomes the stand-in the sdist's absent extension is, and
    says so in :data:`STOOD_IN`. Any other load error stands."""

    def __init__(self, real: importlib.machinery.ModuleSpec):
        self.real = real

    def create_module(self, spec):
        try:
            return self.real.loader.create_module(self.real)
        except ImportError as exc:
            if not _NO_DRIVER.search(str(exc)):
                raise
            return _StandIn().create_module(spec)

    def exec_module(self, module):
        if str(getattr(module, "__file__", "")).startswith("<vllm-repro stand-in"):
            STOOD_IN.append(f"{module.__name__} (no GPU driver here)")
        else:
            self.real.loader.exec_module(module)


class BuildProductStandIns(importlib.abc.MetaPathFinder):
    """A first finder on ``sys.meta_path``: a vLLM sub-package that the CUDA build copies in
    (``vllm/vllm_flash_attn``, from the vllm-flash-attn project) is an empty folder in some
    sdists, which Python would import as a namespace package with none of its names. Such a
    folder (no Python file in it) becomes a stand-in package whose names are GPU-only callables
    (they raise when called). A folder with Python sources is left to the normal finders."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("vllm.") or path is None:
            return None
        last = fullname.rpartition(".")[2]
        if _EXTENSION.match(last):  # a real extension (installed vLLM) may need the GPU driver
            real = importlib.machinery.PathFinder.find_spec(fullname, path)
            if real is not None and isinstance(real.loader, importlib.machinery.ExtensionFileLoader):
                return importlib.machinery.ModuleSpec(fullname, _DriverlessExtension(real),
                                                      origin=real.origin)
            return None
        for entry in path:
            d = os.path.join(entry, last)
            if os.path.isfile(d + ".py") or os.path.isfile(os.path.join(d, "__init__.py")):
                return None
            if os.path.isdir(d):
                try:
                    if not any(n.endswith((".py", ".so")) for n in os.listdir(d)):
                        return importlib.machinery.ModuleSpec(fullname, _StandIn(package=True),
                                                              is_package=True)
                except OSError:
                    return None
        return None


#: the stand-ins made in this process, in order (the hello reports them)
STOOD_IN: list[str] = []


def _install_finder(names: bool = False) -> None:
    found = [f for f in sys.meta_path if isinstance(f, ExtensionStandIns)]
    if not found:
        sys.meta_path.append(ExtensionStandIns(names=names))
        sys.meta_path.insert(0, BuildProductStandIns())
    elif names:
        found[0].names = True


def before_import_without_platforms(vllm_roots) -> bool:
    """Called before ``import vllm`` of a tree with no ``vllm/platforms`` folder (any of
    ``vllm_roots``, the package's search locations; 0.4.x to 0.5.0.post1): under the requested
    ``cuda`` platform the stand-in finder goes in first, names included, since those releases
    import their compiled extension at module level (``from vllm._C import ops``: 0.4.0's
    ``vllm/model_executor/layers/activation.py``, 0.4.1's ``quantization/aqlm.py``; later ones
    through ``vllm/_custom_ops.py``, which tolerates its absence). Returns whether it did; a
    tree with ``vllm/platforms`` is left to :func:`install_eager` after the import."""
    if any(os.path.isdir(os.path.join(r, "platforms")) for r in vllm_roots):
        return False
    if str(requested().get("name", "cuda")) != "cuda":
        return False
    _install_finder(names=True)
    return True


def _import(module: str) -> types.ModuleType:
    """``import module``; raises :class:`PlatformError` naming what failed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PlatformError(f"importing {module} failed: {exc}") from exc


#: a kernel capability query of vLLM's compiled ops, called through ``vllm/_custom_ops.py``
_KERNEL_QUERY = re.compile(r"torch\.ops\.(_C\w*)\.(\w*_supports_\w+|\w+_supported)\(")


def answer_kernel_queries(vllm_dir) -> list[str]:
    """Make each boolean kernel-capability query that the release's ``vllm/_custom_ops.py``
    calls (``torch.ops._C.cutlass_scaled_mm_supports_fp8(capability)``, ``..._supported(...)``;
    found in that file's source) answer ``False`` where the op is not registered: a build
    without that kernel, which is what the lab is. Returns the ``namespace.op`` names answered.
    Some releases call them at import (``w8a8_utils.CUTLASS_FP8_SUPPORTED``)."""
    from pathlib import Path

    import torch

    try:
        text = (Path(vllm_dir) / "_custom_ops.py").read_text(errors="replace")
    except OSError:
        return []
    answered = []
    for ns_name, op in sorted(set(_KERNEL_QUERY.findall(text))):
        ns = getattr(torch.ops, ns_name)
        try:
            getattr(ns, op)
            continue  # a real registration wins
        except (AttributeError, RuntimeError):
            pass
        setattr(ns, op, lambda *a, **k: False)
        answered.append(f"{ns_name}.{op}")
    return answered


#: how many devices the emulated platform reports (:func:`set_device_count`)
_DEVICES = [1]
#: the most devices a run may ask for (a bound on a user-given count: every rank of the
#: multi-process executor is a process of this machine)
from ..topology import MAX_WORLD_SIZE as MAX_DEVICES  # noqa: E402


def set_device_count(n: int) -> int:
    """Make the emulated platform's ``device_count()`` answer ``n`` (1 to :data:`MAX_DEVICES`):
    the GPUs of the host the run stands in for, as many as its ``tensor_parallel_size x
    pipeline_parallel_size x data_parallel_size_local`` ask, each with the scenario's
    ``platform:`` memory and capability, so that vLLM's own checks (``ParallelConfig``'s "World
    size (N) is larger than the number of available GPUs") pass as on that host. Returns the
    previous count. Raises :class:`PlatformError` outside the bounds."""
    n = int(n)
    if not 1 <= n <= MAX_DEVICES:
        raise PlatformError(f"{n} devices: the lab emulates 1 to {MAX_DEVICES} GPUs (one rank "
                            "process each); lower tensor/pipeline/data_parallel_size")
    before, _DEVICES[0] = _DEVICES[0], n
    return before


def device_count() -> int:
    """What the emulated platform's ``device_count()`` answers now."""
    return _DEVICES[0]


def _capability(text: str) -> tuple[int, int]:
    try:
        major, _, minor = str(text).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        raise PlatformError(f"platform.capability {text!r} is not MAJOR.MINOR (e.g. \"9.0\")") from None


def emulated_cuda(spec: dict[str, Any]):
    """An instance of a subclass of the release's CUDA platform class answering the hooks in
    the module docstring from ``spec``. Raises :class:`PlatformError` when the release has no
    CUDA platform module or class."""
    cuda = _import("vllm.platforms.cuda")
    base = getattr(cuda, "NonNvmlCudaPlatform", None) or getattr(cuda, "CudaPlatform", None)
    if base is None:
        raise PlatformError("vllm/platforms/cuda.py has no CudaPlatform class")
    iface = sys.modules["vllm.platforms.interface"]
    # releases before DeviceCapability (0.6.1) answer a (major, minor) tuple
    DeviceCapability = getattr(iface, "DeviceCapability", lambda major, minor: (major, minor))
    major, minor = _capability(spec.get("capability", "9.0"))
    name = str(spec.get("device_name") or DEFAULT_PLATFORM["device_name"])
    memory = int(float(spec.get("total_memory_gib") or 80) * (1 << 30))

    def _cm(fn):
        return classmethod(fn)

    attrs = {
        "__doc__": "vllm-repro: the release's CUDA platform with a GPU runtime's answers emulated",
        "__module__": __name__,
        "get_device_capability": _cm(lambda cls, device_id=0: DeviceCapability(major, minor)),
        "get_device_name": _cm(lambda cls, device_id=0: name),
        "get_device_uuid": _cm(lambda cls, device_id=0: "GPU-00000000-0000-0000-0000-vllmrepro000"),
        "get_device_total_memory": _cm(lambda cls, device_id=0: memory),
        "device_count": _cm(lambda cls: device_count()),
        "is_fully_connected": _cm(lambda cls, *a, **k: True),
        "get_current_memory_usage": _cm(lambda cls, *a, **k: 0.0),
        "set_device": _cm(lambda cls, *a, **k: None),
        "import_kernels": _cm(lambda cls, *a, **k: None),
        "log_warnings": _cm(lambda cls, *a, **k: None),
    }
    # only hooks the release's class has (an old release without device_count keeps its shape)
    keep = {k: v for k, v in attrs.items() if k.startswith("__") or hasattr(base, k)}
    return type(f"Emulated{base.__name__}", (base,), keep)()


def install(notes: list[str]) -> str:
    """Set ``vllm.platforms._current_platform`` to the requested platform (see the module
    docstring) before vLLM's other modules read it; returns what was installed, e.g.
    ``"cuda 9.0 (emulated NonNvmlCudaPlatform)"``. ``notes`` gets a line where the release
    already resolved its platform. Raises :class:`PlatformError` for a platform the release
    does not have."""
    spec = requested()
    want = str(spec.get("name", "cuda"))
    if want == "cuda":
        _install_finder()
    platforms = _import("vllm.platforms")
    if want == "cuda":
        # vllm/platforms/__init__.py -> vllm/
        answer_kernel_queries(os.path.dirname(os.path.dirname(platforms.__file__)))
    if getattr(platforms, "_current_platform", None) is not None:
        notes.append(f"vllm.platforms already resolved {type(platforms._current_platform).__name__} "
                     "before the lab set the platform")
    if want == "cuda":
        platform = emulated_cuda(spec)
        label = f"cuda {spec.get('capability')} (emulated {type(platform).__mro__[1].__name__})"
    elif want == "cpu":
        cpu = _import("vllm.platforms.cpu")
        platform = cpu.CpuPlatform()
        label = "cpu (vLLM's CpuPlatform)"
    else:
        raise PlatformError(f"platform.name {want!r}: the lab emulates cuda, or runs vLLM's cpu "
                            "platform; use one of them")
    platforms._current_platform = platform
    return label


def emulate_nvml(spec: dict[str, Any]) -> bool:
    """Give the lab's ``pynvml`` stand-in NVML's answers for one GPU of ``spec`` (init,
    shutdown, device count 1, handle, CUDA capability, name, memory), for releases whose
    ``vllm/platforms/cuda.py`` queries NVML at import (0.6.x: ``warn_if_different_devices()``).
    Returns False (and changes nothing) when ``pynvml`` is a real module."""
    mod = sys.modules.get("pynvml")
    if mod is None:
        try:
            mod = importlib.import_module("pynvml")
        except ImportError:
            return False
    if not str(getattr(mod, "__file__", "")).startswith("<vllm-repro stand-in"):
        return False
    major, minor = _capability(spec.get("capability", "9.0"))
    name = str(spec.get("device_name") or DEFAULT_PLATFORM["device_name"])
    memory = int(float(spec.get("total_memory_gib") or 80) * (1 << 30))
    mod.nvmlInit = lambda *a, **k: None
    mod.nvmlShutdown = lambda *a, **k: None
    mod.nvmlDeviceGetCount = lambda: device_count()
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (major, minor)
    mod.nvmlDeviceGetName = lambda h: name
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=memory, free=memory, used=0)
    return True


def install_eager(notes: list[str]) -> str:
    """The platform for a release whose ``vllm/platforms/__init__.py`` resolves
    ``current_platform`` eagerly at import (an instance every module then binds by name, e.g.
    0.6.x, where the tree's ``+cpu`` dist-info makes it ``CpuPlatform``), and for releases with
    the lazy ``_current_platform`` (then as :func:`install`). For ``cuda`` the instance vLLM
    already handed out is given the emulated CUDA class of :func:`eager_cuda_swap` for good
    (``__class__`` assignment: every module holding it sees the GPU's rules). Called after
    ``import vllm``, so that the stand-in finder does not make ``vllm._core_C`` look importable
    to ``vllm/_core_ext.py``. Raises :class:`PlatformError` as :func:`install` does. A release
    without ``vllm/platforms`` (before 0.5.1) goes to :func:`install_platformless`."""
    import importlib.util

    if "vllm.platforms" not in sys.modules and importlib.util.find_spec("vllm.platforms") is None:
        return install_platformless(notes)
    platforms = _import("vllm.platforms")
    if "_current_platform" in vars(platforms) or "current_platform" not in vars(platforms):
        return install(notes)
    spec = requested()
    want = str(spec.get("name", "cuda"))
    current = platforms.current_platform
    if want == "cpu":
        if type(current).__name__ != "CpuPlatform":
            raise PlatformError(f"platform.name cpu: vLLM resolved {type(current).__name__} at "
                                "import; the lab cannot change it on this release")
        return "cpu (vLLM's CpuPlatform)"
    if want != "cuda":
        raise PlatformError(f"platform.name {want!r}: the lab emulates cuda, or runs vLLM's cpu "
                            "platform; use one of them")
    swap = eager_cuda_swap(notes, lasting="", over_cuda=True)
    if swap is not None:  # None: the instance already has the emulated class
        instance, cls = swap
        instance.__class__ = cls
    if _answer_is_cpu_false():
        notes.append("vllm.utils.is_cpu read the tree's +cpu dist-info version; the lab answers "
                     "False, as a CUDA build's version does (DeviceConfig picks cuda)")
    return f"cuda {spec.get('capability')} (emulated {type(current).__mro__[1].__name__})"


def install_platformless(notes: list[str]) -> str:
    """The platform for a release with no ``vllm/platforms`` package (0.4.x to 0.5.0.post1): its
    device rules are ``vllm.utils`` functions (``is_cpu``, ``is_hip``, ``is_neuron``...) and
    ``torch.cuda`` calls where they are made. For ``cuda``, as :func:`install_eager` does
    without the platform class: the stand-in finder for the compiled extensions, the kernel
    capability queries answered ``False``, and ``vllm.utils.is_cpu`` answering ``False`` as a
    CUDA build's version does (so ``DeviceConfig(device="auto")`` is ``cuda``). For ``cpu``:
    what ``is_cpu`` answers from the tree's ``+cpu`` dist-info (vLLM's CPU build). Raises
    :class:`PlatformError` for another name, or ``cpu`` where the tree does not answer CPU."""
    spec = requested()
    want = str(spec.get("name", "cuda"))
    vllm_dir = os.path.dirname(sys.modules["vllm"].__file__) if "vllm" in sys.modules else None
    if want == "cpu":
        utils = _import("vllm.utils")
        if not getattr(utils, "is_cpu", lambda: False)():
            raise PlatformError("platform.name cpu: this release has no vllm/platforms and its "
                                "vllm.utils.is_cpu does not answer True; use cuda")
        return "cpu (no vllm/platforms: vllm.utils.is_cpu from the tree's +cpu dist-info)"
    if want != "cuda":
        raise PlatformError(f"platform.name {want!r}: the lab emulates cuda, or runs vLLM's cpu "
                            "platform; use one of them")
    _install_finder(names=True)
    if vllm_dir:
        answer_kernel_queries(vllm_dir)
    _import("vllm.utils")
    notes.append("no vllm/platforms in this release: the device rules are vllm.utils' and "
                 "torch.cuda's where vLLM calls them")
    if _answer_is_cpu_false():
        notes.append("vllm.utils.is_cpu read the tree's +cpu dist-info version; the lab answers "
                     "False, as a CUDA build's version does (DeviceConfig picks cuda)")
    return "cuda (no vllm/platforms; vllm.utils.is_cpu answers False)"


def eager_cuda_swap(notes: list[str], *, lasting: str = " while a V0 run lasts",
                    over_cuda: bool = False):
    """For a release that resolves ``current_platform`` at import (``vllm/platforms/__init__.py``
    binds an instance, e.g. a ``CpuPlatform`` from the tree's ``+cpu`` dist-info):
    ``(instance, emulated CUDA class)``, the class (:func:`emulated_cuda`) to assign to the
    instance's ``__class__``. NVML is emulated first (:func:`emulate_nvml`: the release's
    ``cuda.py`` queries it at import), with the stand-in finder and the kernel queries
    (:func:`answer_kernel_queries`) in place. ``notes`` gets a line naming both classes and
    ``lasting`` (how long the swap holds). Used for a V0 run of 0.6.5 to 0.6.6.post1 (which
    also have a V1 engine, whose :func:`install` set the lazy ``_current_platform`` instead):
    assigned while the run lasts (``engine/v0.py``'s ``V0Adapter.platform_scope``); and by
    :func:`install_eager`, for good. None where there is nothing to swap: a lazy release,
    ``platform.name`` other than ``cuda``, an instance already of the emulated class, or, unless
    ``over_cuda``, a CUDA instance (an installed full vLLM's own)."""
    platforms = _import("vllm.platforms")
    current = vars(platforms).get("current_platform")
    spec = requested()
    if current is None or str(spec.get("name", "cuda")) != "cuda":
        return None
    if type(current).__module__ == __name__ or (not over_cuda and "Cuda" in type(current).__name__):
        return None
    _install_finder()
    emulate_nvml(spec)
    answer_kernel_queries(os.path.dirname(os.path.dirname(platforms.__file__)))
    platform = emulated_cuda(spec)
    notes.append(f"vllm.platforms resolved {type(current).__name__} at import; the lab gives that "
                 f"instance the class {type(platform).__name__}{lasting}")
    return current, type(platform)


def _answer_is_cpu_false() -> bool:
    """0.6.1.x and earlier decide the device type (``DeviceConfig(device="auto")``,
    ``vllm/config.py``) with ``vllm.utils.is_cpu``, which reads the installed dist's version
    (``"cpu" in version("vllm")``): the lab's sdist build is ``+cpu``, a CUDA wheel's is not. On
    the emulated CUDA platform the function (lru-cached; every module binds the same object)
    answers ``False``, what the GPU build answers. Returns whether the tree has that function."""
    utils = sys.modules.get("vllm.utils")
    fn = getattr(utils, "is_cpu", None)
    inner = getattr(fn, "__wrapped__", fn)
    code = getattr(inner, "__code__", None)
    if code is None or "version" not in code.co_names:
        return False

    def _gpu_build() -> bool:
        return False

    inner.__code__ = _gpu_build.__code__
    if hasattr(fn, "cache_clear"):
        fn.cache_clear()
    return True
